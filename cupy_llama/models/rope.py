"""RoPE tables (docs/ARCHITECTURE.md, Decisions 6): float32 cos/sin for half-split pairs
(i, i + d/2), with the frequencies of a RopeConfig computed as transformers computes them
(default, linear, llama3, yarn). Built once on the host; both backends, prefill and decode
alike, read the same table."""
import math

import numpy as np

from ..config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """[d/2] float32 inverse frequencies, and the attention factor that multiplies cos and
    sin (1 but for yarn). Computed in float32 as transformers does, so angles at long
    positions agree."""
    d = head_dim
    exponents = np.arange(0, d, 2, dtype=np.float32) / np.float32(d)
    inv_freq = np.float32(1.0) / np.power(np.float32(rope.theta), exponents)
    if rope.rope_type == "linear":
        return (inv_freq / np.float32(rope.factor)).astype(np.float32), 1.0
    if rope.rope_type == "llama3":
        return _llama3(rope, inv_freq), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, d)
    return inv_freq, 1.0


def _llama3(rope: RopeConfig, inv_freq: np.ndarray) -> np.ndarray:
    """Llama 3's bands: long wavelengths slowed down by `factor`, short ones kept, the band
    between blended."""
    original = rope.original_max_position_embeddings
    low_freq_wavelen = original / rope.low_freq_factor
    high_freq_wavelen = original / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = ((original / wavelen - rope.low_freq_factor)
              / (rope.high_freq_factor - rope.low_freq_factor))
    blended = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor,
                      np.where(wavelen < high_freq_wavelen, inv_freq, blended))
    return scaled.astype(np.float32)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, d: int) -> tuple[np.ndarray, float]:
    """YaRN (NTK-by-parts): frequencies below the correction range are interpolated by
    `factor`, those above kept, a linear ramp between; cos and sin scaled by the
    attention factor."""
    factor, base = rope.factor, rope.theta
    original = rope.original_max_position_embeddings
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = (_yarn_mscale(factor, rope.mscale)
                                / _yarn_mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # avoid a division by zero
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = np.power(np.float32(base), np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    extrapolation_factor = np.float32(1) - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_table(rope: RopeConfig, head_dim: int, max_positions: int) -> np.ndarray:
    """[max_positions, d] float32: cos in columns [0, d/2), sin in [d/2, d), both times the
    attention factor."""
    inv_freq, attention_factor = inverse_frequencies(rope, head_dim)
    positions = np.arange(max_positions, dtype=np.float32)
    angles = np.outer(positions, inv_freq)  # [P, d/2], computed in fp32 like transformers
    table = np.concatenate([np.cos(angles), np.sin(angles)], axis=1)
    if attention_factor != 1.0:
        table = table * np.float32(attention_factor)
    return table.astype(np.float32)
