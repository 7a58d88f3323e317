"""Every cuda_src/*.cu compiles with nvcc for sm_80 and sm_90, with common.cuh prepended
exactly as the loader does (no GPU needed; skipped where nvcc is absent)."""
import shutil
import subprocess

import pytest

from cupy_llama.backends.cuda.kernels import CUDA_SRC, MODULES, module_source

NVCC = shutil.which("nvcc")
SOURCES = sorted(p.stem for p in CUDA_SRC.glob("*.cu"))


def test_every_source_is_a_known_module():
    assert SOURCES, f"no .cu files in {CUDA_SRC}"
    assert set(SOURCES) == set(MODULES), "cuda_src/*.cu and kernels.MODULES disagree"


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", SOURCES)
def test_compiles(tmp_path, name, arch):
    source = tmp_path / f"{name}.cu"
    source.write_text(module_source(name))
    cubin = tmp_path / f"{name}.cubin"
    result = subprocess.run([NVCC, "-std=c++17", f"-arch={arch}", "-cubin", "-o", str(cubin),
                             str(source)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    # every kernel the launchers look up is defined with C linkage (unmangled symbol)
    symbols = cubin.read_bytes()
    for kernel in MODULES[name]:
        assert kernel.encode() + b"\0" in symbols, f"{kernel} not found in the compiled {name}.cu"
