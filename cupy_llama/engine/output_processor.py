"""What the engine says after each step, and the one place that turns it into outputs.

The engine emits one EngineDelta per sample that has news (docs/ARCHITECTURE.md, "Engine
output"): the tokens and text new since that sample's previous delta, and its finish
reason and stop reason once it ends. Deltas are tuples with named fields, so they cross
the engine process's socket at a plain tuple's pickling cost. An OutputAccumulator turns them into
the cumulative RequestOutputs that LLM.generate, LLM.stream and the batch files read.
stop_status is the one function that decides EOS, stop tokens and lengths.
"""
from __future__ import annotations

import time
from operator import itemgetter

from ..outputs import PromptScores, RequestOutput, RequestTimes, TokenLogprob
from ..tokenizer import IncrementalDetokenizer
from .sequence import SequenceStatus

_STOPPED, _LENGTH = SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH


class EngineDelta(tuple):
    """One sample's news from one step. A tuple subclass: fields by name here, a plain
    tuple on the wire (`tuple(delta)`; `EngineDelta.of(t)` names it again)."""
    __slots__ = ()
    request_id: str = property(itemgetter(0))
    index: int = property(itemgetter(1))               # which of the request's n samples
    text: str = property(itemgetter(2))                # text added since the previous delta
    token_ids: list[int] = property(itemgetter(3))     # tokens added since the previous delta
    finish_reason: str | None = property(itemgetter(4))  # "stop", "length", "abort" once over
    # (token id, logprob, top) for each of token_ids where the request asked, else None
    logprobs: list | None = property(itemgetter(5))
    num_cached_tokens: int = property(itemgetter(6))   # prompt tokens the prefix cache served
    # RequestTimes' fields as a tuple (taken in, first scheduled, first token, last token)
    # on the last delta, and so far on the delta with a sample's first tokens; else None
    times: tuple | None = property(itemgetter(7))
    # once, on the first delta after the whole prompt is scored, where the request asked
    # (SamplingParams.prompt_logprobs): PromptScores' (values, ids) arrays; else None
    prompt_logprobs: tuple | None = property(itemgetter(8))
    # on the last delta of a sample that a stop string (str) or a stop token (its id)
    # ended: that one (vLLM's stop_reason); else None, EOS included
    stop_reason: str | int | None = property(itemgetter(9))

    def __new__(cls, request_id: str, index: int, text: str, token_ids: list[int],
                finish_reason: str | None = None, logprobs: list | None = None,
                num_cached_tokens: int = 0, times: tuple | None = None,
                prompt_logprobs: tuple | None = None, stop_reason: str | int | None = None):
        return tuple.__new__(cls, (request_id, index, text, token_ids, finish_reason,
                                   logprobs, num_cached_tokens, times, prompt_logprobs,
                                   stop_reason))

    @classmethod
    def of(cls, fields: tuple) -> "EngineDelta":
        """A plain tuple of the fields, in order (as pickled over the socket), named."""
        return tuple.__new__(cls, fields)

    @property
    def finished(self) -> bool:
        return self[4] is not None


class TokenColumns(tuple):
    """A step's one-token news of streamed samples that send token ids only, as columns:
    the k-th entries of request_ids, indexes and token_ids are one sample's delta with that
    single token (no text, no finish, nothing else new; num_cached_tokens as in the
    sample's previous delta). Serve's engine process sends these in place of a tuple per
    sample (docs/ARCHITECTURE.md, "Engine output"); a plain tuple on the wire, as
    EngineDelta."""
    __slots__ = ()
    request_ids: list[str] = property(itemgetter(0))
    indexes: list[int] = property(itemgetter(1))
    token_ids: list[int] = property(itemgetter(2))

    @classmethod
    def empty(cls) -> "TokenColumns":
        return tuple.__new__(cls, ([], [], []))

    @classmethod
    def of(cls, fields: tuple) -> "TokenColumns":
        return tuple.__new__(cls, fields)


_EOS, _LENGTH_CAP, _GOES_ON = (_STOPPED, None), (_LENGTH, None), (None, None)


def stop_status(params, token_id: int | None, num_output_tokens: int, num_tokens: int,
                eos_token_ids, context_limit: int) -> tuple[SequenceStatus | None, int | None]:
    """Why a sequence ends at its latest token (None: it goes on), and the stop reason:
    EOS (unless ignore_eos) and stop_token_ids stop it once it has min_tokens (before, the
    device bans them), a stop token with itself as the reason; max_tokens or the context
    limit end it for length. EOS is checked first, as vLLM's check_stop does: a token that
    is both EOS and a stop token has no reason. token_id None: the token is not known yet
    (a step launching it): only the lengths decide, and a sequence they end has nothing
    left to schedule. Stop strings are text and decided where the text is made
    (SampleText.add: in the engine, or in serve's server process)."""
    if token_id is not None and num_output_tokens > params.min_tokens:
        if token_id in eos_token_ids and not params.ignore_eos:
            return _EOS
        if token_id in params.stop_token_ids:
            return _STOPPED, token_id
    if num_output_tokens >= params.max_tokens or num_tokens >= context_limit:
        return _LENGTH_CAP
    return _GOES_ON


def output_limit(params, num_prompt_tokens: int, context_limit: int) -> int:
    """The output tokens at which stop_status's lengths end a sequence: its max_tokens, or
    where it reaches the context limit (num_output_tokens >= this is stop_status's
    length rule, num_tokens being num_prompt_tokens + num_output_tokens)."""
    return min(params.max_tokens, context_limit - num_prompt_tokens)


def find_stop(text: str, stops, num_old_chars: int) -> int | None:
    """Where the earliest stop string starts, looking only where a new match can be: one
    that ends in the text added since num_old_chars."""
    best = None
    for stop in stops:
        at = text.find(stop, max(0, num_old_chars - len(stop) + 1))
        if at >= 0 and (best is None or at < best):
            best = at
    return best


class SampleText:
    """One sample's text as its tokens arrive: made token by token (incremental) to stream
    it or watch for stop strings, else decoded once at the end (the same text: the
    detokenizer's deltas concatenate to the one-shot decode). The engine keeps one per
    sample; with serve, the server process does (AsyncEngine), off the step loop."""
    __slots__ = ("tokenizer", "detokenizer", "stops", "vocab_size", "hold_back", "unsent",
                 "tail", "skip_special_tokens", "min_tokens", "include_stop", "num_tokens",
                 "context")

    def __init__(self, tokenizer, params, incremental: bool, prompt_ids=()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        # the prompt tokens the text is decoded after (Tokenizer.text_context): mostly none
        self.context = tokenizer.text_context(prompt_ids) if prompt_ids else []
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, self.skip_special_tokens, checked=False,
            context=self.context) if incremental else None
        self.stops = stops = params.stop
        # a stop string counts only in a token past the first min_tokens, as EOS and stop
        # tokens do (stop_status): min_tokens 1 never gives an empty text (vLLM's rule)
        self.min_tokens = params.min_tokens
        self.include_stop = params.include_stop_str_in_output  # the text ends with it
        self.num_tokens = 0  # tokens added, text or not (as the sample's output counts them)
        self.vocab_size = tokenizer.vocab_size
        # deltas hold back the last `hold_back` characters (one less than the longest stop
        # string) while a stop string could still be forming, so the user never sees part
        # of one
        self.hold_back = max((len(s) for s in stops), default=1) - 1
        self.unsent: list[str] = []  # text made and not taken yet
        self.tail = ""  # the text's last hold_back characters: where a stop string may start

    @property
    def incremental(self) -> bool:
        return self.detokenizer is not None

    def add(self, token_id: int) -> str | None:
        """Adds the token's text (incremental only). The stop string that it completes, or
        None: the text then ends where the stop string starts (it is not shown), or after
        it with include_stop_str_in_output. The one place a stop string is decided."""
        self.num_tokens += 1
        if token_id >= self.vocab_size:
            return None  # ids past the tokenizer's vocabulary (a padded model vocabulary) have no text
        new = self.detokenizer.add(token_id)
        if not new:
            return None
        if not self.stops:
            self.unsent.append(new)
            return None
        # a new match ends in the new text: look in it and the characters before it
        window = self.tail + new
        at = find_stop(window, self.stops, len(self.tail)) \
            if self.num_tokens > self.min_tokens else None
        if at is None:
            self.unsent.append(new)
            self.tail = window[-self.hold_back:] if self.hold_back else ""
            return None
        # the one find_stop found: the first listed of those that start there and end in
        # the new text (one that ends before it came while min_tokens held stops off)
        old = len(self.tail)
        stop = next(s for s in self.stops if window.startswith(s, at) and at + len(s) > old)
        if self.include_stop:  # the text ends with the stop string, not before it
            at += len(stop)
        # the window's characters are all unsent (take() holds back hold_back of them)
        text = "".join(self.unsent) + new
        self.unsent = [text[:len(text) - (len(window) - at)]]
        return stop

    def finish(self, token_ids: list[int]) -> None:
        """The end of the text (not after a stop string): the one-shot decode of
        token_ids, the sample's tokens that have text; or, made token by token, the text
        of those add() has not had (the stop token or EOS that ended the sample, where
        include_stop_str_in_output keeps it) and what the detokenizer held back."""
        detokenizer = self.detokenizer
        if detokenizer is not None:
            self.add_unmatched(token_ids[self.num_tokens:])
            self.unsent.append(detokenizer.flush())
            return
        vocab = self.vocab_size
        if token_ids and max(token_ids) >= vocab:  # ids past the tokenizer's vocabulary
            token_ids = [t for t in token_ids if t < vocab]
        decode, skip = self.tokenizer.decode_unchecked, self.skip_special_tokens
        context = self.context
        if context and token_ids:  # the text as it reads after the context
            before, whole = decode(context, skip), decode(context + token_ids, skip)
            if whole.startswith(before):
                self.unsent.append(whole[len(before):])
                return
        self.unsent.append(decode(token_ids, skip))

    def add_unmatched(self, token_ids) -> None:
        """Adds the tokens' text (incremental only) without matching it for stop strings:
        the stop token or EOS that ended the sample, whose text is kept (and matched, by
        add) only with include_stop_str_in_output."""
        for token_id in token_ids:
            if token_id < self.vocab_size:
                self.unsent.append(self.detokenizer.add(token_id))

    def take(self, finished: bool) -> str:
        """The text made since the last take(), less what is held back unless finished."""
        unsent = self.unsent
        text = unsent[0] if len(unsent) == 1 else "".join(unsent)
        if not finished and self.hold_back and text:
            keep = min(len(text), self.hold_back)
            self.unsent = [text[len(text) - keep:]]
            return text[:len(text) - keep]
        self.unsent = []
        return text


class DetokenizedSample:
    """A sample whose engine sends token ids only (LLMEngine.add_request(text=False)), as
    the server process sees it: process() adds the text to each delta and ends the sample
    at a stop string, keeping the tokens up to the one that completed it (the engine is
    told to stop it, and what it made meanwhile is dropped here)."""
    __slots__ = ("text", "finished", "first_token_at", "stop_tokens", "num_cached_tokens",
                 "engine_times")

    def __init__(self, tokenizer, params, stream: bool, eos_token_ids=(), prompt_ids=()):
        self.text = SampleText(tokenizer, params, stream or bool(params.stop), prompt_ids)
        self.finished = False
        # the tokens stop_status ends a sample at (EOS unless ignore_eos, stop_token_ids)
        # whose text is dropped: none where include_stop_str_in_output keeps it, and then
        # a stop string it completes is the stop reason, as the engine's own text decides
        # it (LLMEngine._append_token). A sample may also stop at another token (a grammar
        # complete: structured outputs), whose text is matched as any
        self.stop_tokens = frozenset() if params.include_stop_str_in_output else frozenset(
            () if params.ignore_eos else eos_token_ids) | frozenset(params.stop_token_ids)
        self.first_token_at: float | None = None  # when its first token reached this process
        self.num_cached_tokens = 0  # as the sample's latest delta said
        # the engine's times with the sample's first tokens (RequestTimes' fields), for a
        # sample that a stop string ends here: the engine's own final delta is dropped
        self.engine_times: tuple | None = None

    def process(self, delta: EngineDelta) -> tuple[EngineDelta | None, bool]:
        """(the delta with its text, or None once the sample has ended here; True when a
        stop string ended it here while the engine goes on, which must be told). A stop
        string found here is the delta's stop_reason, in place of the engine's (its stop
        token, or none)."""
        if self.finished:
            return None, False
        (request_id, index, _, token_ids, finish_reason, logprobs, cached, times, prompt,
         stop_reason) = delta
        self.num_cached_tokens = cached
        text, stopped = self.text, False
        if self.first_token_at is None and token_ids:
            self.first_token_at = time.monotonic()
            self.engine_times = times
        # the engine's "stop" at EOS or a stop token whose text is dropped: that token is
        # not matched for stop strings, and the stop reason stays the engine's
        num_matched = len(token_ids) - (finish_reason == "stop" and bool(token_ids)
                                        and token_ids[-1] in self.stop_tokens)
        if text.incremental:
            for i in range(num_matched):
                stop = text.add(token_ids[i])
                if stop is not None:
                    token_ids = token_ids[:i + 1]
                    if logprobs is not None:
                        logprobs = logprobs[:i + 1]
                    if finish_reason is None:  # the engine goes on: it is told to stop
                        times = self.stop_times(time.monotonic())
                        stopped = True
                    finish_reason, stop_reason = "stop", stop
                    break
            else:
                if finish_reason is not None:
                    text.finish(())
        elif finish_reason is not None:  # its one delta carries all of its tokens
            text.finish(token_ids[:num_matched])
        self.finished = finish_reason is not None
        return _new_tuple(EngineDelta, (
            request_id, index, text.take(self.finished), token_ids, finish_reason, logprobs,
            cached, times, prompt, stop_reason)), stopped

    def stop_times(self, now: float) -> tuple:
        """The times (RequestTimes' fields) of a sample a stop string ends here at `now`:
        the engine's final delta, which carries them, is dropped, so those that came with
        its first tokens stand in (taken in, first scheduled and first token; the first
        token's time seen here only where no delta brought times)."""
        times = self.engine_times
        if times is None:
            return None, None, self.first_token_at, now
        return times[0], times[1], times[2], now

    def process_token(self, request_id: str, index: int,
                      token_id: int) -> tuple[EngineDelta | None, bool]:
        """process() of a TokenColumns entry (a delta of one token and nothing else), made
        without the delta: num_cached_tokens is the previous delta's."""
        if self.finished:
            return None, False
        text, now = self.text, time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        stop = text.add(token_id) if text.incremental else None
        if stop is not None:  # a stop string ends the sample here
            self.finished = True
            return _new_tuple(EngineDelta, (
                request_id, index, text.take(True), [token_id], "stop", None,
                self.num_cached_tokens, self.stop_times(now), None, stop)), True
        return _new_tuple(EngineDelta, (request_id, index, text.take(False), [token_id], None,
                                        None, self.num_cached_tokens, None, None, None)), False


_new_tuple = tuple.__new__  # EngineDelta's fields without a Python-level __new__


class _SampleOutput:
    """What one sample's outputs hold so far. Per-sample fields a delta may carry later
    (tool calls) go here and into output()."""
    __slots__ = ("index", "token_ids", "text", "logprobs", "finish_reason",
                 "num_cached_tokens", "times")

    def __init__(self, index: int):
        self.index = index
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[TokenLogprob] | None = None
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0
        self.times: RequestTimes | None = None


class _RequestOutputs:
    __slots__ = ("prompt_token_ids", "samples", "num_unfinished", "prompt_scores")

    def __init__(self, prompt_token_ids: list[int], n: int):
        self.prompt_token_ids = prompt_token_ids
        # the prompt's, from the first delta that carries them: one for all n samples
        self.prompt_scores: PromptScores | None = None
        self.samples = [_SampleOutput(index) for index in range(n)]
        self.num_unfinished = n


class OutputAccumulator:
    """Turns EngineDeltas into RequestOutputs: each carries the sample's tokens, text and
    log-probabilities so far and the delta's. A request is forgotten once every one of its
    samples has finished; deltas of requests it does not know are dropped."""

    def __init__(self):
        self._requests: dict[str, _RequestOutputs] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], n: int) -> None:
        self._requests[request_id] = _RequestOutputs(prompt_token_ids, n)

    def __contains__(self, request_id: str) -> bool:
        """The request has a sample that has not finished."""
        return request_id in self._requests

    def num_unfinished(self, request_id: str) -> int:
        request = self._requests.get(request_id)
        return 0 if request is None else request.num_unfinished

    def discard(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def process(self, deltas) -> list[RequestOutput]:
        requests, outputs = self._requests, []
        for (request_id, index, text, token_ids, finish_reason, logprobs, cached, times,
             prompt, stop_reason) in deltas:
            request = requests.get(request_id)
            if request is None:
                continue
            sample = request.samples[index]
            if sample.finish_reason is not None:
                continue
            sample.token_ids += token_ids
            if text:
                sample.text += text
            if logprobs is not None:
                new = [TokenLogprob(token_id, logprob, top) for token_id, logprob, top in logprobs]
                sample.logprobs = new if sample.logprobs is None else sample.logprobs + new
            sample.num_cached_tokens = cached
            if prompt is not None and request.prompt_scores is None:
                request.prompt_scores = PromptScores(*prompt)
            if finish_reason is not None:
                sample.finish_reason = finish_reason
                sample.times = None if times is None else RequestTimes(*times)
                request.num_unfinished -= 1
                if not request.num_unfinished:
                    del requests[request_id]
            outputs.append(RequestOutput(
                request_id, request.prompt_token_ids, sample.token_ids[:], sample.text,
                finish_reason, text, token_ids, index, cached,
                None if sample.logprobs is None else sample.logprobs[:], sample.times,
                prompt_scores=request.prompt_scores, stop_reason=stop_reason))
        return outputs
