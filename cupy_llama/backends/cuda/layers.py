"""Launcher for layers.cu: every layer of a small decode step in one persistent kernel.

A decode step of at most MAX_ROWS sequences (one new token each) runs its layers as one
cooperative launch of LAYERS_BLOCKS_PER_SM blocks per SM, the phases of each layer
separated by a device-side counter instead of kernel boundaries (see layers.cu). Steps it
cannot take (more rows, prefill, other head sizes, too little shared memory) run the
layers op by op, as does every step with the switch off: `set_enabled(False)` or
CUPY_LLAMA_DECODE_LAYERS=0, and under the skinny GEMM switch "cublas" or "gemv" (gemm.py),
which ask for those kernels. Graphs bake in what was set when they were captured.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

from . import attention, gemm, launch
from .kernels import BF16, get_kernel

# layers.cu: LAYERS_WARPS, LAYERS_BLOCKS_PER_SM, LAYER_PHASES, DEFINE_DECODE_LAYERS lines
LAYERS_WARPS = 8
LAYERS_BLOCKS_PER_SM = 2
LAYER_PHASES = 5
HEAD_DIMS = (64, 128)
MAX_GROUP = 4
MAX_ROWS = 8  # one 8-column x tile in the products

_enabled = os.environ.get("CUPY_LLAMA_DECODE_LAYERS", "1") != "0"
_timings = None  # a device array the next launches note their phase ends in (perf.py)


def set_enabled(on: bool) -> None:
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


def record_phase_ends(timings) -> None:
    """From now on, launches write when every block had ended each phase into `timings`
    (uint64 [layers * LAYER_PHASES + 1], %globaltimer ns: entry 0 the start); None stops."""
    global _timings
    _timings = timings


class LayerWeights(ctypes.Structure):
    """layers.cu struct LayerWeights."""
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("input_norm", "qkv", "o_proj", "post_norm", "gate_up", "down", "k_cache",
                 "v_cache")]


class LayersArgs(ctypes.Structure):
    """The one by-value parameter of decode_layers_* (layers.cu struct LayersArgs)."""
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("layers", "residual", "q", "attn", "act", "partial_out", "partial_lse",
                 "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc",
                 "cos_sin", "counter", "split_counts", "timings")]
    _fields_ += [(name, ctypes.c_int) for name in
                 ("num_layers", "m_rows", "hidden", "intermediate", "num_heads", "num_kv_heads",
                  "head_dim", "block_shift", "max_blocks_per_seq", "num_splits")]
    _fields_ += [("eps", ctypes.c_float), ("scale_log2", ctypes.c_float)]


def kernel_name(head_dim: int) -> str:
    return f"decode_layers_d{head_dim}_g{MAX_GROUP}"


def shared_bytes(m_rows: int, config) -> int:
    """Dynamic shared memory: the products' staged x rows (the longest: hidden, q_size or
    intermediate) and their warp partials; attention's arrays are static."""
    longest = max(config.hidden_size, config.q_size, config.intermediate_size)
    return gemm.mma_shared_bytes(m_rows, longest, LAYERS_WARPS)


def shape_unsupported(config, block_size: int) -> str | None:
    """Why no step of this model can take the kernel, or None (pure arithmetic)."""
    group = config.num_attention_heads // config.num_key_value_heads
    if config.head_dim not in HEAD_DIMS:
        return f"head_dim in {HEAD_DIMS} (got {config.head_dim})"
    if group > MAX_GROUP:
        return f"at most {MAX_GROUP} query heads per kv head (got {group})"
    if block_size & (block_size - 1):
        return f"a power-of-two KV block size (got {block_size})"
    if config.hidden_size % 8 or config.intermediate_size % 8:
        return "hidden and intermediate sizes that are multiples of 8"
    return None


class DecodeLayers:
    """The per-model state of the kernel: the device table of each layer's weight and
    cache pointers, and the phase counter."""

    def __init__(self, config, weights: dict, kv_caches: list, block_size: int):
        import cupy
        self._cupy = cupy
        self.config = config
        self.block_size = block_size
        self.reason = shape_unsupported(config, block_size)
        if self.reason is None and gemm.device_limits()["capability"] < 80:
            self.reason = "compute capability 8.0 or newer"
        if self.reason is None and not launch.available():
            self.reason = "the CUDA driver's cuLaunchKernelEx"
        table = (LayerWeights * config.num_hidden_layers)()
        arrays = []
        for i, (k_cache, v_cache) in enumerate(kv_caches):
            layer = {name: weights[f"layers.{i}.{name}"] for name in
                     ("input_norm", "qkv", "o_proj", "post_norm", "gate_up", "down")}
            layer.update(k_cache=k_cache, v_cache=v_cache)
            arrays += layer.values()
            for name, array in layer.items():
                setattr(table[i], name, array.data.ptr)
        if self.reason is None and any(a.dtype != BF16 or a.data.ptr % 16 for a in arrays):
            self.reason = "16-byte aligned bf16 weights and caches"
        self._table = cupy.asarray(np.frombuffer(bytes(table), np.uint8))
        # the phase counter, then one split counter per (row, kv head)
        self._counters = cupy.zeros(1 + MAX_ROWS * config.num_key_value_heads, np.uint32)
        self._kernel = None if self.reason else get_kernel("layers", kernel_name(config.head_dim))
        self._rows_fit = {}  # m_rows -> whether every block fits on the GPU at once

    def unsupported(self, meta) -> str | None:
        """Why this step cannot take the kernel, or None."""
        if self.reason is not None:
            return self.reason
        if not (meta.is_decode_only and meta.num_tokens == meta.num_seqs):
            return "a decode step (one new token per sequence)"
        if not 0 < meta.num_seqs <= MAX_ROWS:
            return f"at most {MAX_ROWS} sequences (got {meta.num_seqs})"
        if not self._fits(meta.num_seqs):
            return (f"{LAYERS_BLOCKS_PER_SM} blocks per SM with {meta.num_seqs} rows in "
                    "shared memory")
        return None

    def _fits(self, m_rows: int) -> bool:
        if m_rows not in self._rows_fit:
            shared = shared_bytes(m_rows, self.config)
            kernel = self._kernel
            if shared + kernel.shared_size_bytes > 48 * 1024:
                kernel.max_dynamic_shared_size_bytes = max(
                    shared, kernel.max_dynamic_shared_size_bytes)
            per_sm = launch.resident_blocks_per_sm(kernel, LAYERS_WARPS * 32, shared)
            self._rows_fit[m_rows] = per_sm >= LAYERS_BLOCKS_PER_SM
        return self._rows_fit[m_rows]

    def run(self, meta, cos_sin, buffers, partial_out, partial_lse, num_splits: int) -> None:
        """All layers of the step: buffers["residual"] holds the embeddings and gets the last
        layer's output; q, attn and act are scratch (model/llama.buffer_shapes)."""
        cupy, config = self._cupy, self.config
        m_rows = meta.num_seqs
        parts = m_rows * config.num_attention_heads * num_splits
        if partial_out.size < parts * config.head_dim or partial_lse.size < parts:
            raise ValueError(f"partial_out/partial_lse: workspace too small for {m_rows} "
                             f"sequences x {config.num_attention_heads} heads x {num_splits} splits")
        args = LayersArgs(
            layers=self._table.data.ptr, residual=buffers["residual"].data.ptr,
            q=buffers["q"].data.ptr, attn=buffers["attn"].data.ptr, act=buffers["act"].data.ptr,
            partial_out=partial_out.data.ptr, partial_lse=partial_lse.data.ptr,
            positions=meta.positions.data.ptr, slot_mapping=meta.slot_mapping.data.ptr,
            block_tables=meta.block_tables.data.ptr, seq_lens=meta.seq_lens.data.ptr,
            query_start_loc=meta.query_start_loc.data.ptr, cos_sin=cos_sin.data.ptr,
            counter=self._counters.data.ptr, split_counts=self._counters[1:].data.ptr,
            timings=None if _timings is None else _timings.data.ptr,
            num_layers=config.num_hidden_layers, m_rows=m_rows, hidden=config.hidden_size,
            intermediate=config.intermediate_size, num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
            block_shift=self.block_size.bit_length() - 1,
            max_blocks_per_seq=meta.block_tables.shape[1], num_splits=num_splits,
            eps=config.rms_norm_eps, scale_log2=config.head_dim ** -0.5 * attention.LOG2_E)
        stream = cupy.cuda.get_current_stream().ptr
        cupy.cuda.runtime.memsetAsync(self._counters.data.ptr, 0, self._counters.nbytes, stream)
        blocks = LAYERS_BLOCKS_PER_SM * gemm.device_limits()["sms"]
        launch.launch(self._kernel, blocks, LAYERS_WARPS * 32, shared_bytes(m_rows, config),
                      stream, args, programmatic=False, cooperative=True)
