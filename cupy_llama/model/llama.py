"""The Llama forward pass, written once against a backend's ops (backends/base.py).

One call runs one step: the new tokens of every scheduled sequence (prefill chunks and
decode tokens alike) through all layers, writing their K/V into the paged cache, and
returns the logits of each sequence's last token.
"""
from __future__ import annotations

from ..backends.base import Backend, ForwardBatch
from ..config import ModelConfig

# Activation buffers of one step, name -> shape as a function of (T tokens, B sequences).
# The CUDA backend carves these out of one pool planned from max_num_batched_tokens and
# max_num_seqs; `qkv`/`gate_up` and `q`/`act` never live at the same time, so each pair
# may share memory (`x` and `attn` do: o_proj reads one while writing the other).
def buffer_shapes(config: ModelConfig, num_tokens: int, num_seqs: int) -> dict[str, tuple]:
    T, B, H = num_tokens, num_seqs, config.hidden_size
    qkv_width = config.q_size + 2 * config.kv_size
    return {
        "x": (T, H),                      # a sublayer's output (attention or MLP)
        "residual": (T, H),               # the residual stream (float32 on every backend)
        "h": (T, H),                      # normalized input of a sublayer
        "qkv": (T, qkv_width),            # fused projection output
        "q": (T, config.num_attention_heads, config.head_dim),  # rotated queries
        "attn": (T, config.q_size),       # attention output, heads concatenated
        "gate_up": (T, 2 * config.intermediate_size),
        "act": (T, config.intermediate_size),
        "last_h": (B, H),                 # each sequence's last hidden state
        "last_residual": (B, H),          # and its residual stream (float32)
        "logits": (B, config.vocab_size),  # float32
    }


def forward(backend: Backend, config: ModelConfig, batch: ForwardBatch):
    """Returns logits [B, V] float32 (a backend array, a view of the pool)."""
    ops, w = backend.ops, backend.weights
    meta = ops.upload(batch)
    buf = backend.buffers(batch.num_tokens, batch.num_seqs)
    eps = config.rms_norm_eps
    scale = config.head_dim ** -0.5

    ops.embedding(meta.token_ids, w["embed"], buf["residual"])  # residual: [T, H]
    ops.rms_norm(buf["residual"], w["layers.0.input_norm"], eps, buf["h"])
    for i in range(config.num_hidden_layers):
        k_cache, v_cache = backend.kv_caches[i]
        if i > 0:
            ops.add_rms_norm(buf["x"], buf["residual"], w[f"layers.{i}.input_norm"], eps, buf["h"])
        ops.linear(buf["h"], w[f"layers.{i}.qkv"], buf["qkv"])      # qkv: [T, (nh+2nkv) d]
        ops.rope_and_cache(buf["qkv"], meta, backend.cos_sin, k_cache, v_cache, buf["q"])
        ops.attention(buf["q"], k_cache, v_cache, meta, scale, buf["attn"])  # attn: [T, nh d]
        ops.linear(buf["attn"], w[f"layers.{i}.o_proj"], buf["x"])
        ops.add_rms_norm(buf["x"], buf["residual"], w[f"layers.{i}.post_norm"], eps, buf["h"])
        ops.linear(buf["h"], w[f"layers.{i}.gate_up"], buf["gate_up"])  # gate_up: [T, 2I]
        ops.silu_and_mul(buf["gate_up"], buf["act"])                     # act: [T, I]
        ops.linear(buf["act"], w[f"layers.{i}.down"], buf["x"])
    # only the last token of each sequence needs the final norm and the LM head
    ops.gather_rows(buf["x"], meta.last_token_indices, buf["last_h"])
    ops.gather_rows(buf["residual"], meta.last_token_indices, buf["last_residual"])
    ops.add_rms_norm(buf["last_h"], buf["last_residual"], w["final_norm"], eps, buf["last_h"])
    lm_head = w["lm_head"] if "lm_head" in w else w["embed"]  # tied embeddings
    ops.linear(buf["last_h"], lm_head, buf["logits"])  # logits: [B, V] float32
    return buf["logits"]
