"""SamplingParams(n=k) on the NumPy backend with a tiny random model: k outputs per prompt
told apart by index, the prompt computed once (samples 1..k-1 fork from sample 0 and share
its full prompt blocks, with the prefix cache on or off), seeds, abort and ordering."""
import json
import random

import pytest
from conftest import assert_all_blocks_free, prompt_tokens_computed

from cupy_llama import LLM, SamplingParams
from cupy_llama.cli import main
from cupy_llama.errors import RequestError

BLOCK = 16


@pytest.fixture(scope="module", params=[True, False], ids=["cache", "no-cache"])
def any_llm(request, model_dir):
    return LLM(model_dir, device="cpu", log=None, enable_prefix_caching=request.param)


def ids(seed, count):
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(count)]


def sampled(n, seed=7, max_tokens=10):
    return SamplingParams(temperature=1.0, top_k=40, seed=seed, max_tokens=max_tokens,
                          ignore_eos=True, n=n)


@pytest.mark.parametrize("length", [40, 48])
def test_three_samples_prefill_the_prompt_once(any_llm, length):
    """Sample 0 computes the prompt; samples 1 and 2 compute only their tail: the partly
    filled last block, or the last token when the prompt fills its blocks (48)."""
    any_llm.engine.blocks.reset_prefix_cache()
    prompt = ids(length, length)
    finals = {}
    with prompt_tokens_computed(any_llm) as counts:
        outputs = list(any_llm.stream(prompt, sampled(3)))
    for output in outputs:
        assert not (output.index in finals and output.finished), "finished twice"
        if output.finished:
            finals[output.index] = output
    assert sorted(finals) == [0, 1, 2] and len({o.request_id for o in outputs}) == 1
    assert all(o.finish_reason == "length" and len(o.token_ids) == 10 for o in finals.values())
    tail = length % BLOCK or 1
    assert counts == {outputs[0].request_id: length + 2 * tail}
    assert len({tuple(o.token_ids) for o in finals.values()}) == 3, "the samples are one"
    # each sample's deltas add up to its own final output
    for index, final in finals.items():
        deltas = [t for o in outputs if o.index == index for t in o.delta_token_ids]
        assert deltas == final.token_ids
    assert_all_blocks_free(any_llm)


def test_the_same_seed_gives_the_same_samples(llm, model_dir):
    prompt = ids(1, 30)
    first = llm.generate(prompt, sampled(3, seed=11))
    assert [o.index for o in first] == [0, 1, 2]
    again = llm.generate(prompt, sampled(3, seed=11))
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    # sample 0 is the n = 1 request of that seed; another seed gives other samples
    assert llm.generate(prompt, sampled(1, seed=11)).token_ids == first[0].token_ids
    other = llm.generate(prompt, sampled(3, seed=12))
    assert [o.token_ids for o in other] != [o.token_ids for o in first]
    without_cache = LLM(model_dir, device="cpu", log=None, enable_prefix_caching=False)
    assert [o.token_ids for o in without_cache.generate(prompt, sampled(3, seed=11))] == \
        [o.token_ids for o in first]
    unseeded = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=10, n=3,
                                                   ignore_eos=True))
    assert len({tuple(o.token_ids) for o in unseeded}) == 3


def test_greedy_samples_equal_the_single_greedy_output(any_llm):
    prompt = ids(2, 37)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = any_llm.generate(prompt, greedy)
    three = any_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True, n=3))
    assert [o.index for o in three] == [0, 1, 2]
    assert all(o.token_ids == one.token_ids and o.text == one.text for o in three)
    assert_all_blocks_free(any_llm)


def test_each_sample_has_the_logprobs_of_its_own_tokens(any_llm):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, n=3,
                            logprobs=2)
    outputs = any_llm.generate(ids(8, 21), params)
    assert len({tuple(o.token_ids) for o in outputs}) == 3
    for output in outputs:
        assert [entry.token_id for entry in output.logprobs] == output.token_ids
        assert all(len(entry.top) == 2 for entry in output.logprobs)
    single = any_llm.generate(ids(8, 21), SamplingParams(temperature=1.0, seed=3, max_tokens=6,
                                                         ignore_eos=True, logprobs=2))
    # sample 0 is the request of that seed (float32 sums of other batch shapes: 1e-4)
    assert single.token_ids == outputs[0].token_ids
    for a, b in zip(single.logprobs, outputs[0].logprobs):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert_all_blocks_free(any_llm)


def test_abort_ends_every_sample(any_llm):
    engine = any_llm.engine
    request_id = engine.add_request(ids(3, 25), sampled(3, max_tokens=50))
    outputs = []
    for _ in range(4):
        outputs += engine.step()
    assert {o.index for o in outputs} == {0, 1, 2}, "not every sample was running"
    aborted = engine.abort(request_id)
    assert sorted(o.index for o in aborted) == [0, 1, 2]
    assert all(o.finish_reason == "abort" and o.request_id == request_id for o in aborted)
    assert engine.abort(request_id) == []
    engine.step()  # the step still running hands out nothing
    assert_all_blocks_free(any_llm)


def test_abort_before_the_samples_fork(any_llm):
    engine = any_llm.engine
    request_id = engine.add_request(ids(4, 20), sampled(2))
    aborted = engine.abort(request_id)
    assert sorted(o.index for o in aborted) == [0, 1] and all(not o.token_ids for o in aborted)
    assert_all_blocks_free(any_llm)


def test_samples_fork_even_when_the_parent_has_ended(model_dir):
    """One slot: sample 1 starts only after sample 0 has finished (and let its blocks go):
    with the cache it finds them there, without it it computes the prompt itself."""
    for caching in (True, False):
        llm = LLM(model_dir, device="cpu", log=None, max_num_seqs=1,
                  enable_prefix_caching=caching)
        prompt = ids(5, 40)
        greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        with prompt_tokens_computed(llm) as counts:
            outputs = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5,
                                                          ignore_eos=True, n=2))
        single = llm.generate(prompt, greedy).token_ids
        assert [o.token_ids for o in outputs] == [single, single]
        assert [o.num_cached_tokens for o in outputs] == ([0, 32] if caching else [0, 0])
        assert counts == {outputs[0].request_id: 40 + (8 if caching else 40)}
        assert_all_blocks_free(llm)


def test_preemption_changes_no_sample(model_dir, llm):
    """A pool too small for every sample at once: samples are preempted and recomputed
    (seeded: they draw the same numbers again) and come out as with room to spare."""
    prompts = [ids(20 + i, 20 + 7 * i) for i in range(6)]
    params = sampled(3, seed=5, max_tokens=24)
    ample = llm.generate(prompts, params)
    for caching in (True, False):
        tight = LLM(model_dir, device="cpu", log=None, num_kv_blocks=24, max_num_seqs=18,
                    enable_prefix_caching=caching)
        got = tight.generate(prompts, params)
        assert tight.engine.scheduler.num_preemptions > 0, "no preemption"
        assert [(o.index, o.token_ids) for o in got] == [(o.index, o.token_ids) for o in ample]
        assert_all_blocks_free(tight)


def test_generate_orders_by_prompt_then_index_and_chat_takes_n(llm):
    prompts = [ids(6, 20), ids(7, 33)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=2)
    outputs = llm.generate(prompts, params)
    assert [o.index for o in outputs] == [0, 1, 0, 1]
    assert [o.prompt_token_ids for o in outputs] == [prompts[0]] * 2 + [prompts[1]] * 2
    assert outputs[0].request_id == outputs[1].request_id != outputs[2].request_id
    mixed = llm.generate(prompts, [params, SamplingParams(temperature=0, max_tokens=4)])
    assert [o.index for o in mixed] == [0, 1, 0]
    single = llm.generate(prompts[0], params)
    assert isinstance(single, list) and [o.index for o in single] == [0, 1]
    conversation = [{"role": "user", "content": "hi"}]
    replies = llm.chat(conversation, params)
    assert isinstance(replies, list) and [o.index for o in replies] == [0, 1]
    assert len(llm.chat([conversation, conversation], params)) == 4
    assert not isinstance(llm.chat(conversation, SamplingParams(max_tokens=2)), list)


def test_n_in_a_batch_file_is_a_line_error(model_dir, tmp_path, capsys):
    """generate writes one line per request: n > 1 there is refused, that line only."""
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"id": "x", "prompt": "hi", "n": 2}) + "\n" +
                    json.dumps({"id": "y", "prompt": "hi"}) + "\n")
    assert main(["generate", "--model", str(model_dir), "--input", str(path), "--device",
                 "cpu", "--max-tokens", "2"]) == 1  # a line failed
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows[0]["id"] == "x" and "n must be 1 in a batch file" in rows[0]["error"]
    assert rows[1]["id"] == "y" and "text" in rows[1]


@pytest.mark.parametrize("bad", [0, -1, 129, True, 1.5, "2", None])
def test_n_is_checked(bad):
    with pytest.raises(RequestError, match=r"n must be an integer from 1 to 128.*got"):
        SamplingParams(n=bad)


def test_n_may_be_a_numpy_integer():
    import numpy as np
    params = SamplingParams(n=np.int64(3))
    assert params.n == 3 and type(params.n) is int
