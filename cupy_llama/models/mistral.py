"""Mistral (MistralForCausalLM): Llama with an optional sliding window over every layer
(`sliding_window`, null in most recent checkpoints), or over the layers `layer_types`
names sliding where the config lists them (Ministral's full and sliding layers); and
Mistral Small 3.x's image-text checkpoints (Mistral3ForConditionalGeneration), their
language model run on text."""
from __future__ import annotations

from ..config import FULL_ATTENTION, SLIDING_ATTENTION, ConfigReader, ModelConfig
from .decoder import Decoder
from .image_text import ImageText


class Mistral(Decoder):
    architectures = ("MistralForCausalLM",)
    model_types = ("mistral",)

    @classmethod
    def read_config(cls, reader: ConfigReader) -> ModelConfig:
        fields = reader.shared_fields(cls.architectures[0])
        window = reader.raw.get("sliding_window")
        kind = FULL_ATTENTION if window is None else SLIDING_ATTENTION
        # a listed layer_types decides (transformers reads such a config as Ministral's)
        layer_types = reader.layer_types(fields["num_hidden_layers"],
                                         (kind,) * fields["num_hidden_layers"])
        return ModelConfig(**fields, hidden_act=reader.hidden_act(), layer_types=layer_types,
                           rope=reader.rope(layer_types),
                           sliding_window=window if SLIDING_ATTENTION in layer_types else None)


# transformers' MistralConfig defaults: what an image-text checkpoint's text_config leaves out
TEXT_CONFIG_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10_000.0,
    "sliding_window": 4096, "bos_token_id": 1, "eos_token_id": 2,
}


class Mistral3(ImageText, Mistral):
    """Mistral Small 3.x (Mistral3ForConditionalGeneration), run on text
    (models/image_text.py)."""
    architectures = ("Mistral3ForConditionalGeneration",)
    model_types = ("mistral3",)
    text_model_type = "mistral"
    text_defaults = TEXT_CONFIG_DEFAULTS
