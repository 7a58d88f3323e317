"""The host side of the driver-API launches and of the by-value kernel arguments, checked
without a GPU: the ctypes layouts against the C declarations they mirror."""
import ctypes
import re
from pathlib import Path

import numpy as np
import pytest

from cupy_llama.backends.cuda import gemm, launch, layers
from cupy_llama.backends.cuda.kernels import module_source

CUDA_SRC = Path(__file__).resolve().parents[1] / "cuda_src"


@pytest.mark.parametrize("mirror,file,struct", [
    (gemm.SkinnyArgs, "gemv.cu", "SkinnyArgs"), (layers.LayersArgs, "layers.cu", "LayersArgs"),
    (layers.LayerWeights, "layers.cu", "LayerWeights")])
def test_ctypes_structs_mirror_the_c_structs(mirror, file, struct):
    """Same fields in the same order, pointers before 4-byte fields (no padding inside)."""
    source = (CUDA_SRC / file).read_text()
    body = re.search(rf"struct {struct} \{{(.*?)\}};", source, re.S).group(1)
    fields = []
    for declaration in re.sub(r"//[^\n]*", "", body).split(";"):
        names = re.findall(r"\*?\s*(\w+)\s*(?=,|$)", declaration.strip())
        fields += [n for n in names if n not in ("int", "float", "bf16", "void", "const")]
    assert [name for name, _ in mirror._fields_] == fields
    pointers = sum(1 for _, kind in mirror._fields_ if kind is ctypes.c_void_p)
    assert ctypes.sizeof(mirror) == 8 * pointers + 4 * (len(fields) - pointers)


def test_layers_constants_match_layers_cu():
    source = (CUDA_SRC / "layers.cu").read_text()
    defines = dict(re.findall(r"^#define (\w+) (\d+)\b", source, flags=re.M))
    assert int(defines["LAYERS_WARPS"]) == layers.LAYERS_WARPS
    assert int(defines["LAYERS_BLOCKS_PER_SM"]) == layers.LAYERS_BLOCKS_PER_SM
    assert int(defines["LAYER_PHASES"]) == layers.LAYER_PHASES
    assert source.count("skinny_body<1,") == 4  # one 8-column x tile: MAX_ROWS rows
    assert layers.MAX_ROWS == 8
    for head_dim in layers.HEAD_DIMS:
        assert f"DEFINE_DECODE_LAYERS({head_dim}, {layers.MAX_GROUP})" in source


def test_layers_module_builds_on_the_device_functions_of_gemv_and_attention():
    """Their sources come first, with their own kernels left out; then layers.cu."""
    text = module_source("layers")
    define, undef = text.index("#define DEVICE_FUNCTIONS_ONLY"), text.index("#undef DEVICE_FUNCTIONS_ONLY")
    assert define < text.index('#line 1 "gemv.cu"') < text.index('#line 1 "attention.cu"') < undef
    assert undef < text.index('#line 1 "layers.cu"')
    for kernel_file in ("gemv.cu", "attention.cu"):
        source = (CUDA_SRC / kernel_file).read_text()
        outside = re.sub(r"#ifndef DEVICE_FUNCTIONS_ONLY.*?#endif", "", source, flags=re.S)
        assert not re.search(r"^(DEFINE_\w+\(|extern \"C\")", outside, flags=re.M), \
            f"{kernel_file} defines a kernel outside its DEVICE_FUNCTIONS_ONLY guards"


def test_layers_refuse_shapes_they_cannot_take():
    from types import SimpleNamespace

    def config(heads=32, kv_heads=8, head_dim=64, hidden=2048, intermediate=8192):
        return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads,
                               head_dim=head_dim, hidden_size=hidden,
                               intermediate_size=intermediate)
    assert layers.shape_unsupported(config(), 16) is None
    assert layers.shape_unsupported(config(heads=24, head_dim=128), 16) is None  # group 3
    assert "head_dim" in layers.shape_unsupported(config(head_dim=96), 16)
    assert "query heads per kv head" in layers.shape_unsupported(config(kv_heads=4), 16)
    assert "power-of-two" in layers.shape_unsupported(config(), 12)
    assert "multiples of 8" in layers.shape_unsupported(config(intermediate=8190), 16)


def test_cooperative_and_programmatic_attributes_reach_the_launch_config():
    captured = {}

    class FakeDriver(launch._Driver):
        def __init__(self):
            def fake_launch(config, function, params, extra):
                config = config._obj
                captured["ids"] = [config.attrs[i].id for i in range(config.num_attrs)]
                captured["values"] = [config.attrs[i].value for i in range(config.num_attrs)]
                return 0
            self._launch = fake_launch

    driver = FakeDriver()
    for programmatic, cooperative, ids in [(False, False, []), (True, False, [6]),
                                           (False, True, [2]), (True, True, [6, 2])]:
        driver.launch(0x1234, (2, 1, 1), 64, 0, 0, [ctypes.c_int(1)], programmatic, cooperative)
        assert captured["ids"] == ids and captured["values"] == [1] * len(ids)


def test_launch_structs_have_the_driver_layout():
    """CUlaunchAttribute: 4-byte id, 4 bytes of padding, a 64-byte value union whose first
    int is the value; CUlaunchConfig: seven uints, stream, attrs pointer, count."""
    attribute = launch._LaunchAttribute(id=6, value=1)
    assert ctypes.sizeof(attribute) == 72
    assert bytes(attribute)[:12] == b"\x06\x00\x00\x00\x00\x00\x00\x00\x01\x00\x00\x00"
    assert ctypes.sizeof(launch._LaunchConfig) == 56
    assert launch._LaunchConfig.stream.offset == 32


def test_kernel_args_convert_each_kind():
    class FakeArray:
        class data:
            ptr = 0x1000
    values = launch.kernel_args(FakeArray(), np.int32(-3), np.float32(0.5))
    assert [type(v) for v in values] == [ctypes.c_void_p, ctypes.c_int, ctypes.c_float]
    assert values[0].value == 0x1000 and values[1].value == -3 and values[2].value == 0.5
    with pytest.raises(TypeError, match="int"):
        launch.kernel_args(7)  # a Python int has no fixed width: refused


def test_loaded_library_path_finds_what_the_process_loaded():
    assert launch.loaded_library_path("c") is not None  # libc is in every process
    assert launch.loaded_library_path("no_such_library_xyz") is None
