"""FP8 products of many rows on the tensor cores through cuBLASLt, called with ctypes (CuPy
has no cuBLASLt binding): acc = (x's e4m3 codes) @ (the weight's e4m3 codes)^T, summed in
float32 (docs/ARCHITECTURE.md, "FP8 weights"). The scales are the caller's (fp8.cu
scale_product_kernel): cuBLASLt's per-row ("outer vector") scales are refused on Hopper
by cuBLAS 13.1, and its scalar ones cannot say a scale per row.

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
PREF_MAX_WORKSPACE_BYTES = 1
WORKSPACE_BYTES = 32 << 20


class HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t),
                ("state", ctypes.c_int), ("waves_count", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


def load_library():
    """The cuBLASLt that CuPy's cuBLAS loaded (so both use one copy), its functions typed."""
    import cupy
    path = launch.loaded_library_path("cublasLt")
    if path is None:
        cupy.cuda.device.get_cublas_handle()  # CuPy's cuBLAS loads cuBLASLt with it
        path = launch.loaded_library_path("cublasLt") or "libcublasLt.so"
    lib = ctypes.CDLL(path)
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
    return lib


class _Shape:
    """The descriptors and algorithm of one product shape."""

    def __init__(self, lt, m_rows: int, n: int, k: int):
        self.desc = lt.new_desc()
        for attribute, value in ((DESC_TRANSA, CUBLAS_OP_T), (DESC_TRANSB, CUBLAS_OP_N)):
            lt.set_int(self.desc, attribute, value)
        self.a = lt.layout(CUDA_R_8F_E4M3, k, n, k)   # the weight, [K, N] column-major
        self.b = lt.layout(CUDA_R_8F_E4M3, k, m_rows, k)  # x, [K, M] column-major
        self.d = lt.layout(CUDA_R_32F, n, m_rows, n)  # acc, [N, M] column-major
        self.algo = lt.best_algo(self.desc, self.a, self.b, self.d)


class FP8Lt:
    """cuBLASLt's FP8 products on one handle and workspace."""

    def __init__(self):
        import cupy
        self._lib = lib = load_library()
        c_ptr = ctypes.c_void_p
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
        self._shapes = {}  # (m, n, k) -> _Shape

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

    def layout(self, data_type: int, rows: int, cols: int, ld: int):
        layout = ctypes.c_void_p()
        self._check(self._lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), data_type, rows,
                                                         cols, ld), "cublasLtMatrixLayoutCreate")
        return layout

    def algorithms(self, desc, a, b, d, count: int) -> list:
        """cuBLASLt's heuristic list for a product, best first, up to `count` entries
        (HeuristicResult; the library may list fewer)."""
        results, found = (HeuristicResult * count)(), ctypes.c_int(0)
        self._check(self._lib.cublasLtMatmulAlgoGetHeuristic(
            self.handle, desc, a, b, d, d, self._preference, count, results,
            ctypes.byref(found)), "cublasLtMatmulAlgoGetHeuristic")
        return [result for result in results[:found.value] if result.state == 0]

    def best_algo(self, desc, a, b, d) -> HeuristicResult:
        results = self.algorithms(desc, a, b, d, 1)
        if not results:
            raise RuntimeError("cuBLASLt has no FP8 algorithm for this product")
        return results[0]

    def run(self, desc, algo: HeuristicResult, weight, a, x, b, out, d, beta: float,
            stream: int) -> None:
        """out = weight-side A times x-side B (+ beta out), by the descriptors' types and
        layouts, with `algo`."""
        self._check(self._lib.cublasLtMatmul(
            self.handle, desc, ctypes.byref(self._one), weight.data.ptr, a, x.data.ptr, b,
            ctypes.byref(self._one if beta else self._zero), out.data.ptr, d, out.data.ptr, d,
            ctypes.byref(algo, 0), self.workspace.data.ptr, WORKSPACE_BYTES, stream),
            "cublasLtMatmul")

    def shape(self, m_rows: int, n: int, k: int) -> _Shape:
        """The descriptors and algorithm of an [m, k] x [n, k]^T product; RuntimeError
        where cuBLASLt has no FP8 algorithm for it."""
        key = (m_rows, n, k)
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = _Shape(self, m_rows, n, k)
        return shape

    def matmul(self, codes, weight_codes, acc, stream: int) -> None:
        """acc [M, N] float32 = codes [M, K] @ weight_codes [N, K]^T, both e4m3 (uint8)."""
        m_rows, k = codes.shape
        n = weight_codes.shape[0]
        shape = self.shape(m_rows, n, k)
        self.run(shape.desc, shape.algo, weight_codes, shape.a, codes, shape.b, acc, shape.d,
                 0.0, stream)


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
