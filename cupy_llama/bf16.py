"""bfloat16 stored as uint16 bits (docs/ARCHITECTURE.md, Decisions 1): conversions on the host."""
import numpy as np


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bf16 (ties to even); NaN stays NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounding_bias = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    out = ((bits + rounding_bias) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(bits, dtype=np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values that bf16 can represent exactly (the nearest ones)."""
    return bf16_bits_to_float32(float32_to_bf16_bits(x))
