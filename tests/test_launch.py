"""The host side of the programmatic launches and of the skinny kernels' by-value argument,
checked without a GPU: the ctypes layouts against the C declarations they mirror; and the
shared-memory opt-in every launcher goes through."""
import ctypes
import re

import numpy as np
import pytest

from cupy_llama.backends.cuda import gemm, launch
from cupy_llama.backends.cuda.kernels import kernel_dir


@pytest.mark.parametrize("name", ["SkinnyArgs", "AddedRows"])
def test_skinny_parameters_mirror_the_structs_in_gemv_cu(name):
    """Same fields in the same order, pointers before 4-byte fields (no padding inside);
    SkinnyArgs within the 128 bytes past which the kernels read it another way."""
    source = (kernel_dir() / "gemv.cu").read_text()
    body = re.search(rf"struct {name} \{{(.*?)\}};", source, re.S).group(1)
    fields = []
    for declaration in re.sub(r"//[^\n]*", "", body).split(";"):
        names = re.findall(r"\*?\s*(\w+)\s*(?=,|$)", declaration.strip())
        fields += [n for n in names if n not in ("int", "float", "bf16", "void", "const")]
    struct = getattr(gemm, name)
    assert [field for field, _ in struct._fields_] == fields
    pointers = sum(1 for _, kind in struct._fields_ if kind is ctypes.c_void_p)
    assert ctypes.sizeof(struct) == 8 * pointers + 4 * (len(fields) - pointers)
    assert ctypes.sizeof(gemm.SkinnyArgs) <= 128
    # every skinny kernel takes both, in that order
    assert len(re.findall(r"NAME\(const SkinnyArgs args, const AddedRows add\)", source)) == 1


def test_launch_structs_have_the_driver_layout():
    """CUlaunchAttribute: 4-byte id, 4 bytes of padding, a 64-byte value union (an int for
    programmatic serialization, x, y, z for the cluster dimension); CUlaunchConfig: seven
    uints, stream, attrs pointer, count."""
    programmatic = launch.attribute(6, 1)
    assert ctypes.sizeof(programmatic) == 72
    assert bytes(programmatic)[:12] == b"\x06\x00\x00\x00\x00\x00\x00\x00\x01\x00\x00\x00"
    assert bytes(programmatic)[12:] == bytes(60)
    cluster = launch.attribute(launch.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, 8, 1, 1)
    assert bytes(cluster)[:20] == (b"\x04\x00\x00\x00\x00\x00\x00\x00\x08\x00\x00\x00"
                                   b"\x01\x00\x00\x00\x01\x00\x00\x00")
    assert ctypes.sizeof(launch._LaunchConfig) == 56
    assert launch._LaunchConfig.stream.offset == 32


def test_driver_builds_one_attribute_array_per_kind_of_launch():
    """The attributes a launch passes: none for a plain launch, programmatic serialization
    and the cluster dimension as asked, the same array again for the same kind of launch."""
    passed = []

    def fake_launch(config, function, params, extra):
        config = config._obj
        count = config.num_attrs
        passed.append((ctypes.addressof(config.attrs.contents) if count else None,
                       [bytes(config.attrs[i]) for i in range(count)]))
        return 0

    driver = object.__new__(launch._Driver)  # no libcuda needed
    driver._launch = fake_launch
    kinds = [(True, 1), (True, 8), (False, 1), (False, 8), (True, 1), (True, 8)]
    for programmatic, cluster in kinds:
        driver.launch(0x1000, (8, 1, 1), 128, 0, 0, [ctypes.c_int(1)], programmatic, cluster)
    pss = bytes(launch.attribute(launch.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1))
    cluster = bytes(launch.attribute(launch.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, 8, 1, 1))
    assert [attributes for _, attributes in passed] == [
        [pss], [pss, cluster], [], [cluster], [pss], [pss, cluster]]
    assert passed[2][0] is None
    assert passed[4][0] == passed[0][0] and passed[5][0] == passed[1][0]


def test_kernel_args_convert_each_kind():
    class FakeArray:
        class data:
            ptr = 0x1000
    values = launch.kernel_args(FakeArray(), np.int32(-3), np.float32(0.5))
    assert [type(v) for v in values] == [ctypes.c_void_p, ctypes.c_int, ctypes.c_float]
    assert values[0].value == 0x1000 and values[1].value == -3 and values[2].value == 0.5
    with pytest.raises(TypeError, match="int"):
        launch.kernel_args(7)  # a Python int has no fixed width: refused


def test_row_kernel_arguments_convert_null_pointers_too():
    """The programmatic row launches (elementwise._launch) pass an absent optional array
    (elementwise._pointer: 0) as a null pointer beside arrays and scalars."""
    from cupy_llama.backends.cuda import elementwise

    class Array:  # what kernel_args reads off a cupy array
        class data:
            ptr = 4096

    values = elementwise.launch_values((Array(), np.int32(-3), np.float32(0.5),
                                        elementwise._pointer(None)))
    assert [type(v) for v in values] == [ctypes.c_void_p, ctypes.c_int, ctypes.c_float,
                                         ctypes.c_void_p]
    assert (values[0].value, values[1].value, values[2].value, values[3].value) == \
        (4096, -3, 0.5, None)


def test_loaded_library_path_finds_what_the_process_loaded():
    assert launch.loaded_library_path("c") is not None  # libc is in every process
    assert launch.loaded_library_path("no_such_library_xyz") is None


class _FakeKernel:
    """Counts reads and writes of the one attribute opt_in_shared sets; its static shared
    memory is `static` bytes."""

    def __init__(self, allowed=0, static=8 * 1024):
        self._allowed, self.reads, self.writes = allowed, 0, 0
        self.shared_size_bytes = static

    @property
    def max_dynamic_shared_size_bytes(self):
        self.reads += 1
        return self._allowed

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value):
        self.writes += 1
        self._allowed = value


def test_opt_in_shared_sets_once_per_size_and_only_past_the_default(monkeypatch):
    from cupy_llama.backends.cuda import kernels
    from cupy_llama.backends.cuda.kernels import DEFAULT_SHARED_LIMIT, opt_in_shared
    # the cache is keyed by id() of kernels that live as long as the process; these fakes
    # do not, and a later one may get a freed one's id
    monkeypatch.setattr(kernels, "_opted_in", {})
    small = _FakeKernel(static=1024)
    opt_in_shared(small, DEFAULT_SHARED_LIMIT - 1024)  # exactly the default: no opt-in
    assert (small.reads, small.writes) == (0, 0)
    big = _FakeKernel()
    for _ in range(3):  # every launch calls it; the driver is asked once
        opt_in_shared(big, 128 * 1024)
    assert (big.reads, big.writes, big.max_dynamic_shared_size_bytes) == (1, 1, 128 * 1024)
    opt_in_shared(big, 64 * 1024)  # less than already allowed: nothing to do
    opt_in_shared(big, 160 * 1024)           # more: raised
    assert big.writes == 2 and big.max_dynamic_shared_size_bytes == 160 * 1024
    ready = _FakeKernel(allowed=200 * 1024)  # already allowed by someone else: read, not written
    opt_in_shared(ready, 100 * 1024)
    assert (ready.reads, ready.writes) == (1, 0)


def test_sampling_launcher_takes_its_slots_from_the_device_room(monkeypatch):
    """slots=None: SLOTS, or what the device's shared memory holds; 0 and anything up to
    that room are launched as given; more is a ValueError naming the room."""
    from cupy_llama.backends.cuda import sampling
    launched = []

    class Kernel:
        def __call__(self, grid, block, args, shared_mem):
            launched.append(int(args[5]))  # sampling.cu's `slots` argument

    monkeypatch.setattr(sampling, "check", lambda name, array, *a, **k: array)
    Kernel.shared_size_bytes = 7984  # SampleShared on sm_90
    monkeypatch.setattr(sampling, "get_kernel", lambda module, name: Kernel())
    monkeypatch.setattr(sampling, "opt_in_shared", lambda *a: None)
    rows = np.zeros((1, 8), np.float32)
    settings = np.zeros(sampling.settings_bytes(1), np.uint8)
    for shared, expected_room in ((227 * 1024, 27), (100 * 1024, 11)):
        monkeypatch.setattr(sampling, "device_limits", lambda: {"max_shared_per_block": shared})
        assert sampling.slot_room() == expected_room
        launched.clear()
        for slots in (None, 0, expected_room):
            sampling.sample_settings(rows, settings, 1, np.zeros(1, np.int32), slots=slots)
        assert launched == [min(sampling.SLOTS, expected_room), 0, expected_room]
        with pytest.raises(ValueError, match=rf"\[0, {expected_room}\]"):
            sampling.sample_settings(rows, settings, 1, np.zeros(1, np.int32),
                                     slots=expected_room + 1)


def test_the_argmax_pass_splits_only_where_the_rows_leave_sms_idle(monkeypatch):
    """sampling.argmax_splits: every share holds at least ARGMAX_SHARE logits, a launch
    asks for no more CTAs than the GPU has SMs, at most ARGMAX_MAX_SPLITS a row, and no
    larger count would keep all three; 1 where no split keeps them."""
    from cupy_llama.backends.cuda import sampling
    monkeypatch.setattr(sampling, "device_limits",
                        lambda: {"sms": 132, "max_shared_per_block": 227 * 1024})
    cap = sampling.ARGMAX_MAX_SPLITS
    assert cap == 32

    def keeps(splits, rows, vocab):
        return (splits <= cap and vocab // splits >= sampling.ARGMAX_SHARE
                and rows * splits <= 132)

    seen = set()
    for vocab in (1001, 16383, 32000, 128256, 151936, 262144, 1 << 20):
        for rows in (1, 2, 3, 8, 16, 44, 66, 67, 132, 256):
            splits = sampling.argmax_splits(rows, vocab)
            seen.add(splits)
            if splits > 1:
                assert keeps(splits, rows, vocab), (rows, vocab, splits)
            assert not keeps(splits + 1, rows, vocab), (rows, vocab, splits)
    assert sampling.argmax_splits(0, 128256) == 1
    assert {1, 2, cap} <= seen
    # a count asked for: launched as given where it is an integer in [1, cap]
    launched = []

    class Kernel:
        shared_size_bytes = 7984

        def __call__(self, grid, block, args, shared_mem):
            launched.append(grid)

    monkeypatch.setattr(sampling, "check", lambda name, array, *a, **k: array)
    monkeypatch.setattr(sampling, "get_kernel", lambda module, name: Kernel())
    monkeypatch.setattr(sampling, "opt_in_shared", lambda *a: None)
    rows = np.zeros((2, 8), np.float32)
    settings = np.zeros(sampling.settings_bytes(2), np.uint8)
    sampling.sample_settings(rows, settings, 2, np.zeros(2, np.int32), slots=0, splits=1)
    assert launched == [(2, 1)]
    for splits in (0, cap + 1, 2.0, True, "2"):
        with pytest.raises(ValueError, match=rf"splits must be in \[1, {cap}\] \(an integer\)"):
            sampling.sample_settings(rows, settings, 2, np.zeros(2, np.int32), slots=0,
                                     splits=splits)
