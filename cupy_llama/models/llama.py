"""Llama (LlamaForCausalLM: Llama 2 and 3.x, SmolLM2, ...): the decoder as it is, with
RoPE of type default, linear, llama3 or yarn and no biases."""
from __future__ import annotations

from ..config import ConfigReader, ModelConfig
from .decoder import Decoder


class Llama(Decoder):
    architectures = ("LlamaForCausalLM",)
    model_types = ("llama",)

    @classmethod
    def read_config(cls, reader: ConfigReader) -> ModelConfig:
        for flag in ("attention_bias", "mlp_bias"):
            reader.refuse(flag, "cupy-llama runs Llama checkpoints without biases")
        fields = reader.shared_fields(cls.architectures[0])
        layer_types = reader.layer_types(fields["num_hidden_layers"],
                                         ("full_attention",) * fields["num_hidden_layers"])
        return ModelConfig(**fields, hidden_act=reader.hidden_act(),
                           layer_types=layer_types, rope=reader.rope(layer_types),
                           sliding_window=reader.raw.get("sliding_window")
                           if "sliding_attention" in layer_types else None)
