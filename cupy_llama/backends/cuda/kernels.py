"""The kernel sources (cuda_src/*.cu), compiled with NVRTC (cupy.RawModule) once per
process, what the launchers read off them, and the checks every launcher runs on its
arguments before a launch.

The sources are the one place that says which kernels exist and what their tile sizes,
thread counts and shared-memory layouts are (docs/ARCHITECTURE.md, "Kernels"):
- `constants(module)`: the object-like `#define NAME VALUE` lines of a .cu file and of the
  headers it includes, VALUE an integer or float literal or an arithmetic expression of
  such values and other defines;
- `instances(module, macro)`: the argument lists of the `DEFINE_...(NAME, ...)` lines that
  instantiate a family of kernels (the first argument is the kernel's name);
- `x_macro(module, macro)`: the entries of a list macro `#define NAME(X) X(...) X(...)`
  (the sampling kernel's settings);
- `kernel_names(module)`: every kernel the module defines.
"""
from __future__ import annotations

import ast
import hashlib
import operator
import re
from functools import lru_cache
from pathlib import Path

import numpy as np

_PACKAGE = Path(__file__).resolve().parents[2]  # .../cupy_llama


@lru_cache(maxsize=None)
def kernel_dir() -> Path:
    """The folder of the kernel sources: cupy_llama/cuda_src/ in an installed package
    (setup.cfg maps the repository's cuda_src/ there), else cuda_src/ at the root of the
    checkout the package runs from (an editable install, or PYTHONPATH set to it)."""
    for folder in (_PACKAGE / "cuda_src", _PACKAGE.parent / "cuda_src"):
        if (folder / "common.cuh").is_file():
            return folder
    raise FileNotFoundError(f"CUDA kernel sources not found in {_PACKAGE / 'cuda_src'} or "
                            f"{_PACKAGE.parent / 'cuda_src'}; reinstall cupy-llama")


def module_names() -> list[str]:
    """The kernel modules: one per cuda_src/*.cu file."""
    return sorted(path.stem for path in kernel_dir().glob("*.cu"))


def module_source(name: str) -> str:
    """cuda_src/<name>.cu as it stands (it #includes its headers)."""
    return (kernel_dir() / f"{name}.cu").read_text(encoding="utf-8")


@lru_cache(maxsize=None)
def header_digest() -> str:
    """A hash of every header in the kernel folder. CuPy's kernel cache keys on the source
    text and the options, not on what -I pulls in; passing this as a -D makes an edited
    header a new key."""
    digest = hashlib.sha256()
    for path in sorted(kernel_dir().glob("*.cuh")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def compile_options() -> tuple[str, ...]:
    """NVRTC options of every module (CuPy adds -arch=sm_XX for the current device)."""
    return ("-std=c++17", f"-I{kernel_dir()}", f"-DCUPY_LLAMA_HEADERS={header_digest()}")


@lru_cache(maxsize=None)
def load_module(name: str):
    import cupy
    return cupy.RawModule(code=module_source(name), options=compile_options())


@lru_cache(maxsize=None)
def get_kernel(module: str, kernel: str):
    return load_module(module).get_function(kernel)


def compile_all() -> dict:
    """Compile every module and look up each of its kernels; returns {module: None or
    the compile error text}."""
    results = {}
    for module in module_names():
        try:
            for kernel in kernel_names(module):
                get_kernel(module, kernel)
            results[module] = None
        except Exception as e:  # cupy.cuda.compiler.CompileException carries the NVRTC log
            results[module] = f"{type(e).__name__}: {e}"
    return results


# ---- what the sources say ------------------------------------------------------------

_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"', re.M)
_DEFINE = re.compile(r"^\s*#define\s+([A-Za-z_]\w*)(?!\()\s+(.*?)\s*$")
_INSTANCE = re.compile(r"^(DEFINE_\w+)\((.*)\)\s*$")
_PLAIN_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*'
                           r'\((?:[^()]|\([^()]*\))*\)\s*)?(\w+)\s*\(')


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


@lru_cache(maxsize=None)
def _lines(file_name: str) -> tuple[str, ...]:
    """The file's lines without comments, with each #define's continuation lines joined
    into one."""
    text = _strip_comments((kernel_dir() / file_name).read_text(encoding="utf-8"))
    return tuple(text.replace("\\\n", " ").split("\n"))


def _files(module: str) -> list[str]:
    """The module's .cu file after the headers it includes (included first, as the
    preprocessor reads them)."""
    seen: list[str] = []

    def visit(file_name: str):
        if file_name in seen:
            return
        for included in _INCLUDE.findall((kernel_dir() / file_name).read_text(encoding="utf-8")):
            if (kernel_dir() / included).is_file():
                visit(included)
        seen.append(file_name)

    visit(f"{module}.cu")
    return seen


class KernelConstants:
    """The object-like defines of a module, evaluated on first use."""

    def __init__(self, module: str, raw: dict[str, str]):
        self.module, self._raw, self._values = module, raw, {}

    def __getitem__(self, name: str):
        if name not in self._values:
            if name not in self._raw:
                raise KeyError(f"{self.module}.cu defines no constant {name}")
            self._values[name] = _evaluate(self._raw[name], self, name)
        return self._values[name]

    def __contains__(self, name: str) -> bool:
        return name in self._raw


@lru_cache(maxsize=None)
def constants(module: str) -> KernelConstants:
    raw = {}
    for file_name in _files(module):
        for line in _lines(file_name):
            match = _DEFINE.match(line)
            if match and not match[1].startswith("DEFINE_"):
                raw[match[1]] = match[2]
    return KernelConstants(module, raw)


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv,
              ast.Mod: operator.mod, ast.LShift: operator.lshift,
              ast.RShift: operator.rshift, ast.USub: operator.neg}


def _evaluate(expression: str, known: KernelConstants, name: str):
    """A define's value: C integer and float literals (suffixes u, l, f), the names of other
    defines, + - * / % << >> and parentheses; integer / is C's (truncating) division."""
    text = re.sub(r"\b(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)[fFuUlL]+\b", r"\1", expression)
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        raise ValueError(f"{known.module}.cu: #define {name} {expression}: not a constant "
                         "expression the launchers can read") from None

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.Name):
            return known[node.id]
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and isinstance(left, int) and isinstance(right, int):
                return int(left / right)
            return _OPERATORS[type(node.op)](left, right)
        raise ValueError(f"{known.module}.cu: #define {name} {expression}: not a constant "
                         "expression the launchers can read")

    return value(tree)


@lru_cache(maxsize=None)
def instances(module: str, macro: str) -> tuple[tuple, ...]:
    """The argument lists of the module's `macro(NAME, ...)` lines, in source order: the
    kernel's name first, then each argument as an int where it is a literal or a define,
    else as written."""
    found = []
    for line in _lines(f"{module}.cu"):
        match = _INSTANCE.match(line.strip())
        if match and match[1] == macro:
            args = [arg.strip() for arg in match[2].split(",")]
            found.append((args[0], *(_argument(module, arg) for arg in args[1:])))
    if not found:
        raise KeyError(f"{module}.cu has no {macro}(...) lines")
    return tuple(found)


@lru_cache(maxsize=None)
def x_macro(module: str, macro: str) -> tuple[tuple[str, ...], ...]:
    """The entries of the module's list macro `#define macro(X) X(a, b) X(c, d) ...`, in
    order, each as its arguments written out: (("a", "b"), ("c", "d"), ...)."""
    for file_name in _files(module):
        for line in _lines(file_name):
            match = re.match(rf"\s*#define\s+{macro}\((\w+)\)\s+(.*)$", line)
            if match:
                entries = re.findall(rf"\b{match[1]}\(([^()]*)\)", match[2])
                return tuple(tuple(arg.strip() for arg in entry.split(",")) for entry in entries)
    raise KeyError(f"{module}.cu has no #define {macro}(X) list")


def _argument(module: str, arg: str):
    if re.fullmatch(r"-?\d+", arg):
        return int(arg)
    return constants(module)[arg] if arg in constants(module) else arg


@lru_cache(maxsize=None)
def kernel_names(module: str) -> tuple[str, ...]:
    """Every kernel of the module: those written out (extern "C" __global__) and those the
    DEFINE_... lines instantiate."""
    # a macro's body names its parameter, not a kernel: only the other lines, joined (a
    # declaration may span lines)
    code = "\n".join(line for line in _lines(f"{module}.cu") if not line.lstrip().startswith("#"))
    names = [(match.start(), match[1]) for match in _PLAIN_KERNEL.finditer(code)]
    names += [(match.start(), match[2].split(",")[0].strip())
              for match in re.finditer(r"^\s*(DEFINE_\w+)\((.*)\)\s*$", code, re.M)]
    return tuple(name for _, name in sorted(names))


# static plus dynamic shared memory a kernel may use without opting in
DEFAULT_SHARED_LIMIT = 48 * 1024
_opted_in: dict = {}  # id(kernel function) -> dynamic shared bytes it is opted in for


def opt_in_shared(kernel, dynamic: int) -> None:
    """Let `kernel` launch with `dynamic` bytes of dynamic shared memory beside its static
    shared memory: past DEFAULT_SHARED_LIMIT in all a kernel must opt in. The attribute is
    set (and read from the driver) once per kernel and size; get_kernel's functions live as
    long as the process, so the launchers call this on every launch at the cost of a dict
    lookup."""
    if _opted_in.get(id(kernel), -1) >= dynamic:
        return
    if dynamic + kernel.shared_size_bytes > DEFAULT_SHARED_LIMIT:
        if kernel.max_dynamic_shared_size_bytes < dynamic:
            kernel.max_dynamic_shared_size_bytes = dynamic
    _opted_in[id(kernel)] = dynamic


# ---- argument checks: programming errors, so ValueError naming the argument ----

BF16 = np.dtype(np.uint16)
F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)
U8 = np.dtype(np.uint8)


def check(name: str, array, dtype, shape=None, ndim=None):
    """`array` must be a C-contiguous cupy array of `dtype`; `shape` may hold None for any
    size on that axis."""
    import cupy
    if not isinstance(array, cupy.ndarray):
        raise ValueError(f"{name}: expected a cupy array, got {type(array).__name__}")
    if array.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {np.dtype(dtype).name}, got {array.dtype.name}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous (shape {array.shape}, strides {array.strides})")
    if ndim is not None and array.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {array.shape}")
    if shape is not None:
        if len(shape) != array.ndim or any(w is not None and w != s for w, s in zip(shape, array.shape)):
            raise ValueError(f"{name}: expected shape {tuple(shape)}, got {array.shape}")
    return array


def aligned16(*arrays) -> bool:
    """Every array starts at a 16-byte boundary (the 16-byte loads and stores of the
    vector paths need it)."""
    return all(a.data.ptr % 16 == 0 for a in arrays)


def i32(value) -> np.int32:
    return np.int32(value)


def i64(value) -> np.int64:
    return np.int64(value)


def f32(value) -> np.float32:
    return np.float32(value)
