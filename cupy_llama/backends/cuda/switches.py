"""The switches that choose among kernels, read once, when a backend is made.

A CudaBackend owns one `KernelSwitches` and hands it to its ops; nothing else reads the
environment. CUDA graphs bake in the kernels a step launched when they were captured, so
the switches are frozen: to try other kernels, make a backend with other switches (or call
CudaBackend.use_switches, which drops the captured graphs with them).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ...errors import ConfigError

SKINNY_CHOICES = ("auto", "mma", "cublas")
FP8_CHOICES = ("cublaslt", "dequantize")
ENVIRONMENT = {"programmatic": "CUPY_LLAMA_PDL", "clusters": "CUPY_LLAMA_CLUSTERS",
               "skinny_gemm": "CUPY_LLAMA_SKINNY_GEMM", "fp8_gemm": "CUPY_LLAMA_FP8_GEMM",
               "head_norm_attention": "CUPY_LLAMA_HEAD_NORM_ATTENTION"}


@dataclass(frozen=True)
class KernelSwitches:
    # programmatic dependent launch (sm_90+): a kernel may start while the one before it
    # drains (launch.py); CUPY_LLAMA_PDL=0 turns it off
    programmatic: bool = True
    # decode attention merges its key ranges in a thread-block cluster where that pays
    # (attention.py); CUPY_LLAMA_CLUSTERS=0 turns it off
    clusters: bool = True
    # who computes the products of at most 16 rows (gemm.py): "auto" (this GPU's measured
    # choice table), "mma" (the tensor-core skinny kernels) or "cublas"
    skinny_gemm: str = "auto"
    # who computes the products of FP8 weights past 16 rows (gemm.py): "cublaslt" (x
    # quantized per row, FP8 tensor cores; the dequantized weight where cuBLASLt cannot)
    # or "dequantize" (the weight dequantized to bf16, then cuBLAS)
    fp8_gemm: str = "cublaslt"
    # a decode step's q/k head norms (Qwen3, Gemma 3), RoPE and cache write done by the
    # attention kernel instead of a kernel of their own (attention.py, DecodeRope);
    # CUPY_LLAMA_HEAD_NORM_ATTENTION=0 turns it off
    head_norm_attention: bool = True

    def __post_init__(self):
        for name, choices in (("skinny_gemm", SKINNY_CHOICES), ("fp8_gemm", FP8_CHOICES)):
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name} must be one of {', '.join(choices)}, got "
                                  f"{getattr(self, name)!r}")

    @classmethod
    def from_environment(cls, environ=None) -> "KernelSwitches":
        """The defaults, changed where the CUPY_LLAMA_* variables say so."""
        environ = os.environ if environ is None else environ
        values = {}
        for name in ("programmatic", "clusters", "head_norm_attention"):
            text = environ.get(ENVIRONMENT[name])
            if text is not None:
                if text not in ("0", "1"):
                    raise ConfigError(f"{ENVIRONMENT[name]} must be 0 or 1, got {text!r}")
                values[name] = text == "1"
        for name, choices in (("skinny_gemm", SKINNY_CHOICES), ("fp8_gemm", FP8_CHOICES)):
            text = environ.get(ENVIRONMENT[name])
            if text is not None:
                if text not in choices:
                    raise ConfigError(f"{ENVIRONMENT[name]} must be one of "
                                      f"{', '.join(choices)}, got {text!r}")
                values[name] = text
        return cls(**values)
