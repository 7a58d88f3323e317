"""Launcher for logprobs.cu: the log-probabilities of the sampled tokens, and of the most
likely ones, for the rows of a step that ask (on the device; only those numbers come back)."""
from __future__ import annotations

import numpy as np

from .kernels import F32, I32, check, constants, get_kernel, i32

_C = constants("logprobs")
THREADS = _C["LOGPROB_THREADS"]
MAX_K = _C["LOGPROB_MAX_K"]


def logprobs(logits, rows, tokens, k: int, values, ids, ranks=None):
    """logits [B, V] float32, rows [R] int32 (rows of logits), tokens [B] int32 (the ids
    sampling chose), 0 <= k <= MAX_K -> values [R, 1 + k] float32 and ids [R, 1 + k] int32:
    column 0 the sampled token's log-softmax, then the k largest, best first; ranks [R]
    int32, where given: each sampled token's place in its row (1: the most likely)."""
    num_seqs, vocab = check("logits", logits, F32, ndim=2).shape
    num_rows = check("rows", rows, I32, ndim=1).shape[0]
    check("tokens", tokens, I32, shape=(num_seqs,))
    if not 0 <= k <= MAX_K:
        raise ValueError(f"k must be in [0, {MAX_K}], got {k}")
    check("values", values, F32, shape=(num_rows, 1 + k))
    check("ids", ids, I32, shape=(num_rows, 1 + k))
    if ranks is not None:
        check("ranks", ranks, I32, shape=(num_rows,))
    if num_rows:  # a list of one pair per thread where no row asks for more
        name = "logprobs_kernel" if k <= 1 else "logprobs_top_kernel"
        get_kernel("logprobs", name)(
            (num_rows,), (THREADS,), (logits, i32(vocab), rows, tokens, i32(k), values, ids,
                                      ranks if ranks is not None else np.uintp(0)))
