"""The CUDA backend: kernels from cuda_src/ compiled with NVRTC (cupy.RawModule), cuBLAS
for matrix products, one weight blob, one activation pool, one paged KV cache.

Importing this package does not import CuPy; `check_cuda_device()` says (as a DeviceError)
what is missing when the GPU cannot be used."""
from .device import check_cuda_device, cuda_usable

__all__ = ["CudaBackend", "CudaOps", "check_cuda_device", "cuda_usable"]


def __getattr__(name):
    if name == "CudaBackend":
        from .backend import CudaBackend
        return CudaBackend
    if name == "CudaOps":
        from .ops import CudaOps
        return CudaOps
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
