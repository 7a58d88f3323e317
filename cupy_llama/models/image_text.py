"""The language model of an image-text checkpoint, run on text: Gemma 3's 4B, 12B and 27B
(Gemma3ForConditionalGeneration) and Mistral Small 3.x (Mistral3ForConditionalGeneration).
Their config.json holds the language model's config under text_config, which writes
only what differs from transformers' defaults for it; their weights hold it under
language_model.model.* as released (model.language_model.* as transformers 5 names it)
beside a vision tower and a projector, which stay on disk. The model is the text
family's, unchanged (docs/ARCHITECTURE.md, "Adding a model")."""
from __future__ import annotations

from typing import ClassVar

from ..config import ConfigReader, ModelConfig, id_set
from ..errors import ConfigError

# where the language model's tensors sit, as released and as transformers 5 names them
_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."))
_IMAGE_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                   "model.multi_modal_projector.")


class ImageText:
    """Mixed in before a text family's Decoder: its read_config reads text_config (with
    `text_defaults`, the transformers defaults text_config leaves out), its
    checkpoint_names finds the language model's tensors."""
    text_defaults: ClassVar[dict] = {}
    text_model_type: ClassVar[str] = ""  # text_config's model_type, where it names one

    @classmethod
    def read_config(cls, reader: ConfigReader) -> ModelConfig:
        raw, name = reader.raw, cls.architectures[0]
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"config.json: text_config must be an object (a {name}'s "
                              f"language model settings)")
        kind = text.get("model_type", cls.text_model_type)
        if kind != cls.text_model_type:
            raise ConfigError(f"config.json: text_config.model_type {kind!r} is not supported "
                              f"for {name}; cupy-llama runs its {cls.text_model_type!r} "
                              f"language model")
        if raw.get("quantization_config") is not None:
            raise ConfigError(f"config.json: quantization_config is not supported for {name}; "
                              f"use the bf16 checkpoint")
        merged = {**cls.text_defaults, **text}
        for key in ("torch_dtype", "dtype"):  # the checkpoint's, written at the top
            if key in raw and key not in text:
                merged[key] = raw[key]
        if "eos_token_id" in raw:  # the top level's end-of-turn ids (Gemma 3: 1 and 106)
            merged["eos_token_id"] = sorted(id_set(raw["eos_token_id"])
                                           | id_set(merged.get("eos_token_id")))
        return super().read_config(ConfigReader(merged, reader.gen))

    def checkpoint_names(self, tensors: dict) -> dict:
        renamed = {}
        for name, info in tensors.items():
            if name.startswith(_IMAGE_PREFIXES):
                continue
            for old, new in _TEXT_PREFIXES:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            renamed[name] = info
        return renamed
