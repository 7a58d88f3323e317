"""Qwen2 and Qwen2.5 (Qwen2ForCausalLM): Llama with biases on the q, k and v products
(none on o_proj or the MLP). With use_sliding_window, layers from max_window_layers on
attend within sliding_window (every released checkpoint has it off)."""
from __future__ import annotations

from ..config import FULL_ATTENTION, SLIDING_ATTENTION, ConfigReader, ModelConfig
from ..errors import ConfigError
from .decoder import Decoder


def qwen_layer_types(reader: ConfigReader, num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """Qwen's layer types and window: config.json's layer_types where it lists them
    (transformers 5), else sliding from max_window_layers on when use_sliding_window."""
    window = reader.raw.get("sliding_window") if reader.flag("use_sliding_window") else None
    first_sliding = reader.raw.get("max_window_layers", num_layers)
    if window is not None and "layer_types" not in reader.raw and (
            isinstance(first_sliding, bool) or not isinstance(first_sliding, int)):
        raise ConfigError(f"config.json: max_window_layers must be an integer (the first "
                          f"layer of use_sliding_window's window), got {first_sliding!r}")
    default = tuple(SLIDING_ATTENTION if window is not None and i >= first_sliding
                    else FULL_ATTENTION for i in range(num_layers))
    layer_types = reader.layer_types(num_layers, default)
    return layer_types, window if SLIDING_ATTENTION in layer_types else None


class Qwen2(Decoder):
    architectures = ("Qwen2ForCausalLM",)
    model_types = ("qwen2",)

    @classmethod
    def read_config(cls, reader: ConfigReader) -> ModelConfig:
        fields = reader.shared_fields(cls.architectures[0])
        layer_types, window = qwen_layer_types(reader, fields["num_hidden_layers"])
        return ModelConfig(**fields, hidden_act=reader.hidden_act(), qkv_bias=True,
                           layer_types=layer_types, sliding_window=window,
                           rope=reader.rope(layer_types))
