"""`cupy-llama bench`: the standard workloads, timed honestly, beside transformers.

Modes (DESIGN "Performance model"):
  throughput    the standard offline workload: 256 requests; prompt and output lengths
                uniform in [100, 1024]; prompt ids uniform in [0, 10000]; EOS ignored;
                temperature 0.6; all requests at once. Drawn with Python's `random` seeded
                with --seed in the order nano-vllm's bench.py draws them, so seed 0 gives
                the same requests. Throughput = output tokens / wall time.
  latency       batch-1 greedy decode, 32-token prompt, 256 new tokens: tok/s with the
                clock started at the first token, and the fraction of the bandwidth floor
                (the bytes read per step over a device-to-device copy bandwidth measured
                in the same run).
  ttft          time to first token of 128-, 1,024- and 4,096-token prompts (median).
  decode-sweep  greedy decode tok/s at batch 1, 8, 32, 64, 128, 256 (prompt 128, 128 new
                tokens), counting the tokens after every request has its first one.
  all           every mode on one loaded model, one JSON.

Load, warm-up and run times are reported apart; statistics go to stderr while running,
a short table to stdout at the end. With --hf the same workloads run through Hugging
Face transformers in the same process, after cupy-llama has released the GPU.
"""
from __future__ import annotations

import gc
import json
import os
import platform
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from .errors import DeviceError, RequestError
from .sampling import SamplingParams

MODES = ("throughput", "latency", "ttft", "decode-sweep")
DEVICES = ("cuda", "cpu")
PRESETS = ("llama-3.2-1b", "tiny")
DEFAULT_BATCH_SIZES = (1, 8, 32, 64, 128, 256)
MODEL_SEED = 0                  # random weights: the same model for every workload seed
THROUGHPUT_LENGTHS = (100, 1024)
THROUGHPUT_MAX_TOKEN_ID = 10000
THROUGHPUT_TEMPERATURE = 0.6    # nano-vllm's bench samples; the other modes are greedy
LATENCY_PROMPT, LATENCY_NEW_TOKENS, LATENCY_RUNS = 32, 256, 3
TTFT_LENGTHS, TTFT_RUNS = (128, 1024, 4096), 5
SWEEP_PROMPT, SWEEP_NEW_TOKENS = 128, 128
CUDA_MAX_NUM_SEQS = 256         # the sweep's largest batch decodes as one batch
COPY_BYTES = 1 << 30


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- settings -----------------------------------------------------------------------------

@dataclass
class BenchSettings:
    mode: str
    model_dir: str | None = None
    preset: str = "llama-3.2-1b"
    device: str = "cuda"
    seed: int = 0
    num_requests: int = 256
    scale: float = 1.0            # multiplies every prompt and output length (quick checks)
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    hf: bool = False
    json_path: str | None = None
    commit: str | None = None
    engine: dict = field(default_factory=dict)  # EngineConfig options the user set

    def __post_init__(self):
        if self.mode not in MODES + ("all",):
            raise RequestError(f"mode must be one of {', '.join(MODES + ('all',))}, "
                               f"got {self.mode!r}")
        if self.device not in DEVICES:
            raise RequestError(f"--device must be cuda or cpu, got {self.device!r}")
        if self.preset not in PRESETS:
            raise RequestError(f"--preset must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        if self.num_requests < 1:
            raise RequestError(f"--num-requests must be at least 1, got {self.num_requests}")
        if not 0 < self.scale <= 1:
            raise RequestError(f"--scale must be in (0, 1], got {self.scale}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise RequestError(f"--batch-sizes must be positive integers, got {self.batch_sizes}")
        if self.seed < 0:
            raise RequestError(f"--seed must be >= 0, got {self.seed}")
        if self.json_path is not None:
            parent = Path(self.json_path).expanduser().resolve().parent
            if not parent.is_dir():
                raise RequestError(f"--json: folder {str(parent)!r} does not exist; create it "
                                   "or pick another path")

    @property
    def modes(self) -> tuple[str, ...]:
        return MODES if self.mode == "all" else (self.mode,)

    def scaled(self, length: int, least: int = 1) -> int:
        return max(least, round(length * self.scale))

    def engine_options(self) -> dict:
        options = dict(self.engine)
        if self.device == "cuda":
            options.setdefault("max_num_seqs", CUDA_MAX_NUM_SEQS)
        return options

    def command(self) -> str:
        """The command line that repeats this run, every setting spelled out."""
        args = ["cupy-llama", "bench", self.mode, "--device", self.device, "--seed", str(self.seed)]
        args += ["--model", self.model_dir] if self.model_dir else ["--preset", self.preset]
        if self.num_requests != 256:
            args += ["--num-requests", str(self.num_requests)]
        if self.scale != 1:
            args += ["--scale", repr(self.scale)]
        if tuple(self.batch_sizes) != DEFAULT_BATCH_SIZES:
            args += ["--batch-sizes", ",".join(map(str, self.batch_sizes))]
        for name, value in sorted(self.engine.items()):
            flag = "--" + name.replace("_", "-")
            args += [flag] if value is True else [flag, str(value)]
        args += ["--hf"] if self.hf else []
        args += ["--json", self.json_path] if self.json_path else []
        return shlex.join(args)


# ---- the run ------------------------------------------------------------------------------

def run_bench(settings: BenchSettings, log=_stderr) -> dict:
    """Runs the settings' modes (then the transformers baselines) and returns the report;
    writes it as JSON when settings.json_path is set."""
    if settings.hf:
        check_hf_available(settings.device)
    device = DeviceProbe(settings.device)
    report = {"command": settings.command(), "argv": list(sys.argv), **commit_info(settings.commit),
              "environment": environment(settings.device, settings.hf),
              "device": {"kind": settings.device, "name": device.name}}
    if settings.mode in ("all", "latency"):
        report["device"]["copy_bandwidth_bytes_s"] = device.copy_bandwidth()
        log(f"device copy bandwidth: {report['device']['copy_bandwidth_bytes_s'] / 1e9:,.0f} GB/s "
            "(read + write)")
    model_dir, made_s = prepare_model(settings, log)
    memory = {"used_before_load": device.used_bytes()}

    from .llm import LLM
    started = time.perf_counter()
    llm = LLM(model_dir, device=settings.device, log=log, **settings.engine_options())
    load_s = time.perf_counter() - started
    memory["used_after_load"] = device.used_bytes()
    warmup_s = warm_up(llm, settings)
    memory["used_after_warmup"] = device.used_bytes()
    log(f"load {load_s:.2f} s, warm-up (kernel compile) {warmup_s:.2f} s")
    report["model"] = describe_model(llm, model_dir, settings, made_s)
    report["settings"] = {**run_settings(settings), "engine": asdict(llm.engine_config),
                          "max_model_len": llm.engine.max_model_len}
    report["timings"] = {"load_s": load_s, "warmup_s": warmup_s}

    results, peaks = {}, [memory["used_after_warmup"]]
    report["results"] = results
    for mode in settings.modes:
        results[mode] = {"cupy_llama": OUR_MODES[mode](llm, settings, device, log)}
        peaks.append(device.used_bytes())
    memory["peak_used"] = None if peaks[0] is None else max(peaks)
    report["memory"] = memory_report(llm, device, memory)
    release(llm, device)
    del llm

    def save():  # after each stage, so a run stopped later still leaves its numbers
        if settings.json_path:
            Path(settings.json_path).expanduser().write_text(json.dumps(report, indent=2) + "\n")

    save()
    if settings.hf:
        report["transformers"] = run_hf(model_dir, settings, results, log, save)
        add_ratios(results)
        save()
    if settings.json_path:
        log(f"wrote {settings.json_path}")
    return report


def run_settings(settings: BenchSettings) -> dict:
    return {"modes": list(settings.modes), "seed": settings.seed, "scale": settings.scale,
            "num_requests": settings.num_requests, "batch_sizes": list(settings.batch_sizes),
            "hf": settings.hf, "engine_options_given": dict(settings.engine),
            "sampling": {"throughput": f"temperature {THROUGHPUT_TEMPERATURE}, top-p 1, "
                                       "seed --seed + request index, EOS ignored",
                         "other modes": "greedy, EOS ignored"}}


def prepare_model(settings: BenchSettings, log) -> tuple[Path, float | None]:
    """The model directory: --model, else a seeded random model of the preset's shape,
    written once into the cache (returns its path and how long writing took, or None)."""
    if settings.model_dir:
        return Path(settings.model_dir).expanduser(), None
    from .demo import cache_dir
    target = cache_dir() / "bench-models" / f"{settings.preset}-seed{MODEL_SEED}"
    if (target / ".complete").is_file():
        return target, None
    from .random_model import make_random_model
    log(f"writing a random {settings.preset} model to {target} (once; later runs reuse it)")
    started = time.perf_counter()
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    try:
        make_random_model(partial, settings.preset, seed=MODEL_SEED)
        (partial / ".complete").write_text("")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target, time.perf_counter() - started


def warm_up(llm, settings: BenchSettings) -> float:
    """Runs every kind of step once before anything is timed (kernel compilation, first
    use of each decode batch size): prefill of a few prompt lengths, greedy and sampled
    decode, and decode at each sweep batch size the engine can hold."""
    started = time.perf_counter()
    rng = random.Random(settings.seed + 1)
    top = max_token_id(llm)
    most = llm.engine_config.max_num_seqs
    prompts = [random_ids(rng, 8 + 24 * i, top) for i in range(min(4, most))]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm.generate(prompts[0], SamplingParams(temperature=0.6, max_tokens=4, ignore_eos=True, seed=0))
    for batch in sorted({b for b in DEFAULT_BATCH_SIZES if b <= most} | {most}):
        llm.generate([random_ids(rng, 8, top) for _ in range(batch)],
                     SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    return time.perf_counter() - started


def random_ids(rng: random.Random, length: int, top: int) -> list[int]:
    return [rng.randint(0, top) for _ in range(length)]


def max_token_id(llm) -> int:
    return min(THROUGHPUT_MAX_TOKEN_ID, llm.config.vocab_size - 1)


# ---- cupy-llama's modes -------------------------------------------------------------------

@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


def offline_workload(num_requests: int = 256, seed: int = 0, lengths=THROUGHPUT_LENGTHS,
                     top_id: int = THROUGHPUT_MAX_TOKEN_ID) -> Workload:
    """The standard offline workload: for each request a prompt length and its ids, then
    every output length, all from one `random.Random(seed)` (nano-vllm's order)."""
    rng = random.Random(seed)
    low, high = lengths
    prompts = [[rng.randint(0, top_id) for _ in range(rng.randint(low, high))]
               for _ in range(num_requests)]
    output_lens = [rng.randint(low, high) for _ in range(num_requests)]
    return Workload(prompts, output_lens)


def throughput_workload(settings: BenchSettings, top_id: int) -> Workload:
    lengths = tuple(settings.scaled(n) for n in THROUGHPUT_LENGTHS)
    return offline_workload(settings.num_requests, settings.seed, lengths, top_id)


def run_throughput(llm, settings: BenchSettings, device, log) -> dict:
    work = throughput_workload(settings, max_token_id(llm))
    params = [SamplingParams(temperature=THROUGHPUT_TEMPERATURE, max_tokens=n, ignore_eos=True,
                             seed=settings.seed + i) for i, n in enumerate(work.output_lens)]
    started = time.perf_counter()
    outputs = llm.generate(work.prompts, params)
    wall_s = time.perf_counter() - started
    result = throughput_numbers(work, sum(len(o.token_ids) for o in outputs), wall_s)
    log(f"throughput: {result['num_requests']} requests, {result['output_tokens']:,} output "
        f"tokens in {wall_s:.2f} s: {result['output_tok_s']:,.0f} output tok/s, "
        f"{result['total_tok_s']:,.0f} total tok/s, {result['requests_s']:.1f} req/s")
    return result


def throughput_numbers(work: Workload, output_tokens: int, wall_s: float) -> dict:
    prompt_tokens = sum(len(p) for p in work.prompts)
    return {"num_requests": len(work.prompts), "prompt_tokens": prompt_tokens,
            "requested_output_tokens": sum(work.output_lens), "output_tokens": output_tokens,
            "wall_s": wall_s, "output_tok_s": output_tokens / wall_s,
            "total_tok_s": (prompt_tokens + output_tokens) / wall_s,
            "requests_s": len(work.prompts) / wall_s, "temperature": THROUGHPUT_TEMPERATURE}


def timed_steps(llm, prompts: list[list[int]], params: SamplingParams):
    """Runs the requests step by step; returns the start time and (time, tokens by
    request id) per step, each time taken once the step's tokens are on the host."""
    engine = llm.engine
    ids, steps = [], []
    started = time.perf_counter()
    try:
        ids = [engine.add_request(p, replace(params)) for p in prompts]
        while engine.has_unfinished_requests():
            outputs = engine.step()
            steps.append((time.perf_counter(),
                          {o.request_id: len(o.delta_token_ids) for o in outputs}))
    finally:
        for request_id in ids:
            engine.abort(request_id)
    return started, steps


def decode_numbers(started: float, steps, num_requests: int) -> dict:
    """The clock starts at the step that gave the last request its first token; every
    token after that counts."""
    seen: set[str] = set()
    first = None
    for index, (stamp, tokens) in enumerate(steps):
        seen.update(tokens)
        if len(seen) == num_requests:
            first = index
            break
    if first is None:
        raise RuntimeError("a request finished without a token")  # engine bug, not user error
    after = steps[first + 1:]
    tokens = sum(sum(t.values()) for _, t in after)
    elapsed = steps[-1][0] - steps[first][0]
    return {"time_to_all_first_tokens_s": steps[first][0] - started,
            "decode_tokens": tokens, "decode_s": elapsed, "decode_steps": len(after),
            "tok_s": tokens / elapsed if elapsed > 0 else None,
            "ms_per_step": 1e3 * elapsed / len(after) if after else None}


def run_latency(llm, settings: BenchSettings, device, log) -> dict:
    prompt_len = settings.scaled(LATENCY_PROMPT)
    new_tokens = settings.scaled(LATENCY_NEW_TOKENS, least=2)
    rng = random.Random(settings.seed)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    warm_started = time.perf_counter()
    timed_steps(llm, [random_ids(rng, prompt_len, max_token_id(llm))], params)
    warmup_s = time.perf_counter() - warm_started
    runs = [decode_numbers(*timed_steps(llm, [random_ids(rng, prompt_len, max_token_id(llm))],
                                        params), 1) for _ in range(LATENCY_RUNS)]
    tok_s = statistics.median(r["tok_s"] for r in runs)
    result = {"prompt_tokens": prompt_len, "new_tokens": new_tokens, "warmup_s": warmup_s,
              "tok_s": tok_s, "ms_per_token": 1e3 / tok_s,
              "runs_tok_s": [r["tok_s"] for r in runs],
              "ttft_ms": statistics.median(1e3 * r["time_to_all_first_tokens_s"] for r in runs),
              **bandwidth_floor(llm.config, settings.device, device.copy_bandwidth(), tok_s)}
    log(f"latency: batch 1, {prompt_len}-token prompt, {new_tokens} new tokens: {tok_s:,.1f} tok/s "
        f"({result['ms_per_token']:.3f} ms/token), {100 * result['fraction_of_floor']:.0f}% of "
        f"the bandwidth floor ({result['floor_tok_s']:,.0f} tok/s)")
    return result


def bandwidth_floor(config, device: str, bandwidth: float, tok_s: float) -> dict:
    """Bytes one decode step must read: every layer weight, the final norm and the LM head
    matrix. The embedding lookup reads one row per token, so a tied embedding counts once
    (read in full as the head) and an untied one not at all. On the GPU weights are bf16;
    the CPU backend holds float32."""
    bytes_per_param = 2 if device == "cuda" else 4
    embedding = config.vocab_size * config.hidden_size
    read_params = config.num_parameters - (0 if config.tie_word_embeddings else embedding)
    weight_bytes = read_params * bytes_per_param
    floor_s = weight_bytes / bandwidth
    return {"weight_bytes_per_step": weight_bytes, "bytes_per_parameter": bytes_per_param,
            "copy_bandwidth_bytes_s": bandwidth, "floor_ms_per_token": 1e3 * floor_s,
            "floor_tok_s": 1 / floor_s, "fraction_of_floor": tok_s * floor_s}


def run_ttft(llm, settings: BenchSettings, device, log) -> dict:
    rng = random.Random(settings.seed)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    longest = llm.engine.max_model_len - 1
    rows, warmup_s = [], 0.0
    for wanted in TTFT_LENGTHS:
        length = min(settings.scaled(wanted), longest)
        started = time.perf_counter()
        llm.generate(random_ids(rng, length, max_token_id(llm)), one)
        warmup_s += time.perf_counter() - started
        times = []
        for _ in range(TTFT_RUNS):
            prompt = random_ids(rng, length, max_token_id(llm))  # a fresh prompt: no cache hits
            started = time.perf_counter()
            llm.generate(prompt, one)
            times.append(1e3 * (time.perf_counter() - started))
        rows.append({"nominal_tokens": wanted, "prompt_tokens": length,
                     "ttft_ms": statistics.median(times), "runs_ms": times})
        log(f"ttft: {length}-token prompt: {rows[-1]['ttft_ms']:.2f} ms (median of {TTFT_RUNS})")
    return {"prompts": rows, "warmup_s": warmup_s}


def run_decode_sweep(llm, settings: BenchSettings, device, log) -> dict:
    rng = random.Random(settings.seed)
    prompt_len = settings.scaled(SWEEP_PROMPT)
    new_tokens = settings.scaled(SWEEP_NEW_TOKENS, least=2)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    top = max_token_id(llm)
    rows, warmup_s = [], 0.0
    for batch in settings.batch_sizes:
        started = time.perf_counter()
        timed_steps(llm, [random_ids(rng, prompt_len, top) for _ in range(batch)], warm)
        warmup_s += time.perf_counter() - started
        prompts = [random_ids(rng, prompt_len, top) for _ in range(batch)]
        row = {"batch": batch, **decode_numbers(*timed_steps(llm, prompts, params), batch)}
        row["one_batch"] = batch <= llm.engine_config.max_num_seqs
        rows.append(row)
        log(f"decode-sweep: batch {batch}: {_num(row['tok_s'])} tok/s "
            f"({_num(row['ms_per_step'], 2)} ms/step)")
    return {"prompt_tokens": prompt_len, "new_tokens": new_tokens, "rows": rows,
            "warmup_s": warmup_s}


OUR_MODES = {"throughput": run_throughput, "latency": run_latency, "ttft": run_ttft,
             "decode-sweep": run_decode_sweep}


# ---- the device: memory and bandwidth -----------------------------------------------------

class DeviceProbe:
    """What the report needs from the device: its name, memory in use, copy bandwidth."""

    def __init__(self, kind: str):
        self.kind = kind
        self._bandwidth = None
        if kind == "cuda":
            from .backends.cuda.device import check_cuda_device, device_name, import_cupy
            check_cuda_device()
            self.cupy = import_cupy()
            self.name = device_name(self.cupy.cuda.Device())
        else:
            self.cupy = None
            self.name = platform.processor() or platform.machine() or "cpu"

    def used_bytes(self) -> int | None:
        """Device memory in use by every process (cudaMemGetInfo); None on the CPU."""
        if self.cupy is None:
            return None
        free, total = self.cupy.cuda.runtime.memGetInfo()
        return int(total - free)

    def total_bytes(self) -> int | None:
        return None if self.cupy is None else int(self.cupy.cuda.runtime.memGetInfo()[1])

    def copy_bandwidth(self) -> float:
        """Bytes moved per second (read + write) by a large device-to-device copy, measured
        once per run."""
        if self._bandwidth is None:
            self._bandwidth = self._cuda_copy() if self.cupy is not None else self._host_copy()
        return self._bandwidth

    def _cuda_copy(self, repeats: int = 20) -> float:
        cupy = self.cupy
        nbytes = min(COPY_BYTES, cupy.cuda.runtime.memGetInfo()[0] // 4)
        src = cupy.ones(nbytes, np.uint8)
        dst = cupy.empty_like(src)
        for _ in range(3):
            dst.data.copy_from_device_async(src.data, nbytes)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(repeats):
            dst.data.copy_from_device_async(src.data, nbytes)
        end.record()
        end.synchronize()
        seconds = cupy.cuda.get_elapsed_time(start, end) / 1e3
        del src, dst
        cupy.get_default_memory_pool().free_all_blocks()
        return 2 * nbytes * repeats / seconds

    @staticmethod
    def _host_copy(nbytes: int = 64 << 20, repeats: int = 5) -> float:
        src = np.ones(nbytes, np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)
        started = time.perf_counter()
        for _ in range(repeats):
            np.copyto(dst, src)
        return 2 * nbytes * repeats / (time.perf_counter() - started)


def memory_report(llm, device: DeviceProbe, used: dict) -> dict:
    """Where the memory went: the backend's own plan, beside what the device reports."""
    backend = llm.backend
    if hasattr(backend, "memory_plan"):
        plan = [{"name": n, "bytes": int(b), "note": note} for n, b, note in backend.memory_plan()]
    else:
        plan = [{"name": "KV cache", "bytes": int(backend.kv_cache_bytes),
                 "note": f"{backend.num_kv_blocks} blocks x {backend.block_size} tokens"}]
    report = {"plan": plan, "planned_bytes": sum(row["bytes"] for row in plan),
              **{f"{k}_bytes": v for k, v in used.items()}}
    if device.cupy is not None:
        pool = device.cupy.get_default_memory_pool()
        report["device_total_bytes"] = device.total_bytes()
        report["cupy_pool_held_bytes"] = int(pool.total_bytes())
        report["cupy_pool_used_bytes"] = int(pool.used_bytes())
        # what the plan does not name: CUDA graphs, cuBLAS workspace, kernel images, pool slack
        report["unplanned_bytes"] = (used["peak_used"] - used["used_before_load"]
                                     - report["planned_bytes"])
        report["note"] = ("peak_used: the most device memory in use after load, warm-up and each "
                          "mode (cudaMemGetInfo, all processes); the memory pool keeps what it "
                          "grows to, so this is the run's peak")
    else:
        import resource
        report["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return report


def release(llm, device: DeviceProbe) -> None:
    """Frees cupy-llama's GPU memory so transformers runs with the whole device."""
    llm.engine = llm.backend = None
    gc.collect()
    if device.cupy is not None:
        device.cupy.get_default_memory_pool().free_all_blocks()


# ---- transformers -------------------------------------------------------------------------

def check_hf_available(device: str) -> None:
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        raise RequestError("--hf needs torch and transformers (pip install torch transformers); "
                           "run without --hf to skip the baseline") from None
    if device == "cuda" and not torch.cuda.is_available():
        raise DeviceError("--hf: torch cannot see a CUDA GPU (a CPU-only torch build?); install "
                          "a CUDA build of torch or run without --hf")


def run_hf(model_dir: Path, settings: BenchSettings, results: dict, log, save) -> dict:
    """Loads the model in transformers and runs each mode's workload; a failing mode is
    recorded with its error and the others still run."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    on_gpu = settings.device == "cuda"
    started = time.perf_counter()
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = model.to("cuda" if on_gpu else "cpu").eval()
    load_s = time.perf_counter() - started
    info = {"version": transformers.__version__, "load_s": load_s,
            "dtype": str(dtype).replace("torch.", ""),
            "attn_implementation": model.config._attn_implementation}
    log(f"transformers {transformers.__version__}: loaded in {load_s:.2f} s "
        f"({info['attn_implementation']} attention, {info['dtype']})")
    hf = HfRunner(model, torch, on_gpu, settings, max_token_id=min(
        THROUGHPUT_MAX_TOKEN_ID, model.config.vocab_size - 1))
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    # continuous batching (throughput) last: it switches the model's attention to paged
    for mode in sorted(settings.modes, key=lambda m: m == "throughput"):
        try:
            results[mode]["transformers"] = HF_MODES[mode](hf, results[mode]["cupy_llama"], log)
        except Exception as e:  # the baseline must not cost the numbers already measured
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            results[mode]["transformers"] = {"error": f"{type(e).__name__}: {message}"}
            log(f"transformers {mode} failed: {message}")
        save()
    if on_gpu:
        info["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        info["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    del model, hf
    gc.collect()
    return info


class HfRunner:
    """The same workloads through transformers: `generate`, and continuous batching."""

    def __init__(self, model, torch, on_gpu: bool, settings: BenchSettings, max_token_id: int):
        self.model, self.torch, self.on_gpu = model, torch, on_gpu
        self.settings, self.max_token_id = settings, max_token_id

    def sync(self) -> None:
        if self.on_gpu:
            self.torch.cuda.synchronize()

    def generate(self, prompts: list[list[int]], new_tokens: int):
        """Greedy, exactly new_tokens each (EOS cannot stop it early); prompts of one length."""
        torch = self.torch
        ids = torch.tensor(prompts, device=self.model.device)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      do_sample=False, pad_token_id=0)
        self.sync()
        if out.shape[1] - ids.shape[1] != new_tokens:
            got = out.shape[1] - ids.shape[1]
            raise RuntimeError(f"generate gave {got} tokens, not {new_tokens}")
        return out

    def timed(self, prompts, new_tokens: int) -> float:
        started = time.perf_counter()
        self.generate(prompts, new_tokens)
        return time.perf_counter() - started

    def random_prompts(self, rng, batch: int, length: int) -> list[list[int]]:
        return [random_ids(rng, length, self.max_token_id) for _ in range(batch)]

    def decode_rate(self, rng, batch: int, length: int, new_tokens: int) -> dict:
        """tok/s after the first token: (full run - a one-token run) over the tokens after
        each request's first."""
        full = self.timed(self.random_prompts(rng, batch, length), new_tokens)
        first = statistics.median(self.timed(self.random_prompts(rng, batch, length), 1)
                                  for _ in range(3))
        tokens = batch * (new_tokens - 1)
        return {"tok_s": tokens / (full - first) if full > first else None, "full_run_s": full,
                "first_token_s": first}


def hf_latency(hf: HfRunner, ours: dict, log) -> dict:
    rng = random.Random(hf.settings.seed)
    started = time.perf_counter()
    hf.generate(hf.random_prompts(rng, 1, ours["prompt_tokens"]), 8)
    warmup_s = time.perf_counter() - started
    result = {"method": "generate, batch 1, greedy", "warmup_s": warmup_s,
              **hf.decode_rate(rng, 1, ours["prompt_tokens"], ours["new_tokens"])}
    result["ms_per_token"] = 1e3 / result["tok_s"] if result["tok_s"] else None
    log(f"transformers latency: {_num(result['tok_s'], 1)} tok/s")
    return result


def hf_ttft(hf: HfRunner, ours: dict, log) -> dict:
    rng = random.Random(hf.settings.seed)
    rows = []
    for row in ours["prompts"]:
        length = row["prompt_tokens"]
        hf.generate(hf.random_prompts(rng, 1, length), 1)
        times = [1e3 * hf.timed(hf.random_prompts(rng, 1, length), 1) for _ in range(TTFT_RUNS)]
        rows.append({"prompt_tokens": length, "ttft_ms": statistics.median(times),
                     "runs_ms": times})
        log(f"transformers ttft: {length}-token prompt: {rows[-1]['ttft_ms']:.2f} ms")
    return {"method": "generate with max_new_tokens=1", "prompts": rows}


def hf_decode_sweep(hf: HfRunner, ours: dict, log) -> dict:
    rng = random.Random(hf.settings.seed)
    hf.generate(hf.random_prompts(rng, 1, ours["prompt_tokens"]), 4)
    rows = []
    for row in ours["rows"]:
        rows.append({"batch": row["batch"],
                     **hf.decode_rate(rng, row["batch"], ours["prompt_tokens"],
                                      ours["new_tokens"])})
        log(f"transformers decode-sweep: batch {row['batch']}: {_num(rows[-1]['tok_s'])} tok/s")
    return {"method": "generate, greedy, equal-length prompts (no padding)", "rows": rows}


def hf_throughput(hf: HfRunner, ours: dict, log) -> dict:
    """Continuous batching when this transformers has it (the manager behind
    `generate_batch`, given each request its own max_new_tokens, which `generate_batch`
    cannot); otherwise `generate` on padded batches."""
    work = throughput_workload(hf.settings, hf.max_token_id)
    if hf.on_gpu:
        hf.torch.cuda.empty_cache()  # continuous batching sizes its cache from the free memory
    manager_cm = getattr(hf.model, "continuous_batching_context_manager", None)
    if manager_cm is not None and _accepts(_manager_add_request(), "max_new_tokens"):
        result = _hf_continuous(hf, work, manager_cm)
    else:
        result = _hf_padded(hf, work)
    log(f"transformers throughput ({result['method']}): {result['output_tok_s']:,.0f} output tok/s")
    return result


def _manager_add_request():
    try:
        from transformers.generation.continuous_batching import ContinuousBatchingManager
    except ImportError:
        return None
    return getattr(ContinuousBatchingManager, "add_request", None)


def _accepts(fn, name: str) -> bool:
    import inspect
    if fn is None:
        return False
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _hf_continuous(hf: HfRunner, work: Workload, manager_cm) -> dict:
    from transformers import GenerationConfig
    hf.torch.manual_seed(hf.settings.seed)
    config = GenerationConfig(max_new_tokens=max(work.output_lens), do_sample=True,
                              temperature=THROUGHPUT_TEMPERATURE, top_k=0, top_p=1.0)
    config.eos_token_id = None  # continuous batching then runs with EOS disabled (-1)
    options = {"generation_config": config, "block": True, "timeout": 30}
    if _accepts(manager_cm, "workload_hints"):
        from transformers.generation.continuous_batching.utils import WorkloadHints
        hints = {"max_prompt_length": max(map(len, work.prompts)),
                 "max_generated_length": max(work.output_lens), "num_requests": len(work.prompts)}
        known = getattr(WorkloadHints, "__dataclass_fields__", hints)
        options["workload_hints"] = WorkloadHints(**{k: v for k, v in hints.items() if k in known})
    started = time.perf_counter()
    with manager_cm(**options) as manager:
        run_started = time.perf_counter()  # warm-up (graph capture) is done, the loop runs
        eos = {"eos_token_id": -1} if _accepts(manager.add_request, "eos_token_id") else {}
        for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens)):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n, **eos)
        finished = {}
        while len(finished) < len(work.prompts):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError(f"the continuous batching loop stopped after "
                                       f"{len(finished)} of {len(work.prompts)} requests")
                continue
            if result.is_finished():
                finished[result.request_id] = result
        wall_s = time.perf_counter() - run_started
    errors = [r.error for r in finished.values() if getattr(r, "error", None)]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    output_tokens = sum(len(r.generated_tokens) for r in finished.values())
    return {"method": "continuous batching (ContinuousBatchingManager, as generate_batch "
                      "uses it), per-request max_new_tokens",
            "warmup_s": run_started - started, **throughput_numbers(work, output_tokens, wall_s)}


def _hf_padded(hf: HfRunner, work: Workload, batch: int = 64) -> dict:
    """Padded `generate` in batches of similar prompt length; each batch runs to its
    longest output, and only the requested tokens count as output."""
    torch = hf.torch
    order = sorted(range(len(work.prompts)), key=lambda i: len(work.prompts[i]))
    hf.generate([work.prompts[order[0]][:8]], 2)  # warm-up
    hf.torch.manual_seed(hf.settings.seed)
    started = time.perf_counter()
    for start in range(0, len(order), batch):
        chunk = order[start:start + batch]
        width = max(len(work.prompts[i]) for i in chunk)
        new_tokens = max(work.output_lens[i] for i in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(chunk):  # left padding
            prompt = work.prompts[i]
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        with torch.no_grad():
            hf.model.generate(ids.to(hf.model.device), attention_mask=mask.to(hf.model.device),
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=True, temperature=THROUGHPUT_TEMPERATURE, top_k=0,
                              top_p=1.0, pad_token_id=0)
    hf.sync()
    wall_s = time.perf_counter() - started
    return {"method": f"generate on left-padded batches of {batch}",
            **throughput_numbers(work, sum(work.output_lens), wall_s)}


HF_MODES = {"throughput": hf_throughput, "latency": hf_latency, "ttft": hf_ttft,
            "decode-sweep": hf_decode_sweep}


def add_ratios(results: dict) -> None:
    """How many times faster cupy-llama is, per mode (None where a side is missing)."""
    def ratio(ours, theirs):
        return ours / theirs if ours and theirs else None

    for mode, sides in results.items():
        ours, theirs = sides["cupy_llama"], sides.get("transformers") or {}
        if "error" in theirs:
            continue
        if mode == "throughput":
            sides["speedup"] = ratio(ours["output_tok_s"], theirs.get("output_tok_s"))
        elif mode == "latency":
            sides["speedup"] = ratio(ours["tok_s"], theirs.get("tok_s"))
        elif mode == "ttft":
            sides["speedup"] = {str(a["prompt_tokens"]): ratio(b["ttft_ms"], a["ttft_ms"])
                                for a, b in zip(ours["prompts"], theirs.get("prompts", []))}
        elif mode == "decode-sweep":
            sides["speedup"] = {str(a["batch"]): ratio(a["tok_s"], b["tok_s"])
                                for a, b in zip(ours["rows"], theirs.get("rows", []))}


# ---- what the report says about the run ---------------------------------------------------

def commit_info(explicit: str | None) -> dict:
    """The commit: `git rev-parse HEAD` of this source tree (marked -dirty with uncommitted
    changes), else --commit, else $CUPY_LLAMA_COMMIT."""
    root = Path(__file__).resolve().parents[1]
    if (root / ".git").exists():
        try:
            head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                                  capture_output=True, text=True, timeout=10)
            status = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                     "--untracked-files=no"], capture_output=True, text=True,
                                    timeout=10)
        except (OSError, subprocess.SubprocessError):
            head = None
        if head is not None and head.returncode == 0 and head.stdout.strip():
            dirty = "-dirty" if status.returncode == 0 and status.stdout.strip() else ""
            return {"commit": head.stdout.strip() + dirty, "commit_source": "git"}
    if explicit:
        return {"commit": explicit, "commit_source": "--commit"}
    if os.environ.get("CUPY_LLAMA_COMMIT"):
        return {"commit": os.environ["CUPY_LLAMA_COMMIT"], "commit_source": "CUPY_LLAMA_COMMIT"}
    return {"commit": "unknown", "commit_source": "none"}


def environment(device: str, hf: bool) -> dict:
    from . import __version__
    env = {"cupy_llama": __version__, "python": platform.python_version(),
           "numpy": np.__version__, "platform": platform.platform()}
    if device == "cuda":
        import cupy
        env.update(cupy=cupy.__version__, cuda_runtime=cupy.cuda.runtime.runtimeGetVersion(),
                   cuda_driver=cupy.cuda.runtime.driverGetVersion())
    if hf:
        import torch
        import transformers
        env.update(torch=torch.__version__, transformers=transformers.__version__,
                   torch_cuda=torch.version.cuda)
    return env


def describe_model(llm, model_dir: Path, settings: BenchSettings, made_s) -> dict:
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return {"dir": str(model_dir), "random_preset": None if settings.model_dir else settings.preset,
            "random_seed": None if settings.model_dir else MODEL_SEED, "written_s": made_s,
            "num_parameters": llm.config.num_parameters, "config": config}


# ---- the table ----------------------------------------------------------------------------

def format_table(report: dict) -> str:
    """A short summary of the report: one row per number, both engines side by side."""
    rows = [("", "", "cupy-llama", "transformers", "speed-up")]
    results, timings = report["results"], report["timings"]
    for mode in MODES:
        if mode in results:
            rows += TABLE_ROWS[mode](results[mode])
    hf = report.get("transformers")
    columns = 5 if hf else 3
    width = [max(len(r[i]) for r in rows) for i in range(columns)]
    lines = [f"cupy-llama bench on {report['device']['name']} ({report['device']['kind']}), "
             f"commit {_short(report['commit'])}, model {_model_name(report['model'])}",
             f"load {timings['load_s']:.2f} s, warm-up {timings['warmup_s']:.2f} s"]
    if hf:
        lines.append(f"transformers {hf['version']} ({hf['attn_implementation']} attention, "
                     f"{hf['dtype']}), loaded in {hf['load_s']:.2f} s")
    for r in rows:
        cells = [f"{r[0]:<{width[0]}}", f"{r[1]:<{width[1]}}"]
        cells += [f"{r[i]:>{width[i]}}" for i in range(2, columns)]
        lines.append("  ".join(cells).rstrip())
    lines += _memory_lines(report["memory"])
    return "\n".join(lines)


def _short(commit: str) -> str:
    sha, dirty, _ = commit.partition("-dirty")
    return sha[:12] + dirty


def _model_name(model: dict) -> str:
    kind = f"random {model['random_preset']}" if model["random_preset"] else model["dir"]
    n = model["num_parameters"]
    size = f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"
    return f"{kind} ({size} parameters)"


def _num(value, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _throughput_rows(r: dict) -> list:
    ours, theirs = r["cupy_llama"], r.get("transformers") or {}
    return [("throughput", "output tok/s", _num(ours["output_tok_s"]),
             _num(theirs.get("output_tok_s")) if "error" not in theirs else "failed",
             _x(r.get("speedup"))),
            ("", "total tok/s", _num(ours["total_tok_s"]), _num(theirs.get("total_tok_s")), ""),
            ("", "requests/s", _num(ours["requests_s"], 2), _num(theirs.get("requests_s"), 2), ""),
            ("", "wall time (s)", _num(ours["wall_s"], 2), _num(theirs.get("wall_s"), 2), "")]


def _latency_rows(r: dict) -> list:
    ours, theirs = r["cupy_llama"], r.get("transformers") or {}
    return [("latency", "decode tok/s, batch 1", _num(ours["tok_s"], 1),
             _num(theirs.get("tok_s"), 1) if "error" not in theirs else "failed",
             _x(r.get("speedup"))),
            ("", "ms per token", _num(ours["ms_per_token"], 3),
             _num(theirs.get("ms_per_token"), 3), ""),
            ("", f"of the bandwidth floor ({_num(ours['floor_tok_s'])} tok/s)",
             f"{100 * ours['fraction_of_floor']:.1f}%", "", "")]


def _ttft_rows(r: dict) -> list:
    ours, theirs = r["cupy_llama"], r.get("transformers") or {}
    speedup = r.get("speedup") or {}
    theirs_ms = {row["prompt_tokens"]: row["ttft_ms"] for row in theirs.get("prompts", [])}
    return [("ttft" if i == 0 else "", f"{row['prompt_tokens']}-token prompt (ms)",
             _num(row["ttft_ms"], 2), _num(theirs_ms.get(row["prompt_tokens"]), 2),
             _x(speedup.get(str(row["prompt_tokens"]))))
            for i, row in enumerate(ours["prompts"])]


def _sweep_rows(r: dict) -> list:
    ours, theirs = r["cupy_llama"], r.get("transformers") or {}
    speedup = r.get("speedup") or {}
    theirs_rate = {row["batch"]: row["tok_s"] for row in theirs.get("rows", [])}
    return [("decode-sweep" if i == 0 else "", f"batch {row['batch']} tok/s", _num(row["tok_s"]),
             _num(theirs_rate.get(row["batch"])), _x(speedup.get(str(row["batch"]))))
            for i, row in enumerate(ours["rows"])]


TABLE_ROWS = {"throughput": _throughput_rows, "latency": _latency_rows, "ttft": _ttft_rows,
              "decode-sweep": _sweep_rows}


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _memory_lines(memory: dict) -> list[str]:
    plan = ", ".join(f"{row['name']} {_gib(row['bytes'])}" for row in memory["plan"]
                     if not row["name"].startswith("pool: "))
    pool = sum(row["bytes"] for row in memory["plan"] if row["name"].startswith("pool: "))
    if memory.get("peak_used_bytes") is not None:
        return [f"memory: peak {_gib(memory['peak_used_bytes'])} in use on the device "
                f"({_gib(memory['used_before_load_bytes'])} before load): {plan}, buffers "
                f"{_gib(pool)}, other {_gib(memory['unplanned_bytes'])} (CUDA graphs, cuBLAS, "
                "kernels)"]
    return [f"memory: peak RSS {_gib(memory.get('peak_rss_bytes'))}: {plan}"]


def bench_command(mode: str, *, model_dir, device, preset, json_path, hf, seed, num_requests,
                  scale, batch_sizes: str, commit, engine: dict, out=print) -> dict:
    """The `cupy-llama bench` command: parse, run, print the table."""
    try:
        sizes = tuple(int(part) for part in batch_sizes.split(",") if part.strip())
    except ValueError:
        raise RequestError(f"--batch-sizes must be comma-separated integers, "
                           f"got {batch_sizes!r}") from None
    settings = BenchSettings(mode=mode, model_dir=model_dir, preset=preset, device=device,
                             seed=seed, num_requests=num_requests, scale=scale,
                             batch_sizes=sizes, hf=hf, json_path=json_path, commit=commit,
                             engine=engine)
    report = run_bench(settings)
    out(format_table(report))
    return report
