"""Block manager and scheduler without a model: steps are simulated with fake tokens.

The simulation drives the scheduler as LLMEngine does, steps pipelined one deep: a sampled
token is a placeholder until the next step has been launched. It keeps a shadow record of
the K/V each block holds (which token ids each slot was computed from) to check that a
sequence only ever reads K/V of its own tokens, that no shared or cached block is ever
written, and that every cached block holds what its hash says.

The state machine adds requests (some sharing prefixes, some with n > 1 samples), steps,
aborts and finishes them at random, and drops the prefix cache now and then; it checks the
block accounting and the cache after every rule; at the end it drains the queue and checks
that every block came back.
"""
import subprocess
import sys

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cupy_llama.engine.block_manager import ROOT_HASH, BlockManager, block_hash
from cupy_llama.engine.scheduler import Scheduler
from cupy_llama.engine.sequence import Sequence, SequenceStatus
from cupy_llama.errors import RequestError
from cupy_llama.sampling import SamplingParams


def make_request(request_id, prompt, max_tokens, n=1):
    """The n sequences of a request, as LLMEngine.add_request makes them."""
    if isinstance(prompt, int):  # a prompt of that many tokens, its own
        prompt = [1000 + sum(map(ord, str(request_id))) + i for i in range(prompt)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, n=n)
    seqs, parent = [], None
    for index in range(n):
        seq = Sequence(str(request_id), prompt, params, seed=index, arrival=0, index=index,
                       parent=parent)
        parent = parent or seq
        seqs.append(seq)
    return seqs


def make_seq(request_id, prompt, max_tokens):
    return make_request(request_id, prompt, max_tokens)[0]


def sampled_token(seq, index):
    """The fake token a sequence samples as its index-th output: the same for the same
    request content, so equal prompts also share generated blocks; samples differ."""
    return 1 + (len(seq.prompt_token_ids) + index * index + seq.index) % 3


def chain_hashes(token_ids, block_size):
    hashes = [ROOT_HASH]
    for i in range(len(token_ids) // block_size):
        hashes.append(block_hash(hashes[-1], token_ids[i * block_size:(i + 1) * block_size]))
    return hashes[1:]


class Simulation:
    """Drives a Scheduler the way LLMEngine does, with fake sampled tokens."""

    def __init__(self, num_blocks, block_size, max_num_seqs, max_num_batched_tokens, max_model_len,
                 enable_caching=True):
        self.blocks = BlockManager(num_blocks, block_size, enable_caching=enable_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   max_model_len=max_model_len)
        # as in LLMEngine: a sequence stops when it would outgrow the whole cache
        self.context_limit = min(max_model_len, num_blocks * block_size)
        self.live: dict[tuple[str, int], Sequence] = {}
        self.finished: list[Sequence] = []
        self.coming: list[tuple[Sequence, int]] = []  # placeholders of the latest step
        # the K/V of each slot: (the sequence, the position) they were computed for; the
        # tokens they stand for are that sequence's token_ids[:position + 1]
        self.shadow = [[None] * block_size for _ in range(num_blocks)]
        self.num_prompt_tokens_computed: dict[str, int] = {}

    def add(self, seqs):
        if isinstance(seqs, Sequence):
            seqs = [seqs]
        for seq in seqs:
            self.scheduler.add(seq)
            self.live[seq.request_id, seq.index] = seq

    def step(self):
        batch = self.scheduler.schedule()
        self.queue_after_schedule = (len(self.scheduler.running), len(self.scheduler.waiting))
        self.check_batch(batch)
        # a row wants a sampled token when this step brings its last known token in
        wanted = [(row, id(seq))
                  for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
                  if seq.num_computed_tokens + n == seq.num_tokens]
        sampled = self.scheduler.update_after_step(batch)
        assert [(row, id(seq)) for row, seq in sampled] == wanted
        coming = []
        for row, seq in sampled:
            seq.output_token_ids.append(-(row + 1))  # known once the next step is launched
            coming.append((seq, len(seq.output_token_ids) - 1))
            if len(seq.output_token_ids) >= seq.params.max_tokens or \
                    seq.num_tokens >= self.context_limit:
                # known at launch: the tokens still coming are kept (they arrive below)
                self.finish(seq, SequenceStatus.FINISHED_LENGTH, drop_coming=False)
        # the previous step's tokens arrive (LLMEngine.step: launch k, then read k - 1)
        for seq, index in self.coming:
            if index < len(seq.output_token_ids):
                seq.output_token_ids[index] = sampled_token(seq, index)
        self.coming = coming
        return batch

    def finish(self, seq, status, drop_coming=True):
        self.scheduler.finish(seq, status)
        if drop_coming:
            self.drop_unknown_tokens(seq)
        del self.live[seq.request_id, seq.index]
        self.finished.append(seq)

    @staticmethod
    def drop_unknown_tokens(seq):
        """A sequence that stops (or is aborted) drops the tokens still coming."""
        while seq.output_token_ids and seq.output_token_ids[-1] < 0:
            seq.output_token_ids.pop()

    def check_batch(self, batch):
        s, blocks = self.scheduler, self.blocks
        assert batch.num_tokens <= s.max_num_batched_tokens
        assert len(s.running) <= s.max_num_seqs
        assert len({id(seq) for seq in batch.seqs}) == len(batch.seqs), "a sequence twice in a step"
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            assert n >= 1 and seq in s.running
            start = seq.num_computed_tokens
            assert start + n <= seq.num_tokens
            # the block table covers every token this step writes
            assert len(seq.block_table) * blocks.block_size >= start + n
            # reused K/V are never written: only a fully cached prompt's last token is
            # computed inside its reused blocks (for its logits)
            assert start >= seq.num_reused_tokens or start == seq.num_tokens - 1 == \
                seq.num_reused_tokens - 1
            if start < seq.num_prompt_tokens:
                self.num_prompt_tokens_computed[seq.request_id] = \
                    self.num_prompt_tokens_computed.get(seq.request_id, 0) + \
                    min(start + n, seq.num_prompt_tokens) - start
            for position in range(max(start, seq.num_reused_tokens), start + n):
                block = seq.block_table[position // blocks.block_size]
                assert blocks.ref_counts[block] == 1 and blocks.hash_of[block] is None, \
                    f"{seq} writes block {block}, which is shared or cached"
                self.shadow[block][position % blocks.block_size] = (seq, position)

    def kv_tokens(self, block, row):
        """The token ids the K/V in a slot were computed from (None: never written)."""
        entry = self.shadow[block][row]
        if entry is None:
            return None
        seq, position = entry
        return tuple(seq.token_ids[:position + 1])

    def check_blocks(self):
        blocks = self.blocks
        holders = [seq for seq in self.live.values() if seq.block_table]
        blocks.check_invariants(holders)
        used = {b for seq in holders for b in seq.block_table}
        assert blocks.num_free_blocks + len(used) == blocks.num_blocks
        for seq in self.scheduler.waiting:
            assert seq.block_table == [] and seq.num_computed_tokens == 0 and seq.slot is None
        for seq in self.finished:
            assert seq.block_table == [] and seq.is_finished and seq.slot is None
        # each running sequence holds its own slot; the free ones are the rest
        s = self.scheduler
        slots = [seq.slot for seq in s.running]
        assert len(set(slots)) == len(slots) and all(0 <= slot < s.max_num_seqs for slot in slots)
        assert sorted(slots + s.free_slots) == list(range(s.max_num_seqs))
        assert set(self.live) == {(q.request_id, q.index) for q in s.running} | \
            {(q.request_id, q.index) for q in s.waiting}
        # a running sequence reads, at every computed position, K/V of its own tokens
        bs = blocks.block_size
        for seq in s.running:
            tokens = seq.token_ids
            for position in range(seq.num_computed_tokens):
                got = self.kv_tokens(seq.block_table[position // bs], position % bs)
                assert got == tuple(tokens[:position + 1]), \
                    f"{seq} position {position}: K/V of other tokens"
        # every cached block holds the K/V its hash names: a run of full, known tokens
        for digest, block in blocks.cached.items():
            contents = [self.kv_tokens(block, row) for row in range(bs)]
            assert all(c is not None for c in contents), f"cached block {block} is not full"
            tokens = contents[-1]
            assert len(tokens) % bs == 0 and min(tokens) >= 0
            assert contents == [tokens[:len(tokens) - bs + row + 1] for row in range(bs)]
            assert chain_hashes(list(tokens), bs)[-1] == digest, f"cached block {block}: wrong hash"

    def drain(self, max_steps=20_000):
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                return
            batch = self.step()
            assert batch, "the scheduler stalled with requests in the queue"
            self.check_blocks()
        raise AssertionError("the queue did not drain")


# prompts share prefixes of these (token ids from a small alphabet, so contents repeat)
SHARED_PREFIXES = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1] * 3, [2] * 40, [3, 1] * 20]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]),
                max_num_seqs=st.integers(1, 6), budget=st.integers(1, 48),
                max_model_len=st.integers(2, 96), enable_caching=st.booleans())
    def setup(self, num_blocks, block_size, max_num_seqs, budget, max_model_len, enable_caching):
        self.sim = Simulation(num_blocks, block_size, max_num_seqs, budget, max_model_len,
                              enable_caching)
        self.next_id = 0

    @rule(prefix=st.sampled_from(range(len(SHARED_PREFIXES))), shared=st.integers(0, 40),
          tail=st.lists(st.integers(1, 3), max_size=30), max_tokens=st.integers(1, 40),
          n=st.sampled_from([1, 1, 1, 2, 3]))
    def add(self, prefix, shared, tail, max_tokens, n):
        prompt = SHARED_PREFIXES[prefix][:shared] + tail or [1]
        seqs = make_request(self.next_id, prompt, max_tokens, n)
        self.next_id += 1
        sim = self.sim
        fits = 0 < len(prompt) < sim.scheduler.max_model_len and \
            sim.blocks.blocks_needed(len(prompt) + 1) <= sim.blocks.num_blocks
        if fits:
            sim.add(seqs)
        else:
            with pytest.raises(RequestError, match=str(len(prompt))):
                sim.add(seqs)
            assert all(seq not in sim.scheduler.waiting for seq in seqs)

    @rule()
    def step(self):
        self.sim.step()

    @precondition(lambda self: self.sim.live)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted({r for r, _ in self.sim.live})))
        seqs = self.sim.scheduler.abort(request_id)
        assert seqs and all(seq.status is SequenceStatus.FINISHED_ABORTED for seq in seqs)
        assert {seq.index for seq in seqs} == {i for r, i in self.sim.live if r == request_id}
        for seq in seqs:
            self.sim.drop_unknown_tokens(seq)
            del self.sim.live[request_id, seq.index]
            self.sim.finished.append(seq)

    @precondition(lambda self: self.sim.scheduler.running)
    @rule(data=st.data())
    def finish_early(self, data):
        """A stop string or EOS ends a running sequence between steps."""
        seq = data.draw(st.sampled_from(self.sim.scheduler.running))
        self.sim.finish(seq, SequenceStatus.FINISHED_STOPPED)

    @rule(enable=st.booleans())
    def reset_prefix_cache(self, enable):
        """Drop the cache (as `bench prefix` does between its runs) and turn it on or off."""
        self.sim.blocks.reset_prefix_cache()
        self.sim.blocks.enable_caching = enable

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
TestSchedulerMachine.settings = settings(max_examples=400, stateful_step_count=50, deadline=None)
TestSchedulerMachine.pytestmark = [pytest.mark.slow]  # 400 runs of 50 steps: about 16 s


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


def test_a_prompt_past_every_limit_hears_of_the_one_that_binds():
    """Past max_model_len and past a smaller KV cache: the cache's numbers, since raising
    max_model_len would not help. Past max_model_len alone: raising it is offered only
    where the model takes more."""
    sim = Simulation(num_blocks=2, block_size=4, max_num_seqs=2, max_num_batched_tokens=64,
                     max_model_len=100)
    with pytest.raises(RequestError, match=r"needs 26 KV blocks of 4 tokens.*only 2"):
        sim.add(make_seq("long", 100, 1))
    sim = Simulation(64, 4, 2, 64, 100)
    for model_limit, fix in ((None, "raise max_model_len$"),
                             (4096, r"raise max_model_len \(the model takes up to 4096\)$"),
                             (100, r"use a model with a longer context \(this one takes up "
                                   r"to 100\)$")):
        sim.scheduler.model_limit = model_limit
        with pytest.raises(RequestError, match=r"context limit is 100 .*shorten the prompt or "
                                               + fix):
            sim.add(make_seq("long", 100, 1))


def test_abort_by_id_frees_blocks_at_once():
    sim = Simulation(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                     max_model_len=64)
    for name in "abc":
        sim.add(make_seq(name, 5, 20))
    sim.step()
    assert sim.blocks.num_free_blocks == 2
    [aborted] = sim.scheduler.abort("b")
    assert aborted.status is SequenceStatus.FINISHED_ABORTED
    assert sim.blocks.num_free_blocks == 4
    assert sim.scheduler.abort("b") == [] and sim.scheduler.abort("nope") == []


def test_chunked_prefill_respects_the_token_budget():
    sim = Simulation(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=10,
                     max_model_len=256)
    sim.add(make_seq("a", 25, 2))
    sizes = [sim.step().num_new_tokens for _ in range(3)]
    assert sizes == [[10], [10], [5]]


def test_a_prompt_prefills_from_its_first_uncached_token():
    sim = Simulation(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                     max_model_len=64)
    first = make_seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 3)
    sim.add(first)
    sim.step()
    second = make_seq("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12], 3)
    sim.add(second)
    batch = sim.step()
    assert batch.seqs == [first, second] and batch.num_new_tokens == [1, 3]
    assert second.block_table[:2] == first.block_table[:2]  # shared, a reference each
    assert [sim.blocks.ref_counts[b] for b in second.block_table] == [2, 2, 1]
    assert second.num_cached_tokens == second.num_reused_tokens == 8
    sim.drain()
    assert sim.num_prompt_tokens_computed == {"a": 10, "b": 3}


def test_admission_counts_the_cached_blocks_it_takes():
    """A waiting prompt's cached blocks that no one holds come out of the free ones: it
    waits until a fresh block is free as well."""
    sim = Simulation(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                     max_model_len=64)
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    sim.add(make_seq("a", shared, 1))
    sim.drain()  # its 2 full blocks stay cached
    assert len(sim.blocks.cached) == 2 and sim.blocks.num_free_blocks == 6
    sim.add(make_seq("b", 14, 20))
    sim.step()  # b takes the 4 blocks that cache nothing
    sim.add(make_seq("c", shared + [9, 10], 5))  # 2 cached blocks and 1 fresh one
    sim.step()
    assert [seq.request_id for seq in sim.scheduler.waiting] == ["c"]
    assert len(sim.blocks.cached_free) == 2 and sim.blocks.num_free_blocks == 2  # a's
    sim.scheduler.abort("b")
    del sim.live["b", 0]
    sim.step()
    [c] = sim.scheduler.running
    assert c.request_id == "c" and c.num_cached_tokens == 8
    sim.drain()


def test_samples_wait_for_the_prompt_then_share_its_full_blocks():
    for caching in (True, False):
        sim = Simulation(num_blocks=64, block_size=4, max_num_seqs=4,
                         max_num_batched_tokens=64, max_model_len=128, enable_caching=caching)
        parent, *children = make_request("r", 10, 5, n=3)
        sim.add([parent, *children])
        assert sim.step().seqs == [parent]  # the samples wait for the prompt
        batch = sim.step()
        assert batch.seqs == [parent, *children] and batch.num_new_tokens == [1, 2, 2]
        for child in children:
            assert child.block_table[:2] == parent.block_table[:2]
            assert child.block_table[2] != parent.block_table[2]  # the partly filled one
        assert child.num_cached_tokens == (8 if caching else 0)
        sim.drain()
        assert sim.num_prompt_tokens_computed == {"r": 10 + 2 + 2}
        assert sim.blocks.num_free_blocks == sim.blocks.num_blocks


def test_a_decode_steps_filled_block_is_cached_once_its_last_token_is_known():
    """on_computed's decode-step way (one block of output tokens filled, the blocks before
    it settled) caches what cache_computed_blocks would: the block under the hash of its
    tokens, once its last token, a placeholder while its step runs, is known."""
    blocks = BlockManager(8, 4)
    seq = make_seq("a", [1, 2, 3, 4], 8)
    blocks.allocate(seq, blocks.reusable_blocks(seq), 5)
    seq.num_computed_tokens = 4
    blocks.on_computed([seq])
    assert seq.kv_hashes.num_settled == 1
    outputs = seq.output_token_ids
    for token in (11, 12, 13, 14):  # each step's input is the last one's placeholder
        outputs.append(-1)
        blocks.grow(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens - 1 if len(outputs) > 1 else 4
        blocks.on_computed([seq])
        outputs[-1] = token  # the step's token arrives
    assert outputs == [11, 12, 13, 14] and seq.kv_hashes.num_settled == 1  # 14 was coming
    outputs.append(-1)
    seq.num_computed_tokens = 8
    blocks.on_computed([seq])
    digest = chain_hashes([1, 2, 3, 4, 11, 12, 13, 14], 4)[-1]
    assert seq.kv_hashes.num_settled == 2 and blocks.cached[digest] == seq.block_table[1]
    assert seq.kv_hashes.digests == chain_hashes([1, 2, 3, 4, 11, 12, 13, 14], 4)
    blocks.check_invariants([seq])


def test_scheduling_code_imports_no_numpy():
    code = ("import sys, cupy_llama.engine.scheduler, cupy_llama.engine.block_manager; "
            "bad = [m for m in ('numpy', 'cupy') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("seed", range(8))
def test_steady_steps_schedule_what_the_full_pass_schedules(seed):
    """A step after a steady one is scheduled without a pass over the sequences (each has
    one token to compute; only those whose last block is full get one). Two simulations
    of one random run, one of them always taking the full pass, schedule the same
    sequences and tokens at every step, with tables of the same lengths."""
    import random
    rng = random.Random(seed)
    shape = dict(num_blocks=rng.randint(12, 40), block_size=rng.choice([1, 2, 4, 16]),
                 max_num_seqs=rng.randint(2, 8), max_num_batched_tokens=rng.randint(8, 48),
                 max_model_len=rng.randint(40, 120), enable_caching=rng.random() < 0.5)
    sims = [Simulation(**shape), Simulation(**shape)]
    sims[1].scheduler._steady = lambda: None  # always the full pass
    steady = [0, 0]
    next_id = 0
    for _ in range(500):
        if not sims[0].scheduler.waiting and rng.random() < 0.08:  # bursts of requests
            for _ in range(rng.randint(1, 5)):
                prompt = SHARED_PREFIXES[rng.randrange(3)][:rng.randint(0, 30)] + \
                    [rng.randint(1, 3) for _ in range(rng.randint(1, 8))]
                prompt = prompt[:shape["max_model_len"] - 1]
                max_tokens, n = rng.randint(1, 40), rng.choice([1, 1, 2])
                for sim in sims:
                    try:
                        sim.add(make_request(str(next_id), prompt, max_tokens, n))
                    except RequestError:
                        pass
                next_id += 1
        if rng.random() < 0.04 and sims[0].scheduler.running:
            index = rng.randrange(len(sims[0].scheduler.running))
            for sim in sims:
                sim.finish(sim.scheduler.running[index], SequenceStatus.FINISHED_STOPPED)
        batches = [sim.step() for sim in sims]
        for i, batch in enumerate(batches):
            steady[i] += batch.follows is not None
        shapes = [[(seq.request_id, seq.index, n, len(seq.block_table))
                   for seq, n in zip(batch.seqs, batch.num_new_tokens)] for batch in batches]
        assert shapes[0] == shapes[1]
        for sim in sims:
            sim.check_blocks()
    assert [len(sim.scheduler.waiting) for sim in sims] == [len(sims[1].scheduler.waiting)] * 2
    assert steady[0] > 50 and steady[0] == steady[1], steady
    assert sims[0].scheduler.num_preemptions == sims[1].scheduler.num_preemptions
