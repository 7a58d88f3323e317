"""Fixtures shared by the engine and CLI tests: one tiny random model per test module and
an LLM on the NumPy backend; the check of a one-line CLI error; and the tools of scripts/
as modules."""
import importlib.util
from pathlib import Path

import pytest

from cupy_llama import LLM
from cupy_llama.random_model import make_random_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_random_model(tmp_path_factory.mktemp("tiny") / "model", "tiny", seed=0, std=0.15)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, device="cpu", log=None)


def one_error_line(err: str) -> str:
    """The one `error:` line, last on stderr (after any progress lines), no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in err, err
    return errors[0]


def script_module(name: str):
    """scripts/<name>.py as a module (the measurement tools live outside the package)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
