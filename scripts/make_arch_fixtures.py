"""Tiny checkpoints of every non-Llama family, written by transformers itself, and its
float32 logits and greedy continuations on them. Needs torch and transformers; the tests do
not.

    python scripts/make_arch_fixtures.py              # writes tests/fixtures/arch_<name>/
    python scripts/make_arch_fixtures.py gemma3_vision  # only the ones named

Each model is made from its transformers config class (the config.json it writes is the
transformers-5 form: rope_parameters, layer_types), with its weights drawn by transformers
and then its norms and biases moved off their initial values (ones and zeros would hide a
norm or a bias the engine skipped), cast to bf16 and saved with save_pretrained. The
folder also gets config_legacy.json, the same model in the form released checkpoints use
(top-level rope_theta and rope_scaling, no layer_types), and a byte-level tokenizer with
the family's special tokens (cupy_llama.bench.random_model), so the engine can load it.

reference.npz holds, for transformers in float32 on those bf16 weights: the logits at
every position of a prompt several sliding windows long, and greedy continuations after a
short and after that long prompt.
"""
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from cupy_llama.bench.random_model import TOKENIZER_OF, write_tokenizer  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
SHAPE = dict(vocab_size=288, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
             initializer_range=0.15, bos_token_id=256, eos_token_id=257)
LONG_PROMPT_LEN = 96
NUM_GREEDY = 24
WINDOW = 16

GEMMA3_VALUES = dict(query_pre_attn_scalar=16, sliding_window=WINDOW, sliding_window_pattern=2,
                     rope_theta=1000000.0, rope_local_base_freq=10000.0,
                     rope_scaling={"rope_type": "linear", "factor": 8.0})
GEMMA3_LEGACY = {"rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                 "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                 "sliding_window_pattern": 2}
# name -> (transformers config class, its own values, the legacy config.json's changes)
MODELS = {
    "qwen2": ("Qwen2Config", dict(rope_theta=1000000.0, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
        {"rope_theta": 1000000.0, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 64}}),
    "qwen3": ("Qwen3Config", dict(rope_theta=1000000.0, use_sliding_window=True,
                                  sliding_window=WINDOW + 8, max_window_layers=1),
              {"rope_theta": 1000000.0}),
    "mistral": ("MistralConfig", dict(rope_theta=10000.0, sliding_window=WINDOW),
                {"rope_theta": 10000.0}),
    "gemma3": ("Gemma3TextConfig", GEMMA3_VALUES, GEMMA3_LEGACY),
    # the image-text checkpoint (the 4B and larger): the same language model as "gemma3"
    # under text_config, beside a tiny vision tower the engine leaves on disk; its legacy
    # config.json writes text_config as the released ones do, only what differs from
    # transformers' defaults
    "gemma3_vision": ("Gemma3Config", GEMMA3_VALUES, GEMMA3_LEGACY),
    # Mistral Small 3.x's image-text checkpoint: the "mistral" language model under
    # text_config, with its own LM head, beside a tiny Pixtral vision tower
    "mistral3": ("Mistral3Config", dict(rope_theta=10000.0, sliding_window=WINDOW),
                 {"rope_theta": 10000.0}),
    "gemma2": ("Gemma2Config", dict(query_pre_attn_scalar=16, sliding_window=WINDOW,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                                    rope_theta=10000.0),
               {"rope_theta": 10000.0}),
}


def perturb(model, torch, offset_norms: bool) -> None:
    """Norm weights off 1 (Gemma's off 0: they store w - 1), biases off 0."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                noise = 0.1 * torch.randn(parameter.shape, generator=generator)
                parameter.copy_(noise if offset_norms else 1.0 + noise)
            elif name.endswith(".bias"):
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))


def legacy_config(config: dict, changes: dict) -> dict:
    """The config.json of a released checkpoint for the same model: rope settings at top
    level, no layer_types or rope_parameters (an image-text config: in its text_config,
    which holds only the fields that differ from Gemma3TextConfig's defaults)."""
    if "text_config" in config:
        import transformers
        text_class = {"gemma3": "Gemma3TextConfig", "mistral3": "MistralConfig"}
        defaults = getattr(transformers, text_class[config["model_type"]])().to_dict()
        text = {k: v for k, v in legacy_config(config["text_config"], changes).items()
                if k in changes or k == "model_type" or k not in defaults or defaults[k] != v}
        return {**config, "text_config": text}
    legacy = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")}
    legacy.update(changes)
    return legacy


def make_config(transformers, config_class: str, values: dict):
    """The transformers config of a fixture; an image-text one holds the language model of
    SHAPE and values in its text_config, beside a vision tower of one small layer."""
    if config_class == "Mistral3Config":
        text = transformers.MistralConfig(**{**SHAPE, "tie_word_embeddings": False}, **values)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, image_size=28, patch_size=14, head_dim=16)
        return transformers.Mistral3Config(text_config=text.to_dict(), vision_config=vision,
                                           spatial_merge_size=1, image_token_index=260,
                                           tie_word_embeddings=False)
    if config_class != "Gemma3Config":
        return getattr(transformers, config_class)(**SHAPE, **values)
    text = transformers.Gemma3TextConfig(**SHAPE, **values)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    return transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision,
                                     mm_tokens_per_image=4, boi_token_index=258,
                                     eoi_token_index=259, image_token_index=260,
                                     eos_token_id=[SHAPE["eos_token_id"], 261],
                                     tie_word_embeddings=True)


def greedy(model, torch, prompt: list[int], steps: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model(ids, use_cache=True)
    tokens = []
    for _ in range(steps):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def main():
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    names = sys.argv[1:] or list(MODELS)
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        sys.exit(f"unknown fixture(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    for name in names:
        config_class, values, legacy_changes = MODELS[name]
        torch.manual_seed(0)
        config = make_config(transformers, config_class, values)
        auto = AutoModelForImageTextToText if name == "mistral3" else AutoModelForCausalLM
        model = auto.from_config(config, attn_implementation="eager")
        perturb(model, torch, offset_norms=name.startswith("gemma"))
        target = FIXTURES / f"arch_{name}"
        shutil.rmtree(target, ignore_errors=True)
        with tempfile.TemporaryDirectory() as tmp:
            model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
            target.mkdir(parents=True)
            for file in ("config.json", "generation_config.json", "model.safetensors"):
                if (Path(tmp) / file).exists():
                    shutil.copy(Path(tmp) / file, target / file)
        raw = json.loads((target / "config.json").read_text())
        (target / "config_legacy.json").write_text(
            json.dumps(legacy_config(raw, legacy_changes), indent=2) + "\n")
        text_architecture = {"gemma3_vision": "Gemma3ForCausalLM",
                             "mistral3": "MistralForCausalLM"}.get(name, raw["architectures"][0])
        write_tokenizer(target, SHAPE["vocab_size"], TOKENIZER_OF[text_architecture])
        reference = auto.from_pretrained(
            target, dtype=torch.float32, attn_implementation="eager").eval()
        rng = np.random.default_rng(7)
        long_prompt = rng.integers(0, 256, LONG_PROMPT_LEN).tolist()
        short_prompt = rng.integers(0, 256, 12).tolist()
        with torch.no_grad():
            logits = reference(torch.tensor([long_prompt])).logits[0].numpy()
            greedy_short = greedy(reference, torch, short_prompt, NUM_GREEDY)
            greedy_long = greedy(reference, torch, long_prompt, NUM_GREEDY)
        np.savez_compressed(
            target / "reference.npz", transformers_version=transformers.__version__,
            long_prompt=np.array(long_prompt, np.int32), logits=logits.astype(np.float32),
            short_prompt=np.array(short_prompt, np.int32),
            greedy_short=np.array(greedy_short, np.int32),
            greedy_long=np.array(greedy_long, np.int32))
        print(f"{name}: {raw['architectures'][0]}, layer types {raw.get('layer_types')}, "
              f"greedy {greedy_short[:6]}...")


if __name__ == "__main__":
    main()
