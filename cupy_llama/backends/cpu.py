"""The model on the CPU: float32 weights, float32 paged KV cache, NumPy ops."""
from __future__ import annotations

import numpy as np

from ..config import EngineConfig, ModelConfig
from ..util import cdiv, counted
from ..weights import Checkpoint, load_host_weights
from . import CPU_DEFAULTS
from .memory import MemoryPlan
from .numpy_ops import NumpyOps

# Without an explicit num_kv_blocks the CPU cache gets this much memory at most.
DEFAULT_CPU_KV_BYTES = 2 << 30


def kv_bytes_per_block(config: ModelConfig, block_size: int) -> int:
    return 2 * config.num_hidden_layers * block_size * config.kv_size * 4  # float32 K and V


def plan(model, engine_config, max_model_len: int) -> MemoryPlan:
    """float32 weights, one step's activations and the float32 KV cache of a model (a
    models/ Decoder): as many blocks as max_num_seqs sequences of max_model_len tokens
    fill, at most DEFAULT_CPU_KV_BYTES, unless num_kv_blocks says."""
    config = model.config
    block_size = engine_config.block_size
    per_block = kv_bytes_per_block(config, block_size)
    num_blocks = engine_config.num_kv_blocks
    if num_blocks is None:
        wanted = engine_config.max_num_seqs * cdiv(max_model_len, block_size)
        num_blocks = max(1, min(wanted, DEFAULT_CPU_KV_BYTES // per_block))
    weights, _ = model.weight_plan()
    weight_bytes = 4 * sum(int(np.prod(entry.shape)) for entry in weights.values())  # float32
    shapes = model.buffer_shapes(engine_config.max_num_batched_tokens,
                                 engine_config.max_num_seqs)
    buffer_bytes = sum(4 * int(np.prod(shape)) for shape in shapes.values())
    what = "float32" + (" (the FP8 projections as their codes' values, with row scales)"
                        if config.quantization else "")
    rows = (("weights", weight_bytes, what),
            ("buffers", buffer_bytes, f"one step of {engine_config.max_num_batched_tokens} "
                                      f"tokens, {engine_config.max_num_seqs} sequences"),
            ("KV cache", num_blocks * per_block,
             f"{counted(num_blocks, 'block')} x {block_size} tokens = "
             f"{num_blocks * block_size} tokens, float32"))
    return MemoryPlan(rows, num_blocks, block_size)


class CpuBackend:
    device = "cpu"

    def __init__(self, model, checkpoint: Checkpoint, *, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int = CPU_DEFAULTS["max_num_batched_tokens"],
                 block_size: int = 16, num_kv_blocks: int | None = None, log=None):
        """model: a models/ Decoder, whose weights the checkpoint holds."""
        config = model.config
        self.model, self.config = model, config
        self.ops = NumpyOps()
        weight_plan, _ = model.weight_plan()
        self.weights = load_host_weights(checkpoint, weight_plan, dtype=np.float32)
        self.rope_tables = model.rope_tables(max_model_len)
        self.block_size = block_size
        engine_config = EngineConfig(max_num_seqs=max_num_seqs, block_size=block_size,
                                     max_num_batched_tokens=max_num_batched_tokens,
                                     num_kv_blocks=num_kv_blocks)
        self.memory = plan(model, engine_config, max_model_len)
        self.num_kv_blocks = self.memory.num_kv_blocks
        shape = (self.num_kv_blocks, block_size, config.num_key_value_heads, config.head_dim)
        # Never-written slots hold NaN, so that any stray read shows up in the output. The
        # arrays are not filled up front (that would touch every page of what may be GiBs):
        # a block is filled with NaN when a step first names it (forward), so the memory in
        # use grows with the blocks in use.
        self.kv_caches = [(np.empty(shape, np.float32), np.empty(shape, np.float32))
                          for _ in range(config.num_hidden_layers)]
        self.nan_filled = np.zeros(self.num_kv_blocks, bool)  # blocks filled with NaN once
        self.kv_cache_bytes = self.num_kv_blocks * kv_bytes_per_block(config, block_size)
        if log:
            log(f"KV cache: {counted(self.num_kv_blocks, 'block')} x {block_size} tokens = "
                f"{self.memory.num_kv_tokens} tokens ({self.kv_cache_bytes / 2**30:.2f} GiB, float32)")

    def memory_plan(self) -> list[tuple[str, int, str]]:
        """(name, bytes, note) rows: weights, buffers, the KV cache."""
        return list(self.memory.rows)

    def buffers(self, num_tokens: int, num_seqs: int) -> dict:
        shapes = self.model.buffer_shapes(num_tokens, num_seqs)
        return {name: np.empty(shape, np.float32) for name, shape in shapes.items()}

    def close(self) -> None:
        """Drop the weights and the KV cache (the backend cannot run afterwards)."""
        self.weights, self.kv_caches = {}, []

    def forward(self, batch, prompt=None):
        """One step of the model (models/decoder.py); logits [B, V] float32. prompt: an
        interface.PromptLogprobRequest to fill, or None."""
        self.fill_new_blocks(batch.block_tables)
        return self.model.forward(self, batch, prompt)

    def fill_new_blocks(self, block_tables: np.ndarray) -> None:
        """Fill with NaN the blocks of these tables that no step has named before."""
        named = np.unique(block_tables[block_tables >= 0])
        new = named[~self.nan_filled[named]]
        if new.size:
            for k_cache, v_cache in self.kv_caches:
                k_cache[new] = np.nan
                v_cache[new] = np.nan
            self.nan_filled[new] = True
