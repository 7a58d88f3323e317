"""Every cuda_src/*.cu compiles with nvcc for sm_80 and sm_90 as it stands (it includes its
headers; nvcc gets -I for the kernel folder, as NVRTC does), and defines every kernel the
launchers can ask for (no GPU needed; skipped where nvcc is absent). Also: what the
loader passes NVRTC, and the hash that makes a header edit a new kernel-cache key."""
import shutil
import subprocess

import pytest

from cupy_llama.backends.cuda import kernels
from cupy_llama.backends.cuda.kernels import kernel_dir, kernel_names, module_names

NVCC = shutil.which("nvcc")


def test_every_source_is_a_module_with_kernels():
    sources = sorted(path.stem for path in kernel_dir().glob("*.cu"))
    assert sources == module_names() and "attention" in sources
    for module in sources:
        assert kernel_names(module), f"{module}.cu: no kernels found"
        assert '#include "common.cuh"' in kernels.module_source(module)


def test_options_name_the_kernel_folder_and_the_headers_hash():
    options = kernels.compile_options()
    assert f"-I{kernel_dir()}" in options
    assert f"-DCUPY_LLAMA_HEADERS={kernels.header_digest()}" in options


def test_the_headers_hash_follows_their_content(tmp_path, monkeypatch):
    folder = tmp_path / "cuda_src"
    folder.mkdir()
    (folder / "common.cuh").write_text("#define A 1\n")
    (folder / "x.cu").write_text('#include "common.cuh"\n')
    monkeypatch.setattr(kernels, "kernel_dir", lambda: folder)
    kernels.header_digest.cache_clear()
    try:
        first = kernels.header_digest()
        (folder / "x.cu").write_text('#include "common.cuh"\n// a .cu is in the source text\n')
        assert kernels.header_digest() == first
        kernels.header_digest.cache_clear()
        (folder / "common.cuh").write_text("#define A 2\n")
        assert kernels.header_digest() != first
    finally:
        kernels.header_digest.cache_clear()


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", module_names())
def test_compiles(tmp_path, name, arch):
    cubin = tmp_path / f"{name}.cubin"
    result = subprocess.run([NVCC, "-std=c++17", f"-arch={arch}", f"-I{kernel_dir()}", "-cubin",
                             "-o", str(cubin), str(kernel_dir() / f"{name}.cu")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    # every kernel the launchers look up is defined with C linkage (unmangled symbol)
    symbols = cubin.read_bytes()
    for kernel in kernel_names(name):
        assert kernel.encode() + b"\0" in symbols, f"{kernel} not found in the compiled {name}.cu"
