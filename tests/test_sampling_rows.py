"""The one table of per-sequence sampling settings (interface.SAMPLING_ROWS) and what is
derived from it: SamplingTensors' fields, the model runner's slot columns, the staged
settings buffer and sampling.cu's SAMPLING_ROWS list, which the kernel reads the buffer by."""
import dataclasses

import numpy as np
import pytest

from cupy_llama.engine import model_runner
from cupy_llama.interface import KERNEL_ROWS, SAMPLING_ROWS, SamplingTensors
from cupy_llama.backends.cuda import kernels
from cupy_llama.backends.cuda import sampling as sampling_kernels

C_SIZES = {"unsigned long long": 8, "float": 4, "int": 4, "unsigned int": 4}


def test_the_kernel_lists_the_tables_kernel_rows_in_order():
    in_source = kernels.x_macro("sampling", "SAMPLING_ROWS")
    assert [name for _, name in in_source] == [row.name for row in KERNEL_ROWS]
    assert [C_SIZES[ctype] for ctype, _ in in_source] == \
        [np.dtype(row.dtype).itemsize for row in KERNEL_ROWS]


def test_a_table_the_kernel_does_not_list_is_refused(monkeypatch):
    swapped = (KERNEL_ROWS[1], KERNEL_ROWS[0]) + KERNEL_ROWS[2:]
    monkeypatch.setattr(sampling_kernels, "KERNEL_ROWS", swapped)
    with pytest.raises(RuntimeError, match="SAMPLING_ROWS"):
        sampling_kernels.check_settings_layout()


def test_x_macro_reads_a_list_macro(tmp_path, monkeypatch):
    (tmp_path / "common.cuh").write_text("")
    (tmp_path / "m.cu").write_text('#include "common.cuh"\n// X(int, comment)\n'
                                   "#define LIST(F) \\\n    F(float, a) /* b */ \\\n"
                                   "    F(unsigned long long, c)\n")
    monkeypatch.setattr(kernels, "kernel_dir", lambda: tmp_path)
    kernels._lines.cache_clear()
    kernels.x_macro.cache_clear()
    try:
        assert kernels.x_macro("m", "LIST") == (("float", "a"), ("unsigned long long", "c"))
        with pytest.raises(KeyError, match="OTHER"):
            kernels.x_macro("m", "OTHER")
    finally:
        kernels._lines.cache_clear()
        kernels.x_macro.cache_clear()


def test_sampling_tensors_has_a_field_per_row_and_fills_neutral_values():
    assert {f.name for f in dataclasses.fields(SamplingTensors)} - {"resets"} == \
        {r.name for r in SAMPLING_ROWS}
    required = {f.name: np.zeros(3) for f in dataclasses.fields(SamplingTensors)
                if f.default is dataclasses.MISSING}
    tensors = SamplingTensors(**required)
    assert tensors.resets is None and not tensors.processes_logits
    for row in SAMPLING_ROWS:
        column = tensors.row(row.name)
        assert column.dtype == np.dtype(row.dtype) and column.shape == (3,)
        if getattr(tensors, row.name) is None:
            assert np.all(column == row.neutral), row.name


def test_the_settings_buffer_puts_each_row_after_the_last_at_full_capacity():
    capacity, used = 5, 3
    buffer = np.zeros(sampling_kernels.settings_bytes(capacity), np.uint8)
    assert buffer.size == capacity * sum(C_SIZES[c] for c, _ in kernels.x_macro("sampling", "SAMPLING_ROWS"))
    views = sampling_kernels.settings_views(buffer, capacity, rows=used)
    offset = 0
    for ctype, name in kernels.x_macro("sampling", "SAMPLING_ROWS"):  # what the kernel reads
        view = views[name]
        assert view.shape == (used,) and view.dtype.itemsize == C_SIZES[ctype]
        assert view.ctypes.data - buffer.ctypes.data == offset
        assert offset % C_SIZES[ctype] == 0  # aligned
        offset += capacity * C_SIZES[ctype]


def test_slot_tables_hold_a_column_per_request_row():
    tables = model_runner.SlotTables()
    for row in SAMPLING_ROWS:
        assert hasattr(tables, row.name) == (row.per == "request"), row.name
