"""Launcher for sampling.cu: one CTA per sequence picks its next token on the device."""
from __future__ import annotations

import numpy as np

from .device import device_limits
from .kernels import F32, I32, check, constants, get_kernel, i32, opt_in_shared

_C = constants("sampling")
THREADS = _C["SAMPLE_THREADS"]
CANDIDATE_CUT = _C["CANDIDATE_CUT"]  # candidates lie within this many temperatures of the max
SLOT_BYTES = _C["SLOT_BYTES"]  # shared memory of one candidate slot of every thread
U64 = np.dtype(np.uint64)
U32 = np.dtype(np.uint32)
MASK_SKIP = _C["MASK_SKIP"]  # mask_rows: the launch draws no token for the row
# Candidate slots per thread (sampling.cu, "Candidates"): 8 bytes per slot and thread, so
# 16 slots take 128 KiB of shared memory and hold up to 16,384 candidates, with room for
# sixteen times the mean in any one thread when a row has 1,000 of them. (SmolLM2-135M-
# Instruct at temperature 0.6: 176 of 184 steps fit 8 slots, 183 fit 16.)
SLOTS = 16


def slot_room() -> int:
    """The most candidate slots the device's shared memory per block holds beside the
    kernel's static shared memory (SampleShared)."""
    static = get_kernel("sampling", "sample_kernel").shared_size_bytes
    return max(0, (device_limits()["max_shared_per_block"] - static) // SLOT_BYTES)


def default_slots() -> int:
    """SLOTS, or as many as the device's shared memory per block holds."""
    return min(SLOTS, slot_room())


def sample(logits, temperature, top_k, top_p, min_p, seeds, steps, out_tokens, slots=None,
           used_slots=None, bitmask=None, mask_rows=None):
    """logits [B, V] float32; per-sequence settings [B] (float32 temperature / top_p /
    min_p, int32 top_k / steps, uint64 seeds) -> out_tokens [B] int32, on the device.
    slots: candidate slots per thread (default_slots(); 0 makes every pass read the whole
    row, which draws the same tokens); used_slots: None or [B] int32, set to 1 where the
    candidate slots served the draw. Structured outputs: mask_rows [B] int32, row b's
    bitmask row, -1 for none, MASK_SKIP for a row this launch leaves alone; bitmask [R, W]
    uint32 (W * 32 >= V), needed where a mask row is >= 0 (sampling.cu, "Structured
    outputs")."""
    num_seqs, vocab = check("logits", logits, F32, ndim=2).shape
    for name, array, dtype in (("temperature", temperature, F32), ("top_k", top_k, I32),
                               ("top_p", top_p, F32), ("min_p", min_p, F32),
                               ("seeds", seeds, U64), ("steps", steps, I32),
                               ("out_tokens", out_tokens, I32)):
        check(name, array, dtype, shape=(num_seqs,))
    if used_slots is not None:
        check("used_slots", used_slots, I32, shape=(num_seqs,))
    if bitmask is not None and mask_rows is None:
        raise ValueError("a bitmask needs mask_rows")
    mask_words = 0
    if mask_rows is not None:
        check("mask_rows", mask_rows, I32, shape=(num_seqs,))
    if bitmask is not None:
        mask_words = check("bitmask", bitmask, U32, ndim=2).shape[1]
        if mask_words * 32 < vocab:
            raise ValueError(f"bitmask rows of {mask_words} words do not cover {vocab} tokens")
    if slots is None:
        slots = default_slots()
    else:
        slots = int(slots)
        if not 0 <= slots <= slot_room():
            raise ValueError(f"slots must be in [0, {slot_room()}] on this GPU (its shared "
                             f"memory per block), got {slots}")
    if not num_seqs:
        return
    kernel = get_kernel("sampling", "sample_kernel")
    shared = slots * SLOT_BYTES
    opt_in_shared(kernel, shared)
    kernel((num_seqs,), (THREADS,),
           (logits, i32(vocab), temperature, top_k, top_p, min_p, seeds, steps, out_tokens,
            i32(slots), used_slots if used_slots is not None else np.uintp(0),
            bitmask if bitmask is not None else np.uintp(0), i32(mask_words),
            mask_rows if mask_rows is not None else np.uintp(0)), shared_mem=shared)
