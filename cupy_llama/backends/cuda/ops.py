"""CudaOps: the ops of interface.py on the GPU (bf16 as uint16, fp32 math).

Step metadata and sampling settings reach the device through pinned staging buffers and
one asynchronous copy each; only the sampled token ids come back (pinned, then one
synchronize). The buffers and CUDA events are made once, in the constructor (an event is
recorded again every step, and a wait or synchronize on it takes its latest record), the
sampling settings' views once per batch size."""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ...interface import KERNEL_ROWS, STEP_ARRAYS, ForwardBatch, Logprobs, SamplingTensors, StepLayout, SublayerOps
from . import attention as attention_kernels
from . import elementwise, launch
from . import logprobs as logprob_kernels
from . import sampling as sampling_kernels
from .device import device_limits, import_cupy
from .gemm import Products
from .switches import KernelSwitches

H2D, D2H = 1, 2  # cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost


class DeviceBatch:
    """ForwardBatch on the device: each of STEP_ARRAYS (attributes of the same names) as an
    int32 cupy view of one metadata buffer, and the step's sizes as host ints.
    lengths_on_device (CUDA-graph decode): max_seq_len is max_model_len, so the split count
    is the one the longest context would get, and each sequence's split length comes from
    its seq_len on the device, since the graph bakes in every launch argument."""

    def __init__(self, arrays: dict, *, num_tokens: int, num_seqs: int, max_query_len: int,
                 max_seq_len: int, is_decode_only: bool, lengths_on_device: bool = False):
        assert arrays.keys() == {name for name, _ in STEP_ARRAYS}
        self.__dict__.update(arrays)
        self.num_tokens, self.num_seqs = num_tokens, num_seqs
        self.max_query_len, self.max_seq_len = max_query_len, max_seq_len
        self.is_decode_only, self.lengths_on_device = is_decode_only, lengths_on_device


@functools.lru_cache(maxsize=1024)
def step_layout(num_tokens: int, num_seqs: int, width: int) -> StepLayout:
    """The packed layout of a step of these sizes (made once per size)."""
    return StepLayout(num_tokens, num_seqs, width)


def pinned_array(cupy, count: int, dtype) -> np.ndarray:
    """A numpy array in page-locked host memory (fast, asynchronous copies)."""
    dtype = np.dtype(dtype)
    memory = cupy.cuda.alloc_pinned_memory(max(1, count) * dtype.itemsize)
    return np.frombuffer(memory, dtype, count)


class CudaOps(SublayerOps):
    act_dtype = np.uint16

    def __init__(self, *, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 num_heads: int, head_dim: int, max_model_len: int, workspace=None,
                 switches: KernelSwitches = KernelSwitches(), dequantized=None,
                 fp8_activations=None, slot_state=None):
        """workspace: (partial_out, partial_lse) flat float32 device arrays for split-KV
        decode (sized by attention.workspace_sizes), or None to allocate them here.
        switches: which kernels run (switches.py); fixed for the life of the ops.
        dequantized, fp8_activations: scratch for FP8 weights past 16 rows (gemm.Products)."""
        cupy = import_cupy()
        self._cupy = cupy
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_model_len = max_model_len
        self.switches = switches
        # what the switches ask for, where the GPU can
        self.programmatic = switches.programmatic and launch.launch_attributes_usable()
        self.clusters = switches.clusters and launch.launch_attributes_usable()
        # a decode step's q/k head norms, RoPE and cache write in the attention kernel
        # (norm_qkv_rope hands them to the next attention call)
        self.head_norm_attention = switches.head_norm_attention
        self._rope: tuple | None = None  # (meta, k_cache, DecodeRope) until attention
        self.products = Products(switches.skinny_gemm, self.programmatic, clusters=self.clusters,
                                 dequantized=dequantized, fp8_activations=fp8_activations,
                                 fp8_gemm=switches.fp8_gemm)
        # a step's arrays, packed back to back at the step's own sizes (StepLayout)
        capacity = StepLayout(max_num_tokens, max_num_seqs, max_blocks_per_seq).size
        self._meta_host = pinned_array(cupy, capacity, np.int32)
        self._meta_device = cupy.empty(capacity, np.int32)
        self._meta_copied = sync_event(cupy)  # the last metadata copy has read the host buffer
        # sampling settings: the kernel's rows of SAMPLING_ROWS (widest first), then the rows
        # that ask for log-probabilities, [max_num_seqs] each (SAMPLING_FIELDS).
        # Their copy and the tokens' copy back run on a stream of their own, off the steps'
        # stream: the settings copy is issued while the step's forward pass still runs, before
        # the sampling kernel that reads them, and the tokens go back while the next step
        # runs (sample_async). One settings buffer on each side suffices (see sample_async);
        # the tokens come back to two host buffers in turn, as step k's are read only after
        # step k + 1 is queued.
        n = max_num_seqs
        self._copy_stream = cupy.cuda.Stream(non_blocking=True)
        self._sampling_host = pinned_array(cupy, self.SAMPLING_BYTES * n, np.uint8)
        self._sampling_device = cupy.empty(self.SAMPLING_BYTES * n, np.uint8)
        self._sampling_view_cache = {}  # B -> _sampling_views(B)
        self._sampling_copied = sync_event(cupy)  # copy stream: the settings copy is done
        self._sampled = sync_event(cupy)  # step stream: the sampling kernel is done
        self._tokens_device = cupy.zeros(n, np.int32)  # the latest step's tokens, kept for the next
        self._tokens_host = [pinned_array(cupy, n, np.int32) for _ in range(2)]
        self._token_copies = [sync_event(cupy) for _ in range(2)]  # copy stream: each filled
        self._turn = 0
        # sampling.SlotState of the penalties, biases and bans (the backend allocates it
        # with the rest; made when a step first needs it where none is given)
        self._slot_state = slot_state
        # log-probabilities of the rows that ask ([R, 1 + k], R <= n), back with the tokens
        width = n * (1 + logprob_kernels.MAX_K)
        self._logprob_values = cupy.empty(width, np.float32)
        self._logprob_ids = cupy.empty(width, np.int32)
        self._logprobs_host = [(pinned_array(cupy, width, np.float32),
                                pinned_array(cupy, width, np.int32)) for _ in range(2)]
        # structured outputs: a step's mask rows of its two launches ([2, n] int32: the
        # deferred rows skipped, then only they drawn) and its bitmask rows, made at the
        # first constrained step (sample_masked). Their copies run on the copy stream, like
        # the settings', so the buffers are free again for the same reasons (sample_async)
        self._mask_rows_host = pinned_array(cupy, 2 * n, np.int32).reshape(2, n)
        self._mask_rows_device = cupy.empty((2, n), np.int32)
        self._bitmask_host = self._bitmask_device = None
        self._masks_copied = sync_event(cupy)  # copy stream: the masks of launch 2 are there

        sizes = attention_kernels.workspace_sizes(max_num_seqs, num_heads, head_dim, max_model_len)
        if workspace is None:
            workspace = (cupy.empty(sizes[0], np.float32), cupy.empty(sizes[1], np.float32))
        self._partial_out, self._partial_lse = workspace
        self.max_decode_splits = attention_kernels.max_decode_splits(max_model_len)
        self.num_sms = device_limits()["sms"]
        self._decode_split_key = self._decode_split = None  # the last decode_split

    def empty(self, shape, dtype=None):
        return self._cupy.empty(shape, dtype=self.act_dtype if dtype is None else dtype)

    def upload(self, batch: ForwardBatch) -> DeviceBatch:
        T, B = batch.num_tokens, batch.num_seqs
        width = batch.block_tables.shape[1] if batch.block_tables.ndim == 2 else -1
        if T > self.max_num_tokens or B > self.max_num_seqs or not 0 <= width <= self.max_blocks_per_seq:
            raise ValueError(
                f"batch of {T} tokens, {B} sequences, block tables {batch.block_tables.shape} "
                f"exceeds the buffers ({self.max_num_tokens} tokens, {self.max_num_seqs} "
                f"sequences, {self.max_blocks_per_seq} blocks per sequence)")
        layout = step_layout(T, B, width)
        self._meta_copied.synchronize()  # the staging buffer is free again
        layout.write(self._meta_host, batch)
        stream = self._cupy.cuda.get_current_stream()
        self._cupy.cuda.runtime.memcpyAsync(self._meta_device.data.ptr, self._meta_host.ctypes.data,
                                            layout.size * 4, H2D, stream.ptr)
        self._meta_copied.record(stream)
        return DeviceBatch(layout.views(self._meta_device), num_tokens=T, num_seqs=B,
                           max_query_len=int(batch.max_query_len),
                           max_seq_len=int(batch.max_seq_len),
                           is_decode_only=bool(batch.is_decode_only))

    def embedding(self, token_ids, table, out, *, scale=None):
        elementwise.embedding(token_ids, table, out, pending_tokens=self._tokens_device,
                              scale=scale)

    def rms_norm(self, x, weight, eps, out, *, offset=0.0):
        elementwise.rms_norm(x, weight, eps, out, offset)

    def add_rms_norm(self, x, weight, eps, residual, *, offset=0.0, out=None):
        elementwise.add_rms_norm(x, weight, eps, residual, offset, self.programmatic, out)

    def linear(self, x, weight, out, accumulate=False):
        self.products.linear(x, weight, out, accumulate)

    # the sublayer openers: one fused kernel for steps of at most 16 tokens (gemm.py),
    # else composed (SublayerOps). A sublayer that joins first (added) joins inside that
    # kernel where it can take the add too (gemm.fuses_added), else through add_rms_norm
    # before it
    def norm_linear(self, x, norm_weight, eps, weight, out, h, *, offset=0.0, added=None):
        if self.products.norm_linear(x, norm_weight, eps, weight, out, offset, added):
            return
        x = self.join(x, added, eps, offset)
        if added is None or not self.products.norm_linear(x, norm_weight, eps, weight, out,
                                                          offset):
            super().norm_linear(x, norm_weight, eps, weight, out, h, offset=offset)

    def norm_gate_up_act(self, x, norm_weight, eps, weight, out, h, gate_up, *, offset=0.0,
                         act="silu", added=None):
        if self.products.norm_gate_up_act(x, norm_weight, eps, weight, out, offset, act, added):
            return
        x = self.join(x, added, eps, offset)
        if added is None or not self.products.norm_gate_up_act(x, norm_weight, eps, weight,
                                                               out, offset, act):
            super().norm_gate_up_act(x, norm_weight, eps, weight, out, h, gate_up,
                                     offset=offset, act=act)

    def norm_qkv_rope(self, x, norm_weight, eps, weight, meta, cos_sin, k_cache, v_cache,
                      q_out, h, qkv, *, offset=0.0, bias=None, head_norm=None, added=None):
        # head norms need a whole head in one place, which the fused product's tiles never
        # hold: the norm and product fuse, then in a decode step the attention kernel
        # norms, rotates and writes the cache (attention.DecodeRope), else the rope kernel
        if (head_norm is not None and bias is None and meta.is_decode_only
                and self.head_norm_attention):
            self.norm_linear(x, norm_weight, eps, weight, qkv, h, offset=offset, added=added)
            self._rope = (meta, k_cache, attention_kernels.DecodeRope(
                qkv, head_norm, cos_sin, meta.positions, meta.slot_mapping))
            return
        rope = (meta.positions, meta.slot_mapping, cos_sin, k_cache, v_cache, q_out, offset,
                bias)
        if head_norm is None and self.products.norm_qkv_rope(x, norm_weight, eps, weight,
                                                             *rope, added=added):
            return
        x = self.join(x, added, eps, offset)
        if (head_norm is not None or added is None
                or not self.products.norm_qkv_rope(x, norm_weight, eps, weight, *rope)):
            super().norm_qkv_rope(x, norm_weight, eps, weight, meta, cos_sin, k_cache,
                                  v_cache, q_out, h, qkv, offset=offset, bias=bias,
                                  head_norm=head_norm)

    def rope_and_cache(self, qkv, meta, cos_sin, k_cache, v_cache, q_out, *, bias=None,
                       head_norm=None):
        elementwise.rope_and_cache(qkv, meta.positions, meta.slot_mapping, cos_sin,
                                   k_cache, v_cache, q_out, bias, head_norm, self.programmatic)

    def attention(self, q, k_cache, v_cache, meta, scale, out, *, window=None, softcap=None):
        rope = None
        if self._rope is not None:  # this layer's, from norm_qkv_rope just before
            rope_meta, rope_k_cache, rope = self._rope
            self._rope = None
            if rope_meta is not meta or rope_k_cache is not k_cache:
                raise RuntimeError("attention: the step's last norm_qkv_rope was another "
                                   "layer's or step's; each layer's attention must follow it")
        num_splits, clusters = 1, False
        if meta.is_decode_only:  # a windowed layer's keys are its window at most
            seen = meta.max_seq_len if window is None else min(meta.max_seq_len, window)
            num_splits, clusters = self.decode_split(
                meta.num_seqs, q.shape[1], k_cache.shape[2], q.shape[2], seen)
        attention_kernels.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, out,
            scale=scale, max_query_len=meta.max_query_len,
            max_seq_len=None if meta.lengths_on_device else meta.max_seq_len,
            num_splits=num_splits, partial_out=self._partial_out, partial_lse=self._partial_lse,
            clusters=clusters, programmatic=self.programmatic, window=window, softcap=softcap,
            num_sms=self.num_sms, rope=rope)

    def decode_split(self, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                     max_seq_len: int) -> tuple[int, bool]:
        """(num_splits, clusters) of a decode batch's attention. Every layer of a step asks
        with the same shapes: worked out once, for the first."""
        key = (num_seqs, num_heads, num_kv_heads, head_dim, max_seq_len)
        if key != self._decode_split_key:
            num_splits = attention_kernels.choose_decode_splits(
                num_seqs, num_kv_heads, num_heads // num_kv_heads, max_seq_len, self.num_sms,
                self.max_decode_splits)
            clusters = self.decode_clusters(num_seqs, num_heads, num_kv_heads, head_dim,
                                            max_seq_len)
            self._decode_split_key, self._decode_split = key, (num_splits, clusters)
        return self._decode_split

    def decode_clusters(self, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                        max_seq_len: int) -> bool:
        """Whether a decode batch whose longest sequence has max_seq_len tokens runs its
        attention as thread-block clusters (where it splits the keys at all)."""
        return self.clusters and attention_kernels.decode_clusters_pay(
            num_seqs=num_seqs, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, max_seq_len=max_seq_len, num_sms=self.num_sms)

    def act_and_mul(self, gate_up, out, act="silu"):
        elementwise.act_and_mul(gate_up, out, act)

    def softcap(self, x, cap):
        elementwise.softcap(x, cap)

    def gather_rows(self, x, indices, out):
        elementwise.gather_rows(x, indices, out)

    def device_array(self, host):
        return self._cupy.asarray(host)

    def token_logprobs(self, logits, targets, k, values, ids, ranks):
        rows = self._cupy.arange(logits.shape[0], dtype=np.int32)
        logprob_kernels.logprobs(logits, rows, targets, k, values, ids, ranks)

    def sample(self, logits, sampling: SamplingTensors) -> np.ndarray:
        return self.sample_async(logits, sampling).get()

    # the settings buffers: max_num_seqs of each of the kernel's SAMPLING_ROWS, row after
    # row in the table's order (the layout sampling.cu's SamplingRows reads; widest first,
    # so every array is aligned); logprob_rows: the rows that ask for log-probabilities,
    # first R entries
    SAMPLING_FIELDS = tuple((row.name, row.dtype) for row in KERNEL_ROWS) + (
        ("logprob_rows", np.int32),)
    SAMPLING_BYTES = sum(np.dtype(dtype).itemsize for _, dtype in SAMPLING_FIELDS)  # per sequence

    def _sampling_views(self, B: int) -> tuple[dict, dict, Any]:
        """The host and device views ({field: array}) of the first B entries of each settings
        field, and the first B device tokens: made once per B."""
        views = self._sampling_view_cache.get(B)
        if views is None:
            host, device, start = {}, {}, 0
            for name, dtype in self.SAMPLING_FIELDS:
                stop = start + B * np.dtype(dtype).itemsize
                host[name] = self._sampling_host[start:stop].view(dtype)
                device[name] = self._sampling_device[start:stop].view(dtype)
                start += self.max_num_seqs * np.dtype(dtype).itemsize
            views = self._sampling_view_cache[B] = (host, device, self._tokens_device[:B])
        return views

    def sample_async(self, logits, sampling: SamplingTensors) -> "PendingTokens":
        """Queue the sampling kernel and the copy of its tokens to the host; returns at once.
        The tokens stay on the device too, where the next step's embedding reads them."""
        B, n = logits.shape[0], self.max_num_seqs
        if B > n:
            raise ValueError(f"logits: {B} rows exceeds max_num_seqs {n}")
        host, device = self._sampling_host, self._sampling_device
        # the host buffer is free once the last settings copy is done; that copy is queued
        # right behind the token copy of two steps ago, whose tokens the caller already has
        # (PendingTokens), so this hardly ever waits
        self._sampling_copied.synchronize()
        host_views, on_device, tokens = self._sampling_views(B)
        logprob_rows, k = sampling.logprob_rows()
        R = logprob_rows.size
        for name, view in host_views.items():
            if name == "logprob_rows":
                view[:R] = logprob_rows
            else:
                view[:] = sampling.row(name)
        stream, copy = self._cupy.cuda.get_current_stream(), self._copy_stream
        runtime = self._cupy.cuda.runtime
        # the settings: the copy stream runs in order, and this copy is queued behind the last
        # token copy, which waited for the last sampling kernel: no kernel still reads the
        # device buffer when it is overwritten. The kernel waits for this copy, so also for
        # that token copy: it overwrites the device tokens only once they were read. (Both
        # copies must stay on one stream for that.) The forward pass queued before this
        # call is still running, so the copy is over before this step's kernel comes up
        runtime.memcpyAsync(device.data.ptr, host.ctypes.data, self.SAMPLING_BYTES * n, H2D,
                            copy.ptr)
        deferred = sampling.deferred is not None and bool(sampling.deferred.any())
        if deferred:  # constrained rows: skipped here, drawn by sample_masked
            mask_rows = self._upload_mask_rows(
                0, np.where(sampling.deferred, sampling_kernels.MASK_SKIP, -1))
        self._sampling_copied.record(copy)
        stream.wait_event(self._sampling_copied)
        counts = None
        if sampling.processes_logits:
            # penalties, biases and bans: the slots' state made anew where a sequence took
            # its slot (reading the last step's tokens, which this step's sampling kernel
            # overwrites only after), then applied to the logits in place; the sampling
            # kernel counts the kept tokens (docs/ARCHITECTURE.md, "Penalties")
            if self._slot_state is None:
                self._slot_state = sampling_kernels.SlotState(self._cupy, n, logits.shape[1])
            sampling_kernels.reset_state(self._slot_state, sampling.resets,
                                         self._tokens_device)
            sampling_kernels.process_logits(logits, device, n, self._slot_state)
            counts = self._slot_state.counts
        pending = PendingTokens()
        if deferred:  # the tokens are copied back once sample_masked has drawn the rest
            sampling_kernels.sample_settings(logits, device, n, tokens, counts=counts,
                                             mask_rows=mask_rows)
            pending.deferred_inputs = (logits, B, logprob_rows, k, counts)
            return pending
        sampling_kernels.sample_settings(logits, device, n, tokens, counts=counts)
        self._return_tokens(pending, logits, B, logprob_rows, k)
        return pending

    def _upload_mask_rows(self, launch: int, mask_rows: np.ndarray):
        """Queue the copy of mask_rows [B] for the step's launch 0 or 1 on the copy stream
        (whoever launches waits for it); their device view."""
        B = mask_rows.shape[0]
        self._mask_rows_host[launch, :B] = mask_rows
        self._cupy.cuda.runtime.memcpyAsync(
            self._mask_rows_device[launch].data.ptr, self._mask_rows_host[launch].ctypes.data,
            4 * B, H2D, self._copy_stream.ptr)
        return self._mask_rows_device[launch, :B]

    def sample_masked(self, pending: "PendingTokens", rows, bitmask) -> None:
        logits, B, logprob_rows, k, counts = pending.deferred_inputs
        rows = np.asarray(rows, dtype=np.int32)
        R, words = rows.size, bitmask.shape[1]
        stream = self._cupy.cuda.get_current_stream()
        if R:
            # the host buffers are free: their last copies were queued before the last
            # step's token copy, which the caller has waited for (PendingTokens.get) before
            # it draws this step; the device buffers too: the kernel that read them ran
            # before that token copy, which this step's copies follow on the copy stream
            if self._bitmask_host is None or self._bitmask_host.shape[1] != words:
                self._bitmask_host = pinned_array(
                    self._cupy, self.max_num_seqs * words, np.uint32).reshape(-1, words)
                self._bitmask_device = self._cupy.empty((self.max_num_seqs, words), np.uint32)
            mask_rows = np.full(B, sampling_kernels.MASK_SKIP, np.int32)
            mask_rows[rows] = np.arange(R, dtype=np.int32)
            device_rows = self._upload_mask_rows(1, mask_rows)
            self._bitmask_host[:R] = bitmask[:R]
            self._cupy.cuda.runtime.memcpyAsync(
                self._bitmask_device.data.ptr, self._bitmask_host.ctypes.data,
                4 * R * words, H2D, self._copy_stream.ptr)
            self._masks_copied.record(self._copy_stream)
            stream.wait_event(self._masks_copied)
            tokens = self._sampling_views(B)[2]
            # the settings sample_async staged: no settings copy comes before the next step's
            sampling_kernels.sample_settings(
                logits, self._sampling_device, self.max_num_seqs, tokens, counts=counts,
                bitmask=self._bitmask_device[:R], mask_rows=device_rows)
        self._return_tokens(pending, logits, B, logprob_rows, k)

    def _return_tokens(self, pending: "PendingTokens", logits, B: int, logprob_rows, k: int):
        """Queue the log-probabilities of the rows that ask and the copy of a step's tokens
        (and those) to the host, into pending."""
        stream, copy = self._cupy.cuda.get_current_stream(), self._copy_stream
        runtime = self._cupy.cuda.runtime
        _, on_device, tokens = self._sampling_views(B)
        d = on_device
        R = logprob_rows.size
        values = self._logprob_values[:R * (1 + k)].reshape(R, 1 + k)
        ids = self._logprob_ids[:R * (1 + k)].reshape(R, 1 + k)
        if R:
            logprob_kernels.logprobs(logits, d["logprob_rows"][:R], tokens, k, values, ids)
        self._sampled.record(stream)
        # the tokens: copied back while the step stream goes on to the next step
        copy.wait_event(self._sampled)
        turn, self._turn = self._turn, self._turn ^ 1
        tokens_host, copied = self._tokens_host[turn], self._token_copies[turn]
        runtime.memcpyAsync(tokens_host.ctypes.data, tokens.data.ptr, 4 * B, D2H, copy.ptr)
        logprobs = None
        if R:  # the same stream, the same turn's buffers: ordered like the tokens
            values_host, ids_host = self._logprobs_host[turn]
            for host, device in ((values_host, values), (ids_host, ids)):
                runtime.memcpyAsync(host.ctypes.data, device.data.ptr, device.nbytes, D2H, copy.ptr)
            logprobs = (logprob_rows, values_host[:R * (1 + k)].reshape(R, 1 + k),
                        ids_host[:R * (1 + k)].reshape(R, 1 + k))
        copied.record(copy)
        pending.attach(copied, tokens_host[:B], logprobs)


def sync_event(cupy):
    """A CUDA event to wait on, never timed (cheaper to record)."""
    return cupy.cuda.Event(disable_timing=True)


class PendingTokens:
    """Token ids on their way to a pinned host buffer; `get` waits for them. Call it before
    the second sample_async after this one, which fills the buffer and records the event
    again."""

    prompt_logprobs = None  # interface.PromptLogprobRequest of the step, where it had one

    def __init__(self):
        self._tokens = self._logprobs = None
        # sample_async's, while deferred rows wait for sample_masked (interface.py)
        self.deferred_inputs = None

    def attach(self, copied, host_tokens: np.ndarray, logprobs=None) -> None:
        """The copies are queued. logprobs: None, or (rows, values, ids) with values and ids
        host views being filled."""
        self._copied = copied  # event recorded after the device-to-host copies
        self._host = host_tokens
        self._host_logprobs = logprobs

    def get(self) -> np.ndarray:
        if self._tokens is None:
            self._copied.synchronize()
            self._tokens = self._host.copy()  # the buffer is reused two steps later
            if self._host_logprobs is not None:
                rows, values, ids = self._host_logprobs
                self._logprobs = Logprobs(rows, ids.copy(), values.copy())
        return self._tokens

    def logprobs(self) -> Logprobs | None:
        """The log-probabilities of the rows that asked (None where none did); after get()."""
        return self._logprobs
