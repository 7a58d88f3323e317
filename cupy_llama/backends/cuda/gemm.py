"""out = x @ weight.T: cuBLAS (bf16 in, fp32 compute, bf16 or fp32 out) or, for the skinny
products of decode (at most 16 rows), the custom kernels of gemv.cu.

cuBLAS is called through ctypes on a handle of this module's own: CuPy's binding refuses
every cuBLAS call while a stream is being captured into a CUDA graph (it checks in
setStream). The handle gets a fixed workspace, set again after each stream change (cuBLAS
resets it there), so captured products never allocate. Where the library cannot be found
through ctypes, eager products fall back to CuPy's binding and graphs stay off.

Which kernel serves the skinny products is a switch, so both can be timed in one process:
`set_skinny_gemm("custom" | "cublas")`, or the CUPY_LLAMA_SKINNY_GEMM environment variable."""
from __future__ import annotations

import ctypes
import os
import re

import numpy as np

from .kernels import BF16, F32, check, get_kernel, i32

CUDA_R_32F = 0
CUDA_R_16BF = 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
CUBLAS_GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 << 20  # cuBLAS's recommendation for Hopper

# skinny products: variant rows -> weight rows per warp (gemv.cu DEFINE_GEMV lines)
GEMV_VARIANTS = {1: 2, 2: 2, 4: 2, 8: 4, 16: 4}
GEMV_WARPS = 4
SKINNY_MAX_ROWS = max(GEMV_VARIANTS)
SKINNY_CHOICES = ("custom", "cublas")

# alpha and beta live in host memory for the whole process (pointer mode host)
_ONE = np.ones(1, np.float32)
_ZERO = np.zeros(1, np.float32)

_skinny = os.environ.get("CUPY_LLAMA_SKINNY_GEMM", "cublas")
_cublas = None  # _CublasLibrary once loaded; False when ctypes could not load it


def set_skinny_gemm(choice: str) -> None:
    """Who computes products with at most SKINNY_MAX_ROWS rows: "custom" or "cublas"."""
    global _skinny
    if choice not in SKINNY_CHOICES:
        raise ValueError(f"skinny GEMM must be one of {SKINNY_CHOICES}, got {choice!r}")
    _skinny = choice


def skinny_gemm() -> str:
    return _skinny if _skinny in SKINNY_CHOICES else "cublas"


def linear(x, weight, out):
    """x [M, K] bf16, weight [N, K] bf16, out [M, N] bf16 or float32, all row-major."""
    m_rows, k = check("x", x, BF16, ndim=2).shape
    n_cols = check("weight", weight, BF16, shape=(None, k)).shape[0]
    if out.dtype not in (BF16, F32):
        raise ValueError(f"out: expected dtype uint16 (bf16) or float32, got {out.dtype.name}")
    check("out", out, out.dtype, shape=(m_rows, n_cols))
    if m_rows == 0 or n_cols == 0:
        return
    if skinny_gemm() == "custom" and gemv_supported(x, weight, out):
        _launch_gemv(x, weight, out)
    else:
        cublas_linear(x, weight, out)


# ---------------------------------------------------------------- custom skinny kernels

def gemv_supported(x, weight, out) -> bool:
    """The custom kernels need at most 16 rows, K % 8 == 0 and 16-byte aligned rows."""
    m_rows, k = x.shape
    return (m_rows <= SKINNY_MAX_ROWS and k % 8 == 0 and x.data.ptr % 16 == 0
            and weight.data.ptr % 16 == 0)


def gemv(x, weight, out):
    """The custom kernel whatever the switch says (tests, timing); same shapes as linear."""
    m_rows, k = check("x", x, BF16, ndim=2).shape
    n_cols = check("weight", weight, BF16, shape=(None, k)).shape[0]
    if out.dtype not in (BF16, F32):
        raise ValueError(f"out: expected dtype uint16 (bf16) or float32, got {out.dtype.name}")
    check("out", out, out.dtype, shape=(m_rows, n_cols))
    if not gemv_supported(x, weight, out):
        raise ValueError(f"gemv: needs at most {SKINNY_MAX_ROWS} rows, K a multiple of 8 and "
                         f"16-byte aligned x and weight (got x {x.shape}, weight {weight.shape})")
    if m_rows and n_cols:
        _launch_gemv(x, weight, out)


def _launch_gemv(x, weight, out):
    m_rows, k = x.shape
    n_cols = weight.shape[0]
    variant = next(v for v in sorted(GEMV_VARIANTS) if v >= m_rows)
    rows_per_block = GEMV_WARPS * GEMV_VARIANTS[variant]
    get_kernel("gemv", f"gemv_m{variant}")(
        (-(-n_cols // rows_per_block),), (GEMV_WARPS * 32,),
        (x, weight, out, i32(m_rows), i32(n_cols), i32(k), i32(out.dtype == F32)))


# ------------------------------------------------------------------ cuBLAS via ctypes

def cublas_linear(x, weight, out):
    """Row-major out = x W^T is column-major out^T = W x^T: op(A) = W^T read as [K, N]
    column-major transposed (transa=T, lda=K), B = x^T ([K, M] column-major, ldb=K),
    m=N, n=M, ldc=N."""
    import cupy
    m_rows, k = x.shape
    n_cols = weight.shape[0]
    out_type = CUDA_R_16BF if out.dtype == BF16 else CUDA_R_32F
    args = (CUBLAS_OP_T, CUBLAS_OP_N, n_cols, m_rows, k,
            _ONE.ctypes.data, weight.data.ptr, CUDA_R_16BF, k, x.data.ptr, CUDA_R_16BF, k,
            _ZERO.ctypes.data, out.data.ptr, out_type, n_cols,
            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
    library = cublas_library()
    stream = cupy.cuda.get_current_stream().ptr
    if library is not None:
        library.gemm(stream, *args)
        return
    from cupy_backends.cuda.libs import cublas
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setStream(handle, stream)  # raises NotImplementedError while capturing
    cublas.setPointerMode(handle, 0)  # host
    cublas.gemmEx(handle, *args)


def cublas_library():
    """The ctypes cuBLAS handle, or None where the library could not be loaded."""
    global _cublas
    if _cublas is None:
        try:
            _cublas = _CublasLibrary()
        except (OSError, AttributeError, RuntimeError):
            _cublas = False
    return _cublas or None


class _CublasLibrary:
    def __init__(self):
        import cupy
        cupy.cuda.device.get_cublas_handle()  # CuPy loads libcublas into the process
        lib = ctypes.CDLL(_loaded_library_path())
        self._lib = lib
        handle = ctypes.c_void_p()
        self._check(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        self.handle = handle
        self.workspace = cupy.empty(WORKSPACE_BYTES, np.uint8)  # lives as long as the handle
        self._set_stream = lib.cublasSetStream_v2
        self._set_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._set_workspace = getattr(lib, "cublasSetWorkspace_v2", None)
        if self._set_workspace is not None:
            self._set_workspace.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        self._gemm = lib.cublasGemmEx
        c_int, c_ptr = ctypes.c_int, ctypes.c_void_p
        self._gemm.argtypes = [c_ptr, c_int, c_int, c_int, c_int, c_int, c_ptr, c_ptr, c_int,
                               c_int, c_ptr, c_int, c_int, c_ptr, c_ptr, c_int, c_int, c_int,
                               c_int]
        self._gemm.restype = c_int
        self._stream = None
        self.use_stream(cupy.cuda.get_current_stream().ptr)

    def use_stream(self, stream: int) -> None:
        if stream == self._stream:
            return
        self._check(self._set_stream(self.handle, ctypes.c_void_p(stream)), "cublasSetStream")
        if self._set_workspace is not None:  # setStream resets the workspace
            self._check(self._set_workspace(self.handle, ctypes.c_void_p(self.workspace.data.ptr),
                                            ctypes.c_size_t(WORKSPACE_BYTES)), "cublasSetWorkspace")
        self._stream = stream

    def gemm(self, stream: int, *args) -> None:
        self.use_stream(stream)
        self._check(self._gemm(self.handle, *args), "cublasGemmEx")

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")


def _loaded_library_path() -> str:
    """The libcublas CuPy loaded (so both use one copy), else the first soname found."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                if re.search(r"/libcublas\.so(\.\d+)*$", path):
                    return path
    except OSError:
        pass
    for name in ("libcublas.so.13", "libcublas.so.12", "libcublas.so.11", "libcublas.so"):
        try:
            ctypes.CDLL(name)
            return name
        except OSError:
            continue
    raise OSError("libcublas not found")
