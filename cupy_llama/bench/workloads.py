"""The settings and workloads of `cupy-llama bench`, shared by its runners: the engine's
modes (bench.py), the transformers baselines (bench_hf.py) and the server's load
(bench_serve.py). See bench.py for what each mode measures."""
from __future__ import annotations

import os
import random
import shlex
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import OptionError, check_output_path, option_flag

MODES = ("throughput", "latency", "ttft", "decode-sweep")  # the ones `all` runs
ALL_MODES = MODES + ("all", "prefix")
DEVICES = ("auto", "cuda", "cpu")
# the shapes of random_model.PRESETS, named here so the command line can offer them without
# importing NumPy (tests/test_bench.py checks the two agree)
PRESETS = ("llama-3.2-1b", "qwen3-0.6b", "qwen2.5-1.5b", "gemma-3-1b", "gemma-3-4b", "tiny")
DEFAULT_PRESETS = {"cuda": "llama-3.2-1b", "cpu": "tiny"}
DEFAULT_BATCH_SIZES = (1, 8, 32, 64, 128, 256)
MODEL_SEED = 0                  # random weights: the same model for every workload seed
THROUGHPUT_LENGTHS = (100, 1024)
THROUGHPUT_MAX_TOKEN_ID = 10000
THROUGHPUT_TEMPERATURE = 0.6    # nano-vllm's bench samples; the other modes are greedy
LATENCY_PROMPT, LATENCY_NEW_TOKENS, LATENCY_RUNS = 32, 256, 3
TTFT_LENGTHS, TTFT_RUNS = (128, 1024, 4096), 5
SWEEP_PROMPT, SWEEP_NEW_TOKENS = 128, 128
PREFIX_REQUESTS, PREFIX_SHARED, PREFIX_SUFFIX, PREFIX_NEW_TOKENS = 64, 2048, 64, 32
CHAT_TURNS, CHAT_MESSAGE, CHAT_REPLY = 10, 100, 32
CUDA_MAX_NUM_SEQS = 256         # the sweep's largest batch decodes as one batch
HEARTBEAT_S = 10.0              # a line this often while a random model is being written


# ---- settings -----------------------------------------------------------------------------

@dataclass
class BenchSettings:
    mode: str
    model_dir: str | None = None
    preset: str | None = None     # default: DEFAULT_PRESETS of the device
    device: str = "cuda"          # "auto" only until bench_command resolves it
    seed: int = 0
    num_requests: int = 256
    scale: float = 1.0            # multiplies every prompt and output length (quick checks)
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    hf: bool = False
    json_path: str | None = None
    commit: str | None = None
    engine: dict = field(default_factory=dict)  # EngineConfig options the user set

    def __post_init__(self):
        if self.mode not in ALL_MODES:
            raise OptionError(f"mode must be one of {', '.join(ALL_MODES)}, got {self.mode!r}")
        if self.mode == "prefix" and self.hf:
            raise OptionError("bench prefix has no transformers baseline; drop --hf")
        if self.mode == "prefix" and self.engine.get("enable_prefix_caching") is False:
            raise OptionError("bench prefix runs with prefix caching on and then off itself; "
                              "drop --no-prefix-caching")
        if self.device not in DEVICES:
            raise OptionError(f"--device must be one of {', '.join(DEVICES)}, got "
                              f"{self.device!r}")
        if self.preset is None and self.device in DEFAULT_PRESETS:
            self.preset = DEFAULT_PRESETS[self.device]
        if self.preset is not None and self.preset not in PRESETS:
            raise OptionError(f"--preset must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        if self.num_requests < 1:
            raise OptionError(f"--num-requests must be at least 1, got {self.num_requests}")
        if not 0 < self.scale <= 1:
            raise OptionError(f"--scale must be in (0, 1], got {self.scale}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise OptionError(f"--batch-sizes must be positive integers, got "
                              f"{','.join(map(str, self.batch_sizes))}")
        if self.seed < 0:
            raise OptionError(f"--seed must be >= 0, got {self.seed}")
        if self.json_path is not None:
            check_output_path(self.json_path, "--json")

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
            if name == "enable_prefix_caching":
                args += [] if value else ["--no-prefix-caching"]
                continue
            flag = option_flag(name)
            args += [flag] if value is True else [flag, str(value)]
        args += ["--hf"] if self.hf else []
        args += ["--json", self.json_path] if self.json_path else []
        return shlex.join(args)


def prepare_model(settings: BenchSettings, log) -> tuple[Path, float | None]:
    """The model directory: --model, else a seeded random model of the preset's shape,
    written once into the cache (returns its path and how long writing took, or None)."""
    if settings.model_dir:
        return Path(settings.model_dir).expanduser(), None
    from ..cache import cache_dir
    target = cache_dir() / "bench-models" / f"{settings.preset}-seed{MODEL_SEED}"
    if (target / ".complete").is_file():
        return target, None
    from ..models import config_from_dicts
    from .random_model import PRESETS as SHAPES, config_json, make_random_model
    num_parameters = config_from_dicts(config_json(SHAPES[settings.preset])).num_parameters
    log(f"writing a random {settings.preset} model ({_amount(num_parameters, '')} parameters, "
        f"{_amount(2 * num_parameters, 'B')} of bf16 weights) to {target}; this happens once, "
        "later runs reuse it")
    started = time.perf_counter()
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    try:
        with heartbeat(log, f"writing the random {settings.preset} model"):
            make_random_model(partial, settings.preset, seed=MODEL_SEED)
        (partial / ".complete").write_text("")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target, time.perf_counter() - started


def _amount(n: float, unit: str) -> str:
    """1.24 B, 2.47 GB, 0.11 M, 0.23 MB: the size of a model to a reader."""
    if n >= 1e9:
        return f"{n / 1e9:.2f} {'G' + unit if unit else 'B'}"
    return f"{n / 1e6:.2f} M{unit}"


@contextmanager
def heartbeat(log, what: str, interval: float | None = None):
    """Logs "still <what> (N s so far)" every interval seconds (HEARTBEAT_S) while the
    block runs, so a long silent step shows it is alive."""
    interval = HEARTBEAT_S if interval is None else interval
    done = threading.Event()
    started = time.perf_counter()

    def beat():
        while not done.wait(interval):
            log(f"still {what} ({time.perf_counter() - started:.0f} s so far)")

    thread = threading.Thread(target=beat, name="bench-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def random_ids(rng: random.Random, length: int, top: int) -> list[int]:
    return [rng.randint(0, top) for _ in range(length)]



# ---- workloads ---------------------------------------------------------------------------

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


def throughput_numbers(work: Workload, output_tokens: int, wall_s: float) -> dict:
    prompt_tokens = sum(len(p) for p in work.prompts)
    return {"num_requests": len(work.prompts), "prompt_tokens": prompt_tokens,
            "requested_output_tokens": sum(work.output_lens), "output_tokens": output_tokens,
            "wall_s": wall_s, "output_tok_s": output_tokens / wall_s,
            "total_tok_s": (prompt_tokens + output_tokens) / wall_s,
            "requests_s": len(work.prompts) / wall_s, "temperature": THROUGHPUT_TEMPERATURE}
