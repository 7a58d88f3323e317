"""The float32 residual stream on the GPU: the embedding lookup into float32 rows against
the NumPy reference (fresh random inputs, poisoned outputs). RMSNorm of float32 input is
in test_cuda_ops.py (test_rms_norm), the residual add rides in the products:
test_cuda_fused.py."""
import numpy as np
import pytest

from test_cuda_ops import cp, poisoned, random_bf16, rng  # noqa: F401  (cp, rng: fixtures)
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


def test_model_buffers_keep_the_residual_in_float32():
    from cupy_llama.backends.cuda.backend import buffer_dtype
    assert buffer_dtype("residual") == np.float32 and buffer_dtype("last_residual") == np.float32
    assert buffer_dtype("h") == np.uint16
