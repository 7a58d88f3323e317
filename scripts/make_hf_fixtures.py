"""Reference logits and greedy continuations from Hugging Face transformers (float32) for the
tiny random models the tests build. Needs torch and transformers; the tests do not.

    python scripts/make_hf_fixtures.py            # writes tests/fixtures/hf_*.npz

Each fixture holds the model's config overrides and seed, a hash of the weights file (so a
change in how weights are drawn is caught instead of failing mysteriously), the prompt,
the logits at a spread of positions of a >2,048-token prompt, and 32 greedy tokens after
a short and after the long prompt.
"""
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from cupy_llama.bench.random_model import TINY, make_random_model  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
LONG_PROMPT_LEN = 2100
NUM_GREEDY = 32

# GQA ratio 1 and 3 and 4, tied and untied heads, rope none and llama3 (with a short
# original context so the scaled frequencies matter inside 2,048 positions)
LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=256)
MODELS = {
    "gqa1_tied_norope": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "gqa3_untied_llama3": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                               head_dim=16, tie_word_embeddings=False, rope_theta=500000.0,
                               rope_scaling=LLAMA3_SCALING),
    "gqa4_tied_llama3_hd32": dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                                  head_dim=32, num_hidden_layers=3, intermediate_size=192,
                                  tie_word_embeddings=True, rope_scaling=LLAMA3_SCALING),
}
SEED = 1234
STD = 0.15  # large enough that greedy continuations do not just repeat a token


def logit_positions(n: int) -> np.ndarray:
    return np.unique(np.concatenate([np.arange(0, n, 97), np.arange(n - 8, n)]))


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
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name, overrides in MODELS.items():
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = make_random_model(Path(tmp) / name, dict(TINY, **overrides), seed=SEED, std=STD)
            digest = hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                         attn_implementation="eager").eval()
            vocab = model.config.vocab_size
            rng = np.random.default_rng(7)
            long_prompt = rng.integers(0, vocab, LONG_PROMPT_LEN).tolist()
            short_prompt = rng.integers(0, vocab, 40).tolist()
            positions = logit_positions(LONG_PROMPT_LEN)
            with torch.no_grad():
                logits = model(torch.tensor([long_prompt])).logits[0].numpy()
                greedy_short = greedy(model, torch, short_prompt, NUM_GREEDY)
                greedy_long = greedy(model, torch, long_prompt, NUM_GREEDY)
            np.savez_compressed(
                FIXTURES / f"hf_{name}.npz",
                overrides=json.dumps(overrides), seed=SEED, std=STD, weights_sha256=digest,
                transformers_version=transformers.__version__,
                long_prompt=np.array(long_prompt, np.int32), logit_positions=positions,
                logits=logits[positions].astype(np.float32),
                short_prompt=np.array(short_prompt, np.int32),
                greedy_short=np.array(greedy_short, np.int32),
                greedy_long=np.array(greedy_long, np.int32))
            print(f"{name}: {len(positions)} logit rows, greedy {greedy_short[:6]}...")


if __name__ == "__main__":
    main()
