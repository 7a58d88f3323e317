"""Fixtures shared by the engine and CLI tests: one tiny random model per test module and
an LLM on the NumPy backend; the engine checks several test files make (every block free,
the prompt tokens the steps compute); the check of a one-line CLI error; and the tools of
scripts/ as modules."""
import importlib.util
from contextlib import contextmanager
from pathlib import Path

import pytest

from cupy_llama import LLM
from cupy_llama.bench.random_model import make_random_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_random_model(tmp_path_factory.mktemp("tiny") / "model", "tiny", seed=0, std=0.15)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, device="cpu", log=None)


def assert_all_blocks_free(llm):
    """Nothing left of any request: every KV block back in the pool, none referenced."""
    blocks = llm.engine.blocks
    assert blocks.num_free_blocks == blocks.num_blocks
    blocks.check_invariants([])
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()


@contextmanager
def prompt_tokens_computed(llm):
    """Counts, per request id, the prompt tokens the steps inside the block compute (a
    prefix-cache hit or a forked sample computes fewer than its prompt)."""
    scheduler, counts = llm.engine.scheduler, {}
    schedule = scheduler.schedule

    def counting_schedule():
        batch = schedule()
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            if start < seq.num_prompt_tokens:
                counts[seq.request_id] = counts.get(seq.request_id, 0) + \
                    min(start + n, seq.num_prompt_tokens) - start
        return batch

    scheduler.schedule = counting_schedule
    try:
        yield counts
    finally:
        scheduler.schedule = schedule


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
