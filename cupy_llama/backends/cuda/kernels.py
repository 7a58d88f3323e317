"""Compiling cuda_src/*.cu with NVRTC (cupy.RawModule), once per process, and the checks
every launcher runs on its arguments before a launch."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

# cuda_src/ sits at the repository root, next to the cupy_llama package
CUDA_SRC = Path(__file__).resolve().parents[3] / "cuda_src"
COMPILE_OPTIONS = ("-std=c++17",)  # CuPy adds -arch=sm_XX for the current device

# the tensor-core skinny kernels of gemv.cu (DEFINE_SKINNY lines), each with variants _n1
# (up to 8 x rows) and _n2 (up to 16)
SKINNY_FAMILIES = ("skinny", "skinny_wide", "skinny_norm", "skinny_norm_silu", "skinny_norm_rope")

# every kernel module and the kernels it defines
MODULES = {
    "embedding": ("embedding_kernel", "embedding_f32_kernel", "gather_rows_kernel"),
    "norm": ("rms_norm_kernel", "rms_norm_f32_kernel"),
    "activation": ("silu_and_mul_kernel",),
    "rope": ("rope_and_cache_kernel",),
    "attention": ("paged_attention_dpl1", "paged_attention_dpl2", "paged_attention_dpl4",
                  "paged_attention_dpl8", "attention_combine_kernel",
                  *(f"decode_attention_d{d}_g{g}{c}" for d in (64, 128) for g in (1, 2, 4, 8)
                    for c in ("", "_cluster")),
                  "prefill_attention_d64", "prefill_attention_d128"),
    "sampling": ("sample_kernel",),
    "gemv": ("gemv_m1", "gemv_m2", "gemv_m4", "gemv_m8", "gemv_m16",
             *(f"{family}_n{nt}" for family in SKINNY_FAMILIES for nt in (1, 2))),
}


def module_source(name: str) -> str:
    """common.cuh followed by cuda_src/<name>.cu: the text NVRTC compiles (and CuPy's
    kernel cache keys on, so an edit to the header recompiles)."""
    if not CUDA_SRC.is_dir():
        raise FileNotFoundError(f"CUDA kernel sources not found at {CUDA_SRC}; the cuda_src/ "
                                "folder must sit next to the cupy_llama package")
    header = (CUDA_SRC / "common.cuh").read_text(encoding="utf-8")
    body = (CUDA_SRC / f"{name}.cu").read_text(encoding="utf-8")
    return f"{header}\n#line 1 \"{name}.cu\"\n{body}"


@lru_cache(maxsize=None)
def load_module(name: str):
    import cupy
    return cupy.RawModule(code=module_source(name), options=COMPILE_OPTIONS)


@lru_cache(maxsize=None)
def get_kernel(module: str, kernel: str):
    return load_module(module).get_function(kernel)


# static plus dynamic shared memory a kernel may use without opting in
DEFAULT_SHARED_LIMIT = 48 * 1024
_opted_in: dict = {}  # id(kernel function) -> dynamic shared bytes it is opted in for


def opt_in_shared(kernel, dynamic: int, static: int = 0) -> None:
    """Let `kernel` launch with `dynamic` bytes of dynamic shared memory beside `static`:
    past DEFAULT_SHARED_LIMIT in all a kernel must opt in. The attribute is set (and read
    from the driver) once per kernel and size; get_kernel's functions live as long as the
    process, so the launchers call this on every launch at the cost of a dict lookup."""
    if dynamic + static <= DEFAULT_SHARED_LIMIT or _opted_in.get(id(kernel), -1) >= dynamic:
        return
    if kernel.max_dynamic_shared_size_bytes < dynamic:
        kernel.max_dynamic_shared_size_bytes = dynamic
    _opted_in[id(kernel)] = dynamic


def compile_all() -> dict:
    """Compile every module; returns {module: None or the compile error text}."""
    results = {}
    for module, kernels in MODULES.items():
        try:
            for kernel in kernels:
                get_kernel(module, kernel)
            results[module] = None
        except Exception as e:  # cupy.cuda.compiler.CompileException carries the NVRTC log
            results[module] = f"{type(e).__name__}: {e}"
    return results


# ---- argument checks: programming errors, so ValueError naming the argument ----

BF16 = np.dtype(np.uint16)
F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)


def check(name: str, array, dtype, shape=None, ndim=None):
    """`array` must be a C-contiguous cupy array of `dtype`; `shape` may hold None for any
    size on that axis."""
    import cupy
    if not isinstance(array, cupy.ndarray):
        raise ValueError(f"{name}: expected a cupy array, got {type(array).__name__}")
    if array.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {np.dtype(dtype).name}, got {array.dtype.name}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous (shape {array.shape}, strides {array.strides})")
    if ndim is not None and array.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {array.shape}")
    if shape is not None:
        if len(shape) != array.ndim or any(w is not None and w != s for w, s in zip(shape, array.shape)):
            raise ValueError(f"{name}: expected shape {tuple(shape)}, got {array.shape}")
    return array


def i32(value) -> np.int32:
    return np.int32(value)


def f32(value) -> np.float32:
    return np.float32(value)
