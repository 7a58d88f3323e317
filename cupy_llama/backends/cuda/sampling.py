"""Launcher for sampling.cu: one CTA per sequence picks its next token on the device."""
from __future__ import annotations

import numpy as np

from .kernels import F32, I32, check, get_kernel, i32

THREADS = 1024  # sampling.cu: SAMPLE_THREADS
U64 = np.dtype(np.uint64)


def sample(logits, temperature, top_k, top_p, min_p, seeds, steps, out_tokens):
    """logits [B, V] float32; per-sequence settings [B] (float32 temperature / top_p /
    min_p, int32 top_k / steps, uint64 seeds) -> out_tokens [B] int32, on the device."""
    num_seqs, vocab = check("logits", logits, F32, ndim=2).shape
    for name, array, dtype in (("temperature", temperature, F32), ("top_k", top_k, I32),
                               ("top_p", top_p, F32), ("min_p", min_p, F32),
                               ("seeds", seeds, U64), ("steps", steps, I32),
                               ("out_tokens", out_tokens, I32)):
        check(name, array, dtype, shape=(num_seqs,))
    if num_seqs:
        get_kernel("sampling", "sample_kernel")(
            (num_seqs,), (THREADS,),
            (logits, i32(vocab), temperature, top_k, top_p, min_p, seeds, steps, out_tokens))
