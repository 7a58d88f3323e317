"""out = x @ weight.T on cuBLAS (bf16 in, fp32 compute, bf16 or fp32 out), through the
low-level `cupy_backends.cuda.libs.cublas.gemmEx` binding (cupy.cublas rejects bf16)."""
from __future__ import annotations

import numpy as np

from .kernels import BF16, F32, check

CUDA_R_32F = 0
CUDA_R_16BF = 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_POINTER_MODE_HOST = 0

# alpha and beta live in host memory for the whole process (pointer mode host)
_ONE = np.ones(1, np.float32)
_ZERO = np.zeros(1, np.float32)


def linear(x, weight, out):
    """x [M, K] bf16, weight [N, K] bf16, out [M, N] bf16 or float32, all row-major.

    Row-major out = x W^T is column-major out^T = W x^T: op(A) = W^T read as [K, N]
    column-major transposed (transa=T, lda=K), B = x^T ([K, M] column-major, ldb=K),
    m=N, n=M, ldc=N."""
    import cupy
    from cupy_backends.cuda.libs import cublas

    m_rows, k = check("x", x, BF16, ndim=2).shape
    n_cols = check("weight", weight, BF16, shape=(None, k)).shape[0]
    if out.dtype not in (BF16, F32):
        raise ValueError(f"out: expected dtype uint16 (bf16) or float32, got {out.dtype.name}")
    check("out", out, out.dtype, shape=(m_rows, n_cols))
    if m_rows == 0 or n_cols == 0:
        return
    out_type = CUDA_R_16BF if out.dtype == BF16 else CUDA_R_32F
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)
    cublas.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)
    cublas.gemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n_cols, m_rows, k,
                  _ONE.ctypes.data, weight.data.ptr, CUDA_R_16BF, k,
                  x.data.ptr, CUDA_R_16BF, k,
                  _ZERO.ctypes.data, out.data.ptr, out_type, n_cols,
                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
