"""Is there a GPU CuPy can use, with bf16? One-line `DeviceError`s when there is not."""
from __future__ import annotations

from ...errors import DeviceError

INSTALL_HINT = ("install CuPy for the machine's CUDA: pip install cupy-cuda12x (CUDA 12) or "
                "cupy-cuda13x (CUDA 13)")
MIN_COMPUTE_CAPABILITY = 80  # bf16 arithmetic and storage: Ampere (sm_80) and newer
CPU_HINT = ', or run on the CPU (--device cpu; device="cpu" in Python)'  # ends each no-GPU message


def _no_gpu(reason: str) -> DeviceError:
    """A DeviceError saying why the GPU cannot run the model, then CPU_HINT."""
    return DeviceError(reason + CPU_HINT)


def import_cupy():
    """The cupy module, or a DeviceError saying how to install it."""
    try:
        import cupy
    except ImportError:
        raise _no_gpu(f"CuPy is not installed; {INSTALL_HINT}") from None
    return cupy


def check_cuda_device() -> int:
    """Raise DeviceError unless the current CUDA device can run the model; returns its
    compute capability as an int (90 for sm_90)."""
    cupy = import_cupy()
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError, or a missing driver library
        raise _no_gpu(f"no usable CUDA GPU ({_one_line(e)}); check the NVIDIA driver "
                      "with nvidia-smi") from None
    if count < 1:
        raise _no_gpu("no CUDA GPU found; check the NVIDIA driver with nvidia-smi")
    device = cupy.cuda.Device()
    capability = int(device.compute_capability)
    if capability < MIN_COMPUTE_CAPABILITY:
        name = device_name(device)
        raise _no_gpu(f"GPU {device.id} ({name}) has compute capability "
                      f"{capability // 10}.{capability % 10}, without bf16 support; "
                      "cupy-llama needs 8.0 (Ampere) or newer")
    return capability


def cuda_usable() -> tuple[bool, str]:
    """For device="auto": (True, description) or (False, why not, without the hint to run
    on the CPU: that is what happens then)."""
    try:
        capability = check_cuda_device()
    except DeviceError as e:
        return False, str(e).removesuffix(CPU_HINT)
    import cupy
    device = cupy.cuda.Device()
    return True, f"GPU {device.id}: {device_name(device)} (sm_{capability})"


_limits = {}  # device id -> device_limits()


def device_limits() -> dict:
    """What the current device offers the kernel launchers (read once per device): SMs,
    shared memory per block (opt-in) and per SM, registers and threads per SM, and the
    compute capability as an int (90 for sm_90)."""
    import cupy
    device = cupy.cuda.Device()
    if device.id not in _limits:
        attributes = device.attributes
        _limits[device.id] = {
            "sms": attributes["MultiProcessorCount"],
            "max_shared_per_block": attributes.get("MaxSharedMemoryPerBlockOptin", 48 * 1024),
            "shared_per_sm": attributes.get("MaxSharedMemoryPerMultiprocessor", 100 * 1024),
            "regs_per_sm": attributes.get("MaxRegistersPerMultiprocessor", 65536),
            "threads_per_sm": attributes.get("MaxThreadsPerMultiProcessor", 2048),
            "capability": int(device.compute_capability),
        }
    return _limits[device.id]


def device_name(device) -> str:
    import cupy
    try:
        name = cupy.cuda.runtime.getDeviceProperties(device.id)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        return "unknown GPU"


def _one_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
