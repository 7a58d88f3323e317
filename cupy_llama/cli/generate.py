"""`cupy-llama generate`: a batch file of prompts (batch_io.py) run as one batch, with
progress, Ctrl-C and --resume."""
from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import click

from ..errors import OptionError, RequestError, check_output_path
from ..util import counted
from . import options
from .options import (ENGINE_NAMES, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, MODEL_PATH,
                      PROGRESS_INTERVAL_S, SAMPLING_NAMES, check_options, device_option,
                      engine_options, given, log, sampling_options)


@options.command(stray_hint="generate takes the model as --model PATH and the prompts as "
                            "--input FILE")
@click.option("--model", "model_dir", type=MODEL_PATH,
              help="Model directory (Hugging Face layout). Default: the demo model, built "
                   "on first use.")
@click.option("--input", "input_path", required=True,
              type=click.Path(exists=True, dir_okay=False, allow_dash=True),
              help="Requests: a .txt or .jsonl file, or - for stdin (with --format).")
@click.option("--output", "output_path", default="-", show_default=True,
              type=click.Path(dir_okay=False, allow_dash=True), help="Where the JSONL goes.")
@click.option("--format", "input_format", type=click.Choice(["txt", "jsonl"]),
              help="Input format (default: from the file name).")
@click.option("--raw", is_flag=True, help="Send .txt lines to the model as plain text, not as "
              "user messages through its chat template.")
@device_option
@sampling_options
@click.option("--stop", multiple=True, help="A stop string (repeatable); not included in "
              "the text.")
@click.option("--ignore-eos", is_flag=True, default=None,
              help="Keep generating past end-of-sequence tokens.")
@click.option("--resume", is_flag=True, help="Skip the requests whose ids --output already "
              "holds (from a run that was stopped) and append the others; give the options "
              "of that run (--raw among them) again: other ones are refused.")
@click.option("--overwrite", is_flag=True, help="Replace an --output file that holds results "
              "(without --resume or --overwrite such a file is refused).")
@click.option("--chat-template-kwargs", "template_json", metavar="JSON",
              help='More variables for the chat template of every chat line, as a JSON '
                   'object (e.g. \'{"enable_thinking": false}\' for Qwen3); a line\'s own '
                   '"chat_template_kwargs" goes over it.')
@click.option("--reasoning-parser", metavar="NAME",
              help="OpenAI batch lines of chat completions: split a reasoning model's "
                   "thinking from its answer, as serve's option does (qwen3, deepseek_r1).")
@click.option("--progress-interval", type=float, default=PROGRESS_INTERVAL_S, show_default=True,
              help="Seconds between progress lines on stderr when it is not a terminal (0: "
                   "after every step); a terminal gets a progress bar.")
@engine_options
def generate(model_dir, input_path, output_path, input_format, raw, device, resume,
             overwrite, template_json, reasoning_parser, progress_interval, **flags):
    """Run a batch of prompts together and write one JSON line per request.

    \b
    .txt: one prompt per line; blank lines are skipped (a file without any prompt is
    refused); the id is the line number. When the model has a chat template (a Llama 3
    vocabulary without one gets the built-in Llama 3 chat format) each line is a user
    message through it (as chat takes a message), else plain text; --raw sends plain
    text always, as a base model needs.
    .jsonl: one object per line with "prompt" (text) or "messages" (a chat), an optional
    "id" (default: the line number) and optional sampling fields (temperature, top_p,
    top_k, min_p, max_tokens, seed, stop, ignore_eos, repetition_penalty,
    frequency_penalty, presence_penalty, logit_bias, min_tokens, stop_token_ids, ...: any
    of SamplingParams') overriding the command line's. With "messages", also
    "chat_template_kwargs" (more variables for the chat template), and "tools",
    "tool_choice", "parallel_tool_calls" and "tool_call_parser", as chat completions take
    them: the output line then holds "content" and "tool_calls" (OpenAI's) beside "text".
    Files may start with a UTF-8 BOM and use CRLF line ends.

    \b
    A line's max_tokens (or --max-tokens, for lines without one) shares the context
    (--max-model-len) with its prompt: a line whose prompt and max_tokens pass it fails
    with the numbers, as the server refuses such a request; left out, a plain line's
    reply ends at 256 tokens or where the context does. A --max-tokens that leaves no
    room for any prompt is refused before the model loads.

    \b
    Output, in input order:
      {"id", "text", "usage": {"prompt_tokens", "completion_tokens"}, "finish_reason",
       "stop_reason"}
    (stop_reason: the stop string or stop token id that ended the reply, else null.)
    A line that cannot run gives {"id", "error"} and the others proceed. When an id
    repeats, the first request runs and each later one gets an error line.

    \b
    OpenAI batch files (as OpenAI's Batch API and vLLM's run-batch take them): every line
    {"custom_id", "method": "POST", "url": "/v1/chat/completions" or "/v1/completions",
    "body": {...}}, each custom_id its own. A body is taken as `cupy-llama serve` takes
    it (its "model" aside: the run uses --model); the command line's sampling options
    fill in the fields it leaves out. Each line's output is OpenAI's batch output line
      {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}
    with the body the server would answer; a refused request's response holds the
    server's error status and body, and "error" its {"code", "message"}.

    \b
    Exit code: 0 when every request succeeded, 1 when any failed (the summary says how
    many), 130 when stopped with Ctrl-C: the lines written so far are whole, and the same
    command with --resume does the rest (a .txt input's ids are its line numbers, so
    resume with the file unedited). The options that shape the results are kept beside
    the output (OUTPUT.run.json), and a --resume with other ones is refused.
    """
    from .batch_io import input_format as format_of, read_requests, still_to_run

    if output_path != "-":  # "~/out.jsonl" in quotes reaches us unexpanded
        output_path = os.path.expanduser(output_path)
    format = format_of(input_path, input_format)
    if output_path != "-":
        if input_path != "-" and _same_file(input_path, output_path):
            raise OptionError(f"--output {output_path!r} is the --input file; writing the "
                              "results would overwrite the requests: pick another --output")
        check_output_path(output_path, "--output")
    elif resume:
        raise OptionError("--resume needs --output FILE: it skips the requests that file "
                          "already holds")
    elif overwrite:
        raise OptionError("--overwrite replaces an --output file, and the results go to "
                          "stdout here: leave it out, or add --output FILE")
    if raw and format != "txt":
        raise OptionError("--raw sends a .txt file's lines as plain text; a .jsonl line says "
                          "what it is (\"prompt\": plain text, \"messages\": a chat): leave "
                          "--raw out")
    if resume and overwrite:
        raise OptionError("--resume and --overwrite contradict each other: --resume adds to "
                          "the output, --overwrite replaces it; give one")
    if output_path != "-" and not (resume or overwrite) and _holds_results(output_path):
        raise OptionError(f"--output {output_path!r} already holds results; add --resume to "
                          "finish that run, or --overwrite to replace it")
    if not progress_interval >= 0:
        raise OptionError(f"--progress-interval must be >= 0 seconds, got {progress_interval}")
    data = sys.stdin.buffer.read() if input_path == "-" else Path(input_path).read_bytes()
    name = "stdin (--input -)" if input_path == "-" else f"--input {input_path!r}"
    try:
        requests = read_requests(data, format)
    except RequestError as e:  # OpenAI batch lines beside a line that is not one
        raise OptionError(f"{name}: {e}") from None
    if not requests:  # nothing to run: no reason to load a model
        raise OptionError(f"{name} holds no prompts: it is empty or has only blank lines; "
                          "write one prompt per line (.txt) or one JSON object per line (.jsonl)")
    if all(request.error is not None for request in requests):  # likewise
        raise OptionError(_no_line_runs(name, requests, format))
    defaults = given(flags, SAMPLING_NAMES)
    defaults["stop"] = list(defaults.get("stop", ()))
    if not defaults["stop"]:
        del defaults["stop"]
    engine = given(flags, ENGINE_NAMES)
    check_options(defaults, engine)
    template_kwargs = options.template_kwargs(template_json)
    if template_kwargs is not None and format == "txt" and raw:
        raise OptionError("--chat-template-kwargs goes to the chat template, which --raw "
                          "leaves out of a .txt file's lines; give one of them")
    if reasoning_parser is not None:
        from ..reasoning import reasoning_format
        try:
            reasoning_format(reasoning_parser)
        except RequestError as e:
            raise OptionError(str(e)) from None
    if reasoning_parser is not None and any(r.batch_line is None and r.error is None
                                            for r in requests):
        raise OptionError("--reasoning-parser splits the replies of OpenAI batch lines "
                          "(/v1/chat/completions); this file has plain lines: leave it out, "
                          "or write the requests as OpenAI batch lines")
    run_options = _run_options(model_dir, format, raw, defaults)
    if template_kwargs is not None:
        run_options["--chat-template-kwargs"] = template_kwargs
    if reasoning_parser is not None:
        run_options["--reasoning-parser"] = reasoning_parser
    earlier = _read_earlier_output(output_path) if resume else None
    if resume and earlier is None:  # stopped before it wrote anything: a run that starts
        log(f"resuming: {output_path!r} does not exist yet; running all "
            f"{counted(len(requests), 'request')}")
    num_skipped = 0
    if earlier is not None:
        _check_same_options(output_path, run_options)
        todo = still_to_run(requests, earlier, repr(output_path))
        num_skipped = len(requests) - len(todo)
        if not todo:
            failed = earlier.num_errors
            log(f"nothing to do: all {counted(len(requests), 'request')} are already in "
                f"{output_path!r}" + (f", {failed} of them failed" if failed else ""))
            return EXIT_ERROR if failed else EXIT_OK
        log(f"resuming: {num_skipped} of {counted(len(requests), 'request')} are already in "
             f"{output_path!r}; running the other {len(todo)}"
             + (" (its last line was cut short: that request runs again)"
                if earlier.dropped_partial else ""))
        requests = todo
    model_name = options.served_name(model_dir)  # an OpenAI body's "model", as serve names it
    if model_dir is None:
        model_dir = options.default_model_dir()
    config = options.check_model_options(model_dir, engine, defaults)  # before the weights
    options.check_max_tokens(defaults.get("max_tokens"), config, engine)
    reasoning = None
    if reasoning_parser is not None:  # checked before the model loads
        from ..tokenizer import Tokenizer
        reasoning = options.reasoning_parser(reasoning_parser,
                                             Tokenizer.from_dir(model_dir, config))
    llm = options.load(model_dir, device, engine)
    # the options of a run that starts: once the model has loaded, so that a run that
    # never started leaves no file for a --resume to compare with
    if output_path != "-" and earlier is None:
        _keep_run_options(output_path, run_options, log)
    if format == "txt" and not raw and llm.tokenizer.chat_template is not None and requests:
        log("each line goes to the model as a user message through its chat template "
             "(--raw: as plain text)")
        for request in requests:
            if request.error is None:
                request.messages = [{"role": "user", "content": request.prompt}]
                request.prompt = None
    run = dict(defaults=defaults, interval=progress_interval, num_skipped=num_skipped,
               earlier_errors=earlier.num_errors if earlier is not None else 0,
               model_name=model_name, reasoning=reasoning, template_kwargs=template_kwargs)
    if output_path == "-":
        return _run_generate(llm, requests, _Output(sys.stdout, "stdout"), where="stdout",
                             **run)
    try:
        if earlier is not None and earlier.keep_bytes < os.path.getsize(output_path):
            os.truncate(output_path, earlier.keep_bytes)  # a partly written last line
        out = open(output_path, "a" if earlier is not None else "w", encoding="utf-8")
    except OSError as e:
        raise _Output.error(repr(output_path), e) from None
    with _Output(out, repr(output_path)) as output:
        if earlier is not None and earlier.add_newline:
            output.write("\n")
        return _run_generate(llm, requests, output, where=repr(output_path), **run)


def _no_line_runs(name: str, requests: list, format: str) -> str:
    """Why a file none of whose lines can run is refused: its first line's error, and for
    a .jsonl file of text, where prompts one to a line go."""
    more = len(requests) - 1
    text = (f"{name} has no line that can run: {requests[0].error}"
            + (f" ({counted(more, 'other line')} cannot run either)" if more else ""))
    if format == "jsonl" and all("is not valid JSON" in r.error for r in requests):
        text += "; for one prompt per line, give --format txt or name the file .txt"
    return text


def _holds_results(output_path: str) -> bool:
    path = Path(output_path)  # expanded by generate
    return path.is_file() and path.stat().st_size > 0


def _options_path(output_path: str) -> Path:
    """Where a run keeps the options that shape its results: beside the output."""
    path = Path(output_path)  # expanded by generate
    return path.with_name(path.name + ".run.json")


def _keep_run_options(output_path: str, run_options: dict, log) -> None:
    """The run's options beside a file output, for a --resume to compare with. An output
    that is no file (/dev/null, a terminal, a pipe) keeps none, and where its folder takes
    no new file the run goes on without (a --resume then cannot check its options)."""
    path = Path(output_path)  # expanded by generate
    if path.exists() and not path.is_file():
        return
    kept = _options_path(output_path)
    try:
        kept.write_text(json.dumps(run_options) + "\n")
    except OSError as e:
        log(f"warning: cannot keep this run's options in {str(kept)!r} ({e.strerror or e}); "
            "a --resume of it will not check them")


def _run_options(model_dir, format: str, raw: bool, defaults: dict) -> dict:
    """The options that decide a run's results, by flag: a --resume must give the same.
    As JSON reads them back (--logit-bias's token ids as strings), so a run compares equal
    to the file the first one wrote."""
    return json.loads(json.dumps({
        "--model": str(Path(model_dir).resolve()) if model_dir else None,
        "--format": format, "--raw": raw,
        **{"--" + name.replace("_", "-"): value for name, value in sorted(defaults.items())}}))


def _check_same_options(output_path: str, run_options: dict) -> None:
    """OptionError naming each option that differs from the first run's (an output written
    before options were kept has no record: nothing to compare)."""
    path = _options_path(output_path)
    try:
        first = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(first, dict):
        return
    if first.get("--format") != "txt":  # --raw did nothing there (and is refused now)
        first["--raw"] = False

    def shown(flag, value):
        if value is None or value is False:
            return f"no {flag}"
        return flag if value is True else f"{flag} {json.dumps(value)}"

    differ = [f"{shown(flag, run_options.get(flag))} (the first run: "
              f"{shown(flag, first.get(flag))})"
              for flag in sorted(set(first) | set(run_options))
              if first.get(flag) != run_options.get(flag)]
    if differ:
        raise OptionError(f"--resume with other options than the run that wrote "
                          f"{output_path!r}: {'; '.join(differ)}; give that run's options, "
                          "or --overwrite to start again")


def _same_file(a: str, b: str) -> bool:
    """Whether two paths name one file (also through links, or two spellings)."""
    first, second = Path(a).expanduser(), Path(b).expanduser()
    if first.resolve() == second.resolve():
        return True
    try:
        return os.path.samefile(first, second)
    except OSError:  # the output does not exist yet
        return False


def _read_earlier_output(output_path: str):
    """What an earlier run left in --output; None when the file does not exist (a run
    stopped before it opened its output: the run starts over)."""
    from .batch_io import read_resume

    path = Path(output_path)  # expanded by generate
    if not path.exists():
        return None
    return read_resume(path.read_bytes(), repr(output_path))


class _Output:
    """The JSONL output: a failed write (a full disk, say) is a one-line error naming it."""

    def __init__(self, stream, name: str):
        self.stream, self.name = stream, name

    @staticmethod
    def error(name: str, e: OSError) -> RequestError:
        return RequestError(f"cannot write {name} ({e.strerror or e}); pick another --output")

    @contextmanager
    def _writing(self):
        try:
            yield
        except BrokenPipeError:  # a reader that has what it wanted: main() says ok
            raise
        except OSError as e:
            raise self.error(self.name, e) from None

    def write(self, text: str) -> int:
        with self._writing():
            return self.stream.write(text)

    def flush(self) -> None:
        with self._writing():
            self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is not None:  # that error is the one to show; close quietly
            try:
                self.stream.close()
            except OSError:
                pass
            return
        with self._writing():
            self.stream.close()  # writes what is still buffered


class _ConsoleLines:
    """Result lines printed above rich's live progress bar: when stdout and stderr are one
    terminal, lines written straight to stdout land on the bar's screen line (the bar
    redraws itself in place), so they go through the bar's console, which moves the bar
    below each one."""

    def __init__(self, console):
        self.console = console

    def write(self, text: str) -> int:
        # split at "\n" only: a result's text may hold U+2028 and the like, which
        # str.splitlines would turn into a line break inside one JSON line
        for line in text.removesuffix("\n").split("\n") if text else ():
            self.console.print(line, markup=False, highlight=False, emoji=False,
                               soft_wrap=True)
        return len(text)

    def flush(self) -> None:
        pass


def _same_terminal(a, b) -> bool:
    try:
        return (a.isatty() and b.isatty()
                and os.path.samestat(os.fstat(a.fileno()), os.fstat(b.fileno())))
    except (AttributeError, OSError, ValueError):  # a stream without a file descriptor
        return False


class _ProgressLines:
    """Progress off a terminal: a line on stderr at most every `interval` seconds, checked
    after each engine step."""

    def __init__(self, total: int, interval: float):
        self.total, self.interval = total, interval
        self.started = self.last = time.monotonic()

    def __call__(self, num_done: int, completion_tokens: int) -> None:
        now = time.monotonic()
        if now - self.last < self.interval:
            return
        self.last = now
        elapsed = now - self.started
        rate = completion_tokens / elapsed if elapsed > 0 else 0.0
        eta = _duration((self.total - num_done) * elapsed / num_done) if num_done else "unknown"
        log(f"progress: {num_done}/{counted(self.total, 'request')} done, {rate:,.1f} completion "
             f"tok/s, ETA {eta}")


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _run_generate(llm, requests, out, *, defaults, where: str, interval: float,
                  num_skipped: int = 0, earlier_errors: int = 0, model_name: str,
                  reasoning=None, template_kwargs=None) -> int:
    """Runs the batch with progress on stderr; the exit code (0, 1 when a request failed,
    130 when interrupted), after a summary."""
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    from .batch_io import run_batch

    console = Console(stderr=True)
    if console.is_terminal:
        columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"),
                   TimeRemainingColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("generate", total=len(requests), rate="")
            started = time.perf_counter()

            def update(num_done: int, completion_tokens: int):
                elapsed = time.perf_counter() - started
                rate = f"{completion_tokens / elapsed:.0f} tok/s" if elapsed > 0 else ""
                progress.update(task, completed=num_done, rate=rate)

            if where == "stdout" and _same_terminal(sys.stdout, sys.stderr):
                out = _ConsoleLines(progress.console)
            summary = run_batch(llm, requests, out, defaults, progress=update,
                                model_name=model_name, reasoning=reasoning,
                                template_kwargs=template_kwargs)
    else:
        summary = run_batch(llm, requests, out, defaults,
                            progress=_ProgressLines(len(requests), interval),
                            model_name=model_name, reasoning=reasoning,
                            template_kwargs=template_kwargs)
    summary.num_skipped = num_skipped
    log(summary.line())
    total = num_skipped + summary.num_requests
    if summary.interrupted:
        left = summary.num_requests - summary.num_written
        if where == "stdout":
            log(f"interrupted: {counted(summary.num_written, 'result')} went to stdout; "
                f"the other {counted(left, 'request')} did not run")
        else:
            log(f"interrupted: {num_skipped + summary.num_written} of "
                f"{counted(total, 'result')} are in {where}; the same command with --resume "
                f"runs the other {left}")
        return EXIT_INTERRUPTED
    failed = summary.num_errors + earlier_errors
    if failed:
        log(f"error: {failed} of {counted(total, 'request')} failed; their lines in {where} "
            "hold an \"error\" that says why")
        return EXIT_ERROR
    return EXIT_OK


command = generate
