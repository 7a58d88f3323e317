"""The model's configuration, and how the engine uses its device: dataclasses checked once.

`ModelConfig` says everything the decoder (models/decoder.py) needs: the shape, the RoPE
table of each layer type, and the features that set the families apart (q/k/v biases,
per-head q/k norms, Gemma's norms and GeGLU, sliding windows, soft-capping). Each family
reads its own config.json into one (models/, `read_config`); the helpers here read the
fields they share, from both forms a config.json takes on disk: the released form with
top-level `rope_theta` / `rope_scaling`, and the transformers-5 form with
`rope_parameters` (one dict, or one per layer type).
"""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field, replace
from pathlib import Path

from .errors import ConfigError
from .util import as_flag

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
HIDDEN_ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# weight formats of the products besides bf16 (docs/ARCHITECTURE.md, "FP8 weights"): e4m3
# codes with a float32 scale per output row
QUANTIZATIONS = ("fp8",)


@dataclass(frozen=True)
class RopeConfig:
    """The frequencies of one RoPE table (models/rope.py computes them as transformers
    does): rope_type default, linear (inverse frequencies / factor), llama3 (Llama 3's
    wavelength bands) or yarn (NTK-by-parts, with an attention factor on cos and sin)."""
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0                        # llama3
    high_freq_factor: float = 4.0                       # llama3
    original_max_position_embeddings: int | None = None  # llama3, yarn
    beta_fast: float = 32.0                             # yarn
    beta_slow: float = 1.0                              # yarn
    attention_factor: float | None = None               # yarn; None: from factor (and mscale)
    mscale: float | None = None                         # yarn
    mscale_all_dim: float | None = None                 # yarn
    truncate: bool = True                               # yarn


@dataclass(frozen=True)
class ModelConfig:
    architecture: str            # config.json's architectures[0] (models/ registry key)
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # layer type -> its RoPE table; every type of layer_types has one
    rope: dict = field(default_factory=dict)
    # FULL_ATTENTION or SLIDING_ATTENTION per layer (default: all full)
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None    # keys a sliding layer's token sees, itself included
    qkv_bias: bool = False               # biases on q, k and v (Qwen2)
    qk_norm: bool = False                # RMSNorm of each q and k head before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0             # norms scale by (offset + weight): Gemma's 1 + w
    sandwich_norms: bool = False         # a norm on each sublayer's output too (Gemma)
    hidden_act: str = "silu"             # the gate's activation: silu or gelu_tanh
    embed_scale: float | None = None     # embeddings times this (Gemma: sqrt(hidden))
    attn_scale: float | None = None      # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None   # scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # logits likewise
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    # the format of the products' weights (q/k/v, o, gate/up, down) as the engine runs
    # them: None for bf16, "fp8"; and as the checkpoint stores them (quantization_config)
    quantization: str | None = None
    checkpoint_quantization: str | None = None
    # generation_config.json as it is ({} without one); sampling.py reads its defaults
    generation_config: dict = field(default_factory=dict)

    @property
    def context_limit(self) -> int:
        """The longest context the model takes: max_position_embeddings, or, where a yarn
        RoPE stretches an original context by its factor (Qwen's long-context setting,
        whose model cards leave max_position_embeddings at the original), that stretched
        length when it is longer (the length vLLM derives from the yarn settings)."""
        longest = self.max_position_embeddings
        for rope in self.rope.values():
            if rope.rope_type == "yarn" and rope.original_max_position_embeddings:
                longest = max(longest, int(rope.original_max_position_embeddings * rope.factor))
        return longest

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
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL_ATTENTION,) * self.num_hidden_layers)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"config.json: layer_types lists {len(self.layer_types)} layers "
                              f"but num_hidden_layers is {self.num_hidden_layers}")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ConfigError(f"config.json: layer type {unknown[0]!r} is not supported "
                              f"(supported: {', '.join(LAYER_TYPES)})")
        missing = sorted(set(self.layer_types) - set(self.rope))
        if missing:
            raise ConfigError(f"config.json: no RoPE settings for {missing[0]} layers")
        if SLIDING_ATTENTION in self.layer_types and self.sliding_window is None:
            raise ConfigError("config.json: sliding_attention layers need sliding_window")
        if self.sliding_window is not None and (
                isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int)
                or self.sliding_window < 1):
            raise ConfigError(f"config.json: sliding_window must be a positive integer or "
                              f"null, got {self.sliding_window!r}")
        if self.hidden_act not in HIDDEN_ACTS.values():
            raise ConfigError(f"hidden activation {self.hidden_act!r} is not supported")
        if self.attn_scale is None:
            object.__setattr__(self, "attn_scale", self.head_dim ** -0.5)
        for name in ("attn_logit_softcap", "final_logit_softcap", "embed_scale"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"config.json: {name} must be > 0 or null, got {value!r}")
        for name in ("quantization", "checkpoint_quantization"):
            if getattr(self, name) not in (None, *QUANTIZATIONS):
                raise ConfigError(f"{name} must be one of {', '.join(QUANTIZATIONS)} or None, "
                                  f"got {getattr(self, name)!r}")
        if self.checkpoint_quantization and self.quantization != self.checkpoint_quantization:
            raise ConfigError(f"the checkpoint's weights are {self.checkpoint_quantization}; "
                              f"they cannot run as {self.quantization or 'bf16'}")
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

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer i, None for a full-attention layer."""
        return self.sliding_window if self.layer_types[i] == SLIDING_ATTENTION else None

    @property
    def num_parameters(self) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        qkv = self.q_size + 2 * self.kv_size
        norms = 4 if self.sandwich_norms else 2
        per_layer = (h * qkv + self.q_size * h + 3 * h * i + norms * h
                     + (qkv if self.qkv_bias else 0) + (2 * self.head_dim if self.qk_norm else 0))
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + L * per_layer + h + head


# ---------------------------------------------------------------- reading config.json

GGUF_REFUSED = ("cupy-llama does not load GGUF (llama.cpp's format): pass a Hugging Face "
               "model folder (config.json, tokenizer.json and .safetensors weights), such as "
               "the model's release on the Hugging Face Hub")


def is_gguf(path: Path) -> bool:
    """A GGUF file (llama.cpp's format), by its name or its magic bytes."""
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def read_model_json(model_dir) -> tuple[dict, dict]:
    """config.json and generation_config.json ({} when absent) of a model folder, as JSON
    objects; one-line ConfigErrors for a folder that is missing, a file (a GGUF file, or a
    folder of them, named as such), or bad JSON."""
    model_dir = Path(model_dir).expanduser()
    if model_dir.is_file():
        if is_gguf(model_dir):
            raise ConfigError(f"{str(model_dir)!r} is a GGUF file; {GGUF_REFUSED}")
        raise ConfigError(f"{str(model_dir)!r} is a file, not a model directory; pass the "
                          "folder that holds config.json")
    if not model_dir.is_dir():
        raise ConfigError(f"model directory {str(model_dir)!r} does not exist; pass the "
                          "path of a Hugging Face model folder (with config.json)")
    if not (model_dir / "config.json").is_file():
        ggufs = sorted(p.name for p in model_dir.glob("*.[gG][gG][uU][fF]"))
        if ggufs:
            raise ConfigError(f"{str(model_dir)!r} holds GGUF files ({', '.join(ggufs[:2])}"
                              f"{', ...' if len(ggufs) > 2 else ''}) and no config.json; "
                              f"{GGUF_REFUSED}")
    raw = _read_json(model_dir / "config.json", required=True)
    if not isinstance(raw, dict):
        raise ConfigError("config.json must hold a JSON object")
    gen = _read_json(model_dir / "generation_config.json", required=False)
    if gen is not None and not isinstance(gen, dict):
        raise ConfigError("generation_config.json must hold a JSON object; fix or remove it")
    return raw, gen or {}


class ConfigReader:
    """config.json's fields, each read with an error that names it."""

    def __init__(self, raw: dict, gen: dict | None = None):
        self.raw, self.gen = raw, gen or {}

    def need(self, name: str):
        if name not in self.raw:
            raise ConfigError(f"config.json is missing {name!r}")
        return self.raw[name]

    def need_count(self, name: str) -> int:
        """A required positive integer, checked here: the families work with it before
        ModelConfig checks the rest (a layer count sizes the per-layer fields)."""
        value = self.need(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"config.json: {name} must be a positive integer, got {value!r}")
        return value

    def number(self, name: str, default=None) -> float | None:
        """A number, default when the field is absent, None when it is null."""
        value = self.raw.get(name, default)
        return None if value is None else _number(name, value)

    def flag(self, name: str, default: bool = False) -> bool:
        value = self.raw.get(name, default)
        flag = as_flag(False if value is None else value)
        if flag is None:
            raise ConfigError(f"config.json: {name} must be true or false, got {value!r}")
        return flag

    def refuse(self, name: str, why: str) -> None:
        """A field whose truthy value this family cannot run."""
        if self.raw.get(name):
            raise ConfigError(f"config.json: {name}={json.dumps(self.raw[name])} is not "
                              f"supported ({why})")

    def shared_fields(self, architecture: str) -> dict:
        """The fields every family reads the same way, as ModelConfig keywords."""
        raw, gen = self.raw, self.gen
        hidden = self.need("hidden_size")
        heads = self.need("num_attention_heads")
        kv_heads = raw.get("num_key_value_heads")
        if kv_heads is None:  # no grouped-query attention: one kv head per query head
            kv_heads = heads
        head_dim = raw.get("head_dim")
        if head_dim is None:
            if not isinstance(hidden, int) or not isinstance(heads, int) or heads < 1 or hidden % heads:
                raise ConfigError(f"config.json: hidden_size ({hidden}) is not a multiple of "
                                  f"num_attention_heads ({heads}) and head_dim is not given")
            head_dim = hidden // heads
        quantization = read_quantization_config(raw.get("quantization_config"))
        eos = id_set(raw.get("eos_token_id")) | id_set(gen.get("eos_token_id"))
        bos = gen.get("bos_token_id", raw.get("bos_token_id"))
        max_positions = raw.get("max_position_embeddings", 2048)
        if isinstance(max_positions, float) and max_positions.is_integer():
            max_positions = int(max_positions)
        return dict(
            architecture=architecture, hidden_size=hidden,
            num_hidden_layers=self.need_count("num_hidden_layers"), num_attention_heads=heads,
            num_key_value_heads=kv_heads, head_dim=head_dim,
            intermediate_size=self.need("intermediate_size"), vocab_size=self.need("vocab_size"),
            rms_norm_eps=_number("rms_norm_eps", raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=tuple(sorted(eos)), bos_token_id=bos if isinstance(bos, int) else None,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            quantization=quantization, checkpoint_quantization=quantization,
            generation_config=dict(gen))

    def hidden_act(self, name: str = "hidden_act", default: str = "silu") -> str:
        act = self.raw.get(name, default)
        if act not in HIDDEN_ACTS:
            raise ConfigError(f"config.json: {name} {act!r} is not supported (supported: "
                              f"{', '.join(sorted(HIDDEN_ACTS))})")
        return HIDDEN_ACTS[act]

    def layer_types(self, num_layers: int, default: tuple[str, ...]) -> tuple[str, ...]:
        """config.json's layer_types when it lists them (transformers 5 writes them), else
        the family's default."""
        listed = self.raw.get("layer_types")
        if listed is None:
            return default
        if not isinstance(listed, list) or not all(isinstance(t, str) for t in listed):
            raise ConfigError(f"config.json: layer_types must be a list of layer type names, "
                              f"got {listed!r}")
        return tuple(listed)

    def rope(self, layer_types: tuple[str, ...], default_theta: float = 10000.0,
             sliding_theta: float | None = None) -> dict:
        """The RoPE table of each layer type, from either config form:
        - rope_parameters (transformers 5): one dict for every layer, or one per layer type;
        - rope_theta and rope_scaling at top level (released checkpoints); with
          sliding_theta (Gemma 3's rope_local_base_freq), sliding layers get a plain table
          of that base and only full layers take rope_scaling."""
        raw = self.raw
        params = raw.get("rope_parameters")
        if params is not None and not isinstance(params, dict):
            raise ConfigError(f"config.json: rope_parameters must be an object, got {params!r}")
        per_type = isinstance(params, dict) and set(params) & set(LAYER_TYPES)
        tables = {}
        for layer_type in dict.fromkeys(layer_types):
            if per_type:
                entry = params.get(layer_type)
                if not isinstance(entry, dict):
                    raise ConfigError(f"config.json: rope_parameters has no {layer_type} entry")
                theta = entry.get("rope_theta", raw.get("rope_theta", default_theta))
                tables[layer_type] = _rope_config(entry, theta, raw,
                                                  f"rope_parameters.{layer_type}")
            elif layer_type == SLIDING_ATTENTION and sliding_theta is not None:
                theta = raw.get("rope_local_base_freq", sliding_theta)
                tables[layer_type] = _rope_config({}, theta, raw, "rope_local_base_freq")
            else:
                flat = params or {}
                theta = raw.get("rope_theta", flat.get("rope_theta", default_theta))
                scaling = raw.get("rope_scaling")
                if scaling is None:
                    scaling = flat
                elif not isinstance(scaling, dict):
                    raise ConfigError(f"config.json: rope_scaling must be an object, got {scaling!r}")
                tables[layer_type] = _rope_config(scaling, theta, raw, "rope_scaling")
        return tables


def _rope_config(entry: dict, theta, raw: dict, where: str) -> RopeConfig:
    """One RoPE table's settings (a rope_scaling or rope_parameters dict and its theta)."""
    rope_type = entry.get("rope_type", entry.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"config.json: rope type {rope_type!r} is not supported "
                          f"(supported: {', '.join(ROPE_TYPES)})")
    theta = _number("rope_theta", theta)
    if not theta > 0:
        raise ConfigError(f"config.json: rope_theta must be > 0, got {theta!r}")
    where = f"config.json: {where}"
    if rope_type == "default":
        return RopeConfig(theta)

    def positions(name, default=None) -> int:
        value = entry.get(name, default)
        if isinstance(value, float) and value.is_integer():  # 8192.0, as transformers takes it
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}: {name} must be a positive integer, got {value!r}")
        return value

    def need(name) -> float:
        if entry.get(name) is None:
            raise ConfigError(f"{where}: {rope_type} rope scaling is missing {name!r}")
        return _number(name, entry[name], where)

    def optional(name) -> float | None:
        return None if entry.get(name) is None else _number(name, entry[name], where)

    if rope_type == "linear":
        return RopeConfig(theta, "linear", factor=need("factor"))
    if rope_type == "llama3":
        return RopeConfig(theta, "llama3", factor=need("factor"),
                          low_freq_factor=need("low_freq_factor"),
                          high_freq_factor=need("high_freq_factor"),
                          original_max_position_embeddings=positions(
                              "original_max_position_embeddings"))
    # yarn: the original context defaults to max_position_embeddings, as in transformers
    original = positions("original_max_position_embeddings",
                         raw.get("original_max_position_embeddings",
                                 raw.get("max_position_embeddings")))
    factor = optional("factor")
    if factor is None:
        factor = _number("max_position_embeddings", raw.get("max_position_embeddings")) / original
    truncate = as_flag(entry.get("truncate", True))
    if truncate is None:
        raise ConfigError(f"{where}: truncate must be true or false, got {entry['truncate']!r}")
    return RopeConfig(theta, "yarn", factor=factor, original_max_position_embeddings=original,
                      beta_fast=optional("beta_fast") or 32.0,
                      beta_slow=optional("beta_slow") or 1.0,
                      attention_factor=optional("attention_factor"),
                      mscale=optional("mscale"), mscale_all_dim=optional("mscale_all_dim"),
                      truncate=truncate)


_FP8_FORMATS = ("float-quantized", "naive-quantized")


def read_quantization_config(qc) -> str | None:
    """config.json's quantization_config: None (bf16 weights) or "fp8" for the
    compressed-tensors format's FP8 checkpoints (float8 e4m3 weights with a float32 or
    bf16 scale per output channel or per tensor, as RedHat's and Neural Magic's "FP8" and
    "FP8-dynamic" models are published). Their activation schemes need nothing: the
    products take bf16 activations (more precise than FP8 ones). Anything else is a
    ConfigError that names it."""
    if qc is None:
        return None
    where = "config.json: quantization_config"
    if not isinstance(qc, dict):
        raise ConfigError(f"{where} must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ConfigError(
            f"{where}: quant_method {method!r} is not supported; cupy-llama runs FP8 "
            "checkpoints in the compressed-tensors format, or bf16 ones (FP8 at load "
            "with --quantization fp8)")
    if qc.get("format") not in _FP8_FORMATS:
        raise ConfigError(f"{where}: format {qc.get('format')!r} is not supported (supported: "
                          f"{', '.join(_FP8_FORMATS)}, the FP8 formats)")
    if qc.get("kv_cache_scheme") is not None:
        raise ConfigError(f"{where}: kv_cache_scheme is not supported (the KV cache is bf16); "
                          "use a checkpoint without KV-cache quantization")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{where} needs config_groups")
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        here = f"{where}.config_groups.{name}"
        if not isinstance(weights, dict):
            raise ConfigError(f"{here}.weights must be an object")
        wanted = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
        for key, value in wanted.items():
            if weights.get(key, value) != value:
                raise ConfigError(f"{here}.weights.{key} is {weights.get(key)!r}; cupy-llama "
                                  f"runs {key}={json.dumps(value)} only (FP8 e4m3 weights)")
        if weights.get("strategy") not in ("channel", "tensor"):
            raise ConfigError(f"{here}.weights.strategy {weights.get('strategy')!r} is not "
                              "supported (supported: channel, tensor)")
        if group.get("output_activations") is not None:
            raise ConfigError(f"{here}.output_activations is not supported")
    return "fp8"


def rounded_to_dtype(value: float, torch_dtype: str) -> float:
    """value as the checkpoint's dtype holds it (round to nearest even): transformers
    multiplies Gemma's embeddings by sqrt(hidden) cast to the weights' dtype."""
    import numpy as np
    if torch_dtype in ("bfloat16", "bf16"):
        from .bf16 import bf16_bits_to_float32, float32_to_bf16_bits
        return float(bf16_bits_to_float32(float32_to_bf16_bits(np.float32([value])))[0])
    if torch_dtype in ("float16", "fp16", "half"):
        return float(np.float16(value))
    return float(np.float32(value))


def sqrt_hidden(hidden_size: int, torch_dtype: str) -> float:
    return rounded_to_dtype(math.sqrt(hidden_size), torch_dtype)


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


def id_set(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, bool):
        raise ConfigError(f"eos_token_id must be an int or a list of ints, got {value!r}")
    if isinstance(value, int):
        return {value}
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return set(value)
    raise ConfigError(f"eos_token_id must be an int or a list of ints, got {value!r}")


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
    quantization: str | None = None   # "fp8": the products' bf16 weights to FP8 at load

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
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or left "
                              f"out for the checkpoint's own format), got {self.quantization!r}")

    def model_config(self, model: ModelConfig) -> ModelConfig:
        """The model's config with the products' weights in this engine's format: a bf16
        checkpoint quantized at load where `quantization` asks; an FP8 checkpoint stays
        FP8."""
        if self.quantization is None or self.quantization == model.quantization:
            return model
        return replace(model, quantization=self.quantization)

    def resolved_max_model_len(self, model: ModelConfig) -> int:
        if self.max_model_len is None:
            return min(model.context_limit, 8192)
        limit = model.context_limit
        if self.max_model_len > limit:
            source = ("max_position_embeddings in config.json" if limit ==
                      model.max_position_embeddings else "config.json's yarn rope_scaling: "
                      "its original context times its factor")
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the model's limit "
                              f"of {limit} tokens ({source}); ask for at most {limit}, or "
                              f"leave it out")
        return self.max_model_len
