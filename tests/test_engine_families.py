"""The engine's guarantees for the families beside Llama, on tiny random Qwen3 and Gemma 3
models whose sliding windows (24 and 32 tokens) the prompts and outputs outgrow: preemption
and batch composition change no greedy output, prefix caching on and off agree, n samples
fork after one prefill, and log-probabilities are the model's log-softmax."""
import numpy as np
import pytest
from conftest import assert_all_blocks_free, prompt_tokens_computed
from test_logprobs import reference_log_softmax

from cupy_llama import LLM, SamplingParams
from cupy_llama.bench.random_model import make_random_model

FAMILIES = {
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], use_sliding_window=True,
                  sliding_window=24, max_window_layers=1),
    "gemma3": dict(architectures=["Gemma3ForCausalLM"]),  # window 32, every 2nd layer full
}
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model_dir(request, tmp_path_factory):
    return make_random_model(tmp_path_factory.mktemp(request.param) / "model", "tiny", seed=0,
                             std=0.15, **FAMILIES[request.param])


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, device="cpu", log=None)


def prompts(count: int, seed: int, min_len: int, max_len: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, rng.integers(min_len, max_len + 1)).tolist() for _ in range(count)]


def test_the_window_is_outgrown(llm):
    assert llm.config.sliding_window in (24, 32)
    assert set(llm.config.layer_types) == {"full_attention", "sliding_attention"}


def test_preemption_changes_nothing(model_dir, llm):
    batch = prompts(20, seed=1, min_len=20, max_len=60)
    params = SamplingParams(max_tokens=24, **GREEDY)
    ample = llm.generate(batch, params)
    small = LLM(model_dir, device="cpu", log=None, num_kv_blocks=24, block_size=16,
                max_num_seqs=32)
    tight = small.generate(batch, params)
    assert small.stats().num_preemptions > 0, "the pool was big enough; no preemption"
    assert [o.token_ids for o in tight] == [o.token_ids for o in ample]
    assert_all_blocks_free(small)


def test_batch_composition_changes_nothing(model_dir):
    llm = LLM(model_dir, device="cpu", log=None, max_num_batched_tokens=48, max_num_seqs=16)
    batch = prompts(8, seed=2, min_len=1, max_len=100)
    together = llm.generate(batch, SamplingParams(max_tokens=20, **GREEDY))
    for prompt, output in list(zip(batch, together))[:4]:
        assert output.token_ids == llm.generate(prompt, SamplingParams(max_tokens=20, **GREEDY)).token_ids


def test_prefix_caching_on_and_off_agree(model_dir, llm):
    shared = prompts(1, seed=3, min_len=70, max_len=70)[0]
    batch = [shared + tail for tail in prompts(4, seed=4, min_len=3, max_len=20)]
    params = SamplingParams(max_tokens=20, **GREEDY)
    uncached = LLM(model_dir, device="cpu", log=None, enable_prefix_caching=False)
    cached = [llm.generate(batch[0], params)] + llm.generate(batch[1:], params)
    assert [o.num_cached_tokens for o in cached[1:]] == [64] * 3  # past the window
    assert [o.token_ids for o in cached] == [o.token_ids for o in uncached.generate(batch, params)]


def test_n_samples_fork_after_one_prefill(llm):
    prompt = prompts(1, seed=5, min_len=50, max_len=50)[0]
    with prompt_tokens_computed(llm) as counts:
        greedy = llm.generate(prompt, SamplingParams(max_tokens=16, n=3, **GREEDY))
    assert [o.index for o in greedy] == [0, 1, 2]
    assert greedy[0].token_ids == greedy[1].token_ids == greedy[2].token_ids
    assert sum(counts.values()) < 2 * len(prompt)  # samples 1 and 2 computed their tails only
    seeded = SamplingParams(temperature=1.0, max_tokens=16, n=3, seed=7, ignore_eos=True)
    first, again = llm.generate(prompt, seeded), llm.generate(prompt, seeded)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert len({tuple(o.token_ids) for o in first}) > 1


def test_logprobs_are_the_log_softmax(llm):
    prompt = prompts(1, seed=6, min_len=40, max_len=40)[0]
    out = llm.generate(prompt, SamplingParams(max_tokens=12, logprobs=3, **GREEDY))
    expected = reference_log_softmax(llm, prompt + out.token_ids, len(prompt))
    for position, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert abs(entry.logprob - expected[position][token]) < 1e-4, position
        assert [i for i, _ in entry.top] == np.argsort(-expected[position], kind="stable")[:3].tolist()
