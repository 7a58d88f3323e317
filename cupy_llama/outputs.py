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
    # reply's text besides them (None when there is none)
    tool_calls: list | None = None
    content: str | None = None
    # where the request asked (SamplingParams.prompt_logprobs): one per prompt token, None
    # for the first (nothing comes before it), then each token's log-probability given
    # the ones before it and the k most likely there; on every output once the prompt is
    # computed (the same list for all n samples)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def is_token_id(value) -> bool:
    """An int (Python or NumPy), not a bool."""
    return not isinstance(value, bool) and hasattr(value, "__index__") and not isinstance(value, str)
