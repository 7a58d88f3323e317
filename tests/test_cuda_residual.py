"""The float32 residual stream on the GPU: the embedding lookup into float32 rows and
RMSNorm of float32 input, each against the NumPy reference (fresh random inputs, poisoned
outputs). The residual add itself rides in the products: test_cuda_fused.py."""
import numpy as np
import pytest

from test_cuda_ops import REF, assert_close, cp, poisoned, random_bf16, rng, to_float  # noqa: F401
from test_cuda_ops import pytestmark  # noqa: F401  (gpu marker, skipped without a GPU)


@pytest.mark.parametrize("num_tokens", [1, 17, 129])
def test_embedding_into_float32(cp, rng, num_tokens):
    from cupy_llama.backends.cuda import elementwise
    vocab, hidden = 1000, 576
    table_bits, table = random_bf16(rng, (vocab, hidden))
    ids = rng.integers(0, vocab, num_tokens).astype(np.int32)
    ids[0] = vocab + 3  # out of range: NaN row
    out = poisoned(cp, (num_tokens, hidden), np.float32)
    elementwise.embedding(cp.asarray(ids), cp.asarray(table_bits), out)
    got = cp.asnumpy(out)
    assert np.isnan(got[0]).all()
    np.testing.assert_array_equal(got[1:], table[ids[1:]])  # bf16 -> float32 is exact


@pytest.mark.parametrize("hidden", [64, 576, 2048])
@pytest.mark.parametrize("num_tokens", [1, 17, 129])
def test_rms_norm_of_float32_input(cp, rng, num_tokens, hidden):
    from cupy_llama.backends.cuda import elementwise
    x = rng.standard_normal((num_tokens, hidden), dtype=np.float32) * 3
    w_bits, w = random_bf16(rng, (hidden,))
    expected = np.empty_like(x)
    REF.rms_norm(x, w, 1e-5, expected)
    out = poisoned(cp, x.shape)
    elementwise.rms_norm(cp.asarray(x), cp.asarray(w_bits), 1e-5, out)
    assert_close(to_float(cp, out), expected, 1e-2, 1e-2, "rms_norm (float32 input)")


def test_model_buffers_keep_the_residual_in_float32():
    from cupy_llama.backends.cuda.backend import buffer_dtype
    assert buffer_dtype("residual") == np.float32 and buffer_dtype("last_residual") == np.float32
    assert buffer_dtype("h") == np.uint16
