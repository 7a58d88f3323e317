"""Backends: where the forward pass runs (NumPy reference on the CPU, CUDA on a GPU).

This module chooses one: `resolve_device` says which device "auto" means, `device_options`
which engine options that device takes (and the defaults the CPU gets), and `make_backend`
builds one."""
from __future__ import annotations

DEVICES = ("auto", "cpu", "cuda")
# engine options only the GPU has: the CPU warns and ignores them
GPU_ONLY_OPTIONS = ("enforce_eager", "gpu_memory_utilization")
# modest defaults on the CPU: the NumPy backend serves tests and small models
CPU_DEFAULTS = {"max_num_seqs": 16, "max_num_batched_tokens": 2048}


def resolve_device(device: str, log=None) -> str:
    """"cpu" or "cuda" for a device of DEVICES: "auto" is the GPU when CuPy can use one,
    else the CPU (and `log`, when given, hears why). "cuda" raises DeviceError when the GPU
    cannot be used."""
    from ..errors import ConfigError
    if device not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cpu":
        return "cpu"
    from .cuda import check_cuda_device, cuda_usable
    if device == "cuda":
        check_cuda_device()
        return "cuda"
    usable, reason = cuda_usable()
    if not usable and log is not None:
        log(f"warning: running on the CPU (slow): {reason}")
    return "cuda" if usable else "cpu"


def device_options(device: str, options: dict) -> tuple[dict, list[str]]:
    """The engine options `device` takes, with the CPU's defaults filled in where it is the
    CPU, and the names of those it ignores (GPU_ONLY_OPTIONS on the CPU): the caller warns,
    naming them its own way."""
    if device != "cpu":
        return dict(options), []
    ignored = [name for name in GPU_ONLY_OPTIONS if name in options]
    kept = {name: value for name, value in options.items() if name not in ignored}
    return {**CPU_DEFAULTS, **kept}, ignored


def make_backend(device: str, model, checkpoint, engine_config, max_model_len: int, log=None):
    """The backend of a model (a models/ Decoder) on a resolved device ("cpu" or "cuda"),
    with the weights loaded."""
    if device == "cpu":
        from .cpu import CpuBackend
        return CpuBackend(model, checkpoint, max_model_len=max_model_len,
                          max_num_seqs=engine_config.max_num_seqs,
                          max_num_batched_tokens=engine_config.max_num_batched_tokens,
                          block_size=engine_config.block_size,
                          num_kv_blocks=engine_config.num_kv_blocks, log=log)
    from .cuda import CudaBackend
    return CudaBackend(model, checkpoint, max_model_len=max_model_len,
                       max_num_seqs=engine_config.max_num_seqs,
                       max_num_batched_tokens=engine_config.max_num_batched_tokens,
                       block_size=engine_config.block_size,
                       num_kv_blocks=engine_config.num_kv_blocks,
                       gpu_memory_utilization=engine_config.gpu_memory_utilization,
                       enforce_eager=engine_config.enforce_eager, log=log)
