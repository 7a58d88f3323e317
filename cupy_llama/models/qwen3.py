"""Qwen3, dense (Qwen3ForCausalLM): Llama with an RMSNorm over each q and k head (one
weight of head_dim for all heads) before RoPE, and head_dim given apart from
hidden_size / num_attention_heads (Qwen3-0.6B: 16 heads of 128 on a hidden size of
1,024)."""
from __future__ import annotations

from ..config import ConfigReader, ModelConfig
from .decoder import Decoder
from .qwen2 import qwen_layer_types


class Qwen3(Decoder):
    architectures = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)

    @classmethod
    def read_config(cls, reader: ConfigReader) -> ModelConfig:
        reader.refuse("attention_bias", "Qwen3's attention_bias puts a bias on o_proj too, "
                      "which cupy-llama does not run; every released Qwen3 has it off")
        fields = reader.shared_fields(cls.architectures[0])
        layer_types, window = qwen_layer_types(reader, fields["num_hidden_layers"])
        return ModelConfig(**fields, hidden_act=reader.hidden_act(), qk_norm=True,
                           layer_types=layer_types, sliding_window=window,
                           rope=reader.rope(layer_types))
