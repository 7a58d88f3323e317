"""Streaming checkpoint tensors into the one device weight blob (docs/ARCHITECTURE.md, Decisions 2).

Pieces are packed into one of two pinned staging buffers (together about 64 MiB) and
copied asynchronously; while one buffer's copy runs, the other fills. Pinned copies run
near full PCIe speed; pageable ones are many times slower."""
from __future__ import annotations

import numpy as np

from .ops import H2D, pinned_array

STAGING_BYTES = 64 << 20


def upload_weight_pieces(cupy, blob, pieces, staging_bytes: int = STAGING_BYTES) -> int:
    """Copy (blob byte offset, contiguous numpy array) pieces, in increasing offset order,
    into the device uint8 array `blob`; returns the bytes copied. Neighbouring pieces share
    one copy (the alignment gaps between them go along)."""
    half = staging_bytes // 2
    buffers = [pinned_array(cupy, half, np.uint8) for _ in range(2)]
    done = [None, None]  # events: the copy out of each buffer has finished
    stream = cupy.cuda.Stream(non_blocking=True)
    current, chunk_start, chunk_end = 0, None, None  # blob range staged in `current`
    copied = 0

    def flush():
        nonlocal current, chunk_start, chunk_end
        if chunk_start is None:
            return
        cupy.cuda.runtime.memcpyAsync(blob.data.ptr + chunk_start, buffers[current].ctypes.data,
                                      chunk_end - chunk_start, H2D, stream.ptr)
        done[current] = stream.record()
        current ^= 1
        chunk_start = chunk_end = None

    def claim(offset):
        """Start staging at blob offset `offset` in the next free buffer."""
        nonlocal chunk_start, chunk_end
        if done[current] is not None:
            done[current].synchronize()
        chunk_start = chunk_end = offset

    for offset, piece in pieces:
        data = np.ascontiguousarray(piece).reshape(-1).view(np.uint8)
        if offset + data.size > blob.size:
            raise ValueError(f"weight piece at byte {offset} ({data.size} bytes) overruns the "
                             f"blob of {blob.size} bytes")
        position = 0
        while position < data.size:
            start = offset + position
            if chunk_start is None or start < chunk_end or start - chunk_start >= half:
                flush()
                claim(start)
            n = min(data.size - position, half - (start - chunk_start))
            buffers[current][start - chunk_start:start - chunk_start + n] = data[position:position + n]
            chunk_end = start + n
            position += n
            copied += n
            if chunk_end - chunk_start >= half:
                flush()
    flush()
    stream.synchronize()
    return copied
