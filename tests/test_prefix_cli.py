"""--no-prefix-caching on the commands that load a model, and the cache figures of the
`generate` summary line."""
import io
import json
import re

import pytest

from cupy_llama import cli
from cupy_llama.bench.workloads import BenchSettings
from cupy_llama.cli import main

CPU = ["--device", "cpu"]
SHARED = "a shared system prompt that is long enough to fill several KV blocks. " * 2


def summary_figures(err: str) -> tuple[int, int, int]:
    """(prompt tokens, cached ones, the percentage) from the summary line."""
    match = re.search(r"(\d+) prompt tokens? \((\d+) cached, (\d+)%\)", err)
    assert match, err
    return tuple(int(g) for g in match.groups())


@pytest.fixture
def batch_file(tmp_path):
    path = tmp_path / "in.jsonl"
    lines = [{"id": i, "prompt": SHARED + f"question {i}?"} for i in range(4)]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def run_generate(model_dir, path, capsys, *extra):
    code = main(["generate", "--model", str(model_dir), "--input", str(path), *CPU,
                 "--temperature", "0", "--max-tokens", "3", "--max-num-seqs", "1", *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured


def test_generate_reports_the_prompt_tokens_the_cache_gave(model_dir, batch_file, capsys):
    """One request at a time: the later ones find the shared prompt's blocks."""
    on = run_generate(model_dir, batch_file, capsys)
    prompt_tokens, cached, percent = summary_figures(on.err)
    assert 0 < cached < prompt_tokens and percent == round(100 * cached / prompt_tokens)
    off = run_generate(model_dir, batch_file, capsys, "--no-prefix-caching")
    assert summary_figures(off.err) == (prompt_tokens, 0, 0)
    assert off.out == on.out  # the same greedy text either way


def test_every_command_that_loads_a_model_takes_the_flag():
    for name in ("chat", "generate", "info", "bench"):
        flags = {flag for param in cli.cli.commands[name].params for flag in param.opts}
        assert "--no-prefix-caching" in flags, name


def test_the_flag_reaches_the_engine(model_dir, monkeypatch, capsys):
    seen = []
    load = cli.options.load

    def recording_load(model_dir, device, engine):
        seen.append(dict(engine))
        return load(model_dir, device, engine)

    monkeypatch.setattr(cli.options, "load", recording_load)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello"))
    assert main(["chat", "--model", str(model_dir), *CPU, "--max-tokens", "2",
                 "--no-prefix-caching"]) == 0
    assert seen == [{"enable_prefix_caching": False}]
    seen.clear()
    monkeypatch.setattr("sys.stdin", io.StringIO("hello"))
    assert main(["chat", "--model", str(model_dir), *CPU, "--max-tokens", "2"]) == 0
    assert seen == [{}]  # not given: the engine's default (on)
    assert main(["info", "--model", str(model_dir), *CPU, "--no-prefix-caching"]) == 0


def test_bench_spells_the_flag_in_its_command_line():
    settings = BenchSettings(mode="throughput", device="cpu",
                             engine={"enable_prefix_caching": False})
    assert "--no-prefix-caching" in settings.command()
    assert "prefix" not in BenchSettings(mode="throughput", device="cpu").command()
