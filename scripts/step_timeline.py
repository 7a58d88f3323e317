"""Where an engine's decode step goes, on the GPU: the wall time of each step beside what
the GPU and the host did in it.

    python3 scripts/step_timeline.py MODEL_DIR [--batches 128,256] [--repeats 2]
        [--token-ids] [--num-kv-blocks N] [--repo CHECKOUT] [--label NAME] [--json PATH]

The workload is `bench decode-sweep`'s: each batch size's requests (random prompts of
--prompt tokens, greedy, --new-tokens each, EOS ignored) added at once and stepped with
LLMEngine.step() until they finish, after a short warm-up at that batch size. The
requests are streamed with text (a detokenized token a step each), or with --token-ids
make token ids only, as `bench latency` and `decode-sweep` add theirs. For every steady
step (each request got a token, the step a replayed decode graph) followed by another,
it records:

  wall          host clock from the end of this step() to the end of the next
  gpu graph     CUDA events on the step's stream around DecodeGraphs.run: from the point
                the replay was queued (after whatever was queued before it) to the
                replay's end, its wait for the step's metadata included
  gpu sample    from the replay's end to the end of what sample_async queued
  gpu gap       from that end to the next step's replay point: the GPU waiting for the
                host (0 while the host keeps ahead)
  host busy     step()'s host time less its wait for the step's tokens: scheduling,
                staging, the launches and the step's outputs
  host wait     that wait (PendingTokens.get)

and prints the medians per batch size and repeat. A step is the host's when host busy
exceeds gpu graph + gpu sample: the wait drops to about nothing and the gap grows. In
such a step the replay's clock also holds the host's staging (its start is recorded
before the host stages the metadata), so host_bound_steps, which counts them, is a
lower bound.

--repo runs another checkout's package (the events wrap the same methods there).
--metadata-on-step-stream (this checkout only) copies a replay's metadata on the step's
stream right before its graph, as before docs/ARCHITECTURE.md's decision 8 moved it
beside the step before: an ablation."""
from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

MAX_PROMPT_ID = 120_000  # below every Llama 3 special token
THIS_CHECKOUT = Path(__file__).resolve().parent.parent


class Package:
    """The modules of the checkout that runs, imported once its path is known."""

    def __init__(self, checkout: Path):
        sys.path.insert(0, str(checkout))
        import cupy
        import cupy_llama
        from cupy_llama.llm import LLM
        from cupy_llama.sampling import SamplingParams
        from cupy_llama.backends.cuda import graphs, ops
        from cupy_llama.engine.llm_engine import LLMEngine
        self.cupy, self.LLM, self.SamplingParams = cupy, LLM, SamplingParams
        self.takes_text = "text" in inspect.signature(LLMEngine.add_request).parameters
        self.graphs, self.ops = graphs, ops
        self.location = str(Path(cupy_llama.__file__).resolve().parent)


class StepMarks:
    """What the wrapped methods saw during the current step()."""

    def __init__(self):
        self.current: dict = {}

    def wrap(self, package: Package) -> None:
        marks, cupy = self.current, package.cupy
        graphs, ops = package.graphs, package.ops
        replay, sample, wait = (graphs.DecodeGraphs.run, ops.CudaOps.sample_async,
                                ops.PendingTokens.get)

        def timed_replay(decode_graphs, *args, **kwargs):
            queued, replayed = cupy.cuda.Event(), cupy.cuda.Event()
            queued.record()
            logits = replay(decode_graphs, *args, **kwargs)
            replayed.record()
            marks["replay"] = (queued, replayed)
            return logits

        def timed_sample(cuda_ops, *args, **kwargs):
            pending = sample(cuda_ops, *args, **kwargs)
            sampled = cupy.cuda.Event()
            sampled.record()
            marks["sampled"] = sampled
            return pending

        def timed_wait(pending):
            started = time.perf_counter()
            try:
                return wait(pending)
            finally:
                marks["wait_s"] = marks.get("wait_s", 0.0) + time.perf_counter() - started

        graphs.DecodeGraphs.run = timed_replay
        ops.CudaOps.sample_async = timed_sample
        ops.PendingTokens.get = timed_wait


def metadata_on_step_stream(package: Package) -> None:
    """DecodeGraphs.run with its metadata copied on the step's stream, right before the
    replay (the order before the copy moved to a stream of its own)."""
    cupy = package.cupy

    def run(graphs, batch):
        if not graphs.can_run(batch):
            raise ValueError("not a decode batch the graphs hold")
        bucket = graphs.bucket_for(batch.num_seqs)
        limit = graphs.limit_for(bucket, batch.max_seq_len)
        graph, logits = graphs._graphs.get((bucket, limit)) or graphs.capture(bucket, limit)
        stream = cupy.cuda.get_current_stream()
        graphs._stage(batch, bucket)
        graph.launch(stream)
        graphs._replayed.record(stream)
        return logits[:batch.num_seqs]
    package.graphs.DecodeGraphs.run = run


def run_batch(package: Package, llm, marks: StepMarks, batch: int, args, rng) -> dict:
    engine, cupy = llm.engine, package.cupy
    params = package.SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    extra = {"text": False} if args.token_ids else {}
    for _ in range(batch):
        prompt = [rng.randrange(1, MAX_PROMPT_ID) for _ in range(args.prompt)]
        engine.add_request(prompt, replace(params), **extra)
    steps = []
    while engine.has_unfinished_requests():
        marks.current.clear()
        started = time.perf_counter()
        outputs = engine.step()
        ended = time.perf_counter()
        tokens = sum(len(o.delta_token_ids) for o in outputs)
        steady = tokens == batch and "replay" in marks.current and "sampled" in marks.current
        steps.append({"started": started, "ended": ended, "steady": steady, **marks.current})
    cupy.cuda.Device().synchronize()
    series = {name: [] for name in ("wall_ms", "gpu_graph_ms", "gpu_sample_ms", "gpu_gap_ms",
                                    "host_busy_ms", "host_wait_ms")}
    for step, after in zip(steps, steps[1:]):  # consecutive steps, both steady
        if not (step["steady"] and after["steady"]):
            continue
        queued, replayed = step["replay"]
        wait_ms = 1e3 * step.get("wait_s", 0.0)
        series["wall_ms"].append(1e3 * (after["ended"] - step["ended"]))
        series["gpu_graph_ms"].append(cupy.cuda.get_elapsed_time(queued, replayed))
        series["gpu_sample_ms"].append(cupy.cuda.get_elapsed_time(replayed, step["sampled"]))
        series["gpu_gap_ms"].append(cupy.cuda.get_elapsed_time(step["sampled"], after["replay"][0]))
        series["host_busy_ms"].append(1e3 * (step["ended"] - step["started"]) - wait_ms)
        series["host_wait_ms"].append(wait_ms)
    if not series["wall_ms"]:
        raise SystemExit(f"batch {batch}: no two steady steps in a row; give more --new-tokens")
    row = {"batch": batch, "timed_steps": len(series["wall_ms"])}
    row.update({name: statistics.median(values) for name, values in series.items()})
    gaps = sorted(series["gpu_gap_ms"])
    row["gpu_gap_p90_ms"] = gaps[int(0.9 * (len(gaps) - 1))]
    row["host_bound_steps"] = sum(busy > graph + sample for busy, graph, sample in zip(
        series["host_busy_ms"], series["gpu_graph_ms"], series["gpu_sample_ms"]))
    return row


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"step_timeline.py: {message}\n")


def int_list(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"give batch sizes of at least 1, got {text!r}")
    return values


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def main() -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--batches", type=int_list, default=[128, 256])
    parser.add_argument("--repeats", type=positive, default=2, help="timed runs per batch size")
    parser.add_argument("--prompt", type=positive, default=128, help="prompt tokens")
    parser.add_argument("--new-tokens", type=positive, default=128)
    parser.add_argument("--token-ids", action="store_true",
                        help="requests make token ids only (add_request's text=False)")
    parser.add_argument("--num-kv-blocks", type=positive, help="the engine's KV cache blocks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repo", type=Path,
                        help="the checkout whose package runs (default: this one)")
    parser.add_argument("--metadata-on-step-stream", action="store_true",
                        help="ablation: the replay's metadata copied on the step's stream")
    parser.add_argument("--label", default="", help="a name for this run in the output")
    parser.add_argument("--json", help="write the rows here (default: $OUT/step_timeline.json "
                                       "where $OUT is set, else nowhere)")
    args = parser.parse_args()
    checkout = THIS_CHECKOUT if args.repo is None else args.repo.resolve()
    if not (checkout / "cupy_llama" / "__init__.py").is_file():
        parser.error(f"--repo {args.repo}: no cupy_llama package there")
    if args.metadata_on_step_stream and args.repo is not None:
        parser.error("--metadata-on-step-stream patches this checkout's graphs.py only")
    try:
        package = Package(checkout)
    except ImportError as error:
        parser.exit(1, f"step_timeline.py: {error}; it needs CuPy and a CUDA GPU\n")
    if args.token_ids and not package.takes_text:
        parser.error(f"--token-ids: {package.location}'s add_request has no text argument")
    if args.metadata_on_step_stream:
        metadata_on_step_stream(package)
    marks = StepMarks()
    marks.wrap(package)
    options = {} if args.num_kv_blocks is None else {"num_kv_blocks": args.num_kv_blocks}
    llm = package.LLM(args.model_dir, device="cuda", log=None, max_num_seqs=max(args.batches),
                      **options)
    rng = random.Random(args.seed)
    warm = package.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    rows = []
    for batch in args.batches:
        llm.generate([[rng.randrange(1, MAX_PROMPT_ID) for _ in range(8)] for _ in range(batch)], warm)
        for repeat in range(args.repeats):
            row = {"label": args.label, "repeat": repeat,
                   **run_batch(package, llm, marks, batch, args, rng)}
            rows.append(row)
            print(" ".join(f"{key} {value:.3f}" if isinstance(value, float) else f"{key} {value}"
                           for key, value in row.items()), flush=True)
    # (this checkout's bench.report.output_json_path, which --repo's package may lack)
    out = args.json or (os.path.join(os.environ["OUT"], "step_timeline.json")
                        if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps({
            "argv": sys.argv[1:], "package": package.location,
            "device": package.cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
            "kv_blocks": llm.engine.runner.backend.num_kv_blocks, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
