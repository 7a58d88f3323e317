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
# may share memory. `h`, `qkv`, `gate_up` and `last_h` are scratch of the composed
# sublayer ops (backends/base.py SublayerOps); a fused kernel never writes them.
def buffer_shapes(config: ModelConfig, num_tokens: int, num_seqs: int) -> dict[str, tuple]:
    T, B, H = num_tokens, num_seqs, config.hidden_size
    qkv_width = config.q_size + 2 * config.kv_size
    return {
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
    return forward_uploaded(backend, config, backend.ops.upload(batch))


def forward_uploaded(backend: Backend, config: ModelConfig, meta):
    """forward() of a step whose metadata is already where the ops read it: `meta` is what
    ops.upload returned (CUDA graphs pass their fixed device buffers); the ops take it as
    it is, and the step's sizes are its num_tokens and num_seqs."""
    buf = backend.buffers(meta.num_tokens, meta.num_seqs)
    embed(backend, meta, buf)
    for i in range(config.num_hidden_layers):
        attention_in(backend, config, meta, buf, i)
        attention(backend, config, meta, buf, i)
        attention_out_and_mlp(backend, config, buf, i)
    return head(backend, config, meta, buf)


# The pieces of a step, in order: embed; per layer attention_in, attention,
# attention_out_and_mlp; head. Only `attention` depends on how the step's tokens split into
# sequences; the CUDA backend replays the pieces between attentions from CUDA graphs
# captured per token count (backends/cuda/graphs.py).

def embed(backend: Backend, meta, buf) -> None:
    backend.ops.embedding(meta.token_ids, backend.weights["embed"], buf["residual"])  # residual: [T, H] float32


def attention_in(backend: Backend, config: ModelConfig, meta, buf, i: int) -> None:
    """Layer i's norm, qkv product, RoPE and cache write: q [T, nh, d]."""
    w, (k_cache, v_cache) = backend.weights, backend.kv_caches[i]
    backend.ops.norm_qkv_rope(buf["residual"], w[f"layers.{i}.input_norm"], config.rms_norm_eps,
                              w[f"layers.{i}.qkv"], meta, backend.cos_sin, k_cache, v_cache,
                              buf["q"], buf["h"], buf["qkv"])


def attention(backend: Backend, config: ModelConfig, meta, buf, i: int) -> None:
    """Layer i's attention over the paged cache: attn [T, nh * d]."""
    k_cache, v_cache = backend.kv_caches[i]
    backend.ops.attention(buf["q"], k_cache, v_cache, meta, config.head_dim ** -0.5, buf["attn"])


def attention_out_and_mlp(backend: Backend, config: ModelConfig, buf, i: int) -> None:
    """Layer i's output product added into the residual stream, then the MLP: norm, gate/up
    product and SiLU-and-mul (act: [T, I]), and the down product added likewise."""
    ops, w, layer = backend.ops, backend.weights, f"layers.{i}"
    ops.linear(buf["attn"], w[f"{layer}.o_proj"], buf["residual"], accumulate=True)
    ops.norm_gate_up_silu(buf["residual"], w[f"{layer}.post_norm"], config.rms_norm_eps,
                          w[f"{layer}.gate_up"], buf["act"], buf["h"], buf["gate_up"])
    ops.linear(buf["act"], w[f"{layer}.down"], buf["residual"], accumulate=True)


def head(backend: Backend, config: ModelConfig, meta, buf):
    """Only the last token of each sequence needs the final norm and the LM head: logits
    [B, V] float32."""
    ops, w = backend.ops, backend.weights
    ops.gather_rows(buf["residual"], meta.last_token_indices, buf["last_residual"])
    lm_head = w["lm_head"] if "lm_head" in w else w["embed"]  # tied embeddings
    ops.norm_linear(buf["last_residual"], w["final_norm"], config.rms_norm_eps, lm_head,
                    buf["logits"], buf["last_h"])
    return buf["logits"]
