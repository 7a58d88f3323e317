"""FP8 weights on the CPU: the e4m3 reference (cupy_llama/fp8.py) against torch's
float8_e4m3fn (tests/fixtures/e4m3_torch.npz) and the format's definition, the
compressed-tensors loader against transformers on the dequantized weights
(tests/fixtures/fp8_llama, both made by scripts/make_fp8_fixtures.py), quantization at
load, and the errors for what is not supported."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import logits_at_every_position, read_jsonl

from cupy_llama import LLM, SamplingParams
from cupy_llama.backends.cpu import CpuBackend
from cupy_llama.checkpoint import write_safetensors
from cupy_llama.config import EngineConfig
from cupy_llama.errors import CheckpointError, ConfigError
from cupy_llama.fp8 import (E4M3_VALUES, dequantize_rows, e4m3_to_float32, float32_to_e4m3,
                            quantize_rows, row_scales)
from cupy_llama.interface import Fp8Weight
from cupy_llama.models import config_from_dicts, model_for, read_config
from cupy_llama.weights import open_checkpoint

FIXTURES = Path(__file__).parent / "fixtures"
FP8_MODEL = FIXTURES / "fp8_llama"


# ------------------------------------------------------------------ the e4m3 reference

def test_code_values_follow_the_format():
    # sign, 4 exponent bits of bias 7, 3 mantissa bits; exponent 0 is subnormal
    expected = {0x00: 0.0, 0x01: 2.0**-9, 0x07: 7 * 2.0**-9, 0x08: 2.0**-6, 0x0F: 1.875 * 2**-6,
                0x38: 1.0, 0x39: 1.125, 0x40: 2.0, 0x7E: 448.0, 0x80: -0.0, 0xB8: -1.0,
                0xFE: -448.0}
    for code, value in expected.items():
        assert E4M3_VALUES[code] == value, hex(code)
    assert np.isnan(E4M3_VALUES[[0x7F, 0xFF]]).all()
    assert np.isnan(E4M3_VALUES).sum() == 2


def test_code_values_equal_torchs():
    torch_values = np.load(FIXTURES / "e4m3_torch.npz")["values"]
    assert np.array_equal(E4M3_VALUES, torch_values, equal_nan=True)


def test_rounding_equals_torchs_saturating_cast():
    fixture = np.load(FIXTURES / "e4m3_torch.npz")
    codes = float32_to_e4m3(fixture["inputs"])
    wrong = np.flatnonzero(codes != fixture["codes"])
    assert wrong.size == 0, (f"{wrong.size} codes differ, e.g. {fixture['inputs'][wrong[:3]]} -> "
                             f"{codes[wrong[:3]]} (torch {fixture['codes'][wrong[:3]]})")


@pytest.mark.parametrize("value, code", [
    (1.0625, 0x38),         # halfway between 1 (0x38) and 1.125 (0x39): the even code
    (1.1875, 0x3A),         # halfway between 1.125 and 1.25: the even code is 1.25's
    (1.5 * 2.0**-9, 0x02),  # halfway between two subnormals
    (0.5 * 2.0**-9, 0x00),  # halfway between 0 and the smallest subnormal
    (7.5 * 2.0**-9, 0x08),  # the largest subnormal rounds up into the first normal value
    (460.0, 0x7E), (1e30, 0x7E), (float("inf"), 0x7E),  # saturated
    (-1e30, 0xFE), (-0.0, 0x80), (float("nan"), 0x7F),
])
def test_rounding_rules(value, code):
    assert float32_to_e4m3(np.array([value], np.float32))[0] == code


def test_quantize_rows_scales_each_row_to_the_whole_range():
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((6, 40)).astype(np.float32) * np.array([[1e-3], [1], [30], [1], [5], [1]], np.float32)
    weight[3] = 0.0  # a zero row
    codes, scale = quantize_rows(weight)
    assert codes.dtype == np.uint8 and scale.dtype == np.float32 and scale.shape == (6,)
    amax = np.abs(weight).max(axis=1)
    nonzero = amax > 0
    assert np.array_equal(scale[nonzero], (amax[nonzero] / np.float32(448)).astype(np.float32))
    assert scale[3] == np.finfo(np.float32).tiny and not codes[3].any()
    # each row's largest magnitude becomes +-448 exactly
    biggest = np.abs(weight).argmax(axis=1)
    assert (np.abs(e4m3_to_float32(codes[nonzero, biggest[nonzero]])) == 448).all()
    # every value within half a step of e4m3 (3 mantissa bits) of the original
    restored = dequantize_rows(codes, scale)
    normal = np.abs(weight) >= scale[:, None] * 2.0**-6
    relative = np.abs(restored - weight)[normal] / np.abs(weight)[normal]
    assert relative.max() <= 2.0**-4 * (1 + 1e-6)
    assert np.array_equal(row_scales(weight), scale)


# ------------------------------------------------------------------ quantization_config

def fp8_raw(**changes) -> dict:
    raw = json.loads((FP8_MODEL / "config.json").read_text())
    qc = raw["quantization_config"]
    for key, value in changes.items():
        if key.startswith("weights_"):
            qc["config_groups"]["group_0"]["weights"][key.removeprefix("weights_")] = value
        else:
            qc[key] = value
    return raw


def test_a_compressed_tensors_fp8_config_reads_as_fp8():
    config = config_from_dicts(fp8_raw())
    assert config.quantization == config.checkpoint_quantization == "fp8"
    static = fp8_raw()  # static activation scales: the activations stay bf16 anyway
    static["quantization_config"]["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    assert config_from_dicts(static).quantization == "fp8"
    per_tensor = config_from_dicts(fp8_raw(weights_strategy="tensor"))
    assert per_tensor.quantization == "fp8"


@pytest.mark.parametrize("changes, needle", [
    (dict(quant_method="awq"), "quant_method 'awq' is not supported"),
    (dict(quant_method="gptq"), "quant_method 'gptq'"),
    (dict(quant_method="fp8"), "compressed-tensors"),
    (dict(format="pack-quantized"), "format 'pack-quantized'"),
    (dict(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
    (dict(weights_num_bits=4), "num_bits"),
    (dict(weights_type="int"), "type"),
    (dict(weights_strategy="group"), "strategy 'group'"),
    (dict(weights_dynamic=True), "dynamic"),
])
def test_unsupported_quantization_is_one_line_naming_it(changes, needle):
    with pytest.raises(ConfigError) as info:
        config_from_dicts(fp8_raw(**changes))
    message = str(info.value)
    assert needle in message and "\n" not in message, message


def test_the_quantization_option_is_checked():
    with pytest.raises(ConfigError, match="quantization must be one of fp8"):
        EngineConfig(quantization="int4")
    config = read_config(FIXTURES / "arch_qwen3")
    assert EngineConfig(quantization="fp8").model_config(config).quantization == "fp8"
    assert EngineConfig().model_config(config).quantization is None


# ------------------------------------------------------------------ an FP8 checkpoint

def every_position_logits(model_dir: Path, quantization=None) -> np.ndarray:
    config = EngineConfig(quantization=quantization).model_config(read_config(model_dir))
    prompt = np.load(FP8_MODEL / "reference.npz")["prompt"]
    return logits_at_every_position(model_dir, prompt, config)


def test_an_fp8_checkpoint_matches_transformers_on_its_dequantized_weights():
    reference = np.load(FP8_MODEL / "reference.npz")
    logits = every_position_logits(FP8_MODEL)
    diff = np.abs(logits - reference["logits"])
    assert diff.max() < 1e-3, f"max abs logit difference {diff.max():.2e}"


def test_an_fp8_checkpoint_generates_what_transformers_does():
    reference = np.load(FP8_MODEL / "reference.npz")
    greedy = SamplingParams(temperature=0, max_tokens=len(reference["greedy"]), ignore_eos=True)
    with LLM(str(FP8_MODEL), device="cpu", max_model_len=128) as llm:
        out = llm.generate([reference["prompt"].tolist()], greedy)[0]
    assert out.token_ids == reference["greedy"].tolist()


def test_the_cpu_backend_holds_the_products_as_fp8():
    config = read_config(FP8_MODEL)
    model = model_for(config)
    with open_checkpoint(FP8_MODEL, model) as checkpoint:
        backend = CpuBackend(model, checkpoint, max_model_len=64, max_num_seqs=2, num_kv_blocks=4)
        qkv = backend.weights["layers.0.qkv"]
        assert isinstance(qkv, Fp8Weight) and qkv.shape == (64 + 2 * 32, 64)
        # the values are e4m3 values exactly, the scales the checkpoint's (bf16 in layer 0)
        assert np.isin(qkv.data, E4M3_VALUES).all()
        q_scale = checkpoint.read_float32("model.layers.0.self_attn.q_proj.weight_scale").reshape(-1)
        assert np.array_equal(qkv.scale[:64], q_scale)
        for key in ("embed", "lm_head", "final_norm", "layers.1.input_norm"):
            assert isinstance(backend.weights[key], np.ndarray)
        assert not any(key.endswith(".scale") for key in backend.weights)


def bf16_copy(tmp_path) -> Path:
    """The FP8 fixture's model with its projections dequantized to bf16 (a bf16
    checkpoint, the kind --quantization fp8 takes)."""
    from cupy_llama.bf16 import float32_to_bf16_bits
    target = tmp_path / "bf16"
    shutil.copytree(FP8_MODEL, target)
    config = json.loads((target / "config.json").read_text())
    del config["quantization_config"]
    (target / "config.json").write_text(json.dumps(config))
    config = read_config(FP8_MODEL)
    with open_checkpoint(FP8_MODEL, model_for(config)) as checkpoint:
        tensors = {}
        for name in checkpoint.tensors:
            if name.endswith("_scale"):
                continue
            if name + "_scale" in checkpoint.tensors:
                weight = dequantize_rows(checkpoint.read(name), checkpoint.read_scales(name + "_scale"))
                tensors[name] = float32_to_bf16_bits(weight)
            else:
                tensors[name] = np.array(checkpoint.read(name))
    write_safetensors(target / "model.safetensors", tensors)
    return target


def test_quantizing_at_load_is_fp8_close_to_bf16(tmp_path):
    """--quantization fp8 on a bf16 checkpoint: each projection's rows within half an e4m3
    step of the bf16 weights, and a model whose outputs stay near the bf16 model's."""
    folder = bf16_copy(tmp_path)
    config = EngineConfig(quantization="fp8").model_config(read_config(folder))
    with open_checkpoint(folder, model_for(config)) as checkpoint:
        backend = CpuBackend(model_for(config), checkpoint, max_model_len=64, max_num_seqs=2,
                             num_kv_blocks=4)
        from cupy_llama.bf16 import bf16_bits_to_float32
        bf16 = np.concatenate([bf16_bits_to_float32(checkpoint.read_bf16(
            f"model.layers.1.mlp.{name}_proj.weight")) for name in ("gate", "up")])
    gate_up = backend.weights["layers.1.gate_up"]
    restored = gate_up.data * gate_up.scale[:, None]
    assert np.array_equal(gate_up.scale, (np.abs(bf16).max(1) / np.float32(448)).astype(np.float32))
    normal = np.abs(bf16) >= gate_up.scale[:, None] * 2.0**-6
    assert (np.abs(restored - bf16)[normal] <= np.abs(bf16)[normal] * 2.0**-4 * (1 + 1e-6)).all()

    fp8, plain = every_position_logits(folder, quantization="fp8"), every_position_logits(folder)
    assert not np.array_equal(fp8, plain)  # the quantized model did run in FP8
    assert np.abs(fp8 - plain).mean() < 0.02 * np.abs(plain).mean()
    assert (fp8.argmax(1) == plain.argmax(1)).mean() >= 0.9


def test_fp8_at_load_through_the_engine_and_its_memory_plan(tmp_path):
    folder = bf16_copy(tmp_path)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(folder), device="cpu", quantization="fp8", max_model_len=128) as llm:
        assert llm.engine.config.quantization == "fp8"
        assert isinstance(llm.engine.backend.weights["layers.1.gate_up"], Fp8Weight)
        rows = {name: note for name, _, note in llm.engine.backend.memory_plan()}
        assert "FP8" in rows["weights"]
        assert len(llm.generate(["hello"], greedy)[0].token_ids) == 8


def test_per_tensor_and_flat_scales_are_read_per_row(tmp_path):
    target = tmp_path / "m"
    shutil.copytree(FP8_MODEL, target)
    config = read_config(FP8_MODEL)
    with open_checkpoint(FP8_MODEL, model_for(config)) as checkpoint:
        tensors = {name: np.array(checkpoint.read(name)) for name in checkpoint.tensors}
    name = "model.layers.1.self_attn.o_proj.weight_scale"
    tensors[name] = np.array([0.5], np.float32)                     # per tensor
    flat = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[flat] = tensors[flat].reshape(-1)                          # [N], not [N, 1]
    write_safetensors(target / "model.safetensors", tensors,
                      dtypes={n: "F8_E4M3" for n in model_for(config).fp8_tensors()})
    with open_checkpoint(target, model_for(config)) as checkpoint:
        assert np.array_equal(checkpoint.read_scales(name), np.full(64, 0.5, np.float32))
        assert checkpoint.read_scales(flat).shape == (64,)
        backend = CpuBackend(model_for(config), checkpoint, max_model_len=64, max_num_seqs=2,
                             num_kv_blocks=4)
    assert np.array_equal(backend.weights["layers.1.o_proj"].scale, np.full(64, 0.5, np.float32))


def test_fp8_tensors_without_a_quantization_config_are_refused(tmp_path):
    target = tmp_path / "m"
    shutil.copytree(FP8_MODEL, target)
    config = json.loads((target / "config.json").read_text())
    del config["quantization_config"]
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="only the projections of a checkpoint with a "
                                              "compressed-tensors quantization_config"):
        with LLM(str(target), device="cpu"):
            pass


def test_a_bf16_projection_in_an_fp8_checkpoint_is_refused(tmp_path):
    target = tmp_path / "m"
    shutil.copytree(FP8_MODEL, target)
    config = read_config(FP8_MODEL)
    with open_checkpoint(FP8_MODEL, model_for(config)) as checkpoint:
        tensors = {name: np.array(checkpoint.read(name)) for name in checkpoint.tensors}
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = np.zeros(tensors[name].shape, np.uint16)  # bf16 zeros
    fp8 = {n: "F8_E4M3" for n in model_for(config).fp8_tensors() if n != name}
    write_safetensors(target / "model.safetensors", tensors, dtypes=fp8)
    with pytest.raises(CheckpointError, match="mlp.up_proj.weight' is BF16 but"):
        with open_checkpoint(target, model_for(config)):
            pass


# ------------------------------------------------------------------ the command line

def test_the_command_line_takes_quantization(tmp_path, capsys):
    from cupy_llama.cli import main
    from cupy_llama.cli.options import QUANTIZATIONS as CLI_QUANTIZATIONS
    from cupy_llama.config import QUANTIZATIONS
    assert CLI_QUANTIZATIONS == QUANTIZATIONS
    folder = bf16_copy(tmp_path)
    assert main(["info", "--model", str(folder), "--device", "cpu", "--quantization", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "projections FP8 (e4m3, a float32 scale per row; quantized at load)" in out
    assert main(["info", "--model", str(FP8_MODEL), "--device", "cpu"]) == 0
    assert "the checkpoint's" in capsys.readouterr().out
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    output = tmp_path / "out.jsonl"
    assert main(["generate", "--model", str(folder), "--input", str(prompts), "--output",
                 str(output), "--device", "cpu", "--quantization", "fp8", "--max-tokens", "3",
                 "--temperature", "0"]) == 0
    assert read_jsonl(output)[0]["text"]
    assert main(["info", "--model", str(folder), "--device", "cpu", "--quantization", "int4"]) == 2
    assert "'int4' is not 'fp8'" in capsys.readouterr().err


def test_the_bandwidth_floor_counts_what_fp8_weights_read():
    """bench latency's floor: the bytes a batch-1 step reads, a byte per FP8 weight plus a
    float32 scale per row, against two bytes per bf16 weight (Llama-3.2-1B's shape)."""
    from cupy_llama.bench.offline import bandwidth_floor
    from cupy_llama.bench.random_model import PRESETS, config_json
    config = config_from_dicts(config_json(PRESETS["llama-3.2-1b"]))
    c = config
    rows = c.q_size + 2 * c.kv_size + c.hidden_size + 2 * c.intermediate_size + c.hidden_size
    products = c.num_hidden_layers * (c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
                                      + 3 * c.hidden_size * c.intermediate_size)
    rest = c.num_parameters - products  # embeddings (tied: read as the head), norms
    bf16 = bandwidth_floor(config, 1e12, 100.0)
    fp8 = bandwidth_floor(EngineConfig(quantization="fp8").model_config(config), 1e12, 100.0)
    assert bf16["weight_bytes_per_step"] == 2 * c.num_parameters
    assert fp8["weight_bytes_per_step"] == products + 4 * c.num_hidden_layers * rows + 2 * rest
    assert fp8["floor_tok_s"] / bf16["floor_tok_s"] > 1.6  # the LM head stays bf16


def test_the_fp8_product_switch_reads_from_the_environment():
    from cupy_llama.backends.cuda.switches import KernelSwitches
    assert KernelSwitches().fp8_gemm == "cublaslt"
    assert KernelSwitches.from_environment({"CUPY_LLAMA_FP8_GEMM": "dequantize"}).fp8_gemm == "dequantize"
    with pytest.raises(ConfigError, match="CUPY_LLAMA_FP8_GEMM must be one of cublaslt, dequantize"):
        KernelSwitches.from_environment({"CUPY_LLAMA_FP8_GEMM": "cutlass"})
