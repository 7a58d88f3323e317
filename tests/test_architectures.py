"""Every family but Llama against Hugging Face transformers (float32), on tiny checkpoints
that transformers wrote itself (tests/fixtures/arch_*, made by
scripts/make_arch_fixtures.py): Qwen2 (q/k/v biases, yarn RoPE), Qwen3 (q/k norms, a
sliding layer), Mistral (a sliding window on every layer), Gemma 3 (Gemma's norms,
GeGLU, scaled embeddings, sliding and full layers with their own RoPE tables, linear
scaling), Gemma 3's and Mistral Small 3's image-text checkpoints run on text (the
language model under text_config, a vision tower left on disk) and Gemma 2 (soft-capped
scores and logits).
Prompts are several windows long."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import logits_at_every_position

from cupy_llama import LLM, SamplingParams
from cupy_llama.errors import ConfigError
from cupy_llama.models import read_config

FIXTURES = Path(__file__).parent / "fixtures"
NAMES = ("qwen2", "qwen3", "mistral", "mistral3", "gemma3", "gemma3_vision", "gemma2")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def fixture(name: str) -> tuple[Path, dict]:
    folder = FIXTURES / f"arch_{name}"
    return folder, dict(np.load(folder / "reference.npz"))


def legacy_copy(folder: Path, target: Path) -> Path:
    """The same checkpoint with the released form of config.json (top-level rope_theta
    and rope_scaling, no layer_types or rope_parameters)."""
    shutil.copytree(folder, target)
    shutil.copy(folder / "config_legacy.json", target / "config.json")
    return target


def every_position_logits(model_dir: Path) -> np.ndarray:
    """The logits at every position of the fixture's long prompt."""
    name = model_dir.name.removesuffix("-legacy").removeprefix("arch_")
    return logits_at_every_position(model_dir, fixture(name)[1]["long_prompt"])


@pytest.mark.parametrize("name", NAMES)
def test_both_config_forms_read_the_same(name, tmp_path):
    folder, _ = fixture(name)
    new, old = read_config(folder), read_config(legacy_copy(folder, tmp_path / "legacy"))
    for field in ("architecture", "rope", "layer_types", "sliding_window", "qkv_bias", "qk_norm",
                  "norm_offset", "sandwich_norms", "hidden_act", "embed_scale", "attn_scale",
                  "attn_logit_softcap", "final_logit_softcap", "head_dim"):
        assert getattr(new, field) == getattr(old, field), field


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("form", ["transformers-5", "legacy"])
def test_logits_at_every_position_match_transformers(name, form, tmp_path):
    folder, reference = fixture(name)
    if form == "legacy":
        folder = legacy_copy(folder, tmp_path / f"arch_{name}-legacy")
    logits = every_position_logits(folder)
    diff = np.abs(logits - reference["logits"])
    assert diff.max() < 1e-3, f"max abs logit difference {diff.max():.2e} at position {diff.max(1).argmax()}"


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers_across_the_window(name):
    """Through the whole engine: prefill chunks of 20 tokens (a window edge falls inside
    chunks), paged decode with blocks of 16."""
    folder, reference = fixture(name)
    llm = LLM(folder, device="cpu", max_num_batched_tokens=20, log=None)
    for which in ("short", "long"):
        out = llm.generate(reference[f"{which}_prompt"].tolist(), GREEDY)
        assert out.token_ids == reference[f"greedy_{which}"].tolist(), which


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_a_prefix_cache_hit_past_the_window_gives_the_same_tokens(name):
    folder, reference = fixture(name)
    llm = LLM(folder, device="cpu", max_num_batched_tokens=32, log=None)
    prompt = reference["long_prompt"].tolist()
    first = llm.generate(prompt, GREEDY)
    again = llm.generate(prompt, GREEDY)
    assert again.num_cached_tokens == len(prompt) // 16 * 16 > 2 * read_config(folder).sliding_window
    assert first.token_ids == again.token_ids == reference["greedy_long"].tolist()


def test_gemma_configs_follow_transformers_defaults():
    """A Gemma 3 config.json of a released checkpoint (no layer_types, no rope_parameters):
    every sliding_window_pattern-th layer full, sliding layers on rope_local_base_freq
    without scaling, sqrt(hidden) rounded to bf16 (34 for the 1B's 1,152)."""
    from cupy_llama.bench.random_model import GEMMA_3_1B, config_json
    from cupy_llama.models import config_from_dicts
    config = config_from_dicts(config_json(GEMMA_3_1B))
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    assert full == [5, 11, 17, 23] and config.sliding_window == 512
    assert config.rope["sliding_attention"].theta == 10000.0
    assert config.rope["full_attention"].theta == 1000000.0
    assert config.embed_scale == 34.0 and config.attn_scale == 256 ** -0.5
    assert config.norm_offset == 1.0 and config.sandwich_norms and config.qk_norm
    assert config.hidden_act == "gelu_tanh" and config.attn_logit_softcap is None


def test_qwen_sliding_window_is_off_unless_asked():
    from cupy_llama.bench.random_model import QWEN2_5_1_5B, config_json
    from cupy_llama.models import config_from_dicts
    config = config_from_dicts(config_json(QWEN2_5_1_5B))
    assert config.sliding_window is None and set(config.layer_types) == {"full_attention"}
    assert config.qkv_bias and not config.qk_norm
    config = config_from_dicts(config_json({**QWEN2_5_1_5B, "use_sliding_window": True}))
    sliding = [i for i, kind in enumerate(config.layer_types) if kind == "sliding_attention"]
    assert sliding == list(range(21, 28)) and config.sliding_window == 32768
    with pytest.raises(ConfigError, match="max_window_layers must be an integer .*got None"):
        config_from_dicts(config_json({**QWEN2_5_1_5B, "use_sliding_window": True,
                                       "max_window_layers": None}))


def test_a_yarn_rope_stretches_the_context(capsys, tmp_path):
    """Qwen2.5's model cards add yarn rope_scaling (factor 4 over an original 32,768) and
    leave max_position_embeddings at 32,768: the model then takes 131,072 positions, as
    vLLM takes it; past that, the limit names the yarn settings."""
    from cupy_llama.bench.random_model import QWEN2_5_1_5B, config_json
    from cupy_llama.config import EngineConfig
    from cupy_llama.models import config_from_dicts
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    plain = config_from_dicts(config_json({**QWEN2_5_1_5B, "max_position_embeddings": 32768}))
    config = config_from_dicts(config_json({**QWEN2_5_1_5B, "max_position_embeddings": 32768,
                                            "rope_scaling": yarn}))
    assert plain.context_limit == 32768 and config.context_limit == 131072
    assert EngineConfig(max_model_len=65536).resolved_max_model_len(config) == 65536
    assert EngineConfig().resolved_max_model_len(config) == 8192  # the default stays
    with pytest.raises(ConfigError, match="limit of 131072 tokens \\(config.json's yarn "
                                          "rope_scaling"):
        EngineConfig(max_model_len=200000).resolved_max_model_len(config)
    with pytest.raises(ConfigError, match="limit of 32768 tokens \\(max_position_embeddings"):
        EngineConfig(max_model_len=65536).resolved_max_model_len(plain)
    # a tiny Qwen2 stretched past its max_position_embeddings runs there and says so
    from cupy_llama.cli import main
    folder = tmp_path / "qwen2"
    shutil.copytree(fixture("qwen2")[0], folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["rope_parameters"]["original_max_position_embeddings"] = 256  # x 4: 1,024 positions
    (folder / "config.json").write_text(json.dumps(raw))
    assert main(["info", "--model", str(folder), "--device", "cpu"]) == 0
    assert "512 positions, 1024 with the yarn rope_scaling" in capsys.readouterr().out
    llm = LLM(folder, device="cpu", max_model_len=1024, log=None)
    out = llm.generate([3 + i % 250 for i in range(700)], SamplingParams(max_tokens=2, temperature=0))
    assert len(out.token_ids) == 2 and llm.context_limit == 1024
    llm.close()


def test_info_names_one_layer_as_a_layer():
    from cupy_llama.cli.info import _ranges
    assert _ranges([1]) == "layer 1"
    assert _ranges([0, 1, 2, 4]) == "layers 0-2, 4"


def test_mistral_takes_the_layer_types_a_config_lists():
    """A Mistral config's sliding_window covers every layer, unless the config lists each
    layer's kind (Ministral's full and sliding layers, as transformers reads them)."""
    from cupy_llama.models import config_from_dicts
    raw = json.loads((fixture("mistral")[0] / "config.json").read_text())
    layers = raw["num_hidden_layers"]
    assert raw.get("sliding_window") and "layer_types" not in raw
    config = config_from_dicts(raw)
    assert config.layer_types == ("sliding_attention",) * layers
    listed = ["full_attention"] + ["sliding_attention"] * (layers - 1)
    config = config_from_dicts({**raw, "layer_types": listed})
    assert config.layer_types == tuple(listed) and config.sliding_window == raw["sliding_window"]
    config = config_from_dicts({**raw, "layer_types": ["full_attention"] * layers})
    assert config.sliding_window is None
    with pytest.raises(ConfigError, match="sliding_attention layers need sliding_window"):
        config_from_dicts({**raw, "sliding_window": None, "layer_types": listed})


@pytest.mark.parametrize("name", ["gemma3_vision", "mistral3"])
def test_an_image_text_checkpoint_in_transformers_5_names_reads_the_same(name, tmp_path):
    """An image-text checkpoint's language model under the names transformers 5 holds it
    in (model.language_model.*, lm_head.*, model.vision_tower.*), as a checkpoint saved from
    them may write them: the same logits as the released names (language_model.model.*)."""
    from cupy_llama.checkpoint import write_safetensors
    from cupy_llama.weights import Checkpoint, read_safetensors_header
    folder, reference = fixture(name)
    target = tmp_path / f"arch_{name}"
    shutil.copytree(folder, target)
    path = target / "model.safetensors"
    tensors = read_safetensors_header(path)
    with Checkpoint(target, tensors) as checkpoint:
        renamed = {}
        for name in tensors:
            new = name.replace("language_model.model.", "model.language_model.", 1)
            new = new.replace("language_model.lm_head.", "lm_head.", 1)
            if name.startswith(("vision_tower.", "multi_modal_projector.")):
                new = "model." + name
            renamed[new] = np.array(checkpoint.read(name))
        dtypes = {name: "BF16" for name, array in renamed.items() if array.dtype == np.uint16}
    assert any(n.startswith("model.language_model.") for n in renamed)
    write_safetensors(path, renamed, dtypes=dtypes)
    logits = every_position_logits(target)
    assert np.abs(logits - reference["logits"]).max() < 1e-3


def test_a_released_image_text_config_reads_as_transformers_reads_it():
    """gemma-3-4b-it's config.json writes only what differs from Gemma3TextConfig's
    defaults under text_config; the layers, heads and RoPE tables transformers 5.25 makes
    of it, and the top level's end-of-turn id."""
    from cupy_llama.models import config_from_dicts
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
           "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
           "mm_tokens_per_image": 256, "model_type": "gemma3", "torch_dtype": "bfloat16",
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                           "model_type": "gemma3_text", "num_hidden_layers": 34,
                           "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"}}
    config = config_from_dicts(raw)
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    assert full == [5, 11, 17, 23, 29] and config.sliding_window == 1024
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 4, 256)
    assert (config.vocab_size, config.max_position_embeddings) == (262208, 131072)
    assert config.attn_scale == 256 ** -0.5 and config.tie_word_embeddings
    assert config.rope["sliding_attention"].theta == 10000.0
    full_rope = config.rope["full_attention"]
    assert full_rope.theta == 1000000.0 and full_rope.rope_type == "linear" and full_rope.factor == 8.0
    assert set(config.eos_token_ids) == {1, 106}
    from cupy_llama.bench.random_model import GEMMA_3_4B, config_json
    preset = config_from_dicts(config_json(GEMMA_3_4B))  # bench's gemma-3-4b: the same model
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "vocab_size", "layer_types", "sliding_window",
                  "rope", "attn_scale", "embed_scale", "max_position_embeddings"):
        assert getattr(preset, field) == getattr(config, field), field
    with pytest.raises(ConfigError, match="text_config must be an object"):
        config_from_dicts({**raw, "text_config": None})
    with pytest.raises(ConfigError, match="text_config.model_type 'gemma3n_text' is not "
                                          "supported for Gemma3ForConditionalGeneration"):
        config_from_dicts({**raw, "text_config": {**raw["text_config"],
                                                  "model_type": "gemma3n_text"}})
