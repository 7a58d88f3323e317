"""Safetensors validation, checkpoint opening and the weight-blob plan (cupy_llama/weights.py)."""
import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from cupy_llama.bf16 import bf16_bits_to_float32, float32_to_bf16_bits
from cupy_llama.checkpoint import write_safetensors
from cupy_llama.config import ModelConfig
from cupy_llama.errors import CheckpointError
from cupy_llama.models import config_from_dicts, model_for
from cupy_llama.weights import (BLOB_ALIGNMENT, iter_blob_pieces, load_host_weights,
                                open_checkpoint, read_safetensors_header)

# Tiny model: H=8, 2 layers, 2 query heads, 1 KV head, head_dim 4, I=12, V=16.
H, NH, NKV, D, I, V, LAYERS = 8, 2, 1, 4, 12, 16, 2


def tiny_config(tie=False) -> ModelConfig:
    return config_from_dicts({
        "architectures": ["LlamaForCausalLM"], "hidden_size": H, "num_hidden_layers": LAYERS,
        "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": D,
        "intermediate_size": I, "vocab_size": V, "tie_word_embeddings": tie})


def hf_shapes(tie=False) -> dict:
    """Written out by hand from the Hugging Face Llama layout, independent of weights.py."""
    shapes = {"model.embed_tokens.weight": (16, 8)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (8,),
            p + "self_attn.q_proj.weight": (8, 8),
            p + "self_attn.k_proj.weight": (4, 8),
            p + "self_attn.v_proj.weight": (4, 8),
            p + "self_attn.o_proj.weight": (8, 8),
            p + "post_attention_layernorm.weight": (8,),
            p + "mlp.gate_proj.weight": (12, 8),
            p + "mlp.up_proj.weight": (12, 8),
            p + "mlp.down_proj.weight": (8, 12),
        })
    shapes["model.norm.weight"] = (8,)
    if not tie:
        shapes["lm_head.weight"] = (16, 8)
    return shapes


def random_weights(tie=False, seed=0) -> dict:
    """name -> float32 values that bf16 represents exactly."""
    rng = np.random.default_rng(seed)
    return {name: bf16_bits_to_float32(float32_to_bf16_bits(
                rng.standard_normal(shape).astype(np.float32)))
            for name, shape in hf_shapes(tie).items()}


def as_dtype(values: dict, dtype: str) -> dict:
    if dtype == "BF16":
        return {n: float32_to_bf16_bits(v) for n, v in values.items()}
    return {n: v.astype(np.float16 if dtype == "F16" else np.float32) for n, v in values.items()}


def write_model(model_dir, tie=False, dtype="BF16", seed=0, values=None):
    values = random_weights(tie, seed) if values is None else values
    model_dir.mkdir(parents=True, exist_ok=True)
    write_safetensors(model_dir / "model.safetensors", as_dtype(values, dtype))
    return values


def split_file(path):
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_raw(path, header_bytes: bytes, data: bytes):
    path.write_bytes(len(header_bytes).to_bytes(8, "little") + header_bytes + data)


def rewrite_header(path, mutate):
    header, data = split_file(path)
    mutate(header)
    write_raw(path, json.dumps(header).encode(), data)


def small_file(tmp_path):
    """Three tensors a [2,3] F32, b [4] BF16, c [2] F16, contiguous in that order."""
    path = tmp_path / "small.safetensors"
    write_safetensors(path, {"a": np.arange(6, dtype=np.float32).reshape(2, 3),
                             "b": np.arange(4, dtype=np.uint16),
                             "c": np.ones(2, dtype=np.float16)})
    return path


def expect_error(call, *needles) -> str:
    with pytest.raises(CheckpointError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and message.strip() == message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


# --------------------------------------------------------------------------- header: happy

def test_header_of_valid_file(tmp_path):
    path = small_file(tmp_path)
    tensors = read_safetensors_header(path)
    assert list(tensors) == ["a", "b", "c"]
    a, b, c = tensors["a"], tensors["b"], tensors["c"]
    assert (a.dtype, a.shape, a.nbytes) == ("F32", (2, 3), 24)
    assert (b.dtype, b.shape, b.nbytes) == ("BF16", (4,), 8)
    assert (c.dtype, c.shape, c.nbytes) == ("F16", (2,), 4)
    n = int.from_bytes(path.read_bytes()[:8], "little")
    assert a.start == 8 + n and b.start == a.start + 24 and c.start == b.start + 8
    raw = path.read_bytes()
    assert np.frombuffer(raw[a.start:a.start + 24], np.float32).tolist() == list(range(6))


def test_header_allows_metadata(tmp_path):
    path = tmp_path / "m.safetensors"
    write_safetensors(path, {"x": np.zeros(3, np.float32)}, metadata={"format": "pt"})
    assert list(read_safetensors_header(path)) == ["x"]


def test_header_agrees_with_safetensors_library(tmp_path):
    from safetensors import safe_open
    path = tmp_path / "f.safetensors"
    write_safetensors(path, {"x": np.arange(12, dtype=np.float32).reshape(3, 4),
                             "y": np.arange(5, dtype=np.float16)})
    ours = read_safetensors_header(path)
    with safe_open(str(path), framework="numpy") as f:
        for name in f.keys():
            assert ours[name].shape == tuple(f.get_slice(name).get_shape())


# --------------------------------------------------------------------------- header: each rule

def test_file_shorter_than_8_bytes(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x01\x02\x03\x04\x05")
    expect_error(lambda: read_safetensors_header(path), "short.safetensors", "5 bytes", "8-byte")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.safetensors"
    path.write_bytes(b"")
    expect_error(lambda: read_safetensors_header(path), "empty.safetensors", "0 bytes")


def test_missing_file(tmp_path):
    expect_error(lambda: read_safetensors_header(tmp_path / "nope.safetensors"),
                 "nope.safetensors")


def test_header_length_over_100mb(tmp_path):
    path = small_file(tmp_path)
    raw = path.read_bytes()
    path.write_bytes((2**40).to_bytes(8, "little") + raw[8:])
    expect_error(lambda: read_safetensors_header(path), "small.safetensors", str(2**40),
                 "100000000")


def test_header_length_just_over_limit(tmp_path):
    path = small_file(tmp_path)
    raw = path.read_bytes()
    path.write_bytes((100_000_001).to_bytes(8, "little") + raw[8:])
    expect_error(lambda: read_safetensors_header(path), "100000001")


def test_header_length_past_end_of_file(tmp_path):
    path = small_file(tmp_path)
    raw = path.read_bytes()
    path.write_bytes((len(raw)).to_bytes(8, "little") + raw[8:])
    expect_error(lambda: read_safetensors_header(path), "small.safetensors", str(len(raw)),
                 "header")


def test_header_not_utf8(tmp_path):
    path = tmp_path / "u.safetensors"
    write_raw(path, b'{"a\xff\xfe": 1}', b"")
    expect_error(lambda: read_safetensors_header(path), "u.safetensors", "UTF-8")


def test_header_not_json(tmp_path):
    path = tmp_path / "j.safetensors"
    write_raw(path, b'{"a": {"dtype": "F32",', b"")
    expect_error(lambda: read_safetensors_header(path), "j.safetensors", "JSON")


def test_header_json_array(tmp_path):
    path = tmp_path / "arr.safetensors"
    write_raw(path, b'[{"dtype": "F32"}]', b"")
    expect_error(lambda: read_safetensors_header(path), "arr.safetensors", "list", "object")


def test_header_repeats_a_name(tmp_path):
    path = tmp_path / "dup.safetensors"
    entry = '{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
    write_raw(path, f'{{"w":{entry},"w":{entry}}}'.encode(), b"\0" * 4)
    expect_error(lambda: read_safetensors_header(path), "dup.safetensors", "'w'", "twice")


def test_entry_not_an_object(tmp_path):
    path = small_file(tmp_path)
    rewrite_header(path, lambda h: h.update(b=[1, 2]))
    expect_error(lambda: read_safetensors_header(path), "'b'", "object")


@pytest.mark.parametrize("field", ["dtype", "shape", "data_offsets"])
def test_entry_missing_field(tmp_path, field):
    path = small_file(tmp_path)
    rewrite_header(path, lambda h: h["b"].pop(field))
    expect_error(lambda: read_safetensors_header(path), "small.safetensors", "'b'", field)


def test_unknown_dtype(tmp_path):
    path = small_file(tmp_path)
    rewrite_header(path, lambda h: h["b"].update(dtype="Q4"))
    expect_error(lambda: read_safetensors_header(path), "'b'", "Q4", "BF16, F16, F32")


@pytest.mark.parametrize("dtype", ["I64", "F64", "F8_E5M2", "U8"])
def test_real_but_unsupported_dtype(tmp_path, dtype):
    path = small_file(tmp_path)
    rewrite_header(path, lambda h: h["b"].update(dtype=dtype))
    expect_error(lambda: read_safetensors_header(path), "'b'", dtype,
                 "not supported for weights", "BF16")


@pytest.mark.parametrize("shape", [[-4], "4", [4.0], [True, 4], None, {"n": 4}])
def test_bad_shape(tmp_path, shape):
    path = small_file(tmp_path)
    rewrite_header(path, lambda h: h["b"].update(shape=shape))
    expect_error(lambda: read_safetensors_header(path), "'b'", "shape")


@pytest.mark.parametrize("offsets", [[24], [32, 24], ["24", 32], [24, 32, 40], [-8, 0],
                                     [24.0, 32.0], "24-32"])
def test_bad_data_offsets(tmp_path, offsets):
    path = small_file(tmp_path)
    rewrite_header(path, lambda h: h["b"].update(data_offsets=offsets))
    expect_error(lambda: read_safetensors_header(path), "'b'", "data_offsets")


def test_gap_between_tensors(tmp_path):
    path = small_file(tmp_path)   # a [0,24], b [24,32], c [32,36]
    rewrite_header(path, lambda h: h["c"].update(data_offsets=[34, 38]))
    expect_error(lambda: read_safetensors_header(path), "'c'", "gap", "2 bytes", "'b'")


def test_overlapping_tensors(tmp_path):
    path = small_file(tmp_path)
    rewrite_header(path, lambda h: h["b"].update(data_offsets=[20, 28]))
    expect_error(lambda: read_safetensors_header(path), "'b'", "overlapping", "'a'", "24")


def test_offsets_not_starting_at_zero(tmp_path):
    path = small_file(tmp_path)

    def shift(h):
        for name in "abc":
            begin, end = h[name]["data_offsets"]
            h[name]["data_offsets"] = [begin + 4, end + 4]
    rewrite_header(path, shift)
    expect_error(lambda: read_safetensors_header(path), "'a'", "start at 0", "4")


def test_truncated_file(tmp_path):
    path = small_file(tmp_path)
    path.write_bytes(path.read_bytes()[:-3])
    expect_error(lambda: read_safetensors_header(path), "small.safetensors", "truncated",
                 "36", "33")


def test_trailing_bytes(tmp_path):
    path = small_file(tmp_path)
    path.write_bytes(path.read_bytes() + b"\0" * 5)
    expect_error(lambda: read_safetensors_header(path), "small.safetensors", "5 trailing")


def test_shape_does_not_match_byte_range(tmp_path):
    path = small_file(tmp_path)
    rewrite_header(path, lambda h: h["a"].update(shape=[2, 2]))
    expect_error(lambda: read_safetensors_header(path), "'a'", "[2, 2]", "16 bytes", "24 bytes")


def test_bad_metadata(tmp_path):
    path = small_file(tmp_path)
    rewrite_header(path, lambda h: h.update(__metadata__={"format": 5}))
    expect_error(lambda: read_safetensors_header(path), "__metadata__")


def test_error_names_stay_on_one_line(tmp_path):
    path = small_file(tmp_path)

    def rename(h):
        h["evil\nname"] = h.pop("b")
        h["evil\nname"]["dtype"] = "XX"
    rewrite_header(path, rename)
    expect_error(lambda: read_safetensors_header(path), "XX")


# --------------------------------------------------------------------------- open_checkpoint

def test_expected_tensor_shapes_match_hf_layout():
    assert model_for(tiny_config()).tensor_shapes() == hf_shapes()
    assert model_for(tiny_config(tie=True)).tensor_shapes() == hf_shapes(tie=True)


def test_open_single_file(tmp_path):
    values = write_model(tmp_path)
    logged = []
    with open_checkpoint(tmp_path, model_for(tiny_config()), log=logged.append) as ckpt:
        assert ckpt.source_dtypes == {"BF16"}
        assert set(ckpt.tensors) == set(hf_shapes())
        q = ckpt.read("model.layers.1.self_attn.q_proj.weight")
        assert q.dtype == np.uint16 and q.shape == (8, 8)
        assert not q.flags.writeable
        np.testing.assert_array_equal(q, float32_to_bf16_bits(
            values["model.layers.1.self_attn.q_proj.weight"]))
        np.testing.assert_array_equal(ckpt.read_float32("model.norm.weight"),
                                      values["model.norm.weight"])
    assert logged == []


def test_close_with_views_alive(tmp_path):
    write_model(tmp_path)
    ckpt = open_checkpoint(tmp_path, model_for(tiny_config()))
    view = ckpt.read("model.norm.weight")
    ckpt.close()
    assert view.shape == (8,)
    assert ckpt.read("model.norm.weight").shape == (8,)   # reopens on demand
    ckpt.close()


def test_no_weights_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    expect_error(lambda: open_checkpoint(tmp_path, model_for(tiny_config())),
                 str(tmp_path), "model.safetensors", "model.safetensors.index.json", "safetensors")


def test_pickle_only_directory_is_refused(tmp_path):
    payload = tmp_path / "pytorch_model.bin"
    payload.write_bytes(b"\x80\x04\x95 pickle bytes that must never be loaded")
    message = expect_error(lambda: open_checkpoint(tmp_path, model_for(tiny_config())),
                           "pytorch_model.bin", "pickle", "convert")
    assert "model.safetensors" in message


def test_shards_without_index(tmp_path):
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors",
                      {"model.norm.weight": np.zeros(8, np.float32)})
    message = expect_error(lambda: open_checkpoint(tmp_path, model_for(tiny_config())),
                           "model-00001-of-00002.safetensors", "model.safetensors.index.json")
    assert "pickle" not in message and "name a single file model.safetensors" in message


def test_mistral_s_own_layout_is_named(tmp_path):
    """consolidated.safetensors (with params.json) is Mistral's release layout, not a
    Hugging Face folder: the message says so, not that pickles are refused."""
    write_safetensors(tmp_path / "consolidated.safetensors",
                      {"norm.weight": np.zeros(8, np.float32)})
    message = expect_error(lambda: open_checkpoint(tmp_path, model_for(tiny_config())),
                           "consolidated.safetensors, Mistral's own layout")
    assert "pickle" not in message and "to say which tensors" not in message

def test_model_dir_does_not_exist(tmp_path):
    expect_error(lambda: open_checkpoint(tmp_path / "nowhere", model_for(tiny_config())), "nowhere")


def test_missing_tensor(tmp_path):
    values = random_weights()
    del values["model.layers.1.mlp.up_proj.weight"]
    write_model(tmp_path, values=values)
    message = expect_error(lambda: open_checkpoint(tmp_path, model_for(tiny_config())),
                           "missing 1", "model.layers.1.mlp.up_proj.weight")
    assert "unexpected" not in message


def test_many_missing_tensors_are_summarised(tmp_path):
    values = random_weights()
    for name in list(values):
        if name.startswith("model.layers.1."):
            del values[name]
    write_model(tmp_path, values=values)
    expect_error(lambda: open_checkpoint(tmp_path, model_for(tiny_config())),
                 "missing 9", "model.layers.1.input_layernorm.weight", "and 1 more")


def test_unexpected_tensor(tmp_path):
    values = random_weights()
    values["model.layers.0.self_attn.q_proj.bias"] = np.zeros(8, np.float32)
    write_model(tmp_path, values=values)
    expect_error(lambda: open_checkpoint(tmp_path, model_for(tiny_config())),
                 "unexpected 1", "model.layers.0.self_attn.q_proj.bias")


def test_missing_and_unexpected_in_one_error(tmp_path):
    values = random_weights()
    values["model.layers.2.mlp.up_proj.weight"] = values.pop("model.layers.0.mlp.up_proj.weight")
    write_model(tmp_path, values=values)
    expect_error(lambda: open_checkpoint(tmp_path, model_for(tiny_config())),
                 "missing 1", "'model.layers.0.mlp.up_proj.weight'",
                 "unexpected 1", "'model.layers.2.mlp.up_proj.weight'")


def test_untied_config_without_lm_head_hints_at_tying(tmp_path):
    write_model(tmp_path, tie=True)
    expect_error(lambda: open_checkpoint(tmp_path, model_for(tiny_config(tie=False))),
                 "lm_head.weight", "tie_word_embeddings")


def test_wrong_shape(tmp_path):
    values = random_weights()
    values["model.layers.1.self_attn.k_proj.weight"] = np.zeros((8, 8), np.float32)
    write_model(tmp_path, values=values)
    expect_error(lambda: open_checkpoint(tmp_path, model_for(tiny_config())),
                 "model.layers.1.self_attn.k_proj.weight", "[8, 8]", "[4, 8]")


def test_rotary_inv_freq_is_ignored(tmp_path):
    values = random_weights()
    values["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(2, np.float32)
    write_model(tmp_path, values=values)
    ckpt = open_checkpoint(tmp_path, model_for(tiny_config()))
    assert set(ckpt.tensors) == set(hf_shapes())


def test_tied_model_with_lm_head_in_file_is_accepted(tmp_path):
    write_model(tmp_path, tie=False)   # file has lm_head.weight
    ckpt = open_checkpoint(tmp_path, model_for(tiny_config(tie=True)))
    assert "lm_head.weight" not in ckpt.tensors
    assert "lm_head" not in model_for(tiny_config(tie=True)).weight_plan()[0]


@pytest.mark.parametrize("dtype", ["F16", "F32"])
def test_float_checkpoints_convert_to_bf16(tmp_path, dtype):
    rng = np.random.default_rng(1)
    values = {n: (rng.standard_normal(s) * 3).astype(np.float32) for n, s in hf_shapes().items()}
    write_model(tmp_path, dtype=dtype, values=values)
    logged = []
    ckpt = open_checkpoint(tmp_path, model_for(tiny_config()), log=logged.append)
    assert ckpt.source_dtypes == {dtype}
    assert len(logged) == 1 and dtype in logged[0] and "bf16" in logged[0]
    for name, value in values.items():
        stored = value.astype(np.float16).astype(np.float32) if dtype == "F16" else value
        got = ckpt.read_bf16(name)
        assert got.dtype == np.uint16 and got.shape == value.shape
        np.testing.assert_array_equal(got, float32_to_bf16_bits(stored))


@pytest.mark.parametrize("dtype", ["F16", "F32"])
def test_read_float32_matches_safetensors_library(tmp_path, dtype):
    write_model(tmp_path, dtype=dtype, seed=3)
    reference = load_file(str(tmp_path / "model.safetensors"))
    ckpt = open_checkpoint(tmp_path, model_for(tiny_config()))
    for name, array in reference.items():
        got = ckpt.read_float32(name)
        assert got.dtype == np.float32 and got.flags.writeable
        np.testing.assert_array_equal(got, array.astype(np.float32))
        np.testing.assert_array_equal(ckpt.read(name), array)


def test_mixed_dtypes_load(tmp_path):
    values = random_weights()
    mixed = as_dtype(values, "BF16")
    mixed["model.norm.weight"] = values["model.norm.weight"].astype(np.float32)
    mixed["model.layers.0.mlp.down_proj.weight"] = values[
        "model.layers.0.mlp.down_proj.weight"].astype(np.float16)
    write_safetensors(tmp_path / "model.safetensors", mixed)
    logged = []
    ckpt = open_checkpoint(tmp_path, model_for(tiny_config()), log=logged.append)
    assert ckpt.source_dtypes == {"BF16", "F16", "F32"}
    assert len(logged) == 1 and "F16" in logged[0] and "F32" in logged[0]
    for name, value in values.items():   # bf16-exact values survive every dtype
        np.testing.assert_array_equal(ckpt.read_bf16(name), float32_to_bf16_bits(value))


# --------------------------------------------------------------------------- sharded

def write_sharded(model_dir, values, dtype="BF16", shard_names=None, weight_map=None):
    """Split tensors over two shards: layers 1.. and lm_head in the second."""
    shard_names = shard_names or ["model-00001-of-00002.safetensors",
                                  "model-00002-of-00002.safetensors"]
    model_dir.mkdir(parents=True, exist_ok=True)
    tensors = as_dtype(values, dtype)
    second = {n for n in tensors if n.startswith("model.layers.1.") or n == "lm_head.weight"}
    for index, shard in enumerate(shard_names):
        part = {n: a for n, a in tensors.items() if (n in second) == (index == 1)}
        if not shard.startswith("/") and ".." not in shard:
            write_safetensors(model_dir / shard, part)
    if weight_map is None:
        weight_map = {n: shard_names[n in second] for n in tensors}
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return weight_map


def test_sharded_equals_single_file(tmp_path):
    values = random_weights(seed=5)
    write_model(tmp_path / "single", values=values)
    write_sharded(tmp_path / "sharded", values)
    config = tiny_config()
    plan, _ = model_for(config).weight_plan()
    single = open_checkpoint(tmp_path / "single", model_for(config))
    sharded = open_checkpoint(tmp_path / "sharded", model_for(config))
    assert len({t.path for t in sharded.tensors.values()}) == 2
    host_single = load_host_weights(single, plan)
    host_sharded = load_host_weights(sharded, plan)
    assert host_single.keys() == host_sharded.keys()
    for key in host_single:
        np.testing.assert_array_equal(host_single[key], host_sharded[key])
    pieces_single = [(o, a.tobytes()) for o, a in iter_blob_pieces(single, plan)]
    pieces_sharded = [(o, a.tobytes()) for o, a in iter_blob_pieces(sharded, plan)]
    assert pieces_single == pieces_sharded


@pytest.mark.parametrize("bad_name", ["../x.safetensors", "sub/../../x.safetensors",
                                      "/etc/passwd", "..\\x.safetensors", "C:\\x.safetensors"])
def test_shard_path_escaping_model_dir(tmp_path, bad_name):
    values = random_weights()
    write_sharded(tmp_path / "m", values,
                  shard_names=["model-00001-of-00002.safetensors", bad_name])
    expect_error(lambda: open_checkpoint(tmp_path / "m", model_for(tiny_config())),
                 "model.safetensors.index.json", repr(bad_name), "outside")


def test_shard_symlink_outside_model_dir(tmp_path):
    values = random_weights()
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    write_sharded(tmp_path / "m", values, shard_names=names)
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(tmp_path / "m" / names[1], outside)
    os.symlink(outside, tmp_path / "m" / names[1])
    expect_error(lambda: open_checkpoint(tmp_path / "m", model_for(tiny_config())),
                 names[1], "outside", "elsewhere.safetensors")


def test_shard_symlink_inside_model_dir_is_fine(tmp_path):
    values = random_weights()
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    write_sharded(tmp_path / "m", values, shard_names=names)
    (tmp_path / "m" / "store").mkdir()
    os.replace(tmp_path / "m" / names[1], tmp_path / "m" / "store" / "real.safetensors")
    os.symlink("store/real.safetensors", tmp_path / "m" / names[1])
    assert len(open_checkpoint(tmp_path / "m", model_for(tiny_config())).tensors) == len(values)


def test_hub_cache_layout_links_into_blobs(tmp_path):
    values = random_weights()
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    snapshot = tmp_path / "models--x--y" / "snapshots" / "abc123"
    blobs = tmp_path / "models--x--y" / "blobs"
    write_sharded(snapshot, values, shard_names=names)
    blobs.mkdir()
    for i, name in enumerate(names):
        os.replace(snapshot / name, blobs / f"sha{i}")
        os.symlink(f"../../blobs/sha{i}", snapshot / name)
    assert len(open_checkpoint(snapshot, model_for(tiny_config())).tensors) == len(values)


def test_shard_file_missing(tmp_path):
    values = random_weights()
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    write_sharded(tmp_path, values, shard_names=names)
    (tmp_path / names[1]).unlink()
    expect_error(lambda: open_checkpoint(tmp_path, model_for(tiny_config())), names[1], "does not exist")


def test_index_lists_tensor_its_shard_lacks(tmp_path):
    values = random_weights()
    weight_map = write_sharded(tmp_path, values)
    weight_map["model.layers.0.input_layernorm.weight"] = "model-00002-of-00002.safetensors"
    index = {"weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    expect_error(lambda: open_checkpoint(tmp_path, model_for(tiny_config())),
                 "model.layers.0.input_layernorm.weight", "model-00002-of-00002.safetensors",
                 "does not hold")


def test_shard_holds_tensor_index_does_not_list(tmp_path):
    values = random_weights()
    weight_map = write_sharded(tmp_path, values)
    del weight_map["model.norm.weight"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    expect_error(lambda: open_checkpoint(tmp_path, model_for(tiny_config())),
                 "model.norm.weight", "does not list")


@pytest.mark.parametrize("index_text", ["not json", "[]", '{"weight_map": [1]}',
                                        '{"weight_map": {"a": 3}}'])
def test_malformed_index(tmp_path, index_text):
    (tmp_path / "model.safetensors.index.json").write_text(index_text)
    expect_error(lambda: open_checkpoint(tmp_path, model_for(tiny_config())), "model.safetensors.index.json")


def test_corrupt_shard_reports_the_shard(tmp_path):
    values = random_weights()
    write_sharded(tmp_path, values)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    expect_error(lambda: open_checkpoint(tmp_path, model_for(tiny_config())),
                 "model-00002-of-00002.safetensors", "truncated")


# --------------------------------------------------------------------------- weight blob

@pytest.mark.parametrize("tie", [False, True])
def test_blob_plan_layout(tie):
    plan, total = model_for(tiny_config(tie)).weight_plan()
    keys = ["embed"]
    for i in range(LAYERS):
        keys += [f"layers.{i}.{k}" for k in
                 ("input_norm", "qkv", "o_proj", "mlp_norm", "gate_up", "down")]
    keys += ["final_norm"] + ([] if tie else ["lm_head"])
    assert list(plan) == keys
    assert plan["layers.0.qkv"].shape == ((NH + 2 * NKV) * D, H)
    assert plan["layers.1.gate_up"].shape == (2 * I, H)
    assert plan["layers.1.qkv"].sources == tuple(
        f"model.layers.1.self_attn.{x}_proj.weight" for x in "qkv")
    assert plan["layers.0.gate_up"].sources == ("model.layers.0.mlp.gate_proj.weight",
                                                "model.layers.0.mlp.up_proj.weight")
    entries = list(plan.values())
    end = 0
    for entry in entries:   # blob order = key order, aligned, no overlap
        assert entry.offset % BLOB_ALIGNMENT == 0 and entry.offset >= end
        assert entry.nbytes == 2 * int(np.prod(entry.shape))
        end = entry.offset + entry.nbytes
    assert end <= total < end + BLOB_ALIGNMENT
    # every HF tensor is used exactly once
    sources = [s for e in entries for s in e.sources]
    assert sorted(sources) == sorted(hf_shapes(tie))


@pytest.mark.parametrize("dtype", ["BF16", "F32"])
def test_blob_pieces_cover_the_plan_exactly(tmp_path, dtype):
    values = write_model(tmp_path, dtype=dtype, seed=7)
    ckpt = open_checkpoint(tmp_path, model_for(tiny_config()))
    plan, total = model_for(tiny_config()).weight_plan()
    blob = np.zeros(total, np.uint8)
    written = np.zeros(total, np.int32)
    last = -1
    for offset, piece in iter_blob_pieces(ckpt, plan):
        assert offset > last and piece.dtype == np.uint16 and piece.flags.c_contiguous
        last = offset
        blob[offset:offset + piece.nbytes] = piece.view(np.uint8).reshape(-1)
        written[offset:offset + piece.nbytes] += 1
    covered = np.zeros(total, np.int32)
    for entry in plan.values():
        covered[entry.offset:entry.offset + entry.nbytes] = 1
    np.testing.assert_array_equal(written, covered)   # each planned byte once, nothing else

    def entry_bits(key):
        e = plan[key]
        return blob[e.offset:e.offset + e.nbytes].view(np.uint16).reshape(e.shape)
    bits = {n: float32_to_bf16_bits(v) for n, v in values.items()}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        np.testing.assert_array_equal(entry_bits(f"layers.{i}.qkv"), np.concatenate(
            [bits[p + "self_attn.q_proj.weight"], bits[p + "self_attn.k_proj.weight"],
             bits[p + "self_attn.v_proj.weight"]]))
        np.testing.assert_array_equal(entry_bits(f"layers.{i}.gate_up"), np.concatenate(
            [bits[p + "mlp.gate_proj.weight"], bits[p + "mlp.up_proj.weight"]]))
        np.testing.assert_array_equal(entry_bits(f"layers.{i}.down"),
                                      bits[p + "mlp.down_proj.weight"])
    np.testing.assert_array_equal(entry_bits("embed"), bits["model.embed_tokens.weight"])
    np.testing.assert_array_equal(entry_bits("lm_head"), bits["lm_head.weight"])
    np.testing.assert_array_equal(entry_bits("final_norm"), bits["model.norm.weight"])


def test_load_host_weights_fuses_like_the_blob(tmp_path):
    values = write_model(tmp_path, seed=9)
    ckpt = open_checkpoint(tmp_path, model_for(tiny_config()))
    plan, _ = model_for(tiny_config()).weight_plan()
    host = load_host_weights(ckpt, plan)
    assert list(host) == list(plan)
    for key, entry in plan.items():
        assert host[key].dtype == np.float32 and host[key].shape == entry.shape
        np.testing.assert_array_equal(host[key],
                                      np.concatenate([values[s] for s in entry.sources]))
    assert load_host_weights(ckpt, plan, dtype=np.float64)["embed"].dtype == np.float64


def test_load_host_weights_rounds_f32_checkpoints_to_bf16(tmp_path):
    rng = np.random.default_rng(2)
    values = {n: rng.standard_normal(s).astype(np.float32) for n, s in hf_shapes().items()}
    write_model(tmp_path, dtype="F32", values=values)
    ckpt = open_checkpoint(tmp_path, model_for(tiny_config()))
    plan, _ = model_for(tiny_config()).weight_plan()
    host = load_host_weights(ckpt, plan)
    expected = bf16_bits_to_float32(float32_to_bf16_bits(values["model.norm.weight"]))
    np.testing.assert_array_equal(host["final_norm"], expected)
    assert not np.array_equal(host["final_norm"], values["model.norm.weight"])


def test_pieces_refuse_a_plan_from_another_config(tmp_path):
    write_model(tmp_path)
    ckpt = open_checkpoint(tmp_path, model_for(tiny_config()))
    other = config_from_dicts({
        "architectures": ["LlamaForCausalLM"], "hidden_size": H, "num_hidden_layers": LAYERS,
        "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": D,
        "intermediate_size": I + 4, "vocab_size": V})
    plan, _ = model_for(other).weight_plan()
    expect_error(lambda: list(iter_blob_pieces(ckpt, plan)), "gate_up")

