"""Prefix caching on the NumPy backend."""

BLOCK = 16


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
