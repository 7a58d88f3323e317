"""Gemma 3, text only (Gemma3ForCausalLM; the 1B checkpoint is of this class):
- RMSNorm as x * (1 + w), four a layer: input, on the attention output, before the MLP and
  on its output (the two on the outputs before the residual add);
- RMSNorm over each q and k head before RoPE, likewise (1 + w);
- GeGLU with the tanh GELU;
- embeddings times sqrt(hidden_size), rounded to the weights' dtype as transformers does;
- attention scale query_pre_attn_scalar ** -0.5;
- sliding and full layers (layer_types, or every sliding_window_pattern-th layer full),
  RoPE of base rope_local_base_freq on sliding layers and rope_theta with its
  rope_scaling on full ones;
- soft-capped attention scores and logits where the config sets them."""
from __future__ import annotations

from ..config import FULL_ATTENTION, SLIDING_ATTENTION, ConfigReader, ModelConfig, sqrt_hidden
from ..errors import ConfigError
from .decoder import LLAMA_LAYER_TENSORS, Decoder
from .image_text import ImageText

GEMMA_LAYER_TENSORS = {
    **LLAMA_LAYER_TENSORS,
    "attn_out_norm": ("post_attention_layernorm.weight",),
    "mlp_norm": ("pre_feedforward_layernorm.weight",),
    "mlp_out_norm": ("post_feedforward_layernorm.weight",),
}


def gemma_fields(reader: ConfigReader, architecture: str, attn_softcap=None,
                 final_softcap=None) -> dict:
    """What Gemma 2 and 3 share: the norms, the activation, the scales and the caps (the
    defaults: a cap for a config.json that leaves the field out)."""
    reader.refuse("attention_bias", "Gemma checkpoints have no biases")
    fields = reader.shared_fields(architecture)
    raw = reader.raw
    fields["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", True))
    head_dim = fields["head_dim"]
    scalar = reader.number("query_pre_attn_scalar", head_dim)
    if scalar is None or not scalar > 0:
        raise ConfigError(f"config.json: query_pre_attn_scalar must be > 0, got {scalar!r}")
    return dict(fields, norm_offset=1.0, sandwich_norms=True,
                hidden_act=reader.hidden_act("hidden_activation", "gelu_pytorch_tanh"),
                embed_scale=sqrt_hidden(fields["hidden_size"], fields["torch_dtype"]),
                attn_scale=scalar ** -0.5,
                attn_logit_softcap=reader.number("attn_logit_softcapping", attn_softcap),
                final_logit_softcap=reader.number("final_logit_softcapping", final_softcap))


class Gemma3(Decoder):
    architectures = ("Gemma3ForCausalLM",)
    model_types = ("gemma3_text",)
    layer_tensors = GEMMA_LAYER_TENSORS

    @classmethod
    def read_config(cls, reader: ConfigReader) -> ModelConfig:
        fields = gemma_fields(reader, cls.architectures[0])
        # Gemma 3 stores attn_logit_softcapping but never applies it (transformers passes no
        # softcap to its attention): ignored here likewise
        fields["attn_logit_softcap"] = None
        layers = fields["num_hidden_layers"]
        pattern = reader.raw.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ConfigError(f"config.json: sliding_window_pattern must be a positive "
                              f"integer, got {pattern!r}")
        default = tuple(FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION
                        for i in range(layers))
        layer_types = reader.layer_types(layers, default)
        window = reader.raw.get("sliding_window", 4096)
        return ModelConfig(**fields, qk_norm=True, layer_types=layer_types,
                           sliding_window=window if SLIDING_ATTENTION in layer_types else None,
                           rope=reader.rope(layer_types, default_theta=1_000_000.0,
                                            sliding_theta=10_000.0))


# transformers' Gemma3TextConfig defaults: an image-text checkpoint's text_config writes
# only the fields that differ from them (gemma-3-4b-it: its sizes, rope_scaling, sliding_window)
TEXT_CONFIG_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "rope_scaling": None,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "bos_token_id": 2, "eos_token_id": 1,
}


class Gemma3WithVision(ImageText, Gemma3):
    """Gemma 3's image-text checkpoints (Gemma3ForConditionalGeneration: the 4B, 12B and
    27B), their language model run on text (models/image_text.py)."""
    architectures = ("Gemma3ForConditionalGeneration",)
    model_types = ("gemma3",)
    text_model_type = "gemma3_text"
    text_defaults = TEXT_CONFIG_DEFAULTS
