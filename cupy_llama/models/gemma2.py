"""Gemma 2 (Gemma2ForCausalLM): Gemma 3's layer (models/gemma3.py) without the q/k norms,
with one RoPE table for every layer, sliding and full layers alternating (even layers
slide), and soft-capped attention scores (50) and logits (30) unless config.json says
otherwise."""
from __future__ import annotations

from ..config import FULL_ATTENTION, SLIDING_ATTENTION, ConfigReader, ModelConfig
from .decoder import Decoder
from .gemma3 import GEMMA_LAYER_TENSORS, gemma_fields


class Gemma2(Decoder):
    architectures = ("Gemma2ForCausalLM",)
    model_types = ("gemma2",)
    layer_tensors = GEMMA_LAYER_TENSORS

    @classmethod
    def read_config(cls, reader: ConfigReader) -> ModelConfig:
        fields = gemma_fields(reader, cls.architectures[0], attn_softcap=50.0,
                              final_softcap=30.0)
        layers = fields["num_hidden_layers"]
        default = tuple(SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(layers))
        layer_types = reader.layer_types(layers, default)
        window = reader.raw.get("sliding_window", 4096)
        return ModelConfig(**fields, layer_types=layer_types,
                           sliding_window=window if SLIDING_ATTENTION in layer_types else None,
                           rope=reader.rope(layer_types))
