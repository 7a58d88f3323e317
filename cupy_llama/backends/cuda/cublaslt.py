"""FP8 products of many rows on the tensor cores through cuBLASLt, called with ctypes (CuPy
has no cuBLASLt binding): out = (x quantized per row to e4m3) @ (the weight's e4m3 codes)^T,
each product scaled by its weight row's scale and its x row's scale (cuBLASLt's
"outer vector" scaling, cuBLAS 12.9 and newer), summed in float32 and written as bf16 or
added to a float32 out (docs/ARCHITECTURE.md, "FP8 weights").

Row-major out [M, N] = x [M, K] @ W [N, K]^T is column-major out^T = W^T' x': A is the
weight read as [K, N] column-major and transposed, B is x as [K, M] column-major, the
"TN" layout FP8 products need. Descriptors and the chosen algorithm are made once per
shape; the workspace is fixed, so a product can be captured into a CUDA graph.
`FP8Lt.available()` is False where the library or the GPU cannot (the caller then takes
the dequantized weight through cuBLAS)."""
from __future__ import annotations

import ctypes

import numpy as np

from . import launch

CUDA_R_32F, CUDA_R_16BF, CUDA_R_8F_E4M3 = 0, 14, 28
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB = 3, 4
DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER = 17, 18
DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 31, 32
SCALE_OUTER_VEC_32F = 3
PREF_MAX_WORKSPACE_BYTES = 1
WORKSPACE_BYTES = 32 << 20


class HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t),
                ("state", ctypes.c_int), ("waves_count", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


class _Shape:
    """The descriptors and algorithm of one product shape."""

    def __init__(self, lt, m_rows: int, n: int, k: int, out_type: int):
        self.desc = lt.new_desc()
        for attribute, value in ((DESC_TRANSA, CUBLAS_OP_T), (DESC_TRANSB, CUBLAS_OP_N),
                                 (DESC_A_SCALE_MODE, SCALE_OUTER_VEC_32F),
                                 (DESC_B_SCALE_MODE, SCALE_OUTER_VEC_32F)):
            lt.set_int(self.desc, attribute, value)
        self.a = lt.layout(CUDA_R_8F_E4M3, k, n, k)   # the weight, [K, N] column-major
        self.b = lt.layout(CUDA_R_8F_E4M3, k, m_rows, k)  # x, [K, M] column-major
        self.d = lt.layout(out_type, n, m_rows, n)    # out, [N, M] column-major
        self.algo = lt.best_algo(self.desc, self.a, self.b, self.d)


class FP8Lt:
    """cuBLASLt's FP8 products on one handle and workspace."""

    def __init__(self):
        import cupy
        path = launch.loaded_library_path("cublasLt")
        if path is None:
            cupy.cuda.device.get_cublas_handle()  # CuPy's cuBLAS loads cuBLASLt with it
            path = launch.loaded_library_path("cublasLt") or "libcublasLt.so"
        self._lib = lib = ctypes.CDLL(path)
        c_ptr, c_int, c_size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        signatures = {
            "cublasLtCreate": [ctypes.POINTER(c_ptr)],
            "cublasLtMatmulDescCreate": [ctypes.POINTER(c_ptr), c_int, c_int],
            "cublasLtMatmulDescSetAttribute": [c_ptr, c_int, c_ptr, c_size],
            "cublasLtMatrixLayoutCreate": [ctypes.POINTER(c_ptr), c_int, ctypes.c_uint64,
                                           ctypes.c_uint64, ctypes.c_int64],
            "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(c_ptr)],
            "cublasLtMatmulPreferenceSetAttribute": [c_ptr, c_int, c_ptr, c_size],
            "cublasLtMatmulAlgoGetHeuristic": [c_ptr, c_ptr, c_ptr, c_ptr, c_ptr, c_ptr, c_ptr,
                                               c_int, ctypes.POINTER(HeuristicResult),
                                               ctypes.POINTER(c_int)],
            "cublasLtMatmul": [c_ptr, c_ptr, c_ptr, c_ptr, c_ptr, c_ptr, c_ptr, c_ptr, c_ptr,
                               c_ptr, c_ptr, c_ptr, c_ptr, c_ptr, c_size, c_ptr],
        }
        for name, argtypes in signatures.items():
            function = getattr(lib, name)
            function.argtypes, function.restype = argtypes, c_int
        self.handle = c_ptr()
        self._check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = cupy.empty(WORKSPACE_BYTES, np.uint8)
        self._preference = c_ptr()
        self._check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self._preference)),
                    "cublasLtMatmulPreferenceCreate")
        size = ctypes.c_uint64(WORKSPACE_BYTES)
        self._check(lib.cublasLtMatmulPreferenceSetAttribute(
            self._preference, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size), ctypes.sizeof(size)),
            "cublasLtMatmulPreferenceSetAttribute")
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._shapes = {}  # (m, n, k, out type) -> _Shape

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def new_desc(self):
        desc = ctypes.c_void_p()
        self._check(self._lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F,
                                                       CUDA_R_32F), "cublasLtMatmulDescCreate")
        return desc

    def set_int(self, desc, attribute: int, value: int) -> None:
        value = ctypes.c_int32(value)
        self._check(self._lib.cublasLtMatmulDescSetAttribute(
            desc, attribute, ctypes.byref(value), ctypes.sizeof(value)),
            f"cublasLtMatmulDescSetAttribute({attribute})")

    def set_pointer(self, desc, attribute: int, pointer: int) -> None:
        value = ctypes.c_void_p(pointer)
        self._check(self._lib.cublasLtMatmulDescSetAttribute(
            desc, attribute, ctypes.byref(value), ctypes.sizeof(value)),
            f"cublasLtMatmulDescSetAttribute({attribute})")

    def layout(self, data_type: int, rows: int, cols: int, ld: int):
        layout = ctypes.c_void_p()
        self._check(self._lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), data_type, rows,
                                                         cols, ld), "cublasLtMatrixLayoutCreate")
        return layout

    def best_algo(self, desc, a, b, d) -> HeuristicResult:
        result, count = HeuristicResult(), ctypes.c_int(0)
        self._check(self._lib.cublasLtMatmulAlgoGetHeuristic(
            self.handle, desc, a, b, d, d, self._preference, 1, ctypes.byref(result),
            ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
        if count.value < 1 or result.state != 0:
            raise RuntimeError("cuBLASLt has no FP8 algorithm for this product")
        return result

    def shape(self, m_rows: int, n: int, k: int, out_f32: bool) -> _Shape:
        key = (m_rows, n, k, out_f32)
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = _Shape(self, m_rows, n, k,
                                               CUDA_R_32F if out_f32 else CUDA_R_16BF)
        return shape

    def matmul(self, codes, codes_scale, weight, out, accumulate: bool, stream: int) -> None:
        """out [M, N] (bf16, or float32: accumulate adds to it) = codes [M, K] e4m3 with row
        scales codes_scale [M] against the Fp8Weight [N, K]."""
        m_rows, k = codes.shape
        n = weight.data.shape[0]
        shape = self.shape(m_rows, n, k, out.dtype == np.float32)
        self.set_pointer(shape.desc, DESC_A_SCALE_POINTER, weight.scale.data.ptr)
        self.set_pointer(shape.desc, DESC_B_SCALE_POINTER, codes_scale.data.ptr)
        beta = self._one if accumulate else self._zero
        self._check(self._lib.cublasLtMatmul(
            self.handle, shape.desc, ctypes.byref(self._one), weight.data.data.ptr, shape.a,
            codes.data.ptr, shape.b, ctypes.byref(beta), out.data.ptr, shape.d, out.data.ptr,
            shape.d, ctypes.byref(shape.algo, 0), self.workspace.data.ptr, WORKSPACE_BYTES,
            stream), "cublasLtMatmul")


_lt = None  # FP8Lt once made; False where it cannot be


def fp8_lt() -> FP8Lt | None:
    """This process's cuBLASLt FP8 products, or None where the library or the GPU cannot
    run them (it needs sm_89 or newer)."""
    global _lt
    if _lt is None:
        try:
            import cupy
            capability = int(cupy.cuda.Device().compute_capability)
            _lt = FP8Lt() if capability >= 89 else False
        except (OSError, AttributeError, RuntimeError):
            _lt = False
    return _lt or None
