"""The model on the CPU: float32 weights, float32 paged KV cache, NumPy ops."""
from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..model.llama import buffer_shapes
from ..model.llama import forward as llama_forward
from ..model.rope import rope_cos_sin
from ..weights import Checkpoint, load_host_weights, plan_weight_blob
from .numpy_ops import NumpyOps

# Without an explicit num_kv_blocks the CPU cache gets this much memory at most.
DEFAULT_CPU_KV_BYTES = 2 << 30


class CpuBackend:
    device = "cpu"

    def __init__(self, config: ModelConfig, checkpoint: Checkpoint, *, max_model_len: int,
                 max_num_seqs: int, block_size: int = 16, num_kv_blocks: int | None = None,
                 log=None):
        self.config = config
        self.ops = NumpyOps()
        plan, _ = plan_weight_blob(config)
        self.weights = load_host_weights(checkpoint, plan, dtype=np.float32)
        self.cos_sin = rope_cos_sin(config, max_model_len)
        self.block_size = block_size
        bytes_per_block = 2 * config.num_hidden_layers * block_size * config.kv_size * 4
        if num_kv_blocks is None:
            wanted = max_num_seqs * -(-max_model_len // block_size)
            num_kv_blocks = max(1, min(wanted, DEFAULT_CPU_KV_BYTES // bytes_per_block))
        self.num_kv_blocks = num_kv_blocks
        shape = (num_kv_blocks, block_size, config.num_key_value_heads, config.head_dim)
        # NaN in never-written slots makes any stray read show up in the output
        self.kv_caches = [(np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32))
                          for _ in range(config.num_hidden_layers)]
        self.kv_cache_bytes = num_kv_blocks * bytes_per_block
        if log:
            log(f"KV cache: {num_kv_blocks} blocks x {block_size} tokens = "
                f"{num_kv_blocks * block_size} tokens ({self.kv_cache_bytes / 2**30:.2f} GiB, float32)")

    def buffers(self, num_tokens: int, num_seqs: int) -> dict:
        shapes = buffer_shapes(self.config, num_tokens, num_seqs)
        return {name: np.empty(shape, np.float32) for name, shape in shapes.items()}

    def close(self) -> None:
        """Drop the weights and the KV cache (the backend cannot run afterwards)."""
        self.weights, self.kv_caches = {}, []

    def forward(self, config: ModelConfig, batch):
        """One step through model/llama.py; logits [B, V] float32."""
        return llama_forward(self, config, batch)
