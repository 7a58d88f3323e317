"""Mistral (MistralForCausalLM): Llama with an optional sliding window over every layer
(`sliding_window`, null in most recent checkpoints)."""
from __future__ import annotations

from ..config import FULL_ATTENTION, SLIDING_ATTENTION, ConfigReader, ModelConfig
from .decoder import Decoder


class Mistral(Decoder):
    architectures = ("MistralForCausalLM",)
    model_types = ("mistral",)

    @classmethod
    def read_config(cls, reader: ConfigReader) -> ModelConfig:
        fields = reader.shared_fields(cls.architectures[0])
        window = reader.raw.get("sliding_window")
        kind = FULL_ATTENTION if window is None else SLIDING_ATTENTION
        layer_types = (kind,) * fields["num_hidden_layers"]
        return ModelConfig(**fields, hidden_act=reader.hidden_act(), layer_types=layer_types,
                           rope=reader.rope(layer_types), sliding_window=window)
