"""The model families cupy-llama runs, one file each, and the registry that picks one for
a checkpoint: config.json's architectures[0], or its model_type when it names none.

Adding a family is a file here with a Decoder subclass (decoder.py), a line in FAMILIES,
and its tests (docs/ARCHITECTURE.md, "Adding a model")."""
from __future__ import annotations

from ..config import ConfigReader, ModelConfig, read_model_json
from ..errors import ConfigError
from .decoder import Decoder
from .gemma2 import Gemma2
from .gemma3 import Gemma3, Gemma3WithVision
from .llama import Llama
from .mistral import Mistral, Mistral3
from .qwen2 import Qwen2
from .qwen3 import Qwen3

FAMILIES: tuple[type[Decoder], ...] = (Llama, Mistral, Qwen2, Qwen3, Gemma3, Gemma2,
                                         Gemma3WithVision, Mistral3)
ARCHITECTURES = {name: family for family in FAMILIES for name in family.architectures}
MODEL_TYPES = {name: family for family in FAMILIES for name in family.model_types}


def family_of(raw: dict) -> type[Decoder]:
    """The family that runs a config.json, by architectures[0], else model_type."""
    architectures = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if architectures:
        if not isinstance(architectures, list) or not isinstance(architectures[0], str):
            raise ConfigError(f"config.json: architectures must be a list of names, got "
                              f"{architectures!r}")
        family = ARCHITECTURES.get(architectures[0])
        if family is None:
            raise ConfigError(f"config.json: architecture {architectures[0]!r} is not supported; "
                              f"cupy-llama runs {', '.join(ARCHITECTURES)}")
        return family
    if model_type is None:
        raise ConfigError("config.json names neither 'architectures' nor 'model_type'; "
                          f"expected one of {', '.join(ARCHITECTURES)}")
    family = MODEL_TYPES.get(model_type)
    if family is None:
        raise ConfigError(f"config.json: model_type {model_type!r} is not supported; "
                          f"cupy-llama runs {', '.join(MODEL_TYPES)}")
    return family


def config_from_dicts(raw: dict, gen: dict | None = None) -> ModelConfig:
    """ModelConfig from config.json and generation_config.json as dicts."""
    if not isinstance(raw, dict):
        raise ConfigError("config.json must hold a JSON object")
    family = family_of(raw)
    try:
        return family.read_config(ConfigReader(raw, gen))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.json: {e}") from None


def read_config(model_dir) -> ModelConfig:
    """The ModelConfig of a model folder, its generation defaults checked (a bad one fails
    here, with the model, rather than with the first request that takes it)."""
    from ..sampling import model_sampling_defaults
    config = config_from_dicts(*read_model_json(model_dir))
    model_sampling_defaults(config.generation_config)
    return config


def model_for(config: ModelConfig) -> Decoder:
    """The model object of a config (its family's Decoder)."""
    return ARCHITECTURES[config.architecture](config)
