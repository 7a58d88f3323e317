"""`cupy-llama bench` on the CPU with a tiny random model and shortened workloads: the
report's fields, that its numbers agree with each other, and the exit codes."""
import json
import sys

import pytest
from conftest import one_error_line

from cupy_llama.bench.offline import add_ratios, bandwidth_floor, decode_numbers, format_table
from cupy_llama.bench.workloads import offline_workload
from cupy_llama.cli import main
from cupy_llama.models import config_from_dicts
from cupy_llama.bench.random_model import LLAMA_3_2_1B, TINY, config_json, make_random_model

SCALE = 0.05  # lengths x 0.05: throughput prompts and outputs in [5, 51]
QUICK = ["--device", "cpu", "--scale", str(SCALE), "--max-num-seqs", "4"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_random_model(tmp_path_factory.mktemp("tiny") / "model", "tiny", seed=0)


@pytest.fixture(scope="module")
def report_all(model_dir, tmp_path_factory):
    """One `bench all` run shared by the report checks: (exit code, report, stdout, stderr)."""
    out = tmp_path_factory.mktemp("bench") / "report.json"
    capture = pytest.MonkeyPatch()
    import io
    stdout, stderr = io.StringIO(), io.StringIO()
    capture.setattr(sys, "stdout", stdout)
    capture.setattr(sys, "stderr", stderr)
    try:
        code = main(["bench", "all", "--model", str(model_dir), *QUICK, "--num-requests", "5",
                     "--batch-sizes", "1,3", "--json", str(out)])
    finally:
        capture.undo()
    report = json.loads(out.read_text()) if out.exists() else None
    return code, report, stdout.getvalue(), stderr.getvalue()


# ---- the workload and the arithmetic ------------------------------------------------------

def test_offline_workload_follows_the_standard_definition():
    work = offline_workload(256, seed=0)
    assert len(work.prompts) == len(work.output_lens) == 256
    lengths = [len(p) for p in work.prompts]
    assert min(lengths) >= 100 and max(lengths) <= 1024
    assert min(work.output_lens) >= 100 and max(work.output_lens) <= 1024
    ids = [t for p in work.prompts for t in p]
    assert min(ids) >= 0 and max(ids) <= 10000 and max(ids) > 9900
    # uniform in [100, 1024]: mean 562, sd 267 / sqrt(256) = 17 for 256 draws
    assert 500 < sum(lengths) / 256 < 625 and 500 < sum(work.output_lens) / 256 < 625
    assert lengths != work.output_lens                      # drawn separately
    assert offline_workload(256, seed=0) == work           # seeded: the same every run
    assert offline_workload(256, seed=1).prompts != work.prompts
    # the totals nano-vllm's published runs of this workload report
    assert sum(work.output_lens) == 133_966 and sum(lengths) == 142_827


def test_decode_numbers_start_the_clock_when_every_request_has_a_token():
    steps = [(1.0, {"a": 1}), (2.0, {"a": 1, "b": 1}), (3.0, {"a": 1, "b": 1}),
             (5.0, {"a": 1, "b": 1})]
    numbers = decode_numbers(0.5, steps, num_requests=2)
    assert numbers["time_to_all_first_tokens_s"] == pytest.approx(1.5)
    assert numbers["decode_tokens"] == 4 and numbers["decode_steps"] == 2
    assert numbers["decode_s"] == pytest.approx(3.0)
    assert numbers["tok_s"] == pytest.approx(4 / 3)
    assert numbers["ms_per_step"] == pytest.approx(1500)
    with pytest.raises(RuntimeError):
        decode_numbers(0.0, steps, num_requests=3)


def test_bandwidth_floor_of_the_1b_shape_matches_the_performance_model():
    config = config_from_dicts(config_json(LLAMA_3_2_1B))
    floor = bandwidth_floor(config, bandwidth=4.5e12, tok_s=900.0)
    # 2.47 GB per decode step, 0.55 ms at 4.5 TB/s, about 1,800 tok/s
    assert floor["weight_bytes_per_step"] == pytest.approx(2.47e9, rel=0.01)
    assert floor["floor_ms_per_token"] == pytest.approx(0.55, rel=0.01)
    assert 1800 < floor["floor_tok_s"] < 1850
    assert floor["fraction_of_floor"] == pytest.approx(900 / floor["floor_tok_s"])
    untied = config_from_dicts(config_json({**LLAMA_3_2_1B, "tie_word_embeddings": False}))
    # an untied head is its own matrix; the embedding lookup still reads one row per token
    assert bandwidth_floor(untied, 4.5e12, 1.0)["weight_bytes_per_step"] == \
        floor["weight_bytes_per_step"]


def test_a_named_commit_wins_and_git_is_kept_beside_it(monkeypatch):
    from cupy_llama.bench import report as bench_report
    monkeypatch.delenv("CUPY_LLAMA_COMMIT", raising=False)
    monkeypatch.setattr(bench_report, "git_commit", lambda root: "752737c0ffee-dirty")
    assert bench_report.commit_info("3e80ac8") == {
        "commit": "3e80ac8", "commit_source": "--commit", "git_reported": "752737c0ffee-dirty"}
    # the named commit, but uncommitted changes: git's word is kept
    assert bench_report.commit_info("752737c")["git_reported"] == "752737c0ffee-dirty"
    assert bench_report.commit_info(None) == {"commit": "752737c0ffee-dirty", "commit_source": "git"}
    monkeypatch.setattr(bench_report, "git_commit", lambda root: "752737c0ffee")
    assert bench_report.commit_info("752737c") == {"commit": "752737c", "commit_source": "--commit"}
    # another commit than git's clean HEAD: git's word is kept too
    assert bench_report.commit_info("3e80ac8")["git_reported"] == "752737c0ffee"
    monkeypatch.setenv("CUPY_LLAMA_COMMIT", "abc1234")
    assert bench_report.commit_info(None)["commit_source"] == "CUPY_LLAMA_COMMIT"
    monkeypatch.setattr(bench_report, "git_commit", lambda root: None)
    monkeypatch.delenv("CUPY_LLAMA_COMMIT")
    assert bench_report.commit_info(None) == {"commit": "unknown", "commit_source": "none"}


def test_git_is_asked_at_the_checkout_s_root():
    """The root of the source tree, where a checkout's .git is (not the package folder)."""
    import re

    from cupy_llama.bench import report as bench_report
    root = bench_report.SOURCE_ROOT
    assert (root / "cupy_llama" / "bench" / "report.py").is_file()
    if (root / ".git").exists():  # a checkout, as the tests run in one
        assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", bench_report.git_commit(root))


# ---- a whole run --------------------------------------------------------------------------

def test_all_modes_write_a_complete_report(report_all, model_dir):
    code, report, stdout, stderr = report_all
    assert code == 0, stderr
    assert report["command"].startswith("cupy-llama bench all --device cpu --seed 0 --model ")
    assert "--scale 0.05" in report["command"] and "--max-num-seqs 4" in report["command"]
    assert report["commit"] and report["commit_source"]
    assert report["environment"]["python"] and report["environment"]["numpy"]
    assert report["device"]["kind"] == "cpu" and "copy_bandwidth_bytes_s" not in report["device"]
    assert report["model"]["config"]["hidden_size"] == TINY["hidden_size"]
    assert report["settings"]["engine"]["max_num_seqs"] == 4
    assert report["timings"]["load_s"] > 0 and report["timings"]["warmup_s"] > 0
    assert set(report["results"]) == {"throughput", "latency", "ttft", "decode-sweep"}
    assert report["memory"]["plan"] and report["memory"]["peak_rss_bytes"] > 0
    assert "transformers" not in report
    # statistics to stderr while running, the table to stdout
    assert "warm-up" in stderr and "throughput:" in stderr
    assert "warm-up (kernel compile)" not in stderr and "floor" not in stdout
    for label in ("throughput", "latency", "ttft", "decode-sweep", "memory"):
        assert label in stdout


def test_throughput_counts_every_requested_token(report_all):
    result = report_all[1]["results"]["throughput"]["cupy_llama"]
    work = offline_workload(5, seed=0, lengths=(5, 51), top_id=TINY["vocab_size"] - 1)
    assert result["num_requests"] == 5
    assert result["prompt_tokens"] == sum(len(p) for p in work.prompts)
    # EOS is ignored, so every request runs to its own output length
    assert result["output_tokens"] == result["requested_output_tokens"] == sum(work.output_lens)
    assert result["output_tok_s"] == pytest.approx(result["output_tokens"] / result["wall_s"])
    assert result["total_tok_s"] == pytest.approx(
        (result["output_tokens"] + result["prompt_tokens"]) / result["wall_s"])
    assert result["requests_s"] == pytest.approx(5 / result["wall_s"])
    # a step gives a request at most one token: at least the longest output's count of
    # steps, and no more than one a token plus a prefill a request
    engine = result["engine"]
    assert max(work.output_lens) <= engine["steps"] <= sum(work.output_lens) + 5
    assert engine["preemptions"] == 0
    assert engine["ms_per_step"] == pytest.approx(1e3 * result["wall_s"] / engine["steps"])


def test_latency_on_the_cpu_has_no_bandwidth_floor(report_all):
    """The CPU path once divided the weight bytes by one thread's memcpy rate, which BLAS's
    threads reading the weights beat: 193% of a "floor". Nothing quick on the host bounds
    those reads, so there is no floor on the CPU at all."""
    code, report, stdout, stderr = report_all
    result = report["results"]["latency"]["cupy_llama"]
    assert result["prompt_tokens"] == 2 and result["new_tokens"] == 13  # 32 and 256 x 0.05
    assert result["tok_s"] > 0 and len(result["runs_tok_s"]) == 3
    assert result["ms_per_token"] * result["tok_s"] == pytest.approx(1000)
    assert not {"floor_tok_s", "fraction_of_floor", "copy_bandwidth_bytes_s",
                "weight_bytes_per_step"} & set(result)
    assert "bandwidth floor" not in stdout and "% of" not in stderr
    assert "it has no bandwidth floor and no kernel compile" in stderr
    from cupy_llama.bench.offline import DeviceProbe
    with pytest.raises(RuntimeError):
        DeviceProbe("cpu").copy_bandwidth()


def test_the_gpu_table_shows_the_floor_and_never_above_it():
    from cupy_llama.bench.report import _latency_rows
    config = config_from_dicts(config_json(LLAMA_3_2_1B))
    ours = {"tok_s": 1154.0, "ms_per_token": 1e3 / 1154.0,
            **bandwidth_floor(config, bandwidth=4.26e12, tok_s=1154.0)}
    rows = _latency_rows({"cupy_llama": ours})
    # README: 1,154 tok/s at batch 1 was 67% of the floor of 1,724 tok/s at 4.26 TB/s
    assert rows[-1][1] == "of the bandwidth floor (1,724 tok/s)" and rows[-1][2] == "67.0%"
    # the floor is the fastest a step can be: any speed the GPU reaches is below it
    assert ours["fraction_of_floor"] < 1 and ours["floor_tok_s"] > ours["tok_s"]


def test_ttft_rows_past_the_context_are_not_repeated(model_dir):
    """A context shorter than the longer nominal prompts clips them to its length once:
    one row for it, not one per nominal length."""
    from cupy_llama import LLM
    from cupy_llama.bench.offline import run_ttft
    from cupy_llama.bench.workloads import BenchSettings
    llm = LLM(model_dir, device="cpu", max_model_len=64, log=None)
    rows = run_ttft(llm, BenchSettings(mode="ttft", scale=0.5), "cpu", lambda message: None)
    llm.close()
    assert [(r["nominal_tokens"], r["prompt_tokens"]) for r in rows["prompts"]] == [(128, 63)]


def test_ttft_and_decode_sweep(report_all):
    results = report_all[1]["results"]
    rows = results["ttft"]["cupy_llama"]["prompts"]
    assert [r["nominal_tokens"] for r in rows] == [128, 1024, 4096]
    assert [r["prompt_tokens"] for r in rows] == [6, 51, 205]
    assert all(r["ttft_ms"] > 0 and len(r["runs_ms"]) == 5 for r in rows)
    sweep = results["decode-sweep"]["cupy_llama"]
    assert sweep["prompt_tokens"] == 6 and sweep["new_tokens"] == 6
    assert [r["batch"] for r in sweep["rows"]] == [1, 3]
    for row in sweep["rows"]:
        # all prompts fit one step, so every request decodes new_tokens - 1 more tokens
        assert row["decode_tokens"] == row["batch"] * (sweep["new_tokens"] - 1)
        assert row["tok_s"] == pytest.approx(row["decode_tokens"] / row["decode_s"])
        assert row["one_batch"] and row["max_num_seqs"] == 4


def test_the_timed_decode_steps_make_no_text(model_dir, monkeypatch):
    """latency and decode-sweep time the engine's steps on token ids: nothing is
    detokenized while they run, token by token or at a request's end."""
    from cupy_llama.bench.offline import timed_steps
    from cupy_llama.llm import LLM
    from cupy_llama.sampling import SamplingParams
    from cupy_llama.tokenizer import IncrementalDetokenizer, Tokenizer
    made = []

    def counted(name, original):
        def call(*args, **kwargs):
            made.append(name)
            return original(*args, **kwargs)
        return call

    for owner, name in ((IncrementalDetokenizer, "add"), (IncrementalDetokenizer, "flush"),
                        (Tokenizer, "decode_unchecked")):
        monkeypatch.setattr(owner, name, counted(name, getattr(owner, name)))
    llm = LLM(model_dir, device="cpu", max_num_seqs=4, log=None)
    try:
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        _, steps = timed_steps(llm, [[5, 6, 7], [8, 9], [10, 11, 12, 13]], params)
    finally:
        llm.close()
    assert sum(sum(tokens.values()) for _, tokens in steps) == 3 * 5
    assert made == []


def test_prefix_runs_both_workloads_with_caching_on_and_off(model_dir, tmp_path, capsys):
    out = tmp_path / "prefix.json"
    assert main(["bench", "prefix", "--model", str(model_dir), *QUICK, "--json", str(out)]) == 0
    captured = capsys.readouterr()
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"prefix"}
    result = report["results"]["prefix"]["cupy_llama"]
    # lengths x 0.05: a 102-token shared prefix (6 full blocks), 3-token suffixes, 2 new
    # tokens; chat messages of 5 tokens and replies of 2
    assert (result["requests"], result["shared_tokens"], result["suffix_tokens"],
            result["new_tokens"]) == (64, 102, 3, 2)
    on, off = result["cached"], result["uncached"]
    assert on["shared_prefix"]["first_cached_tokens"] == 0
    assert on["shared_prefix"]["rest_cached_tokens"] == [96] * 63
    assert off["shared_prefix"]["rest_cached_tokens"] == [0] * 63
    for run in (on, off):
        shared = run["shared_prefix"]
        assert shared["output_tokens"] == 64 * 2 and len(shared["rest_ttft_ms"]) == 63
        assert shared["output_tok_s"] == pytest.approx(shared["output_tokens"] / shared["wall_s"])
        assert shared["rest_ttft_ms_median"] > 0 and shared["first_ttft_ms"] > 0
        turns = run["chat"]["turns"]
        assert [t["turn"] for t in turns] == list(range(1, 11))
        # each turn sends the conversation so far: the previous prompt, its reply, 5 more
        assert [t["prompt_tokens"] for t in turns] == [5 + 7 * i for i in range(10)]
        assert run["chat"]["output_tokens"] == 10 * 2
    # with the cache, a turn finds every full block of the conversation computed so far
    # (all but the previous reply's last token)
    assert [t["cached_tokens"] for t in on["chat"]["turns"]] == \
        [0] + [(5 + 7 * i - 1) // 16 * 16 for i in range(9)]
    assert all(t["cached_tokens"] == 0 for t in off["chat"]["turns"])
    assert off["hit_rate"] == 0 and 0 < on["hit_rate"] < 1
    assert result["rest_ttft_on_over_off"] == pytest.approx(
        on["shared_prefix"]["rest_ttft_ms_median"] / off["shared_prefix"]["rest_ttft_ms_median"])
    assert "prefix" in captured.out and "cache on / off" in captured.out
    assert "prefix, caching on:" in captured.err and "prefix, caching off:" in captured.err


def test_a_sweep_batch_past_max_num_seqs_says_how_it_ran():
    from cupy_llama.bench.report import sweep_batch
    assert sweep_batch({"batch": 3, "one_batch": True, "max_num_seqs": 4}) == "3"
    assert sweep_batch({"batch": 6, "one_batch": False, "max_num_seqs": 4}) == "6 (4 at a time)"


def test_random_model_is_written_once_into_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUPY_LLAMA_CACHE", str(tmp_path / "cache"))
    reports = []
    for name in ("first.json", "second.json"):
        code = main(["bench", "latency", "--preset", "tiny", *QUICK,
                     "--json", str(tmp_path / name)])
        assert code == 0, capsys.readouterr().err
        reports.append(json.loads((tmp_path / name).read_text()))
    model = tmp_path / "cache" / "bench-models" / "tiny-seed0"
    assert (model / ".complete").is_file() and (model / "model.safetensors").is_file()
    assert reports[0]["model"]["written_s"] > 0 and reports[1]["model"]["written_s"] is None
    assert reports[0]["model"]["random_preset"] == "tiny"
    assert reports[0]["results"]["latency"]["cupy_llama"]["tok_s"] > 0


def test_ratios_and_table_beside_transformers(report_all):
    report = json.loads(json.dumps(report_all[1]))
    results = report["results"]
    ours = results["throughput"]["cupy_llama"]
    results["throughput"]["transformers"] = {**ours, "output_tok_s": ours["output_tok_s"] / 4}
    results["latency"]["transformers"] = {"error": "RuntimeError: out of memory"}
    results["ttft"]["transformers"] = {"prompts": [
        {**row, "ttft_ms": row["ttft_ms"] * 3} for row in results["ttft"]["cupy_llama"]["prompts"]]}
    results["decode-sweep"]["transformers"] = {"rows": [
        {"batch": row["batch"], "tok_s": row["tok_s"] / 2}
        for row in results["decode-sweep"]["cupy_llama"]["rows"]]}
    add_ratios(results)
    report["transformers"] = {"version": "5.0", "attn_implementation": "sdpa", "dtype": "bfloat16",
                              "load_s": 1.0}
    assert results["throughput"]["speedup"] == pytest.approx(4)
    assert "speedup" not in results["latency"]
    assert results["ttft"]["speedup"]["51"] == pytest.approx(3)   # their time / ours
    assert results["decode-sweep"]["speedup"]["3"] == pytest.approx(2)
    table = format_table(report)
    assert "4.00x" in table and "3.00x" in table and "2.00x" in table and "failed" in table
    assert "transformers 5.0 (sdpa attention, bfloat16)" in table
    assert "transformers" not in format_table(report_all[1])  # no baseline, no column


# ---- errors and exit codes ----------------------------------------------------------------

def test_hf_without_torch_is_a_one_line_error_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now fails
    monkeypatch.setenv("CUPY_LLAMA_CACHE", str(tmp_path / "cache"))
    code = main(["bench", "latency", "--preset", "tiny", *QUICK, "--hf"])
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert err.startswith("error: --hf needs torch and transformers") and "\n" not in err
    assert not (tmp_path / "cache").exists()  # failed before writing a model


@pytest.mark.parametrize("args, code, message", [
    (["bench", "fastest"], 2, "fastest"),
    (["bench", "ttft", "--scale", "2"], 2, "--scale must be in (0, 1]"),
    (["bench", "ttft", "--num-requests", "0"], 2, "--num-requests must be at least 1"),
    (["bench", "decode-sweep", "--batch-sizes", "1,x"], 2, "--batch-sizes must be"),
    (["bench", "decode-sweep", "--batch-sizes", "0"], 2, "positive integers, got 0"),
    (["bench", "decode-sweep", "--batch-sizes", ""], 2, "comma-separated integers, got ''"),
    (["bench", "decode-sweep", "--batch-sizes", "1,,2"], 2, "integers, got '1,,2'"),
    (["bench", "ttft", "--json", "/nonexistent-folder/out.json"], 2, "does not exist"),
    (["bench", "ttft", "--json", __file__ + "/out.json"], 2, "is a file, not a folder"),
    (["bench", "ttft", "--json", "/proc/out.json"], 2, "cannot write '/proc/out.json'"),
    (["bench", "ttft", "--model", "/nonexistent-model"], 1, "does not exist"),
    (["bench", "prefix", "--hf"], 2, "bench prefix has no transformers baseline"),
    (["bench", "prefix", "--no-prefix-caching"], 2, "drop --no-prefix-caching"),
    (["bench", "latency", "--model", "/nonexistent-model", "--preset", "qwen3-0.6b"], 2,
     "--preset names the shape of a random model, and --model gives the model itself"),
])
def test_usage_errors(args, code, message, capsys, tmp_path, monkeypatch):
    """Bad option values are usage errors (2), one line; a missing model is a runtime one.
    (A tiny model in a cache of the test's own, should a check let a row through.)"""
    monkeypatch.setenv("CUPY_LLAMA_CACHE", str(tmp_path / "cache"))
    preset = [] if "--model" in args else ["--preset", "tiny"]
    assert main([*args, "--device", "cpu", *preset]) == code
    err = capsys.readouterr().err
    assert message in one_error_line(err) and len(err.strip().splitlines()) == 1, err


def test_the_json_check_leaves_no_file_and_keeps_an_old_one(tmp_path):
    from cupy_llama.bench.workloads import BenchSettings
    new = tmp_path / "new.json"
    BenchSettings(mode="latency", json_path=str(new))
    assert not new.exists()
    old = tmp_path / "old.json"
    old.write_text("kept")
    BenchSettings(mode="latency", json_path=str(old))
    assert old.read_text() == "kept"


def test_cuda_without_a_usable_gpu_is_a_one_line_error(capsys):
    from cupy_llama.backends.cuda import cuda_usable
    if cuda_usable()[0]:
        pytest.skip("a usable GPU is present")
    assert main(["bench", "latency", "--preset", "tiny", "--device", "cuda"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err


@pytest.mark.parametrize("mode", [[], ["--serve"]])
def test_host_path_profiler_runs_the_real_engine(mode):
    """scripts/profile_host_path.py drives the engine through a stub backend: it breaks
    when the engine's backend interface changes, so it runs here, small (as generate()
    and as serve's engine process, whose turn counts the tokens of each step's deltas)."""
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "scripts" / "profile_host_path.py"
    done = subprocess.run([sys.executable, str(script), "--num-requests", "4", "--scale", "0.05",
                           *mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "whole run, seconds:" in done.stdout and "total" in done.stdout


def test_forward_host_time_prompt_is_a_prefill_the_reference_runs(model_dir):
    """scripts/forward_host_time.py times the forward of its own prompt batch on the GPU; on
    the reference backend that batch is one sequence's prefill whose last logits match
    the same prompt's prefill through the engine's own path (the last position of
    logits_at_every_position)."""
    import numpy as np

    from conftest import logits_at_every_position, script_module
    from cupy_llama.backends.cpu import CpuBackend
    from cupy_llama.models import model_for, read_config
    from cupy_llama.weights import open_checkpoint
    script = script_module("forward_host_time")
    tokens, config = 40, read_config(model_dir)
    batch = script.prompt_batch(tokens, config.vocab_size)
    assert batch.num_seqs == 1 and batch.num_tokens == tokens and not batch.is_decode_only
    model = model_for(config)
    with open_checkpoint(model_dir, model) as checkpoint:
        backend = CpuBackend(model, checkpoint, max_model_len=256, max_num_seqs=1,
                             num_kv_blocks=batch.block_tables.shape[1],
                             block_size=script.BLOCK_SIZE)
    logits = np.asarray(backend.forward(batch))
    expected = logits_at_every_position(model_dir, batch.token_ids.tolist())[-1]
    np.testing.assert_allclose(logits[0], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_prefix_check_script_finds_no_difference_on_the_reference_backend(tmp_path):
    """scripts/prefix_check.py (run on the GPU for the report) compares greedy outputs with
    prefix caching on and off; on the float32 reference they must all be identical."""
    import subprocess
    import sys
    from pathlib import Path
    model = make_random_model(tmp_path / "model", "tiny", seed=0, std=0.15)
    script = Path(__file__).resolve().parents[1] / "scripts" / "prefix_check.py"
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, str(script), str(model), "--device", "cpu",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert (report["identical"], report["of"]) == (8, 8)
    assert [row["cached_tokens"] for row in report["prompts"]] == \
        [shared // 16 * 16 for shared in (16, 17, 100, 255, 256, 512, 700, 1000)]
    assert "8 of 8 identical" in done.stdout


# ---- the CPU defaults ---------------------------------------------------------------------

def test_bench_defaults_to_auto_and_a_tiny_model_on_the_cpu(tmp_path, monkeypatch, capsys):
    from cupy_llama.backends.cuda import cuda_usable
    if cuda_usable()[0]:
        pytest.skip("a usable GPU is present: auto means the GPU there")
    monkeypatch.setenv("CUPY_LLAMA_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "report.json"
    assert main(["bench", "latency", "--scale", "0.05", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    report = json.loads(out.read_text())
    assert report["device"]["kind"] == "cpu" and report["model"]["random_preset"] == "tiny"
    assert report["command"].startswith("cupy-llama bench latency --device cpu --seed 0 "
                                        "--preset tiny")
    assert "warning: running on the CPU (slow)" in captured.err
    assert "bench on the CPU: the NumPy reference backend" in captured.err
    # only the tiny model was written; no 1.2 B one on the CPU unless --preset asks
    assert [p.name for p in (tmp_path / "cache" / "bench-models").iterdir()] == ["tiny-seed0"]
    assert "floor" not in captured.out and "warm-up (kernel compile)" not in captured.err


def test_writing_a_random_model_says_it_is_still_at_it(tmp_path, monkeypatch):
    """A 1.2 B model takes minutes to write: a line every HEARTBEAT_S seconds says the
    bench is alive. Here the writer waits until it has seen such a line."""
    import threading
    from cupy_llama.bench import random_model, workloads as bench_workloads
    from cupy_llama.bench.workloads import BenchSettings, prepare_model

    monkeypatch.setenv("CUPY_LLAMA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bench_workloads, "HEARTBEAT_S", 0.01)
    lines, beat = [], threading.Event()

    def log(line):
        lines.append(line)
        if line.startswith("still writing the random llama-3.2-1b model ("):
            beat.set()

    def slow_writer(out_dir, shape, seed):
        assert beat.wait(timeout=120), lines  # the state: a heartbeat came while writing
        return make_random_model(out_dir, "tiny", seed=seed)

    monkeypatch.setattr(random_model, "make_random_model", slow_writer)
    path, seconds = prepare_model(BenchSettings(mode="latency", device="cpu",
                                                preset="llama-3.2-1b"), log)
    assert path.name == "llama-3.2-1b-seed0" and (path / ".complete").is_file()
    assert lines[0].startswith("writing a random llama-3.2-1b model (1.24 B parameters, "
                               "2.47 GB of bf16 weights)")
    count = len(lines)
    assert count >= 2 and len(lines) == count  # the heartbeat stopped with the writing


def test_the_command_line_offers_every_random_model_shape():
    from cupy_llama.bench import random_model, workloads
    assert sorted(workloads.PRESETS) == sorted(random_model.PRESETS)


def test_measuring_scripts_write_json_where_asked(monkeypatch, tmp_path):
    """scripts/ write their JSON at --json's path, else into $OUT, else nowhere."""
    from cupy_llama.bench.report import output_json_path
    monkeypatch.delenv("OUT", raising=False)
    assert output_json_path(None, "probe.json") is None
    assert output_json_path("mine.json", "probe.json") == "mine.json"
    monkeypatch.setenv("OUT", str(tmp_path))
    assert output_json_path(None, "probe.json") == str(tmp_path / "probe.json")
    assert output_json_path("mine.json", "probe.json") == "mine.json"


def test_the_random_model_script_refuses_bad_values_in_one_line(tmp_path):
    """scripts/make_random_model.py: a config its values cannot make is one line and exit
    2, and no folder is left behind."""
    import subprocess
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "scripts" / "make_random_model.py"
    out = tmp_path / "model"
    for args, said in (
            (["--preset", "llama-3.2-1b", "--set", "vocab_size=512"], "outside the vocabulary"),
            (["--set", 'architectures=["GPT2LMHeadModel"]'], "random models are written for"),
            (["--set", "hidden_size"], "give KEY=VALUE"),
            (["--set", "hidden_size=abc"], "make no valid config")):
        done = subprocess.run([sys.executable, str(script), str(out), *args],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, (args, done.stderr)
        assert "Traceback" not in done.stderr and said in done.stderr.strip().splitlines()[-1]
        assert not out.exists()
