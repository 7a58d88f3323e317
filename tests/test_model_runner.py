"""The model runner's step inputs against a plain rebuild from the sequences.

The runner keeps block tables and sampling settings in per-slot rows across steps and
copies only what changed; these tests drive a scheduler through admissions, preemptions,
finishes and aborts (so slots and blocks are reused), prefix-cache hits and forked samples
(so blocks are shared), and compare every step's ForwardBatch and SamplingTensors with what
a from-scratch rebuild gives."""
import random
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from cupy_llama.interface import ForwardBatch, SamplingTensors
from cupy_llama.engine.block_manager import BlockManager
from cupy_llama.engine.model_runner import ModelRunner
from cupy_llama.engine.scheduler import Scheduler
from cupy_llama.engine.sequence import Sequence, SequenceStatus
from cupy_llama.sampling import SamplingParams


def reference_batch(batch, block_size: int) -> ForwardBatch:
    """Every field rebuilt from the sequences, token by token."""
    token_ids, positions, slots, seq_lens, query_start_loc = [], [], [], [], [0]
    max_blocks = max(len(seq.block_table) for seq in batch.seqs)
    block_tables = np.full((len(batch.seqs), max_blocks), -1, dtype=np.int32)
    for b, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        start, table = seq.num_computed_tokens, seq.block_table
        token_ids += seq.token_ids[start:start + n]
        positions += range(start, start + n)
        # a position in the shared blocks the sequence reused is never written (slot -1)
        slots += [-1 if p < seq.num_reused_tokens else
                  table[p // block_size] * block_size + p % block_size
                  for p in range(start, start + n)]
        seq_lens.append(start + n)
        query_start_loc.append(query_start_loc[-1] + n)
        block_tables[b, :len(table)] = table
    return ForwardBatch(
        token_ids=np.array(token_ids, np.int32), positions=np.array(positions, np.int32),
        slot_mapping=np.array(slots, np.int32), query_start_loc=np.array(query_start_loc, np.int32),
        seq_lens=np.array(seq_lens, np.int32), block_tables=block_tables,
        max_query_len=max(batch.num_new_tokens), max_seq_len=max(seq_lens))


def reference_sampling(batch) -> SamplingTensors:
    params = [seq.params for seq in batch.seqs]
    return SamplingTensors(
        temperature=np.array([p.temperature for p in params], np.float32),
        top_k=np.array([p.top_k for p in params], np.int32),
        top_p=np.array([p.top_p for p in params], np.float32),
        min_p=np.array([p.min_p for p in params], np.float32),
        seeds=np.array([seq.seed for seq in batch.seqs], np.uint64),
        steps=np.array([len(seq.output_token_ids) for seq in batch.seqs], np.int32))


def assert_same_fields(got, expected, names):
    for name in names:
        a, b = getattr(got, name), getattr(expected, name)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype, f"{name}: dtype {a.dtype}, expected {b.dtype}"
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:
            assert a == b, f"{name}: {a} != {b}"


FORWARD_FIELDS = ("token_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
                  "block_tables", "max_query_len", "max_seq_len")
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seeds", "steps")


def random_params(rng: random.Random) -> tuple[SamplingParams, int]:
    params = SamplingParams(temperature=rng.choice([0.0, 0.6, 1.3]), top_k=rng.choice([0, 5, 50]),
                            top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.05]),
                            max_tokens=rng.randint(1, 30),
                            frequency_penalty=rng.choice([0.0, 0.0, 0.5]),
                            logit_bias=rng.choice([{}, {}, {3: 1.0}]))
    return params, rng.choice([0, 7, 2**63 + rng.randrange(2**62), 2**64 - 1])


def check_slot_state(device_state, batch, tensors):
    """Apply the step's resets to a model of the device state, then check that every row
    with state reads its own output's counts, and that only rows that use a control have
    state."""
    for reset in tensors.resets or ():
        assert all(t >= 0 for t in reset.output_token_ids)
        device_state[reset.slot] = Counter(reset.output_token_ids)
    for b, seq in enumerate(batch.seqs):
        uses = seq.params.has_penalties or bool(seq.params.logit_bias)
        slot = -1 if tensors.state_slot is None else int(tensors.state_slot[b])
        assert slot == (seq.slot if uses else -1)
        if uses and seq.params.has_penalties:
            assert device_state[slot] == Counter(seq.output_token_ids), seq
        if uses and tensors.count_token[b] == 0:
            assert seq.num_computed_tokens + batch.num_new_tokens[b] < seq.num_tokens


@pytest.mark.parametrize("seed", range(12))
def test_step_inputs_equal_a_rebuild_through_preemption_and_slot_reuse(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    max_num_seqs = rng.randint(1, 6)
    blocks = BlockManager(rng.randint(8, 40), block_size)
    scheduler = Scheduler(blocks, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=rng.randint(max_num_seqs, 64), max_model_len=200)
    runner = ModelRunner(config=None, backend=SimpleNamespace(block_size=block_size))
    live, next_id, steps, reused, decode_steps = {}, 0, 0, 0, 0
    device_state = {}  # slot -> Counter: what a backend keeps, from resets and kept tokens
    shared_prefix = [rng.randrange(1000) for _ in range(40)]
    for _ in range(300):
        if rng.random() < 0.3:
            prompt = shared_prefix[:rng.randint(0, 40)] + [rng.randrange(1000) for _ in
                                                          range(rng.randint(0, 12))] or [1]
            if blocks.blocks_needed(len(prompt) + 1) <= blocks.num_blocks:
                params, request_seed = random_params(rng)
                parent = None
                for index in range(rng.choice([1, 1, 2, 3])):  # samples fork from sample 0
                    seq = Sequence(str(next_id), prompt, params, (request_seed + index) % 2**64,
                                   next_id, index=index, parent=parent)
                    parent = parent or seq
                    scheduler.add(seq)
                    live[seq.request_id, index] = seq
                next_id += 1
        if live and rng.random() < 0.05:  # an abort from outside, or a stop string
            key = rng.choice(sorted(live))
            if rng.random() < 0.5:
                for seq in scheduler.abort(key[0]):
                    del live[seq.request_id, seq.index]
            elif live[key].status is SequenceStatus.RUNNING:
                scheduler.finish(live.pop(key), SequenceStatus.FINISHED_STOPPED)
        batch = scheduler.schedule()
        if not batch:
            continue
        steps += 1
        reused += sum(1 for seq in batch.seqs if seq.num_reused_tokens)
        decode_steps += batch.num_tokens == len(batch.seqs)  # the one-token-each batch
        assert_same_fields(runner.build_batch(batch), reference_batch(batch, block_size),
                           FORWARD_FIELDS)
        tensors = runner.sampling_tensors(batch)
        assert_same_fields(tensors, reference_sampling(batch), SAMPLING_FIELDS)
        check_slot_state(device_state, batch, tensors)
        for row, seq in scheduler.update_after_step(batch):
            seq.output_token_ids.append(rng.randrange(1000))
            if tensors.state_slot is not None and tensors.state_slot[row] >= 0:
                assert tensors.count_token[row] == 1
                device_state[seq.slot][seq.output_token_ids[-1]] += 1  # the kernel's count
            if len(seq.output_token_ids) >= seq.params.max_tokens or \
                    seq.num_tokens >= blocks.num_blocks * block_size:
                scheduler.finish(live.pop((seq.request_id, seq.index)),
                                 SequenceStatus.FINISHED_LENGTH)
    assert steps > 50 and reused > 0 and decode_steps > 10


def test_a_preempted_sequence_gets_its_new_blocks():
    """Preempted, then readmitted into the same slot with a table of the same length but
    other blocks: its row must be rewritten."""
    blocks = BlockManager(4, 4)
    scheduler = Scheduler(blocks, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    runner = ModelRunner(config=None, backend=SimpleNamespace(block_size=4))
    params = SamplingParams(temperature=0, max_tokens=10)
    first, second = (Sequence(name, [1] * 6, params, 0, i) for i, name in enumerate("ab"))
    for seq in (first, second):
        scheduler.add(seq)
    seen = []
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        built = runner.build_batch(batch)
        assert_same_fields(built, reference_batch(batch, 4), FORWARD_FIELDS)
        seen.append([(seq.request_id, seq.slot, tuple(seq.block_table)) for seq in batch.seqs])
        for _, seq in scheduler.update_after_step(batch):
            seq.output_token_ids.append(2)
            if len(seq.output_token_ids) >= params.max_tokens:
                scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)
    assert second.num_preemptions >= 1
    tables_of_b = {table for step in seen for name, _, table in step if name == "b"}
    assert len(tables_of_b) > 1, "b never ran on other blocks after its preemption"


def reference_prompt_positions(batch) -> tuple[list[int], list[int]]:
    """The step's rows that score a prompt token and the tokens they score, position by
    position: sample 0 of a request with prompt_logprobs, the position p scoring p + 1."""
    rows, targets, first_row = [], [], 0
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            if seq.params.prompt_logprobs is not None and seq.index == 0 \
                    and p + 1 < seq.num_prompt_tokens:
                rows.append(first_row + p - seq.num_computed_tokens)
                targets.append(seq.prompt_token_ids[p + 1])
        first_row += n
    return rows, targets


@pytest.mark.parametrize("seed", range(6))
def test_prompt_positions_equal_a_rebuild_as_scoring_sequences_come_and_go(seed):
    """The runner skips the search for prompt positions while no slot's sequence scores its
    prompt; sequences that do arrive, are preempted, finish and give their slots to others."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    blocks = BlockManager(rng.randint(8, 30), block_size)
    scheduler = Scheduler(blocks, max_num_seqs=rng.randint(1, 5),
                          max_num_batched_tokens=rng.randint(5, 40), max_model_len=200)
    runner = ModelRunner(config=None, backend=SimpleNamespace(block_size=block_size))
    live, scored_steps, plain_steps = {}, 0, 0
    for next_id in range(400):
        if rng.random() < 0.25:
            prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 30))]
            if blocks.blocks_needed(len(prompt) + 1) <= blocks.num_blocks:
                params = SamplingParams(max_tokens=rng.randint(1, 12),
                                        prompt_logprobs=rng.choice([None, None, None, 0, 2]))
                parent = None
                for index in range(rng.choice([1, 1, 2])):
                    seq = Sequence(str(next_id), prompt, params, 0, next_id, index=index,
                                   parent=parent)
                    parent = parent or seq
                    scheduler.add(seq)
                    live[seq.request_id, index] = seq
        batch = scheduler.schedule()
        if not batch:
            continue
        runner.sampling_tensors(batch)  # makes every row's slot current, as run() does
        request = runner.prompt_logprob_request(batch)
        rows, targets = reference_prompt_positions(batch)
        if not rows:
            assert request is None
            plain_steps += 1
        else:
            scored_steps += 1
            np.testing.assert_array_equal(request.rows, np.array(rows, np.int32))
            np.testing.assert_array_equal(request.targets, np.array(targets, np.int32))
        for _, seq in scheduler.update_after_step(batch):
            seq.output_token_ids.append(rng.randrange(1000))
            if len(seq.output_token_ids) >= seq.params.max_tokens or \
                    seq.num_tokens >= blocks.num_blocks * block_size:
                scheduler.finish(live.pop((seq.request_id, seq.index)),
                                 SequenceStatus.FINISHED_LENGTH)
    assert scored_steps > 5 and plain_steps > 5


OPTIONAL_CONTROLS = {  # SamplingTensors' optional rows: a params field each, and its neutral
    "repetition_penalty": ("repetition_penalty", 1.0),
    "frequency_penalty": ("frequency_penalty", 0.0),
    "presence_penalty": ("presence_penalty", 0.0),
    "min_tokens": ("min_tokens", 0),
    "num_logprobs": ("logprobs", None),
}


@pytest.mark.parametrize("seed", range(6))
def test_optional_controls_are_none_exactly_where_no_row_uses_them(seed):
    """A control is given where some row of the step uses it, and then equals each row's
    value; else it is None. Sequences with and without controls share slots in turn."""
    rng = random.Random(seed)
    blocks = BlockManager(rng.randint(10, 30), 4)
    scheduler = Scheduler(blocks, max_num_seqs=rng.randint(1, 4),
                          max_num_batched_tokens=rng.randint(4, 32), max_model_len=200)
    runner = ModelRunner(config=None, backend=SimpleNamespace(block_size=4))
    live, given, left_out = {}, 0, 0
    for next_id in range(400):
        if rng.random() < 0.3:
            prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 20))]
            if blocks.blocks_needed(len(prompt) + 1) <= blocks.num_blocks:
                params = SamplingParams(
                    max_tokens=rng.randint(2, 10),
                    repetition_penalty=rng.choice([1.0, 1.0, 1.0, 1.2]),
                    frequency_penalty=rng.choice([0.0, 0.0, 0.0, 0.5]),
                    presence_penalty=rng.choice([0.0, 0.0, 0.0, -0.3]),
                    min_tokens=rng.choice([0, 0, 0, 2]), logprobs=rng.choice([None] * 3 + [3]))
                seq = Sequence(str(next_id), prompt, params, 0, next_id)
                scheduler.add(seq)
                live[seq.request_id] = seq
        batch = scheduler.schedule()
        if not batch:
            continue
        tensors = runner.sampling_tensors(batch)
        for name, (field, neutral) in OPTIONAL_CONTROLS.items():
            values = [getattr(seq.params, field) for seq in batch.seqs]
            if name == "num_logprobs":
                values = [-1 if v is None else v for v in values]
                neutral = -1
            column = getattr(tensors, name)
            if all(v == neutral for v in values):
                assert column is None, name
                left_out += 1
            else:
                np.testing.assert_allclose(column, np.array(values, np.float64), err_msg=name)
                given += 1
        for _, seq in scheduler.update_after_step(batch):
            seq.output_token_ids.append(rng.randrange(1000))
            if len(seq.output_token_ids) >= seq.params.max_tokens or \
                    seq.num_tokens >= blocks.num_blocks * 4:
                scheduler.finish(live.pop(seq.request_id), SequenceStatus.FINISHED_LENGTH)
    assert given > 20 and left_out > 20


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("pipelined", [False, True])
def test_steady_steps_equal_a_rebuild_from_scratch(seed, pipelined):
    """The steady decode step (ScheduledBatch.follows) updates the last step's arrays by
    the diff: sequences that ended since are dropped, blocks added since are copied,
    positions and sampling steps move on by one. Every step's ForwardBatch and
    SamplingTensors equal those of a runner that has never seen a step before (it
    gathers everything from the sequences). `pipelined` runs as the engine does: a step
    is launched while the last one's tokens are placeholders -(row + 1), which the rebuild
    reads from the sequences and the steady step writes without reading them."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    blocks = BlockManager(rng.randint(20, 60), block_size)
    max_num_seqs = rng.randint(2, 8)
    scheduler = Scheduler(blocks, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=rng.randint(max_num_seqs, 48),
                          max_model_len=300)
    runner = ModelRunner(config=None, backend=SimpleNamespace(block_size=block_size))
    live, in_flight, next_id = {}, None, 0
    followed = dropped = grown = 0
    for _ in range(600):
        # requests come in bursts, once none waits, so that sequences also end with none
        # to take their place
        burst = not scheduler.waiting and rng.random() < 0.05
        for _ in range(rng.randint(1, 6) if burst else 0):
            prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 20))]
            params, request_seed = random_params(rng)
            parent = None
            for index in range(rng.choice([1, 1, 2])):
                seq = Sequence(str(next_id), prompt, params, (request_seed + index) % 2**64,
                               next_id, index=index, parent=parent)
                parent = parent or seq
                scheduler.add(seq)
                live[seq.request_id, index] = seq
            next_id += 1
        if live and rng.random() < 0.05:  # an abort between steps
            for seq in scheduler.abort(rng.choice(sorted(live))[0]):
                del live[seq.request_id, seq.index]
        batch = scheduler.schedule()
        if batch.follows is not None:
            followed += 1
            dropped += bool(batch.dropped)
            kept = [seq for row, seq in enumerate(batch.follows.seqs)
                    if row not in (batch.dropped or ())]
            assert kept == batch.seqs and batch.num_new_tokens == [1] * len(batch.seqs)
            grown += any(seq.num_computed_tokens % block_size == 0 for seq in batch.seqs)
        batch.inputs_in_flight = (batch.follows is not None and in_flight is not None
                                  and in_flight[0] is batch.follows)
        fresh = ModelRunner(config=None, backend=SimpleNamespace(block_size=block_size))
        if batch:
            tensors = runner.sampling_tensors(batch)
            expected = fresh.sampling_tensors(batch)
            assert_same_fields(tensors, expected, [name for name in vars(expected)
                                                   if name != "resets"])
            assert_same_fields(runner.build_batch(batch), fresh.build_batch(batch),
                               FORWARD_FIELDS)
        if in_flight is not None:  # the last step's tokens arrive
            for seq, index in in_flight[1]:
                if index < len(seq.output_token_ids):
                    seq.output_token_ids[index] = rng.randrange(1000)
            in_flight = None
        if not batch:
            continue
        launched = []
        for row, seq in scheduler.update_after_step(batch):
            seq.output_token_ids.append(-(row + 1) if pipelined else rng.randrange(1000))
            launched.append((seq, len(seq.output_token_ids) - 1))
            if len(seq.output_token_ids) >= seq.params.max_tokens or \
                    seq.num_tokens >= min(blocks.num_blocks * block_size, 300) - 1:
                scheduler.finish(live.pop((seq.request_id, seq.index)),
                                 SequenceStatus.FINISHED_LENGTH)
        if pipelined:
            in_flight = (batch, launched)
    assert followed > 50 and dropped > 1 and grown > 5, (followed, dropped, grown)
