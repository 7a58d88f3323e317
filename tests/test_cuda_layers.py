"""The persistent decode kernel (cuda_src/layers.cu) against the same step run op by op.

Both run the same products on the same inputs, so the first layer's K/V must reach the
cache with the same bits; attention sums its keys with 8 warps instead of 4, so later
layers and the logits differ by single roundings (the eager tolerance of
test_cuda_graphs); and the float32 CPU reference holds to the self-test's bar. Also: the
kernel really ran (its phase-end times), it is deterministic, and steps it cannot take
run op by op. Needs CuPy and a CUDA GPU; skipped elsewhere."""
from __future__ import annotations

import numpy as np
import pytest

from test_cuda_graphs import rng  # noqa: F401  (fixture)
from test_cuda_graphs import (BLOCK_SIZE, EAGER_TOLERANCE, MAX_MODEL_LEN, REFERENCE_TOLERANCE,
                              Sequences, _gpu_available, assert_logits_close, prefill)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")]

NUM_SEQS = 10
NUM_KV_BLOCKS = NUM_SEQS * MAX_MODEL_LEN // BLOCK_SIZE


# head_dim 64 with 4 query heads per kv head (the Llama-3.2-1B layout); head_dim 128 with 2
@pytest.fixture(scope="module", params=[(8, 2, 512), (4, 2, 512)], ids=["d64_g4", "d128_g2"])
def model(request, tmp_path_factory):
    from cupy_llama.config import ModelConfig
    from cupy_llama.random_model import make_random_model
    from cupy_llama.weights import open_checkpoint
    heads, kv_heads, hidden = request.param
    directory = make_random_model(
        tmp_path_factory.mktemp("layers") / "model", "tiny", seed=1, hidden_size=hidden,
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=1024,
        vocab_size=1000, num_hidden_layers=3, tie_word_embeddings=False)
    config = ModelConfig.from_dir(directory)
    return config, open_checkpoint(directory, config)


@pytest.fixture
def backends(model):
    from cupy_llama.backends.cpu import CpuBackend
    from cupy_llama.backends.cuda import gemm, layers
    from cupy_llama.backends.cuda.backend import CudaBackend
    config, checkpoint = model
    previous = gemm.skinny_gemm()
    gemm.set_skinny_gemm("auto")
    layers.set_enabled(True)
    cpu = CpuBackend(config, checkpoint, max_model_len=MAX_MODEL_LEN, max_num_seqs=NUM_SEQS,
                     block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS)
    gpu = CudaBackend(config, checkpoint, max_model_len=MAX_MODEL_LEN, max_num_seqs=NUM_SEQS,
                      max_num_batched_tokens=256, block_size=BLOCK_SIZE,
                      num_kv_blocks=NUM_KV_BLOCKS, enforce_eager=True)
    yield config, cpu, gpu
    layers.set_enabled(True)
    layers.record_phase_ends(None)
    gemm.set_skinny_gemm(previous)


def _ready(backends, rng, lengths):
    config, cpu, gpu = backends
    prompts = [rng.integers(0, config.vocab_size, n) for n in lengths]
    seqs = Sequences(prompts, NUM_KV_BLOCKS, rng)
    prefill(cpu, gpu, config, seqs)
    return seqs


def _step(gpu, config, batch, fused: bool):
    """Logits of one eager forward pass, and the caches it left."""
    import cupy
    from cupy_llama.backends.cuda import layers
    from cupy_llama.model.llama import forward
    layers.set_enabled(fused)
    try:
        logits = cupy.asnumpy(forward(gpu, config, batch))
    finally:
        layers.set_enabled(True)
    return logits, cupy.asnumpy(gpu._kv)


# contexts: one key, one split's worth, several splits (up to 16 of 64 keys at 1,000)
LENGTHS = [1, 64, 65, 900, 300, 17, 129, 700]


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_matches_the_op_by_op_step(backends, rng, rows):
    import cupy
    from cupy_llama.backends.cuda import layers
    config, cpu, gpu = backends
    seqs = _ready(backends, rng, LENGTHS)
    members = list(rng.permutation(len(LENGTHS))[:rows])
    for step in range(3):
        counts = {int(b): 1 for b in members}
        batch = seqs.batch(counts)
        what = f"{rows} rows, step {step}"
        before = cupy.asnumpy(gpu._kv)
        timings = cupy.zeros(config.num_hidden_layers * layers.LAYER_PHASES + 1, np.uint64)
        layers.record_phase_ends(timings)
        fused, fused_kv = _step(gpu, config, batch, fused=True)
        layers.record_phase_ends(None)
        ends = cupy.asnumpy(timings).astype(np.int64)
        assert (ends > 0).all() and (np.diff(ends) >= 0).all(), f"{what}: phase ends {ends}"
        plain, plain_kv = _step(gpu, config, batch, fused=False)  # rewrites the same slots
        slots = np.flatnonzero((fused_kv != before).any(axis=(0, 1, 4, 5)).reshape(-1))
        expected_slots = sorted(int(s) for s in batch.slot_mapping)
        assert list(slots) == expected_slots, f"{what}: wrote slots {slots}, not {expected_slots}"
        # layer 0's K/V come from the same product on the same input: the same bits
        np.testing.assert_array_equal(fused_kv[0], plain_kv[0], err_msg=f"{what}: layer 0 K/V")
        assert_logits_close(fused, plain, EAGER_TOLERANCE, f"{what}: one kernel vs op by op")
        expected = cpu.forward(config, batch)
        assert_logits_close(fused, expected, REFERENCE_TOLERANCE, f"{what}: one kernel vs CPU")
        seqs.advance(counts, np.argmax(expected, axis=-1))


def test_is_deterministic(backends, rng):
    config, _, gpu = backends
    seqs = _ready(backends, rng, [500, 40, 3])
    batch = seqs.batch({0: 1, 1: 1, 2: 1})
    first, first_kv = _step(gpu, config, batch, fused=True)
    for _ in range(3):  # rewrites the same slots with the same values
        again, again_kv = _step(gpu, config, batch, fused=True)
        np.testing.assert_array_equal(again, first)
        np.testing.assert_array_equal(again_kv, first_kv)


def test_steps_it_cannot_take_run_op_by_op(backends, rng):
    import cupy
    from cupy_llama.backends.cuda import gemm, layers
    config, cpu, gpu = backends
    seqs = _ready(backends, rng, [30] * 9)
    timings = cupy.zeros(config.num_hidden_layers * layers.LAYER_PHASES + 1, np.uint64)
    layers.record_phase_ends(timings)
    nine = seqs.batch({b: 1 for b in range(9)})  # past MAX_ROWS
    assert_logits_close(_step(gpu, config, nine, fused=True)[0], cpu.forward(config, nine),
                        REFERENCE_TOLERANCE, "nine rows")
    gemm.set_skinny_gemm("cublas")  # asks for cuBLAS products everywhere
    one = seqs.batch({0: 1})
    _step(gpu, config, one, fused=True)
    assert not cupy.asnumpy(timings).any(), "the persistent kernel ran where it must not"
    gemm.set_skinny_gemm("auto")
    _step(gpu, config, one, fused=True)
    assert cupy.asnumpy(timings).all(), "the persistent kernel did not run for one row"
