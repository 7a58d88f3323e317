"""Prefix caching end to end on the NumPy backend with a tiny random model: greedy outputs
with the cache equal those without, exactly, for prefixes shared across block boundaries
and between them, under preemption, for a fully cached prompt and across chat turns; the
reported cached tokens; and every block free once the requests are done."""
import random

import pytest
from conftest import assert_all_blocks_free, prompt_tokens_computed

from cupy_llama import LLM, SamplingParams
from cupy_llama.config import EngineConfig
from cupy_llama.errors import ConfigError

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def uncached(model_dir):
    return LLM(model_dir, device="cpu", log=None, enable_prefix_caching=False)


@pytest.fixture
def cached(llm):
    """The module's engine (caching is on by default), with an empty cache."""
    assert llm.engine.blocks.enable_caching
    llm.engine.blocks.reset_prefix_cache()
    return llm


def ids(rng, count):
    return [rng.randrange(256) for _ in range(count)]


@pytest.mark.parametrize("shared", [0, 15, 16, 17, 100, 1000])
def test_greedy_outputs_with_the_cache_equal_those_without(cached, uncached, shared):
    """A first prompt fills the cache; prompts sharing its first `shared` tokens (then
    tails of their own, ending at several offsets in a block) run together after it."""
    rng = random.Random(shared)
    prefix = ids(rng, shared)
    first = prefix + ids(rng, 9)
    others = [prefix + ids(rng, tail) for tail in (1, 7, 16, 20)]
    with_cache = [cached.generate(first, GREEDY)] + cached.generate(others, GREEDY)
    without = [uncached.generate(first, GREEDY)] + uncached.generate(others, GREEDY)
    assert [o.token_ids for o in with_cache] == [o.token_ids for o in without]
    # the followers take the shared full blocks, no more (their tails differ)
    assert [o.num_cached_tokens for o in with_cache] == [0] + [shared // BLOCK * BLOCK] * 4
    assert all(o.num_cached_tokens == 0 for o in without)
    assert_all_blocks_free(cached)
    assert_all_blocks_free(uncached)


def test_the_same_under_preemption(model_dir, uncached):
    """A pool too small for the batch: sequences are preempted and recomputed, finding their
    own computed blocks (and the shared prefix) in the cache again."""
    rng = random.Random(1)
    prefix = ids(rng, 100)
    batch = [prefix + ids(rng, rng.randint(1, 30)) for _ in range(24)] + \
        [ids(rng, rng.randint(5, 40)) for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = uncached.generate(batch, params)
    small = LLM(model_dir, device="cpu", log=None, num_kv_blocks=40, max_num_seqs=32)
    readmitted_with_hits = []
    allocate = small.engine.blocks.allocate

    def recording_allocate(seq, reused, num_tokens):
        if seq.num_preemptions:
            readmitted_with_hits.append(bool(reused))
        allocate(seq, reused, num_tokens)

    small.engine.blocks.allocate = recording_allocate
    got = small.generate(batch, params)
    assert small.engine.scheduler.num_preemptions > 0, "the pool was big enough; no preemption"
    assert any(readmitted_with_hits), "no preempted sequence found its blocks again"
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert small.engine.blocks.num_hit_tokens > 0
    assert_all_blocks_free(small)


def test_chunked_prefill_after_a_hit(model_dir, uncached):
    """A small token budget: prompts that hit the cache prefill the rest of their prompt in
    chunks, beside other sequences' decodes."""
    llm = LLM(model_dir, device="cpu", log=None, max_num_batched_tokens=40)
    rng = random.Random(2)
    prefix = ids(rng, 100)
    prompts = [prefix + ids(rng, tail) for tail in (150, 3, 61)] + [ids(rng, 90)]
    outputs = [llm.generate(prompts[0], GREEDY)] + llm.generate(prompts[1:], GREEDY)
    assert [o.token_ids for o in outputs] == \
        [o.token_ids for o in uncached.generate(prompts, GREEDY)]
    assert [o.num_cached_tokens for o in outputs] == [0, 96, 96, 0]
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("length", [16, 64])
def test_a_fully_cached_prompt_computes_only_its_last_token(cached, uncached, length):
    """Every block of the prompt is cached: its last token is computed again for the
    logits (its K/V are not written again), and the first token is the right one."""
    prompt = ids(random.Random(length), length)
    cached.generate(prompt, GREEDY)
    with prompt_tokens_computed(cached) as counts:
        again = cached.generate(prompt, GREEDY)
    assert counts == {again.request_id: 1}
    assert again.num_cached_tokens == length
    assert again.token_ids == uncached.generate(prompt, GREEDY).token_ids
    assert_all_blocks_free(cached)


def test_chat_turn_two_hits_turn_one_and_its_reply(cached, uncached):
    """Turn 2 sends turn 1's prompt, the reply as generated and a new message: it finds the
    blocks of both, the generated ones too."""
    rng = random.Random(3)
    turn1 = ids(rng, 40)
    reply = cached.generate(turn1, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    turn2 = turn1 + reply.token_ids + ids(rng, 10)
    second = cached.generate(turn2, GREEDY)
    # the reply's last token was never fed back, so its K/V were never computed
    computed = len(turn1) + len(reply.token_ids) - 1
    assert second.num_cached_tokens == computed // BLOCK * BLOCK > len(turn1) // BLOCK * BLOCK
    assert second.token_ids == uncached.generate(turn2, GREEDY).token_ids
    assert_all_blocks_free(cached)


def test_the_hit_counters_add_up_the_first_admissions(cached):
    blocks = cached.engine.blocks
    queried, hits = blocks.num_queried_tokens, blocks.num_hit_tokens
    rng = random.Random(4)
    prefix = ids(rng, 50)
    prompts = [prefix + ids(rng, 5) for _ in range(3)]
    outputs = [cached.generate(prompts[0], GREEDY)] + cached.generate(prompts[1:], GREEDY)
    assert blocks.num_queried_tokens - queried == sum(len(p) for p in prompts)
    assert blocks.num_hit_tokens - hits == sum(o.num_cached_tokens for o in outputs) == 2 * 48


def test_blocks_no_request_holds_stay_cached_and_are_evicted_last(model_dir):
    """A pool of 12 blocks: a finished request's blocks stay findable while never-used
    blocks are left; past that, new blocks are taken from the cached ones, least recently
    used first (a sequence's later blocks before its earlier ones), and leave the cache."""
    llm = LLM(model_dir, device="cpu", log=None, num_kv_blocks=12)
    blocks, rng = llm.engine.blocks, random.Random(5)
    old, new = ids(rng, 64), ids(rng, 64)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate(old, params)  # 4 full blocks cached, 1 (its last token's) not
    assert len(blocks.cached) == 4 and blocks.num_free_blocks == 12
    llm.generate(new, params)  # 5 of the 8 blocks that cache nothing
    assert len(blocks.cached) == 8 and blocks.num_free_blocks == 12
    assert llm.generate(old, params).num_cached_tokens == 64  # and old's are used again
    # 7 blocks: the 4 that cache nothing, then the 3 least recently used: new's last three
    llm.generate(ids(rng, 100), params)
    assert len(blocks.cached) == 8 - 3 + 6
    assert llm.generate(old, params).num_cached_tokens == 64
    assert llm.generate(new, params).num_cached_tokens == 16
    assert_all_blocks_free(llm)


def test_caching_off_reports_nothing(uncached):
    prompt = ids(random.Random(6), 40)
    for _ in range(2):
        assert uncached.generate(prompt, GREEDY).num_cached_tokens == 0
    blocks = uncached.engine.blocks
    assert not blocks.cached and blocks.num_queried_tokens == blocks.num_hit_tokens == 0


def test_the_option_takes_flags_as_enforce_eager_does():
    import numpy as np
    for value in (1, np.True_, True):
        assert EngineConfig(enable_prefix_caching=value).enable_prefix_caching is True
    assert EngineConfig(enable_prefix_caching=0).enable_prefix_caching is False
    assert EngineConfig().enable_prefix_caching is True
    with pytest.raises(ConfigError, match="enable_prefix_caching must be True or False, got 'no'"):
        EngineConfig(enable_prefix_caching="no")


def test_the_reference_ops_write_no_kv_for_slot_minus_one():
    """Slot -1 marks a token whose K/V are in a shared block already (a fully cached
    prompt's last token): rope_and_cache leaves every cache row as it was, for it."""
    import numpy as np
    from types import SimpleNamespace

    from cupy_llama.backends.numpy_ops import NumpyOps
    rng = np.random.default_rng(0)
    num_heads, num_kv_heads, head_dim = 4, 2, 8
    qkv = rng.standard_normal((3, (num_heads + 2 * num_kv_heads) * head_dim)).astype(np.float32)
    cos_sin = rng.standard_normal((64, head_dim)).astype(np.float32)
    k_cache = rng.standard_normal((4, BLOCK, num_kv_heads, head_dim)).astype(np.float32)
    v_cache = k_cache.copy()
    k_before, v_before = k_cache.copy(), v_cache.copy()
    meta = SimpleNamespace(positions=np.array([5, 6, 7], np.int32),
                           slot_mapping=np.array([2 * BLOCK + 5, -1, 2 * BLOCK + 7], np.int32))
    q_out = np.empty((3, num_heads, head_dim), np.float32)
    NumpyOps().rope_and_cache(qkv, meta, cos_sin, k_cache, v_cache, q_out)
    changed = [(b, r) for b in range(4) for r in range(BLOCK)
               if not np.array_equal(k_cache[b, r], k_before[b, r])
               or not np.array_equal(v_cache[b, r], v_before[b, r])]
    assert changed == [(2, 5), (2, 7)]
    # every query is still rotated, the unwritten token's too
    full = np.empty_like(q_out)
    NumpyOps().rope_and_cache(qkv, SimpleNamespace(positions=meta.positions,
                                                   slot_mapping=np.arange(3, dtype=np.int32)),
                              cos_sin, k_before.copy(), v_before.copy(), full)
    np.testing.assert_array_equal(q_out, full)
