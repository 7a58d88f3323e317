"""Kernel launches through the CUDA driver's cuLaunchKernelEx (ctypes), for the three things
CuPy's RawKernel call cannot do: pass a C struct by value (the skinny kernels' SkinnyArgs),
launch programmatically (programmatic dependent launch, sm_90+: the kernel may start
while the kernel before it on the stream still runs, and waits for it on the device,
`wait_for_previous_kernel` in common.cuh; launches captured into a CUDA graph keep that
overlap as programmatic edges), and launch thread-block clusters (sm_90+: decode
attention's clustered kernels).

Whether a launch is programmatic or clustered is the caller's to say: the backend's
switches decide (switches.py; CUPY_LLAMA_PDL=0 and CUPY_LLAMA_CLUSTERS=0 turn them off),
and launch_attributes_usable() says where the GPU can."""
from __future__ import annotations

import ctypes
import functools
import re

import numpy as np

from .device import device_limits

CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):
    # CUlaunchAttribute: a 4-byte id, padding to 8, a 64-byte value union (an int for
    # programmatic serialization, three unsigned ints x, y, z for the cluster dimension)
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def attribute(attribute_id: int, *values: int) -> _LaunchAttribute:
    """A CUlaunchAttribute whose value starts with the given unsigned ints."""
    return _LaunchAttribute(id=attribute_id, value=(ctypes.c_uint * 16)(*values))


@functools.lru_cache(maxsize=None)
def launch_attributes(programmatic: bool, cluster: int) -> tuple:
    """(CUlaunchAttribute array or None, count) of a launch: programmatic stream
    serialization, and the cluster dimension where cluster > 1. Built once per kind of
    launch (the cache keeps the array alive)."""
    attributes = []
    if programmatic:
        attributes.append(attribute(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1))
    if cluster > 1:
        attributes.append(attribute(CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, cluster, 1, 1))
    if not attributes:
        return None, 0
    return (_LaunchAttribute * len(attributes))(*attributes), len(attributes)


_driver = None  # _Driver once loaded; False where it could not be
_attributes_usable = None  # launch_attributes_usable(), once worked out


def launch_attributes_usable() -> bool:
    """The driver's cuLaunchKernelEx loaded and an sm_90+ GPU: worked out once, for the
    device current then (the engine runs on one GPU)."""
    global _attributes_usable
    if _attributes_usable is None:
        _attributes_usable = available() and device_limits()["capability"] >= 90
    return _attributes_usable


def available() -> bool:
    """Whether cuLaunchKernelEx could be loaded (else callers use other kernels)."""
    return _load() is not None


def launch(kernel, grid, block: int, shared_bytes: int, stream_ptr: int, args,
           programmatic: bool, cluster: int = 1) -> None:
    """Launch the CuPy RawKernel `kernel` (grid: an int or up to three ints) with `args`,
    one ctypes struct passed by value or a list of ctypes values, one per parameter.
    programmatic: the kernel waits for the one before before touching its results, and
    the GPU can (sm_90+, launch_attributes_usable()). cluster > 1: launch clusters of that
    many CTAs along x (grid x a multiple of it; sm_90+)."""
    driver = _load()
    if driver is None:
        raise RuntimeError("cuLaunchKernelEx is not available")
    grid = (grid,) if isinstance(grid, int) else tuple(grid)
    values = args if isinstance(args, (list, tuple)) else [args]
    driver.launch(kernel.kernel.ptr, grid + (1,) * (3 - len(grid)), block, shared_bytes,
                  stream_ptr, values, programmatic, cluster)


def launch_waiting(kernel, grid: tuple, block: int, args: tuple, shared_bytes: int = 0,
                   cluster: int = 1, programmatic: bool = False) -> None:
    """Launch a RawKernel that calls wait_for_previous_kernel on the current stream:
    programmatically where `programmatic` (the caller has checked that the GPU can), else
    with CuPy's plain call (or the driver's, for clusters: cluster > 1 CTAs along x).
    args: CuPy arrays and NumPy int32 / float32 scalars, as CuPy's call takes them."""
    if programmatic or cluster > 1:
        import cupy
        launch(kernel, grid, block, shared_bytes, cupy.cuda.get_current_stream().ptr,
               kernel_args(*args), programmatic, cluster)
    else:
        kernel(grid, (block,), args, shared_mem=shared_bytes)


def kernel_args(*values) -> list:
    """CuPy arrays and NumPy int32 / float32 scalars as the ctypes values launch() takes."""
    converted = []
    for value in values:
        if hasattr(value, "data") and hasattr(value.data, "ptr"):
            converted.append(ctypes.c_void_p(value.data.ptr))
        elif isinstance(value, np.int32):
            converted.append(ctypes.c_int(int(value)))
        elif isinstance(value, np.float32):
            converted.append(ctypes.c_float(float(value)))
        else:
            raise TypeError(f"kernel argument of type {type(value).__name__}")
    return converted


def _load():
    global _driver
    if _driver is None:
        try:
            _driver = _Driver()
        except (OSError, AttributeError):
            _driver = False
    return _driver or None


class _Driver:
    def __init__(self):
        lib = ctypes.CDLL(_libcuda_path())
        self._launch = lib.cuLaunchKernelEx
        self._launch.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                 ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        self._launch.restype = ctypes.c_int

    def launch(self, function: int, grid: tuple, block: int, shared_bytes: int, stream: int,
               values: list, programmatic: bool, cluster: int = 1) -> None:
        attrs, count = launch_attributes(bool(programmatic), cluster)
        config = _LaunchConfig(*grid, block, 1, 1, shared_bytes, stream, attrs, count)
        params = (ctypes.c_void_p * len(values))(
            *[ctypes.cast(ctypes.byref(value), ctypes.c_void_p) for value in values])
        status = self._launch(ctypes.byref(config), ctypes.c_void_p(function), params, None)
        if status != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUDA driver error {status}")


def _libcuda_path() -> str:
    """The libcuda already in the process (CuPy loaded it), else the usual soname."""
    return loaded_library_path("cuda") or "libcuda.so.1"


def loaded_library_path(stem: str) -> str | None:
    """The path of lib<stem>.so* already loaded into this process, or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                if re.search(rf"/lib{stem}\.so(\.\d+)*$", path):
                    return path
    except OSError:
        pass
    return None
