"""A reasoning model's thinking apart from its answer (serve --reasoning-parser, vLLM's
flag and parser names). Qwen3 and DeepSeek-R1 think between <think> and </think> before
they answer; a chat reply's text is split into `reasoning` (the thinking) and `content`
(the answer), whole or as it streams (docs/ARCHITECTURE.md, "Reasoning models").

- "qwen3": thinking unless the request's chat_template_kwargs say {"enable_thinking":
  false}.
- "deepseek_r1": thinking (its template opens <think> in the prompt).

Either way the prompt's last turn decides where it shows: a reply after </think> (Qwen3's
template writes an empty thinking for enable_thinking false; an assistant message being
continued may hold its thinking whole) starts with the answer, a reply after <think>
starts thinking. A reply that never closes its thinking (cut off by max_tokens) is all
reasoning. Only </think> ends the thinking, in the text as in the engine's constraint
(structured.ReasoningGate). The markers that open and close the thinking are in neither
part; the answer is as written; whitespace around the markers is kept, as vLLM keeps it.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import RequestError


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    follows_enable_thinking: bool = False   # chat_template_kwargs' enable_thinking: false


FORMATS = {"qwen3": ReasoningFormat("qwen3", follows_enable_thinking=True),
           "deepseek_r1": ReasoningFormat("deepseek_r1")}
PARSER_NAMES = tuple(FORMATS)


def reasoning_format(name: str, flag: str = "--reasoning-parser") -> ReasoningFormat:
    if name not in FORMATS:
        raise RequestError(f"{flag}: unknown parser {name!r}; use one of "
                           f"{', '.join(PARSER_NAMES)}")
    return FORMATS[name]


@dataclass(frozen=True)
class ReasoningParser:
    """A reasoning format bound to a model's tokenizer: the id of the token that ends the
    thinking (where a structured reply's constraint begins, structured.ReasoningGate),
    and whether the markers are special tokens (then replies keep special tokens, or
    their text would lose the markers)."""
    format: ReasoningFormat
    end_token: int
    start_token: int | None
    special: bool
    turn_tokens: frozenset  # the special tokens other than the markers: where turns begin

    @classmethod
    def for_tokenizer(cls, name: str, tokenizer, flag: str = "--reasoning-parser"
                      ) -> "ReasoningParser":
        """RequestError for an unknown name, or a vocabulary without the end marker as
        one token (not a model that thinks in that format)."""
        fmt = reasoning_format(name, flag)
        token_id = tokenizer.token_to_id(fmt.end)
        if token_id is None:
            raise RequestError(f"{flag} {name}: this model's vocabulary has no {fmt.end} "
                               "token, so it does not think in that format; leave the flag "
                               "out")
        specials = set(tokenizer.all_special_ids)
        start_id = tokenizer.token_to_id(fmt.start)
        return cls(fmt, token_id, start_id, token_id in specials or start_id in specials,
                   frozenset(specials - {token_id, start_id}))

    def thinks(self, prompt_ids, template_kwargs: dict | None) -> bool:
        """Whether the reply to this prompt starts by thinking: the prompt's last turn
        decides where it shows a marker (a template that opens <think> whatever
        enable_thinking says, QwQ's and the Thinking-2507 models'; one that closes it);
        without one, not where Qwen3's enable_thinking is false, else thinking."""
        marker = self.last_marker(prompt_ids)
        if marker is not None:
            return marker == self.start_token
        return not (self.format.follows_enable_thinking
                    and (template_kwargs or {}).get("enable_thinking") is False)

    def last_marker(self, prompt_ids) -> int | None:
        """The last marker token (start_token or end_token) of the prompt's last turn (the
        tokens after its last special token), or None where it has none."""
        for token in reversed(prompt_ids):
            if token == self.end_token or token == self.start_token:
                return token
            if token in self.turn_tokens:
                return None
        return None


class ReasoningSplitter:
    """One reply's text, fed in pieces as it streams, as (reasoning, content) pieces. Text
    that may be the start of a marker waits for the next piece (or `finish`)."""

    def __init__(self, fmt: ReasoningFormat, thinking: bool):
        self.fmt = fmt
        self.thinking = thinking
        self.thought = thinking  # whether any of the reply was thinking
        self._held = ""
        self._markers = (fmt.start, fmt.end)

    def feed(self, text: str) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        reasoning = []
        while self.thinking and text:
            at, marker = _first(text, self._markers)
            if marker is None:
                keep = _partial_marker(text, self._markers)
                reasoning.append(text[:len(text) - keep])
                self._held, text = text[len(text) - keep:], ""
                break
            reasoning.append(text[:at])
            self.thinking = marker == self.fmt.start  # a <think> while thinking is dropped
            text = text[at + len(marker):]
        return "".join(reasoning), text  # the answer's text is never changed

    def finish(self) -> tuple[str, str]:
        """What waited at the end of the reply: it was no marker."""
        held, self._held = self._held, ""
        return (held, "") if self.thinking else ("", held)


def split_reasoning(fmt: ReasoningFormat, text: str, thinking: bool
                    ) -> tuple[str | None, str | None]:
    """A whole reply as (reasoning, content): reasoning None when the reply did not think,
    content None when it holds no answer (it never closed its thinking)."""
    splitter = ReasoningSplitter(fmt, thinking)
    reasoning, content = splitter.feed(text)
    last_reasoning, last_content = splitter.finish()
    reasoning, content = reasoning + last_reasoning, content + last_content
    return (reasoning if splitter.thought else None,
            content if content or not splitter.thought else None)


def _first(text: str, markers) -> tuple[int, str | None]:
    """The earliest marker in text and where it starts ((len(text), None) for none)."""
    best, found = len(text), None
    for marker in markers:
        at = text.find(marker, 0, best + len(marker))
        if at != -1 and at < best:
            best, found = at, marker
    return best, found


def _partial_marker(text: str, markers) -> int:
    """The length of the longest end of text that begins a marker (0 for none)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-size:]):
                longest = size
                break
    return longest
