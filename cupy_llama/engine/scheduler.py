"""Continuous batching (docs/ARCHITECTURE.md, Decisions 9), plain Python.

Each step: every running sequence gets its next tokens (one decode token, or the next
chunk of an unfinished prefill) within the token budget; then free slots are refilled
from the waiting queue with prefill chunks. When KV blocks run out, the most recently
admitted running sequence is preempted: its blocks are freed and it waits at the head of
the queue to be recomputed from its tokens so far.

A running sequence holds one of max_num_seqs slots (`Sequence.slot`) from admission until
it finishes or is preempted: the model runner keeps its per-sequence rows there.

Admission takes the sequence's reusable full blocks first (block_manager.py: its longest
cached run, with prefix caching on), so its prefill starts at its first uncached token;
the last token is always computed, so there are logits to sample from. A request with
n > 1 samples queues n sequences; samples 1..n-1 start only once sample 0 has computed the
prompt, and share its full prompt blocks, with or without the cache: each computes only
its own tail (its partly filled last block, or its last token).

A step after a steady one (every row of the last step ended in a sampled token, the same
sequences run less those that ended, none preempted or admitted) is scheduled without a
pass over the sequences: each has one token to compute, and only those whose last block is
full, found by the step at which each runs out, get a block (`_steady`). The batch says so
(`ScheduledBatch.follows`), so the model runner and update_after_step need no pass either.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..errors import RequestError
from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]   # tokens of each sequence computed this step
    # the steady decode step: the batch scheduled just before this one, when this one is
    # one token each of that one's sequences in the same order less those that ended
    # since (rows `dropped` of it), that one was computed (update_after_step) with a token
    # sampled for every row, and nothing was preempted since. Each sequence is then at
    # the position after that step's last, its input that step's token, in the same slot
    # (the model runner updates its per-slot arrays by this diff instead of gathering
    # them, docs/ARCHITECTURE.md)
    follows: "ScheduledBatch | None" = None
    dropped: list[int] | None = None  # with follows: rows of it not here, ascending
    # set by the engine where `follows` is the step still running: this step's input
    # tokens are the placeholders of its rows (nothing on the host to read)
    inputs_in_flight: bool = False
    # a steady step scheduled without the pass (Scheduler._steady): the sequences whose
    # last block the step before filled, which got a block for this one. Only their
    # blocks can have become cacheable since (the filled block's last token is known by
    # this step's update_after_step), so on_computed looks at them alone
    grown: list[Sequence] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self):
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 model_limit: int | None = None):
        """model_limit: the model's own longest context (ModelConfig.context_limit), which
        max_model_len may be raised to; None: unknown."""
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.model_limit = model_limit
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # in admission order, oldest first
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))  # pop() takes the lowest
        self.num_preemptions = 0
        # the last batch that update_after_step marked computed if each of its rows ended
        # in a sampled token, num_preemptions then, and the running sequences that ended
        # since (ScheduledBatch.follows)
        self._last_sampled: ScheduledBatch | None = None
        self._sampled_preemptions = 0
        self._ended: list[Sequence] = []
        # schedule() calls so far, and while steady steps follow one another, the running
        # sequences by the call at which their next token needs a new block (_steady)
        self._num_schedules = 0
        self._block_due: dict[int, list[Sequence]] | None = None

    def check_fits(self, num_prompt_tokens: int) -> None:
        """Reject a prompt that could never run, with the numbers that say why."""
        if num_prompt_tokens < 1:
            raise RequestError("the prompt is empty; give at least one token")
        needed = self.blocks.blocks_needed(num_prompt_tokens + 1)
        blocks, block_size = self.blocks.num_blocks, self.blocks.block_size
        # where the KV cache holds fewer tokens than max_model_len, the cache is the limit
        # to name: raising max_model_len would not help
        cache_binds = needed > blocks and blocks * block_size < self.max_model_len
        if num_prompt_tokens >= self.max_model_len and not cache_binds:
            limit = self.model_limit
            fix = ("raise max_model_len" if limit is None else
                   f"raise max_model_len (the model takes up to {limit})"
                   if self.max_model_len < limit else
                   f"use a model with a longer context (this one takes up to {limit})")
            raise RequestError(
                f"the prompt has {num_prompt_tokens} tokens but the context limit is "
                f"{self.max_model_len} (prompt plus at least one new token); shorten the "
                f"prompt or {fix}")
        if needed > self.blocks.num_blocks:
            raise RequestError(
                f"the prompt has {num_prompt_tokens} tokens and needs {needed} KV blocks of "
                f"{self.blocks.block_size} tokens (with one new token) but the cache has only "
                f"{self.blocks.num_blocks}; shorten the prompt or give the KV "
                f"cache more memory (num_kv_blocks / gpu_memory_utilization)")

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq.num_tokens)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> list[Sequence]:
        """Abort every sequence of the request (its n samples); returns them."""
        seqs = [seq for queue in (self.running, self.waiting) for seq in queue
                if seq.request_id == request_id]
        for seq in seqs:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seqs

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Release a finished sequence's blocks at once. A sequence may finish while it
        waits (preempted, its last token still coming), and again once it has finished
        (for its length at the launch of its last token, then for what that token says):
        then only its status changes, its blocks are long released."""
        if seq.is_finished:
            seq.status = status
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            if self._last_sampled is not None:
                self._ended.append(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = status
        self._free_slot(seq)
        self.blocks.free(seq)

    def _free_slot(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None

    def schedule(self) -> ScheduledBatch:
        self._num_schedules += 1
        batch = self._steady()
        if batch is not None:
            return batch
        self._block_due = None
        batch = ScheduledBatch([], [])
        budget = self.max_num_batched_tokens
        block_size = self.blocks.block_size
        cut = False  # a sequence gets fewer tokens than it has uncomputed
        # 1. running sequences, oldest first: decode tokens and continuing prefill chunks
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted making room for an older one
                continue
            computed = seq.num_computed_tokens  # (num_uncomputed_tokens, without the call)
            take = seq.num_prompt_tokens + len(seq.output_token_ids) - computed
            if take > budget:
                take, cut = budget, True
            # most decode steps: the last block has room, and nothing else is asked
            if computed + take > len(seq.block_table) * block_size \
                    and not self._make_room(seq, computed + take):
                continue  # seq itself was preempted
            batch.seqs.append(seq)
            batch.num_new_tokens.append(take)
            budget -= take
        # 2. refill free slots from the waiting queue
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.can_start:
                break  # a sample waits for its parent's prompt; the queue behind it too
            reused = self.blocks.reusable_blocks(seq)
            # the last token is always computed: a prompt whose every block is reused
            # computes it again for its logits, without writing the shared block
            # (model_runner.py)
            start = min(reused.num_tokens, seq.num_tokens - 1)
            take = min(seq.num_tokens - start, budget)
            if not self.blocks.can_allocate(reused, start + take):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, reused, start + take)
            seq.num_computed_tokens = start
            seq.status = SequenceStatus.RUNNING
            seq.slot = self.free_slots.pop()
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(take)
            budget -= take
        last, self._last_sampled = self._last_sampled, None
        if last is not None and not cut and self.num_preemptions == self._sampled_preemptions \
                and batch.num_new_tokens.count(1) == len(batch.seqs):
            self._follow(batch, last)
        self._ended = []
        return batch

    def _follow(self, batch: ScheduledBatch, last: ScheduledBatch) -> None:
        """Set batch.follows (and dropped) where batch is last less the sequences that
        ended since (the comparisons run at C speed: no pass over the sequences here)."""
        dropped = self._dropped(batch.seqs, last)
        if dropped is not False:
            last.follows = last.dropped = None  # one step back is all a batch keeps
            batch.follows, batch.dropped = last, dropped

    def _dropped(self, seqs: list[Sequence], last: ScheduledBatch) -> list[int] | None | bool:
        """The rows of last whose sequences ended since, where seqs is last less those
        (None: none ended); False where seqs is not."""
        if seqs == last.seqs:
            return None
        if not self._ended:
            return False
        try:
            dropped = sorted(last.seqs.index(seq) for seq in self._ended)
        except ValueError:  # one ran without being in the last step
            return False
        kept = list(last.seqs)
        for row in reversed(dropped):
            del kept[row]
        return dropped if kept == seqs else False

    def _steady(self) -> ScheduledBatch | None:
        """The step after a steady one without a pass over the sequences, or None where
        schedule's full pass is needed. It applies where the last step sampled a token
        for each of its rows, the running sequences are those rows less the ones that
        ended since, nothing was preempted and none can be admitted: each running
        sequence then has one token to compute (LLMEngine appends one to each row that
        ends in a sampled token, or ends it), and only those whose last block is full
        need anything, a block, found by the call at which each runs out (_block_due)."""
        last, running = self._last_sampled, self.running
        if last is None or self.num_preemptions != self._sampled_preemptions or not running \
                or len(running) > self.max_num_batched_tokens \
                or (self.waiting and len(running) < self.max_num_seqs):
            return None
        dropped = self._dropped(running, last)
        if dropped is False:
            return None
        now, block_size = self._num_schedules, self.blocks.block_size
        due = self._block_due
        if due is None:  # the first steady step since a full one: one pass
            due = {}
            for seq in running:
                computed = seq.num_computed_tokens
                if seq.num_prompt_tokens + len(seq.output_token_ids) - computed != 1:
                    return None
                due.setdefault(now + len(seq.block_table) * block_size - computed,
                               []).append(seq)
            self._block_due = due
        # (those that ended since are left out; each of the others needs one block)
        grow = [seq for seq in due.pop(now, ()) if seq.status is SequenceStatus.RUNNING]
        if len(grow) > self.blocks.num_free_blocks:
            self._block_due = None
            return None  # the full pass preempts to make room
        for seq in grow:
            computed = seq.num_computed_tokens
            self.blocks.grow(seq, computed + 1)
            due.setdefault(now + len(seq.block_table) * block_size - computed, []).append(seq)
        self._last_sampled, self._ended = None, []
        last.follows = last.dropped = None
        return ScheduledBatch(list(running), [1] * len(running), follows=last, dropped=dropped,
                              grown=grow)

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's blocks to num_tokens, preempting newer sequences as needed. False if
        seq had to be preempted itself."""
        if not self.blocks.num_new_blocks(seq, num_tokens):
            return True  # most decode steps: the last block has room
        while not self.blocks.can_grow(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self.blocks.grow(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free_slot(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update_after_step(self, batch: ScheduledBatch,
                          placeholders: bool = False) -> list[tuple[int, Sequence]]:
        """Mark this step's tokens computed; returns (row, sequence) of the sequences whose
        step ends in a sampled token, those with every known token in the cache now (a
        prompt chunk that is not the last wants none). placeholders (a steady step only):
        each row's output tokens also get the row's placeholder -(row + 1) in the same pass
        (the engine's token still coming), and nothing is returned."""
        if placeholders:
            assert batch.follows is not None, "placeholders are for a steady step"
            for seq, placeholder in zip(batch.seqs, range(-1, -len(batch.seqs) - 1, -1)):
                seq.num_computed_tokens += 1
                seq.output_token_ids.append(placeholder)
            self.blocks.on_computed(batch.seqs if batch.grown is None else batch.grown)
            self._last_sampled = batch
            self._sampled_preemptions = self.num_preemptions
            self._ended = []
            return []
        if batch.follows is not None:
            # the steady step: one token each, every known token but that one computed
            # before (ScheduledBatch.follows), so each row ends in a sampled token
            for seq in batch.seqs:
                seq.num_computed_tokens += 1
            sampled = list(enumerate(batch.seqs))
        else:
            sampled = []
            for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
                seq.num_computed_tokens += n
                if seq.num_computed_tokens == seq.num_prompt_tokens + len(seq.output_token_ids):
                    sampled.append((row, seq))  # every known token computed
        self.blocks.on_computed(batch.seqs if batch.grown is None else batch.grown)
        # every row ends in a sampled token (a prompt chunk that is not the last does not)
        self._last_sampled = batch if len(sampled) == len(batch.seqs) else None
        self._sampled_preemptions = self.num_preemptions
        self._ended = []
        return sampled
