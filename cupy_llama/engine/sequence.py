"""A request's state as the scheduler and engine see it (plain Python, no device code)."""
from __future__ import annotations

import enum

from ..sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"      # EOS token or stop string
    FINISHED_LENGTH = "length"     # max_tokens or the context limit
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


class Sequence:
    """One sequence of tokens. A request with n > 1 samples is n sequences with the same
    request_id: sample 0 computes the prompt, samples 1..n-1 fork from it (`parent`) once
    it has, sharing its full prompt blocks (engine/scheduler.py)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 seed: int, arrival: int, index: int = 0, parent: "Sequence | None" = None):
        self.request_id = request_id
        self.index = index          # which of the request's n samples this is
        self.parent = parent        # sample 0 of the request, for samples 1..n-1
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)  # read every step: no len() call
        self.output_token_ids: list[int] = []
        self.params = params
        self.seed = seed            # this sample's seed, drawn at random when none was given
        # drawn under a per-sequence mask (the engine defers its draw): params.is_constrained,
        # or set by the engine for bad words of more than one token
        self.is_constrained = params.is_constrained
        self.arrival = arrival      # admission order: later arrivals are preempted first
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.slot: int | None = None  # while running: a row of its own in the model runner's tables
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_preemptions = 0
        # the block manager's own record of this sequence's block digests (prefix caching,
        # engine/block_manager.py); nothing else reads it
        self.kv_hashes = None
        # tokens at the head of block_table whose K/V this sequence took from the prefix
        # cache or from its parent: full, shared blocks that it never writes
        self.num_reused_tokens = 0
        # prompt tokens whose K/V came from the prefix cache at the first admission (-1
        # before it); what RequestOutput.num_cached_tokens reports
        self.num_cached_tokens = -1
        # output tokens at which its lengths end it (output_processor.output_limit: the
        # engine lowers it to what the context limit leaves)
        self.output_limit = params.max_tokens

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list (one token per decode step)."""
        num_prompt = self.num_prompt_tokens
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

    def token_id(self, position: int) -> int:
        num_prompt = self.num_prompt_tokens
        if position < num_prompt:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - num_prompt]

    @property
    def can_start(self) -> bool:
        """False only for a sample 1..n-1 whose parent has not computed the prompt yet: it
        may start once the parent has an output token (known or coming) or has ended."""
        parent = self.parent
        return parent is None or bool(parent.output_token_ids) or parent.is_finished

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self):
        return (f"Sequence({self.request_id!r}/{self.index}, {self.status.value}, "
                f"tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
