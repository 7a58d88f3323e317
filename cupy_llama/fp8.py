"""FP8 (e4m3) weights: the format's values, rounding to it, and per-row scales, in NumPy.

This is the reference the CUDA kernels are tested against bit for bit (cuda_src/fp8.cu
quantizes with the same arithmetic) and what the NumPy backend computes with
(docs/ARCHITECTURE.md, "FP8 weights").

e4m3 ("float8_e4m3fn"): a sign bit, 4 exponent bits (bias 7) and 3 mantissa bits. An
exponent field of 0 holds the subnormals m/8 * 2^-6; the fields 1 to 15 hold
(1 + m/8) * 2^(e - 7), except 0x7F and 0xFF, which are NaN. There is no infinity: the
largest magnitude is 448 (0x7E). Rounding to e4m3 is to the nearest value, ties to the
even code, and saturates: a magnitude past 448 becomes 448 (CUDA's cvt.rn.satfinite).

A weight matrix [N, K] is stored as codes (uint8) and one float32 scale per output row:
W[n, k] = value(codes[n, k]) * scale[n], with scale[n] = max|W[n, :]| / 448 (at least the
smallest normal float32), so each row uses the format's whole range.
"""
from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0
E4M3_NAN = 0x7F
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32, 2^-126


def _code_values() -> np.ndarray:
    codes = np.arange(256)
    negative = np.where(codes & 0x80, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
    magnitude = np.where(exponent == 0, mantissa / 8.0 * 2.0**-6,
                         (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    values = negative * magnitude
    values[(codes & 0x7F) == E4M3_NAN] = np.nan
    return values.astype(np.float32)


E4M3_VALUES = _code_values()  # [256] float32: the value of each code


def e4m3_to_float32(codes: np.ndarray) -> np.ndarray:
    """The float32 values of e4m3 codes (uint8), exactly."""
    return E4M3_VALUES[np.asarray(codes, dtype=np.uint8)]


def float32_to_e4m3(values: np.ndarray) -> np.ndarray:
    """uint8 e4m3 codes of float32 values: nearest, ties to the even code, magnitudes past
    448 saturated to 448, NaN to NaN."""
    x = np.asarray(values, dtype=np.float32).astype(np.float64)  # exact
    magnitude = np.minimum(np.abs(x), E4M3_MAX)  # past 448: saturated (NaN stays NaN)
    # subnormal range (below 2^-6): steps of 2^-9, so the code is the rounded count of
    # steps (8 steps is 2^-6, the code of the first normal value: it carries over)
    small = np.rint(magnitude * 2.0**9)
    # normal range: 2^e <= m < 2^(e+1) has eight steps of 2^(e-3); np.rint rounds halves
    # to even, and the mantissa's low bit is the code's
    _, exp2 = np.frexp(magnitude)
    e = exp2.astype(np.int64) - 1
    steps = np.rint(np.ldexp(magnitude, -(e - 3)))  # in [8, 16]
    e = np.where(steps == 16, e + 1, e)
    steps = np.where(steps == 16, 8, steps)
    normal = ((e + 7) << 3) + steps - 8
    codes = np.where(magnitude < 2.0**-6, small, normal)
    codes = np.where(np.isnan(x), E4M3_NAN, codes).astype(np.int64)
    sign = np.where(np.signbit(x) & ~np.isnan(x), 0x80, 0)
    return (codes | sign).astype(np.uint8)


def row_scales(weight: np.ndarray) -> np.ndarray:
    """float32 [N]: each row's largest magnitude over 448, at least FLOAT32_TINY."""
    amax = np.max(np.abs(np.asarray(weight, dtype=np.float32)), axis=1)
    return np.maximum(amax / np.float32(E4M3_MAX), np.float32(FLOAT32_TINY)).astype(np.float32)


def quantize_rows(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float32 (or bf16-valued) [N, K] matrix -> (codes uint8 [N, K], scale float32 [N]):
    codes = e4m3(weight / scale), the division in float32 as the device does it."""
    weight = np.asarray(weight, dtype=np.float32)
    scale = row_scales(weight)
    return float32_to_e4m3(weight / scale[:, None]), scale


def dequantize_rows(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float32 [N, K]: value(codes) * scale per row (rounded to float32)."""
    return e4m3_to_float32(codes) * np.asarray(scale, dtype=np.float32).reshape(-1, 1)
