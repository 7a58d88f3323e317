"""Turns a scheduled batch into one forward pass and one sampling call on a backend.

What changes slowly per sequence (its block table, its sampling settings) is kept in host
tables with one row per scheduler slot (`Sequence.slot`), written when it changes; a step
gathers the rows of its sequences with one NumPy indexing each. At a few hundred sequences
per decode step, per-sequence NumPy calls or list conversions would cost milliseconds.

The steady decode step (ScheduledBatch.follows: the same sequences as the step before, one
token each) touches no sequence object: its positions are the last step's plus one, its
tokens the last step's rows (placeholders), its sampling rows the last step's with one more
token generated; only the rows whose sequence got a block since are copied again."""
from __future__ import annotations

import numpy as np

from ..interface import (MAX_BIAS_ENTRIES, SAMPLING_ROWS, ForwardBatch, PromptLogprobRequest,
                         SamplingTensors, SlotReset)
from ..config import ModelConfig
from ..util import cdiv
from .scheduler import ScheduledBatch
from .sequence import Sequence


# SAMPLING_ROWS kept per slot, and where a sequence's value of each comes from (where it is
# not the SamplingParams field of the same name)
REQUEST_ROWS = tuple(row for row in SAMPLING_ROWS if row.per == "request")
# the rows a step leaves None where none of its rows uses the control (the backends skip it)
OPTIONAL_ROWS = tuple(row.name for row in REQUEST_ROWS
                      if SamplingTensors.__dataclass_fields__[row.name].default is None)
ROW_SOURCES = {
    "seeds": lambda seq, entries: seq.seed,
    "deferred": lambda seq, entries: seq.is_constrained,
    "num_logprobs": lambda seq, entries: -1 if seq.params.logprobs is None else seq.params.logprobs,
    "num_biases": lambda seq, entries: entries[2],
    "num_min_bans": lambda seq, entries: entries[3],
    # an int32 row: min_tokens past the output's end (max_tokens None leaves it unbounded)
    # bans no more than the output's length does
    "min_tokens": lambda seq, entries: min(seq.params.min_tokens, seq.output_limit),
}


def row_value(name: str, seq: Sequence, entries):
    source = ROW_SOURCES.get(name)
    return source(seq, entries) if source else getattr(seq.params, name)


def bias_entries(seq: Sequence, eos_token_ids) -> tuple[list, list, int, int]:
    """(ids, values, num_biases, num_min_bans): the sequence's logit_bias and bans (its
    banned_token_ids: bad words), one entry per token, a ban over a bias; then the tokens
    banned until min_tokens (EOS and stop_token_ids; EOS under ignore_eos too, as vLLM bans
    it: min_tokens says how many tokens come before any EOS)."""
    params = seq.params
    always = dict(params.logit_bias)
    for token in getattr(seq, "banned_token_ids", ()):
        always[token] = float("-inf")
    until_min = []
    if params.min_tokens:
        stops = list(params.stop_token_ids) + sorted(eos_token_ids)
        until_min = sorted(set(stops))
    ids = list(always) + until_min
    if len(ids) > MAX_BIAS_ENTRIES:  # SamplingParams' limits keep this from happening
        raise ValueError(f"{len(ids)} bias entries, at most {MAX_BIAS_ENTRIES}")
    values = list(always.values()) + [float("-inf")] * len(until_min)
    return ids, values, len(always), len(until_min)


class SlotTables:
    """Per-slot host rows: block tables ([slots, blocks] int32, unused entries -1) and
    sampling settings (one array per "request" row of SAMPLING_ROWS, an attribute of the
    row's name). Grown on demand."""

    def __init__(self, eos_token_ids=()):
        self.eos_token_ids = tuple(eos_token_ids)  # banned until min_tokens
        self.block_tables = np.full((0, 0), -1, np.int32)
        # the block_table list each row copies and how many of its entries it holds (a list
        # only grows until BlockManager.free replaces it, so this says what is new)
        self._table_source: list[list[int] | None] = []
        self._table_length: list[int] = []
        self.table_lengths = np.zeros(0, np.int64)  # _table_length as an array (steady steps)
        self._sampling_owner: list[Sequence | None] = []
        # the device state of each slot (interface.SlotReset): whether its sequence uses it,
        # its bias entries, and the sequence and preemption count it was made for (a
        # sequence readmitted after preemption recounts: a dropped token may be counted)
        self.uses_state = np.zeros(0, bool)
        self._entries: list = []
        self._state_made_for: list = []
        # whether each slot's sequence scores its prompt (prompt_logprobs, sample 0), and
        # how many slots' do: none, and a step looks for no prompt positions to score
        self.scores_prompt = np.zeros(0, bool)
        self.num_scoring = 0
        # [slots, OPTIONAL_ROWS]: whether the slot's value is not the row's neutral one
        self.uses_control = np.zeros((0, len(OPTIONAL_ROWS)), bool)
        for row in REQUEST_ROWS:
            setattr(self, row.name, np.zeros(0, row.dtype))

    def _grow(self, num_slots: int, num_blocks: int) -> None:
        """Room for slots [0, num_slots) and num_blocks blocks per row (at least doubling
        what grows, so growing is rare)."""
        old_slots, old_blocks = self.block_tables.shape
        slots = old_slots if num_slots <= old_slots else max(num_slots, 2 * old_slots)
        blocks = old_blocks if num_blocks <= old_blocks else max(num_blocks, 2 * old_blocks)
        if (slots, blocks) != (old_slots, old_blocks):
            tables = np.full((slots, blocks), -1, np.int32)
            tables[:old_slots, :old_blocks] = self.block_tables
            self.block_tables = tables
        new = self.block_tables.shape[0] - old_slots
        if new:
            self._table_source += [None] * new
            self._table_length += [0] * new
            self.table_lengths = np.concatenate([self.table_lengths, np.zeros(new, np.int64)])
            self._sampling_owner += [None] * new
            self._entries += [None] * new
            self._state_made_for += [None] * new
            self.uses_state = np.concatenate([self.uses_state, np.zeros(new, bool)])
            self.uses_control = np.concatenate(
                [self.uses_control, np.zeros((new, len(OPTIONAL_ROWS)), bool)])
            self.scores_prompt = np.concatenate([self.scores_prompt, np.zeros(new, bool)])
            for row in REQUEST_ROWS:
                old = getattr(self, row.name)
                setattr(self, row.name, np.concatenate([old, np.full(new, row.default, row.dtype)]))

    def update_block_table(self, seq: Sequence) -> None:
        """Make seq's row equal its block table, copying only what changed."""
        slot, table = seq.slot, seq.block_table
        if slot >= len(self._table_source) or len(table) > self.block_tables.shape[1]:
            self._grow(slot + 1, len(table))
        row = self.block_tables[slot]
        if self._table_source[slot] is table:
            row[self._table_length[slot]:len(table)] = table[self._table_length[slot]:]
        else:  # another sequence's row, or this one's before it was preempted
            row[:len(table)] = table
            row[len(table):self._table_length[slot]] = -1
            self._table_source[slot] = table
        self._table_length[slot] = self.table_lengths[slot] = len(table)

    def update_sampling(self, seq: Sequence) -> None:
        slot = seq.slot
        if slot >= len(self._sampling_owner):
            self._grow(slot + 1, 0)
        entries = bias_entries(seq, self.eos_token_ids)
        for row in REQUEST_ROWS:
            getattr(self, row.name)[slot] = row_value(row.name, seq, entries)
        self.uses_control[slot] = [getattr(self, row.name)[slot] != row.neutral
                                   for row in REQUEST_ROWS if row.name in OPTIONAL_ROWS]
        self._entries[slot] = entries
        scores = seq.params.prompt_logprobs is not None and seq.index == 0
        self.num_scoring += scores - int(self.scores_prompt[slot])
        self.scores_prompt[slot] = scores
        self.uses_state[slot] = seq.params.has_penalties or bool(entries[0])
        self._sampling_owner[slot] = seq

    def state_reset(self, seq: Sequence) -> SlotReset | None:
        """The reset seq's slot needs before this step samples (None: its state is current)."""
        slot = seq.slot
        made_for = self._state_made_for[slot]
        if made_for is not None and made_for[0] is seq and made_for[1] == seq.num_preemptions:
            return None
        self._state_made_for[slot] = (seq, seq.num_preemptions)
        counted = seq.params.has_penalties
        ids, values, _, _ = self._entries[slot]
        return SlotReset(slot, seq.prompt_token_ids if counted else [],
                         list(seq.output_token_ids) if counted else [], ids, values)

    def block_table_is_current(self, seq: Sequence) -> bool:
        slot = seq.slot
        return (slot < len(self._table_source) and self._table_source[slot] is seq.block_table
                and self._table_length[slot] == len(seq.block_table))

    def sampling_is_current(self, seq: Sequence) -> bool:
        return seq.slot < len(self._sampling_owner) and self._sampling_owner[seq.slot] is seq


class ModelRunner:
    def __init__(self, config: ModelConfig, backend):
        self.config = config
        self.backend = backend
        self.block_size = backend.block_size
        self.slots = SlotTables(getattr(config, "eos_token_ids", None) or ())
        # the last batch whose host arrays were built: (batch, ForwardBatch, its rows'
        # slots) and (batch, SamplingTensors, its rows' slots), the next step's base when
        # it follows that batch (ScheduledBatch.follows)
        self._last_forward: tuple | None = None
        self._last_sampling: tuple | None = None

    def build_batch(self, batch: ScheduledBatch) -> ForwardBatch:
        forward, self._last_forward = _by_diff_or_whole(
            batch, self._last_forward, self._steady_batch, self._build_batch)
        return forward

    def _build_batch(self, batch: ScheduledBatch) -> tuple[ForwardBatch, np.ndarray]:
        seqs = batch.seqs
        if batch.num_tokens == len(seqs):  # one token each: the usual decode step
            decode = self._decode_batch(seqs)
            if decode is not None:
                return decode
        slots = self.slots
        token_ids, starts, rows, unwritten = [], [], [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if not slots.block_table_is_current(seq):
                slots.update_block_table(seq)
            start = seq.num_computed_tokens
            if start < seq.num_reused_tokens:
                # a prompt whose blocks all came from the prefix cache or from its parent
                # (a sample 1..n-1) computes its last token again for the logits; that
                # token's K/V are in a shared block already, which is never written: its
                # slot is -1 (attention reads the cached K/V at its position)
                unwritten.append((len(token_ids), min(n, seq.num_reused_tokens - start)))
            if n == 1 and start >= seq.num_prompt_tokens:  # a decode step's token
                token_ids.append(seq.output_token_ids[start - seq.num_prompt_tokens])
            else:
                token_ids += seq.token_slice(start, start + n)
            starts.append(start)
            rows.append(seq.slot)
        num_new = np.array(batch.num_new_tokens, dtype=np.int32)
        starts = np.array(starts, dtype=np.int32)
        rows = np.array(rows, dtype=np.intp)
        seq_lens = starts + num_new
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(num_new, out=query_start_loc[1:])
        # token t of sequence b sits at position starts[b] + (t - query_start_loc[b])
        positions = (np.arange(len(token_ids), dtype=np.int32)
                     + np.repeat(starts - query_start_loc[:-1], num_new))
        bs = self.block_size
        max_blocks = cdiv(int(seq_lens.max()), bs)  # the columns any position of the step reads
        blocks = slots.block_tables[np.repeat(rows, num_new), positions // bs]
        slot_mapping = blocks * bs + positions % bs
        for first, count in unwritten:
            slot_mapping[first:first + count] = -1
        return ForwardBatch(
            token_ids=np.array(token_ids, dtype=np.int32), positions=positions,
            slot_mapping=slot_mapping, query_start_loc=query_start_loc,
            seq_lens=seq_lens, block_tables=slots.block_tables[rows, :max_blocks],
            max_query_len=int(num_new.max()), max_seq_len=int(seq_lens.max())), rows

    def _steady_batch(self, batch: ScheduledBatch, last: ForwardBatch,
                      last_rows: np.ndarray) -> tuple[ForwardBatch, np.ndarray]:
        """build_batch for a step that follows `last` (ScheduledBatch.follows): each kept
        row one position after its last, in the same slot, its token the one `last`
        sampled for it. The sequences are read only where their block table grew, and
        for their tokens where those are on the host already (not batch.inputs_in_flight)."""
        seqs, slots, bs = batch.seqs, self.slots, self.block_size
        positions, rows = last.seq_lens, last_rows  # each row's last position + 1
        if batch.dropped:
            kept = np.delete(np.arange(len(rows)), batch.dropped)
            positions, rows = positions[kept], rows[kept]
            placeholders = -1 - kept.astype(np.int32)
            query_start_loc = np.arange(len(seqs) + 1, dtype=np.int32)
        else:
            placeholders = np.arange(-1, -len(seqs) - 1, -1, dtype=np.int32)
            query_start_loc = (last.query_start_loc if last.max_query_len == 1
                               else np.arange(len(seqs) + 1, dtype=np.int32))
        if batch.inputs_in_flight:  # the token of kept row b is the placeholder of its row
            token_ids = placeholders
        else:
            token_ids = np.array([seq.output_token_ids[-1] for seq in seqs], dtype=np.int32)
        columns = positions // bs
        if batch.grown is not None:  # the scheduler added blocks to these sequences only
            for seq in batch.grown:
                slots.update_block_table(seq)
        else:
            for b in np.flatnonzero(columns >= slots.table_lengths[rows]).tolist():
                slots.update_block_table(seqs[b])  # a block added for this position
        seq_lens = positions + 1
        # every row one further on: the longest too, unless it was dropped
        max_seq_len = last.max_seq_len + 1 if not batch.dropped else int(seq_lens.max())
        return ForwardBatch(
            token_ids=token_ids, positions=positions,
            slot_mapping=slots.block_tables[rows, columns] * bs + positions % bs,
            query_start_loc=query_start_loc, seq_lens=seq_lens,
            block_tables=slots.block_tables[rows, :cdiv(max_seq_len, bs)],
            max_query_len=1, max_seq_len=max_seq_len), rows

    def _decode_batch(self, seqs: list[Sequence]) -> tuple[ForwardBatch, np.ndarray] | None:
        """build_batch for a step of one token per sequence, from whole-batch list passes
        and array operations; None when a sequence recomputes a reused token (a prompt
        whose every block came from the cache: build_batch's unwritten slot)."""
        slots = self.slots
        for seq in [seq for seq in seqs if not slots.block_table_is_current(seq)]:
            slots.update_block_table(seq)
        starts_list = [seq.num_computed_tokens for seq in seqs]
        if any(start < seq.num_reused_tokens for start, seq in zip(starts_list, seqs)):
            return None
        starts = np.array(starts_list, dtype=np.int32)  # [B] the one token's position
        rows = np.array([seq.slot for seq in seqs], dtype=np.intp)
        token_ids = np.array([seq.token_id(start) for start, seq in zip(starts_list, seqs)],
                             dtype=np.int32)
        seq_lens = starts + 1
        bs = self.block_size
        max_seq_len = int(seq_lens.max())
        slot_mapping = slots.block_tables[rows, starts // bs] * bs + starts % bs
        return ForwardBatch(
            token_ids=token_ids, positions=starts, slot_mapping=slot_mapping,
            query_start_loc=np.arange(len(seqs) + 1, dtype=np.int32), seq_lens=seq_lens,
            block_tables=slots.block_tables[rows, :cdiv(max_seq_len, bs)],
            max_query_len=1, max_seq_len=max_seq_len), rows

    def sampling_tensors(self, batch: ScheduledBatch) -> SamplingTensors:
        tensors, self._last_sampling = _by_diff_or_whole(
            batch, self._last_sampling, self._steady_sampling, self._gather_sampling)
        return tensors

    def _steady_sampling(self, batch: ScheduledBatch, last: SamplingTensors,
                         rows: np.ndarray) -> tuple[SamplingTensors, np.ndarray]:
        """sampling_tensors for a step that follows `last`: its kept rows, each with one
        more token generated; each slot's state is current (its reset, if any, went with
        an earlier step) and each row's token is counted (`last` sampled every row)."""
        if not batch.dropped:  # (a copy of last's fields: dataclasses.replace costs 5 us)
            tensors = object.__new__(SamplingTensors)
            vars(tensors).update(vars(last), steps=last.steps + 1, resets=None)
            return tensors, rows
        kept = np.delete(np.arange(len(rows)), batch.dropped)
        rows = rows[kept]
        settings = {name: None if value is None else value[kept]
                    for name, value in vars(last).items() if name != "resets"}
        settings["steps"] += 1
        # a control only the dropped rows used is left out again (None)
        for name, used in zip(OPTIONAL_ROWS, self.slots.uses_control[rows].any(axis=0).tolist()):
            if not used:
                settings[name] = None
        if settings["state_slot"] is not None and not self.slots.uses_state[rows].any():
            settings["state_slot"] = settings["count_token"] = None
        return SamplingTensors(**settings), rows

    def _gather_sampling(self, batch: ScheduledBatch) -> tuple[SamplingTensors, np.ndarray]:
        slots = self.slots
        rows, steps = [], []
        for seq in batch.seqs:  # one pass: this runs every step
            if not slots.sampling_is_current(seq):
                slots.update_sampling(seq)
            rows.append(seq.slot)
            # the step index is the number of tokens generated so far, so a recomputed
            # (preempted) sequence draws the same random numbers again
            steps.append(len(seq.output_token_ids))
        rows = np.array(rows, dtype=np.intp)
        settings = {"steps": np.array(steps, dtype=np.int32)}
        uses_state = slots.uses_state[rows]
        if uses_state.any():
            settings["state_slot"] = np.where(uses_state, rows, -1).astype(np.int32)
            count_token = np.zeros(len(rows), np.int32)
            resets = []
            for b in np.flatnonzero(uses_state).tolist():
                seq, n = batch.seqs[b], batch.num_new_tokens[b]
                reset = slots.state_reset(seq)
                if reset is not None:
                    resets.append(reset)
                # the token is kept (and counted) where the step computes every known token
                count_token[b] = seq.num_computed_tokens + n >= seq.num_tokens
            settings["count_token"] = count_token
            settings["resets"] = resets or None
        # a control no row of the step uses stays None (the backends skip it)
        used = dict(zip(OPTIONAL_ROWS, slots.uses_control[rows].any(axis=0).tolist()))
        for row in REQUEST_ROWS:
            settings[row.name] = (getattr(slots, row.name)[rows] if used.get(row.name, True)
                                  else None)
        return SamplingTensors(**settings), rows
    def prompt_logprob_request(self, batch: ScheduledBatch) -> PromptLogprobRequest | None:
        """The prompt positions of this step whose next-token log-probabilities are asked
        (sample 0 of a request with prompt_logprobs computes them; its other samples fork
        from its blocks). None where no sequence asks. `spans` says which rows are whose:
        (seq, first prompt token scored, count). Every sequence's slot must be current
        (sampling_tensors makes it so)."""
        if not self.slots.num_scoring:  # no slot's sequence asks: the usual step
            return None
        rows, targets, spans, k, first_row = [], [], [], 0, 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            wanted = seq.params.prompt_logprobs
            # the token at position p scores prompt token p + 1
            stop = min(start + n, seq.num_prompt_tokens - 1)
            if wanted is not None and seq.index == 0 and start < stop:
                rows += range(first_row, first_row + stop - start)
                targets += seq.prompt_token_ids[start + 1:stop + 1]
                spans.append((seq, start + 1, stop - start))
                k = max(k, wanted)
            first_row += n
        if not rows:
            return None
        return PromptLogprobRequest(np.array(rows, np.int32), np.array(targets, np.int32), k,
                                    spans=spans)

    def run(self, batch: ScheduledBatch):
        """Queue one forward pass and the sampling of a token for every scheduled sequence
        (the caller keeps only those of sequences whose prompt is fully computed). Returns
        at once with a handle whose get() waits for the tokens (interface.py
        SampledTokens), and whose prompt_logprobs holds the step's prompt log-probabilities
        where it has some. Token ids -(r + 1) in the sequences are the previous step's row r.
        Rows of constrained sequences are deferred: the engine draws them with
        Ops.sample_masked once their masks are filled."""
        sampling = self.sampling_tensors(batch)  # first: it makes each row's slot current
        prompt = self.prompt_logprob_request(batch)
        forward_batch = self.build_batch(batch)
        logits = (self.backend.forward(forward_batch) if prompt is None
                  else self.backend.forward(forward_batch, prompt))
        sampled = self.backend.ops.sample_async(logits, sampling)
        sampled.prompt_logprobs = prompt
        return sampled


def _by_diff_or_whole(batch: ScheduledBatch, last: tuple | None, steady, whole):
    """(arrays, the record for the next step) of a batch: by steady(batch, arrays, rows)
    from the last step's where the batch follows the one `last` records (batch, arrays,
    rows), else whole(batch); each returns (arrays, rows)."""
    if last is not None and batch.follows is not None and batch.follows is last[0]:
        arrays, rows = steady(batch, last[1], last[2])
    else:
        arrays, rows = whole(batch)
    return arrays, (batch, arrays, rows)
