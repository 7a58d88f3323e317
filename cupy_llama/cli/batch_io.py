"""Batch files for `cupy-llama generate`: read requests, run them together, write JSONL.

Input: `.txt` (one prompt per line, blank lines skipped; `generate` makes each a user
message when the model has a chat template, unless --raw) or `.jsonl` (one JSON object per
line), in one of two kinds:
- plain lines: `prompt` or `messages`, optional `id` and sampling fields; with
  `messages`, also `tools`, `tool_choice`, `parallel_tool_calls`, `tool_call_parser` and
  `chat_template` as LLM.chat takes them. A request's default id is its line number. A later request reusing an id gets an error line; the
  first one runs. A `max_tokens` asked for (the line's or the command line's) that the
  context cannot give beside the prompt gets an error line, in the words the server
  refuses it with; left out, the reply ends where the context does, if not before.
- OpenAI batch lines `{"custom_id", "method", "url", "body"}` (a `metadata` beside them is
  ignored), as OpenAI's Batch API and vLLM's run-batch read them. Each is the request
  `cupy-llama serve` would take at that url and method, parsed and checked by the server's
  own request models (server/protocol.py). The output is matched to the input by custom_id,
  so in such a file every line must be one, with a custom_id of its own; the file is
  refused before anything runs when a line is not.
Lines may end in CRLF and the file may start with a UTF-8 BOM.

Output: one JSON object per request, in input order. For plain lines
`{"id", "text", "usage": {"prompt_tokens", "completion_tokens"}, "finish_reason",
"stop_reason"}` (stop_reason: the stop string or stop token id that ended the reply, else
null, as RequestOutput.stop_reason; with tools, also `"content"` and `"tool_calls"`,
OpenAI's, and finish_reason "tool_calls" when there are calls; where the line asks for them, `"logprobs"`, an entry per output token
`{"token", "token_id", "logprob", "top_logprobs": [{"token", "token_id", "logprob"}]}`,
and `"prompt_logprobs"`, null for the first prompt token and then such an entry) or, for a request that could not run, `{"id", "error"}`. For OpenAI batch lines, OpenAI's batch
output line `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}`: body is the chat.completion or text_completion object the server would answer
with; a request the server would refuse gets its error status and body, and `error`
{"code", "message"}. A stopped run leaves the lines of the first requests, each one whole;
`read_resume` reads them back, so that a second run with the same input writes only the
rest and the file ends as one uninterrupted run writes it (an OpenAI line's ids and
`created` time aside, which are new in every run).
"""
from __future__ import annotations

import importlib
import json
import sys
import time
from dataclasses import dataclass, field, replace
from dataclasses import fields as dataclass_fields
from pathlib import Path

from ..errors import CupyLlamaError, OptionError, RequestError
from ..outputs import TokenStrings, json_logprob
from ..sampling import SamplingParams, model_sampling_defaults
from ..structured import StructuredSpec
from ..tokenizer import check_template_kwargs
from ..util import counted, json_type

FORMATS = ("txt", "jsonl")
BATCH_LINE_FIELDS = ("custom_id", "method", "url", "body")  # any one: an OpenAI batch line
PLAIN_KIND, BATCH_KIND = "plain", "OpenAI batch"  # the two kinds of line, in messages
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "tool_call_parser")


@dataclass
class BatchRequest:
    line: int                        # 1-based line number in the input file
    id: str | int                    # as given, or the line number; an OpenAI line's custom_id
    prompt: str | list[int] | None = None
    messages: list | None = None
    sampling: dict = field(default_factory=dict)  # per-request sampling fields
    error: str | None = None         # why the request cannot run
    id_given: bool = False           # the line named its id (else it is the line number)
    batch_line: dict | None = None   # an OpenAI batch line's method, url and body


def input_format(path: str, format: str | None = None) -> str:
    if format:
        return format
    suffix = Path(path).suffix.lower()
    if suffix == ".txt":
        return "txt"
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    raise OptionError(f"cannot tell the format of {path!r} from its name; use a .txt or "
                      f".jsonl file, or pass --format txt|jsonl")


def read_requests(data: bytes, format: str) -> list[BatchRequest]:
    """Parse a whole batch file. Bad plain lines become requests with an error; blank lines
    are skipped. RequestError when the file holds OpenAI batch lines and a line that is not
    one of them (with a custom_id of its own)."""
    rows = []  # (line number, text, the JSON object, why the line cannot be read)
    for number, text, error in _lines(data):
        obj = None
        if error is None and format == "jsonl":
            obj, error = _json_object(number, text)
        rows.append((number, text, obj, error))
    first = next((number for number, _, obj, _ in rows if _is_batch_line(obj)), None)
    if first is not None:
        return _read_batch_lines(rows, first)
    requests: list[BatchRequest] = []
    first_line_of: dict = {}
    for number, text, obj, error in rows:
        if error is not None:
            request = BatchRequest(number, number, error=error)
        elif format == "txt":
            request = BatchRequest(number, number, prompt=text)
        else:
            request = _read_plain_line(number, obj)
        key = (type(request.id).__name__, request.id)
        if request.error is None and key in first_line_of:
            default = " (its line number, the default id)"
            first, first_given = first_line_of[key]
            request.error = (f"line {number}: duplicate id {request.id!r}"
                             f"{'' if request.id_given else default}, first used on line "
                             f"{first}{'' if first_given else default}; give every request "
                             "its own id")
        first_line_of.setdefault(key, (number, request.id_given))
        requests.append(request)
    return requests


def _lines(data: bytes):
    """(line number, text, None) for each line that is not blank; (line number, None,
    why) for one that is not UTF-8."""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    for number, raw in enumerate(data.split(b"\n"), start=1):
        raw = raw.removesuffix(b"\r")
        if not raw.strip():
            continue
        try:
            yield number, raw.decode("utf-8"), None
        except UnicodeDecodeError as e:
            yield number, None, (f"line {number} is not UTF-8 text (byte {e.start}); save "
                                 "the file as UTF-8")


def _json_object(number: int, text: str) -> tuple[dict | None, str | None]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"line {number} is not valid JSON ({e.msg} at column {e.colno})"
    except RecursionError:  # valid JSON Python's parser cannot take
        return None, (f"line {number} nests arrays or objects too deeply; write at most a "
                      "few hundred levels")
    except ValueError:  # the int-string conversion limit
        return None, (f"line {number} holds an integer of more than "
                      f"{sys.get_int_max_str_digits()} digits; write smaller numbers")
    if not isinstance(obj, dict):
        return None, f"line {number} must be a JSON object, got {json_type(obj)}"
    return obj, None


def openai_protocol():
    """server/protocol.py, which OpenAI batch lines go through. It needs pydantic, which
    cupy-llama installs; a source tree run without installing may lack it."""
    try:
        return importlib.import_module("..server.protocol", __package__)
    except ImportError as e:
        raise CupyLlamaError(f"OpenAI batch lines need pydantic ({e.name} is not "
                             "installed): pip install 'pydantic>=2.5'") from None


def _is_batch_line(obj) -> bool:
    return isinstance(obj, dict) and any(name in obj for name in BATCH_LINE_FIELDS)


def _read_plain_line(number: int, obj: dict) -> BatchRequest:
    request = BatchRequest(number, number)
    try:
        _read_plain(request, obj)
    except RequestError as e:
        request.error = f"line {number}: {e}"
    return request


def _read_batch_lines(rows: list, first: int) -> list[BatchRequest]:
    """An OpenAI batch file: one request per line, each named by its custom_id. What the
    line asks for (url, method, body) is checked when it runs, as the server checks it."""
    openai_protocol()  # fails before the model loads
    requests: list[BatchRequest] = []
    line_of: dict[str, int] = {}
    for number, _, obj, error in rows:
        if error is None and not _is_batch_line(obj):
            error = (f"line {number} is a plain request (it has none of "
                     f"{', '.join(BATCH_LINE_FIELDS)})")
        if error is not None:
            raise RequestError(f"{error}, in a file of OpenAI batch requests (line {first} "
                               "is one); every line must be one, with a custom_id of its "
                               f"own: fix or remove line {number}")
        custom_id = obj.get("custom_id")
        if "custom_id" not in obj:
            error = f"line {number} has no custom_id"
        elif not isinstance(custom_id, str):
            error = f"line {number}: custom_id must be a string, got {json.dumps(custom_id)}"
        elif custom_id in line_of:
            error = (f"line {number} repeats the custom_id {custom_id!r} of line "
                     f"{line_of[custom_id]}")
        if error is not None:
            raise RequestError(f"{error}; every request of an OpenAI batch file needs a "
                               "custom_id of its own: it names the request's output line")
        line_of[custom_id] = number
        requests.append(BatchRequest(number, custom_id, id_given=True, batch_line={
            "method": obj.get("method"), "url": obj.get("url"), "body": obj.get("body")}))
    return requests


def _read_plain(request: BatchRequest, obj: dict) -> None:
    fields = dict(obj)
    if "id" in fields:
        request.id, request.id_given = _check_id(fields.pop("id"), "id"), True
    _read_prompt(request, fields)
    request.sampling = fields


def _read_prompt(request: BatchRequest, fields: dict) -> None:
    """Moves `prompt` or `messages` out of fields into the request."""
    has_prompt, has_messages = "prompt" in fields, "messages" in fields
    if has_prompt == has_messages:
        raise RequestError("give exactly one of 'prompt' (a string) or 'messages' "
                           "(a list of {role, content})")
    if has_prompt:
        prompt = fields.pop("prompt")
        if not isinstance(prompt, (str, list)):
            raise RequestError(f"'prompt' must be a string or a list of token ids, got "
                               f"{json_type(prompt)}")
        request.prompt = prompt
    else:
        request.messages = fields.pop("messages")


# A plain line may constrain its output under the names a server request uses for it.
_STRUCTURED_FIELDS = (("response_format", StructuredSpec.from_response_format),
                      ("structured_outputs", StructuredSpec.from_structured_outputs),
                      ("guided_json", StructuredSpec.json), ("guided_regex", StructuredSpec.regex),
                      ("guided_choice", StructuredSpec.choice),
                      ("guided_grammar", StructuredSpec.grammar),
                      ("grammar", StructuredSpec.gbnf), ("json_schema", StructuredSpec.json))


def plain_structured(fields: dict) -> dict:
    """A plain line's sampling fields with its constraint, under any of the server's names
    for one (response_format, structured_outputs, guided_*, llama.cpp's grammar and
    json_schema), as SamplingParams.structured."""
    given = [name for name, _ in _STRUCTURED_FIELDS if fields.get(name) is not None]
    if not given:
        return fields
    if len(given) + ("structured" in fields) > 1:
        raise RequestError(f"{' and '.join(given + ['structured'] * ('structured' in fields))} "
                           f"both constrain the output; give one of them")
    fields = dict(fields)
    make = dict(_STRUCTURED_FIELDS)[given[0]]
    fields["structured"] = make(fields.pop(given[0]), given[0])
    for name, _ in _STRUCTURED_FIELDS:
        fields.pop(name, None)
    return fields


# what a plain line may hold besides 'prompt' or 'messages' and 'id': SamplingParams'
# fields, the names of a constraint, tools and the chat template's
_PLAIN_FIELDS = frozenset(
    {f.name for f in dataclass_fields(SamplingParams)} | {name for name, _ in _STRUCTURED_FIELDS}
    | set(TOOL_FIELDS) | {"chat_template", "chat_template_kwargs"})


def _check_plain_fields(fields: dict) -> None:
    """RequestError naming a plain line's first unknown field, with the fields it takes."""
    unknown = sorted(set(fields) - _PLAIN_FIELDS)
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r}; a line holds 'prompt' or "
                           f"'messages', an optional 'id', and any of "
                           f"{', '.join(sorted(_PLAIN_FIELDS))}")


def _check_id(value, name: str):
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RequestError(f"{name!r} must be a string or an integer, got {json.dumps(value)}")
    return value


# ---- resuming ----------------------------------------------------------------------

def id_key(value) -> tuple[str, str | int]:
    """Ids compare with their type: the string "1" and the line number 1 differ."""
    return type(value).__name__, value


@dataclass
class Resume:
    """What an earlier run left in the output file."""
    done: set                   # id_key of every request that has its line
    keep_bytes: int             # the file without a partly written last line
    num_errors: int = 0         # lines among them with an error
    add_newline: bool = False   # the last line is whole but has no line end
    dropped_partial: bool = False
    kinds: set = field(default_factory=set)  # "plain" and/or "OpenAI batch": the lines' kind


def read_resume(data: bytes, name: str) -> Resume:
    """The ids of the result lines in an output file. A last line cut short (the run was
    killed while writing it) is left out, to be written again; any other line that is not
    a result is a RequestError (not the output of a run?)."""
    *lines, last = data.split(b"\n")
    resume = Resume(set(), len(data))
    for number, raw in enumerate(lines, start=1):
        if raw.strip() and not _add_result(resume, raw):
            raise RequestError(f"{name} line {number} is not a result line of cupy-llama "
                               "generate; --resume appends to the output of an earlier run "
                               "of the same input")
    if last.strip():
        if _add_result(resume, last):
            resume.add_newline = True
        else:
            resume.keep_bytes -= len(last)
            resume.dropped_partial = True
    return resume


def _add_result(resume: Resume, raw: bytes) -> bool:
    """Notes one output line's id; False when it is not a result line. An OpenAI batch
    output line is named by its custom_id (its "id" is the output line's own)."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(obj, dict):
        return False
    if "custom_id" in obj and "response" in obj:
        value, kind, failed = obj["custom_id"], BATCH_KIND, obj.get("error") is not None
        if not isinstance(value, str):
            return False
    elif "text" in obj or "error" in obj:
        value, kind, failed = obj.get("id"), PLAIN_KIND, "error" in obj
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            return False
    else:
        return False
    resume.done.add(id_key(value))
    resume.kinds.add(kind)
    resume.num_errors += failed
    return True


def still_to_run(requests: list[BatchRequest], resume: Resume, name: str) -> list[BatchRequest]:
    """The requests whose ids the output does not have yet. RequestError when it has an
    id the input does not, or lines of the other kind: the output of another input."""
    kind = BATCH_KIND if requests and requests[0].batch_line is not None else PLAIN_KIND
    other = next((k for k in resume.kinds if k != kind), None)
    if other is not None:
        raise RequestError(f"{name} holds {other} result lines and the input has {kind} "
                           "lines; --resume continues the output of the same input")
    ids = {id_key(r.id) for r in requests}
    stray = next((key for key in resume.done if key not in ids), None)
    if stray is not None:
        raise RequestError(f"{name} holds id {stray[1]!r}, which the input does not have; "
                           "--resume continues the output of the same input (a .txt "
                           "input's ids are its line numbers: resume it unedited)")
    return [r for r in requests if id_key(r.id) not in resume.done]


# ---- running ------------------------------------------------------------------------

@dataclass
class BatchSummary:
    num_requests: int = 0       # this run's (without those an earlier run finished)
    num_written: int = 0        # output lines written, in input order
    num_errors: int = 0         # of those, lines with an error
    num_skipped: int = 0        # already in the output (--resume)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0    # of those, tokens whose K/V came from the prefix cache
    completion_tokens: int = 0
    seconds: float = 0.0
    num_preemptions: int = 0
    interrupted: bool = False

    def line(self) -> str:
        rate = self.completion_tokens / self.seconds if self.seconds > 0 else 0.0
        hit_rate = (100 * self.cached_prompt_tokens / self.prompt_tokens
                    if self.prompt_tokens else 0.0)
        if self.interrupted:
            done = f"{self.num_written} of {counted(self.num_requests, 'request')} done"
        else:
            done = counted(self.num_requests, "request")
        skipped = (f"{counted(self.num_skipped, 'request')} done before (--resume); "
                   if self.num_skipped else "")
        return (f"{skipped}{done} ({self.num_errors} failed): "
                f"{counted(self.prompt_tokens, 'prompt token')} ({self.cached_prompt_tokens} "
                f"cached, {hit_rate:.0f}%) + {counted(self.completion_tokens, 'completion token')} "
                f"in {self.seconds:.2f} s, {rate:.1f} completion tok/s, "
                f"{counted(self.num_preemptions, 'preemption')}")


def run_batch(llm, requests: list[BatchRequest], out, defaults: dict, progress=None,
              model_name: str | None = None, reasoning=None,
              template_kwargs: dict | None = None) -> BatchSummary:
    """Add every runnable request to the engine at once, step until all finish, and write
    one JSON line per request to `out` in input order (as soon as its turn comes).
    Ctrl-C (KeyboardInterrupt) stops the run: the lines written so far stay, the rest of
    the requests are aborted, and the summary says interrupted.

    defaults: sampling fields for requests that do not set them (the command line's);
    the model's generation_config.json lies underneath both.
    progress: called as progress(num_done, completion_tokens) after every step.
    model_name: the "model" of OpenAI response bodies (default: the model folder).
    reasoning: a ReasoningParser that splits OpenAI chat lines' replies, as serve's
    --reasoning-parser does (None: no split).
    template_kwargs: more chat-template variables for every chat line (a line's own
    chat_template_kwargs go over them)."""
    engine = llm.engine
    runner = _Runner(llm, defaults, model_name or str(llm.model_dir), reasoning,
                     template_kwargs)
    results: list[dict | None] = [None] * len(requests)
    failed = [False] * len(requests)
    summary = BatchSummary(num_requests=len(requests))
    preemptions_before = engine.stats().num_preemptions
    started = time.perf_counter()
    try:
        for index, request in enumerate(requests):
            refused = runner.add(index, request)
            if refused is not None:
                results[index], failed[index] = refused, True
        summary.num_written = _write_ready(results, out, 0)
        num_done = len(requests) - runner.num_running
        generated = 0  # by every request, finished or not: the progress rate's
        while engine.has_unfinished_requests():
            for output in engine.step():
                generated += len(output.delta_token_ids)
                line = runner.finish(output) if output.finished else None
                if line is not None:
                    results[line.index] = line.result
                    # the summary counts finished requests' tokens, prompt and completion
                    # alike (an interrupted run's running requests count in neither)
                    for prompt_outputs in line.outputs:
                        summary.prompt_tokens += len(prompt_outputs[0].prompt_token_ids)
                        summary.cached_prompt_tokens += prompt_outputs[0].num_cached_tokens
                        summary.completion_tokens += sum(len(o.token_ids)
                                                         for o in prompt_outputs)
                    num_done += 1
            summary.num_written = _write_ready(results, out, summary.num_written)
            if progress is not None:
                progress(num_done, generated)
    except KeyboardInterrupt:
        summary.interrupted = True
    finally:
        runner.abort_all()
    summary.seconds = time.perf_counter() - started
    summary.num_errors = sum(failed[:summary.num_written])
    summary.num_preemptions = engine.stats().num_preemptions - preemptions_before
    return summary


@dataclass
class _Line:
    """A running request: its engine requests (one per prompt, n samples each) and their
    outputs as they finish; `result`, its output line, once all have."""
    index: int                       # in the requests
    request: BatchRequest
    api: object | None               # an OpenAI line's parsed request (server/protocol.py)
    engine_ids: list[str]
    outputs: list[list]              # [prompt][sample] -> the final RequestOutput
    num_unfinished: int
    created: int = 0                 # when it was added (an OpenAI body's "created")
    result: dict | None = None
    tool_parser: str | None = None   # a plain line with tools: the parser of its reply
    max_calls: int | None = None     # and the calls it keeps (1: parallel_tool_calls false)


class _Runner:
    """Adds each request to the engine and builds its output line once it is finished."""

    def __init__(self, llm, defaults: dict, model_name: str, reasoning=None,
                 template_kwargs: dict | None = None):
        self.llm = llm
        self.reasoning = reasoning
        self.template_kwargs = template_kwargs or {}
        self.engine = llm.engine
        self.defaults = defaults
        self.model_name = model_name
        self.model_defaults = model_sampling_defaults(llm.config.generation_config)
        self.protocol = None          # server/protocol.py, once an OpenAI line comes
        self.token_strings = TokenStrings(llm.tokenizer)  # each token's text, for logprobs
        self.fingerprint = None       # an OpenAI body's system_fingerprint, as serve's
        self._lines: dict[str, tuple[_Line, int]] = {}  # engine id -> line, prompt index

    @property
    def num_running(self) -> int:
        return len({id(line) for line, _ in self._lines.values()})

    def add(self, index: int, request: BatchRequest) -> dict | None:
        """Queue one request; returns its output line when it cannot run."""
        if request.batch_line is not None:
            return self._add_batch_line(index, request)
        if request.error is None:
            request.error = self._add_plain(index, request)
        return None if request.error is None else {"id": request.id, "error": request.error}

    def _add_plain(self, index: int, request: BatchRequest) -> str | None:
        """Returns the error message when the request cannot run."""
        from .chat_ui import context_hint

        engine = self.engine
        try:
            fields = dict(request.sampling)
            _check_plain_fields(fields)
            tool_fields = {name: fields.pop(name) for name in TOOL_FIELDS if name in fields}
            template = fields.pop("chat_template", None)
            template_kwargs = fields.pop("chat_template_kwargs", None)
            for name, value in (("chat_template", template),
                                ("chat_template_kwargs", template_kwargs)):
                if value is not None and request.messages is None:
                    raise RequestError(f"{name} needs 'messages' (a chat), not 'prompt'")
            template_kwargs = {**self.template_kwargs,
                               **check_template_kwargs(template_kwargs)}
            params = SamplingParams.from_dict({**self.defaults, **plain_structured(fields)},
                                              self.model_defaults)
            if params.n != 1:  # one output line per request
                raise RequestError(f"n must be 1 in a batch file (one reply per line), got "
                                   f"{params.n}; repeat the line with other ids instead")
            tools, parser, max_calls = None, None, None
            if tool_fields:
                tools, parser, params = self._tool_setup(request, tool_fields, params, template,
                                                         template_kwargs or None)
                max_calls = 1 if tool_fields.get("parallel_tool_calls") is False else None
            if request.messages is not None:
                prompt = self.llm.tokenizer.encode_chat(request.messages,
                                                        add_generation_prompt=True, tools=tools,
                                                        template_kwargs=template_kwargs or None,
                                                        chat_template=template)
            else:
                prompt = engine.encode_prompt(request.prompt)
            if parser is not None:  # a call enforced after the thinking the prompt opened
                params = self.llm.constrain_after_thinking(prompt, params,
                                                           template_kwargs or None)
            if len(prompt) >= engine.context_limit:
                return (f"line {request.line}: the prompt has {len(prompt)} tokens but the "
                        f"context limit is {engine.context_limit} (prompt plus at least one "
                        f"new token); shorten the prompt{context_hint(self.llm)}")
            # a max_tokens asked for (the line's or --max-tokens) that the context cannot
            # give is refused, in the server's words, as an OpenAI line's is; left out, the
            # default ends where the context does
            asked = fields.get("max_tokens", self.defaults.get("max_tokens")) is not None
            room = engine.context_limit - len(prompt)
            if asked and params.max_tokens > room:
                return (f"line {request.line}: {counted(len(prompt), 'prompt token')} + max_tokens "
                        f"{params.max_tokens} = {len(prompt) + params.max_tokens} tokens, "
                        f"past the context limit of {engine.context_limit}; ask for at most "
                        f"{room} tokens or shorten the prompt")
            self._start(_Line(index, request, None, [f"{index}-0"], [[None]], 1,
                              tool_parser=parser, max_calls=max_calls), [prompt], [params])
        except CupyLlamaError as e:
            return f"line {request.line}: {e}"
        return None

    def _tool_setup(self, request: BatchRequest, fields: dict, params: SamplingParams,
                    chat_template: str | None = None, template_kwargs: dict | None = None):
        """A plain line's tool fields, as LLM.chat takes them: (the tools the template
        shows, the parser of the reply, the params with the grammar of its tool_choice)."""
        if request.messages is None:
            raise RequestError(f"{' and '.join(fields)} need 'messages' (tools are shown to "
                               "the chat template), not 'prompt'")
        structured, parallel = params.structured, fields.get("parallel_tool_calls")
        tools, parser, tool_params = self.llm.tool_setup(
            fields.get("tools"), fields.get("tool_choice"),
            True if parallel is None else parallel,  # null: the default, as OpenAI takes it
            fields.get("tool_call_parser"), replace(params, structured=None), chat_template,
            template_kwargs)
        if tool_params.structured is None:
            return tools, parser, params
        if structured is not None:
            raise RequestError("tool_choice \"required\" or a named function sets the output's "
                               "grammar; leave out the line's constraint (structured, "
                               "response_format, guided_*)")
        return tools, parser, tool_params

    def _add_batch_line(self, index: int, request: BatchRequest) -> dict | None:
        """An OpenAI batch line, taken as `cupy-llama serve` takes the request (the same
        request model, prompts and SamplingParams); its output line when it is refused.
        The body's "model" is not checked: a run has the one model of the command line,
        and files written for a hosted API name that API's models."""
        if self.protocol is None:
            self.protocol = openai_protocol()
            self.fingerprint = self.protocol.system_fingerprint(self.llm.model_dir,
                                                                self.llm.device)
        protocol, line = self.protocol, request.batch_line
        try:
            body = _with_defaults(line["body"], self.defaults)
            if self.template_kwargs and line["url"] == "/v1/chat/completions":
                body = _with_template_kwargs(body, self.template_kwargs)
            api = protocol.parse_batch_request(line["method"], line["url"], body)
            if isinstance(api, protocol.ChatCompletionRequest):
                api.set_reasoning_parser(self.reasoning)
            prompts, params = api.engine_inputs(self.llm.tokenizer, self.llm.config.vocab_size,
                                                self.engine.context_limit, self.model_defaults)
            engine_ids = [f"{index}-{i}" for i in range(len(prompts))]
            self._start(_Line(index, request, api, engine_ids,
                              [[None] * api.samples_per_prompt for _ in prompts],
                              len(prompts) * api.samples_per_prompt,
                              created=int(time.time())), prompts, params)
        except protocol.APIError as e:
            return protocol.batch_error_output(request.id, e)
        return None

    def _start(self, line: _Line, prompts: list, params: list) -> None:
        """Adds the line's engine requests; when the engine refuses one, none stays (an
        OpenAI line's refusal is the 400 the server answers it with)."""
        added = []
        try:
            for i, (engine_id, prompt, sampling) in enumerate(zip(line.engine_ids, prompts,
                                                                  params)):
                self.engine.add_request(prompt, sampling, request_id=engine_id)
                added.append(engine_id)
                self._lines[engine_id] = (line, i)
        except RequestError as e:
            for engine_id in added:
                self.engine.abort(engine_id)
                del self._lines[engine_id]
            if line.api is None:
                raise
            raise self.protocol.request_error(str(e)) from None

    def finish(self, output) -> _Line | None:
        """Notes a finished sample; returns its line once the line's last one is in."""
        found = self._lines.get(output.request_id)
        if found is None:
            return None
        line, prompt = found
        line.outputs[prompt][output.index] = output
        line.num_unfinished -= 1
        if line.num_unfinished:
            return None
        for engine_id in line.engine_ids:
            del self._lines[engine_id]
        if line.api is None:
            output = line.outputs[0][0]
            if line.tool_parser is not None:
                self.llm.parse_tool_calls(output, line.tool_parser, line.max_calls)
            line.result = result_object(line.request.id, output, line.tool_parser is not None,
                                        self.token_strings)
        else:
            api = line.api
            body = api.response_body(self.protocol.new_id(api.ID_PREFIX), line.created,
                                     self.model_name, line.outputs, self.token_strings,
                                     self.fingerprint)
            line.result = self.protocol.batch_output(line.request.id, body)
        return line

    def abort_all(self) -> None:
        for engine_id in list(self._lines):
            self.engine.abort(engine_id)
        self._lines.clear()


def _with_defaults(body, defaults: dict):
    """The body with the command line's sampling options (their names are the API's) in
    the fields it leaves out or sets to null."""
    if not isinstance(body, dict) or not defaults:
        return body
    return {**body, **{name: value for name, value in defaults.items()
                       if body.get(name) is None}}


def _with_template_kwargs(body, template_kwargs: dict):
    """A chat body with --chat-template-kwargs under its own chat_template_kwargs (a body
    whose field is no object keeps it, for the request model to refuse)."""
    if not isinstance(body, dict):
        return body
    own = body.get("chat_template_kwargs")
    if own is None:
        return {**body, "chat_template_kwargs": template_kwargs}
    if isinstance(own, dict):
        return {**body, "chat_template_kwargs": {**template_kwargs, **own}}
    return body


def result_object(request_id, output, with_tools: bool = False, token_text=None) -> dict:
    """with_tools: the line offered tools; its parsed reply goes beside the text. Where the
    line asked for logprobs or prompt_logprobs, they go beside it too (token_text: a token
    id's text)."""
    result = {"id": request_id, "text": output.text,
              "usage": {"prompt_tokens": len(output.prompt_token_ids),
                        "completion_tokens": len(output.token_ids)},
              "finish_reason": output.finish_reason, "stop_reason": output.stop_reason}
    if with_tools:
        result["content"] = output.content
        result["tool_calls"] = [call.to_openai() for call in output.tool_calls or []]
    if output.logprobs is not None:
        result["logprobs"] = [_logprob_entry(entry, token_text) for entry in output.logprobs]
    prompt_logprobs = output.prompt_logprobs
    if prompt_logprobs is not None:
        result["prompt_logprobs"] = [None if entry is None else _logprob_entry(entry, token_text)
                                     for entry in prompt_logprobs]
    return result


def _logprob_entry(entry, token_text) -> dict:
    """A token's log-probability and its top alternatives', as the line's output holds them."""
    def item(token_id, logprob):
        return {"token": token_text(token_id), "token_id": token_id,
                "logprob": json_logprob(logprob)}

    return {**item(entry.token_id, entry.logprob),
            "top_logprobs": [item(token_id, logprob) for token_id, logprob in entry.top]}


def _write_ready(results: list, out, start: int) -> int:
    """Write results[start:] up to the first one not finished yet; returns the new start."""
    while start < len(results) and results[start] is not None:
        out.write(json.dumps(results[start], ensure_ascii=False) + "\n")
        start += 1
    out.flush()
    return start
