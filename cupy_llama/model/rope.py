"""RoPE table (docs/ARCHITECTURE.md, Decisions 6): fp32 cos/sin for half-split pairs (i, i + d/2), with
Llama-3 frequency scaling when the config asks for it. Built once on the host; both the
NumPy and the CUDA backend (prefill and decode alike) read the same table."""
import math

import numpy as np

from ..config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """[d/2] float32 inverse frequencies, scaled as transformers' `llama3` rope type does
    (computed in float32 as there, so angles at long positions agree)."""
    d = config.head_dim
    exponents = np.arange(0, d, 2, dtype=np.float32) / np.float32(d)
    inv_freq = np.float32(1.0) / np.power(np.float32(config.rope_theta), exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed down by `factor`, short ones kept, the band between blended
    smooth = ((scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor,
                      np.where(wavelen < high_freq_wavelen, inv_freq, blended))
    return scaled.astype(np.float32)


def rope_cos_sin(config: ModelConfig, max_positions: int) -> np.ndarray:
    """[max_positions, d] float32: cos in columns [0, d/2), sin in [d/2, d)."""
    inv_freq = inverse_frequencies(config)
    positions = np.arange(max_positions, dtype=np.float32)
    angles = np.outer(positions, inv_freq)  # [P, d/2], computed in fp32 like transformers
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)
