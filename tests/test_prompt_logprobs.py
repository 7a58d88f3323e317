"""Prompt log-probabilities (SamplingParams.prompt_logprobs, RequestOutput.prompt_logprobs):
computed on the device during prefill, against transformers float32 log-softmax at every
position of the fixtures' long prompts (tests/fixtures/arch_*, made by
scripts/make_arch_fixtures.py), whole and in chunks, after a prefix-cache hit, for n > 1
samples and through preemption."""
from pathlib import Path

import numpy as np
import pytest

from cupy_llama import LLM, SamplingParams
from cupy_llama.errors import RequestError

FIXTURES = Path(__file__).parent / "fixtures"
NAMES = ("qwen2", "qwen3", "mistral", "gemma3", "gemma2")
TOLERANCE = 1e-4


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


def fixture(name):
    folder = FIXTURES / f"arch_{name}"
    reference = dict(np.load(folder / "reference.npz"))
    return folder, reference["long_prompt"].tolist(), log_softmax(reference["logits"])


def check(scored, prompt, expected, k):
    """scored: RequestOutput.prompt_logprobs; expected: [len(prompt), V] log-softmax."""
    assert scored[0] is None and len(scored) == len(prompt)
    for position, entry in enumerate(scored[1:], start=1):
        row = expected[position - 1]  # the logits after token position - 1
        assert entry.token_id == prompt[position]
        assert abs(entry.logprob - row[prompt[position]]) < TOLERANCE, position
        assert len(entry.top) == k
        top_ids = [i for i, _ in entry.top]
        np.testing.assert_allclose([v for _, v in entry.top], row[top_ids], atol=TOLERANCE)
        # the k largest, best first (a near tie may order two neighbours either way)
        assert np.all(np.sort(row)[::-1][:k] - row[top_ids] < TOLERANCE), position
        # the token's place among all: 1 + those clearly above it, up to those near it
        own = row[prompt[position]]
        above, near = np.sum(row > own + TOLERANCE), np.sum(row > own - TOLERANCE) - 1
        assert 1 + above <= entry.rank <= 1 + near, (position, entry.rank, above, near)
        if entry.token_id in top_ids:  # where it is among the k, that place
            assert entry.rank == 1 + top_ids.index(entry.token_id) or near > above


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("chunk", [None, 20])
def test_prompt_logprobs_equal_transformers(name, chunk):
    folder, prompt, expected = fixture(name)
    options = {} if chunk is None else {"max_num_batched_tokens": chunk}
    llm = LLM(folder, device="cpu", log=None, **options)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    check(out.prompt_logprobs, prompt, expected, 3)


def test_a_prefix_cache_hit_still_scores_every_prompt_token():
    folder, prompt, expected = fixture("qwen2")
    llm = LLM(folder, device="cpu", log=None, max_num_batched_tokens=32)
    plain = SamplingParams(temperature=0, max_tokens=2)
    llm.generate(prompt, plain)
    llm.generate(prompt, plain)
    assert llm.engine.stats().prefix_cache_hits > 0, "no prefix-cache hit: the test proves nothing"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))
    check(out.prompt_logprobs, prompt, expected, 0)
    assert out.token_ids == llm.generate(prompt, plain).token_ids


def test_n_samples_share_the_prompts_scores_and_a_plain_request_has_none():
    folder, prompt, expected = fixture("mistral")
    llm = LLM(folder, device="cpu", log=None)
    outs = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=3,
                                               prompt_logprobs=1))
    for out in outs:
        check(out.prompt_logprobs, prompt, expected, 1)
    assert llm.generate(prompt, SamplingParams(max_tokens=1)).prompt_logprobs is None
    one = llm.generate(prompt[:1], SamplingParams(max_tokens=1, prompt_logprobs=2))
    assert one.prompt_logprobs == [None]


def test_preempted_prompts_are_scored_once(model_dir):
    import random
    rng = random.Random(0)
    batch = [[rng.randrange(256) for _ in range(rng.randint(20, 60))] for _ in range(24)]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=20, prompt_logprobs=1)
    ample = LLM(model_dir, device="cpu", log=None).generate(batch, params)
    tight = LLM(model_dir, device="cpu", log=None, num_kv_blocks=24, block_size=16,
                max_num_seqs=64)
    outs = tight.generate(batch, params)
    assert tight.engine.scheduler.num_preemptions > 0
    for a, b in zip(ample, outs):
        assert len(b.prompt_logprobs) == len(a.prompt_logprobs)
        assert [e.token_id for e in b.prompt_logprobs[1:]] == [e.token_id for e in a.prompt_logprobs[1:]]
        np.testing.assert_allclose([e.logprob for e in b.prompt_logprobs[1:]],
                                   [e.logprob for e in a.prompt_logprobs[1:]], atol=1e-5)


def test_requests_of_one_step_keep_their_own_k_as_arrays():
    """A step scores as many alternatives as its widest request asks; each request keeps
    its own, as the arrays the device gave (the engine makes no object per token), whole
    and in chunks of another request's width."""
    folder, prompt, expected = fixture("qwen3")
    llm = LLM(folder, device="cpu", log=None, max_num_batched_tokens=24)
    ks, lengths = (0, 4, 1), (10, len(prompt), 30)  # steps of 24 tokens mix them
    outs = llm.generate([prompt[:n] for n in lengths], [
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k) for k in ks])
    for k, n, out in zip(ks, lengths, outs):
        scores = out.prompt_scores
        assert scores.values.dtype == np.float32 and scores.ids.dtype == np.int32
        assert scores.values.shape == scores.ids.shape == (n - 1, 1 + k)
        np.testing.assert_array_equal(scores.ids[:, 0], prompt[1:n])
        np.testing.assert_allclose(scores.values[:, 0],
                                   expected[np.arange(n - 1), prompt[1:n]], atol=TOLERANCE)
        check(out.prompt_logprobs, prompt[:n], expected, k)


def test_prompt_scores_cross_a_pickle_as_arrays_and_make_their_entries_once():
    import pickle

    from cupy_llama.outputs import PromptScores, TokenLogprob
    values = np.array([[-1.5, -0.5, -1.5], [-0.25, -0.25, -2.0]], np.float32)
    ids = np.array([[7, 3, 7], [9, 9, 1]], np.int32)
    ranks = np.array([2, 1], np.int32)
    scores = pickle.loads(pickle.dumps(PromptScores(values, ids, ranks)))
    assert len(scores) == 3 and scores.k == 2
    entries = scores.entries()
    assert entries == [None, TokenLogprob(7, -1.5, [(3, -0.5), (7, -1.5)], 2),
                       TokenLogprob(9, -0.25, [(9, -0.25), (1, -2.0)], 1)]
    assert scores.entries() is entries  # made once, shared by whoever reads them
    assert all(type(entry.token_id) is int and type(entry.logprob) is float
               for entry in entries[1:])
    # what crosses is the arrays (no list of entries: made again where read)
    again = pickle.loads(pickle.dumps(scores))
    assert again._entries is None and again.entries() == entries


@pytest.mark.parametrize("value", [-1, 21, True, "2"])
def test_out_of_range_is_refused(value):
    with pytest.raises(RequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
