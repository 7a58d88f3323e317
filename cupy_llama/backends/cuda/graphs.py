"""CUDA graphs for decode steps (docs/ARCHITECTURE.md, Decisions 8).

One graph per batch-size bucket holds a whole decode forward pass (every kernel and cuBLAS
call of the model's forward, models/decoder.py). A step of B sequences replays the smallest bucket >= B after one
asynchronous copy of its metadata into FIXED device buffers: each array sits at a fixed
offset (StepLayout, sized for the largest bucket), and block tables have the fixed width of
max_model_len. Rows past B are padding (PADDING). Nothing that
changes between steps is baked into a graph: the attention split count is the bucket's
fixed maximum and the kernel derives each sequence's split length from seq_lens on the
device. A bucket whose attention runs as thread-block clusters at short contexts
(CudaOps.decode_clusters) has a second graph, replayed while every sequence of the step
has at most attention.cluster_max_keys tokens. Capturing runs on a side stream; replays run on the
caller's stream, so they order with the eager work around them."""
from __future__ import annotations

import time

import numpy as np

from ...interface import ForwardBatch, StepLayout
from .attention import cluster_max_keys
from .ops import H2D, DeviceBatch, pinned_array, sync_event

FIRST_BUCKETS = (1, 2, 4, 8, 16, 24, 32)
BUCKET_STEP = 16
# what a padding row of a decode step holds, per array of one entry per row: token 0 at
# position 0, KV slot -1 (nothing is written), sequence length 0 (attention writes zeros
# and reads no block); query_start_loc and last_token_indices are fixed (one token per
# row), and block tables are written per row (see _stage)
PADDING = {"token_ids": 0, "positions": 0, "slot_mapping": -1, "seq_lens": 0}
FIXED = ("query_start_loc", "last_token_indices", "block_tables")


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
    CudaOps.decode_clusters) where that is a shorter context than the graphs' own, and not
    at the graphs' own context already."""
    if not 0 < short_limit < max_model_len:
        return frozenset()
    return frozenset(b for b in buckets
                     if clustered(b, short_limit) and not clustered(b, max_model_len))


def captured(stream, run):
    """(graph, what run returned) of run() captured on `stream`, which must be current.
    A failed capture is ended before the error goes on."""
    stream.begin_capture()
    try:
        result = run()
    except BaseException:
        try:
            stream.end_capture()
        except Exception:
            pass  # the capture was already invalid; report the first error
        raise
    return stream.end_capture(), result


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
        # every array of a step of n sequences, at a fixed offset (interface.py)
        self.layout = StepLayout(n, n, width)
        # block tables last: a step copies the buffer up to its own rows of them
        assert list(self.layout.shapes)[-1] == "block_tables"
        missing = [name for name in self.layout.shapes if name not in PADDING and name not in FIXED]
        if missing:
            raise ValueError(f"graphs.PADDING must say what a padding row holds in {missing}")
        self._host = pinned_array(cupy, self.layout.size, np.int32)
        # past a row's length its table is never read (see _stage); -1 so a stray read of a
        # column no step has written would show
        self._field("block_tables")[:] = -1
        self._device = cupy.zeros(self.layout.size, np.int32)
        # one new token per sequence: these two never change
        self._field("query_start_loc")[:] = np.arange(n + 1, dtype=np.int32)
        self._field("last_token_indices")[:] = np.arange(n, dtype=np.int32)
        self._copied = sync_event(cupy)  # the last metadata copy is over
        # a replay's metadata goes up on a stream of its own once the last replay is over,
        # so the copy runs beside the sampling kernel after it, not between it and the
        # next replay (docs/ARCHITECTURE.md, Decisions 8)
        self._stage_stream = cupy.cuda.Stream(non_blocking=True)
        self._replayed = sync_event(cupy)  # the last replay is over: it read the metadata
        self._capture_stream = cupy.cuda.Stream(non_blocking=True)
        self._graphs = {}  # (bucket, context limit) -> (graph, logits [bucket, V])

    # ---- metadata ----------------------------------------------------------------------
    def _field(self, name: str, rows: int | None = None) -> np.ndarray:
        """The host buffer's array `name` (its first rows only, where given)."""
        return self.layout.view(self._host, name, rows)

    def _device_batch(self, bucket: int, limit: int) -> DeviceBatch:
        return DeviceBatch(
            {name: self.layout.view(self._device, name, bucket) for name in self.layout.shapes},
            num_tokens=bucket, num_seqs=bucket, max_query_len=1, max_seq_len=limit,
            is_decode_only=True, lengths_on_device=True)

    def _stage(self, batch: ForwardBatch | None, bucket: int, stream=None) -> None:
        """Write the batch, padded to `bucket` rows, to the host buffer and copy it to the
        device on `stream` (default: the current one; batch None: all padding). Of the
        block tables only the batch's own rows are copied and only its own columns
        written: the kernels read a row's table up to its sequence length (0 for a padding
        row), whatever an earlier step left past that."""
        num_seqs = 0 if batch is None else batch.num_seqs
        self._copied.synchronize()  # the previous copy has read the host buffer
        for name, pad in PADDING.items():
            field = self._field(name, bucket)
            if batch is not None:
                field[:num_seqs] = getattr(batch, name)
            field[num_seqs:] = pad
        if batch is not None:
            self._field("block_tables", num_seqs)[:, :batch.width] = batch.block_tables
        nbytes = 4 * (self.layout.offsets["block_tables"] + num_seqs * self.width)
        stream = stream or self._cupy.cuda.get_current_stream()
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

    def run(self, batch: ForwardBatch):
        """Logits [B, V] float32 of a decode batch (a view of the pool)."""
        if not self.can_run(batch):
            raise ValueError(f"a batch of {batch.num_tokens} tokens for {batch.num_seqs} "
                             f"sequences (block tables {batch.block_tables.shape}) is not a "
                             f"decode batch of at most {self.max_bucket} sequences")
        bucket = self.bucket_for(batch.num_seqs)
        limit = self.limit_for(bucket, batch.max_seq_len)
        entry = self._graphs.get((bucket, limit)) or self.capture(bucket, limit)
        graph, logits = entry
        stream = self._cupy.cuda.get_current_stream()
        # the copy overwrites what the last replay read: it waits for that replay, and
        # this one for the copy
        self._stage_stream.wait_event(self._replayed)
        self._stage(batch, bucket, self._stage_stream)
        stream.wait_event(self._copied)
        graph.launch(stream)
        self._replayed.record(stream)
        return logits[:batch.num_seqs]

    def run_uncaptured(self, batch: ForwardBatch):
        """The same launches as the graph of batch's bucket, run eagerly (tests and timing:
        replay must give exactly these logits)."""
        bucket = self.bucket_for(batch.num_seqs)
        stream = self._cupy.cuda.get_current_stream()
        stream.wait_event(self._replayed)  # as run's copy: the last replay has read the buffer
        self._stage(batch, bucket)
        logits = self._forward(bucket, self.limit_for(bucket, batch.max_seq_len))
        self._replayed.record(stream)
        return logits[:batch.num_seqs]

    # ---- capture -----------------------------------------------------------------------
    def _forward(self, bucket: int, limit: int):
        backend = self._backend
        return backend.model.forward_uploaded(backend, self._device_batch(bucket, limit))

    def capture(self, bucket: int, limit: int):
        """Capture the decode graph of one bucket for steps of at most `limit` tokens per
        sequence (an all-padding warm-up run first, so every kernel is compiled and loaded
        and no KV slot is touched)."""
        cupy = self._cupy
        caller = cupy.cuda.get_current_stream()
        stream = self._capture_stream
        stream.wait_event(caller.record())
        with stream:
            self._stage(None, bucket)
            self._forward(bucket, limit)  # warm-up, not captured
            stream.synchronize()
            graph, logits = captured(stream, lambda: self._forward(bucket, limit))
        caller.wait_event(stream.record())
        self._graphs[(bucket, limit)] = (graph, logits)
        return graph, logits

    def capture_all(self) -> None:
        started = time.perf_counter()
        for bucket, limit in self.graph_keys():
            if (bucket, limit) not in self._graphs:
                self.capture(bucket, limit)
        short = sorted(self.short_buckets)
        extra = (f", and for contexts up to {self.short_limit} tokens at batch sizes "
                 f"{', '.join(map(str, short))}" if short else "")
        self._log(f"CUDA graphs: captured {len(self.buckets)} decode batch sizes "
                  f"({', '.join(map(str, self.buckets))}){extra} in "
                  f"{time.perf_counter() - started:.2f} s")

    def reset(self) -> None:
        """Drop every captured graph (CudaBackend.use_switches: other kernels)."""
        self._cupy.cuda.get_current_stream().synchronize()
        self._graphs.clear()

    @property
    def metadata_bytes(self) -> int:
        return int(self._device.nbytes)

    @property
    def num_captured(self) -> int:
        return len(self._graphs)


# ============================================================ steps of many tokens
# Token counts the step graphs are captured for: steps of up to 16 tokens run the fused
# skinny kernels, larger ones cuBLAS and the small kernels; past 256 tokens the buckets are
# at most 1.5 times apart, so padding costs little where the products take long.
STEP_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
# what a padding row of such a step holds: token 0 at position 0, KV slot -1 (nothing is
# written); the other arrays are the step's own (attention reads only its sequences' rows)
STEP_PADDING = {"token_ids": 0, "positions": 0, "slot_mapping": -1}


def step_buckets(max_num_tokens: int) -> list[int]:
    """STEP_BUCKETS up to max_num_tokens (and max_num_tokens itself below the largest)."""
    largest = min(max_num_tokens, STEP_BUCKETS[-1])
    return [b for b in STEP_BUCKETS if b < largest] + [largest]


class StepGraphs:
    """CUDA graphs for the steps decode graphs do not take: prefill chunks and steps that
    mix them with decode tokens, of up to STEP_BUCKETS[-1] tokens (docs/ARCHITECTURE.md,
    Decisions 8). Only attention depends on how a step's tokens split into sequences, so
    each piece of the forward pass between two attentions (models/decoder.py pieces: embed
    and layer 0's attention_in; layer i's attention_out_and_mlp and layer i + 1's
    attention_in; the last layer's attention_out_and_mlp) is captured once per bucket of
    token counts; a step
    replays them, padded to its bucket (STEP_PADDING), with attention and the LM head run
    eagerly on its own sequences in between. That is 17 graph launches and 16 attention
    launches in place of about 150 kernel launches from Python.

    A step of one sequence (a prompt, or a chunk of one, alone: a first token's step)
    replays one graph per bucket instead, pieces, attention and LM head together: its
    attention launches are captured for the bucket's token count, and the CTAs of row
    tiles past the step's own tokens return at once (attention.cu), so nothing of the
    sequence is baked in. The host then launches one graph, not 33 launches that a short
    prompt's GPU work waits for (benchmarks/NOTES.md, "Where a first token's time goes")."""

    def __init__(self, backend, log=None):
        import cupy
        self._cupy = cupy
        self._backend = backend
        self._log = log or (lambda message: None)
        self.buckets = step_buckets(backend.max_num_tokens)
        self.max_tokens = self.buckets[-1]
        self.width = backend.ops.max_blocks_per_seq
        self.layout = StepLayout(self.max_tokens, backend.max_num_seqs, self.width)
        assert list(self.layout.shapes)[-1] == "block_tables"  # see _stage
        self._host = pinned_array(cupy, self.layout.size, np.int32)
        self._device = cupy.zeros(self.layout.size, np.int32)
        self._copied = sync_event(cupy)
        self._capture_stream = cupy.cuda.Stream(non_blocking=True)
        self._graphs = {}  # bucket -> the graphs of its pieces, in order
        self._whole = {}   # bucket -> (graph of a one-sequence step, its logits [1, V])

    def can_run(self, batch: ForwardBatch) -> bool:
        return (not batch.is_decode_only and 0 < batch.num_tokens <= self.max_tokens
                and batch.num_seqs <= self._backend.max_num_seqs
                and batch.block_tables.ndim == 2 and batch.block_tables.shape[1] <= self.width)

    def bucket_for(self, num_tokens: int) -> int:
        return next(b for b in self.buckets if b >= num_tokens)

    def _view(self, name: str, rows: int):
        return self.layout.view(self._device, name, rows)

    def _stage(self, batch: ForwardBatch | None, bucket: int, empty_seqs: int = 0) -> None:
        """Write the batch's arrays to the host buffer, its token arrays padded to `bucket`
        rows, and copy them to the device on the current stream (batch None: all padding,
        and empty_seqs sequences of no tokens and no keys, which attention skips)."""
        self._copied.synchronize()  # the previous copy has read the host buffer
        layout, host = self.layout, self._host
        num_tokens = 0 if batch is None else batch.num_tokens
        for name, pad in STEP_PADDING.items():
            field = layout.view(host, name, bucket)
            if batch is not None:
                field[:num_tokens] = getattr(batch, name)
            field[num_tokens:] = pad
        num_seqs = empty_seqs
        if batch is not None:
            num_seqs = batch.num_seqs
            for name in ("query_start_loc", "seq_lens", "last_token_indices"):
                layout.view(host, name, num_seqs)[:] = getattr(batch, name)
            layout.view(host, "block_tables", num_seqs)[:, :batch.width] = batch.block_tables
        else:
            for name in ("query_start_loc", "seq_lens", "last_token_indices", "block_tables"):
                layout.view(host, name, num_seqs)[:] = 0
        nbytes = 4 * (layout.offsets["block_tables"] + num_seqs * self.width)
        stream = self._cupy.cuda.get_current_stream()
        self._cupy.cuda.runtime.memcpyAsync(self._device.data.ptr, host.ctypes.data, nbytes,
                                            H2D, stream.ptr)
        self._copied.record(stream)

    def _pieces_batch(self, bucket: int) -> DeviceBatch:
        """What the captured pieces read: the token arrays of `bucket` rows."""
        return DeviceBatch({name: self._view(name, bucket if name in STEP_PADDING else 1)
                            for name in self.layout.shapes},
                           num_tokens=bucket, num_seqs=1, max_query_len=bucket,
                           max_seq_len=bucket, is_decode_only=False)

    def capture(self, bucket: int) -> list:
        """Capture the pieces of one bucket (run once first on all-padding metadata, so
        every kernel is compiled and every cuBLAS algorithm chosen, and no KV slot is
        touched)."""
        cupy = self._cupy
        caller = cupy.cuda.get_current_stream()
        stream = self._capture_stream
        stream.wait_event(caller.record())
        backend = self._backend
        meta, buf = self._pieces_batch(bucket), backend.buffers(bucket, 1)
        pieces = backend.model.pieces(backend, meta, buf)
        with stream:
            self._stage(None, bucket)
            for piece in pieces:  # warm-up, not captured
                piece()
            stream.synchronize()
            graphs = [captured(stream, piece)[0] for piece in pieces]
        caller.wait_event(stream.record())
        self._graphs[bucket] = graphs
        return graphs

    def capture_whole(self, bucket: int) -> tuple:
        """Capture a one-sequence step of `bucket` tokens whole: (graph, its logits). The
        warm-up and the capture run on a sequence of no tokens, so attention reads no key
        and no KV slot is touched."""
        cupy = self._cupy
        caller = cupy.cuda.get_current_stream()
        stream = self._capture_stream
        stream.wait_event(caller.record())
        backend = self._backend
        model, meta, buf = backend.model, self._pieces_batch(bucket), backend.buffers(bucket, 1)
        pieces = model.pieces(backend, meta, buf)

        def step():
            pieces[0]()
            for i in range(model.config.num_hidden_layers):
                model.attention(backend, meta, buf, i)
                pieces[i + 1]()
            return model.head(backend, meta, buf)

        with stream:
            self._stage(None, bucket, empty_seqs=1)
            step()  # warm-up, not captured
            stream.synchronize()
            whole = captured(stream, step)
        caller.wait_event(stream.record())
        self._whole[bucket] = whole
        return whole

    def capture_all(self) -> None:
        started = time.perf_counter()
        for bucket in self.buckets:
            if bucket not in self._graphs:
                self.capture(bucket)
            if bucket not in self._whole:
                self.capture_whole(bucket)
        self._log(f"CUDA graphs: captured the pieces between attentions for steps of up to "
                  f"{', '.join(map(str, self.buckets))} tokens, and those steps whole for "
                  f"one sequence, in {time.perf_counter() - started:.2f} s")

    def run(self, batch: ForwardBatch, prompt=None):
        """Logits [B, V] float32 of a prefill or mixed step (a view of the pool). prompt:
        None, or an interface.PromptLogprobRequest, computed after the last layer as
        models/decoder.py forward_uploaded does."""
        if not self.can_run(batch):
            raise ValueError(f"a batch of {batch.num_tokens} tokens for {batch.num_seqs} "
                             f"sequences is not a step of at most {self.max_tokens} tokens "
                             "with a prefill in it")
        bucket = self.bucket_for(batch.num_tokens)
        stream = self._cupy.cuda.get_current_stream()
        if batch.num_seqs == 1 and prompt is None:
            graph, logits = self._whole.get(bucket) or self.capture_whole(bucket)
            self._stage(batch, bucket)
            graph.launch(stream)
            return logits
        graphs = self._graphs.get(bucket) or self.capture(bucket)
        self._stage(batch, bucket)
        B = batch.num_seqs
        meta = DeviceBatch(
            {name: self._view(name, batch.num_tokens if name in STEP_PADDING else B)
             for name in self.layout.shapes},
            num_tokens=batch.num_tokens, num_seqs=B, max_query_len=int(batch.max_query_len),
            max_seq_len=int(batch.max_seq_len), is_decode_only=False)
        backend = self._backend
        model = backend.model
        buf = backend.buffers(bucket, B)
        # the prompt rows to score go up before the graphs are queued: an upload waits for
        # what its stream has queued already
        staged = None if prompt is None else backend.ops.device_array(
            np.stack([prompt.rows, prompt.targets]))
        graphs[0].launch(stream)  # the pieces' walk of models/decoder.py forward_uploaded
        for i in range(model.config.num_hidden_layers):
            model.attention(backend, meta, buf, i)
            graphs[i + 1].launch(stream)
        if prompt is not None:
            model.prompt_logprobs(backend, meta, buf, prompt, staged)
        return model.head(backend, meta, buf)

    @property
    def metadata_bytes(self) -> int:
        return int(self._device.nbytes)

    @property
    def num_captured(self) -> int:
        return sum(len(graphs) for graphs in self._graphs.values()) + len(self._whole)
