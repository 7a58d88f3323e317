"""Bad model directories through the `cupy-llama` command: each gives exit code 1 and ONE
line on stderr that names the problem, never a traceback. (tests/test_weights.py checks
the same cases through the API, with their exception types.)"""
import importlib.util
import io
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import one_error_line

from cupy_llama.checkpoint import write_safetensors
from cupy_llama.cli import main
from cupy_llama.bench.random_model import make_random_model


@pytest.fixture(scope="module")
def good_model(tmp_path_factory):
    return make_random_model(tmp_path_factory.mktemp("good") / "model", "tiny", seed=0,
                             num_hidden_layers=1, vocab_size=320)


def read_parts(path):
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_parts(path, header, data, header_bytes=None):
    header_bytes = header_bytes if header_bytes is not None else json.dumps(header).encode()
    path.write_bytes(len(header_bytes).to_bytes(8, "little") + header_bytes + data)


def first_tensor(header):
    return next(k for k in header if k != "__metadata__")


def edit_entry(field, value):
    def corrupt(d):
        st = d / "model.safetensors"
        header, data = read_parts(st)
        header[first_tensor(header)][field] = value
        write_parts(st, header, data)
    return corrupt


def edit_offsets(fn):
    def corrupt(d):
        st = d / "model.safetensors"
        header, data = read_parts(st)
        names = sorted((k for k in header if k != "__metadata__"),
                       key=lambda k: header[k]["data_offsets"][0])
        fn(header, names)
        write_parts(st, header, data)
    return corrupt


def raw_bytes(fn):
    def corrupt(d):
        st = d / "model.safetensors"
        st.write_bytes(fn(st.read_bytes()))
    return corrupt


def header_text(text: bytes):
    def corrupt(d):
        _, data = read_parts(d / "model.safetensors")
        write_parts(d / "model.safetensors", None, data, header_bytes=text)
    return corrupt


def edit_config(**changes):
    def corrupt(d):
        raw = json.loads((d / "config.json").read_text())
        raw.update(changes)
        (d / "config.json").write_text(json.dumps(raw))
    return corrupt


def edit_tensors(fn):
    def corrupt(d):
        from cupy_llama.weights import open_checkpoint
        from cupy_llama.models import model_for, read_config
        with open_checkpoint(d, model_for(read_config(d))) as ckpt:
            tensors = {name: np.array(ckpt.read(name)) for name in ckpt.tensors}
        write_safetensors(d / "model.safetensors", fn(tensors))
    return corrupt


def shard_outside(d):
    st = d / "model.safetensors"
    shutil.move(st, d.parent / "elsewhere.safetensors")
    header, _ = read_parts(d.parent / "elsewhere.safetensors")
    weight_map = {k: "../elsewhere.safetensors" for k in header if k != "__metadata__"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def shift_first(header, names):
    header[names[0]]["data_offsets"][0] += 2


def overlap(header, names):
    header[names[1]]["data_offsets"][0] -= 2


def gap(header, names):
    for name in names[1:]:
        header[name]["data_offsets"] = [x + 2 for x in header[name]["data_offsets"]]


CASES = {
    # safetensors rules
    "file shorter than 8 bytes": (raw_bytes(lambda b: b[:5]), "8"),
    "header length over 100 MB": (raw_bytes(lambda b: (200_000_000).to_bytes(8, "little") + b[8:]), "header"),
    "header length past end of file": (raw_bytes(lambda b: (len(b) + 10).to_bytes(8, "little") + b[8:]), "header"),
    "header not UTF-8": (header_text(b'{"a": "\xff\xfe"}'), "utf-8"),
    "header not JSON": (header_text(b"{not json"), "json"),
    "header not an object": (header_text(b"[1, 2]"), "object"),
    "entry without dtype": (edit_entry("dtype", None), "dtype"),
    "unknown dtype": (edit_entry("dtype", "Q4_K"), "q4_k"),
    "negative shape": (edit_entry("shape", [-1, 4]), "shape"),
    "offsets not from 0": (edit_offsets(shift_first), "0"),
    "overlapping offsets": (edit_offsets(overlap), "overlap"),
    "gap in offsets": (edit_offsets(gap), "gap"),
    "truncated file": (raw_bytes(lambda b: b[:-10]), "truncated"),
    "trailing bytes": (raw_bytes(lambda b: b + b"\0" * 16), "trailing"),
    "shape does not match byte range": (edit_entry("shape", [3]), "bytes"),
    # model directory
    "missing config.json": (lambda d: (d / "config.json").unlink(), "config.json"),
    "unsupported architecture": (edit_config(architectures=["PhiForCausalLM"], model_type="phi"), "phiforcausallm"),
    "unsupported model type": (edit_config(architectures=None, model_type="phi"), "'phi'"),
    "unsupported rope type": (edit_config(rope_scaling={"rope_type": "longrope", "factor": 4.0}), "longrope"),
    "yarn rope without a factor": (edit_config(rope_scaling={"rope_type": "yarn", "factor": "x"}), "factor"),
    "qwen3 with o_proj bias": (edit_config(architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                                           attention_bias=True), "attention_bias"),
    "llama3 rope factor not a number": (edit_config(rope_scaling={
        "rope_type": "llama3", "factor": "x", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}), "factor"),
    "no kv heads": (edit_config(num_key_value_heads=0), "num_key_value_heads"),
    "rms_norm_eps null": (edit_config(rms_norm_eps=None), "rms_norm_eps"),
    "generation config not an object": (
        lambda d: (d / "generation_config.json").write_text("[1, 2]"), "generation_config.json"),
    "generation config top_k negative": (
        lambda d: (d / "generation_config.json").write_text(json.dumps(
            {"do_sample": True, "temperature": 0.6, "top_k": -2})), "generation_config.json: top_k"),
    "missing weights file": (lambda d: (d / "model.safetensors").unlink(), "safetensors"),
    "GGUF weights": (lambda d: (d / "model.safetensors").rename(d / "model-Q4_K_M.gguf"),
                     "found model-q4_k_m.gguf, gguf (llama.cpp's format), which cupy-llama "
                     "does not load"),
    "missing tensor": (edit_tensors(lambda t: {k: v for k, v in t.items() if "o_proj" not in k}), "o_proj"),
    "unexpected tensor": (edit_tensors(lambda t: {**t, "model.extra.weight": np.zeros(4, np.uint16)}), "model.extra.weight"),
    "wrong shape": (edit_tensors(lambda t: {**t, "model.norm.weight": np.zeros(63, np.uint16)}), "model.norm.weight"),
    "shard outside the directory": (shard_outside, "outside"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_model_dir_gives_one_line_and_exit_1(case, good_model, tmp_path, capsys):
    model_dir = tmp_path / "model"
    shutil.copytree(good_model, model_dir)
    corrupt, keyword = CASES[case]
    corrupt(model_dir)
    code = main(["info", "--model", str(model_dir), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 1, err
    line = one_error_line(err)
    assert len(err.strip().splitlines()) == 1 and keyword in line.lower(), err


def test_console_script_prints_no_traceback(good_model, tmp_path):
    """The installed entry point, in its own process, for a bad file and a missing dir."""
    model_dir = tmp_path / "model"
    shutil.copytree(good_model, model_dir)
    raw_bytes(lambda b: b[:-10])(model_dir)
    for target in (model_dir, tmp_path / "missing"):
        result = subprocess.run([sys.executable, "-m", "cupy_llama.cli", "info", "--model",
                                 str(target), "--device", "cpu"], capture_output=True, text=True)
        assert result.returncode == 1
        assert "Traceback" not in result.stderr and result.stderr.startswith("error: ")


# ---- what the user named on the command line --------------------------------------------

@pytest.mark.parametrize("command", [
    ["info"], ["chat", "hi"], ["generate", "--input", "PROMPTS"], ["bench", "latency"],
    ["serve", "--port", "0"]])
def test_every_model_path_mistake_is_a_one_line_exit_1(command, good_model, tmp_path, capsys):
    """A folder that does not exist and a file where the folder belongs are the same kind
    of mistake: a runtime problem with what was named (1), for every command."""
    if command[0] == "serve":
        for package in ("fastapi", "uvicorn", "pydantic", "prometheus_client"):
            pytest.importorskip(package)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hi\n")
    args = [str(prompts) if arg == "PROMPTS" else arg for arg in command]
    # GGUF (llama.cpp's format), named as such: a file by its name or its magic bytes, and
    # a folder of them without config.json
    gguf_folder = tmp_path / "Llama-3.2-1B-Instruct-GGUF"
    gguf_folder.mkdir()
    (gguf_folder / "Llama-3.2-1B-Instruct-Q4_K_M.gguf").write_bytes(b"GGUF\x03\0\0\0")
    (tmp_path / "renamed.bin").write_bytes(b"GGUF\x03\0\0\0")
    not_gguf = "cupy-llama does not load GGUF (llama.cpp's format): pass a Hugging Face model " \
               "folder (config.json, tokenizer.json and .safetensors weights)"
    for model, fragment in ((tmp_path / "nonexistent", "does not exist"),
                            (good_model / "config.json", "is a file, not a model directory"),
                            (gguf_folder / "Llama-3.2-1B-Instruct-Q4_K_M.gguf",
                             f"is a GGUF file; {not_gguf}"),
                            (tmp_path / "renamed.bin", f"is a GGUF file; {not_gguf}"),
                            (gguf_folder, "holds GGUF files (Llama-3.2-1B-Instruct-Q4_K_M.gguf) "
                                          f"and no config.json; {not_gguf}")):
        assert main([*args, "--model", str(model), "--device", "cpu"]) == 1, model
        assert fragment in one_error_line(capsys.readouterr().err)
    # an empty --model (an unset variable) is a usage error, not the demo model nor "."
    assert main([*args, "--model", "", "--device", "cpu"]) == 2
    assert "'--model': is empty; name a model folder" in one_error_line(capsys.readouterr().err)


def test_a_folder_without_weights_is_found_before_loading(good_model, tmp_path, capsys):
    """config.json and the tokenizer, but GGUF weights in place of safetensors: every
    command names the folder and what it lacks before the load (and the tokenizer's load)
    starts, and generate writes no file."""
    model_dir = tmp_path / "model"
    shutil.copytree(good_model, model_dir)
    (model_dir / "model.safetensors").rename(model_dir / "model-Q4_K_M.gguf")
    prompts, out = tmp_path / "prompts.txt", tmp_path / "out"
    prompts.write_text("hi\n")
    out.mkdir()
    commands = [["chat", "hi"], ["info"],
                ["generate", "--input", str(prompts), "--output", str(out / "r.jsonl")]]
    if all(importlib.util.find_spec(p) for p in ("fastapi", "uvicorn", "pydantic")):
        commands.append(["serve", "--port", "0"])  # before it listens
    for command in commands:
        assert main([*command, "--model", str(model_dir), "--device", "cpu"]) == 1, command
        err = capsys.readouterr().err
        assert one_error_line(err) == (
            f"error: no weights in {str(model_dir)!r}: looked for model.safetensors and "
            "model.safetensors.index.json; found model-Q4_K_M.gguf, GGUF (llama.cpp's "
            "format), which cupy-llama does not load: use the model's Hugging Face release "
            "(.safetensors weights)"), command
        assert "loading" not in err, command
    assert list(out.iterdir()) == []


def test_a_context_beyond_the_model_names_the_flag_and_the_limit(good_model, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hi\n")
    commands = [["chat", "hi"], ["generate", "--input", str(prompts)], ["info"]]
    if all(importlib.util.find_spec(p) for p in ("fastapi", "uvicorn", "pydantic")):
        commands.append(["serve", "--port", "0"])  # before it listens
    for command in commands:
        code = main([*command, "--model", str(good_model), "--device", "cpu",
                     "--max-model-len", "100000"])
        err = capsys.readouterr().err
        assert code == 2, err
        line = one_error_line(err)
        assert line.startswith("error: --max-model-len 100000 exceeds the model's limit of "
                               "4096 tokens"), line
        assert "loading" not in err  # before the weights are read


def too_long_prompt(good_model, tmp_path, capsys, *options):
    prompts = tmp_path / "long.txt"
    prompts.write_text("x" * 5000 + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--model", str(good_model), "--input", str(prompts), "--output",
                 str(out), "--device", "cpu", "--overwrite", *options]) == 1
    capsys.readouterr()
    return json.loads(out.read_text())["error"]


def test_a_prompt_too_long_says_what_can_be_done(good_model, tmp_path, capsys):
    # the context is the model's own maximum: only shortening helps
    error = too_long_prompt(good_model, tmp_path, capsys)
    assert "context limit is 4096" in error and error.endswith("shorten the prompt")
    # a smaller --max-model-len: raising it helps, up to the model's limit
    error = too_long_prompt(good_model, tmp_path, capsys, "--max-model-len", "1024")
    assert error.endswith("shorten the prompt or raise --max-model-len (the model takes up "
                          "to 4096)")
    # a KV cache smaller than the context: more blocks help
    error = too_long_prompt(good_model, tmp_path, capsys, "--num-kv-blocks", "8")
    assert "context limit is 128" in error
    assert error.endswith("or give the KV cache room for more than 128 tokens "
                          "(--num-kv-blocks)")


@pytest.mark.parametrize("template, fragment", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    ("{{ cycler.__init__.__globals__.os.popen('id').read() }}", "unsafe"),
    ("{% for m in messages %}", "not valid jinja"),
    ("{{ messages + 1 }}", "TypeError"),
    ("{{ raise_exception('this template is broken') }}", "this template is broken"),
])
def test_a_broken_chat_template_fails_the_load(template, fragment, good_model, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(good_model, model_dir)
    (model_dir / "chat_template.jinja").write_text(template)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hi\n")
    for command in (["chat"], ["generate", "--input", str(prompts)]):
        result = subprocess.run([sys.executable, "-m", "cupy_llama.cli", *command, "--model",
                                 str(model_dir), "--device", "cpu"], input="hello\n",
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 1, result.stderr
        line = one_error_line(result.stderr)
        assert "chat template" in line and fragment in line, line
        assert "loaded on" not in result.stderr and result.stdout == ""


@pytest.mark.parametrize("args, stdin, name", [
    (["caf\udce9"], None, "PROMPT"),
    (["--system", "caf\udce9", "hi"], None, "--system"),
    ([], "caf\udce9\n", "stdin"),
    (["-"], b"caf\xe9\n", "stdin"),  # bytes under a locale that decodes strictly
])
def test_chat_text_that_is_no_utf8_is_refused_before_loading(args, stdin, name, tmp_path,
                                                            monkeypatch, capsys):
    """Bytes that are no UTF-8 (a lone surrogate once decoded) in the message or the system
    prompt: a usage error naming where they came from, before any model is read."""
    if isinstance(stdin, bytes):
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin), "utf-8", "strict"))
    elif stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = main(["chat", "--model", str(tmp_path / "nowhere"), *args])
    line = one_error_line(capsys.readouterr().err)
    assert code == 2 and line.startswith(f"error: {name} is not valid text"), line


@pytest.mark.parametrize("value, fragment", [
    ("{x", "--chat-template-kwargs is not valid JSON"),
    ('{"messages": []}', "--chat-template-kwargs: may not set 'messages'"),
    ("[1]", "--chat-template-kwargs: must be an object"),
])
def test_chat_template_kwargs_are_checked_before_loading(value, fragment, tmp_path, capsys):
    """A bad --chat-template-kwargs is a usage error, found before any model is read, by
    chat and by generate."""
    code = main(["chat", "--model", str(tmp_path / "nowhere"), "--chat-template-kwargs", value, "hi"])
    line = one_error_line(capsys.readouterr().err)
    assert code == 2 and fragment in line, line
    (tmp_path / "in.txt").write_text("hi\n")
    code = main(["generate", "--model", str(tmp_path / "nowhere"), "--input",
                 str(tmp_path / "in.txt"), "--chat-template-kwargs", value])
    line = one_error_line(capsys.readouterr().err)
    assert code == 2 and fragment in line, line
