"""FP8 fixtures, made with torch's own float8_e4m3fn and transformers, so that the tests
check cupy_llama/fp8.py and the FP8 loader against an implementation that is not ours.
Needs torch and transformers; the tests do not.

    python scripts/make_fp8_fixtures.py    # writes tests/fixtures/e4m3_torch.npz and fp8_llama/

e4m3_torch.npz: float32 inputs (random magnitudes over the whole range, every midpoint
between neighbouring e4m3 values and the floats just beside them, zeros, values past 448)
and the e4m3 codes torch rounds them to; torch's cast does not saturate, so the inputs
are clamped to +-448 first, which is what a saturating conversion does. Also torch's value
of every code.

fp8_llama/: a tiny Llama checkpoint in the compressed-tensors FP8 format, as published
"FP8-dynamic" models are: every projection's weight float8_e4m3fn with a per-output-channel
weight_scale [N, 1] (bf16 in layer 0, float32 in layer 1, as both occur on disk), the
embeddings, norms and LM head bf16, and config.json's quantization_config. The weights
are transformers' random ones, quantized here in torch: scale = max|w| / 448 per row,
codes = float8(w / scale). reference.npz holds transformers' float32 logits at every
position of a prompt, and a greedy continuation, for the model whose projections are the
dequantized weights (codes' values times their scales).
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
from make_arch_fixtures import greedy  # noqa: E402  (this folder is on the path)

FIXTURES = ROOT / "tests" / "fixtures"
SHAPE = dict(vocab_size=288, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
             initializer_range=0.15, bos_token_id=256, eos_token_id=257, rope_theta=500000.0)
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PROMPT_LEN = 40
NUM_GREEDY = 16
QUANTIZATION_CONFIG = {
    "config_groups": {"group_0": {
        "input_activations": {"actorder": None, "block_structure": None, "dynamic": True,
                              "group_size": None, "num_bits": 8, "observer": None,
                              "observer_kwargs": {}, "strategy": "token", "symmetric": True,
                              "type": "float"},
        "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                    "group_size": None, "num_bits": 8, "observer": "minmax",
                    "observer_kwargs": {}, "strategy": "channel", "symmetric": True,
                    "type": "float"}}},
    "format": "float-quantized", "global_compression_ratio": 1.2, "ignore": ["lm_head"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors",
    "quantization_status": "compressed"}


def e4m3_table(torch) -> np.ndarray:
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()


def rounding_fixture(torch) -> None:
    rng = np.random.default_rng(3)
    values = np.sort(np.unique(e4m3_table(torch)[:0x7F]))  # the non-negative values
    mids = ((values[1:].astype(np.float64) + values[:-1]) / 2).astype(np.float32)
    beside = np.concatenate([np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(1e9))])
    spread = np.concatenate([rng.standard_normal(4000) * scale for scale in (1e-4, 1e-2, 1, 50, 400)])
    inputs = np.concatenate([mids, beside, spread.astype(np.float32), values,
                             [0.0, 448.0, 449.0, 463.9, 464.0, 500.0, 1e6, 3e38, 1e-40]])
    inputs = np.concatenate([inputs, -inputs]).astype(np.float32)
    clamped = torch.from_numpy(inputs).clamp(-448.0, 448.0)
    codes = clamped.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.savez_compressed(FIXTURES / "e4m3_torch.npz", inputs=inputs, codes=codes,
                        values=e4m3_table(torch), torch_version=torch.__version__)
    print(f"e4m3_torch.npz: {inputs.size} values")


def checkpoint_fixture(torch) -> None:
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE), attn_implementation="eager")
    with torch.no_grad():  # norms off 1, so a skipped norm shows
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.1 * torch.randn(parameter.shape))
    target = FIXTURES / "fp8_llama"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        tensors = load_file(str(Path(tmp) / "model.safetensors"))
        config = json.loads((Path(tmp) / "config.json").read_text())
        for file in ("generation_config.json",):
            shutil.copy(Path(tmp) / file, target / file)
    dequantized = {}
    for layer in range(SHAPE["num_hidden_layers"]):
        scale_dtype = torch.bfloat16 if layer == 0 else torch.float32
        for projection in PROJECTIONS:
            name = f"model.layers.{layer}.{projection}.weight"
            weight = tensors[name].float()
            scale = (weight.abs().amax(dim=1, keepdim=True) / 448.0).to(scale_dtype)
            codes = (weight / scale.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
            tensors[name] = codes
            tensors[name + "_scale"] = scale
            dequantized[name] = codes.float() * scale.float()
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = QUANTIZATION_CONFIG
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(target, SHAPE["vocab_size"], TOKENIZER_OF[config["architectures"][0]])

    # the reference: transformers in float32 with the projections' dequantized weights
    reference = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE), attn_implementation="eager")
    state = {name: tensor.float() for name, tensor in tensors.items()
             if not name.endswith("_scale")}
    state.update(dequantized)
    reference.load_state_dict(state, strict=True)
    reference = reference.float().eval()
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 256, PROMPT_LEN).tolist()
    with torch.no_grad():
        logits = reference(torch.tensor([prompt])).logits[0].numpy()
        continuation = greedy(reference, torch, prompt, NUM_GREEDY)
    np.savez_compressed(target / "reference.npz", transformers_version=transformers.__version__,
                        prompt=np.array(prompt, np.int32), logits=logits.astype(np.float32),
                        greedy=np.array(continuation, np.int32))
    print(f"fp8_llama: greedy {continuation[:6]}...")


def main():
    import torch
    rounding_fixture(torch)
    checkpoint_fixture(torch)


if __name__ == "__main__":
    main()
