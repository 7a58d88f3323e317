"""LLMEngine: add requests, step, abort; stopping rules and streaming text."""
from __future__ import annotations

import hashlib
import itertools
import secrets
import time
from dataclasses import dataclass, replace
from typing import Iterator

from ..config import EngineConfig, ModelConfig
from ..errors import RequestError
from ..outputs import RequestOutput, RequestTimes, TokenLogprob, is_token_id
from ..sampling import MAX_BANNED_TOKENS, SamplingParams
from .block_manager import BlockManager
from .model_runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus


class _Sample:
    """One of a request's n sequences plus its text: incremental detokenizer and what was
    already streamed."""

    def __init__(self, seq: Sequence, tokenizer, stream: bool):
        from ..tokenizer import IncrementalDetokenizer
        self.seq = seq
        self.stream = stream  # False: only the final output is wanted (no per-token outputs)
        self.tokenizer = tokenizer
        # text is needed token by token only to stream it or to watch for stop strings;
        # otherwise it is decoded once at the end (same text: the detokenizer's deltas
        # concatenate to the one-shot decode)
        self.detokenizer = (IncrementalDetokenizer(tokenizer, seq.params.skip_special_tokens,
                                                   checked=False)
                            if stream or seq.params.stop else None)
        self.vocab_size = tokenizer.vocab_size
        self.text_ids: list[int] = []
        self.hold_back = max((len(s) for s in seq.params.stop), default=1) - 1
        self.text = ""
        self.num_emitted_chars = 0
        self.num_emitted_tokens = 0
        # output tokens known on the host; the sequence may also hold placeholders for
        # tokens of steps still running (see LLMEngine.step)
        self.num_resolved = 0
        # why the sample ended, once its last known token says so (the sequence itself
        # may finish earlier in the scheduler, when its length is reached at launch)
        self.finish_reason: str | None = None
        # one per resolved output token where the request asked for them
        self.logprobs: list[TokenLogprob] | None = [] if seq.params.logprobs is not None else None
        # the prompt's (SamplingParams.prompt_logprobs), filled by sample 0 as its prompt is
        # computed: None for the first token, then one per scored token
        self.prompt_logprobs: list | None = None if seq.params.prompt_logprobs is None else [None]
        self.prompt_source = self  # the sample that computes them (sample 0)
        # the request's metrics (RequestOutput.times): when the engine took the sample, first
        # scheduled it, and had its first and last token
        self.added_at = time.monotonic()
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    def add_text(self, token_id: int) -> bool:
        """Adds the token's text; True when that completes a stop string (the text is then
        cut where the stop string starts: it is not shown)."""
        if token_id >= self.vocab_size:
            return False  # ids past the tokenizer's vocabulary (a padded model vocabulary) have no text
        if self.detokenizer is None:
            self.text_ids.append(token_id)
            return False
        num_old_chars = len(self.text)
        self.text += self.detokenizer.add(token_id)
        params = self.seq.params
        if len(self.detokenizer.token_ids) < params.min_tokens:
            return False  # no stop string before min_tokens (vLLM's rule)
        stop_at = _find_stop(self.text, params.stop, num_old_chars)
        if stop_at is None:
            return False
        if params.include_stop_str_in_output:  # the text ends with the stop string
            stop_at += next(len(s) for s in params.stop if self.text.startswith(s, stop_at))
        self.text = self.text[:stop_at]
        return True

    def flush_text(self) -> None:
        if self.detokenizer is None:
            self.text = self.tokenizer.decode_unchecked(  # ids < vocab_size
                self.text_ids, self.seq.params.skip_special_tokens)
        else:
            self.text += self.detokenizer.flush()

    def output(self) -> RequestOutput:
        """Deltas hold back the last `hold_back` characters (one less than the longest stop
        string) while a stop string could still be forming, so the user never sees part of
        one."""
        seq = self.seq
        visible = len(self.text) if self.finish_reason is not None else max(
            self.num_emitted_chars, len(self.text) - self.hold_back)
        delta = self.text[self.num_emitted_chars:visible]
        token_ids = seq.output_token_ids[:self.num_resolved]
        delta_ids = token_ids[self.num_emitted_tokens:]
        self.num_emitted_chars = visible
        self.num_emitted_tokens = len(token_ids)
        times = None if self.finish_reason is None else RequestTimes(
            self.added_at, self.scheduled_at, self.first_token_at, self.last_token_at)
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
            token_ids=token_ids, text=self.text[:visible],
            finish_reason=self.finish_reason, delta=delta, delta_token_ids=delta_ids,
            index=seq.index, num_cached_tokens=max(0, seq.num_cached_tokens),
            logprobs=None if self.logprobs is None else self.logprobs[:len(token_ids)],
            times=times, prompt_logprobs=self.complete_prompt_logprobs())

    def complete_prompt_logprobs(self) -> list | None:
        scored = self.prompt_source.prompt_logprobs
        if scored is None or len(scored) < self.seq.num_prompt_tokens:
            return None
        return scored

    def add_prompt_logprobs(self, first: int, values, ids) -> None:
        """Scores of prompt tokens first, first + 1, ... (rows of values and ids: the token's
        then the top k's); those it has already (a recomputed prompt) are kept."""
        k = self.seq.params.prompt_logprobs
        scored = self.prompt_logprobs
        for j in range(max(0, len(scored) - first), values.shape[0]):
            row_ids, row_values = ids[j].tolist(), values[j].tolist()
            scored.append(TokenLogprob(row_ids[0], row_values[0],
                                       list(zip(row_ids[1:1 + k], row_values[1:1 + k]))))


@dataclass(frozen=True)
class EngineStats:
    """What the engine is doing, for the front ends: /metrics, `info`, `bench`, `generate`'s
    summary and the chat's statistics read this, never the scheduler or block manager."""
    num_running: int            # sequences admitted (a request of n samples has n)
    num_waiting: int            # sequences waiting for a slot or for KV blocks
    num_blocks: int             # KV blocks in all
    num_free_blocks: int        # blocks no sequence holds, whether cached or not
    num_cached_blocks: int      # blocks the prefix cache holds, held by a sequence or not
    prefix_cache_queries: int   # prompt tokens looked up at each sequence's first admission
    prefix_cache_hits: int      # of those, tokens the cache held
    num_preemptions: int
    num_steps: int

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use (1 means all)."""
        return 1 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


class LLMEngine:
    def __init__(self, model_config: ModelConfig, tokenizer, backend, engine_config: EngineConfig,
                 max_model_len: int):
        """max_model_len: the configured context limit (EngineConfig.resolved_max_model_len)."""
        self.config = model_config
        self.tokenizer = tokenizer
        self.backend = backend
        self.engine_config = engine_config
        self.blocks = BlockManager(backend.num_kv_blocks, backend.block_size,
                                   enable_caching=engine_config.enable_prefix_caching)
        self.max_model_len = max_model_len
        # the longest sequence (prompt and output) this engine runs: max_model_len, or less
        # when the KV cache cannot hold that many tokens (a sequence stops there)
        self.context_limit = min(max_model_len, backend.num_kv_blocks * backend.block_size)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=engine_config.max_num_seqs,
                                   max_num_batched_tokens=engine_config.max_num_batched_tokens,
                                   max_model_len=max_model_len)
        self.runner = ModelRunner(model_config, backend)
        self.num_steps = 0
        self.num_step_tokens = 0  # tokens the last launched step computes (prefill and decode)
        self._num_unscheduled = 0  # samples added and never scheduled yet
        self.load_seconds = 0.0  # load() sets it: reading, checking and uploading the model
        # config.json + generation_config.json, plus the end-of-turn tokens of the template
        self.eos_token_ids = set(model_config.eos_token_ids) | set(
            getattr(tokenizer, "eos_token_ids", ()))
        self.runner.slots.eos_token_ids = tuple(sorted(self.eos_token_ids))  # min_tokens' bans
        # request id -> its n samples, until every one has finished
        self.requests: dict[str, list[_Sample]] = {}
        self._in_flight: _Launched | None = None  # the step whose tokens are still coming
        self._unhandled: _Launched | None = None  # tokens an interrupted step() left behind
        self._undelivered: dict[str, list[RequestOutput]] = {}
        self._owned: set[str] = set()  # requests some stream() or generate() is waiting on
        self._ids = itertools.count()
        self._arrivals = itertools.count()

    @classmethod
    def load(cls, model_dir, device: str = "auto", *, log=None, **engine_options) -> "LLMEngine":
        """The engine of a model directory on a device ("auto", "cpu" or "cuda"), with
        EngineConfig's options: the config, tokenizer and weights checked, the backend
        made. Each step of that may raise a one-line CupyLlamaError. Engine options the
        device does not have (backends.GPU_ONLY_OPTIONS on the CPU) are ignored with a
        warning to `log`."""
        from dataclasses import fields

        from ..backends import device_options, make_backend, resolve_device
        from ..errors import ConfigError
        from ..models import model_for, read_config
        from ..tokenizer import Tokenizer
        from ..weights import open_checkpoint

        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(engine_options) - known)
        if unknown:
            raise ConfigError(f"unknown LLM option {unknown[0]!r}; the options are "
                              f"{', '.join(sorted(known))}")
        EngineConfig(**engine_options)  # every value is checked, those the device ignores too
        started = time.perf_counter()
        log = log or (lambda message: None)
        config = read_config(model_dir)  # generation defaults checked too
        device = resolve_device(device, log)
        engine_options, ignored = device_options(device, engine_options)
        if ignored:
            verb = "applies" if len(ignored) == 1 else "apply"
            log(f"warning: {' and '.join(ignored)} {verb} to the GPU only; ignored on the CPU")
        engine_config = EngineConfig(**engine_options)
        config = engine_config.model_config(config)
        max_model_len = engine_config.resolved_max_model_len(config)
        tokenizer = Tokenizer.from_dir(model_dir, config)
        tokenizer.check_chat_template()  # a broken template fails the load, not a chat
        model = model_for(config)
        with open_checkpoint(model_dir, model, log=log) as checkpoint:
            backend = make_backend(device, model, checkpoint, engine_config, max_model_len, log)
        engine = cls(config, tokenizer, backend, engine_config, max_model_len)
        engine.load_seconds = time.perf_counter() - started
        return engine

    def set_prefix_caching(self, enabled: bool) -> None:
        """Turn prefix caching on or off from the next admission on (bench prefix compares
        the two on one engine); what is cached stays until reset_prefix_cache()."""
        self.blocks.enable_caching = bool(enabled)
        self.engine_config = replace(self.engine_config, enable_prefix_caching=bool(enabled))

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (safe at any time)."""
        self.blocks.reset_prefix_cache()

    @property
    def device(self) -> str:
        """"cpu" or "cuda"."""
        return self.backend.device

    def stats(self) -> EngineStats:
        blocks, scheduler = self.blocks, self.scheduler
        return EngineStats(
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            num_blocks=blocks.num_blocks, num_free_blocks=blocks.num_free_blocks,
            num_cached_blocks=len(blocks.cached),
            prefix_cache_queries=blocks.num_queried_tokens,
            prefix_cache_hits=blocks.num_hit_tokens,
            num_preemptions=scheduler.num_preemptions, num_steps=self.num_steps)

    # ---- requests -------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, stream: bool = True) -> str:
        """stream=False: step() reports this request only when it finishes. With params.n
        > 1 the request is n sequences, its samples: each output says which one it is
        (RequestOutput.index); the prompt is computed once (engine/scheduler.py)."""
        prompt_ids = self.encode_prompt(prompt)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        banned = self.bad_word_ids(params.bad_words)
        samples, parent = [], None
        for index in range(params.n):
            seq = Sequence(request_id, prompt_ids, params, sample_seed(params.seed, index),
                           next(self._arrivals), index=index, parent=parent)
            seq.banned_token_ids = banned
            parent = parent or seq
            self.scheduler.add(seq)
            samples.append(_Sample(seq, self.tokenizer, stream))
            samples[-1].prompt_source = samples[0]
        self.requests[request_id] = samples
        self._num_unscheduled += len(samples)
        return request_id

    def bad_word_ids(self, bad_words: list[str]) -> list[int]:
        """The tokens bad_words ban: each word's spellings alone and after a space (vLLM's
        two) that are one token each. The device bans single tokens only: a word with no
        one-token spelling is refused."""
        banned = set()
        for word in bad_words:
            spellings = [self.tokenizer.encode(text, add_special_tokens=False)
                         for text in dict.fromkeys((word, " " + word.lstrip()))]
            single = [ids[0] for ids in spellings if len(ids) == 1]
            if not single:
                raise RequestError(f"bad_words holds {word!r}, {min(map(len, spellings))} "
                                   "tokens however it is spelled; only words of one token "
                                   "can be banned")
            banned.update(single)
        if len(banned) > MAX_BANNED_TOKENS:
            raise RequestError(f"bad_words ban {len(banned)} tokens; at most "
                               f"{MAX_BANNED_TOKENS}")
        return sorted(banned)

    def encode_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise RequestError("a prompt must be a string or a list of token ids (ints)")
        # plain ints (the usual case) are checked in C-speed passes: a batch of long
        # token-id prompts would otherwise cost a Python call per token
        if set(map(type, prompt)) <= {int}:
            prompt = list(prompt)
        elif all(is_token_id(t) for t in prompt):  # NumPy integers, say
            prompt = [int(t) for t in prompt]
        else:
            raise RequestError("a prompt must be a string or a list of token ids (ints)")
        vocab = self.config.vocab_size
        if prompt and (min(prompt) < 0 or max(prompt) >= vocab):
            bad = next(t for t in prompt if not 0 <= t < vocab)
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        return prompt

    def abort(self, request_id: str) -> list[RequestOutput]:
        """End all of the request's samples that have not finished; returns their final
        outputs (none for a request that is unknown or over)."""
        request_id = str(request_id)
        samples = self.requests.pop(request_id, None)
        outputs = []
        for sample in samples or ():
            if sample.finish_reason is not None:
                continue
            self._num_unscheduled -= sample.scheduled_at is None
            self.scheduler.finish(sample.seq, SequenceStatus.FINISHED_ABORTED)
            del sample.seq.output_token_ids[sample.num_resolved:]  # tokens still coming
            sample.finish_reason = SequenceStatus.FINISHED_ABORTED.finish_reason  # not
            # "length": the scheduler may have finished it already, at its last token's launch
            sample.flush_text()
            outputs.append(sample.output())  # finished: nothing is held back
        if outputs and request_id in self._owned:  # a stream()/generate() waits on it
            self._undelivered.setdefault(request_id, []).extend(outputs)
        return outputs

    def close(self) -> None:
        """Abort every request, forget the steps in flight (their tokens are dropped) and
        close the backend, which hands its memory back; closing twice does nothing."""
        for request_id in list(self.requests):
            self.abort(request_id)
        self._in_flight = self._unhandled = None
        self._undelivered.clear()
        close_backend = getattr(self.backend, "close", None)
        if close_backend is not None:
            close_backend()

    def has_unfinished_requests(self) -> bool:
        # a step still running counts while some request waits for its tokens
        steps_left = self._in_flight is not None or self._unhandled is not None
        return self.scheduler.has_unfinished() or (steps_left and bool(self.requests))

    # ---- one step -------------------------------------------------------------------
    # Steps are pipelined one deep, so the GPU never waits for Python: step() schedules
    # and launches step k while step k-1 still runs, then waits for k-1's tokens and
    # handles them (text, stop rules, outputs) while step k runs. A sequence that needs
    # k-1's token in step k gets a placeholder, -(row + 1), that the device resolves from
    # k-1's sampled tokens (interface.py ForwardBatch). A sequence that turns out to
    # stop at k-1's token (EOS, stop string) already has step k queued: that extra token
    # is dropped and never shown. Blocks freed meanwhile are safe to hand out again: every
    # later use is queued behind step k on the same stream.
    def step(self) -> list[RequestOutput]:
        """Launch the next step, finish the previous one. Returns an output for every
        streamed request that got a new token and for every request that finished;
        finished requests are dropped from the engine after this."""
        if self._unhandled is not None:
            # an earlier step() was interrupted (Ctrl-C while waiting for tokens): its
            # placeholders name rows of that step, so it is finished before any launch
            return self._finish_step(self._unhandled)
        batch = self.scheduler.schedule()
        launched = self._launch(batch) if batch else None
        self.num_steps += launched is not None
        self.num_step_tokens = batch.num_tokens if batch else 0
        previous, self._in_flight = self._in_flight, launched
        if previous is None:
            return []
        self._unhandled = previous
        return self._finish_step(previous)

    def _launch(self, batch) -> "_Launched":
        if self._num_unscheduled:
            self._note_scheduled(batch)
        sampled = self.runner.run(batch)
        waiting_for = []
        for row, seq in self.scheduler.update_after_step(batch):
            seq.output_token_ids.append(-(row + 1))
            waiting_for.append((seq, row, len(seq.output_token_ids) - 1))
            if (len(seq.output_token_ids) >= seq.params.max_tokens
                    or seq.num_tokens >= self.context_limit):
                # known before the token is: schedule nothing more for it
                self.scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)
        return _Launched(sampled, waiting_for)

    def _note_scheduled(self, batch) -> None:
        """The first scheduling of each sample in the batch that had none yet."""
        now = time.monotonic()
        for seq in batch.seqs:
            samples = self.requests.get(seq.request_id)
            sample = samples[seq.index] if samples and seq.index < len(samples) else None
            if sample is not None and sample.seq is seq and sample.scheduled_at is None:
                sample.scheduled_at = now
                self._num_unscheduled -= 1

    def _finish_step(self, launched: "_Launched") -> list[RequestOutput]:
        """Handle a launched step's tokens; entries are taken off as they are handled, so an
        interrupted call leaves the rest for the next one (self._unhandled)."""
        tokens = launched.sampled.get().tolist()
        now = time.monotonic()  # when these tokens are known
        prompt = getattr(launched.sampled, "prompt_logprobs", None)
        if prompt is not None:
            launched.sampled.prompt_logprobs = None  # taken once (an interrupted step)
            self._take_prompt_logprobs(prompt)
        outputs = []
        waiting_for = launched.waiting_for
        while waiting_for:
            seq, row, index = waiting_for.pop()
            samples = self.requests.get(seq.request_id)  # (its id may be in use again)
            sample = samples[seq.index] if samples and seq.index < len(samples) else None
            if sample is None or sample.seq is not seq or index >= len(seq.output_token_ids):
                continue  # aborted, or stopped at an earlier token: this one is dropped
            seq.output_token_ids[index] = tokens[row]
            if sample.logprobs is not None:
                token_id, logprob, top = launched.sampled.logprobs().of_row(row, seq.params.logprobs)
                sample.logprobs.append(TokenLogprob(token_id, logprob, top))
            if sample.first_token_at is None:
                sample.first_token_at = now
            sample.last_token_at = now
            output = self._append_token(sample, index)
            if output is not None:
                outputs.append(output)
        self._unhandled = None
        return outputs

    def _take_prompt_logprobs(self, prompt) -> None:
        values, ids = prompt.host()
        offset = 0
        for seq, first, count in prompt.spans:
            samples = self.requests.get(seq.request_id)
            sample = samples[seq.index] if samples and seq.index < len(samples) else None
            if sample is not None and sample.seq is seq:
                sample.add_prompt_logprobs(first, values[offset:offset + count],
                                           ids[offset:offset + count])
            offset += count

    def _append_token(self, sample: _Sample, index: int) -> RequestOutput | None:
        """Output token `index` of the sample is now known: apply the stopping rules."""
        seq, params = sample.seq, sample.seq.params
        token_id = seq.output_token_ids[index]
        sample.num_resolved = index + 1
        # EOS and stop_token_ids stop (never before min_tokens: the device bans them)
        is_eos = index + 1 > params.min_tokens and (
            (token_id in self.eos_token_ids and not params.ignore_eos)
            or token_id in params.stop_token_ids)
        status = None
        if not is_eos and sample.add_text(token_id):  # a stop string
            status = SequenceStatus.FINISHED_STOPPED
        elif is_eos:
            sample.flush_text()
            status = SequenceStatus.FINISHED_STOPPED
        elif (index + 1 >= params.max_tokens
              or seq.num_prompt_tokens + index + 1 >= self.context_limit):
            sample.flush_text()
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            del seq.output_token_ids[index + 1:]  # a token of a step still running
            self.scheduler.finish(seq, status)
            sample.finish_reason = status.finish_reason
            samples = self.requests[seq.request_id]
            if all(s.finish_reason is not None for s in samples):  # the request is over
                del self.requests[seq.request_id]
        elif not sample.stream:
            return None
        return sample.output()

    # ---- whole requests -------------------------------------------------------------
    # stream() and generate() may run interleaved on one engine (a stream left half-read
    # while generate() runs): each takes the outputs of its own requests and leaves the
    # others' in self._undelivered for their owner.
    def _add_all(self, prompts: list, params: list[SamplingParams], stream: bool,
                 ids: list[str]) -> None:
        for prompt, sampling in zip(prompts, params):
            ids.append(self.add_request(prompt, sampling, stream=stream))  # ids seen by finally
            self._owned.add(ids[-1])

    def _outputs_for(self, ids) -> list[RequestOutput]:
        """The next outputs of these requests: waiting ones first, else one engine step."""
        waiting = []
        if self._undelivered:  # almost always empty: no pop per request on every step
            waiting = [o for rid in ids for o in self._undelivered.pop(rid, [])]
        if waiting:
            return waiting
        mine = []
        for output in self.step():
            if output.request_id in ids:
                mine.append(output)
            elif output.request_id in self._owned:
                self._undelivered.setdefault(output.request_id, []).append(output)
        return mine

    def _close(self, ids: list[str]) -> None:
        for request_id in ids:
            self._owned.discard(request_id)
            self.abort(request_id)
            self._undelivered.pop(request_id, None)

    def _run(self, prompts: list, params: list[SamplingParams], stream: bool,
             ids: list[str]) -> Iterator[RequestOutput]:
        """Add all prompts (their request ids go to `ids`), then yield their outputs as
        steps produce them (stream=False: only the final ones, one per sample). Requests
        still running when the caller stops iterating are aborted."""
        try:
            self._add_all(prompts, params, stream, ids)
            unfinished = {request_id: p.n for request_id, p in zip(ids, params)}  # samples
            while unfinished:
                for output in self._outputs_for(unfinished):
                    if output.finished:
                        unfinished[output.request_id] -= 1
                        if not unfinished[output.request_id]:
                            del unfinished[output.request_id]
                    yield output
        finally:
            self._close(ids)

    def stream(self, prompts: list, params: list[SamplingParams]) -> Iterator[RequestOutput]:
        """Add all prompts, then yield their outputs as steps produce them (each carries its
        request_id and its sample's index). Requests still running when the caller stops
        iterating are aborted. A prompt that cannot run is refused here, not at the first
        next() (the requests are added then)."""
        prompt_ids = [self.encode_prompt(prompt) for prompt in prompts]
        for ids in prompt_ids:
            self.scheduler.check_fits(len(ids))
        return self._run(prompt_ids, params, True, [])

    def generate(self, prompts: list, params: list[SamplingParams]) -> list[RequestOutput]:
        """The final outputs, by prompt and then by sample index: n of them for a prompt
        whose params say n."""
        ids: list[str] = []
        final = {(output.request_id, output.index): output
                 for output in self._run(prompts, params, False, ids)}
        return [final[request_id, index] for request_id, p in zip(ids, params)
                for index in range(p.n)]


def sample_seed(seed: int | None, index: int) -> int:
    """The seed of a request's sample `index`: without a seed, a fresh random one each;
    with one, that seed for sample 0 (as with n = 1) and for the others one derived from
    (seed, index), so the same seed gives the same n samples."""
    if seed is None:
        return secrets.randbits(63)
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")  # a uint64, as every seed is


class _Launched:
    """A step on its way: the handle of its sampled tokens, and for each sequence that
    wants one of them (sequence, row in the step, index in its output tokens)."""

    def __init__(self, sampled, waiting_for: list):
        self.sampled = sampled
        self.waiting_for = waiting_for[::-1]  # last first: pop() hands them out in order


def _find_stop(text: str, stops: list[str], num_old_chars: int) -> int | None:
    """Where the earliest stop string starts, looking only where a new match can be: one
    that ends in the text added since num_old_chars."""
    if not stops:
        return None
    positions = [i for i in (text.find(s, max(0, num_old_chars - len(s) + 1)) for s in stops)
                 if i >= 0]
    return min(positions) if positions else None
