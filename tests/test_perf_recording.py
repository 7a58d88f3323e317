"""scripts/perf.py's kernel table records one decode step's kernel calls and replays them
label by label. The record must be the step itself: every kernel the step runs, and
nothing it does not (a decode step of a head-norm model hands its q/k norms, RoPE and
cache write to the attention kernel on the GPU, so no rope kernel runs there). Checked
by replaying the record over poisoned buffers: the logits come back bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import script_module
from test_cuda_ops import _gpu_available

FAMILIES = {
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], head_dim=64),
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], head_dim=128, query_pre_attn_scalar=128,
                   sliding_window=100, sliding_window_pattern=2),
}
GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not _gpu_available(), reason="needs CuPy and a CUDA GPU")])


def make_backend(kind: str, directory):
    from cupy_llama.models import model_for, read_config
    from cupy_llama.weights import open_checkpoint
    model = model_for(read_config(directory))
    with open_checkpoint(directory, model) as checkpoint:
        if kind == "cpu":
            from cupy_llama.backends.cpu import CpuBackend
            return CpuBackend(model, checkpoint, max_model_len=256, max_num_seqs=2,
                              block_size=16, num_kv_blocks=32)
        from cupy_llama.backends.cuda.backend import CudaBackend
        return CudaBackend(model, checkpoint, max_model_len=256, max_num_seqs=2,
                           max_num_batched_tokens=64, block_size=16, num_kv_blocks=32)


def host(array):
    return array.get() if hasattr(array, "get") else np.asarray(array)


def poison(buffers):
    """Every activation buffer of the step NaN (bf16 buffers by their bits)."""
    for array in buffers.values():
        if array.dtype == np.uint16:
            array.fill(0x7FC0)
        elif array.dtype.kind == "f":
            array.fill(np.nan)


@pytest.mark.parametrize("kind", ["cpu", GPU])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_kernel_table_records_the_step_it_times(tmp_path, kind, name):
    from cupy_llama.bench.random_model import make_random_model
    perf = script_module("perf")
    directory = make_random_model(tmp_path / name, "tiny", seed=0, hidden_size=256,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=384, vocab_size=10240,  # perf draws ids below 10,000
                                  tie_word_embeddings=False, **FAMILIES[name])
    backend = make_backend(kind, directory)
    for k_cache, v_cache in backend.kv_caches:  # perf's steps read a zeroed cache
        k_cache.fill(0)
        v_cache.fill(0)
    made, make = {}, backend.buffers  # the CPU backend's are new arrays at every call
    backend.buffers = lambda *sizes: made.setdefault(sizes, make(*sizes))
    num_seqs = 2
    batch = perf.decode_batch(num_seqs, 40, backend.block_size, 4, np.random.default_rng(0))
    logits, calls = perf.record_step(backend, batch)
    expected = host(logits).copy()
    assert np.isfinite(expected).all()
    labels = [label for label, _ in calls]
    assert labels.count("attention") == backend.config.num_hidden_layers
    if kind == "cuda":  # the decode step's head norms ride in attention
        assert "rope_and_cache" not in labels, labels
    buffers = backend.buffers(batch.num_tokens, num_seqs)
    poison(buffers)
    for _, call in calls[1:]:  # the record can fail: without its first call, NaN
        call()
    assert not np.isfinite(host(logits)).all()
    poison(buffers)
    for _, call in calls:
        call()
    np.testing.assert_array_equal(host(logits), expected)
    if kind == "cuda":
        backend.close()
