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
reasoning. Only the </think> token ends the thinking, in the text as in the engine's
constraint (structured.ReasoningGate): the same text spelled in ordinary tokens ("</",
"think", ">") is part of the thinking. The markers' tokens are in neither part; the answer
is as written; whitespace around the markers is kept, as vLLM keeps it.

Where no parser is named (LLM.chat's tool calls, cupy-llama chat), `thinking_markers` are
the vocabulary's, and `ReasoningParser.reply_thinks` says which replies think.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .errors import CupyLlamaError, RequestError


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
    # where turns begin: the special tokens other than the markers, and the token the
    # template's generation prompt begins with where it is an added token (_turn_opener)
    turn_tokens: frozenset
    # token ids -> their text, special tokens kept (where a marker token's text falls)
    decode: Callable[[list], str] = field(compare=False, repr=False)

    @classmethod
    def for_tokenizer(cls, name: str, tokenizer, flag: str = "--reasoning-parser"
                      ) -> "ReasoningParser":
        """RequestError for an unknown name, or a vocabulary without the end marker as
        one token (not a model that thinks in that format)."""
        fmt = reasoning_format(name, flag)
        token_id = tokenizer.token_to_id(fmt.end)
        if token_id is None:
            raise RequestError(f"{flag} {name}: this model's vocabulary has no {fmt.end} "
                               f"token, so it does not think in that format; leave {flag} "
                               "out")
        specials = set(tokenizer.all_special_ids)
        start_id = tokenizer.token_to_id(fmt.start)
        vocab_size = tokenizer.vocab_size

        def decode(token_ids) -> str:  # ids past the vocabulary (a padded one's) have no text
            return tokenizer.decode_unchecked([t for t in token_ids if t < vocab_size],
                                              skip_special_tokens=False)

        turns = specials | {_turn_opener(tokenizer)} - {None}
        return cls(fmt, token_id, start_id, token_id in specials or start_id in specials,
                   frozenset(turns - {token_id, start_id}), decode)

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

    def reply_thinks(self, prompt_ids, token_ids) -> bool:
        """Whether a reply thinks where no parser says how the model thinks (LLM.chat's
        tool calls; cli/chat_ui.ThinkingView shows a reply by the same rule): where the
        prompt's last turn opened the thinking, or the reply's first token is <think>. A
        vocabulary with the markers does not make a model think (Qwen3's Instruct-2507
        models never do), so only the prompt and the reply can say."""
        return self.start_token is not None and (
            self.last_marker(prompt_ids) == self.start_token
            or (len(token_ids) > 0 and token_ids[0] == self.start_token))

    def last_marker(self, prompt_ids) -> int | None:
        """The last marker token (start_token or end_token) of the prompt's last turn (the
        tokens after its last turn token: a special token, or the role marker that begins
        the template's generation prompt), or None where it has none. Where the role
        markers are no special tokens (DeepSeek-R1's <｜Assistant｜>), the last special
        token may come before the last user message, whose text must not decide."""
        for token in reversed(prompt_ids):
            if token == self.end_token or token == self.start_token:
                return token
            if token in self.turn_tokens:
                return None
        return None


class ReasoningSplitter:
    """One reply's text, fed in pieces as it streams with the tokens that made them, as
    (reasoning, content) pieces. The thinking ends at the parser's end token, and a start
    token while thinking is dropped; the same texts spelled in ordinary tokens are
    thinking. A piece's text may lag its tokens (a character not complete yet, a stop
    string's hold-back), never lead them.

    A marker token's place in the text is found by counting: when it arrives, the text of
    the tokens before it says how many times its text came before (spelled, or an earlier
    marker), so its own is the next one. The count goes on from the last marker token's,
    decoding only the tokens since (no occurrence spans a marker token's text: neither
    marker's text begins inside the other's or its own), so a long thinking is decoded
    once. Text that may be the start of a marker waits for the next piece (or `finish`),
    so that every occurrence is counted whole."""

    def __init__(self, parser: ReasoningParser, thinking: bool):
        self.parser = parser
        self.thinking = thinking
        self.thought = thinking  # whether any of the reply was thinking
        self._held = ""
        self._markers = (parser.format.start, parser.format.end)
        self._watching = thinking  # tokens are read until the end token
        self._unread: list[int] = []  # the tokens since the last marker token
        # occurrences of each marker's text in the text of the tokens up to the last marker
        # token, and in the text fed so far
        self._written = dict.fromkeys(self._markers, 0)
        self._seen = dict.fromkeys(self._markers, 0)
        self._due: deque = deque()  # (marker text, its occurrence number) of marker tokens

    def feed(self, text: str, token_ids) -> tuple[str, str]:
        if self._watching:
            self._read_tokens(token_ids)
        text, self._held = self._held + text, ""
        reasoning = []
        while self.thinking and text:
            at, marker = _first(text, self._markers)
            if marker is None:
                keep = _partial_marker(text, self._markers)
                reasoning.append(text[:len(text) - keep])
                self._held, text = text[len(text) - keep:], ""
                break
            self._seen[marker] += 1
            if self._due and self._due[0] == (marker, self._seen[marker]):  # the token's
                self._due.popleft()
                reasoning.append(text[:at])
                self.thinking = marker == self.parser.format.start
            else:  # spelled in ordinary tokens: part of the thinking
                reasoning.append(text[:at + len(marker)])
            text = text[at + len(marker):]
        return "".join(reasoning), text  # the answer's text is never changed

    def _read_tokens(self, token_ids) -> None:
        parser = self.parser
        for token_id in token_ids:
            if token_id != parser.start_token and token_id != parser.end_token:
                self._unread.append(token_id)
                continue
            since = parser.decode(self._unread)
            for marker in self._markers:
                self._written[marker] += since.count(marker)
            marker = parser.format.end if token_id == parser.end_token else parser.format.start
            self._written[marker] += 1
            self._due.append((marker, self._written[marker]))
            self._unread = []
            if token_id == parser.end_token:
                self._watching = False
                return

    def finish(self) -> tuple[str, str]:
        """What waited at the end of the reply: it was no marker."""
        held, self._held = self._held, ""
        return (held, "") if self.thinking else ("", held)


def thinking_markers(tokenizer) -> ReasoningParser | None:
    """The vocabulary's <think> and </think>, for a model that may think where no parser
    was named (reply_thinks says which replies do), or None where it has no </think>
    token."""
    try:
        return ReasoningParser.for_tokenizer("deepseek_r1", tokenizer)
    except RequestError:
        return None


def split_reasoning(parser: ReasoningParser, text: str, token_ids, thinking: bool
                    ) -> tuple[str | None, str | None]:
    """A whole reply (its text and tokens) as (reasoning, content): reasoning None when the
    reply did not think, content None when it holds no answer (it never closed its
    thinking)."""
    splitter = ReasoningSplitter(parser, thinking)
    reasoning, content = splitter.feed(text, token_ids)
    last_reasoning, last_content = splitter.finish()
    reasoning, content = reasoning + last_reasoning, content + last_content
    return (reasoning if splitter.thought else None,
            content if content or not splitter.thought else None)


def _turn_opener(tokenizer) -> int | None:
    """The token the chat template's generation prompt begins with (the assistant turn's
    role marker) where it is an added token, or None: where it is ordinary text (which a
    message could hold), or the template renders no generation prompt. Found by rendering
    one user message with and without it."""
    probe = [{"role": "user", "content": "?"}]
    try:
        bare = tokenizer.encode_chat(probe, add_generation_prompt=False)
        asked = tokenizer.encode_chat(probe, add_generation_prompt=True)
    except CupyLlamaError:  # no chat template, or one that refuses the probe
        return None
    if len(asked) <= len(bare) or asked[:len(bare)] != bare:
        return None
    opener = asked[len(bare)]
    return opener if opener in tokenizer.added_token_ids else None


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
