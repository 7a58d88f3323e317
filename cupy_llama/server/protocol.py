"""The OpenAI protocol: one request model and one response builder per endpoint, free of
HTTP, so the server and a batch front end reading OpenAI batch files build the same bodies
from the same plain dicts and RequestOutputs.

A request body (a dict) becomes prompts plus SamplingParams here, and engine outputs
become OpenAI JSON, the same way for either endpoint:

    request = parse(CompletionRequest, body)              # APIError(400) if malformed
    prompts, params = request.engine_inputs(tokenizer, vocab_size, max_model_len, defaults)
    ... run them: one list of RequestOutputs (the n choices) per prompt ...
    request.response_body(new_id(request.ID_PREFIX), created, "model", outputs, token_strings)

A line of an OpenAI batch file ({"custom_id", "method", "url", "body"}) goes the same way
through parse_batch_request, and its answer into batch_output / batch_error_output.

Fields a client sends that this module does not know are ignored (clients send many);
known fields that would change what is generated and are not done here are a 400 naming
the field (UNSUPPORTED). A null is the field left out. Omitted sampling fields take the
model's generation_config.json defaults, greedy unless it says do_sample, as everywhere in
cupy-llama.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
import secrets
from dataclasses import fields, replace
from pathlib import Path
from typing import Annotated, Any, ClassVar, get_args

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError,
                      model_validator)

from ..errors import CupyLlamaError, RequestError
from ..outputs import is_token_id, json_logprob
from ..reasoning import ReasoningParser, ReasoningSplitter, split_reasoning
from ..sampling import MAX_LOGPROBS, MAX_N, SamplingParams
from ..structured import StructuredSpec
from ..tokenizer import check_template_kwargs, part_text_key
from ..tool_choice import (check_tool_choice, check_tools, template_tools, tool_call_grammar,
                           tool_choice_of_function_call, tools_of_functions)
from ..tool_parsers import (PARSER_NAMES, SPECIAL_TAG_PARSERS, make_tool_parser,
                            parse_tool_calls, tool_parser_for_template)
from ..util import counted, json_type

SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# A generation the server had to cut short (it is shutting down) reports "length": the text
# is cut, not finished, as when max_tokens cuts it. OpenAI's finish reasons have no "abort".
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "length",
                  "tool_calls": "tool_calls", "function_call": "function_call"}


class APIError(Exception):
    """An error answered in OpenAI's shape {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def new_id(prefix: str) -> str:
    """A response or request id: the prefix and 32 random hex digits."""
    return f"{prefix}{secrets.token_hex(16)}"


def request_error(message: str) -> APIError:
    """A message of the engine's own checks (SamplingParams, the scheduler, a constraint's
    compiler) as a 400; a message that starts with a field's name ("top_p must ...",
    "structured_outputs.grammar: the grammar ...") names that field."""
    first = re.split(r"[ :.\[]", message, maxsplit=1)[0]
    named = first in SAMPLING_FIELDS or first in CONSTRAINT_FIELDS
    return APIError(400, message, param=first if named else None)


# the request fields a constraint comes from (structured_spec; tool_call_grammar's, the
# tools' schemas): a compiler's message starts with the one it quotes
CONSTRAINT_FIELDS = frozenset({"response_format", "structured_outputs", "guided_json",
                               "guided_regex", "guided_choice", "guided_grammar", "grammar",
                               "json_schema", "tool_choice", "tools"})


# ---- parsing --------------------------------------------------------------------------

class _Model(BaseModel):
    # unknown fields are ignored; known ones have exactly their JSON types (no "5" for 5)
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, data):
        """A null for a field with a default that is no null (n, stream, logprobs, ...) is
        the field left out: OpenAI's API marks those fields nullable, and clients that
        write every unset field send null for them."""
        if isinstance(data, dict):
            defaulted = _null_defaults(cls)
            if any(value is None and key in defaulted for key, value in data.items()):
                data = {key: value for key, value in data.items()
                        if value is not None or key not in defaulted}
        return data


@functools.cache
def _null_defaults(model: type[BaseModel]) -> frozenset:
    """The fields of a request model that have a default and do not take null."""
    return frozenset(name for name, field in model.model_fields.items()
                     if not field.is_required() and field.annotation is not Any
                     and type(None) not in get_args(field.annotation))


def _integral(value):
    """5.0 is the integer 5: JSON Schema counts a number with a zero fraction as an
    integer, and OpenAI's API takes it; 5.5 stays a float, which an integer field refuses."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


# an integer field: an int, or a float with a zero fraction (never a string or a bool)
Int = Annotated[int, BeforeValidator(_integral)]
SEED_RANGE = (-2**63, 2**64)  # vLLM's signed 64-bit seeds, and the device's unsigned ones


def parse(model: type[_Model], body) -> _Model:
    """Validate a decoded JSON body; APIError(400) naming the first field at fault."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got "
                            f"{json_type(body)}")
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None
    request.check_supported()
    return request


def validation_error(e: ValidationError) -> APIError:
    """The first problem in the client's words: the field's path, what it must be (each
    form a union field takes, where none took the value) and what came; then how many
    other problems there were."""
    errors = e.errors(include_url=False)
    first = errors[0]
    loc = first["loc"]
    # a field of several forms (str | list[str]) adds each form's tag to the path
    cut = next((i for i, part in enumerate(loc) if _is_form_tag(part)), len(loc))
    path = _field_path(loc[:cut])
    counted = [first]
    if first["type"] == "missing":
        message = f"{path} is required"
    elif cut < len(loc):
        counted = [err for err in errors if len(err["loc"]) > cut and err["loc"][:cut] == loc[:cut]
                   and _is_form_tag(err["loc"][cut])]
        forms = list(dict.fromkeys(_form_words(err["loc"][cut]) for err in counted))
        whole = next((err for err in counted if len(err["loc"]) == cut + 1), first)
        message = f"{path} must be {' or '.join(forms)}"
        if "input" in whole:
            message += f" (got {_preview(whole['input'])})"
    else:
        words = _TYPE_WORDS.get(first["type"]) or _bound_words(first)
        message = f"{path} must {words}" if words else f"{path}: {first['msg']}"
        if "input" in first:
            message += f" (got {_preview(first['input'])})"
    others = len(errors) - len(counted)
    if others:
        message += f"; and {others} more problem{'s' if others > 1 else ''}"
    return APIError(400, message, param=path or None)


# the type errors of pydantic, and the tags it gives a union's forms, in the client's words
_TYPE_WORDS = {kind: f"be {words}" for kind, words in (
    ("string_type", "a string"), ("int_type", "an integer"), ("int_from_float", "an integer"),
    ("int_parsing", "an integer"), ("float_type", "a number"), ("bool_type", "true or false"),
    ("list_type", "an array"), ("dict_type", "an object"), ("model_type", "an object"),
    ("model_attributes_type", "an object"))}
_FORM_WORDS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
               "none": "null"}
# pydantic's bound errors: (the context's key, the client's words for the bound)
_BOUND_WORDS = {"less_than_equal": ("le", "be at most"), "less_than": ("lt", "be below"),
                "greater_than_equal": ("ge", "be at least"), "greater_than": ("gt", "be above"),
                "too_short": ("min_length", "hold at least"),
                "too_long": ("max_length", "hold at most")}


def _bound_words(error: dict) -> str | None:
    """A bound's error in the client's words ("be at most 20", "hold at least 1 item"), or
    None for another kind of error."""
    key, words = _BOUND_WORDS.get(error["type"], (None, None))
    bound = (error.get("ctx") or {}).get(key)
    if bound is None:
        return None
    if error["type"] in ("too_short", "too_long"):
        return f"{words} {bound} item{'s' if bound != 1 else ''}"
    return f"{words} {bound}"


def _is_form_tag(part) -> bool:
    """Whether a part of an error's location names one form of a union field (str,
    list[str], a model's class name) rather than a field or an index."""
    return isinstance(part, str) and (part in _FORM_WORDS or "[" in part or part[:1].isupper())


def _form_words(tag: str) -> str:
    if tag in _FORM_WORDS:
        return _FORM_WORDS[tag]
    inner = re.fullmatch(r"list\[(\w+)\]", tag)
    if inner:
        return "an array" + (f" of {_FORM_WORDS[inner[1]].split(' ', 1)[1]}s"
                             if inner[1] in ("str", "int", "float") else "")
    if tag.startswith("list["):
        return "an array"
    return "an object"  # a model's class name, or a dict


def _field_path(loc) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _preview(value, limit: int = 60) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        text = json_type(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _default_output(default: int | None, model_defaults: dict) -> int | None:
    """The output length of a request that names none: the endpoint's default (None: what
    the context leaves) lowered to the model's own (generation_config.json's
    max_new_tokens) where it has one, as vLLM takes it: below OpenAI's 16 of a completion,
    in place of a chat's whole room."""
    model_default = model_defaults.get("max_tokens")
    if model_default is None:
        return default
    return model_default if default is None else min(default, model_default)


# ---- known fields this server does not do ---------------------------------------------

def _off(*harmless):
    """The field is fine when absent or one of these values (which change nothing)."""
    return lambda value, request: value in harmless or value is None


# request fields handed to SamplingParams as they are (null: left out), which checks them
PASSED_FIELDS = ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
                 "min_tokens", "stop_token_ids", "include_stop_str_in_output",
                 "skip_special_tokens", "spaces_between_special_tokens", "bad_words",
                 "allowed_token_ids")

# field -> whether its value is one this server can honour (it changes nothing)
UNSUPPORTED = {
    "audio": _off(), "modalities": _off(["text"]), "web_search_options": _off(),
    # vLLM's sampling extensions beside those done here (PASSED_FIELDS)
    "use_beam_search": _off(False),
}


class _Unsupported:
    """Declares the UNSUPPORTED fields a request model knows (as Any: any value that is not
    harmless is refused by name, whatever its type)."""

    def check_supported(self) -> None:
        for name in type(self).model_fields:
            allowed = UNSUPPORTED.get(name)
            value = getattr(self, name)
            if allowed is not None and not allowed(value, self):
                raise APIError(400, f"{name} is not supported by this server (got "
                                    f"{_preview(value)}); remove it from the request",
                               param=name, code="unsupported_parameter")


class StreamOptions(_Model):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool = False


class _SamplingFields(_Unsupported, _Model):
    """What completions and chat completions share."""
    model: str | None = None      # left out: the one model this server serves, as vLLM does
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None      # vLLM's extension; -1 means off (SamplingParams reads it)
    min_p: float | None = None
    seed: Int | None = None       # any signed or unsigned 64-bit integer; -1: none (vLLM's)
    stop: str | list[str] | None = None
    n: Int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None       # accepted and not used: it changes no output
    frequency_penalty: Any = None
    presence_penalty: Any = None
    logit_bias: Any = None
    repetition_penalty: Any = None
    min_tokens: Any = None
    stop_token_ids: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    prompt_logprobs: Int | None = None  # vLLM's: each prompt token's log-probability
    use_beam_search: Any = None
    # structured outputs (structured_spec): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* fields, llama.cpp's grammar and json_schema
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    best_of: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    grammar: Any = None       # llama.cpp's: a GBNF grammar
    json_schema: Any = None   # llama.cpp's: a JSON schema
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:N"
    truncate_prompt_tokens: Int | None = None  # vLLM's: keep the prompt's last k tokens

    def check_supported(self) -> None:
        super().check_supported()
        if not 1 <= self.n <= MAX_N:  # before best_of, whose samples would hide it
            raise APIError(400, f"n must be an integer from 1 to {MAX_N} (choices per prompt), "
                                f"got {_preview(self.n)}", param="n")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true",
                           param="stream_options")
        if self.prompt_logprobs is not None and self.stream:  # as vLLM refuses it
            raise APIError(400, "prompt_logprobs is not available with stream: true; ask "
                                "for it without streaming", param="prompt_logprobs")
        k = self.truncate_prompt_tokens
        if k is not None and not (k == -1 or k >= 1):
            raise APIError(400, f"truncate_prompt_tokens must be -1 (the model's context) or "
                                f"a positive number of tokens, got {k}",
                           param="truncate_prompt_tokens")
        low, high = SEED_RANGE
        if self.seed is not None and not low <= self.seed < high:
            raise APIError(400, f"seed must be an integer in [-2^63, 2^64), got "
                                f"{_preview(self.seed)}",
                           param="seed")

    def prompt_byte_limit(self, max_prompt_bytes: int | None) -> int | None:
        """The text a prompt may hold before it is tokenized: none where it is truncated to
        its last tokens (the body's size limit still holds)."""
        return None if self.truncate_prompt_tokens is not None else max_prompt_bytes

    def output_asked(self) -> tuple[str, int | None, int | None]:
        """(the field that asks for output tokens, its value, the default where it is left
        out; None: what the context leaves)."""
        raise NotImplementedError

    def truncated(self, prompt: list[int], max_model_len: int,
                  model_defaults: dict) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens. -1: as many as the
        context holds beside the output asked for (vLLM's max_model_len - max_tokens), so
        a max_tokens that fits is never refused for the prompt's length. Where it is left
        out, a prompt that fits stays whole (the reply gets the room left, up to its
        default length, as without truncation), and a longer one keeps room for that
        default (the endpoint's, lowered to the model's own)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return prompt
        if k == -1:
            field, requested, default = self.output_asked()
            if requested is None:
                if len(prompt) < max_model_len:
                    return prompt
                asked = _default_output(default, model_defaults)
                if asked is None or asked >= max_model_len:  # no room for a reply
                    raise APIError(400, f"truncate_prompt_tokens -1 keeps {max_model_len} "
                                        f"prompt tokens (the context limit) when {field} is "
                                        f"left out, which leaves no room for a reply; send "
                                        f"{field} (-1 then keeps room for it) or a "
                                        f"truncate_prompt_tokens below {max_model_len}",
                                   param="truncate_prompt_tokens",
                                   code="context_length_exceeded")
                return prompt[-(max_model_len - asked):]
            if requested >= max_model_len:
                raise APIError(400, f"{field} {requested} leaves no room for the prompt that "
                                    f"truncate_prompt_tokens -1 keeps in the context limit of "
                                    f"{max_model_len}; ask for at most {max_model_len - 1} "
                                    f"tokens", param=field, code="context_length_exceeded")
            # (a requested value below 1 is refused by name with the sampling parameters)
            k = max_model_len - max(requested, 1)
        if k > max_model_len:
            raise APIError(400, f"truncate_prompt_tokens ({k}) is more than the model's context "
                                f"({max_model_len} tokens); send at most {max_model_len}, or -1",
                           param="truncate_prompt_tokens")
        return prompt[-k:]

    def token_names(self, token_strings):
        """What names the tokens of this request's logprobs (TokenStrings): their texts, or
        with return_tokens_as_token_ids "token_id:N"."""
        if self.return_tokens_as_token_ids and token_strings is not None:
            return token_strings.by_id()
        return token_strings

    def structured_spec(self) -> StructuredSpec | None:
        """The request's constraint: at most one of response_format (json_object or
        json_schema), structured_outputs, guided_json, guided_regex, guided_choice,
        guided_grammar, and llama.cpp's grammar (GBNF) and json_schema. A 400 naming the
        field for one that is malformed."""
        specs = []
        for name, make in (("response_format", StructuredSpec.from_response_format),
                           ("structured_outputs", StructuredSpec.from_structured_outputs),
                           ("guided_json", StructuredSpec.json),
                           ("guided_regex", StructuredSpec.regex),
                           ("guided_choice", StructuredSpec.choice),
                           ("guided_grammar", StructuredSpec.grammar),
                           ("grammar", StructuredSpec.gbnf),
                           ("json_schema", StructuredSpec.json)):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                spec = make(value, name)
            except RequestError as e:
                raise APIError(400, str(e), param=name) from None
            if spec is not None:
                specs.append((name, spec))
        if len(specs) > 1:
            raise APIError(400, f"{specs[0][0]} and {specs[1][0]} both constrain the output; "
                                f"send one of them", param=specs[1][0])
        return specs[0][1] if specs else None

    @property
    def samples_per_prompt(self) -> int:
        """The engine's samples of each prompt: n (best_of's where it asks for more)."""
        return self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: usage on every chunk (with include_usage, as
        vLLM asks)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def prompt_logprobs_wanted(self) -> int | None:
        """The prompt log-probabilities the engine computes: vLLM's prompt_logprobs."""
        return self.prompt_logprobs

    def _sampling_params(self, max_tokens_field: str, requested: int | None,
                         num_prompt_tokens: int, max_model_len: int, model_defaults: dict,
                         default_max_tokens: int | None, prompt_field: str,
                         logprobs: int | None, structured=None,
                         end_token_ids=()) -> SamplingParams:
        """structured: the constraint, where it is not the request's own (structured_spec),
        such as the grammar of a tool_choice; end_token_ids: tokens that end the output
        beside the request's stop_token_ids (those closing a fill-in-the-middle)."""
        if num_prompt_tokens < 1:  # a chat template that renders nothing (texts: _encode)
            raise APIError(400, f"{prompt_field}: the prompt is empty (no tokens); give at "
                                f"least one token of text", param=prompt_field)
        room = max_model_len - num_prompt_tokens
        if room < 1:
            raise APIError(400, f"the prompt has {num_prompt_tokens} tokens but the context "
                                f"limit is {max_model_len} (prompt plus at least one new "
                                f"token); shorten the prompt", param=prompt_field,
                           code="context_length_exceeded")
        if requested is None:
            default_max_tokens = _default_output(default_max_tokens, model_defaults)
            max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        elif requested < 1:
            raise APIError(400, f"{max_tokens_field} must be at least 1, got {_preview(requested)}",
                           param=max_tokens_field)
        elif requested > room:
            total = _preview(num_prompt_tokens + requested)
            raise APIError(400, f"{counted(num_prompt_tokens, 'prompt token')} + "
                                f"{max_tokens_field} {_preview(requested)} = {total} tokens, "
                                f"past the context limit of {max_model_len}; ask for at most "
                                f"{room} tokens or shorten the prompt",
                           param=max_tokens_field, code="context_length_exceeded")
        else:
            max_tokens = requested
        wanted = self.min_tokens
        if requested is None and type(wanted) is int and wanted > max_tokens:
            # the max_tokens in the way is none the client gave: say where it comes from
            if wanted > room:
                raise APIError(400, f"min_tokens {wanted} is more than the {room} tokens the "
                                    f"context limit of {max_model_len} leaves after the "
                                    f"{counted(num_prompt_tokens, 'prompt token')}; ask for "
                                    f"at most {room} or shorten the prompt", param="min_tokens")
            raise APIError(400, f"min_tokens {wanted} is more than {max_tokens_field}, "
                                f"{max_tokens} when it is left out; send {max_tokens_field} "
                                f"of at least {wanted}", param="min_tokens")
        values = {name: getattr(self, name) for name in
                  ("temperature", "top_p", "top_k", "min_p", "seed", "stop", *PASSED_FIELDS)
                  if getattr(self, name) is not None}
        if values.get("seed", -1) != -1:  # -1: no seed, which SamplingParams reads; another
            values["seed"] %= 2**64        # negative seed names the unsigned one of its bits
        if end_token_ids and isinstance(values.get("stop_token_ids", []), list):
            asked = values.get("stop_token_ids", [])
            values["stop_token_ids"] = asked + [t for t in end_token_ids if t not in asked]
        values["max_tokens"] = max_tokens
        values["ignore_eos"] = self.ignore_eos
        values["logprobs"] = logprobs
        values["n"] = self.samples_per_prompt
        if self.samples_per_prompt > self.n and logprobs is None:
            values["logprobs"] = 0  # best_of ranks the samples by their tokens' logprobs
        values["prompt_logprobs"] = self.prompt_logprobs_wanted()
        values["structured"] = structured or self.structured_spec()
        if self.allowed_token_ids is not None and values["structured"] is not None:
            other = "tool_choice" if structured is not None else \
                values["structured"].source.split(".")[0].split("[")[0]
            raise APIError(400, f"allowed_token_ids and {other} both constrain the output; "
                                "send one of them", param="allowed_token_ids")
        try:
            return SamplingParams.from_dict(values, model_defaults)
        except RequestError as e:
            raise request_error(str(e)) from None


# ---- log-probabilities ----------------------------------------------------------------

def logprob_entries(logprobs) -> list[tuple]:
    """(token id, log-probability, [(id, log-probability), ...]) for each token, from a
    RequestOutput's TokenLogprobs or the tuples the server carries."""
    return [(e.token_id, e.logprob, e.top) if hasattr(e, "token_id") else e
            for e in logprobs or ()]


def completion_logprobs(entries, token_strings, text_offset: int = 0) -> tuple[dict, int]:
    """The legacy completions form: parallel lists, top_logprobs as {token: logprob}; and
    the text offset after these tokens (text offsets count from the completion's start).
    As OpenAI's legacy completions and vLLM give them, a position's top_logprobs holds the
    `logprobs` most likely tokens and the sampled token when it is not among them (up to
    logprobs + 1 entries; logprobs 0: the sampled token alone)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, logprob, top in entries:
        name = token_strings(token_id)
        tokens.append(name)
        token_logprobs.append(json_logprob(logprob))
        alternatives = {token_strings(t): json_logprob(lp) for t, lp in top}
        if all(t != token_id for t, _ in top):
            alternatives.setdefault(name, json_logprob(logprob))
        top_logprobs.append(alternatives)
        offsets.append(text_offset)
        text_offset += len(token_strings.text(token_id))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}, text_offset


def chat_logprobs(entries, token_strings) -> dict:
    def item(token_id, logprob):
        text = token_strings(token_id)
        return {"token": text, "logprob": json_logprob(logprob),
                "bytes": token_strings.bytes_of(token_id)}

    return {"content": [{**item(token_id, logprob),
                         "top_logprobs": [item(t, lp) for t, lp in top]}
                        for token_id, logprob, top in entries],
            "refusal": None}


# ---- /v1/completions ------------------------------------------------------------------

class CompletionRequest(_SamplingFields):
    ID_PREFIX: ClassVar[str] = "cmpl-"
    prompt: Any = Field()  # a string, strings, token ids or lists of them: checked below
    max_tokens: Int | None = None
    logprobs: Int | None = None
    echo: Any = None
    add_special_tokens: bool = True  # vLLM's: false leaves the tokenizer's BOS out of a text
    # the text after the gap, for fill-in-the-middle: each prompt is the text before it and
    # the completion the middle ("" or null: none)
    suffix: Any = None
    _fim_end_ids: list = PrivateAttr(default_factory=list)
    _cut: bool = PrivateAttr(False)  # truncate_prompt_tokens shortened a prompt

    def prompt_token_ids(self, tokenizer, vocab_size: int,
                         max_prompt_bytes: int | None = None) -> list[list[int]]:
        """One list of ids per prompt: strings are tokenized as a completion prompt is
        (with the tokenizer's special tokens, BOS, unless add_special_tokens is false),
        token ids are checked. A string longer
        than max_prompt_bytes (PromptLimit) is refused before it is tokenized. With a
        suffix, each prompt string and the suffix make the model's fill-in-the-middle
        prompt (Tokenizer.encode_fim)."""
        prompt = self.prompt
        if self.suffix:
            return self._fim_prompts(tokenizer, max_prompt_bytes)
        special = self.add_special_tokens
        if isinstance(prompt, str):
            return [_encode(tokenizer, prompt, "prompt", max_prompt_bytes, special)]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) for p in prompt):
                return [_encode(tokenizer, p, f"prompt[{i}]", max_prompt_bytes, special)
                        for i, p in enumerate(prompt)]
            if all(_is_token_id(t) for t in prompt):
                return [_check_ids(prompt, vocab_size, "prompt")]
            if all(isinstance(p, list) for p in prompt):
                return [_check_ids(p, vocab_size, f"prompt[{i}]") for i, p in enumerate(prompt)]
        if isinstance(prompt, list) and not prompt:
            raise APIError(400, "prompt is an empty list; send a string, a list of strings, "
                                "token ids or a list of token-id lists", param="prompt")
        raise APIError(400, f"prompt must be a string, a list of strings, a list of token "
                            f"ids or a list of token-id lists (got {_preview(prompt)})",
                       param="prompt")

    def _fim_prompts(self, tokenizer, max_prompt_bytes: int | None) -> list[list[int]]:
        if tokenizer.fim_format is None:
            raise APIError(400, "suffix needs fill-in-the-middle tokens, and this model has "
                                "none (its tokenizer has none of the known sets, such as "
                                "<|fim_prefix|>, <fim_prefix>, <PRE> or [SUFFIX]); remove "
                                "suffix", param="suffix", code="unsupported_parameter")
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        if not (isinstance(prompts, list) and prompts
                and all(isinstance(p, str) for p in prompts)):
            raise APIError(400, "suffix needs the prompt as text (a string or a list of "
                                f"strings), got {_preview(self.prompt)}", param="suffix")
        self._fim_end_ids = tokenizer.fim_end_token_ids
        where = ["prompt"] if isinstance(self.prompt, str) else \
            [f"prompt[{i}]" for i in range(len(prompts))]
        fim_prompts = []
        for text, param in zip(prompts, where):
            whole = text + self.suffix
            if max_prompt_bytes is not None and len(whole) * 4 > max_prompt_bytes:
                check_prompt_bytes(len(whole.encode("utf-8", "surrogatepass")),
                                   max_prompt_bytes, param)
            try:
                fim_prompts.append(tokenizer.encode_fim(text, self.suffix))
            except RequestError as e:
                raise APIError(400, f"{param}: {e}", param=param) from None
        return fim_prompts

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo is not None and not isinstance(self.echo, bool):
            raise APIError(400, f"echo must be true or false, got {_preview(self.echo)}",
                           param="echo")
        if self.suffix is not None and not isinstance(self.suffix, str):
            raise APIError(400, f"suffix must be a string (the text after the gap), got "
                                f"{_preview(self.suffix)}", param="suffix")
        if self.suffix and self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported beside suffix (the "
                                "prompt's tokens are its fill-in-the-middle form, not the "
                                "text echoed); leave out echo or logprobs", param="suffix")
        if self.best_of is not None:
            if not _is_token_id(self.best_of) or not self.n <= self.best_of <= MAX_N:
                raise APIError(400, f"best_of must be an integer from n ({self.n}) to {MAX_N}, "
                                    f"got {_preview(self.best_of)}", param="best_of")
            if self.best_of > self.n and self.stream:
                raise APIError(400, "best_of past n is not supported with stream: true (as "
                                    "OpenAI's API)", param="best_of")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens must be at least 1, got 0 (0 only scores the "
                                "prompt, with echo: true)", param="max_tokens")

    @property
    def samples_per_prompt(self) -> int:
        """best_of samples where it asks for more than n: the n with the highest cumulative
        log-probability are answered (best_outputs)."""
        return max(self.n, int(self.best_of or 0))

    def best_outputs(self, prompt_outputs: list) -> list:
        """The n answered samples of one prompt: all of them, or with best_of the n whose
        tokens have the highest summed log-probability, as choices 0..n-1 (best first)."""
        if self.samples_per_prompt == self.n:
            return prompt_outputs
        ranked = sorted(prompt_outputs, key=lambda o: (
            -sum(logprob for _, logprob, _ in logprob_entries(o.logprobs)), _index(o)))
        keep = self.logprobs is not None
        return [replace(o, index=j, logprobs=o.logprobs if keep else None)
                for j, o in enumerate(ranked[:self.n])]

    @property
    def scores_only(self) -> bool:
        """max_tokens 0 with echo: the prompt scored, nothing generated (the engine makes
        one token, which the answer leaves out)."""
        return self.max_tokens == 0 and bool(self.echo)

    def prompt_logprobs_wanted(self) -> int | None:
        """echo with logprobs scores the prompt with as many alternatives (OpenAI's legacy
        completions); vLLM's prompt_logprobs may ask for more."""
        wanted = [k for k in (self.prompt_logprobs,
                              self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

    def output_asked(self) -> tuple[str, int | None, int | None]:
        """max_tokens left out: OpenAI's 16 (what the context leaves if less)."""
        return ("max_tokens", 1 if self.scores_only else self.max_tokens,
                COMPLETION_DEFAULT_MAX_TOKENS)

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int,
                        model_defaults: dict) -> SamplingParams:
        """max_tokens left out: OpenAI's 16, or what the context leaves if less."""
        field, requested, default = self.output_asked()
        return self._sampling_params(field, requested, num_prompt_tokens,
                                     max_model_len, model_defaults,
                                     default, "prompt", self.logprobs,
                                     end_token_ids=self._fim_end_ids)

    def prompt_texts(self, prompts: list[list[int]], token_strings) -> list[str]:
        """What echo puts before each completion: the prompt as sent (token ids, or a
        prompt cut by truncate_prompt_tokens: decoded)."""
        if not self._cut and isinstance(self.prompt, str):
            return [self.prompt]
        if not self._cut and all(isinstance(p, str) for p in self.prompt):
            return list(self.prompt)
        tokenizer = token_strings._tokenizer
        return [tokenizer.decode_unchecked([t for t in ids if t < tokenizer.vocab_size],
                                           skip_special_tokens=False) for ids in prompts]

    def engine_inputs(self, tokenizer, vocab_size: int, max_model_len: int,
                      model_defaults: dict, max_prompt_bytes: int | None = None
                      ) -> tuple[list[list[int]], list[SamplingParams]]:
        """Each prompt's token ids and SamplingParams: one engine request per prompt."""
        whole = self.prompt_token_ids(tokenizer, vocab_size,
                                      self.prompt_byte_limit(max_prompt_bytes))
        prompts = [self.truncated(p, max_model_len, model_defaults) for p in whole]
        self._cut = any(len(p) < len(w) for p, w in zip(prompts, whole))
        return prompts, [self.sampling_params(len(p), max_model_len, model_defaults)
                         for p in prompts]

    def response_body(self, response_id: str, created: int, model: str, outputs: list[list],
                      token_strings=None, fingerprint: str | None = None) -> dict:
        return completion_response(self, response_id, created, model, outputs, token_strings,
                                   fingerprint)


def max_bytes_per_token(tokenizer) -> int:
    """The most UTF-8 bytes of text one token of this vocabulary stands for, at most: no
    token's spelling is shorter in bytes than the text it encodes (a byte-level token spells
    each byte with one character of one or two bytes, SentencePiece's spells a space with
    three). So a text of more than this many bytes per context token cannot fit."""
    return max(1, max(len((tokenizer.id_to_token(i) or "").encode("utf-8", "replace"))
                      for i in range(tokenizer.vocab_size)))


def check_prompt_bytes(num_bytes: int, max_prompt_bytes: int | None, param: str) -> None:
    """Refuse a prompt too long to fit the context before tokenizing it (tokenizing a
    prompt of megabytes takes seconds)."""
    if max_prompt_bytes is not None and num_bytes > max_prompt_bytes:
        raise APIError(400, f"{param} has {num_bytes:,} bytes of text, more than the context "
                            f"can hold ({max_prompt_bytes:,} bytes at most for this model's "
                            "vocabulary); shorten the prompt", param=param,
                       code="context_length_exceeded")


def _encode(tokenizer, text: str, param: str, max_prompt_bytes: int | None = None,
            add_special_tokens: bool = True) -> list[int]:
    if max_prompt_bytes is not None and len(text) * 4 > max_prompt_bytes:  # else it fits
        check_prompt_bytes(len(text.encode("utf-8", "surrogatepass")), max_prompt_bytes, param)
    try:
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except RequestError as e:
        raise APIError(400, f"{param}: {e}", param=param) from None
    if not ids:  # an empty text, and no BOS (this tokenizer's, or add_special_tokens false)
        raise APIError(400, f"{param} is empty: the text makes no tokens; give at least one "
                            f"character", param=param)
    return ids


def _is_token_id(value) -> bool:
    """A token id: an int, or a float with a zero fraction (JSON Schema's integer)."""
    return is_token_id(value) or (type(value) is float and value.is_integer())


def _check_ids(ids: list, vocab_size: int, param: str) -> list[int]:
    if not ids:
        raise APIError(400, f"{param} is an empty list of token ids; give at least one",
                       param=param)
    if all(type(t) is int for t in ids) and min(ids) >= 0 and max(ids) < vocab_size:
        return ids  # every id fine: the common case, checked in C-speed passes
    for token_id in ids:
        if not _is_token_id(token_id):
            raise APIError(400, f"{param} must hold only token ids (integers), got "
                                f"{_preview(token_id)}", param=param)
        if not 0 <= token_id < vocab_size:
            raise APIError(400, f"{param}: token id {_preview(token_id)} is outside the "
                                f"vocabulary [0, {vocab_size})", param=param)
    return [int(token_id) for token_id in ids]


def completion_response(request: CompletionRequest, response_id: str, created: int,
                        model: str, outputs: list[list], token_strings=None,
                        fingerprint: str | None = None) -> dict:
    """The body of a non-streamed completion. outputs: for each prompt, its RequestOutputs
    (one per choice). Choice i * n + j is prompt i's choice j."""
    choices = []
    echo = bool(request.echo)
    token_strings = request.token_names(token_strings)
    usage = usage_of(outputs)  # every sample best_of made counts
    outputs = [request.best_outputs(group) for group in outputs]
    if request.scores_only:  # the one token made to score the prompt is not shown, nor
        # what it would have ended on (an EOS drawn there is no stop the client asked for)
        outputs = [[replace(o, token_ids=[], text="", logprobs=[] if o.logprobs is not None
                            else None, finish_reason="length", stop_reason=None)
                    for o in group] for group in outputs]
    prompt_texts = request.prompt_texts([g[0].prompt_token_ids for g in outputs if g],
                                        token_strings) if echo else []
    for i, prompt_outputs in enumerate(outputs):
        for output in sorted(prompt_outputs, key=_index):
            logprobs, offset, text = None, 0, output.text
            if echo:  # the prompt, the completion, and the suffix after it (OpenAI's)
                text = prompt_texts[i] + text + (request.suffix or "")
                if request.logprobs is not None:
                    logprobs, offset = prompt_completion_logprobs(
                        output.prompt_token_ids, output.prompt_scores, request.logprobs,
                        token_strings)
            if request.logprobs is not None:
                generated, _ = completion_logprobs(logprob_entries(output.logprobs),
                                                   token_strings, offset)
                logprobs = generated if logprobs is None else {
                    key: logprobs[key] + generated[key] for key in logprobs}
            choice = {"index": i * request.n + _index(output), "text": text,
                      "logprobs": logprobs,
                      "finish_reason": FINISH_REASONS[output.finish_reason],
                      "stop_reason": output.stop_reason}
            if request.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(
                    output.prompt_token_ids, output.prompt_scores, request.prompt_logprobs,
                    token_strings)
            choices.append(choice)
    if request.scores_only:  # the token made to score the prompt is not the client's
        usage = usage_of(outputs)
    return {"id": response_id, "object": "text_completion", "created": created,
            "model": model, "system_fingerprint": fingerprint, "choices": choices,
            "usage": usage}


def prompt_completion_logprobs(prompt_ids, scored, k: int, token_strings) -> tuple[dict, int]:
    """echo's part of the legacy logprobs: one entry per prompt token, the first with
    token_logprobs and top_logprobs null (nothing comes before it), the others with the
    token's log-probability and the k most likely tokens there (and the token itself, as
    for generated ones); text offsets from 0. scored: the prompt's PromptScores (read as
    arrays, no object per token), or None. Returns it and the offset after the prompt."""
    tokens = [token_strings(t) for t in prompt_ids]
    offsets, offset = [], 0
    for token_id in prompt_ids:
        offsets.append(offset)
        offset += len(token_strings.text(token_id))
    token_logprobs, top_logprobs = [None] * len(tokens), [None] * len(tokens)
    if scored is not None:
        ids, values, _ = scored.rows()
        for position, (row_ids, row_values) in enumerate(zip(ids, values), start=1):
            if position >= len(tokens):
                break
            logprob = json_logprob(row_values[0])
            token_logprobs[position] = logprob
            alternatives = {token_strings(t): json_logprob(lp)
                            for t, lp in zip(row_ids[1:1 + k], row_values[1:1 + k])}
            if row_ids[0] not in row_ids[1:1 + k]:
                alternatives.setdefault(tokens[position], logprob)
            top_logprobs[position] = alternatives
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}, offset


def vllm_prompt_logprobs(prompt_ids, scored, k: int, token_strings) -> list | None:
    """vLLM's prompt_logprobs: per prompt token, null for the first, then {token id: {
    "logprob", "rank", "decoded_token"}} for the token and the k most likely there (rank
    1 the most likely, the token's own wherever it ranks). scored: the prompt's
    PromptScores, or None."""
    if scored is None:
        return None
    result = [None] * len(prompt_ids)
    ids, values, ranks = scored.rows()
    for position, (row_ids, row_values, rank) in enumerate(zip(ids, values, ranks), start=1):
        if position >= len(prompt_ids):
            break
        token_id, top = row_ids[0], row_ids[1:]
        items = {str(token_id): {"logprob": json_logprob(row_values[0]), "rank": rank,
                                 "decoded_token": token_strings.text(token_id)}}
        for rank, (t, lp) in enumerate(zip(top[:k], row_values[1:1 + k]), start=1):
            items.setdefault(str(t), {"logprob": json_logprob(lp), "rank": rank,
                                      "decoded_token": token_strings.text(t)})
        result[position] = items
    return result


# Characters that JSON and server-sent events let stand inside a string but that end a
# line for a client that splits lines as Python's str.splitlines does (httpx's and
# requests' iter_lines): escaped, so that such a client reads every event whole. (The other
# breaks of str.splitlines are control characters, which JSON escapes anyway.)
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _one_line(json_text: str) -> str:
    """JSON text written with ensure_ascii=False, with _LINE_BREAKS escaped."""
    return json_text if json_text.isascii() else json_text.translate(_LINE_BREAKS)


def sse_event(body: dict) -> bytes:
    """One server-sent event of a JSON body (compact, UTF-8, one line for any client)."""
    text = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + _one_line(text).encode() + b"\n\n"


# a text whose JSON form no chunk's other fields hold: it marks where a chunk's text goes
# (_Stream._text_in_event)
_TEXT_MARK = "\x00\x01text"
_TEXT_MARK_JSON = json.dumps(_TEXT_MARK).encode()
# a str as JSON, as json.dumps(ensure_ascii=False) writes it inside a body (the encoder's
# own function, without making an encoder a call)
_json_string = json.encoder.encode_basestring


class _Stream:
    """What the streams of both endpoints share: each chunk's head (id, object, created,
    model, system_fingerprint) and one choice; "usage" on every chunk when the request
    asked for usage (null, or with vLLM's continuous_usage_stats the choice's usage so far),
    and usage_chunk() last. A choice's last chunk has vLLM's stop_reason beside its
    finish_reason (the stop string or stop token id that ended it, or null)."""
    OBJECT = ""

    def __init__(self, request, response_id: str, created: int, model: str, token_strings,
                 fingerprint: str | None = None):
        self.include_usage = request.include_usage
        self.continuous_usage = request.continuous_usage
        self._token_strings = request.token_names(token_strings)
        self._head = {"id": response_id, "object": self.OBJECT, "created": created,
                      "model": model, "system_fingerprint": fingerprint}
        # per choice: a plain text chunk's event before and after its text (_text_in_event)
        self._text_events: dict[int, tuple[bytes, bytes] | None] = {}

    def chunks(self, index: int, text: str, token_ids: list[int], logprobs,
               finish_reason: str | None, usage: dict | None = None,
               stop_reason: str | int | None = None) -> list[dict]:
        """The chunks that carry a choice's new text (token_ids: the new tokens; logprobs:
        their (token id, log-probability, top) entries; usage: the choice's usage so far;
        stop_reason: with a finish_reason, the choice's)."""
        return [self.chunk(index, text, logprobs, finish_reason, usage, stop_reason)]

    def opening(self, index: int, prompt_index: int, prompts: list[list[int]], scored,
                usage: dict | None = None) -> list[dict]:
        """The chunks that come before a choice's first text (prompts: every prompt's
        token ids; scored: prompt prompt_index's log-probabilities, where computed)."""
        return []

    def text_event(self, index: int, text: str, finish_reason: str | None,
                   usage: dict | None) -> bytes | None:
        """The events of chunks(index, text, ..., finish_reason, usage) where they are one
        plain text chunk, encoded without building it, or None where chunks() must build
        them (log-probabilities, when asked, make every chunk a built one)."""
        return None

    def _text_chunk(self, index: int, text: str) -> dict:
        """The chunk of a piece of text alone (text_event's kind)."""
        raise NotImplementedError

    def _text_in_event(self, index: int, text: str) -> bytes | None:
        """Most chunks of a stream carry a piece of text and nothing else that changes.
        Their event is the choice's head and tail around the text's JSON, made once from
        the _text_chunk of a mark: per token, one string to encode instead of a dict. None
        where the mark's JSON is in another field (the model's name, say)."""
        parts = self._text_events.get(index, False)
        if parts is False:
            pieces = sse_event(self._text_chunk(index, _TEXT_MARK)).split(_TEXT_MARK_JSON)
            parts = self._text_events[index] = tuple(pieces) if len(pieces) == 2 else None
        if parts is None:
            return None
        return parts[0] + _one_line(_json_string(text)).encode() + parts[1]

    def _chunk(self, index: int, finish_reason: str | None, usage: dict | None,
               stop_reason: str | int | None = None, **fields) -> dict:
        choice = {"index": index, **fields,
                  "finish_reason": None if finish_reason is None else FINISH_REASONS[finish_reason]}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        body = {**self._head, "choices": [choice]}
        if self.include_usage:
            body["usage"] = usage if self.continuous_usage else None
        return body

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head, "choices": [], "usage": usage}


class CompletionStream(_Stream):
    """The chunks of a streamed completion, in order: chunks() for each new piece of a
    choice's text, usage_chunk() last when request.include_usage."""
    OBJECT = "text_completion"

    def __init__(self, request: CompletionRequest, response_id: str, created: int,
                 model: str, token_strings=None, fingerprint: str | None = None):
        super().__init__(request, response_id, created, model, token_strings, fingerprint)
        self._request = request
        self._wants_logprobs = request.logprobs is not None
        self._text_offsets: dict[int, int] = {}  # per choice: where its next token starts
        self._prompt_texts: list[str] | None = None  # echo's, made at the first opening
        # text chunks without log-probabilities or echo's scores may be text_events
        self._plain_text = not (self._wants_logprobs or request.scores_only)

    def opening(self, index: int, prompt_index: int, prompts: list[list[int]], scored,
                usage: dict | None = None) -> list[dict]:
        """echo: the prompt's text (and its legacy logprobs, text offsets from the prompt's
        start) in one chunk, before the completion's; the completion's offsets go on from
        the prompt's end (what completion_response puts in one body)."""
        request = self._request
        if not request.echo:
            return []
        if self._prompt_texts is None:
            self._prompt_texts = request.prompt_texts(prompts, self._token_strings)
        logprobs = None
        if self._wants_logprobs:
            logprobs, self._text_offsets[index] = prompt_completion_logprobs(
                prompts[prompt_index], scored, request.logprobs, self._token_strings)
        return [self._chunk(index, None, self._scores_only_usage(usage),
                            text=self._prompt_texts[prompt_index], logprobs=logprobs)]

    def chunks(self, index: int, text: str, token_ids: list[int], logprobs,
               finish_reason: str | None, usage: dict | None = None,
               stop_reason: str | int | None = None) -> list[dict]:
        if self._request.scores_only:  # the one token made to score the prompt is not shown
            text, logprobs = "", None if logprobs is None else []
            if finish_reason is not None:  # max_tokens 0 ended it, whatever that token was
                finish_reason, stop_reason = "length", None
        if finish_reason is not None and self._request.echo and self._request.suffix:
            text += self._request.suffix  # echo ends with the suffix, as completion_response
        return [self.chunk(index, text, logprobs, finish_reason,
                           self._scores_only_usage(usage), stop_reason)]

    def text_event(self, index: int, text: str, finish_reason: str | None,
                   usage: dict | None) -> bytes | None:
        """A chunk of text alone: no log-probabilities asked, not the last, no usage so
        far, not echo's scores."""
        if finish_reason is not None or usage is not None or not self._plain_text:
            return None
        return self._text_in_event(index, text)

    def _text_chunk(self, index: int, text: str) -> dict:
        return self.chunk(index, text, None, None)

    def usage_chunk(self, usage: dict) -> dict:
        return super().usage_chunk(self._scores_only_usage(usage))

    def _scores_only_usage(self, usage: dict | None) -> dict | None:
        """max_tokens 0 with echo: the token made to score the prompt is not the client's."""
        if usage is None or not self._request.scores_only:
            return usage
        return {**usage, "completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}

    def chunk(self, index: int, text: str, logprobs, finish_reason: str | None,
              usage: dict | None = None, stop_reason: str | int | None = None) -> dict:
        choice_logprobs = None
        if self._wants_logprobs:
            choice_logprobs, self._text_offsets[index] = completion_logprobs(
                logprob_entries(logprobs), self._token_strings, self._text_offsets.get(index, 0))
        return self._chunk(index, finish_reason, usage, stop_reason, text=text,
                           logprobs=choice_logprobs)


# ---- /v1/chat/completions -------------------------------------------------------------

# "developer": the system role renamed; "function": the deprecated functions API's tool role
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user",
              "assistant": "assistant", "tool": "tool", "function": "tool"}


class ChatMessage(_Model):
    role: str
    content: Any = None        # a string or [{"type": "text", "text": ...}, ...]: checked below
    name: str | None = None
    tool_calls: Any = None     # an assistant's calls: passed to the chat template as they are
    tool_call_id: Any = None   # a tool message's: the call it answers
    function_call: Any = None  # an assistant's call in the deprecated functions API
    # an assistant's thinking, as a reasoning parser answered it (vLLM's two names): the
    # chat template takes it under both (Qwen3's keeps the thinking of a tool-call loop)
    reasoning: str | None = None
    reasoning_content: str | None = None


class _ChatPrompt:
    """What makes a chat's prompt, as chat completions and /tokenize take it: the messages
    through the chat template (the model's, or the request's chat_template), with vLLM's
    add_generation_prompt, continue_final_message and chat_template_kwargs."""

    def check_chat_options(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both "
                                "be true; send add_generation_prompt: false to continue the "
                                "last message", param="continue_final_message")
        try:
            check_template_kwargs(self.chat_template_kwargs)
        except RequestError as e:
            raise APIError(400, str(e), param="chat_template_kwargs") from None

    def conversation(self) -> list[dict]:
        """The messages as the chat template takes them: {"role", "content"} with the
        content's text parts joined by newlines."""
        conversation = []
        last_call_id = None  # of the deprecated API's last call: what a "function" answers
        for i, message in enumerate(self.messages):
            where = f"messages[{i}]"
            role = CHAT_ROLES.get(message.role)
            if role is None:
                raise APIError(400, f"{where}.role {message.role!r} is not supported; use "
                                    f"system, developer, user, assistant, tool or function",
                               param=f"{where}.role")
            if message.role == "function":  # the deprecated API's answer to a call
                if not isinstance(message.name, str) or not message.name:
                    raise APIError(400, f"{where}.name is required: the function whose result "
                                        "this message holds", param=f"{where}.name")
                if message.content is None:
                    message = message.model_copy(update={"content": ""})
            entry = {"role": role, "content": _message_text(message, role, where)}
            if message.name is not None:
                entry["name"] = message.name
            if message.tool_calls is not None:  # the tokenizer checks their shape
                entry["tool_calls"] = message.tool_calls
            if message.function_call is not None:
                # made up (the deprecated API has no ids), in the one form every template
                # takes: Mistral's want 9 letters and digits
                last_call_id = f"call{i:05d}"
                entry["tool_calls"] = [_legacy_call(message, last_call_id, where)]
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            elif message.role == "function" and last_call_id is not None:
                entry["tool_call_id"] = last_call_id
            thinking = message.reasoning if message.reasoning is not None \
                else message.reasoning_content
            if thinking is not None:
                entry["reasoning"] = entry["reasoning_content"] = thinking
            conversation.append(entry)
        return conversation

    def template_tools(self, tokenizer) -> list | None:
        """The tools the chat template is shown (None: none)."""
        return None

    def prompt_token_ids(self, tokenizer, max_prompt_bytes: int | None = None) -> list[int]:
        """The prompt the model's chat template renders: ending in the assistant's turn
        (add_generation_prompt), or in the last message left open (continue_final_message);
        with vLLM's add_special_tokens, the tokenizer's special tokens (BOS) put around it
        as around a plain text, on top of the template's own. Messages of more text than
        max_prompt_bytes are refused before they are rendered."""
        conversation = self.conversation()
        if max_prompt_bytes is not None:
            texts = [text for message in conversation for text in _rendered_texts(message)]
            if sum(map(len, texts)) * 4 > max_prompt_bytes:  # else they fit, whatever they hold
                check_prompt_bytes(sum(len(text.encode("utf-8", "surrogatepass"))
                                       for text in texts), max_prompt_bytes, "messages")
        try:
            ids = tokenizer.encode_chat(conversation,
                                        add_generation_prompt=self.add_generation_prompt,
                                        continue_final_message=self.continue_final_message,
                                        tools=self.template_tools(tokenizer),
                                        template_kwargs=self.chat_template_kwargs,
                                        chat_template=self.chat_template)
        except CupyLlamaError as e:  # the template refused the messages, or there is none
            param = "chat_template" if str(e).startswith("chat_template") else "messages"
            raise APIError(400, str(e), param=param) from None
        if self.add_special_tokens:
            ids = tokenizer.encode("", add_special_tokens=True) + ids
        return ids


def _rendered_texts(message: dict) -> list[str]:
    """The texts of a chat message that its template may render: its content, an
    assistant's thinking and its tool calls (as JSON, about their rendered size)."""
    texts = [message["content"]]
    if "reasoning" in message:  # reasoning_content is the same text
        texts.append(message["reasoning"])
    if "tool_calls" in message:
        texts.append(json.dumps(message["tool_calls"], ensure_ascii=False, default=str))
    return texts


class ChatCompletionRequest(_ChatPrompt, _SamplingFields):
    ID_PREFIX: ClassVar[str] = "chatcmpl-"
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True       # vLLM's
    continue_final_message: bool = False     # vLLM's
    chat_template_kwargs: dict | None = None  # vLLM's: more variables for the template
    chat_template: str | None = None  # vLLM's: a Jinja template instead of the model's
    add_special_tokens: bool = False  # vLLM's: BOS on top of the template's (prompt_token_ids)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    # OpenAI's deprecated forms of tools and tool_choice: the reply's one call comes back
    # as message.function_call (legacy_functions)
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    web_search_options: Any = None
    echo: Any = None
    include_reasoning: bool = True  # vLLM's: false leaves a reasoning model's thinking out
    # the server's --tool-call-parser (set_tool_parser), else the chat template's format
    _tool_parser_name: str | None = PrivateAttr(None)
    _exclude_tools_none: bool = PrivateAttr(False)  # --exclude-tools-when-tool-choice-none
    _checked_tools: list = PrivateAttr(default_factory=list)
    _tool_choice: Any = PrivateAttr("none")
    _tool_grammar: Any = PrivateAttr(None)
    _parser: str | None = PrivateAttr(None)
    _reasoning: Any = PrivateAttr(None)  # the server's --reasoning-parser (ReasoningParser)
    _thinks: bool = PrivateAttr(False)   # the reply starts by thinking (engine_inputs)

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, self.n):
            raise APIError(400, f"best_of is not supported by this server on chat completions "
                                f"(got {_preview(self.best_of)}); remove it from the request",
                           param="best_of", code="unsupported_parameter")
        if self.echo not in (None, False):  # vLLM's chat echo (legacy completions' is done)
            raise APIError(400, f"echo is not supported by this server on chat completions "
                                f"(got {_preview(self.echo)}); remove it from the request",
                           param="echo", code="unsupported_parameter")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        self.check_chat_options()
        if self.legacy_functions:
            older = "functions" if self.functions is not None else "function_call"
            for name in ("tools", "tool_choice"):
                if getattr(self, name) is not None:
                    raise APIError(400, f"{older} and {name} are both given; send tools and "
                                        "tool_choice, or functions and function_call (their "
                                        "deprecated form)", param=older)
        try:
            if self.legacy_functions:
                self._checked_tools = tools_of_functions(self.functions)
                self._tool_choice = tool_choice_of_function_call(self.function_call,
                                                                 self._checked_tools)
            else:
                self._checked_tools = check_tools(self.tools)
                self._tool_choice = check_tool_choice(self.tool_choice, self._checked_tools)
        except RequestError as e:
            field = str(e).split(" ", 1)[0].split(".", 1)[0].split("[", 1)[0]
            raise APIError(400, str(e), param=field) from None

    def set_tool_parser(self, name: str | None, exclude_tools_when_none: bool = False) -> None:
        """The server's --tool-call-parser (None: the chat template's format) and its
        --exclude-tools-when-tool-choice-none."""
        self._tool_parser_name = name
        self._exclude_tools_none = exclude_tools_when_none

    def set_reasoning_parser(self, parser: ReasoningParser | None) -> None:
        """The server's --reasoning-parser: replies are split into reasoning and content
        (None: all content)."""
        self._reasoning = parser

    @property
    def legacy_functions(self) -> bool:
        """The request speaks the deprecated functions API: its reply's call is answered as
        message.function_call (one call: that API has no parallel calls), finish_reason
        "function_call"."""
        return self.functions is not None or self.function_call is not None

    @property
    def uses_tools(self) -> bool:
        """Calls may be made (tool_choice is not "none"): replies are parsed for them."""
        return self._tool_choice != "none"

    def template_tools(self, tokenizer) -> list | None:
        """The tools the chat template is shown, "none" or not (tool_choice.template_tools),
        unless the server excludes them from "none" requests."""
        if self._exclude_tools_none and self._tool_choice == "none":
            return None
        return template_tools(tokenizer, self._checked_tools, self._tool_choice,
                              self.chat_template, self.chat_template_kwargs)

    def tool_parser(self, tokenizer) -> str:
        """The name of the parser of this model's tool calls: 400 where the server has none
        and the chat template shows no format."""
        name = self._tool_parser_name or tool_parser_for_template(
            tokenizer.tools_template(self.chat_template))
        if name is None:
            field = "functions" if self.legacy_functions else "tools"
            refusal = tokenizer.tools_refusal(self._checked_tools, self.chat_template,
                                              self.chat_template_kwargs)
            if refusal is not None:  # the template refuses tools: no parser would help
                raise APIError(400, f"{field}: {refusal}", param=field)
            raise APIError(400, f"{field}: the model's chat template shows no tool-call format "
                                "this server knows; start it with --tool-call-parser "
                                f"({', '.join(PARSER_NAMES)})", param=field)
        return name

    def output_asked(self) -> tuple[str, int | None, int | None]:
        """max_completion_tokens (or the older max_tokens) left out: what the context
        leaves."""
        field = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        return field, getattr(self, field), None

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int,
                        model_defaults: dict) -> SamplingParams:
        """max_completion_tokens (or the older max_tokens) left out: what the context leaves."""
        field, requested, default = self.output_asked()
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        params = self._sampling_params(field, requested, num_prompt_tokens,
                                       max_model_len, model_defaults, default, "messages",
                                       logprobs, structured=self._tool_grammar)
        if ((self.uses_tools and self._parser in SPECIAL_TAG_PARSERS)
                or (self._reasoning is not None and self._reasoning.special)):
            # the reply's text keeps the special token its calls start with (vLLM's
            # Mistral parser asks the same), or the thinking's markers, so that stop
            # strings and the parsers read one text
            params = replace(params, skip_special_tokens=False)
        if self._thinks and params.structured is not None:  # the answer is constrained,
            params = replace(params, structured=replace(    # not the thinking before it
                params.structured, starts_after=self._reasoning.end_token))
        return params

    def engine_inputs(self, tokenizer, vocab_size: int, max_model_len: int,
                      model_defaults: dict, max_prompt_bytes: int | None = None
                      ) -> tuple[list[list[int]], list[SamplingParams]]:
        """The one prompt (the rendered conversation) and its SamplingParams, in lists as
        CompletionRequest gives them."""
        self._tool_grammar = None
        if self.uses_tools:
            self._parser = self.tool_parser(tokenizer)
            parallel = False if self.legacy_functions else self.parallel_tool_calls
            self._tool_grammar = tool_call_grammar(
                self._parser, self._checked_tools, self._tool_choice, parallel,
                token_id=tokenizer.token_to_id)
            if self._tool_grammar is not None and self.structured_spec() is not None:
                choice = "function_call" if self.legacy_functions else "tool_choice"
                what = "function_call naming a function" if self.legacy_functions else \
                    "tool_choice \"required\" or a named function"
                raise APIError(400, f"{what} sets the answer's grammar; leave out "
                                    "response_format and structured_outputs", param=choice)
        prompt = self.truncated(self.prompt_token_ids(
            tokenizer, self.prompt_byte_limit(max_prompt_bytes)), max_model_len, model_defaults)
        if not prompt and self.chat_template is not None:
            raise APIError(400, "chat_template renders these messages as no text; a prompt "
                                "needs at least one token", param="chat_template")
        self._thinks = self._reasoning is not None and self._reasoning.thinks(
            prompt, self.chat_template_kwargs)
        return [prompt], [self.sampling_params(len(prompt), max_model_len, model_defaults)]

    def new_reasoning_splitter(self) -> ReasoningSplitter | None:
        """A streamed choice's splitter of thinking from answer, where replies are split."""
        if self._reasoning is None:
            return None
        return ReasoningSplitter(self._reasoning, self._thinks)

    def split_reasoning(self, text: str, token_ids: list[int]
                        ) -> tuple[str | None, str | None]:
        """A whole reply (its text and tokens) as (reasoning, content); (None, text) where
        replies are not split."""
        if self._reasoning is None:
            return None, text
        return split_reasoning(self._reasoning, text, token_ids, self._thinks)

    def with_reasoning(self, message: dict, reasoning: str | None) -> dict:
        """A message or delta with the reasoning beside its content, where replies are
        split, under both names clients read: vLLM's `reasoning` and DeepSeek's
        `reasoning_content` (a delta only where it has some)."""
        if self._reasoning is None:
            return message
        shown = reasoning if self.include_reasoning else None
        return {**message, "reasoning": shown, "reasoning_content": shown}

    def new_stream_parser(self):
        """A streamed choice's tool-call parser, where replies are parsed; else None."""
        if not self.uses_tools:
            return None
        return make_tool_parser(self._parser, max_calls=self.max_calls)

    @property
    def max_calls(self) -> int | None:
        """The calls a reply keeps: 1 for parallel_tool_calls false (as vLLM, the first;
        the grammar of "required" or a named function writes one anyway), else all."""
        return 1 if self.parallel_tool_calls is False else None

    def response_body(self, response_id: str, created: int, model: str, outputs: list[list],
                      token_strings=None, fingerprint: str | None = None) -> dict:
        """outputs: one list, the prompt's RequestOutputs (as engine_inputs has one prompt)."""
        (choices,) = outputs
        return chat_completion_response(self, response_id, created, model, choices,
                                        token_strings, fingerprint)


def _message_text(message: ChatMessage, role: str, where: str) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            here = f"{where}.content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            key = part_text_key(kind, role)
            if kind != key:
                got = _preview(kind) if isinstance(part, dict) else json_type(part)
                allowed = "'text' or 'refusal'" if role == "assistant" else "'text'"
                raise APIError(400, f"{here}.type must be {allowed} (got {got}): only text "
                                    "content is supported", param=f"{here}.type")
            if not isinstance(part.get(key), str):
                raise APIError(400, f"{here}.{key} must be a string", param=f"{here}.{key}")
            texts.append(part[key])
        return "\n".join(texts)
    raise APIError(400, f"{where}.content must be a string or a list of "
                        f"{{\"type\": \"text\", \"text\": ...}} parts (got {json_type(content)})",
                   param=f"{where}.content")


def _legacy_call(message: ChatMessage, call_id: str, where: str) -> dict:
    """An assistant message's function_call {"name", "arguments"} (the deprecated functions
    API) as the one tool call it stands for."""
    call, here = message.function_call, f"{where}.function_call"
    if message.role != "assistant":
        raise APIError(400, f"{here}: only assistant messages call functions (this one is "
                            f"{message.role!r})", param=here)
    if message.tool_calls is not None:
        raise APIError(400, f"{here}: send tool_calls or function_call, not both", param=here)
    if (not isinstance(call, dict) or not isinstance(call.get("name"), str)
            or not call["name"] or not isinstance(call.get("arguments", ""), str)):
        raise APIError(400, f"{here} must be {{\"name\": ..., \"arguments\": \"<JSON text>\"}}, "
                            f"got {_preview(call)}", param=here)
    return {"id": call_id, "type": "function",
            "function": {"name": call["name"], "arguments": call.get("arguments", "{}")}}


def chat_completion_response(request: ChatCompletionRequest, response_id: str, created: int,
                             model: str, outputs: list, token_strings=None,
                             fingerprint: str | None = None) -> dict:
    """The body of a non-streamed chat completion; outputs: the RequestOutputs, one per
    choice. A choice's logprobs hold top_logprobs alternatives per token, as OpenAI's chat
    API gives them (the sampled token is not added to them, unlike legacy completions)."""
    choices = []
    token_strings = request.token_names(token_strings)
    for output in sorted(outputs, key=_index):
        logprobs = chat_logprobs(logprob_entries(output.logprobs), token_strings) \
            if request.logprobs else None
        reasoning, content = request.split_reasoning(output.text, output.token_ids)
        message = {"role": "assistant", "content": content}
        finish_reason = FINISH_REASONS[output.finish_reason]
        if request.uses_tools:  # calls are the answer's: the thinking is not parsed
            parsed = parse_tool_calls(content or "", request._parser,
                                      max_calls=request.max_calls)
            message = legacy_message(parsed) if request.legacy_functions else parsed.to_openai()
            if parsed.tool_calls and finish_reason == "stop":
                finish_reason = "function_call" if request.legacy_functions else "tool_calls"
        message = request.with_reasoning(message, reasoning)
        choices.append({"index": _index(output), "message": message, "logprobs": logprobs,
                        "finish_reason": finish_reason, "stop_reason": output.stop_reason})
    body = {"id": response_id, "object": "chat.completion", "created": created,
            "model": model, "system_fingerprint": fingerprint, "choices": choices,
            "usage": usage_of([outputs])}
    if request.prompt_logprobs is not None and outputs:  # vLLM's, beside the choices
        first = min(outputs, key=_index)
        body["prompt_logprobs"] = vllm_prompt_logprobs(
            first.prompt_token_ids, first.prompt_scores, request.prompt_logprobs,
            token_strings)
    return body


def legacy_message(parsed) -> dict:
    """A parsed reply as the deprecated functions API answers it: its first call as
    message.function_call {"name", "arguments"} (that API has no parallel calls; a model
    that writes more under function_call "auto" has the rest left out)."""
    message = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        call = parsed.tool_calls[0]
        message["function_call"] = {"name": call.name, "arguments": call.arguments}
    return message


def legacy_delta(parsed) -> dict:
    """A streamed StreamDelta as the deprecated functions API streams it: the first call's
    pieces as delta.function_call, its name in the first ({"name", "arguments"}), then
    {"arguments"} with more of them."""
    delta = {"content": parsed.content} if parsed.content else {}
    pieces = [entry for entry in parsed.tool_calls if entry.index == 0]
    if pieces:
        call = {"arguments": "".join(entry.arguments for entry in pieces)}
        named = [entry.name for entry in pieces if entry.id is not None]
        if named:
            call = {"name": named[0], **call}
        delta["function_call"] = call
    return delta


class ChatCompletionStream(_Stream):
    """The chunks of a streamed chat completion: each choice opens with a chunk whose delta
    is {"role": "assistant", "content": ""}, as OpenAI sends it, and its text follows in the
    next ones; usage_chunk() last when request.include_usage. A reply that tool_choice
    makes all calls ("required", a named function) opens with "content": null, as its
    whole message has it and OpenAI streams a forced call."""
    OBJECT = "chat.completion.chunk"

    def __init__(self, request: ChatCompletionRequest, response_id: str, created: int,
                 model: str, token_strings=None, fingerprint: str | None = None):
        super().__init__(request, response_id, created, model, token_strings, fingerprint)
        self._wants_logprobs = request.logprobs
        self._started: set[int] = set()
        self._request = request
        self._tool_parsers: dict = {}  # choice index -> its ToolCallParser, with tools
        self._splitters: dict = {}  # choice index -> its ReasoningSplitter, where split
        # the request's settings that every chunk asks, read once: the server sets the
        # request's parsers before it makes the stream, and pydantic's private attributes
        # are slow to read per token
        self._splits_reasoning = request._reasoning is not None
        self._uses_tools = request.uses_tools
        # content chunks without log-probabilities, a reasoning split or tool calls may be
        # text_events
        self._plain_text = not (self._wants_logprobs or self._splits_reasoning
                                or self._uses_tools)
        self._opening = {"role": "assistant",
                         "content": None if request._tool_grammar is not None else ""}

    def chunks(self, index: int, text: str, token_ids: list[int], logprobs,
               finish_reason: str | None, usage: dict | None = None,
               stop_reason: str | int | None = None) -> list[dict]:
        chunks = []
        if index not in self._started:
            self._started.add(index)
            opening = None if usage is None else \
                {**usage, "completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}
            chunks.append(self._chunk(index, None, opening,
                                      delta=dict(self._opening), logprobs=None))
        chunk = self.chunk(index, text, token_ids, logprobs, finish_reason, usage, stop_reason)
        choice = chunk["choices"][0]
        if choice["delta"] or choice["logprobs"] is not None or finish_reason is not None:
            chunks.append(chunk)  # not one that carries nothing (a marker's token, say)
        return chunks

    def text_event(self, index: int, text: str, finish_reason: str | None,
                   usage: dict | None) -> bytes | None:
        """A chunk of content alone after the choice's opening one: no log-probabilities
        asked, not the last, no usage so far, no reasoning split or tool calls to parse
        (a piece of no text is no chunk)."""
        if (finish_reason is not None or usage is not None or not self._plain_text
                or index not in self._started):
            return None
        return self._text_in_event(index, text) if text else b""

    def _text_chunk(self, index: int, text: str) -> dict:
        return self._chunk(index, None, None, delta={"content": text}, logprobs=None)

    def chunk(self, index: int, text: str, token_ids: list[int], logprobs,
              finish_reason: str | None, usage: dict | None = None,
              stop_reason: str | int | None = None) -> dict:
        """A chunk of text after the choice's opening one (token_ids: the tokens that made
        it; the reasoning split reads them)."""
        choice_logprobs = chat_logprobs(logprob_entries(logprobs), self._token_strings) \
            if self._wants_logprobs else None
        reasoning = ""
        if self._splits_reasoning:
            splitter = self._splitters.get(index)
            if splitter is None:
                splitter = self._splitters[index] = self._request.new_reasoning_splitter()
            reasoning, text = splitter.feed(text, token_ids)
            if finish_reason is not None:
                last_reasoning, last_text = splitter.finish()
                reasoning, text = reasoning + last_reasoning, text + last_text
        delta = {"content": text} if text else {}
        if self._uses_tools:  # calls go out as delta.tool_calls, never as text
            parser = self._tool_parsers.get(index)
            if parser is None:
                parser = self._tool_parsers[index] = self._request.new_stream_parser()
            parsed = parser.feed(text)
            if finish_reason is not None:
                last = parser.finish()
                parsed.extend(last)
                if parser.result().tool_calls and finish_reason == "stop":
                    finish_reason = "function_call" if self._request.legacy_functions \
                        else "tool_calls"
            delta = legacy_delta(parsed) if self._request.legacy_functions \
                else parsed.to_openai()
        if reasoning and self._request.include_reasoning:
            delta = self._request.with_reasoning(delta, reasoning)
        return self._chunk(index, finish_reason, usage, stop_reason, delta=delta,
                           logprobs=choice_logprobs)


# ---- usage ----------------------------------------------------------------------------

def _index(output) -> int:
    return output.index


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """cached_tokens: prompt tokens whose KV the prefix cache held."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def usage_of(outputs: list[list]) -> dict:
    """Usage of one request: each prompt counts once (its cached tokens as the sample that
    computed it found them), every choice's tokens count."""
    firsts = [min(group, key=_index) for group in outputs if group]
    return usage(sum(len(o.prompt_token_ids) for o in firsts),
                 sum(len(o.token_ids) for group in outputs for o in group),
                 sum(o.num_cached_tokens for o in firsts))


# ---- /v1/models, /tokenize, /detokenize, /tokenizer_info ----------------------------------

def tokenizer_info(tokenizer, context_limit: int) -> dict:
    """vLLM's /tokenizer_info fields that a client needs to use /tokenize and /detokenize
    as its tokenizer."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token, "pad_token": None,
            "chat_template": tokenizer.chat_template, "model_max_length": context_limit}

# the files whose content makes the model's answers; weights are named by size and time
FINGERPRINT_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json", "chat_template.jinja")


def system_fingerprint(model_dir, device: str) -> str:
    """OpenAI's system_fingerprint: a value that changes when what makes the answers
    changes: the model (its configuration, tokenizer and chat template by content, its
    weight files by name, size and modification time), the device ("cpu" or "cuda", whose
    numerics differ) and cupy-llama's version."""
    from .. import __version__

    folder = Path(model_dir)
    digest = hashlib.sha256(f"cupy-llama {__version__} {device}".encode())
    for name in FINGERPRINT_FILES:
        path = folder / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        stat = path.stat()
        digest.update(f"{path.name} {stat.st_size} {stat.st_mtime_ns}".encode())
    return "fp_" + digest.hexdigest()[:10]


def model_list(name: str, created: int, max_model_len: int) -> dict:
    return {"object": "list", "data": [model_card(name, created, max_model_len)]}


def model_card(name: str, created: int, max_model_len: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "cupy-llama",
            "max_model_len": max_model_len}


class TokenizeRequest(_ChatPrompt, _Unsupported, _Model):
    """vLLM's /tokenize: {"prompt": text} (tokenized as a completion prompt is, with the
    tokenizer's special tokens unless add_special_tokens is false) or {"messages": [...]}
    (as a chat prompt is, through the chat template, with add_generation_prompt,
    continue_final_message and chat_template_kwargs as chat completions take them; there
    add_special_tokens, false by default, adds the tokenizer's special tokens on top of the
    template's). return_token_strs: each token's spelling too."""
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None   # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    chat_template: str | None = None
    tools: Any = None  # shown to the chat template, as chat completions show them
    return_token_strs: bool = False

    def template_tools(self, tokenizer) -> list | None:
        return check_tools(self.tools) or None

    def check_supported(self) -> None:
        super().check_supported()
        try:
            check_tools(self.tools)
        except RequestError as e:
            raise APIError(400, str(e), param="tools") from None
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give exactly one of prompt (a string) or messages (a chat)",
                           param="prompt")
        if self.prompt is not None:
            for name in ("add_generation_prompt", "continue_final_message",
                         "chat_template_kwargs", "chat_template"):
                if name in self.model_fields_set:
                    raise APIError(400, f"{name} applies to messages (a chat), not to a "
                                        "prompt; remove it", param=name)
        self.check_chat_options()

    def token_ids(self, tokenizer, max_prompt_bytes: int | None = None) -> list[int]:
        if self.messages is not None:
            return self.prompt_token_ids(tokenizer, max_prompt_bytes)
        if max_prompt_bytes is not None and len(self.prompt) * 4 > max_prompt_bytes:
            check_prompt_bytes(len(self.prompt.encode("utf-8", "surrogatepass")),
                               max_prompt_bytes, "prompt")
        try:
            return tokenizer.encode(self.prompt, add_special_tokens=self.add_special_tokens
                                    is not False)
        except RequestError as e:
            raise APIError(400, f"prompt: {e}", param="prompt") from None

    def response(self, tokenizer, token_ids: list[int], max_model_len: int) -> dict:
        body = tokenize_response(token_ids, max_model_len)
        body["token_strs"] = [tokenizer.id_to_token(t) for t in token_ids] \
            if self.return_token_strs else None
        return body


def tokenize_response(token_ids: list[int], max_model_len: int) -> dict:
    return {"tokens": token_ids, "count": len(token_ids), "max_model_len": max_model_len}


class DetokenizeRequest(_Unsupported, _Model):
    model: str | None = None
    tokens: list[Int]

    def text(self, tokenizer, vocab_size: int) -> str:
        """The ids' text, special tokens included (the inverse of /tokenize). Any id of the
        model's vocabulary or the tokenizer's is taken: those past the tokenizer's (a
        padded embedding table, as Qwen's) have no text, as in a completion's."""
        if not self.tokens:
            return ""
        ids = _check_ids(self.tokens, max(vocab_size, tokenizer.vocab_size), "tokens")
        known = tokenizer.vocab_size
        return tokenizer.decode_unchecked([t for t in ids if t < known],
                                          skip_special_tokens=False)


def detokenize_response(text: str) -> dict:
    return {"prompt": text}


# ---- OpenAI batch files ---------------------------------------------------------------
# A batch line {"custom_id", "method", "url", "body"} is the HTTP request it names, taken
# as the server takes it (`cupy-llama generate` runs such files), and its answer is
# OpenAI's batch output line around the response the server would send.

BATCH_URLS = {"/v1/chat/completions": ChatCompletionRequest,
              "/v1/completions": CompletionRequest}


def parse_batch_request(method, url, body) -> CompletionRequest | ChatCompletionRequest:
    """One batch line's request, parsed and checked as the server does. APIError as the
    server would answer the same request: 404 for a url it has no route for, 405 for a
    method other than POST, 400 for a body it refuses."""
    urls = " or ".join(BATCH_URLS)
    if url is None:
        raise APIError(400, f"url is required: {urls}", param="url")
    if not isinstance(url, str) or url not in BATCH_URLS:
        raise APIError(404, f"url {_preview(url)} is not supported; batch lines go to {urls}",
                       param="url", code="unsupported_url")
    if method is None:
        raise APIError(400, "method is required: POST", param="method")
    if method != "POST":
        raise APIError(405, f"method {_preview(method)} is not supported; batch lines are "
                            "POST requests", param="method", code="unsupported_method")
    if body is None:
        raise APIError(400, f"body is required: the request to {url}", param="body")
    request = parse(BATCH_URLS[url], body)
    # A line is answered with one response body: a stream of chunks has no place in the
    # output file, and answering with a body the request did not ask for would hide the
    # mistake. vLLM's run-batch refuses it too.
    if request.stream:
        raise APIError(400, "stream: true is not supported in a batch file (each line is "
                            "answered with one response body); remove stream",
                       param="stream", code="unsupported_parameter")
    return request


def batch_output(custom_id: str, body: dict) -> dict:
    """The output line of a batch request that ran: `body` with status 200."""
    return {"id": new_id("batch_req_"), "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": new_id("req_"), "body": body},
            "error": None}


def batch_error_output(custom_id: str, error: APIError) -> dict:
    """The output line of a refused batch request: the response the server would send (its
    status and OpenAI error body), and `error` {"code", "message"}. OpenAI's Batch API
    fills `error` only for failures outside the request (an expired batch) and leaves it
    null beside an error response; here every failed line has it, so that a reader that
    looks at `error` alone misses none."""
    return {"id": new_id("batch_req_"), "custom_id": custom_id,
            "response": {"status_code": error.status, "request_id": new_id("req_"),
                         "body": error.body()},
            "error": {"code": error.code or error.type, "message": error.message}}
