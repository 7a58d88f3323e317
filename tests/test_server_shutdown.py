"""`cupy-llama serve` starting and stopping: the waiting-queue limit, SIGTERM and SIGINT
while streams run (each stream ends cleanly, the process exits 0), and the one-line
errors of bad flags, a bad model, a port in use and a missing serve extra."""
import pytest

# the serve extra (in the test extra); a machine without it, running only -m gpu, skips
pytest.importorskip("fastapi")
pytest.importorskip("openai")

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
from conftest import one_error_line

from cupy_llama.cli import main
from test_server import ServerProcess, metric


async def _streams(url: str, count: int, n: int):
    """count long streamed requests of n choices; returns each one's finish reasons by
    choice and whether it saw [DONE]."""
    async def one(client):
        body = {"prompt": "abc", "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
                "n": n, "stream": True}
        reasons, done = {}, False
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line:
                    (choice,) = json.loads(line[6:])["choices"]
                    if choice["finish_reason"] is not None:
                        reasons.setdefault(choice["index"], []).append(choice["finish_reason"])
        return reasons, done

    limits = httpx.Limits(max_connections=count + 4)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        return await asyncio.gather(*(one(client) for _ in range(count)))


def _wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _in_engine(server: ServerProcess) -> float:
    """The samples the server's engine holds, running or waiting (its /metrics)."""
    text = httpx.get(server.url + "/metrics").text
    return metric(text, "num_requests_running") + metric(text, "num_requests_waiting")


def _stop_during_streams(server: ServerProcess, sig, count: int, check_queue_limit: bool,
                         n: int = 1):
    async def scenario():
        streams = asyncio.ensure_future(_streams(server.url, count, n))
        # all of them in the engine, running or waiting (each of the n samples counts;
        # with a few sequences at a time most have no first chunk yet)
        await asyncio.get_running_loop().run_in_executor(
            None, _wait_for, lambda: _in_engine(server) == count * n, 30,
            f"{count} requests in the engine")
        if check_queue_limit:
            refused = await asyncio.get_running_loop().run_in_executor(None, lambda: httpx.post(
                server.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2}))
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "server_busy"
        stopped_at = time.monotonic()
        server.proc.send_signal(sig)
        results = await streams
        return results, stopped_at

    results, stopped_at = asyncio.run(scenario())
    code = server.proc.wait(timeout=10)
    assert code == 0, server.log_text()
    assert time.monotonic() - stopped_at < 10
    for reasons, done in results:  # each choice ended once, and the stream with [DONE]
        assert done and sorted(reasons) == list(range(n)), results
        assert all(len(r) == 1 and r[0] in ("stop", "length") for r in reasons.values()), results
    assert "Traceback" not in server.log_text()


@pytest.mark.slow
def test_sigterm_during_eight_streams_ends_them_and_exits_0(model_dir):
    # 2 run, 6 wait: the limit of 6 waiting turns a ninth request away with 503
    server = ServerProcess(model_dir, "--max-num-seqs", "2", "--max-waiting", "6")
    try:
        _stop_during_streams(server, signal.SIGTERM, 8, check_queue_limit=True)
    finally:
        server.stop(signal.SIGKILL)


@pytest.mark.slow
def test_sigint_stops_cleanly_too(model_dir):
    server = ServerProcess(model_dir, "--max-num-seqs", "4", "--log-requests")
    try:
        _stop_during_streams(server, signal.SIGINT, 3, check_queue_limit=False, n=2)
    finally:
        server.stop(signal.SIGKILL)
    assert '"prompt": "abc"' in server.log_text()  # --log-requests: bodies are logged


async def _answers(url: str, count: int):
    """count long streamed requests: each one's (status, its events as far as they came)
    where it was answered 200, else (status, its JSON body)."""
    async def one(client):
        body = {"prompt": "abc", "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
                "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return response.status_code, json.loads(await response.aread())
            lines = []
            try:
                async for line in response.aiter_lines():
                    lines.append(line)
            except httpx.HTTPError:  # cut off mid-stream
                pass
            return 200, lines

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await asyncio.gather(*(one(client) for _ in range(count)))


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_without_a_traceback(model_dir):
    """Ctrl-C twice while streams run: uvicorn's forced exit cuts them off (none ends with
    [DONE], as every one does after a single Ctrl-C), the request still waiting for a slot
    is answered 503 shutting_down in OpenAI's shape (not a plain-text 500), the process
    exits 0, and the log holds no traceback (of the cancelled requests, or of the
    lifespan's wait)."""
    server = ServerProcess(model_dir, "--max-num-seqs", "2")
    try:
        async def scenario():
            streams = asyncio.ensure_future(_answers(server.url, 3))
            await asyncio.get_running_loop().run_in_executor(
                None, _wait_for, lambda: _in_engine(server) == 3, 30, "3 requests in the engine")
            server.proc.send_signal(signal.SIGINT)
            await asyncio.get_running_loop().run_in_executor(
                None, _wait_for, lambda: "shutting down" in server.log_text(), 10,
                "the first Ctrl-C's shutdown")
            server.proc.send_signal(signal.SIGINT)
            return await streams

        results = asyncio.run(scenario())
        assert server.proc.wait(timeout=10) == 0, server.log_text()
        # the two running streams cut off, without [DONE]; the one waiting for a slot
        # (two at a time) refused in OpenAI's shape
        refused = [answer for status, answer in results if status != 200]
        assert len(refused) >= 1, results
        for status, answer in results:
            if status == 200:
                assert "data: [DONE]" not in answer, results
            else:
                assert status == 503 and answer["error"]["code"] == "shutting_down", results
    finally:
        server.stop(signal.SIGKILL)
    assert "shutting down" in server.log_text()
    assert "Traceback" not in server.log_text() and "CancelledError" not in server.log_text()


@pytest.mark.slow
def test_a_bad_model_is_one_line_exit_1(model_dir, tmp_path):
    result = subprocess.run([sys.executable, "-m", "cupy_llama.cli", "serve", "--model",
                             str(tmp_path / "nope"), "--device", "cpu", "--port", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "does not exist" in one_error_line(result.stderr)
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (broken / name).write_bytes((model_dir / name).read_bytes())
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    result = subprocess.run([sys.executable, "-m", "cupy_llama.cli", "serve", "--model",
                             str(broken), "--device", "cpu", "--port", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert "safetensors" in one_error_line(result.stderr), result.stderr


def test_a_port_in_use_is_one_line_exit_1(model_dir, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code = main(["serve", "--model", str(model_dir), "--device", "cpu", "--port", str(port)])
    assert code == 1
    line = one_error_line(capsys.readouterr().err)
    assert f"port {port}" in line and "in use" in line


def test_bad_flags_are_usage_errors(model_dir, capsys):
    for args in (["--port", "70000"], ["--max-num-seqs", "0"], ["--max-waiting", "-1"],
                 ["--device", "tpu"], ["--no-such-flag"]):
        assert main(["serve", "--model", str(model_dir), *args]) == 2, args
        one_error_line(capsys.readouterr().err)


def test_a_missing_serve_extra_names_the_pip_command(model_dir, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # import fastapi now fails
    assert main(["serve", "--model", str(model_dir), "--device", "cpu", "--port", "0"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "fastapi" in line and "pip install 'cupy-llama[serve]'" in line
    assert "pip install -e '.[serve]'" in line  # what a checkout needs


def test_an_engine_process_that_dies_ends_the_server_with_exit_1(model_dir):
    import os
    server = ServerProcess(model_dir, "--max-num-seqs", "2")
    try:
        body = {"prompt": "abc", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=30) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(server.engine_pid(), signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["error"]["type"] == "server_error"
        assert server.proc.wait(timeout=10) == 1
        assert "the engine process stopped unexpectedly" in one_error_line(server.log_text())
    finally:
        server.stop(signal.SIGKILL)


@pytest.mark.slow
def test_a_stopped_engine_fails_its_requests_and_the_server_exits_1(model_dir):
    """The shape of a hung GPU: the engine process stopped (SIGSTOP) while a stream runs.
    After --engine-timeout the stream ends with an error event and [DONE] and the server
    exits 1 (as when the engine dies) so that a supervisor restarts it (test_server_hostile.py
    checks /health and a request not begun, with an engine that stops stepping)."""
    import os
    server = ServerProcess(model_dir, "--max-num-seqs", "2", "--engine-timeout", "1")
    try:
        body = {"prompt": "abc", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=30) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(server.engine_pid(), signal.SIGSTOP)
            stopped_at = time.monotonic()
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert "--engine-timeout 1" in error["message"] and error["type"] == "server_error"
        assert 1 <= time.monotonic() - stopped_at < 10
        assert server.proc.wait(timeout=15) == 1
        assert "--engine-timeout" in one_error_line(server.log_text())
    finally:
        server.stop(signal.SIGKILL)
