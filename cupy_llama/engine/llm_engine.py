"""LLMEngine: add requests, step, abort; stopping rules and streaming text."""
from __future__ import annotations

import hashlib
import itertools
import secrets
import signal
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import compress
from operator import setitem
from pathlib import Path
from typing import Iterator

import numpy as np

from ..config import EngineConfig, ModelConfig
from ..errors import RequestError
from ..outputs import RequestOutput, are_token_ids
from ..sampling import (MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS, MAX_BANNED_TOKENS,
                        SamplingParams)
from ..structured import BadWordsMatcher, CombinedMatcher
from .block_manager import BlockManager
from .model_runner import ModelRunner
from .output_processor import (EngineDelta, OutputAccumulator, SampleText, TokenColumns,
                               output_limit, stop_status)
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus


# the fewest rows of a steady step that the engine resolves as _Rows: with their
# samples' counts in _Lanes, its fixed cost (some ten array operations a step) is
# below that of the per-row lookups it saves at 64 rows (docs/ARCHITECTURE.md, "The
# steady decode step"; measured with scripts/profile_host_path.py --serve)
STEADY_ROWS_MIN = 64


class _Sample:
    """One of a request's n sequences plus what its deltas have not carried yet: text
    (held back while a stop string could be forming), tokens and log-probabilities."""

    def __init__(self, seq: Sequence, tokenizer, stream: bool, text: bool, matcher=None):
        self.seq = seq
        # structured outputs: the sample's GrammarMatcher, advanced by each resolved token
        self.matcher = matcher
        # text=False: the caller makes the text from the token ids and matches the stop
        # strings (serve's server process); a sample with stop strings then sends every
        # step's tokens, streamed or not, and ends at a stop string when the caller says
        self.text = (SampleText(tokenizer, seq.params, stream or bool(seq.params.stop),
                                seq.prompt_token_ids) if text else None)
        self.stream = stream or (not text and bool(seq.params.stop))  # a delta every step
        # neither text made token by token nor a grammar: only stop_status can end the
        # sample at a token (LLMEngine._finish_step's short way)
        self.plain = matcher is None and (self.text is None or self.text.detokenizer is None)
        self.stop_token_ids = frozenset(seq.params.stop_token_ids)  # (a list in the params)
        # a streamed sample whose deltas carry token ids only: after its first delta (which
        # carries num_cached_tokens), a step's one new token may go in TokenColumns
        self.columnar = (self.stream and text is False and seq.params.logprobs is None
                         and seq.params.prompt_logprobs is None)
        # num_sent_tokens, num_resolved and last_token_at (properties below) are kept
        # here until a steady step's rows carry the sample, then in their _Lanes
        self._lanes: _Lanes | None = None
        self._lane = 0
        self._num_sent_tokens = 0
        # output tokens known on the host; the sequence may also hold placeholders for
        # tokens of steps still running (see LLMEngine.step)
        self._num_resolved = 0
        # why the sample ended, once its last known token says so (the sequence itself
        # may finish earlier in the scheduler, when its length is reached at launch)
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # the stop string or stop token, if one
        # (token id, logprob, top) per resolved token not in a delta yet, where asked
        self.logprobs: list | None = [] if seq.params.logprobs is not None else None
        # the prompt's scores (SamplingParams.prompt_logprobs), filled by sample 0 as its
        # prompt is computed: the (values, ids) rows the device returned, step by step, as
        # arrays (never an object per token here: docs/ARCHITECTURE.md, "Prompt
        # log-probabilities"), joined into one pair once every prompt token is scored
        self.prompt_chunks: list | None = None if seq.params.prompt_logprobs is None else []
        self.num_scored = 1  # prompt positions covered (the first has no score)
        self.prompt_scores: tuple | None = None  # (values, ids, ranks) once complete
        self.prompt_source = self  # the sample that computes them (sample 0)
        # in a delta already (a sample that asks none has none to send: its deltas skip
        # the check)
        self.prompt_logprobs_sent = seq.params.prompt_logprobs is None
        # the request's metrics (RequestOutput.times): when the engine took the sample, first
        # scheduled it, and had its first and last token
        self.added_at = time.monotonic()
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self._last_token_at: float | None = None

    # A steady step's rows write these three for all their samples as array operations
    # (_Lanes); elsewhere a sample's own attributes hold them.
    @property
    def num_resolved(self) -> int:
        lanes = self._lanes
        return self._num_resolved if lanes is None else int(lanes.resolved[self._lane])

    @num_resolved.setter
    def num_resolved(self, value: int) -> None:
        if self._lanes is None:
            self._num_resolved = value
        else:
            self._lanes.resolved[self._lane] = value

    @property
    def num_sent_tokens(self) -> int:
        lanes = self._lanes
        return self._num_sent_tokens if lanes is None else int(lanes.sent[self._lane])

    @num_sent_tokens.setter
    def num_sent_tokens(self, value: int) -> None:
        if self._lanes is None:
            self._num_sent_tokens = value
        else:
            self._lanes.sent[self._lane] = value

    @property
    def last_token_at(self) -> float | None:
        lanes = self._lanes
        if lanes is None:
            return self._last_token_at
        value = float(lanes.last_token_at[self._lane])
        return None if value != value else value  # NaN: none yet

    @last_token_at.setter
    def last_token_at(self, value: float | None) -> None:
        if self._lanes is None:
            self._last_token_at = value
        else:
            self._lanes.last_token_at[self._lane] = np.nan if value is None else value

    def finish(self, reason: str) -> None:
        """The sample has ended: its rows' tokens still coming are dropped (_Lanes.ended)."""
        self.finish_reason = reason
        if self._lanes is not None:
            self._lanes.ended[self._lane] = True
            self._lanes.num_ended += 1

    def finish_text(self, last_is_eos: bool) -> None:
        if self.text is not None:
            self.text.finish(self.seq.output_token_ids[:self.num_resolved - last_is_eos])

    def delta(self) -> EngineDelta:
        """What is new since the previous delta."""
        seq = self.seq
        text = "" if self.text is None else self.text.take(self.finish_reason is not None)
        sent = self.num_sent_tokens
        token_ids = seq.output_token_ids[sent:self.num_resolved]
        self.num_sent_tokens = self.num_resolved
        logprobs = self.logprobs
        if logprobs is not None:
            self.logprobs = []
        times = None
        # at the end, and with the first tokens: a stop string that the server process
        # finds ends the sample there, before this end, and its metrics need these times
        if self.finish_reason is not None or (not sent and token_ids):
            times = (self.added_at, self.scheduled_at, self.first_token_at, self.last_token_at)
        prompt = None
        if not self.prompt_logprobs_sent:
            prompt = self.complete_prompt_logprobs()
            self.prompt_logprobs_sent = prompt is not None
        return _new_tuple(EngineDelta, (
            seq.request_id, seq.index, text, token_ids, self.finish_reason, logprobs,
            max(0, seq.num_cached_tokens), times, prompt, self.stop_reason))

    def complete_prompt_logprobs(self) -> tuple | None:
        """The prompt's scores, (values [P - 1, 1 + k] float32, ids [P - 1, 1 + k] int32,
        ranks [P - 1] int32), once every prompt token is scored, else None (PromptScores'
        arrays)."""
        source = self.prompt_source
        if source.prompt_scores is None:
            chunks = source.prompt_chunks
            if chunks is None or source.num_scored < self.seq.num_prompt_tokens:
                return None
            if not chunks:  # a prompt of one token: nothing to score
                width = 1 + self.seq.params.prompt_logprobs
                source.prompt_scores = (np.empty((0, width), np.float32),
                                        np.empty((0, width), np.int32),
                                        np.empty(0, np.int32))
            elif len(chunks) == 1:
                source.prompt_scores = chunks[0]
            else:
                source.prompt_scores = tuple(np.concatenate(parts) for parts in zip(*chunks))
            source.prompt_chunks = []
        return source.prompt_scores

    def add_prompt_logprobs(self, first: int, values, ids, ranks) -> None:
        """Scores of prompt tokens first, first + 1, ... (rows of values and ids: the token's
        then the top k's, of the step's width; ranks: the token's place); those it has
        already (a recomputed prompt) are kept."""
        skip = max(0, self.num_scored - first)
        if skip >= values.shape[0]:
            return
        width = 1 + self.seq.params.prompt_logprobs  # the step's may be wider
        # copies: the step's arrays are not the sample's to keep
        self.prompt_chunks.append((np.array(values[skip:, :width], np.float32),
                                   np.array(ids[skip:, :width], np.int32),
                                   np.array(ranks[skip:], np.int32)))
        self.num_scored += values.shape[0] - skip


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


CLOSED = "this LLM is closed; make a new one to generate"  # after LLMEngine.close()


class _Interrupts:
    """SIGINT as Python's own handler takes it (KeyboardInterrupt), except while an engine
    turn runs in the main thread: there it waits for the turn's end, so that Ctrl-C never
    leaves the engine's bookkeeping half done (a sample in the scheduler whose request is
    not registered yet would run for ever, owned by no one). generate() and stream()
    install it for their lifetime where Python's own handler is in place (a program with
    a handler of its own, such as the terminal chat, decides for itself); a turn then only
    marks itself busy. A second Ctrl-C during the same turn raises at once: a way out of
    a turn that does not end (a hung device)."""

    def __init__(self):
        self.users = 0       # calls that installed it and have not ended
        self.busy = 0        # turns running in the main thread
        self.pending = False  # a Ctrl-C came during one
        self.previous = None

    def __call__(self, signum, frame):
        if self.busy and not self.pending:
            self.pending = True
            return
        self.pending = False
        raise KeyboardInterrupt

    def install(self) -> bool:
        """Take SIGINT for a call (main thread only); True where it did."""
        if threading.current_thread() is not threading.main_thread():
            return False
        handler = signal.getsignal(signal.SIGINT)
        if handler is not self:
            if handler is not signal.default_int_handler:
                return False
            self.previous = signal.signal(signal.SIGINT, self)
        self.users += 1
        return True

    def uninstall(self) -> None:
        self.users -= 1
        if not self.users:
            self.pending = False  # none outlives the calls it came in
            if (threading.current_thread() is threading.main_thread()
                    and signal.getsignal(signal.SIGINT) is self):
                signal.signal(signal.SIGINT, self.previous)

    @contextmanager
    def deferred(self):
        """Ctrl-C in the block raises KeyboardInterrupt at its end; a block that ends with
        an error of its own raises that error only (the call fails either way)."""
        marks = self.users > 0 and threading.get_ident() == threading.main_thread().ident
        self.busy += marks
        try:
            yield
        finally:
            self.busy -= marks
            interrupted = marks and self.pending and not self.busy
            if interrupted:
                self.pending = False
        if interrupted:
            raise KeyboardInterrupt


_INTERRUPTS = _Interrupts()


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
                                   max_model_len=max_model_len,
                                   model_limit=model_config.context_limit)
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
        # turns the steps' deltas into RequestOutputs for step(), abort(), stream() and
        # generate(); None where the caller takes the deltas itself (step_deltas(), as
        # serve's engine process does): requests are then not recorded here
        self.outputs: OutputAccumulator | None = OutputAccumulator()
        self._undelivered: dict[str, list[RequestOutput]] = {}
        self._owned: set[str] = set()  # requests some stream() or generate() is waiting on
        # generate() and stream() from several threads take turns at the engine: each adds
        # its requests or runs a step under this lock (_turn). A stream that ends while
        # the engine is busy (another thread's turn, or its own thread's, where the garbage
        # collector finalizes it in the middle of a step) leaves its requests in
        # _to_close, for the next turn to close first
        self._lock = threading.Lock()
        self._to_close: deque[list[str]] = deque()
        self.closed = False
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._grammars = None  # GrammarCompiler, made at the first constrained request
        self._grammars_lock = threading.Lock()
        self._compile_pool = None  # the worker thread of compile_structured_async
        self._bitmask = None  # [max_num_seqs, words] uint32: a step's mask rows, filled here
        self._every_token = None  # the free mask of a ReasoningGate's thinking
        self._columns: TokenColumns | None = None  # the one step_deltas() call's, if any

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
        model_dir = Path(model_dir).expanduser()  # "~/..." as a shell would take it
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
        tokenizer.check_fits(config.vocab_size, model_dir)
        tokenizer.check_chat_template()  # a broken template fails the load, not a chat
        model = model_for(config)
        with open_checkpoint(model_dir, model, log=log) as checkpoint:
            backend = make_backend(device, model, checkpoint, engine_config, max_model_len, log)
        engine = cls(config, tokenizer, backend, engine_config, max_model_len)
        if engine.context_limit < max_model_len:  # the cache ends sequences, not the limit
            log(f"warning: the KV cache holds {engine.context_limit} tokens, fewer than "
                f"max_model_len {max_model_len}: a sequence stops at {engine.context_limit}; "
                "give the cache more memory (num_kv_blocks / gpu_memory_utilization) or "
                "lower max_model_len")
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
    def compile_structured(self, spec):
        """The compiled grammar of a StructuredSpec (cached by its text): RequestError
        quoting the compiler when it does not compile, or naming the `structured` extra
        when llguidance is missing. Front ends call it before they queue a request."""
        with self._grammars_lock:
            if self._grammars is None:  # reads the whole vocabulary: seconds for 128k tokens
                from ..structured import GrammarCompiler
                self._grammars = GrammarCompiler.from_tokenizer(
                    self.tokenizer, self.config.vocab_size, self.eos_token_ids)
        return self._grammars.compile(spec)

    def compile_structured_async(self, spec):
        """compile_structured on a worker thread: a concurrent.futures.Future, for a loop
        that must not wait (the server's engine process adds a constrained request once
        its grammar is compiled; add_request then finds it in the cache)."""
        if self._compile_pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="cupy-llama-grammar")
        return self._compile_pool.submit(self.compile_structured, spec)

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, stream: bool = True,
                    text: bool = True) -> str:
        """stream=False: step() reports this request only when it finishes. With params.n
        > 1 the request is n sequences, its samples: each output says which one it is
        (RequestOutput.index); the prompt is computed once (engine/scheduler.py).
        text=False: the deltas carry no text and stop strings are not matched here; the
        caller makes the text (SampleText) and ends a sample at its stop string with
        abort_deltas(request_id, index), as serve's server process does."""
        prompt_ids = self.encode_prompt(prompt)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        self.check_token_ids(params)
        grammar = None if params.structured is None else self.compile_structured(params.structured)
        allowed = self.allowed_tokens_matcher(params.allowed_token_ids)
        banned, word_bans = self.bad_word_bans(params.bad_words)
        samples, parent = [], None
        for index in range(params.n):
            seq = Sequence(request_id, prompt_ids, params, sample_seed(params.seed, index),
                           next(self._arrivals), index=index, parent=parent)
            seq.banned_token_ids = banned
            seq.output_limit = output_limit(params, len(prompt_ids), self.context_limit)
            parent = parent or seq
            # each sample follows the grammar on its own: a fresh matcher each
            matcher = allowed if grammar is None else self._grammar_matcher(grammar, params)
            if word_bans is not None:  # and keeps its own output tokens for its bad words
                matcher = (word_bans.fork() if matcher is None
                           else CombinedMatcher(matcher, word_bans.fork()))
                seq.is_constrained = True
            self.scheduler.add(seq)
            samples.append(_Sample(seq, self.tokenizer, stream, text, matcher))
            samples[-1].prompt_source = samples[0]
        self.requests[request_id] = samples
        self._num_unscheduled += len(samples)
        if self.outputs is not None:
            self.outputs.add(request_id, prompt_ids, params.n)
        return request_id

    def _grammar_matcher(self, grammar, params: SamplingParams):
        """A fresh matcher of a compiled grammar; behind a ReasoningGate where the
        constraint starts after a token (structured.starts_after)."""
        after = params.structured.starts_after
        if after is None:
            return grammar.matcher()
        from ..structured import AllowedTokensMatcher, ReasoningGate
        if self._every_token is None:  # the whole vocabulary, shared: it keeps no state
            self._every_token = AllowedTokensMatcher(range(self.config.vocab_size),
                                                     self._bitmask_words())
        return ReasoningGate(grammar.matcher(), after, self._every_token)

    def check_token_ids(self, params: SamplingParams) -> None:
        """The token ids a request names, against the model's vocabulary (the bias and ban
        tables and the masks index the logits by them): add_request checks them first, and
        stream() at its call."""
        self.check_in_vocabulary("logit_bias", params.logit_bias)
        self.check_in_vocabulary("stop_token_ids", params.stop_token_ids)
        if params.structured is not None and params.structured.starts_after is not None:
            self.check_in_vocabulary("structured.starts_after", [params.structured.starts_after])
        token_ids = params.allowed_token_ids
        if token_ids is not None:
            vocab = self.config.vocab_size
            if len(token_ids) > vocab:
                raise RequestError(f"allowed_token_ids holds {len(token_ids)} ids; the "
                                   f"vocabulary has only {vocab}")
            self.check_in_vocabulary("allowed_token_ids", token_ids)

    def allowed_tokens_matcher(self, token_ids: list[int] | None):
        """The fixed-mask matcher of allowed_token_ids (None for none), whose ids
        check_token_ids has checked."""
        if token_ids is None:
            return None
        from ..structured import AllowedTokensMatcher
        return AllowedTokensMatcher(token_ids, self._bitmask_words())

    def check_in_vocabulary(self, name: str, token_ids) -> None:
        """RequestError naming the field where a token id (of a list, or a dict's keys) is
        outside the model's vocabulary: the logits have no such entry."""
        vocab = self.config.vocab_size
        outside = next((t for t in token_ids if t >= vocab), None)
        if outside is not None:
            raise RequestError(f"{name} holds token id {outside}, outside the vocabulary "
                               f"[0, {vocab})")

    def _bitmask_words(self) -> int:
        """Words of a bitmask row: enough for the model's vocabulary and the tokenizer's
        (a grammar's mask covers the larger, structured.GrammarCompiler)."""
        from ..structured import bitmask_words
        return bitmask_words(max(self.config.vocab_size, self.tokenizer.vocab_size))

    def bad_word_sequences(self, bad_words: list[str]) -> list[tuple[int, ...]]:
        """The token sequences bad_words ban, spelled as vLLM spells them: each word without
        its leading spaces, and after one space where that spelling starts with another
        token and has as many (the word inside a text rather than at its start). A
        spelling holding an id outside the model's vocabulary, which it never samples, is
        left out."""
        vocab, sequences = self.config.vocab_size, {}
        for word in bad_words:
            word = word.lstrip()
            plain = tuple(self.tokenizer.encode(word, add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word, add_special_tokens=False))
            spellings = [plain]
            if plain and spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                spellings.append(spaced)
            for ids in spellings:
                if ids and max(ids) < vocab:
                    sequences[ids] = None
        return list(sequences)

    def bad_word_bans(self, bad_words: list[str]) -> tuple[list[int], BadWordsMatcher | None]:
        """What bad_words ban: (the tokens of words of one token, banned at every step by
        the device's bias entries; a BadWordsMatcher, to fork for each sample, for the
        words of more than one token, or None when there are none: a request without them
        never takes the mask path). RequestError past the limits."""
        sequences = self.bad_word_sequences(bad_words)
        banned = sorted({ids[0] for ids in sequences if len(ids) == 1})
        if len(banned) > MAX_BANNED_TOKENS:
            raise RequestError(f"bad_words ban {len(banned)} words of one token; at most "
                               f"{MAX_BANNED_TOKENS}")
        longer = [ids for ids in sequences if len(ids) > 1]
        if len(longer) > MAX_BAD_WORD_SEQUENCES:
            raise RequestError(f"bad_words spell {len(longer)} sequences of more than one "
                               f"token; at most {MAX_BAD_WORD_SEQUENCES}")
        num_tokens = sum(map(len, longer))
        if num_tokens > MAX_BAD_WORD_TOKENS:
            raise RequestError(f"bad_words of more than one token spell {num_tokens} tokens "
                               f"in all; at most {MAX_BAD_WORD_TOKENS}")
        if not longer:
            return banned, None
        return banned, BadWordsMatcher(longer, self._bitmask_words())

    def encode_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise RequestError("a prompt must be a string or a list of token ids (ints)")
        # plain ints (the usual case) are checked in C-speed passes: a batch of long
        # token-id prompts would otherwise cost a Python call per token
        if set(map(type, prompt)) <= {int}:
            prompt = list(prompt)
        elif are_token_ids(prompt):  # NumPy integers, say
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
        outputs = self.outputs.process(self.abort_deltas(request_id))
        if outputs and request_id in self._owned:  # a stream()/generate() waits on it
            self._undelivered.setdefault(request_id, []).extend(outputs)
        return outputs

    def abort_deltas(self, request_id: str, index: int | None = None) -> list[EngineDelta]:
        """abort() as deltas: the final one of each sample that had not finished (of sample
        `index` only, where given)."""
        request_id = str(request_id)
        samples = self.requests.get(request_id)
        if samples is None:
            return []
        deltas = []
        for sample in samples if index is None else samples[index:index + 1]:
            if sample.finish_reason is not None:
                continue
            self._num_unscheduled -= sample.scheduled_at is None
            self.scheduler.finish(sample.seq, SequenceStatus.FINISHED_ABORTED)
            del sample.seq.output_token_ids[sample.num_resolved:]  # tokens still coming
            sample.finish(SequenceStatus.FINISHED_ABORTED.finish_reason)  # not
            # "length": the scheduler may have finished it already, at its last token's launch
            sample.finish_text(last_is_eos=False)
            deltas.append(sample.delta())  # finished: nothing is held back
        if all(s.finish_reason is not None for s in samples):
            del self.requests[request_id]
        return deltas

    def close(self) -> None:
        """Abort every request, forget the steps in flight (their tokens are dropped) and
        close the backend, which hands its memory back; closing twice does nothing."""
        with self._lock:
            self._to_close.clear()
            self._close_engine()

    def _close_engine(self) -> None:
        self.closed = True
        for request_id in list(self.requests):
            self.abort_deltas(request_id)
        if self.outputs is not None:
            self.outputs = OutputAccumulator()
        self._in_flight = self._unhandled = None
        self._undelivered.clear()
        if self._compile_pool is not None:
            self._compile_pool.shutdown(wait=False, cancel_futures=True)
            self._compile_pool = None
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
    #
    # Constrained sequences (structured outputs): step k's mask of such a sequence depends
    # on its token of step k-1. Step k runs its forward pass for every row but leaves the
    # constrained rows' draw out; once step k-1's tokens are handled (each matcher advanced
    # by its token), their masks are filled and a second, masked draw of step k's logits
    # is queued (_draw_constrained), before step k+1 is launched (docs/ARCHITECTURE.md,
    # "Structured outputs and tools").
    def step(self) -> list[RequestOutput]:
        """Launch the next step, finish the previous one. Returns an output for every
        streamed request that got a new token and for every request that finished;
        finished requests are dropped from the engine after this."""
        return self.outputs.process(self.step_deltas())

    def step_deltas(self, columns: TokenColumns | None = None) -> list[EngineDelta]:
        """step() as deltas: one for each streamed sample that got a new token and for each
        sample that finished. With columns (TokenColumns.empty()), the one-token deltas of
        samples added with text=False and no log-probabilities go there instead, except
        each sample's first (serve's engine process sends them so)."""
        self._columns = columns
        if self._unhandled is not None:
            # an earlier step() was interrupted (Ctrl-C while waiting for tokens): its
            # placeholders name rows of that step, so it is finished before any launch
            outputs = self._finish_step(self._unhandled)
            self._draw_constrained(self._in_flight)
            return outputs
        batch = self.scheduler.schedule()
        launched = self._launch(batch) if batch else None
        self.num_steps += launched is not None
        self.num_step_tokens = batch.num_tokens if batch else 0
        previous, self._in_flight = self._in_flight, launched
        if previous is None:
            self._draw_constrained(launched)
            return []
        self._unhandled = previous
        outputs = self._finish_step(previous)
        self._draw_constrained(launched)
        return outputs

    def _draw_constrained(self, launched: "_Launched | None") -> None:
        """Fill the masks of a launched step's constrained rows from their matchers (which
        have seen every earlier token) and queue their masked draw. Rows of sequences that
        ended meanwhile are left out: their tokens are dropped anyway."""
        if launched is None or getattr(launched.sampled, "deferred_inputs", None) is None:
            return  # no row was deferred (or they are drawn already)
        constrained = launched.constrained or ()  # none: only prompt chunks were deferred
        if self._bitmask is None:
            import numpy as np
            self._bitmask = np.zeros((self.engine_config.max_num_seqs,
                                      self._bitmask_words()), np.uint32)
        rows = []
        for seq, row, index in constrained:
            sample = self._sample_of(seq)
            if (sample is None or sample.finish_reason is not None
                    or index >= len(seq.output_token_ids)):
                continue
            sample.matcher.fill_bitmask(self._bitmask, len(rows))
            rows.append(row)
        self.runner.backend.ops.sample_masked(launched.sampled, rows, self._bitmask)
        launched.sampled.deferred_inputs = None

    def _sample_of(self, seq: Sequence) -> "_Sample | None":
        """seq's sample, while its request runs (its id may be in use again)."""
        samples = self.requests.get(seq.request_id)
        sample = samples[seq.index] if samples and seq.index < len(samples) else None
        return sample if sample is not None and sample.seq is seq else None

    def _launch(self, batch) -> "_Launched":
        if self._num_unscheduled:
            self._note_scheduled(batch)
        in_flight = self._in_flight
        batch.inputs_in_flight = (batch.follows is not None and in_flight is not None
                                  and in_flight.batch is batch.follows)
        sampled = self.runner.run(batch)
        if batch.inputs_in_flight and len(batch.seqs) >= STEADY_ROWS_MIN:
            rows = self._steady_rows(in_flight, batch)
            if rows is not None:
                return self._launch_steady(batch, sampled, rows)
        waiting_for, constrained = [], None
        for row, seq in self.scheduler.update_after_step(batch):
            outputs = seq.output_token_ids
            outputs.append(-(row + 1))
            waiting_for.append((seq, row, len(outputs) - 1))
            if seq.is_constrained:
                constrained = constrained or []
                constrained.append(waiting_for[-1])
            if len(outputs) >= seq.output_limit:  # stop_status's lengths, the token unknown
                # its length ends it at this token: nothing is left to schedule (the token
                # still comes, and stop_status decides again what it says)
                self.scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)
        return _Launched(batch, sampled, waiting_for, constrained)

    def _steady_rows(self, last: "_Launched", batch) -> "_Rows | None":
        """The rows of a steady step that follows `last` (still in flight): last's rows
        less the dropped ones, each a token further on; None where a kept row's sample is
        gone (the step is then launched the long way)."""
        rows = last.rows
        if rows is None:  # last was launched the long way: its entries, in row order
            entries = last.waiting_for[::-1]
            if len(entries) != len(last.batch.seqs):
                return None
            rows = _Rows.of([self._sample_of(seq) for seq, _, _ in entries],
                            [index for _, _, index in entries])
        if batch.dropped:
            rows = rows.without(batch.dropped)
            if None in rows.samples:
                return None
        elif rows.incomplete:
            return None
        return rows.moved_on()

    def _launch_steady(self, batch, sampled, rows: "_Rows") -> "_Launched":
        """_launch for a steady step: a placeholder for each row, and the lengths checked
        as arrays (each row's output index is the last step's plus one)."""
        self.scheduler.update_after_step(batch, placeholders=True)
        seqs = batch.seqs
        # stop_status's lengths, the token unknown: nothing is left to schedule (the rows
        # whose output limit this token reaches, which _finish_step takes the long way)
        state = rows.state
        ended = state[_Rows.LEFT] <= 0
        if ended.any():
            rows.long = ended | rows.never_short
            for row in np.flatnonzero(ended).tolist():
                self.scheduler.finish(seqs[row], SequenceStatus.FINISHED_LENGTH)
        elif rows.any_never_short:
            rows.long = rows.never_short
        rows.num_ended = rows.lanes.num_ended
        constrained = None
        if rows.constrained:
            indexes = state[_Rows.INDEX].tolist()
            constrained = [(seqs[row], row, indexes[row]) for row, sample
                           in enumerate(rows.samples) if sample.seq.is_constrained]
        launched = _Launched(batch, sampled, [], constrained)
        launched.rows = rows
        return launched

    def _finish_rows(self, launched: "_Launched", token_array, tokens: list[int], now: float,
                     deltas: list) -> None:
        """_finish_step's short way for a steady step's rows (_Rows): a row whose token
        stop_status certainly says None for (below the output limit, not EOS, a sample
        without stop tokens) and whose sample has no grammar, no text made token by token
        and no log-probabilities takes its token with a few array operations over all
        such rows (its sample's counts and time are in _Lanes); the others become entries
        for the long way (launched.waiting_for), and the rows of samples that ended
        since the launch are dropped."""
        rows = launched.rows
        lanes, state, num_rows = rows.lanes, rows.state, len(rows.samples)
        lane, indexes = state[_Rows.LANE], state[_Rows.INDEX]
        long, skip = rows.long, None
        if lanes.num_ended != rows.num_ended or rows.started:
            # a sample ended since the launch, or an interrupted call handled some rows
            skip = lanes.ended[lane] | (lanes.resolved[lane] > indexes)
        rows.started = True
        if len(tokens) != num_rows:
            tokens, token_array = tokens[:num_rows], token_array[:num_rows]
        if self.eos_token_ids:
            eos = token_array >= min(self.eos_token_ids)  # those that may be EOS
            if eos.any():
                eos &= np.isin(token_array, list(self.eos_token_ids))
                long = eos if long is None else long | eos
        if skip is not None:
            long = None if long is None else long & ~skip
            if not skip.any():
                skip = None
        if long is not None and not long.any():
            long = None
        waiting_for = []
        if long is not None:
            waiting_for = [(rows.samples[row].seq, row, index) for row, index in zip(
                np.flatnonzero(long).tolist(), indexes[long].tolist())]
        columns, short = self._columns, None
        samples, outputs, request_ids, sample_indexes = (
            rows.samples, rows.outputs, rows.request_ids, rows.sample_indexes)
        short_tokens, short_indexes = tokens, indexes
        if long is not None or skip is not None:  # some rows are not the short way's
            short = ~long if skip is None else ~skip if long is None else ~(long | skip)
            picked = short.tolist()
            samples, outputs, request_ids, sample_indexes, short_tokens = (
                list(compress(values, picked)) for values in
                (samples, outputs, request_ids, sample_indexes, tokens))
            short_indexes, lane = indexes[short], lane[short]
        # outputs[index] = token for each row (at C speed: no Python frame a row)
        deque(map(setitem, outputs, short_indexes.tolist(), short_tokens), maxlen=0)
        resolved = short_indexes + 1
        lanes.resolved[lane] = resolved
        lanes.last_token_at[lane] = now
        if rows.kinds is not None:  # every row streams the same way
            if rows.kinds == _Rows.COLUMN and columns is not None:
                lanes.sent[lane] = resolved
                columns[0].extend(request_ids)
                columns[1].extend(sample_indexes)
                columns[2].extend(short_tokens)
            elif rows.kinds != _Rows.QUIET:
                deltas += [sample.delta() for sample in samples]
        else:
            kind = state[_Rows.KIND] if short is None else state[_Rows.KIND][short]
            by_delta = kind != _Rows.QUIET
            if columns is not None:
                in_column = kind == _Rows.COLUMN
                by_delta &= ~in_column
                lanes.sent[lane[in_column]] = resolved[in_column]
                picked = in_column.tolist()
                columns[0].extend(compress(request_ids, picked))
                columns[1].extend(compress(sample_indexes, picked))
                columns[2].extend(compress(short_tokens, picked))
            deltas += [samples[row].delta() for row in np.flatnonzero(by_delta).tolist()]
        launched.waiting_for = waiting_for[::-1]
        launched.rows = None  # the rest are entries now
        in_flight = self._in_flight
        if in_flight is None or in_flight.rows is None or in_flight.rows.lanes is not lanes:
            lanes.release()  # the step after this one was launched the long way

    def _note_scheduled(self, batch) -> None:
        """The first scheduling of each sample in the batch that had none yet."""
        now = time.monotonic()
        for seq in batch.seqs:
            samples = self.requests.get(seq.request_id)
            sample = samples[seq.index] if samples and seq.index < len(samples) else None
            if sample is not None and sample.seq is seq and sample.scheduled_at is None:
                sample.scheduled_at = now
                self._num_unscheduled -= 1

    def _finish_step(self, launched: "_Launched") -> list[EngineDelta]:
        """Handle a launched step's tokens; entries are taken off as they are handled, so an
        interrupted call leaves the rest for the next one (self._unhandled). The one-token
        deltas that may go in columns go to step_deltas' TokenColumns, where it has one."""
        token_array = launched.sampled.get()
        tokens = token_array.tolist()
        now = time.monotonic()  # when these tokens are known
        prompt = getattr(launched.sampled, "prompt_logprobs", None)
        if prompt is not None:
            launched.sampled.prompt_logprobs = None  # taken once (an interrupted step)
            self._take_prompt_logprobs(prompt)
        deltas = []
        requests, waiting_for = self.requests, launched.waiting_for
        eos = self.eos_token_ids
        columns = self._columns
        if columns is not None:
            column_ids, column_indexes, column_tokens = columns
        if launched.rows is not None:  # a steady step: most rows the short way at once
            self._finish_rows(launched, token_array, tokens, now, deltas)
            waiting_for = launched.waiting_for
        while waiting_for:
            seq, row, index = waiting_for.pop()
            samples = requests.get(seq.request_id)  # (its id may be in use again)
            sample = samples[seq.index] if samples and seq.index < len(samples) else None
            if sample is None or sample.seq is not seq or index >= len(seq.output_token_ids):
                continue  # aborted, or stopped at an earlier token: this one is dropped
            token_id = seq.output_token_ids[index] = tokens[row]
            if sample.logprobs is not None:
                sample.logprobs.append(
                    launched.sampled.logprobs().of_row(row, seq.params.logprobs))
            if sample.first_token_at is None:
                sample.first_token_at = now
            sample.last_token_at = now
            # stop_status says None for certain (its lengths not reached, not a token that
            # may stop), and only stop_status can end the sample here: the short way
            if sample.plain and index + 1 < seq.output_limit and token_id not in eos \
                    and token_id not in sample.stop_token_ids:
                sample.num_resolved = index + 1  # _append_token's way when nothing ends
                if not sample.stream:
                    continue
                if columns is not None and sample.columnar and 0 < sample.num_sent_tokens == index:
                    column_ids.append(seq.request_id)
                    column_indexes.append(seq.index)
                    column_tokens.append(token_id)
                    sample.num_sent_tokens = index + 1
                else:
                    deltas.append(sample.delta())
                continue
            if self._append_token(sample, index, token_id):
                deltas.append(sample.delta())
        self._unhandled = None
        return deltas

    def _take_prompt_logprobs(self, prompt) -> None:
        values, ids, ranks = prompt.host()
        offset = 0
        for seq, first, count in prompt.spans:
            sample = self._sample_of(seq)
            if sample is not None:
                span = slice(offset, offset + count)
                sample.add_prompt_logprobs(first, values[span], ids[span], ranks[span])
            offset += count

    def _append_token(self, sample: _Sample, index: int, token_id: int) -> bool:
        """Output token `index` of the sample is now known: apply the stopping rules.
        True when the sample has a delta to send (streamed, or finished)."""
        seq, params = sample.seq, sample.seq.params
        sample.num_resolved = index + 1
        status, stop_reason = stop_status(params, token_id, index + 1,
                                          seq.num_prompt_tokens + index + 1,
                                          self.eos_token_ids, self.context_limit)
        grammar_status = None
        if sample.matcher is not None and status is not SequenceStatus.FINISHED_STOPPED:
            grammar_status = self._advance_matcher(sample, token_id)
            if grammar_status is SequenceStatus.FINISHED_ABORTED:
                return self._reject_token(sample, index)
        text, stop = sample.text, None
        # the stop string the token completes, if any; a stop token or EOS is matched only
        # where its text is kept (include_stop_str_in_output), and a stop string it
        # completes is then the stop reason, as vLLM's detokenizer decides
        if (status is not SequenceStatus.FINISHED_STOPPED or params.include_stop_str_in_output) \
                and text is not None and text.detokenizer is not None:
            stop = text.add(token_id)
        if stop is not None:
            status, stop_reason = SequenceStatus.FINISHED_STOPPED, stop
        elif grammar_status is not None:
            status = grammar_status  # its last token is the grammar's: it has text
            sample.finish_text(last_is_eos=False)
        elif status is not None:  # EOS or a stop token: its text only where asked (vLLM)
            sample.finish_text(last_is_eos=status is SequenceStatus.FINISHED_STOPPED
                               and not params.include_stop_str_in_output)
        if status is None:
            return sample.stream
        sample.stop_reason = stop_reason
        self._end_sample(sample, index + 1, status)
        return True

    def _reject_token(self, sample: _Sample, index: int) -> bool:
        """The sample's constraint rejected its output token `index`: the sample ends
        before it ("abort"), so its text, tokens and logprobs keep to the constraint."""
        sample.num_resolved = index
        if sample.logprobs:
            sample.logprobs.pop()  # the rejected token's, appended as it arrived
        sample.finish_text(last_is_eos=False)
        self._end_sample(sample, index, SequenceStatus.FINISHED_ABORTED)
        return True

    def _end_sample(self, sample: _Sample, num_tokens: int, status: SequenceStatus) -> None:
        """Finish the sample with its first num_tokens output tokens."""
        seq = sample.seq
        del seq.output_token_ids[num_tokens:]  # tokens of a step still running
        self.scheduler.finish(seq, status)
        sample.finish(status.finish_reason)
        samples = self.requests[seq.request_id]
        if all(s.finish_reason is not None for s in samples):  # the request is over
            del self.requests[seq.request_id]

    def _advance_matcher(self, sample: _Sample, token_id: int) -> SequenceStatus | None:
        """Advance the sample's matcher by its new token: "stop" once the grammar is
        complete (nothing may follow but EOS), "abort" for a token the constraint rejects.
        A draw under the mask never gives one, unless the request's own settings left
        the mask empty (bad_words against its grammar): logged with the reason."""
        matcher = sample.matcher
        if not matcher.advance(token_id):
            import logging
            logging.getLogger("cupy_llama").warning(
                "request %s: token %d breaks its constraint (%s); the sample ends before it",
                sample.seq.request_id, token_id, matcher.error)
            return SequenceStatus.FINISHED_ABORTED
        return SequenceStatus.FINISHED_STOPPED if matcher.is_complete else None

    # ---- whole requests -------------------------------------------------------------
    # stream() and generate() may run interleaved on one engine (a stream left half-read
    # while generate() runs, or calls from several threads, which take turns under
    # self._lock): each takes the outputs of its own requests and leaves the others' in
    # self._undelivered for their owner.
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
            self.outputs.discard(request_id)  # added, and never taken in (a bad prompt)
            self._undelivered.pop(request_id, None)

    def _run(self, prompts: list, params: list[SamplingParams], stream: bool,
             ids: list[str]) -> Iterator[RequestOutput]:
        """Add all prompts (their request ids go to `ids`), then yield their outputs as
        steps produce them (stream=False: only the final ones, one per sample). Requests
        still running when the caller stops iterating are aborted."""
        interrupts = False
        try:
            interrupts = _INTERRUPTS.install()
            with self._turn():
                self._check_open()
                self._add_all(prompts, params, stream, ids)
            unfinished = set(ids)
            while unfinished:
                with self._turn():
                    self._check_open()  # a stream read on after close(): its requests are gone
                    outputs = self._outputs_for(unfinished)
                    # the requests' last outputs: their accumulator forgot them
                    ended = [output.request_id for output in outputs if output.finished
                             and output.request_id not in self.outputs]
                unfinished.difference_update(ended)
                for output in outputs:
                    self._check_open()  # closed while the caller read the step's outputs
                    yield output
        finally:
            try:
                self._close_when_free(ids)
            finally:
                if interrupts:
                    _INTERRUPTS.uninstall()

    @contextmanager
    def _turn(self):
        """This call's turn at the engine: the lock, with the requests of streams that
        ended while the engine was busy closed before and after it (and once more where a
        stream ended as the lock was let go). Ctrl-C during it takes effect at its end
        (_Interrupts)."""
        with self._lock, _INTERRUPTS.deferred():
            self._close_queued()
            yield
            self._close_queued()
        if self._to_close and self._lock.acquire(blocking=False):
            try:
                with _INTERRUPTS.deferred():
                    self._close_queued()
            finally:
                self._lock.release()

    def _close_queued(self) -> None:
        while self._to_close:
            self._close(self._to_close.popleft())

    def _close_when_free(self, ids: list[str]) -> None:
        """Close the requests now where the engine is free, else at the next turn: a
        stream's end never waits for the lock, and never closes requests in the middle of
        a step."""
        if self._lock.acquire(blocking=False):
            try:
                with _INTERRUPTS.deferred():
                    self._close(ids)
            finally:
                self._lock.release()
        else:
            self._to_close.append(ids)

    def _check_open(self) -> None:
        if self.closed:
            raise RequestError(CLOSED)

    def stream(self, prompts: list, params: list[SamplingParams]) -> Iterator[RequestOutput]:
        """Add all prompts, then yield their outputs as steps produce them (each carries its
        request_id and its sample's index). Requests still running when the caller stops
        iterating are aborted. A prompt that cannot run is refused here, not at the first
        next() (the requests are added then)."""
        prompt_ids = [self.encode_prompt(prompt) for prompt in prompts]
        for ids in prompt_ids:
            self.scheduler.check_fits(len(ids))
        for p in params:
            self.check_token_ids(p)
        self._compile_all(params)
        return self._run(prompt_ids, params, True, [])

    def _compile_all(self, params: list[SamplingParams]) -> None:
        """Compile every constraint before the first request is added: one that does not
        compile refuses the whole call, with nothing queued."""
        for p in params:
            if p.structured is not None:
                self.compile_structured(p.structured)

    def generate(self, prompts: list, params: list[SamplingParams]) -> list[RequestOutput]:
        """The final outputs, by prompt and then by sample index: n of them for a prompt
        whose params say n."""
        ids: list[str] = []
        for p in params:  # as stream() checks them: before any constraint compiles
            self.check_token_ids(p)
        self._compile_all(params)
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

    def __init__(self, batch, sampled, waiting_for: list, constrained: list | None = None):
        self.batch = batch
        self.sampled = sampled
        self.waiting_for = waiting_for[::-1]  # last first: pop() hands them out in order
        # the entries of constrained sequences, until their masked draw is queued
        self.constrained = constrained
        # a steady step's rows (LLMEngine._launch_steady), which stand for its entries
        # until _finish_step makes entries of those it cannot take the short way
        self.rows: _Rows | None = None


class _Lanes:
    """Where the samples of a steady step's rows keep num_resolved, num_sent_tokens and
    last_token_at (_Sample's properties read them here): one array each, a lane a
    sample, so that _finish_rows writes each for all its rows with one operation; and
    which samples ended (ended, num_ended: their rows' tokens still coming are dropped).
    Made when rows start to be carried, released when they stop."""
    __slots__ = ("samples", "resolved", "sent", "last_token_at", "ended", "num_ended")

    def __init__(self, samples: list):
        """Lanes 0.. for these samples (None: a lane no sample uses), taking their
        values."""
        present = [s for s in samples if s is not None]
        self.samples = samples
        self.resolved = np.zeros(len(samples), np.int64)
        self.sent = np.zeros(len(samples), np.int64)
        self.last_token_at = np.full(len(samples), np.nan)
        self.ended = np.array([s is None or s.finish_reason is not None for s in samples])
        self.num_ended = 0
        values = [(s.num_resolved, s.num_sent_tokens, s.last_token_at) for s in present]
        for lane, sample in enumerate(samples):
            if sample is not None:
                sample._lanes, sample._lane = self, lane
        if present:
            lanes = [lane for lane, s in enumerate(samples) if s is not None]
            resolved, sent, last = zip(*values)
            self.resolved[lanes] = resolved
            self.sent[lanes] = sent
            self.last_token_at[lanes] = [np.nan if t is None else t for t in last]

    def release(self) -> None:
        """Hand each sample still here its values back, to its own attributes (no rows
        use these lanes any more: the long way then reads no arrays)."""
        resolved, sent = self.resolved.tolist(), self.sent.tolist()
        last_token_at = self.last_token_at.tolist()
        for lane, sample in enumerate(self.samples):
            if sample is not None and sample._lanes is self:
                sample._lanes = None
                sample._num_resolved, sample._num_sent_tokens = resolved[lane], sent[lane]
                last = last_token_at[lane]
                sample._last_token_at = None if last != last else last  # NaN: none yet
        self.samples = []


class _Rows:
    """A steady step's rows, carried from step to step while steps stay steady
    (docs/ARCHITECTURE.md, "The steady decode step"): each row's sample, its output
    tokens (the sequence's list), request id and sample index (TokenColumns' entries),
    and, as one int64 array of rows (deleted from and moved on with one operation each),
    the index in its output tokens of the row's token, the output tokens left under its
    limit after that one (the limit is reached where this is 0 or less), 1 where its
    sample never takes _finish_step's short way (a grammar, text made token by token,
    log-probabilities or stop tokens), how its sample streams (KIND), and its lane in
    `lanes`."""
    __slots__ = ("samples", "state", "constrained", "incomplete", "long", "lanes",
                 "outputs", "request_ids", "sample_indexes", "kinds", "never_short",
                 "any_never_short", "num_ended", "started")
    INDEX, LEFT, NEVER_SHORT, KIND, LANE = range(5)
    STEP = np.array([[1], [-1], [0], [0], [0]], np.int64)  # one token further on
    # KIND: not streamed, streamed as TokenColumns entries (where step_deltas has them),
    # streamed as deltas
    QUIET, COLUMN, DELTA = range(3)

    def __init__(self, samples: list, state, constrained: bool, incomplete: bool,
                 lanes: _Lanes, outputs: list, request_ids: list, sample_indexes: list,
                 kinds: int | None, never_short=None, any_never_short: bool = False):
        self.samples = samples
        self.state = state
        self.constrained = constrained  # a sample of some row is constrained
        self.incomplete = incomplete  # a row's sample is gone (None)
        self.lanes = lanes
        self.outputs = outputs
        self.request_ids = request_ids
        self.sample_indexes = sample_indexes
        self.kinds = kinds  # the KIND of every row where they are all the same, else None
        if never_short is None:
            never_short = state[_Rows.NEVER_SHORT].astype(bool)
            any_never_short = bool(never_short.any())
        self.never_short = never_short
        self.any_never_short = any_never_short
        self.long = None  # set at launch: the rows _finish_step takes the long way (None: none)
        self.num_ended = 0  # lanes.num_ended at the launch
        self.started = False  # _finish_rows has begun (an interrupted call)

    @classmethod
    def of(cls, samples: list, indexes: list[int]) -> "_Rows":
        kinds = [cls.QUIET if s is None or not s.stream
                 else cls.COLUMN if s.columnar else cls.DELTA for s in samples]
        lanes = _Lanes(samples)
        state = np.array([
            indexes,
            [0 if s is None else s.seq.output_limit - index - 1
             for s, index in zip(samples, indexes)],
            [s is None or not s.plain or s.logprobs is not None or bool(s.stop_token_ids)
             for s in samples],
            kinds, range(len(samples))], np.int64).reshape(5, len(samples))
        constrained = any(s is not None and s.seq.is_constrained for s in samples)
        return cls(samples, state, constrained, None in samples, lanes,
                   [None if s is None else s.seq.output_token_ids for s in samples],
                   [None if s is None else s.seq.request_id for s in samples],
                   [None if s is None else s.seq.index for s in samples],
                   kinds[0] if kinds and kinds.count(kinds[0]) == len(kinds) else None)

    def without(self, dropped: list[int]) -> "_Rows":
        """These rows less the dropped ones (ascending)."""
        lists = [list(self.samples), list(self.outputs), list(self.request_ids),
                 list(self.sample_indexes)]
        for row in reversed(dropped):
            for values in lists:
                del values[row]
        state = np.delete(self.state, dropped, axis=1)
        kinds = self.kinds
        if kinds is None and state.shape[1]:
            kind = state[_Rows.KIND]
            kinds = int(kind[0]) if (kind == kind[0]).all() else None
        return _Rows(lists[0], state, self.constrained, None in lists[0], self.lanes,
                     *lists[1:], kinds)

    def moved_on(self) -> "_Rows":
        """The same rows one token further on."""
        return _Rows(self.samples, self.state + _Rows.STEP, self.constrained, self.incomplete,
                     self.lanes, self.outputs, self.request_ids, self.sample_indexes,
                     self.kinds, self.never_short, self.any_never_short)


_new_tuple = tuple.__new__  # EngineDelta's fields without a Python-level __new__
