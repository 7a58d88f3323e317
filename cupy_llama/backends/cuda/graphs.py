"""CUDA graphs for decode steps (DESIGN decision 8).

One graph per batch-size bucket holds a whole decode forward pass (every kernel and cuBLAS
call of model/llama.py). A step of B sequences replays the smallest bucket >= B after one
asynchronous copy of its metadata into FIXED device buffers: each field sits at a fixed
offset, sized for the largest bucket, and block tables have the fixed width of
max_model_len. Rows past B are padding: token 0 at position 0, KV slot -1 (nothing is
written), sequence length 0 (attention writes zeros and reads no block). Nothing that
changes between steps is baked into a graph: the attention split count is the bucket's
fixed maximum and the kernel derives each sequence's split length from seq_lens on the
device. A bucket whose attention runs as thread-block clusters at short contexts
(CudaOps.decode_clusters) has a second graph, replayed while every sequence of the step
has at most attention.cluster_max_keys tokens. Capturing runs on a side stream; replays run on the
caller's stream, so they order with the eager work around them."""
from __future__ import annotations

import time

import numpy as np

from ...model.llama import forward_uploaded
from ..base import ForwardBatch
from .attention import cluster_max_keys
from .ops import H2D, DeviceBatch, pinned_array, sync_event

FIRST_BUCKETS = (1, 2, 4, 8, 16, 24, 32)
BUCKET_STEP = 16


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, then steps of 16, ending at max_num_seqs."""
    buckets = [b for b in FIRST_BUCKETS if b < max_num_seqs]
    next_bucket = FIRST_BUCKETS[-1] + BUCKET_STEP
    while next_bucket < max_num_seqs:
        buckets.append(next_bucket)
        next_bucket += BUCKET_STEP
    return buckets + [max_num_seqs]


def short_graph_buckets(buckets: list[int], short_limit: int, max_model_len: int,
                        clustered) -> frozenset:
    """The buckets that get a second graph for steps of at most short_limit tokens per
    sequence: those whose attention runs clustered there (clustered(bucket, short_limit),
    CudaOps.decode_clusters) where that is a shorter context than the graphs' own."""
    if not 0 < short_limit < max_model_len:
        return frozenset()
    return frozenset(b for b in buckets if clustered(b, short_limit))


class DecodeGraphs:
    def __init__(self, backend, log=None):
        import cupy
        self._cupy = cupy
        self._backend = backend
        self._log = log or (lambda message: None)
        self.buckets = decode_buckets(backend.max_num_seqs)
        n = self.max_bucket = self.buckets[-1]
        self.width = width = backend.ops.max_blocks_per_seq
        config = backend.config
        self.short_limit = cluster_max_keys(config.head_dim, config.num_attention_heads
                                            // config.num_key_value_heads)
        self.short_buckets = short_graph_buckets(
            self.buckets, self.short_limit, backend.max_model_len,
            lambda bucket, limit: backend.ops.decode_clusters(
                bucket, config.num_attention_heads, config.num_key_value_heads,
                config.head_dim, limit))
        # fixed layout (int32): token_ids [n] | positions [n] | slot_mapping [n] |
        # query_start_loc [n + 1] | seq_lens [n] | last_token_indices [n] | block_tables [n, W]
        self._offsets = {"token_ids": 0, "positions": n, "slot_mapping": 2 * n,
                         "query_start_loc": 3 * n, "seq_lens": 4 * n + 1,
                         "last_token_indices": 5 * n + 1, "block_tables": 6 * n + 1}
        capacity = 6 * n + 1 + n * width
        self._host = pinned_array(cupy, capacity, np.int32)
        # past a row's length its table is never read (see _stage); -1 so a stray read of a
        # column no step has written would show
        self._host[self._offsets["block_tables"]:] = -1
        self._device = cupy.zeros(capacity, np.int32)
        # one new token per sequence: these two never change
        self._field("query_start_loc", n + 1)[:] = np.arange(n + 1, dtype=np.int32)
        self._field("last_token_indices", n)[:] = np.arange(n, dtype=np.int32)
        self._copied = sync_event(cupy)  # the last metadata copy has read the host buffer
        self._capture_stream = cupy.cuda.Stream(non_blocking=True)
        self._graphs = {}  # (bucket, context limit) -> (graph, logits [bucket, V])

    # ---- metadata ----------------------------------------------------------------------
    def _field(self, name: str, count: int) -> np.ndarray:
        start = self._offsets[name]
        return self._host[start:start + count]

    def _device_batch(self, bucket: int, limit: int) -> DeviceBatch:
        views = {}
        for name in ("token_ids", "positions", "slot_mapping", "seq_lens", "last_token_indices"):
            start = self._offsets[name]
            views[name] = self._device[start:start + bucket]
        start = self._offsets["query_start_loc"]
        views["query_start_loc"] = self._device[start:start + bucket + 1]
        start = self._offsets["block_tables"]
        views["block_tables"] = self._device[start:start + bucket * self.width].reshape(bucket, self.width)
        return DeviceBatch(**views, num_tokens=bucket, num_seqs=bucket, max_query_len=1,
                           max_seq_len=limit, is_decode_only=True, lengths_on_device=True)

    def _stage(self, batch: ForwardBatch | None, bucket: int) -> None:
        """Write the batch, padded to `bucket` rows, to the host buffer and copy it to the
        device on the current stream (batch None: all padding). Of the block tables only
        the batch's own rows are copied and only its own columns written: the kernels read
        a row's table up to its sequence length (0 for a padding row), whatever an earlier
        step left past that."""
        num_seqs = 0 if batch is None else batch.num_seqs
        self._copied.synchronize()  # the previous copy has read the host buffer
        for name, pad in (("token_ids", 0), ("positions", 0), ("slot_mapping", -1), ("seq_lens", 0)):
            field = self._field(name, bucket)
            if batch is not None:
                field[:num_seqs] = getattr(batch, name)
            field[num_seqs:] = pad
        if batch is not None:
            tables = self._field("block_tables", num_seqs * self.width).reshape(num_seqs, self.width)
            tables[:, :batch.block_tables.shape[1]] = batch.block_tables
        nbytes = 4 * (self._offsets["block_tables"] + num_seqs * self.width)
        stream = self._cupy.cuda.get_current_stream()
        self._cupy.cuda.runtime.memcpyAsync(self._device.data.ptr, self._host.ctypes.data,
                                            nbytes, H2D, stream.ptr)
        self._copied.record(stream)

    # ---- replay ------------------------------------------------------------------------
    def bucket_for(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def limit_for(self, bucket: int, max_seq_len: int) -> int:
        """The longest context the bucket's graph for a step of max_seq_len tokens was
        captured for: short_limit for a short bucket's short steps, else max_model_len."""
        if bucket in self.short_buckets and max_seq_len <= self.short_limit:
            return self.short_limit
        return self._backend.max_model_len

    def graph_keys(self) -> list[tuple[int, int]]:
        """(bucket, context limit) of every graph capture_all captures."""
        return ([(bucket, self._backend.max_model_len) for bucket in self.buckets]
                + [(bucket, self.short_limit) for bucket in sorted(self.short_buckets)])

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.is_decode_only and batch.num_tokens == batch.num_seqs
                and 0 < batch.num_seqs <= self.max_bucket and batch.block_tables.ndim == 2
                and batch.block_tables.shape[1] <= self.width)

    def run(self, config, batch: ForwardBatch):
        """Logits [B, V] float32 of a decode batch (a view of the pool)."""
        if not self.can_run(batch):
            raise ValueError(f"a batch of {batch.num_tokens} tokens for {batch.num_seqs} "
                             f"sequences (block tables {batch.block_tables.shape}) is not a "
                             f"decode batch of at most {self.max_bucket} sequences")
        bucket = self.bucket_for(batch.num_seqs)
        limit = self.limit_for(bucket, batch.max_seq_len)
        entry = self._graphs.get((bucket, limit)) or self.capture(config, bucket, limit)
        graph, logits = entry
        stream = self._cupy.cuda.get_current_stream()
        self._stage(batch, bucket)
        graph.launch(stream)
        return logits[:batch.num_seqs]

    def run_uncaptured(self, config, batch: ForwardBatch):
        """The same launches as the graph of batch's bucket, run eagerly (tests and timing:
        replay must give exactly these logits)."""
        bucket = self.bucket_for(batch.num_seqs)
        self._stage(batch, bucket)
        return self._forward(config, bucket, self.limit_for(bucket, batch.max_seq_len))[:batch.num_seqs]

    # ---- capture -----------------------------------------------------------------------
    def _forward(self, config, bucket: int, limit: int):
        return forward_uploaded(self._backend, config, self._device_batch(bucket, limit))

    def capture(self, config, bucket: int, limit: int):
        """Capture the decode graph of one bucket for steps of at most `limit` tokens per
        sequence (an all-padding warm-up run first, so every kernel is compiled and loaded
        and no KV slot is touched)."""
        cupy = self._cupy
        caller = cupy.cuda.get_current_stream()
        stream = self._capture_stream
        stream.wait_event(caller.record())
        with stream:
            self._stage(None, bucket)
            self._forward(config, bucket, limit)  # warm-up, not captured
            stream.synchronize()
            stream.begin_capture()
            try:
                logits = self._forward(config, bucket, limit)
            except BaseException:
                try:
                    stream.end_capture()
                except Exception:
                    pass  # the capture was already invalid; report the first error
                raise
            graph = stream.end_capture()
        caller.wait_event(stream.record())
        self._graphs[(bucket, limit)] = (graph, logits)
        return graph, logits

    def capture_all(self, config) -> None:
        started = time.perf_counter()
        for bucket, limit in self.graph_keys():
            if (bucket, limit) not in self._graphs:
                self.capture(config, bucket, limit)
        short = sorted(self.short_buckets)
        extra = (f", and for contexts up to {self.short_limit} tokens at batch sizes "
                 f"{', '.join(map(str, short))}" if short else "")
        self._log(f"CUDA graphs: captured {len(self.buckets)} decode batch sizes "
                  f"({', '.join(map(str, self.buckets))}){extra} in "
                  f"{time.perf_counter() - started:.2f} s")

    def reset(self) -> None:
        """Drop every captured graph (after a kernel switch such as gemm.set_skinny_gemm)."""
        self._cupy.cuda.get_current_stream().synchronize()
        self._graphs.clear()

    @property
    def metadata_bytes(self) -> int:
        return int(self._device.nbytes)

    @property
    def num_captured(self) -> int:
        return len(self._graphs)
