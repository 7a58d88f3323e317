"""Structured outputs: a constraint on what a sequence may generate (a JSON schema, any
JSON object, a regular expression, one of a list of strings, or a Lark grammar), enforced
token by token through an allowed-token bitmask (docs/ARCHITECTURE.md, "Structured outputs
and tools").

- `StructuredSpec` is a constraint as a request states it: a plain value that pickles,
  checked when it is made, needing nothing installed.
- `GrammarCompiler`, one per model, compiles specs with llguidance (the `structured` extra)
  and caches them by the spec's text. Front ends compile before they queue a request, so
  a spec that does not compile is a RequestError quoting the compiler, and the step loop
  never compiles (`compile_async` compiles on a worker thread where it must not wait).
- `GrammarMatcher`, one per constrained sequence, writes its row of a step's bitmask and
  advances by each sampled token. `AllowedTokensMatcher` (allowed_token_ids) and
  `BadWordsMatcher` (bad words of more than one token) have its interface;
  `CombinedMatcher` joins one of the first two with the last.

Bitmask layout: one row of uint32 words per constrained sequence; token t is allowed when
bit t % 32 of word t // 32 is set. A row holds `bitmask_words(vocab_size)` words for the
model's vocabulary, which may be larger than the tokenizer's (ids past the tokenizer have
no text and are never allowed). `apply_token_bitmask` is the reference of what the
sampling kernels do with it.

This module imports numpy only inside the functions that take arrays: sampling.py and the
scheduler's side import the spec and must stay free of numpy.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from .errors import RequestError
from .util import cdiv

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# vLLM's other structured_outputs fields, and the values of each that change nothing here
# (one backend, so no fallback to choose)
HARMLESS_OPTIONS = {"disable_fallback": (False, True), "disable_any_whitespace": (False,),
                    "disable_additional_properties": (False,)}
EXTRA_HINT = "pip install 'cupy-llama[structured]'"
# JSON output may hold at most this much whitespace at any one place: enough for
# pretty-printed JSON, and a bound on a model that would otherwise pad with newlines until
# max_tokens. A schema's own "x-guidance" whitespace settings take precedence.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{1,20}"
_X_GUIDANCE_WHITESPACE = ("whitespace_flexible", "whitespace_pattern")
# What each kind is called in messages.
_NOUNS = {"json": "JSON schema", "json_object": "JSON object constraint",
          "regex": "regular expression", "choice": "choice list", "grammar": "grammar"}
MAX_QUOTED_ERROR = 300  # characters of a compiler message quoted in an error


@dataclass(frozen=True)
class StructuredSpec:
    """A constraint on a sequence's output. Make one with the class methods (`json`,
    `json_object`, `regex`, `choice`, `grammar`) or from request fields
    (`from_structured_outputs`, `from_response_format`); `text` is the canonical text that
    identifies the compiled grammar (`key`). `source` names the request field it came from,
    for messages; it plays no part in equality."""
    kind: str
    text: str = ""
    source: str = field(default="structured", compare=False)
    # a token id: the constraint applies to the tokens after it, those up to it (a
    # reasoning model's thinking, ended by </think>) are free (ReasoningGate); None: all
    starts_after: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise RequestError(f"{self.source}: unknown kind {self.kind!r}; use one of "
                               f"{', '.join(KINDS)}")
        if not isinstance(self.text, str):
            raise RequestError(f"{self.source}: the constraint text must be a string")
        if self.starts_after is not None and not (
                type(self.starts_after) is int and self.starts_after >= 0):
            raise RequestError(f"{self.source}: starts_after must be a token id, got "
                               f"{self.starts_after!r}")

    # ---- makers -------------------------------------------------------------------------

    @classmethod
    def json(cls, schema, source: str = "structured") -> "StructuredSpec":
        """A JSON schema (a dict, or its JSON text). Properties come out in the schema's
        order, as llguidance generates them."""
        deep = RequestError(f"{source}: the JSON schema nests objects or arrays too deeply; "
                            f"use at most a few hundred levels ($defs and $ref name a "
                            f"repeated part)")
        if isinstance(schema, (str, bytes)):
            try:
                schema = json.loads(schema)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise RequestError(f"{source}: the JSON schema is not valid JSON ({e})") from None
            except RecursionError:
                raise deep from None
        if not isinstance(schema, dict):
            raise RequestError(f"{source} must be a JSON schema (a JSON object), got "
                               f"{_type_name(schema)}")
        try:
            text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"),
                              allow_nan=False)
        except (TypeError, ValueError) as e:
            raise RequestError(f"{source}: the JSON schema cannot be written as JSON "
                               f"({e})") from None
        except RecursionError:
            raise deep from None
        return cls("json", text, source)

    @classmethod
    def json_object(cls, source: str = "structured") -> "StructuredSpec":
        """Any JSON object."""
        return cls("json_object", "", source)

    @classmethod
    def regex(cls, pattern, source: str = "structured") -> "StructuredSpec":
        """Output that matches the whole regular expression (Rust regex syntax, which is
        Python's for everything but look-around and backreferences)."""
        if not isinstance(pattern, str) or not pattern:
            raise RequestError(f"{source} must be a non-empty regular expression (a "
                               f"string), got {_describe(pattern)}")
        return cls("regex", pattern, source)

    @classmethod
    def choice(cls, options, source: str = "structured") -> "StructuredSpec":
        """Output that is exactly one of the strings."""
        if (isinstance(options, (str, bytes)) or not isinstance(options, (list, tuple))
                or not options or not all(isinstance(o, str) for o in options)):
            raise RequestError(f"{source} must be a non-empty list of strings, got "
                               f"{_describe(options)}")
        return cls("choice", json.dumps(list(options), ensure_ascii=False), source)

    @classmethod
    def grammar(cls, text, source: str = "structured") -> "StructuredSpec":
        """A Lark grammar in llguidance's dialect (GBNF is converted)."""
        if not isinstance(text, str) or not text.strip():
            raise RequestError(f"{source} must be a non-empty grammar (a string), got "
                               f"{_describe(text)}")
        return cls("grammar", text, source)

    @classmethod
    def gbnf(cls, text, source: str = "grammar") -> "StructuredSpec":
        """A GBNF grammar (llama.cpp's, rooted at `root`), converted to the Lark grammar it
        is kept as with llguidance's converter (needs llguidance). Converted here, not left
        to the compiler's guess at the syntax: text in llama.cpp's `grammar` field is GBNF
        even where it would also read as Lark, and a converter error is quoted as such."""
        if not isinstance(text, str) or not text.strip():
            raise RequestError(f"{source} must be a non-empty GBNF grammar (a string), got "
                               f"{_describe(text)}")
        _llguidance()  # the converter ships with it: name the extra where it is missing
        from llguidance.gbnf_to_lark import gbnf_to_lark
        try:
            lark = gbnf_to_lark(text)
        except RecursionError:
            raise RequestError(f"{source}: the GBNF grammar is nested too deeply to "
                               f"convert") from None
        except Exception as e:  # the converter raises plain Exceptions for missing rules
            message = " ".join(str(e).split()) or type(e).__name__
            if len(message) > MAX_QUOTED_ERROR:
                message = message[:MAX_QUOTED_ERROR - 3] + "..."
            raise RequestError(f"{source}: the GBNF grammar does not convert: "
                               f"{message}") from None
        return cls("grammar", lark, source)

    @classmethod
    def from_structured_outputs(cls, value, source: str = "structured_outputs"
                                ) -> "StructuredSpec | None":
        """vLLM's `structured_outputs` object: exactly one of json, json_object (true),
        regex, choice, grammar; fields set to null count as left out. None for an object
        that sets none of them."""
        if isinstance(value, StructuredSpec) or value is None:
            return value
        if not isinstance(value, dict):
            raise RequestError(f"{source} must be an object with one of {', '.join(KINDS)}, "
                               f"got {_type_name(value)}")
        given = [key for key in KINDS if value.get(key) is not None]
        unknown = sorted(key for key, v in value.items() if key not in KINDS and v is not None
                         and not _harmless(key, v))
        if unknown:
            name = unknown[0]
            if name in HARMLESS_OPTIONS:
                taken = HARMLESS_OPTIONS[name]
                raise RequestError(f"{source}.{name} is not supported as "
                                   f"{json.dumps(value[name])} (only "
                                   f"{' or '.join(map(json.dumps, taken))}, which "
                                   f"{'changes' if len(taken) == 1 else 'change'} nothing "
                                   f"here); leave it out")
            raise RequestError(f"{source}.{name} is not supported; use one of "
                               f"{', '.join(KINDS)}")
        if len(given) > 1:
            raise RequestError(f"{source} sets {given[0]} and {given[1]}; set only one")
        if not given:
            return None
        kind = given[0]
        where = f"{source}.{kind}"
        if kind == "json_object":
            if value[kind] is not True:
                raise RequestError(f"{where} must be true, got {_describe(value[kind])}")
            return cls.json_object(where)
        return getattr(cls, kind)(value[kind], where)

    @classmethod
    def from_response_format(cls, value, source: str = "response_format"
                             ) -> "StructuredSpec | None":
        """OpenAI's `response_format`: {"type": "text"} (None: no constraint),
        {"type": "json_object"}, or {"type": "json_schema", "json_schema": {"name",
        "schema", "strict"}}."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise RequestError(f"{source} must be an object such as {{\"type\": "
                               f"\"json_object\"}}, got {_type_name(value)}")
        kind = value.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object(source)
        if kind == "json_schema":
            inner = value.get("json_schema")
            if not isinstance(inner, dict):
                raise RequestError(f"{source}.json_schema is missing; give {{\"name\": ..., "
                                   f"\"schema\": {{...}}}}")
            if inner.get("schema") is None:
                raise RequestError(f"{source}.json_schema.schema is missing; give the JSON "
                                   f"schema the answer must follow")
            return cls.json(inner["schema"], f"{source}.json_schema.schema")
        raise RequestError(f"{source}.type must be 'text', 'json_object' or 'json_schema', "
                           f"got {_describe(kind)}")

    # ---- what it is -------------------------------------------------------------------

    @property
    def key(self) -> str:
        """The text compiled grammars are cached by."""
        return f"{self.kind}:{self.text}"

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's own form (needs llguidance)."""
        llg = _llguidance()
        try:
            if self.kind == "json":
                schema = json.loads(self.text)
                own = schema.get("x-guidance") if isinstance(schema, dict) else None
                keeps_own = isinstance(own, dict) and any(k in own for k in _X_GUIDANCE_WHITESPACE)
                defaults = None if keeps_own else {"whitespace_pattern": JSON_WHITESPACE}
                return llg.LLMatcher.grammar_from_json_schema(self.text, defaults=defaults)
            if self.kind == "json_object":
                return llg.LLMatcher.grammar_from_json_schema(
                    '{"type": "object"}', defaults={"whitespace_pattern": JSON_WHITESPACE})
            if self.kind == "regex":
                return llg.LLMatcher.grammar_from_regex(self.text)
            if self.kind == "choice":
                return llg.grammar_from("choice", self.text)
            return llg.grammar_from("grammar", self.text)  # Lark as it is, GBNF converted
        except (ValueError, TypeError) as e:
            raise self._error(str(e)) from None

    def _error(self, message: str) -> RequestError:
        return RequestError(f"{self.source}: the {_NOUNS[self.kind]} does not compile: "
                            f"{compiler_message(message, self.kind)}")


class CompiledGrammar:
    """A spec compiled for one model's tokenizer: a fresh matcher to copy for each
    sequence (copying costs microseconds; compiling costs milliseconds)."""

    def __init__(self, spec: StructuredSpec, prototype, num_words: int):
        self.spec = spec
        self._prototype = prototype
        self._num_words = num_words

    def matcher(self) -> "GrammarMatcher":
        """A matcher at the start of the grammar, for one sequence."""
        return GrammarMatcher(self._prototype.deep_copy(), self._num_words, self.spec)


class GrammarMatcher:
    """The state of one constrained sequence: which tokens may come next.

    The engine keeps it equal to the sequence's known output tokens: `advance` by each
    token as it comes back from the device, before filling the mask of the step that
    follows it. A preempted sequence keeps its output tokens and is recomputed from them,
    so its matcher needs nothing on recompute; `rollback` is for tokens the engine takes
    back after advancing by them."""

    __slots__ = ("_matcher", "_num_words", "spec", "num_tokens")

    def __init__(self, matcher, num_words: int, spec: StructuredSpec):
        self._matcher = matcher
        self._num_words = num_words
        self.spec = spec
        self.num_tokens = 0  # tokens advanced by, less those rolled back

    def fill_bitmask(self, bitmask, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]`: bitmask is a 2-D array of
        4-byte words (uint32, or int32 holding the same bits) whose rows are contiguous and
        at least `bitmask_words(vocab_size)` words long; words past that are left alone.
        Once the grammar is complete (or the matcher failed) only EOS is allowed."""
        dtype = bitmask.dtype
        if dtype.kind not in "ui" or dtype.itemsize != 4 or bitmask.ndim != 2:
            raise ValueError(f"bitmask must be a 2-D array of uint32 words, got "
                             f"{bitmask.ndim}-D {dtype}")
        if bitmask.shape[1] < self._num_words or bitmask.strides[1] != 4:
            raise ValueError(f"bitmask rows must hold {self._num_words} contiguous words, "
                             f"got {bitmask.shape[1]} with stride {bitmask.strides[1]}")
        if not 0 <= row < bitmask.shape[0]:
            raise ValueError(f"row {row} is outside the bitmask's {bitmask.shape[0]} rows")
        if not bitmask.flags.writeable:
            raise ValueError("the bitmask is read-only")
        address = bitmask.ctypes.data + row * bitmask.strides[0]
        self._matcher.unsafe_compute_mask_ptr(address, 4 * self._num_words)

    def advance(self, token_id: int) -> bool:
        """Advance by a sampled token (EOS included). False when the grammar rejects it,
        which a token sampled under this matcher's mask never is: the matcher has then
        failed (`error` says why) and allows only EOS from there on."""
        accepted = self._matcher.consume_token(int(token_id))
        self.num_tokens += accepted
        return accepted

    @property
    def eos_allowed(self) -> bool:
        """Whether the output may end here: the grammar accepts what came so far."""
        return self._matcher.is_accepting()

    @property
    def is_complete(self) -> bool:
        """The grammar is satisfied and nothing may follow but EOS: the sequence is done
        (finish_reason "stop") without waiting for the model to sample EOS."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a rejected token), or None."""
        return compiler_message(self._matcher.get_error()) if self._matcher.is_error() else None

    def fork(self) -> "GrammarMatcher":
        """An independent copy in the same state (a sample of n > 1 that forks later than
        its prompt; samples forked at the prompt take fresh matchers)."""
        copy = GrammarMatcher(self._matcher.deep_copy(), self._num_words, self.spec)
        copy.num_tokens = self.num_tokens
        return copy

    def rollback(self, num_tokens: int) -> None:
        """Take back the last num_tokens tokens advanced by."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_tokens} tokens")
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: "
                               f"{compiler_message(self._matcher.get_error())}")
        self.num_tokens -= num_tokens


class AllowedTokensMatcher:
    """The matcher of a request's allowed_token_ids (vLLM's extension): the same fixed mask
    at every step, EOS in it only where the request lists it, never complete. It has
    GrammarMatcher's interface, so the engine draws such rows as it draws structured
    outputs', without llguidance. It keeps no state, so the samples of a request share one."""

    error = None
    is_complete = False
    eos_allowed = True  # the output may end anywhere (with EOS, where it is allowed)

    def __init__(self, token_ids, num_words: int):
        import numpy as np

        ids = np.asarray(sorted(set(token_ids)), dtype=np.int64)
        bits = np.zeros(num_words * 32, np.uint8)
        bits[ids] = 1
        self._row = np.packbits(bits, bitorder="little").view("<u4")
        self._ids = frozenset(ids.tolist())

    def fill_bitmask(self, bitmask, row: int) -> None:
        """bitmask[row] = the allowed tokens (the first num_words words)."""
        bitmask[row, :self._row.size] = self._row

    def advance(self, token_id: int) -> bool:
        return int(token_id) in self._ids

    def fork(self) -> "AllowedTokensMatcher":
        return self

    def rollback(self, num_tokens: int) -> None:
        pass


class BadWordsMatcher:
    """The matcher of a request's bad words of more than one token (vLLM's semantics): a
    word of tokens t1..tn bans tn at a step where the sequence's last n - 1 OUTPUT tokens
    are t1..t(n-1); prompt tokens never count. Words of one token are banned on the device
    (the slot's bias entries) and are not given here. It keeps the output tokens it has
    been advanced by, so each sample needs its own (`fork`). It has GrammarMatcher's
    interface; CombinedMatcher joins it with a grammar or allowed_token_ids."""

    is_complete = False
    eos_allowed = True  # bad words never say where the output ends

    def __init__(self, sequences, num_words: int):
        """sequences: the banned token sequences, each of two tokens or more."""
        bans: dict[int, dict[tuple, set]] = {}  # n - 1 -> {t1..t(n-1): {tn, ...}}
        for sequence in sequences:
            sequence = tuple(int(t) for t in sequence)
            if len(sequence) < 2:
                raise ValueError(f"a bad word sequence needs two tokens or more, got "
                                 f"{list(sequence)}")
            bans.setdefault(len(sequence) - 1, {}).setdefault(sequence[:-1], set()).add(
                sequence[-1])
        # shortest prefixes first: banned() stops at the first longer than the output
        self._bans = {length: {prefix: tuple(sorted(last)) for prefix, last in by.items()}
                      for length, by in sorted(bans.items())}
        self._num_words = num_words
        self._tokens: list[int] = []  # the output tokens advanced by (rollback needs all)
        self.error: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def banned(self) -> list[int]:
        """The tokens that may not come next: each sequence's last token where the output
        ends with the rest of it."""
        tokens, banned = self._tokens, []
        for length, prefixes in self._bans.items():
            if length > len(tokens):
                break
            banned.extend(prefixes.get(tuple(tokens[-length:]), ()))
        return banned

    def fill_bitmask(self, bitmask, row: int) -> None:
        """bitmask[row] = every token but the banned ones (the first num_words words)."""
        bitmask[row, :self._num_words] = 0xFFFFFFFF if bitmask.dtype.kind == "u" else -1
        self.clear_banned(bitmask, row)

    def clear_banned(self, bitmask, row: int) -> None:
        """Clear the banned tokens' bits in bitmask[row], leaving the others as they are (the
        AND of another matcher's row and this one's)."""
        import numpy as np

        words = bitmask[row].view(np.uint32)  # int32 rows hold the same bits
        for token in self.banned():
            words[token >> 5] &= ~np.uint32(1 << (token & 31))

    def advance(self, token_id: int) -> bool:
        """Advance by a sampled token. False for a token that ends a bad word, which a
        token sampled under this matcher's mask never is (`error` then says which)."""
        token_id = int(token_id)
        if token_id in self.banned():
            self.error = f"token {token_id} completes a bad word"
            return False
        self._tokens.append(token_id)
        return True

    def fork(self) -> "BadWordsMatcher":
        """An independent copy with the same output tokens (the bans are shared)."""
        copy = object.__new__(BadWordsMatcher)
        copy._bans, copy._num_words = self._bans, self._num_words
        copy._tokens, copy.error = list(self._tokens), self.error
        return copy

    def rollback(self, num_tokens: int) -> None:
        """Take back the last num_tokens tokens advanced by."""
        if not 0 <= num_tokens <= len(self._tokens):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self._tokens)} tokens")
        del self._tokens[len(self._tokens) - num_tokens:]


class CombinedMatcher:
    """A constraint's matcher (GrammarMatcher or AllowedTokensMatcher) and a
    BadWordsMatcher on one sequence: a token is allowed where both allow it (the AND of
    their masks); both advance, fork and roll back together; where the output may end and
    whether it is complete are the constraint's."""

    def __init__(self, constraint, bad_words: BadWordsMatcher):
        self.constraint = constraint
        self.bad_words = bad_words
        self._nothing_left = False  # the last row filled allowed no token at all

    def fill_bitmask(self, bitmask, row: int) -> None:
        self.constraint.fill_bitmask(bitmask, row)
        self.bad_words.clear_banned(bitmask, row)
        # the request's own settings can leave nothing to draw (allowed_token_ids that bad
        # words ban): the token drawn then is refused, and error says why
        self._nothing_left = not bitmask[row, :self.bad_words._num_words].any()

    def advance(self, token_id: int) -> bool:
        allowed = self.bad_words.advance(token_id)  # both advance, whatever either says
        return self.constraint.advance(token_id) and allowed

    @property
    def eos_allowed(self) -> bool:
        return self.constraint.eos_allowed

    @property
    def is_complete(self) -> bool:
        return self.constraint.is_complete

    @property
    def error(self) -> str | None:
        if self._nothing_left:
            return "bad_words ban every token the constraint allows here"
        return self.constraint.error or self.bad_words.error

    def fork(self) -> "CombinedMatcher":
        copy = CombinedMatcher(self.constraint.fork(), self.bad_words.fork())
        copy._nothing_left = self._nothing_left
        return copy

    def rollback(self, num_tokens: int) -> None:
        self.constraint.rollback(num_tokens)
        self.bad_words.rollback(num_tokens)


class ReasoningGate:
    """A constraint that begins after a token: a reasoning model's thinking, up to and
    including the token that ends it (</think>), is drawn under `free` (the whole
    vocabulary, EOS too); the constraint's matcher sees only the tokens after it, as vLLM
    applies structured outputs after the reasoning (docs/ARCHITECTURE.md, "Reasoning
    models")."""

    def __init__(self, constraint, end_token: int, free: AllowedTokensMatcher):
        self.constraint = constraint
        self.end_token = end_token
        self.free = free
        self.thinking = True
        self.num_thinking = 0  # tokens drawn free, the end token included
        self.num_after = 0     # tokens the constraint took

    def fill_bitmask(self, bitmask, row: int) -> None:
        (self.free if self.thinking else self.constraint).fill_bitmask(bitmask, row)

    def advance(self, token_id: int) -> bool:
        if not self.thinking:
            accepted = self.constraint.advance(token_id)
            self.num_after += accepted
            return accepted
        self.num_thinking += 1
        self.thinking = int(token_id) != self.end_token
        return True

    @property
    def eos_allowed(self) -> bool:
        return self.thinking or self.constraint.eos_allowed

    @property
    def is_complete(self) -> bool:
        return not self.thinking and self.constraint.is_complete

    @property
    def error(self) -> str | None:
        return None if self.thinking else self.constraint.error

    def fork(self) -> "ReasoningGate":
        copy = ReasoningGate(self.constraint.fork(), self.end_token, self.free)
        copy.thinking, copy.num_thinking, copy.num_after = \
            self.thinking, self.num_thinking, self.num_after
        return copy

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_thinking + self.num_after:
            raise ValueError(f"cannot roll back {num_tokens} of "
                             f"{self.num_thinking + self.num_after} tokens")
        after = min(num_tokens, self.num_after)
        self.constraint.rollback(after)
        self.num_after -= after
        if num_tokens > after:  # back into the thinking, its end token taken back
            self.num_thinking -= num_tokens - after
            self.thinking = True


class _TrieSource:
    """What llguidance builds a token trie from (its TokenizerWrapper protocol): each
    token's bytes as llguidance reads them from tokenizer.json, with only the tokens the
    tokenizer calls special marked special, and an encoder that writes special tokens'
    text with ordinary tokens.

    Built from tokenizer.json directly, llguidance marks every added token special (Qwen's
    <tool_call> too), while the encoder it tokenizes a grammar's forced text with splits
    added tokens out of text: a constraint that spells one ("<tool_call>x", "<|eot_id|>")
    got a mask allowing only that token, which its matcher then rejected. Here the text
    and its tokens agree: a non-special added token is its text, and a special token's
    text is spelled greedily with ordinary tokens (grammars still name special tokens,
    <[id]> or <|name|>). The encoder is otherwise llguidance's own, which knows the space
    a SentencePiece vocabulary puts in front of a text."""

    def __init__(self, as_read, tokens: list[bytes], special_token_ids: list[int], eos: int):
        self.tokens = tokens
        self.special_token_ids = special_token_ids
        self.eos_token_id = eos
        self.bos_token_id = None
        self.is_tokenizer_wrapper = True
        self._as_read = as_read  # llguidance's tokenizer of tokenizer.json
        self._special = frozenset(special_token_ids)

    @classmethod
    def of(cls, llg, tokenizer_json: str, eos: list[int], vocab_size: int) -> "_TrieSource":
        """The source for tokenizer.json and a model of vocab_size ids (the ids past the
        tokenizer's are special tokens, which no text grammar allows)."""
        as_read = llg.LLTokenizer(tokenizer_json, eos_token=eos, slices=[])  # no mask work
        tokens = [as_read.decode_bytes([i]) for i in range(as_read.vocab_size)]
        added = json.loads(tokenizer_json).get("added_tokens") or []
        special = sorted({token["id"] for token in added if isinstance(token, dict)
                          and token.get("special") and isinstance(token.get("id"), int)
                          and 0 <= token["id"] < len(tokens)})
        padding = range(len(tokens), vocab_size)  # named as llguidance names them
        tokens += [f"<[{i}]>".encode() for i in padding]
        return cls(as_read, tokens, special + list(padding), eos[0])

    def __call__(self, text) -> list[int]:
        read = self._as_read
        ids = read.tokenize_bytes(text if isinstance(text, bytes) else text.encode())
        special = self._special
        if special.isdisjoint(ids):
            return ids
        spelled = []
        for token_id in ids:
            if token_id in special:
                spelled += read.greedy_tokenize(self.tokens[token_id].decode(errors="replace"))
            else:
                spelled.append(token_id)
        return spelled


class GrammarCompiler:
    """Compiles specs for one model. Building it reads the whole vocabulary into
    llguidance's token trie (_TrieSource): about 1 s for Llama 3's 128,256 tokens on a
    2-core x86-64 (the interpreter lock is held meanwhile), so a model builds one, once,
    before it serves constrained requests.

    vocab_size: the model's vocabulary (config.json), which may exceed the tokenizer's;
    eos_token_ids: every id that ends a sequence (config.json, generation_config.json and
    the chat template's end-of-turn tokens): a grammar allows them where it may end."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids,
                 cache_size: int = 256):
        llg = _llguidance()
        eos = sorted({int(i) for i in eos_token_ids})
        if not eos:
            raise ValueError("a grammar needs at least one EOS token id")
        source = _TrieSource.of(llg, tokenizer_json, eos, int(vocab_size))
        try:
            tokenizer = llg.LLTokenizer(source, n_vocab=int(vocab_size), eos_token=eos)
        except ValueError:
            # the tokenizer has more ids than the model (ids the model can never sample):
            # the mask covers the tokenizer's, of which the model reads its own
            tokenizer = llg.LLTokenizer(source, eos_token=eos)
            if tokenizer.vocab_size < vocab_size:
                raise
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size  # what a bitmask row covers
        self.eos_token_ids = tuple(eos)
        self.num_words = bitmask_words(self.vocab_size)
        # error messages quote the compiler, never the grammar or the parser's state
        self._limits = llg.LLParserLimits(verbose_errors=False)
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pool = None

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, eos_token_ids,
                       cache_size: int = 256) -> "GrammarCompiler":
        """From a cupy_llama Tokenizer (its tokenizer.json as the tokenizers library
        reads it)."""
        return cls(tokenizer.to_json(), vocab_size, eos_token_ids, cache_size)

    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """The compiled grammar of spec, from the cache when it was compiled before;
        RequestError quoting the compiler when it does not compile."""
        if not isinstance(spec, StructuredSpec):
            raise TypeError(f"expected a StructuredSpec, got {type(spec).__name__}")
        key = spec.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        grammar = spec.llguidance_grammar()
        # LLMatcher never raises for a bad grammar: it is born failed, with the reason; it
        # lets go of the interpreter lock while it builds
        prototype = _llguidance().LLMatcher(self._tokenizer, grammar, log_level=0,
                                            limits=self._limits)
        if prototype.is_error():
            raise spec._error(prototype.get_error())
        compiled = CompiledGrammar(spec, prototype, self.num_words)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def compile_async(self, spec: StructuredSpec):
        """compile() on a worker thread: a concurrent.futures.Future of the
        CompiledGrammar (or of the RequestError). For a loop that must not wait: it
        polls future.done() between steps."""
        with self._lock:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="cupy-llama-grammar")
            pool = self._pool
        return pool.submit(self.compile, spec)

    def matcher(self, spec: StructuredSpec) -> GrammarMatcher:
        """A new sequence's matcher (compiling spec if it is not cached)."""
        return self.compile(spec).matcher()

    def close(self) -> None:
        """Stop the worker thread of compile_async, if one was started."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


# ---- the bitmask ------------------------------------------------------------------------

def bitmask_words(vocab_size: int) -> int:
    """uint32 words in one bitmask row for a vocabulary."""
    return cdiv(vocab_size, 32)


def apply_token_bitmask(logits, bitmask, mask_rows=None) -> None:
    """The reference of masking on the device: set the logits of disallowed tokens to -inf,
    in place. logits: [B, V] float; bitmask: [R, W] uint32 words (W * 32 >= V); mask_rows:
    [B] ints, the bitmask row of each logits row or -1 for a row without a constraint
    (None: logits row b reads bitmask row b)."""
    import numpy as np

    num_rows, vocab = logits.shape
    if bitmask.ndim != 2 or bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"bitmask of shape {bitmask.shape} does not cover {vocab} tokens")
    rows = np.arange(num_rows) if mask_rows is None else np.asarray(mask_rows)
    constrained = np.flatnonzero(rows >= 0)
    if not constrained.size:
        return
    words = np.ascontiguousarray(bitmask[rows[constrained]], dtype="<u4")
    # bit t % 32 of word t // 32, little-endian: byte 4w + k holds bits 8k..8k+7 of word w
    allowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    block = logits[constrained]
    block[allowed == 0] = -np.inf
    logits[constrained] = block


def allowed_token_ids(bitmask_row, vocab_size: int):
    """The token ids a bitmask row allows, ascending (an int64 array)."""
    import numpy as np

    words = np.ascontiguousarray(bitmask_row, dtype="<u4")
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


# ---- helpers ----------------------------------------------------------------------------

def llguidance_available() -> bool:
    try:
        _llguidance()
    except RequestError:
        return False
    return True


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise RequestError(f"structured outputs need the llguidance package; install it "
                           f"with: {EXTRA_HINT}") from None
    return llguidance


def compiler_message(message: str, kind: str | None = None) -> str:
    """llguidance's message on one line: its first line and the line naming the error
    (regex errors put the reason on a later line), without the location in a grammar the
    user did not write (every kind but a grammar is compiled through a generated one)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    text = lines[0]
    reason = next((line for line in lines[1:] if line.startswith("error:")), None)
    if reason:
        text = f"{text.rstrip(':')}: {reason.removeprefix('error:').strip()}"
    if kind is not None and kind != "grammar":
        text = re.sub(r"^at \d+\(\d+\): ", "", text)
    if len(text) > MAX_QUOTED_ERROR:
        text = text[:MAX_QUOTED_ERROR - 3] + "..."
    return text


def _harmless(name: str, value) -> bool:
    """Whether a vLLM structured_outputs option has a value that changes nothing here."""
    return isinstance(value, bool) and value in HARMLESS_OPTIONS.get(name, ())


def _type_name(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), type(value).__name__)


def _describe(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else _type_name(value)
