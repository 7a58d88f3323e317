"""`cupy-llama bench serve` on the CPU with the tiny model and shortened workloads: against a
server it starts itself and against a given --url (clients spread over processes, Poisson
arrivals); the report's numbers agree with each other and with the workload."""
import pytest

# the serve extra (in the test extra); a machine without it, running only -m gpu, skips
pytest.importorskip("fastapi")
pytest.importorskip("openai")

import json

from conftest import one_error_line

from cupy_llama.bench.workloads import offline_workload
from cupy_llama.bench.serve import (ENGINE_COUNTERS, ServeBenchSettings, _event_lines,
                                    engine_numbers, serve_numbers, serve_workload)
from cupy_llama.cli import main
from test_server import ServerProcess

QUICK = ["--scale", "0.05", "--seed", "4"]


def check_report(report: dict, num_requests: int) -> dict:
    r = report["results"]
    assert (r["completed"], r["failed"], r["errors"]) == (num_requests, 0, [])
    # EOS is ignored: every request writes exactly its max_tokens, as the server reports
    assert r["output_tokens_from_usage"] and r["output_tokens"] == r["requested_output_tokens"]
    assert r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["duration_s"])
    assert r["requests_s"] == pytest.approx(num_requests / r["duration_s"])
    for key in ("ttft", "tpot", "itl", "e2e_latency"):
        stats = r[key]
        assert 0 < stats["p50_ms"] <= stats["p90_ms"] <= stats["p99_ms"], key
    assert r["ttft"]["p99_ms"] <= r["e2e_latency"]["p99_ms"]
    assert r["chunks"] <= r["output_tokens"]
    # the engine's counters over the run: every request's tokens, and a step computes the
    # prompt tokens the cache did not hold, then one token a request for each output
    # token after the first
    e = r["engine"]
    assert (e["prompt_tokens"], e["generation_tokens"]) == (r["input_tokens"], r["output_tokens"])
    assert e["preemptions"] == 0
    assert e["tokens"] == r["input_tokens"] - e["prefix_hits"] + r["output_tokens"] - num_requests
    assert 0 < e["step_s"] <= e["loop_s"] < r["duration_s"]
    assert e["idle_s"] == pytest.approx(r["duration_s"] - e["loop_s"])
    assert e["tokens_per_step"] == pytest.approx(e["tokens"] / e["steps"])
    return r


@pytest.mark.slow
def test_bench_serve_starts_its_own_server(model_dir, tmp_path, capsys):
    out = tmp_path / "serve.json"
    code = main(["bench", "serve", "--device", "cpu", "--model", str(model_dir), *QUICK,
                 "--num-requests", "6", "--max-concurrency", "3", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(out.read_text())
    check_report(report, 6)
    assert report["server"]["started"] and report["server"]["model"] == "bench"
    assert report["settings"]["max_concurrency"] == 3 and report["timings"]["warmup_s"] > 0
    work = offline_workload(6, 4, (5, 51), min(10000, 511))
    assert report["results"]["input_tokens"] == sum(len(p) for p in work.prompts)
    assert report["results"]["requested_output_tokens"] == sum(work.output_lens)
    assert "Serving Benchmark Result" in captured.out and "Median TTFT (ms)" in captured.out
    assert "cupy-llama bench serve" in report["command"]


@pytest.mark.slow
def test_bench_serve_at_a_url_with_two_client_processes(model_dir, tmp_path):
    server = ServerProcess(model_dir, "--max-num-seqs", "4")
    try:
        out = tmp_path / "url.json"
        code = main(["bench", "serve", "--url", server.url, "--model", str(model_dir), *QUICK,
                     "--num-requests", "8", "--request-rate", "200", "--max-concurrency", "4",
                     "--client-processes", "2", "--input-len", "12", "--output-len", "5",
                     "--temperature", "0", "--json", str(out)])
        assert code == 0, server.log_text()
        report = json.loads(out.read_text())
        r = check_report(report, 8)
        assert (r["input_tokens"], r["output_tokens"]) == (8 * 12, 8 * 5)
        assert report["settings"]["client_processes"] == 2
        assert report["settings"]["request_rate"] == 200
        assert not report["server"]["started"] and report["server"]["url"] == server.url + "/v1"
    finally:
        server.stop()


@pytest.mark.slow
def test_bench_serve_at_a_url_says_what_the_server_refused(model_dir, monkeypatch, capsys):
    """Against a given server, bench serve asks for the key it wants, refuses a workload
    past the server's context before sending it, and names --model where prompts' token
    ids fall outside the server's vocabulary: one line each."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    server = ServerProcess(model_dir, "--api-key", "sekret", "--max-model-len", "256")
    try:
        run = ["bench", "serve", "--url", server.url, *QUICK, "--num-requests", "2"]
        assert main(run) == 2
        line = one_error_line(capsys.readouterr().err)
        assert "HTTP 401" in line and "--api-key" in line, line
        assert main([*run, "--api-key", "wrong"]) == 2
        assert "is not the server's" in one_error_line(capsys.readouterr().err)
        keyed = [*run, "--api-key", "sekret"]
        assert main([*keyed, "--model", str(model_dir), "--input-len", "250",
                     "--output-len", "7"]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert "257 tokens" in line and "context of 256" in line and "--input-len" in line, line
        # no --model: the prompts' ids reach past the tiny model's 512-token vocabulary
        assert main([*keyed, "--input-len", "64", "--output-len", "2"]) == 1
        line = one_error_line(capsys.readouterr().err)
        assert "HTTP 400" in line and "vocabulary" in line and "--model DIR" in line, line
        assert "{" not in line  # the server's message, not its JSON
    finally:
        server.stop()


def test_fixed_lengths_replace_the_drawn_ones():
    settings = ServeBenchSettings(url="http://x", num_requests=5, input_len=7, output_len=3)
    work = serve_workload(settings, 100)
    assert [len(p) for p in work.prompts] == [7] * 5 and work.output_lens == [3] * 5
    standard = serve_workload(ServeBenchSettings(url="http://x", num_requests=5), 10000)
    assert standard == offline_workload(5, 0)


def test_serve_numbers_follow_their_definitions():
    def result(start, ttft, end, tokens, itl):
        return {"start": start, "ttft": ttft, "end": end, "output_tokens": tokens, "itl": itl,
                "chunks": len(itl) + 1, "error": None, "prompt_tokens": 10, "max_tokens": tokens}

    numbers = serve_numbers([result(0.0, 0.1, 1.1, 11, [0.1] * 10),
                             result(0.5, 0.3, 2.5, 5, [0.4, 0.5, 0.6, 0.2]),
                             {**result(1.0, None, 1.2, None, []), "error": "HTTP 503"}])
    assert numbers["completed"] == 2 and numbers["failed"] == 1 and numbers["errors"] == ["HTTP 503"]
    assert numbers["duration_s"] == pytest.approx(2.5)
    # the last request went out at 1.0 (the failed one too); the first token came at 0.1
    assert numbers["last_start_s"] == pytest.approx(1.0)
    assert numbers["first_token_s"] == pytest.approx(0.1)
    # no request answered: no first token (null in the JSON, not NaN)
    assert serve_numbers([{**result(1.0, None, 1.2, None, []), "error": "HTTP 503"}])[
        "first_token_s"] is None
    assert numbers["output_tok_s"] == pytest.approx(16 / 2.5)
    assert numbers["ttft"]["mean_ms"] == pytest.approx(200)
    assert numbers["tpot"]["mean_ms"] == pytest.approx((100 + 425) / 2)  # 1.0/10, 1.7/4
    assert numbers["itl"]["p50_ms"] == pytest.approx(100)


def test_engine_numbers_come_from_one_server_or_none():
    """The engine's counters over a run are the growth between two reads of /metrics, and
    only where one server answered both reads and every request: behind a balancer the
    reads may come from two replicas, or the run may have gone to several."""
    def counters(server, steps):
        return {**{key: 1.0 for key in ENGINE_COUNTERS}, "steps": steps, "loop_s": steps / 100,
                "server": server}

    numbers = engine_numbers(counters("a", 10), counters("a", 110), 1.5, {"a"})
    assert numbers["steps"] == 100 and numbers["server"] == "a"
    assert numbers["loop_s"] == pytest.approx(1.0) and numbers["idle_s"] == pytest.approx(0.5)
    assert numbers["loop_ms"] == pytest.approx(10.0)
    assert engine_numbers(counters("a", 10), counters("b", 110), 1.5, {"a", "b"}) is None
    assert engine_numbers(counters("a", 10), counters("a", 110), 1.5, {"a", "b"}) is None
    assert engine_numbers(None, counters("a", 110), 1.5, {"a"}) is None


@pytest.mark.parametrize("pieces, lines", [
    # a CR LF split between two pieces ends one line; a blank line (an event's end) is one
    (['data: {"t": "a\u2028', 'b\x85c"}\r', '\n\r\ndata: [DO', 'NE]\n\nlast'],
     ['data: {"t": "a\u2028b\x85c"}', "", "data: [DONE]", "", "last"]),
    (["a\rb", "\r"], ["a", "b"]),  # a lone CR ends a line, also at the very end
    (["a\r\n", "", "b\n"], ["a", "b"]),
])
def test_the_client_splits_event_lines_where_the_format_does(pieces, lines):
    """At CR LF, LF or CR only, wherever the pieces of the body end, and not at U+2028 or
    U+0085 inside an event's JSON (which httpx's own aiter_lines splits at)."""
    import asyncio

    class Body:
        async def aiter_text(self):
            for piece in pieces:
                yield piece

    async def read():
        return [line async for line in _event_lines(Body())]

    assert asyncio.run(read()) == lines


@pytest.mark.parametrize("args, flag", [
    (["latency", "--url", "http://x"], "--url"),
    (["throughput", "--max-concurrency", "4"], "--max-concurrency"),
    (["serve", "--hf"], "--hf"),
    (["serve", "--batch-sizes", "1,2"], "--batch-sizes"),
    (["serve", "--url", "ftp://x"], "--url"),
    (["serve", "--url", "http://x", "--max-num-seqs", "4"], "--max-num-seqs"),
    (["serve", "--max-concurrency", "0"], "--max-concurrency"),
    (["serve", "--request-rate", "0"], "--request-rate"),
    (["serve", "--output-len", "0"], "--output-len"),
])
def test_bench_serve_usage_errors(args, flag, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUPY_LLAMA_CACHE", str(tmp_path / "cache"))
    assert main(["bench", *args, "--device", "cpu"]) == 2
    assert flag in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "cache").exists()  # refused before any model was written
