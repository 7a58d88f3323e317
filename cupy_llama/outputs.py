"""What a request gives back."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the model (its log-softmax, before
    temperature and filters), and the `top` most likely tokens', best first."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob)
    rank: int | None = None  # the token's place among all (1: the most likely), where known


class PromptScores:
    """A prompt's log-probabilities as the device returned them (docs/ARCHITECTURE.md,
    "Prompt log-probabilities"): row r scores prompt token r + 1 given the ones before it,
    values[r, 0] its log-probability and values[r, 1:] the k most likely tokens' there
    (ids[r, 1:]), best first; ids[r, 0] is the token, ranks[r] its place in the row (1:
    the most likely). entries() makes the per-token objects once, for whoever reads them."""
    __slots__ = ("values", "ids", "ranks", "_entries")

    def __init__(self, values, ids, ranks):
        self.values = values  # [P - 1, 1 + k] float32 (NumPy)
        self.ids = ids        # [P - 1, 1 + k] int32
        self.ranks = ranks    # [P - 1] int32
        self._entries: list | None = None

    @property
    def k(self) -> int:
        return self.ids.shape[1] - 1

    def __len__(self) -> int:
        """One per prompt token (the first has no score)."""
        return self.ids.shape[0] + 1

    def rows(self) -> tuple[list, list, list]:
        """(ids, values, ranks) as Python lists, made in one pass each."""
        return self.ids.tolist(), self.values.tolist(), self.ranks.tolist()

    def entries(self) -> list[TokenLogprob | None]:
        """RequestOutput.prompt_logprobs: None for the first token, then a TokenLogprob per
        scored token (made on the first call, the same list after)."""
        if self._entries is None:
            ids, values, ranks = self.rows()
            self._entries = [None] + [TokenLogprob(i[0], v[0], list(zip(i[1:], v[1:])), r)
                                      for i, v, r in zip(ids, values, ranks)]
        return self._entries

    def __reduce__(self):  # the arrays only: the entries are made again where read
        return PromptScores, (self.values, self.ids, self.ranks)


@dataclass(frozen=True)
class RequestTimes:
    """When a sample passed the engine's stages, in time.monotonic() seconds: the
    request's metrics (queue, prefill and decode time, time to the first token)."""
    added: float
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)   # generated tokens so far
    text: str = ""                                       # generated text so far
    finish_reason: str | None = None                     # "stop", "length", "abort" or None
    delta: str = ""            # text added since the previous output of this request's sample
    delta_token_ids: list[int] = field(default_factory=list)
    index: int = 0             # which of the request's n samples (SamplingParams.n) this is
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    # one per token of token_ids where the request asked (SamplingParams.logprobs), else None;
    # the delta's are the last len(delta_token_ids)
    logprobs: list[TokenLogprob] | None = None
    # on a finished output: when the engine took the sample, first scheduled it, and had its
    # first and last token (time.monotonic(); None where it never came to that)
    times: RequestTimes | None = None
    # LLM.chat(stream=True) with tools: the calls' new pieces in this output
    # (tool_parsers.ToolCallDelta: a call's first carries its index, id and name, later
    # ones more of its arguments), while `delta` carries only the content's new text
    tool_call_deltas: list | None = None
    # LLM.chat with tools: the calls parsed from the reply (tool_parsers.ToolCall: id,
    # name, arguments as JSON text), finish_reason then "tool_calls"; `content` is the
    # reply's text besides them (None when there is none). A reasoning model's calls are
    # its answer's: its thinking is never parsed, and stays in `content` as written
    tool_calls: list | None = None
    content: str | None = None
    # where the request asked (SamplingParams.prompt_logprobs), on every output once the
    # prompt is computed (the same for all n samples): the scores as arrays;
    # prompt_logprobs below makes the per-token objects from them when read
    prompt_scores: PromptScores | None = None
    # on a finished output (vLLM's stop_reason): the stop string (SamplingParams.stop) or
    # the stop token id (stop_token_ids) that ended it; None when something else did, EOS
    # included (a token that is EOS and a stop token too counts as EOS)
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """Where the request asked (SamplingParams.prompt_logprobs): one per prompt token,
        None for the first (nothing comes before it), then each token's log-probability
        given the ones before it and the k most likely there; made from prompt_scores on
        the first read (the same list for all n samples)."""
        return None if self.prompt_scores is None else self.prompt_scores.entries()


def is_token_id(value) -> bool:
    """An int (Python or NumPy), not a bool."""
    return not isinstance(value, bool) and hasattr(value, "__index__") and not isinstance(value, str)


def are_token_ids(values) -> bool:
    """Whether every element is_token_id. Plain ints, the usual case, are checked in one
    C-speed pass over their types: a prompt of 4,096 ids would otherwise cost a Python
    call per id (half a millisecond) on the way to its first token."""
    return set(map(type, values)) <= {int} or all(is_token_id(v) for v in values)


# ---- log-probabilities as JSON (the server's bodies, generate's batch lines) -------------

LOGPROB_FLOOR = -9999.0  # JSON has no -Infinity; OpenAI's API reports this instead


def json_logprob(logprob: float) -> float:
    """JSON has no -Infinity (nor NaN): those become OpenAI's floor."""
    return float(logprob) if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


class TokenStrings:
    """Each token's own text for logprobs: decoded alone, special tokens spelled out (an id
    past the tokenizer's vocabulary, a padded model vocabulary's, has none); and its bytes
    (Tokenizer.token_bytes: part of a character where the token holds part of one).
    Called, it gives the name logprobs show for a token: its text, or "token_id:N" from
    by_id()'s view (vLLM's return_tokens_as_token_ids: many byte tokens share a text)."""

    def __init__(self, tokenizer, named_by_id: bool = False):
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self.named_by_id = named_by_id

    def by_id(self) -> "TokenStrings":
        """A view that names tokens "token_id:N" and shares this one's texts and bytes."""
        view = TokenStrings(self._tokenizer, named_by_id=True)
        view._texts, view._bytes = self._texts, self._bytes
        return view

    def bytes_of(self, token_id: int) -> list[int]:
        values = self._bytes.get(token_id)
        if values is None:
            values = self._bytes[token_id] = list(self._tokenizer.token_bytes(token_id))
        return values

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.named_by_id else self.text(token_id)

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            tokenizer = self._tokenizer
            text = tokenizer.decode_unchecked([token_id], skip_special_tokens=False) \
                if token_id < tokenizer.vocab_size else ""
            self._texts[token_id] = text
        return text
