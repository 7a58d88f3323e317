"""The NumPy backend's memory: a KV cache sized for what the engine can use, whose pages
are touched only as blocks come into use (its never-written slots still read NaN)."""
import json
import subprocess
import sys

import numpy as np

from cupy_llama import LLM, SamplingParams
from cupy_llama.backends.cpu import DEFAULT_CPU_KV_BYTES


def test_blocks_are_filled_with_nan_as_steps_first_name_them(model_dir):
    llm = LLM(model_dir, device="cpu", log=None, num_kv_blocks=64)
    backend = llm.backend
    assert not backend.nan_filled.any()
    out = llm.generate([1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    used = np.flatnonzero(backend.nan_filled)
    assert used.tolist() == [0, 1]  # 25 tokens of 16-token blocks, the first free blocks
    written = len(out.prompt_token_ids) + len(out.token_ids) - 1  # the last token's K/V never ran
    for cache in backend.kv_caches[0]:
        slots = cache[used].reshape(2 * 16, -1)
        assert np.isfinite(slots[:written]).all() and np.isnan(slots[written:]).all()


def test_a_large_cache_costs_no_memory_until_used(model_dir):
    """A cache planned at DEFAULT_CPU_KV_BYTES leaves the process's peak memory far below
    it after loading and a short generation (its pages are not written up front)."""
    code = f"""
import json, resource
from cupy_llama import LLM, SamplingParams
llm = LLM({str(model_dir)!r}, device="cpu", log=None, max_num_seqs=4096)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
llm.generate("hello", SamplingParams(temperature=0, max_tokens=4))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({{"kv": llm.backend.kv_cache_bytes, "before": before, "after": after}}))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    assert numbers["kv"] == DEFAULT_CPU_KV_BYTES  # 4096 sequences of 4096 tokens, capped
    assert numbers["after"] < numbers["kv"] / 4, numbers


def test_the_reference_attention_uses_matrix_products(monkeypatch):
    """Prefill attention on the CPU goes through BLAS (matmul), not einsum, which ran 2.5
    times slower on the same shapes and made a 1,000-token prompt take seconds."""
    from cupy_llama.backends.numpy_ops import NumpyOps
    from cupy_llama.interface import ForwardBatch

    def no_einsum(*args, **kwargs):
        raise AssertionError("np.einsum in the reference attention")

    monkeypatch.setattr(np, "einsum", no_einsum)
    rng = np.random.default_rng(0)
    n, heads, kv_heads, d, block = 40, 6, 2, 16, 16
    cache = rng.standard_normal((4, block, kv_heads, d), dtype=np.float32)
    q = rng.standard_normal((n, heads, d), dtype=np.float32)
    batch = ForwardBatch(token_ids=np.zeros(n, np.int32), positions=np.arange(n, dtype=np.int32),
                         slot_mapping=np.full(n, -1, np.int32),
                         query_start_loc=np.array([0, n], np.int32), seq_lens=np.array([n], np.int32),
                         block_tables=np.arange(4, dtype=np.int32)[None], max_query_len=n,
                         max_seq_len=n)
    out = np.empty((n, heads * d), np.float32)
    NumpyOps().attention(q, cache, cache, batch, d ** -0.5, out)
    # the last row attends to every key: the mean of softmax-weighted values, finite
    assert np.isfinite(out).all()


def test_filters_apply_in_vllms_order():
    """min-p, then top-k, then top-p over what those kept (vLLM's sampler): with
    probabilities .5 / .3 / .2, min-p 0.5 keeps .5 and .3, and top-p 0.6 of their mass
    (0.48) keeps .5 alone; top-p first (of the whole mass) would keep .5 and .3."""
    from cupy_llama.backends.numpy_ops import filtered_probs
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    np.testing.assert_allclose(filtered_probs(logits, 1.0, 0, 0.6, 0.5), [1, 0, 0])
    np.testing.assert_allclose(filtered_probs(logits, 1.0, 0, 0.6, 0.0), [0.625, 0.375, 0])
    # top-k among the tokens min-p kept, and top-p's share of the mass both kept
    logits = np.log(np.array([0.4, 0.25, 0.2, 0.15]))
    np.testing.assert_allclose(filtered_probs(logits, 1.0, 3, 0.7, 0.45),
                               [0.4 / 0.65, 0.25 / 0.65, 0, 0])
