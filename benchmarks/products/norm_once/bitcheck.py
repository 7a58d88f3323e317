"""The normed skinny products of fixed inputs, written to one .npz, to compare two trees'
kernels bit for bit (NOTES change 48). Run it in each tree, then compare:

    PYTHONPATH=<tree A> python3 bitcheck.py a.npz
    PYTHONPATH=<tree B> python3 bitcheck.py b.npz
    python3 bitcheck.py --compare a.npz b.npz

Needs CuPy and a CUDA GPU for the first two."""
import sys

import numpy as np

SHAPES = ((2048, 3072), (1024, 6144), (1152, 1536), (1536, 2048), (64, 48))  # (K, N)
ROWS = (1, 2, 3, 4, 5, 8, 16)


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits by truncation (fixed inputs, not a rounding under test)."""
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def write(path: str) -> None:
    import cupy as cp
    from cupy_llama.backends.cuda import gemm
    rng = np.random.default_rng(0)
    products = gemm.Products("mma")
    results = {}
    for k, n in SHAPES:
        w = cp.asarray(bf16_bits(rng.standard_normal((n, k)) * 0.02))
        norm = cp.asarray(bf16_bits(rng.standard_normal(k) * 0.1 + 1))
        for m in ROWS:
            x = cp.asarray(rng.standard_normal((m, k)).astype(np.float32) * 3)
            out = cp.empty((m, n), np.float32)
            assert products.norm_linear(x, norm, 1e-5, w, out)
            act = cp.empty((m, n // 2), np.uint16)
            assert products.norm_gate_up_act(x, norm, 1e-5, w, act)
            results[f"lin_{k}_{n}_{m}"] = cp.asnumpy(out)
            results[f"glu_{k}_{n}_{m}"] = cp.asnumpy(act)
    np.savez(path, **results)
    print("wrote", len(results))


def compare(a_path: str, b_path: str) -> None:
    a, b = np.load(a_path), np.load(b_path)
    differ = [key for key in a.files if not np.array_equal(a[key], b[key])]
    print("bit check:", len(a.files), "arrays,", len(differ), "differ", differ[:10])


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        write(sys.argv[1])
