"""Batch files for `cupy-llama generate`: read requests, run them together, write JSONL.

Input: `.txt` (one prompt per line, blank lines skipped) or `.jsonl` (one JSON object per
line: `prompt` or `messages`, optional `id` and sampling fields; or the OpenAI batch
envelope `{"custom_id", "method", "url", "body": {...}}`). Lines may end in CRLF and the file
may start with a UTF-8 BOM. A request's default id is its line number. A later request
reusing an id gets an error line; the first one runs.

Output: one JSON object per request, in input order:
`{"id", "text", "usage": {"prompt_tokens", "completion_tokens"}, "finish_reason"}` or, for a
request that could not run, `{"id", "error"}`. A stopped run leaves the lines of the first
requests, each one whole; `read_resume` reads them back, so that a second run with the
same input writes only the rest and the file ends as one uninterrupted run writes it.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CupyLlamaError, OptionError, RequestError
from .sampling import SamplingParams, model_sampling_defaults

FORMATS = ("txt", "jsonl")
# OpenAI request bodies carry these; they do not change how a request is sampled here
IGNORED_BODY_FIELDS = ("model", "user")


@dataclass
class BatchRequest:
    line: int                        # 1-based line number in the input file
    id: str | int                    # as given, or the line number
    prompt: str | list[int] | None = None
    messages: list | None = None
    sampling: dict = field(default_factory=dict)  # per-request sampling fields
    error: str | None = None         # why the request cannot run
    id_given: bool = False           # the line named its id (else it is the line number)


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
    """Parse a whole batch file. Bad lines become requests with an error; blank lines are
    skipped."""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    requests: list[BatchRequest] = []
    first_line_of: dict = {}
    for number, raw in enumerate(data.split(b"\n"), start=1):
        raw = raw.removesuffix(b"\r")
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            requests.append(BatchRequest(number, number, error=f"line {number} is not UTF-8 "
                                         f"text (byte {e.start}); save the file as UTF-8"))
            continue
        request = BatchRequest(number, number, prompt=text) if format == "txt" \
            else parse_json_line(number, text)
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


def parse_json_line(number: int, text: str) -> BatchRequest:
    request = BatchRequest(number, number)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        request.error = f"line {number} is not valid JSON ({e.msg} at column {e.colno})"
        return request
    if not isinstance(obj, dict):
        request.error = f"line {number} must be a JSON object, got {type(obj).__name__}"
        return request
    try:
        if "body" in obj or "custom_id" in obj:
            _read_envelope(request, obj)
        else:
            _read_plain(request, obj)
    except RequestError as e:
        request.error = f"line {number}: {e}"
    return request


def _read_plain(request: BatchRequest, obj: dict) -> None:
    fields = dict(obj)
    if "id" in fields:
        request.id, request.id_given = _check_id(fields.pop("id"), "id"), True
    _read_prompt(request, fields)
    request.sampling = fields


def _read_envelope(request: BatchRequest, obj: dict) -> None:
    if "custom_id" in obj:
        request.id, request.id_given = _check_id(obj["custom_id"], "custom_id"), True
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise RequestError(f"unknown batch field {unknown[0]!r}; expected custom_id, method, "
                           f"url and body")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise RequestError("'body' must be an object with 'messages' or 'prompt'")
    fields = {k: v for k, v in body.items() if k not in IGNORED_BODY_FIELDS}
    if "max_completion_tokens" in fields:
        fields["max_tokens"] = fields.pop("max_completion_tokens")
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
                               f"{type(prompt).__name__}")
        request.prompt = prompt
    else:
        request.messages = fields.pop("messages")


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
    """Notes one output line's id; False when it is not a result line."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(obj, dict) or not ("text" in obj or "error" in obj):
        return False
    value = obj.get("id")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return False
    resume.done.add(id_key(value))
    resume.num_errors += "error" in obj
    return True


def still_to_run(requests: list[BatchRequest], resume: Resume, name: str) -> list[BatchRequest]:
    """The requests whose ids the output does not have yet. RequestError when it has an
    id the input does not: the output of another input."""
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
            done = f"{self.num_written} of {_requests(self.num_requests)} done"
        else:
            done = _requests(self.num_requests)
        skipped = (f"{_requests(self.num_skipped)} done before (--resume); "
                   if self.num_skipped else "")
        return (f"{skipped}{done} ({self.num_errors} failed): "
                f"{self.prompt_tokens} prompt ({self.cached_prompt_tokens} cached, "
                f"{hit_rate:.0f}%) + {self.completion_tokens} completion tokens "
                f"in {self.seconds:.2f} s, {rate:.1f} completion tok/s, "
                f"{self.num_preemptions} preemptions")


def _requests(count: int) -> str:
    return f"{count} request" + ("" if count == 1 else "s")


def run_batch(llm, requests: list[BatchRequest], out, defaults: dict,
              progress=None) -> BatchSummary:
    """Add every runnable request to the engine at once, step until all finish, and write
    one JSON line per request to `out` in input order (as soon as its turn comes).
    Ctrl-C (KeyboardInterrupt) stops the run: the lines written so far stay, the rest of
    the requests are aborted, and the summary says interrupted.

    defaults: sampling fields for requests that do not set them (the command line's);
    the model's generation_config.json lies underneath both.
    progress: called as progress(num_done, completion_tokens) after every step."""
    engine = llm.engine
    model_defaults = model_sampling_defaults(llm.config.generation_defaults)
    results: list[dict | None] = [None] * len(requests)
    pending: dict[str, int] = {}     # engine request id -> index in requests
    summary = BatchSummary(num_requests=len(requests))
    preemptions_before = engine.scheduler.num_preemptions
    started = time.perf_counter()
    try:
        for index, request in enumerate(requests):
            if request.error is None:
                request.error = _add(llm, request, str(index), defaults, model_defaults)
            if request.error is None:
                pending[str(index)] = index
            else:
                results[index] = {"id": request.id, "error": request.error}
        summary.num_written = _write_ready(results, out, 0)
        num_done = len(requests) - len(pending)
        while engine.has_unfinished_requests():
            for output in engine.step():
                summary.completion_tokens += len(output.delta_token_ids)
                if output.finished:
                    index = pending.pop(output.request_id)
                    results[index] = result_object(requests[index].id, output)
                    summary.prompt_tokens += len(output.prompt_token_ids)
                    summary.cached_prompt_tokens += output.num_cached_tokens
                    num_done += 1
            summary.num_written = _write_ready(results, out, summary.num_written)
            if progress is not None:
                progress(num_done, summary.completion_tokens)
    except KeyboardInterrupt:
        summary.interrupted = True
    finally:
        for request_id in list(pending):
            engine.abort(request_id)
    summary.seconds = time.perf_counter() - started
    summary.num_errors = sum(1 for r in results[:summary.num_written] if "error" in r)
    summary.num_preemptions = engine.scheduler.num_preemptions - preemptions_before
    return summary


def _add(llm, request: BatchRequest, engine_id: str, defaults: dict,
         model_defaults: dict) -> str | None:
    """Queue one request; returns the error message when it cannot run."""
    from .chat_ui import context_hint

    engine = llm.engine
    try:
        params = SamplingParams.from_dict({**defaults, **request.sampling}, model_defaults)
        if params.n != 1:  # one output line per request
            raise RequestError(f"n must be 1 in a batch file (one reply per line), got "
                               f"{params.n}; repeat the line with other ids instead")
        if request.messages is not None:
            prompt = llm.tokenizer.encode_chat(request.messages, add_generation_prompt=True)
        else:
            prompt = engine.encode_prompt(request.prompt)
        if len(prompt) >= engine.max_model_len:
            return (f"line {request.line}: the prompt has {len(prompt)} tokens but the "
                    f"context limit is {engine.max_model_len} (prompt plus at least one new "
                    f"token); shorten the prompt{context_hint(llm)}")
        engine.add_request(prompt, params, request_id=engine_id)
    except CupyLlamaError as e:
        return f"line {request.line}: {e}"
    return None


def result_object(request_id, output) -> dict:
    return {"id": request_id, "text": output.text,
            "usage": {"prompt_tokens": len(output.prompt_token_ids),
                      "completion_tokens": len(output.token_ids)},
            "finish_reason": output.finish_reason}


def _write_ready(results: list, out, start: int) -> int:
    """Write results[start:] up to the first one not finished yet; returns the new start."""
    while start < len(results) and results[start] is not None:
        out.write(json.dumps(results[start], ensure_ascii=False) + "\n")
        start += 1
    out.flush()
    return start
