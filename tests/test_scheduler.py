"""Block manager and scheduler without a model: steps are simulated by appending fake tokens.

The state machine adds, steps, aborts and finishes requests at random and checks the block
accounting after every step; at the end it drains the queue and checks that every block
came back.
"""
import subprocess
import sys

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cupy_llama.engine.block_manager import BlockManager
from cupy_llama.engine.scheduler import Scheduler
from cupy_llama.engine.sequence import Sequence, SequenceStatus
from cupy_llama.errors import RequestError
from cupy_llama.sampling import SamplingParams

FAKE_TOKEN = 7


def make_seq(request_id, prompt_len, max_tokens, arrival=0):
    return Sequence(str(request_id), [FAKE_TOKEN] * prompt_len,
                    SamplingParams(temperature=0, max_tokens=max_tokens), seed=0, arrival=arrival)


class Simulation:
    """Drives a Scheduler the way LLMEngine does, with fake sampled tokens."""

    def __init__(self, num_blocks, block_size, max_num_seqs, max_num_batched_tokens, max_model_len):
        self.blocks = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   max_model_len=max_model_len)
        # as in LLMEngine: a sequence stops when it would outgrow the whole cache
        self.context_limit = min(max_model_len, num_blocks * block_size)
        self.live: dict[str, Sequence] = {}
        self.finished: list[Sequence] = []

    def add(self, seq):
        self.scheduler.add(seq)
        self.live[seq.request_id] = seq

    def step(self):
        batch = self.scheduler.schedule()
        self.queue_after_schedule = (len(self.scheduler.running), len(self.scheduler.waiting))
        self.check_batch(batch)
        # a row wants a sampled token when this step brings its last known token in
        wanted = [(row, id(seq)) for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
                  if seq.num_computed_tokens + n == seq.num_tokens]
        sampled = self.scheduler.update_after_step(batch)
        assert [(row, id(seq)) for row, seq in sampled] == wanted
        for _, seq in sampled:
            seq.output_token_ids.append(FAKE_TOKEN)
            if len(seq.output_token_ids) >= seq.params.max_tokens or \
                    seq.num_tokens >= self.context_limit:
                self.finish(seq, SequenceStatus.FINISHED_LENGTH)
        return batch

    def finish(self, seq, status):
        self.scheduler.finish(seq, status)
        del self.live[seq.request_id]
        self.finished.append(seq)

    def check_batch(self, batch):
        s = self.scheduler
        assert batch.num_tokens <= s.max_num_batched_tokens
        assert len(s.running) <= s.max_num_seqs
        assert len({id(seq) for seq in batch.seqs}) == len(batch.seqs), "a sequence twice in a step"
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            assert n >= 1 and seq in s.running
            assert seq.num_computed_tokens + n <= seq.num_tokens
            # the block table covers every token this step writes
            assert len(seq.block_table) * self.blocks.block_size >= seq.num_computed_tokens + n

    def check_blocks(self):
        blocks = self.blocks
        live = list(self.live.values())
        blocks.check_invariants(live)
        used = sum(len(seq.block_table) for seq in live)
        assert blocks.num_free_blocks + used == blocks.num_blocks
        owners = [b for seq in live for b in seq.block_table]
        assert len(owners) == len(set(owners)), "a block is owned twice"
        for seq in self.scheduler.waiting:
            assert seq.block_table == [] and seq.num_computed_tokens == 0 and seq.slot is None
        for seq in self.finished:
            assert seq.block_table == [] and seq.is_finished and seq.slot is None
        # each running sequence holds its own slot; the free ones are the rest
        s = self.scheduler
        slots = [seq.slot for seq in s.running]
        assert len(set(slots)) == len(slots) and all(0 <= slot < s.max_num_seqs for slot in slots)
        assert sorted(slots + s.free_slots) == list(range(s.max_num_seqs))
        assert set(self.live) == {s.request_id for s in self.scheduler.running} | \
            {s.request_id for s in self.scheduler.waiting}

    def drain(self, max_steps=20_000):
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                return
            batch = self.step()
            assert batch, "the scheduler stalled with requests in the queue"
            self.check_blocks()
        raise AssertionError("the queue did not drain")


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]),
                max_num_seqs=st.integers(1, 6), budget=st.integers(1, 48),
                max_model_len=st.integers(2, 96))
    def setup(self, num_blocks, block_size, max_num_seqs, budget, max_model_len):
        self.sim = Simulation(num_blocks, block_size, max_num_seqs, budget, max_model_len)
        self.next_id = 0

    @rule(prompt_len=st.integers(1, 60), max_tokens=st.integers(1, 40))
    def add(self, prompt_len, max_tokens):
        seq = make_seq(self.next_id, prompt_len, max_tokens, arrival=self.next_id)
        self.next_id += 1
        sim = self.sim
        fits = prompt_len < sim.scheduler.max_model_len and \
            sim.blocks.blocks_needed(prompt_len + 1) <= sim.blocks.num_blocks
        if fits:
            sim.add(seq)
        else:
            with pytest.raises(RequestError, match=str(prompt_len)):
                sim.add(seq)

    @rule()
    def step(self):
        self.sim.step()

    @precondition(lambda self: self.sim.live)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.sim.live)))
        seq = self.sim.scheduler.abort(request_id)
        assert seq is not None and seq.status is SequenceStatus.FINISHED_ABORTED
        del self.sim.live[request_id]
        self.sim.finished.append(seq)

    @precondition(lambda self: self.sim.scheduler.running)
    @rule(data=st.data())
    def finish_early(self, data):
        """A stop string or EOS ends a running sequence between steps."""
        seq = data.draw(st.sampled_from(self.sim.scheduler.running))
        self.sim.finish(seq, SequenceStatus.FINISHED_STOPPED)

    @invariant()
    def blocks_add_up(self):
        if hasattr(self, "sim"):
            self.sim.check_blocks()

    def teardown(self):
        if hasattr(self, "sim"):
            self.sim.drain()
            assert self.sim.blocks.num_free_blocks == self.sim.blocks.num_blocks
            assert not self.sim.live


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_preempts_the_newest_and_recomputes_it():
    sim = Simulation(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                     max_model_len=64)
    first, second = make_seq("a", 6, 10), make_seq("b", 6, 10)
    sim.add(first)
    sim.add(second)
    sim.step()  # both prefilled: 2 blocks each, the cache is full
    assert sim.blocks.num_free_blocks == 0
    for _ in range(3):
        sim.step()  # a needs a third block at its 9th token: b is preempted
    assert second.num_preemptions == 1 and first.num_preemptions == 0
    assert sim.scheduler.waiting[0] is second and second.block_table == []
    sim.drain()
    assert len(first.output_token_ids) == 10 and len(second.output_token_ids) == 10
    assert sim.blocks.num_free_blocks == 4


def test_short_request_behind_a_long_one_finishes_first():
    sim = Simulation(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=64,
                     max_model_len=256)
    sim.add(make_seq("long", 8, 50))
    sim.add(make_seq("blocker", 8, 5))
    sim.add(make_seq("short", 4, 3))  # waits for a free slot
    order = []
    while sim.scheduler.has_unfinished():
        sim.step()
        num_running, num_waiting = sim.queue_after_schedule
        if num_waiting:
            assert num_running == 2, "a slot stayed empty while requests waited"
        order += [s.request_id for s in sim.finished if s.request_id not in order]
    assert order == ["blocker", "short", "long"]


def test_rejects_what_can_never_fit_with_the_numbers():
    sim = Simulation(num_blocks=2, block_size=4, max_num_seqs=2, max_num_batched_tokens=64,
                     max_model_len=100)
    with pytest.raises(RequestError, match=r"needs 3 KV blocks of 4 tokens.*only 2"):
        sim.add(make_seq("big", 8, 1))
    with pytest.raises(RequestError, match=r"100 tokens.*context limit is 100"):
        Simulation(64, 4, 2, 64, 100).add(make_seq("long", 100, 1))
    with pytest.raises(RequestError, match="empty"):
        sim.add(make_seq("empty", 0, 1))


def test_abort_by_id_frees_blocks_at_once():
    sim = Simulation(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                     max_model_len=64)
    for name in "abc":
        sim.add(make_seq(name, 5, 20))
    sim.step()
    assert sim.blocks.num_free_blocks == 2
    assert sim.scheduler.abort("b").status is SequenceStatus.FINISHED_ABORTED
    assert sim.blocks.num_free_blocks == 4
    assert sim.scheduler.abort("b") is None and sim.scheduler.abort("nope") is None


def test_chunked_prefill_respects_the_token_budget():
    sim = Simulation(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=10,
                     max_model_len=256)
    sim.add(make_seq("a", 25, 2))
    sizes = [sim.step().num_new_tokens for _ in range(3)]
    assert sizes == [[10], [10], [5]]


def test_scheduling_code_imports_no_numpy():
    code = ("import sys, cupy_llama.engine.scheduler, cupy_llama.engine.block_manager; "
            "bad = [m for m in ('numpy', 'cupy') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
