"""`cupy-llama bench serve`: the standard workload against an OpenAI-compatible server.

It targets --url (any server speaking /v1/completions with server-sent events: cupy-llama,
vLLM, SGLang, llama.cpp, ...) or starts `cupy-llama serve` itself on a free port (and
always stops it). The requests are bench throughput's: the same prompts (token-id lists),
output lengths, temperature 0.6 and per-request seeds, EOS ignored, sent to
/v1/completions with stream: true, at a fixed --max-concurrency or with Poisson arrivals
at --request-rate (both: arrivals at that rate, at most that many in flight). --input-len
and --output-len replace the drawn lengths with fixed ones (a latency-shaped run, or the
time to first token of long prompts).

Measured per request as a client sees it (in the manner of `vllm bench serve`): time to
first token (to the first chunk that carries a choice), time per output token after the
first ((latency - TTFT) / (tokens - 1)), inter-token latency (the gaps between chunks; a
chunk carries every token that was ready when the server wrote it), end-to-end latency;
output tokens come from the usage the server reports at the end of each stream.

The clients must not be what limits the run: at 32,000 output tokens/s one Python
process cannot parse every event, so the requests are spread over --client-processes
processes (default: one per 32 concurrent streams, at most 8, at least 1), each with its
own share of the concurrency or of the arrival rate, and their timings are merged.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import select
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..util import cdiv
from .report import commit_info, environment, write_report
from .workloads import (THROUGHPUT_LENGTHS, THROUGHPUT_MAX_TOKEN_ID,
                              THROUGHPUT_TEMPERATURE, BenchSettings, Workload, offline_workload,
                              prepare_model, random_ids)
from ..errors import CupyLlamaError, OptionError, check_output_path

# a client process builds all its requests before its first one is sent (httpx: about 2 ms
# each on a 2-core machine, its connection pool's bookkeeping growing with them), so
# fewer streams a process bring a burst's first token sooner: at 256 streams on an H100,
# 32 a process gave 97.6, 98.2 and 97.2% of the offline figure where 64 a process gave
# 96.5, 97.0 and 97.0% in the same calls (benchmarks/NOTES.md, "The served run's first
# step")
STREAMS_PER_CLIENT = 32
MAX_CLIENT_PROCESSES = 8
SERVER_START_TIMEOUT_S = 900     # load, kernel compilation, CUDA graphs of a large model
PERCENTILES = (50, 90, 99)
# the engine's counters that a cupy-llama server's /metrics exposes (server/metrics.py), by
# the key bench serve reports their growth over the timed run under
ENGINE_COUNTERS = {"steps": "cupy_llama:engine_steps_total",
                   "step_s": "cupy_llama:engine_step_seconds_total",
                   "loop_s": "cupy_llama:engine_loop_seconds_total",
                   "tokens": "cupy_llama:iteration_tokens_total_sum",
                   "prompt_tokens": "cupy_llama:prompt_tokens_total",
                   "generation_tokens": "cupy_llama:generation_tokens_total",
                   "prefix_hits": "cupy_llama:prefix_cache_hits_total",
                   "preemptions": "cupy_llama:num_preemptions_total",
                   "queue_s": "cupy_llama:request_queue_time_seconds_sum",
                   "prefill_s": "cupy_llama:request_prefill_time_seconds_sum"}


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class ServeBenchSettings:
    url: str | None = None
    model_dir: str | None = None
    preset: str = "llama-3.2-1b"
    device: str = "cuda"
    max_concurrency: int | None = None
    request_rate: float = math.inf
    num_requests: int = 256
    seed: int = 0
    scale: float = 1.0
    input_len: int | None = None
    output_len: int | None = None
    temperature: float = THROUGHPUT_TEMPERATURE
    client_processes: int | None = None
    api_key: str | None = None
    json_path: str | None = None
    commit: str | None = None
    engine: dict = field(default_factory=dict)   # options for the server it starts

    def __post_init__(self):
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise OptionError(f"--max-concurrency must be at least 1, got {self.max_concurrency}")
        if not self.request_rate > 0:
            raise OptionError(f"--request-rate must be > 0 (inf: all at once), got "
                              f"{self.request_rate}")
        if self.num_requests < 1:
            raise OptionError(f"--num-requests must be at least 1, got {self.num_requests}")
        if not 0 < self.scale <= 1:
            raise OptionError(f"--scale must be in (0, 1], got {self.scale}")
        for flag, value in (("--input-len", self.input_len), ("--output-len", self.output_len),
                            ("--client-processes", self.client_processes)):
            if value is not None and value < 1:
                raise OptionError(f"{flag} must be at least 1, got {value}")
        if not self.temperature >= 0:
            raise OptionError(f"--temperature must be >= 0, got {self.temperature}")
        if self.url is not None and self.engine:
            names = ", ".join("--" + k.replace("_", "-") for k in sorted(self.engine))
            raise OptionError(f"{names}: engine options apply to the server bench serve "
                              "starts, not to one at --url")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise OptionError(f"--url must start with http:// or https://, got {self.url!r}")
        if self.json_path is not None:
            check_output_path(self.json_path, "--json")

    @property
    def concurrency(self) -> int:
        """Requests in flight at most (all of them when neither limit is given)."""
        return min(self.max_concurrency or self.num_requests, self.num_requests)

    def num_client_processes(self) -> int:
        if self.client_processes is not None:
            return min(self.client_processes, self.concurrency)
        return max(1, min(MAX_CLIENT_PROCESSES, cdiv(self.concurrency, STREAMS_PER_CLIENT)))

    def command(self) -> str:
        args = ["cupy-llama", "bench", "serve", "--seed", str(self.seed),
                "--num-requests", str(self.num_requests)]
        if self.url:
            args += ["--url", self.url]
        else:
            args += ["--device", self.device]
            args += ["--model", self.model_dir] if self.model_dir else ["--preset", self.preset]
        if self.max_concurrency is not None:
            args += ["--max-concurrency", str(self.max_concurrency)]
        if self.request_rate != math.inf:
            args += ["--request-rate", repr(self.request_rate)]
        for flag, value in (("--input-len", self.input_len), ("--output-len", self.output_len),
                            ("--client-processes", self.client_processes)):
            if value is not None:
                args += [flag, str(value)]
        if self.scale != 1:
            args += ["--scale", repr(self.scale)]
        if self.temperature != THROUGHPUT_TEMPERATURE:
            args += ["--temperature", repr(self.temperature)]
        args += engine_flags(self.engine)
        args += ["--json", self.json_path] if self.json_path else []
        return shlex.join(args)


def engine_flags(engine: dict) -> list[str]:
    """The command-line flags of engine options (as `cupy-llama serve` and bench take them)."""
    flags = []
    for name, value in sorted(engine.items()):
        if name == "enable_prefix_caching":
            flags += [] if value else ["--no-prefix-caching"]
        elif value is True:
            flags.append("--" + name.replace("_", "-"))
        else:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


# ---- the workload -------------------------------------------------------------------------

def serve_workload(settings: ServeBenchSettings, top_id: int) -> Workload:
    """bench throughput's workload, with --input-len / --output-len fixing the lengths."""
    lengths = tuple(max(1, round(n * settings.scale)) for n in THROUGHPUT_LENGTHS)
    work = offline_workload(settings.num_requests, settings.seed, lengths, top_id)
    if settings.input_len is not None:
        rng = random.Random(settings.seed)
        work.prompts = [random_ids(rng, settings.input_len, top_id)
                        for _ in range(settings.num_requests)]
    if settings.output_len is not None:
        work.output_lens = [settings.output_len] * settings.num_requests
    return work


def request_bodies(work: Workload, settings: ServeBenchSettings, model: str) -> list[dict]:
    """top_p 1 is sent: a server would otherwise apply the model's own top-p, which bench
    throughput does not."""
    return [{"model": model, "prompt": prompt, "max_tokens": max_tokens,
             "temperature": settings.temperature, "top_p": 1.0, "seed": settings.seed + i,
             "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            for i, (prompt, max_tokens) in enumerate(zip(work.prompts, work.output_lens))]


# ---- the clients --------------------------------------------------------------------------

_LINE_END = re.compile(r"\r\n|\n|\r")


async def _event_lines(response):
    """A server-sent event stream's lines, split where the format ends a line: CR LF, LF
    or CR (httpx's aiter_lines also splits at U+2028 and the like, which a server may write
    unescaped inside an event's JSON)."""
    pending = ""
    async for text in response.aiter_text():
        pending += text
        # a CR at the end may be the first half of a CR LF: it waits for the next piece
        cut = len(pending) - pending.endswith("\r")
        *lines, rest = _LINE_END.split(pending[:cut])
        pending = rest + pending[cut:]
        for line in lines:
            yield line
    *lines, rest = _LINE_END.split(pending)
    for line in lines + ([rest] if rest else []):
        yield line


async def _one_request(client, body: dict, semaphore: asyncio.Semaphore) -> dict:
    async with semaphore:
        result = {"start": time.perf_counter(), "ttft": None, "itl": [], "end": None,
                  "output_tokens": None, "chunks": 0, "error": None, "served_by": None}
        last = result["start"]
        try:
            async with client.stream("POST", "completions", json=body) as response:
                result["served_by"] = response.headers.get("x-served-by")
                if response.status_code != 200:
                    text = (await response.aread()).decode("utf-8", "replace")
                    result["error"] = f"HTTP {response.status_code}: {_error_text(text)}"
                    return result
                async for line in _event_lines(response):
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    event = json.loads(data)
                    if event.get("choices"):
                        if result["ttft"] is None:
                            result["ttft"] = now - result["start"]
                        else:
                            result["itl"].append(now - last)
                        last = now
                        result["chunks"] += 1
                    elif event.get("usage"):
                        result["output_tokens"] = event["usage"]["completion_tokens"]
                    elif event.get("error"):
                        result["error"] = str(event["error"].get("message"))
        except Exception as e:  # a broken connection fails the request, not the run
            result["error"] = f"{type(e).__name__}: {e}"
        result["end"] = time.perf_counter()
        if result["error"] is None and result["ttft"] is None:
            result["error"] = "the stream ended without a token"
        return result


async def _run_share(base_url: str, api_key: str | None, bodies: list[tuple[int, dict]],
                     concurrency: int, rate: float, seed: int, start_at: float) -> list:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    semaphore = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url.rstrip("/") + "/", headers=headers,
                                 limits=limits, timeout=httpx.Timeout(None)) as client:
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        tasks = []
        for index, body in bodies:
            if rate != math.inf and tasks:
                await asyncio.sleep(rng.expovariate(rate))
            tasks.append(asyncio.ensure_future(_one_request(client, body, semaphore)))
        results = await asyncio.gather(*tasks)
    for (index, body), result in zip(bodies, results):
        result["index"] = index
        result["prompt_tokens"] = len(body["prompt"])
        result["max_tokens"] = body["max_tokens"]
    return results


def _client_process(args, results_queue) -> None:
    """One client process: its share of the requests, results back through the queue."""
    try:
        results_queue.put(asyncio.run(_run_share(*args)))
    except BaseException as e:  # the parent reports it
        results_queue.put(f"{type(e).__name__}: {e}")


def run_clients(base_url: str, bodies: list[dict], *, concurrency: int, rate: float = math.inf,
                api_key: str | None = None, seed: int = 0, num_processes: int = 1) -> list[dict]:
    """Send every body; returns one result per request, in request order. Request i goes to
    client process i mod num_processes; concurrency and rate are split between them."""
    num_processes = max(1, min(num_processes, len(bodies)))
    shares = []
    for k in range(num_processes):
        mine = [(i, body) for i, body in enumerate(bodies) if i % num_processes == k]
        share_concurrency = concurrency // num_processes + (k < concurrency % num_processes)
        shares.append((base_url, api_key, mine, max(1, share_concurrency),
                       rate / num_processes, seed + 1000 * k))
    if num_processes == 1:
        results = asyncio.run(_run_share(*shares[0], time.perf_counter()))
    else:
        import multiprocessing
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        start_at = time.perf_counter() + 2.0 + 0.2 * num_processes  # after every import
        processes = [context.Process(target=_client_process, args=((*share, start_at), queue),
                                     daemon=True) for share in shares]
        for process in processes:
            process.start()
        results = []
        try:
            for _ in processes:
                part = queue.get()
                if isinstance(part, str):
                    raise RuntimeError(f"a client process failed: {part}")
                results += part
        finally:
            for process in processes:
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()
    return sorted(results, key=lambda r: r["index"])


# ---- the numbers --------------------------------------------------------------------------

def _stats_ms(values: list[float]) -> dict:
    if not values:
        return {"mean_ms": None, "std_ms": None, **{f"p{p}_ms": None for p in PERCENTILES}}
    ms = np.asarray(values) * 1e3
    return {"mean_ms": float(ms.mean()), "std_ms": float(ms.std()),
            **{f"p{p}_ms": float(np.percentile(ms, p)) for p in PERCENTILES}}


def serve_numbers(results: list[dict]) -> dict:
    ok = [r for r in results if r["error"] is None]
    failed = [r for r in results if r["error"] is not None]
    first_start = min(r["start"] for r in results)
    duration = max(r["end"] for r in results) - first_start
    counted_by_usage = all(r["output_tokens"] is not None for r in ok)
    for r in ok:
        if r["output_tokens"] is None:
            r["output_tokens"] = r["chunks"]  # a server that reports no usage
    output_tokens = sum(r["output_tokens"] for r in ok)
    input_tokens = sum(r["prompt_tokens"] for r in ok)
    tpot = [(r["end"] - r["start"] - r["ttft"]) / (r["output_tokens"] - 1)
            for r in ok if r["output_tokens"] > 1]
    return {
        "num_requests": len(results), "completed": len(ok), "failed": len(failed),
        "errors": sorted({r["error"] for r in failed})[:10],
        "duration_s": duration,
        # the run's edges as the clients saw them: when the last request went out, and when
        # the first token came back, from the first request's start
        "last_start_s": max(r["start"] for r in results) - first_start,
        "first_token_s": (min(r["start"] + r["ttft"] for r in ok) - first_start) if ok else None,
        "input_tokens": input_tokens, "output_tokens": output_tokens,
        "requested_output_tokens": sum(r["max_tokens"] for r in ok),
        "output_tokens_from_usage": counted_by_usage,
        "requests_s": len(ok) / duration, "output_tok_s": output_tokens / duration,
        "total_tok_s": (input_tokens + output_tokens) / duration,
        "chunks": sum(r["chunks"] for r in ok),
        "ttft": _stats_ms([r["ttft"] for r in ok]), "tpot": _stats_ms(tpot),
        "itl": _stats_ms([gap for r in ok for gap in r["itl"]]),
        "e2e_latency": _stats_ms([r["end"] - r["start"] for r in ok]),
    }


def engine_counters(base_url: str, api_key: str | None) -> dict | None:
    """ENGINE_COUNTERS as the server's /metrics gives them now, summed over their labels,
    and under "server" the x-served-by header of the answer (the replica behind a
    balancer); None for a server that lacks any of them (not a cupy-llama server, or an
    older one)."""
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    root = base_url[:-len("/v1")] if base_url.endswith("/v1") else base_url
    try:
        response = httpx.get(root + "/metrics", headers=headers, timeout=30)
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    wanted = {name: key for key, name in ENGINE_COUNTERS.items()}
    found = {}
    for line in response.text.splitlines():
        series, _, value = line.rpartition(" ")  # name{labels} value; comments start "#"
        name = series.partition("{")[0]
        if name in wanted:
            try:
                found[wanted[name]] = found.get(wanted[name], 0.0) + float(value)
            except ValueError:
                return None
    if len(found) < len(ENGINE_COUNTERS):
        return None
    return {**found, "server": response.headers.get("x-served-by")}


def engine_numbers(before: dict | None, after: dict | None, duration_s: float,
                   served_by: set) -> dict | None:
    """What the engine did during the timed run, from its counters before and after it:
    steps, seconds inside its steps (step_s) and in the loop turns that stepped (loop_s:
    the steps plus taking requests and sending outputs), and the run's time it stepped
    in no turn (idle_s: waiting for requests, or the run's edges as clients see them).
    None unless one server answered both reads and every request that
    got an answer (served_by: their x-served-by headers): behind a balancer the reads
    may come from different replicas, and one replica's counters are not the run's."""
    if (before is None or after is None or before["server"] != after["server"]
            or not served_by <= {after["server"]}):
        return None
    grown = {"server": after["server"],
             **{key: after[key] - before[key] for key in ENGINE_COUNTERS}}
    for key in ("steps", "tokens", "prompt_tokens", "generation_tokens", "prefix_hits",
                "preemptions"):
        grown[key] = round(grown[key])
    steps = grown["steps"]
    grown.update({"idle_s": duration_s - grown["loop_s"],
                  "tokens_per_step": grown["tokens"] / steps if steps else None,
                  "step_ms": 1e3 * grown["step_s"] / steps if steps else None,
                  "loop_ms": 1e3 * grown["loop_s"] / steps if steps else None})
    return grown


def format_serve_table(report: dict) -> str:
    r = report["results"]
    settings = report["settings"]
    rate = settings["request_rate"]

    def num(value, digits=2):
        return "-" if value is None else f"{value:,.{digits}f}"

    lines = ["============ Serving Benchmark Result ============",
             f"{'Server:':<40}{report['server']['url']}"
             f"{' (started by bench serve)' if report['server']['started'] else ''}",
             f"{'Max concurrency:':<40}{settings['max_concurrency'] or 'none'}",
             f"{'Request rate (req/s):':<40}{'inf' if rate is None else num(rate)}",
             f"{'Successful requests:':<40}{r['completed']}",
             f"{'Failed requests:':<40}{r['failed']}",
             f"{'Benchmark duration (s):':<40}{num(r['duration_s'])}",
             f"{'Total input tokens:':<40}{r['input_tokens']:,}",
             f"{'Total generated tokens:':<40}{r['output_tokens']:,}",
             f"{'Request throughput (req/s):':<40}{num(r['requests_s'])}",
             f"{'Output token throughput (tok/s):':<40}{num(r['output_tok_s'])}",
             f"{'Total token throughput (tok/s):':<40}{num(r['total_tok_s'])}"]
    for key, title in (("ttft", "Time to First Token"),
                       ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2e_latency", "End-to-end Latency")):
        short = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e_latency": "E2EL"}[key]
        lines.append(f"{title:-^50}")
        lines.append(f"{f'Mean {short} (ms):':<40}{num(r[key]['mean_ms'])}")
        for p in PERCENTILES:
            label = "Median" if p == 50 else f"P{p}"
            lines.append(f"{f'{label} {short} (ms):':<40}{num(r[key][f'p{p}_ms'])}")
    engine = r.get("engine")
    if engine is not None:
        title = "Engine (the server's /metrics)"
        lines += [f"{title:-^50}",
                  f"{'Engine steps:':<40}{engine['steps']:,}",
                  f"{'Tokens per step:':<40}{num(engine['tokens_per_step'], 1)}",
                  f"{'Mean loop turn of a step (ms):':<40}{num(engine['loop_ms'])}",
                  f"{'Engine idle during the run (s):':<40}{num(engine['idle_s'])}",
                  f"{'Preemptions:':<40}{engine['preemptions']:,}"]
    lines.append("=" * 50)
    if r["errors"]:
        lines.append("errors: " + "; ".join(r["errors"]))
    return "\n".join(lines)


# ---- the server ---------------------------------------------------------------------------

@contextmanager
def started_server(settings: ServeBenchSettings, model_dir: Path, log):
    """`cupy-llama serve` on a free port of 127.0.0.1 as a subprocess in its own process
    group; yields its base URL (…/v1) once /health answers. Always stopped afterwards."""
    command = [sys.executable, "-m", "cupy_llama.cli", "serve", "--model", str(model_dir),
               "--device", settings.device, "--port", "0", "--served-model-name", "bench",
               "--max-waiting", str(max(1024, settings.num_requests)),
               *engine_flags(settings.engine)]
    log_file = tempfile.NamedTemporaryFile("w+", prefix="cupy-llama-serve-", suffix=".log",
                                           delete=False)
    log(f"starting the server: {shlex.join(command)} (log: {log_file.name})")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log_file, text=True,
                               start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = _wait_for_ready_line(process, log_file)
        _wait_for_health(url, None, SERVER_START_TIMEOUT_S)
        yield url + "/v1", command, log_file.name
    finally:
        _stop(process)
        log_file.close()


def _wait_for_ready_line(process: subprocess.Popen, log_file) -> str:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        readable, _, _ = select.select([process.stdout], [], [], 0.5)
        if readable:
            line = process.stdout.readline()
            if line.startswith("serving ") and " at http" in line:
                return line.split(" at ", 1)[1].split()[0].removesuffix("/v1")
        if process.poll() is not None:
            log_file.flush()
            tail = Path(log_file.name).read_text(errors="replace").strip().splitlines()[-3:]
            raise CupyLlamaError(f"the server exited (code {process.returncode}) before it was "
                                 f"ready: {' | '.join(tail)}")
    raise CupyLlamaError(f"the server was not ready within {SERVER_START_TIMEOUT_S} s; see "
                         f"{log_file.name}")


def _wait_for_health(base: str, api_key, timeout: float) -> None:
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise CupyLlamaError(f"{base}/health did not answer 200 within {timeout:.0f} s")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _error_text(body: str) -> str:
    """One line from an error response's body: its OpenAI error message where it has one."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:300]
    return " ".join(str(message).split())


def _server_model(base_url: str, api_key: str | None) -> tuple[str, int | None]:
    """The served model's name, and its context length where /models gives one (vLLM's
    and cupy-llama's max_model_len)."""
    import httpx
    url = base_url.rstrip("/") + "/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url, headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise CupyLlamaError(f"cannot reach {url} ({' '.join(str(e).split())}); is the "
                             "server up at that address?") from None
    if response.status_code == 401:
        fix = ("the key given (--api-key or $OPENAI_API_KEY) is not the server's" if api_key
               else "pass the server's key with --api-key or set $OPENAI_API_KEY")
        raise OptionError(f"{url} refused bench serve (HTTP 401): {fix}")
    if response.status_code != 200:
        raise CupyLlamaError(f"{url} answered HTTP {response.status_code}: "
                             f"{_error_text(response.text)}; is it an OpenAI-compatible server?")
    try:
        card = response.json()["data"][0]
        context = card.get("max_model_len")
        return card["id"], context if isinstance(context, int) else None
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        raise CupyLlamaError(f"{url} lists no model; is it an OpenAI-compatible "
                             "server?") from None


def check_context(work: Workload, context: int | None) -> None:
    """Refuse a workload whose longest request (prompt and output) the server's context
    cannot hold, before any request is sent."""
    longest = max(len(p) + n for p, n in zip(work.prompts, work.output_lens))
    if context is not None and longest > context:
        raise OptionError(f"the workload's longest request takes {longest} tokens (prompt "
                          f"and output), past the server's context of {context}: lower "
                          "--input-len, --output-len or --scale")


def warm_up(base_url: str, model: str, settings: ServeBenchSettings, top_id: int,
            longest_prompt: int, log) -> float:
    """Before anything is timed: as many requests as will run at once, request i with
    2 + i new tokens, so the batch shrinks one sequence per step through every decode batch
    size (CUDA graphs are captured on first use), then the longest prompt alone."""
    rng = random.Random(settings.seed + 1)
    concurrency = settings.concurrency
    started = time.perf_counter()
    bodies = [{"model": model, "prompt": random_ids(rng, 8 + (4 * i) % 1024, top_id),
               "max_tokens": 2 + i, "temperature": settings.temperature, "top_p": 1.0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
              for i in range(concurrency)]
    bodies += [{**bodies[0], "prompt": random_ids(rng, longest_prompt, top_id), "max_tokens": 2}]
    results = run_clients(base_url, bodies[:-1], concurrency=concurrency,
                          api_key=settings.api_key)
    results += run_clients(base_url, bodies[-1:], concurrency=1, api_key=settings.api_key)
    failed = [r["error"] for r in results if r["error"] is not None]
    if failed:
        hint = ""
        if settings.model_dir is None and "vocab" in failed[0].lower():
            hint = (f"; prompts draw token ids below {top_id + 1} without --model: pass "
                    "--model DIR, the server's model directory, to draw them from its vocabulary")
        raise CupyLlamaError(f"warm-up requests failed: {failed[0]}{hint}")
    seconds = time.perf_counter() - started
    log(f"warm-up: {len(bodies)} requests in {seconds:.1f} s")
    return seconds


# ---- the run ------------------------------------------------------------------------------

def run_bench_serve(settings: ServeBenchSettings, log=_stderr) -> dict:
    model_dir, top_id = None, THROUGHPUT_MAX_TOKEN_ID
    if settings.url is None or settings.model_dir is not None:
        from ..models import read_config
        if settings.url is None:
            model_dir, _ = prepare_model(BenchSettings(mode="throughput", model_dir=settings.model_dir,
                                                       preset=settings.preset,
                                                       device=settings.device), log)
        else:
            model_dir = Path(settings.model_dir)
        top_id = min(THROUGHPUT_MAX_TOKEN_ID, read_config(model_dir).vocab_size - 1)
    work = serve_workload(settings, top_id)
    num_processes = settings.num_client_processes()
    report = {"command": settings.command(), "argv": list(sys.argv),
              **commit_info(settings.commit), "environment": environment("cpu", False),
              "settings": {"max_concurrency": settings.max_concurrency,
                           "request_rate": None if settings.request_rate == math.inf
                           else settings.request_rate,
                           "num_requests": settings.num_requests, "seed": settings.seed,
                           "scale": settings.scale, "input_len": settings.input_len,
                           "output_len": settings.output_len,
                           "temperature": settings.temperature, "top_p": 1.0,
                           "client_processes": num_processes, "engine": dict(settings.engine),
                           "workload": "bench throughput's" if settings.input_len is None
                           and settings.output_len is None else "fixed lengths"}}

    def run(base_url: str) -> None:
        model, context = _server_model(base_url, settings.api_key)
        check_context(work, context)
        report["server"]["model"] = model
        report["timings"] = {"warmup_s": warm_up(base_url, model, settings, top_id,
                                                 max(len(p) for p in work.prompts), log)}
        bodies = request_bodies(work, settings, model)
        log(f"bench serve: {len(bodies)} requests, concurrency {settings.concurrency}, rate "
            f"{settings.request_rate:g}/s, {num_processes} client process"
            f"{'es' if num_processes > 1 else ''}")
        before = engine_counters(base_url, settings.api_key)
        results = run_clients(base_url, bodies, concurrency=settings.concurrency,
                              rate=settings.request_rate, api_key=settings.api_key,
                              seed=settings.seed, num_processes=num_processes)
        report["results"] = serve_numbers(results)
        report["results"]["engine"] = engine_numbers(
            before, engine_counters(base_url, settings.api_key), report["results"]["duration_s"],
            {r["served_by"] for r in results if r["served_by"] is not None})

    if settings.url is not None:
        base_url = settings.url.rstrip("/")
        base_url = base_url if base_url.endswith("/v1") else base_url + "/v1"
        report["server"] = {"url": base_url, "started": False}
        run(base_url)
    else:
        with started_server(settings, model_dir, log) as (base_url, command, log_path):
            report["server"] = {"url": base_url, "started": True, "command": shlex.join(command),
                                "log": log_path, "model_dir": str(model_dir)}
            run(base_url)
    r = report["results"]
    log(f"bench serve: {r['completed']} of {r['num_requests']} requests, "
        f"{r['output_tokens']:,} output tokens in {r['duration_s']:.2f} s: "
        f"{r['output_tok_s']:,.0f} output tok/s, TTFT p50 {r['ttft']['p50_ms'] or 0:.1f} ms, "
        f"TPOT p50 {r['tpot']['p50_ms'] or 0:.2f} ms")
    if settings.json_path:
        write_report(settings.json_path, report)
        log(f"wrote {settings.json_path}")
    return report


def bench_serve_command(out=print, **options) -> dict:
    settings = ServeBenchSettings(**options)
    report = run_bench_serve(settings)
    out(format_serve_table(report))
    return report
