"""Model configuration from a Hugging Face model directory, validated once.

Reads `config.json` (both the released Llama 3.x form with top-level `rope_theta` /
`rope_scaling` and the transformers-5 form with `rope_parameters`) and, when present,
`generation_config.json` for EOS ids and sampling defaults.
"""
from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError
from .util import as_flag

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency scaling (rope_type "llama3")."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    # generation_config.json as it is ({} without one); sampling.py reads its defaults
    generation_config: dict = field(default_factory=dict)

    def __post_init__(self):
        positive = ("hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                    "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"config.json: head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"config.json: rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ConfigError(f"config.json: rope_theta must be > 0, got {self.rope_theta!r}")
        for token_id in self.eos_token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise ConfigError(f"eos_token_id {token_id} is outside the vocabulary "
                                  f"(vocab_size {self.vocab_size})")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + L * per_layer + h + head

    @classmethod
    def from_dir(cls, model_dir) -> "ModelConfig":
        model_dir = Path(model_dir)
        if model_dir.is_file():
            raise ConfigError(f"{str(model_dir)!r} is a file, not a model directory; pass the "
                              "folder that holds config.json")
        if not model_dir.is_dir():
            raise ConfigError(f"model directory {str(model_dir)!r} does not exist; pass the "
                              "path of a Hugging Face model folder (with config.json)")
        raw = _read_json(model_dir / "config.json", required=True)
        gen = _read_json(model_dir / "generation_config.json", required=False)
        if gen is not None and not isinstance(gen, dict):
            raise ConfigError("generation_config.json must hold a JSON object; fix or remove it")
        return cls.from_dicts(raw, gen)

    @classmethod
    def from_dicts(cls, raw: dict, gen: dict | None = None) -> "ModelConfig":
        gen = gen or {}
        if not isinstance(raw, dict):
            raise ConfigError("config.json must hold a JSON object")
        architectures = raw.get("architectures") or []
        model_type = raw.get("model_type")
        if architectures and not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
            raise ConfigError(f"config.json: architecture {architectures[0]!r} is not supported; "
                              f"cupy-llama runs {', '.join(SUPPORTED_ARCHITECTURES)} models")
        if model_type is not None and model_type != "llama":
            raise ConfigError(f"config.json: model_type {model_type!r} is not supported; "
                              "cupy-llama runs model_type 'llama'")
        if not architectures and model_type is None:
            raise ConfigError("config.json names neither 'architectures' nor 'model_type'; "
                              "expected LlamaForCausalLM / llama")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
        for flag in ("attention_bias", "mlp_bias"):
            if raw.get(flag):
                raise ConfigError(f"config.json: {flag}=true is not supported "
                                  "(Llama checkpoints have no biases)")

        def need(name):
            if name not in raw:
                raise ConfigError(f"config.json is missing {name!r}")
            return raw[name]

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv_heads = raw.get("num_key_value_heads")
        if kv_heads is None:  # no grouped-query attention: one kv head per query head
            kv_heads = heads
        head_dim = raw.get("head_dim")
        if head_dim is None:
            if not isinstance(hidden, int) or not isinstance(heads, int) or heads < 1 or hidden % heads:
                raise ConfigError(f"config.json: hidden_size ({hidden}) is not a multiple of "
                                  f"num_attention_heads ({heads}) and head_dim is not given")
            head_dim = hidden // heads

        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling")
        if scaling is None and rope:
            scaling = rope
        rope_theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_scaling = _parse_rope_scaling(scaling)

        eos = _id_set(raw.get("eos_token_id")) | _id_set(gen.get("eos_token_id"))
        bos = gen.get("bos_token_id", raw.get("bos_token_id"))
        dtype = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
        try:
            return cls(
                hidden_size=hidden, num_hidden_layers=need("num_hidden_layers"),
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                intermediate_size=need("intermediate_size"), vocab_size=need("vocab_size"),
                rms_norm_eps=_number("rms_norm_eps", raw.get("rms_norm_eps", 1e-6)),
                rope_theta=_number("rope_theta", rope_theta),
                max_position_embeddings=raw.get("max_position_embeddings", 2048),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                rope_scaling=rope_scaling, eos_token_ids=tuple(sorted(eos)),
                bos_token_id=bos if isinstance(bos, int) else None,
                torch_dtype=str(dtype), generation_config=dict(gen))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config.json: {e}") from None


def _is_number(value, kind=numbers.Real) -> bool:
    """A Python or NumPy number of `kind` (numbers.Integral or Real), not a bool."""
    return isinstance(value, kind) and not isinstance(value, bool)


def _number(name: str, value, where: str = "config.json") -> float:
    if not _is_number(value):
        raise ConfigError(f"{where}: {name} must be a number, got {value!r}")
    return float(value)


def _read_json(path: Path, required: bool):
    if not path.is_file():
        if required:
            raise ConfigError(f"{path.name} not found in {str(path.parent)!r}; a Hugging Face "
                              "model directory needs config.json, tokenizer.json and "
                              "model.safetensors")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path.name} is not valid JSON ({e}); re-download the model") from None


def _id_set(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, bool):
        raise ConfigError(f"eos_token_id must be an int or a list of ints, got {value!r}")
    if isinstance(value, int):
        return {value}
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return set(value)
    raise ConfigError(f"eos_token_id must be an int or a list of ints, got {value!r}")


def _parse_rope_scaling(scaling) -> RopeScaling | None:
    if not scaling:
        return None
    if not isinstance(scaling, dict):
        raise ConfigError(f"config.json: rope_scaling must be an object, got {scaling!r}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"config.json: rope type {rope_type!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return None
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings") if k not in scaling]
    if missing:
        raise ConfigError(f"config.json: llama3 rope_scaling is missing {missing[0]!r}")
    where = "config.json: rope_scaling"
    original = scaling["original_max_position_embeddings"]
    if isinstance(original, float) and original.is_integer():  # 8192.0, as transformers takes it
        original = int(original)
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ConfigError(f"{where}: original_max_position_embeddings must be a positive "
                          f"integer, got {original!r}")
    return RopeScaling(
        factor=_number("factor", scaling["factor"], where),
        low_freq_factor=_number("low_freq_factor", scaling["low_freq_factor"], where),
        high_freq_factor=_number("high_freq_factor", scaling["high_freq_factor"], where),
        original_max_position_embeddings=original)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine uses its device. None means: choose from the model and the device."""
    max_num_seqs: int = 256           # sequences decoded together in one step
    max_num_batched_tokens: int = 8192  # new tokens per step (prefill chunks + decodes)
    max_model_len: int | None = None  # context limit; default min(model's, 8192)
    block_size: int = 16              # tokens per KV block
    num_kv_blocks: int | None = None  # default: sized from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False       # turn CUDA graphs off
    enable_prefix_caching: bool = True  # reuse the KV blocks of prompts seen before

    def __post_init__(self):
        # Python or NumPy numbers (never bools), stored as Python ones
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len",
                     "num_kv_blocks"):
            value = getattr(self, name)
            if value is None and name in ("max_model_len", "num_kv_blocks"):
                continue
            if not _is_number(value, numbers.Integral) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        utilization = self.gpu_memory_utilization
        if not _is_number(utilization, numbers.Real) or not 0 < utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be a number in (0, 1], got {utilization!r}")
        object.__setattr__(self, "gpu_memory_utilization", float(utilization))
        for name in ("enforce_eager", "enable_prefix_caching"):
            flag = as_flag(getattr(self, name))
            if flag is None:
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
            object.__setattr__(self, name, flag)

    def resolved_max_model_len(self, model: ModelConfig) -> int:
        if self.max_model_len is None:
            return min(model.max_position_embeddings, 8192)
        if self.max_model_len > model.max_position_embeddings:
            limit = model.max_position_embeddings
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the model's limit "
                              f"of {limit} tokens (max_position_embeddings in config.json); "
                              f"ask for at most {limit}, or leave it out")
        return self.max_model_len
