"""A server's first requests, on the CPU: starts `cupy-llama serve --device cpu` (the demo
model) of the checkout it runs in on a free port, then sends one-token chat completions
one at a time, four plain ones and then two that ask logprobs, printing each one's time
as the client sees it. From the repository root of the checkout to measure:
    PYTHONPATH=. python benchmarks/host_path/first_request/serve_first.py
It needs the serve extra and the demo model (`cupy-llama fetch-demo`).
"""
import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "cupy_llama.cli", "serve", "--device", "cpu", "--host",
         "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        for line in server.stdout:  # the ready line
            if line.startswith("serving "):
                break
        else:
            raise SystemExit("the server stopped before it was ready")
        base = f"http://127.0.0.1:{port}/v1"
        model = httpx.get(f"{base}/models").json()["data"][0]["id"]
        body = {"model": model, "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        for label, extra, count in (("plain", {}, 4), ("logprobs", {"logprobs": True,
                                                                    "top_logprobs": 2}, 2)):
            for i in range(count):
                started = time.perf_counter()
                response = httpx.post(f"{base}/chat/completions", json={**body, **extra},
                                      timeout=60)
                elapsed = time.perf_counter() - started
                response.raise_for_status()
                print(f"{label} request {i + 1}: {1e3 * elapsed:.1f} ms")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
