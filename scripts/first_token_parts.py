"""Where a first token's time goes, in one command on the GPU machine:

    python3 scripts/first_token_parts.py MODEL_DIR [--lengths 128,1024,4096] [--runs 7]

For each prompt length, greedy requests of max_tokens=1 through LLM.generate, as `bench
ttft` makes them (fresh random prompts: no prefix-cache hits), timed in parts (medians
of --runs):
  wall          LLM.generate from call to return: `bench ttft`'s number
  forward host  the host's time inside the backend's forward call (staging the batch,
                replaying the step graphs and launching attention between them)
  forward span  GPU time from the forward's first piece of work to its last, as it ran:
                where the host launches slower than the GPU runs, the GPU waits in it
  forward GPU   the same forward with its work queued behind a spin kernel first, so the
                GPU never waits for the host: what the GPU needs for the step
  sampling      GPU time from the forward's end to the sampled token's (span runs)
and the rest of wall, which is the host's: scheduling, the step's host arrays, reading
the token back and the request's output. JSON to $OUT/first_token_parts.json (or --json).
--cprofile N: then the host's top N functions (own time) over --runs more requests of each
length, with nothing timed but the profile."""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout's package
from cupy_llama.bench.report import output_json_path, write_report  # noqa: E402
from cupy_llama import LLM, SamplingParams  # noqa: E402
from cupy_llama.bench.offline import max_token_id  # noqa: E402
from cupy_llama.bench.workloads import random_ids  # noqa: E402

SPIN_CYCLES = 40_000_000  # ~20 ms at 2 GHz: longer than the host needs to queue a step
SPIN_SOURCE = r"""
extern "C" __global__ void spin_kernel(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


class ForwardClock:
    """Wraps the backend's forward and the sampling launch: host time in the forward, and
    CUDA events at the forward's start, its end and the sampling's end."""

    def __init__(self, backend):
        import cupy
        self.cupy, self.backend = cupy, backend
        self.spin = cupy.RawKernel(SPIN_SOURCE, "spin_kernel")
        self.spin_first = False
        self.records = []
        forward, sample = backend.forward, backend.ops.sample_async

        def timed_forward(batch, *rest):
            if self.spin_first:
                self.spin((1,), (1,), (np.int64(SPIN_CYCLES),))
            start = self.event()
            began = time.perf_counter()
            logits = forward(batch, *rest)
            host = time.perf_counter() - began
            self.records.append({"start": start, "end": self.event(), "host_s": host})
            return logits

        def timed_sample(*args, **kwargs):
            sampled = sample(*args, **kwargs)
            self.records[-1]["sampled"] = self.event()
            return sampled

        backend.forward, backend.ops.sample_async = timed_forward, timed_sample

    def event(self):
        event = self.cupy.cuda.Event()
        event.record()
        return event


def ms(start, end) -> float:
    end.synchronize()
    from cupy.cuda import get_elapsed_time
    return get_elapsed_time(start, end)


def measure(llm, clock: ForwardClock, length: int, runs: int, rng) -> dict:
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    top = max_token_id(llm)  # ids that are no special token, as bench ttft's

    def prompt():
        return random_ids(rng, length, top)

    llm.generate(prompt(), one)  # warm-up
    walls, hosts, spans, samplings, gpus = [], [], [], [], []
    for _ in range(runs):
        clock.records.clear()
        clock.spin_first = False
        ids = prompt()
        began = time.perf_counter()
        llm.generate(ids, one)
        walls.append(1e3 * (time.perf_counter() - began))
        (record,) = clock.records  # one step: the whole prompt and its token
        hosts.append(1e3 * record["host_s"])
        spans.append(ms(record["start"], record["end"]))
        samplings.append(ms(record["end"], record["sampled"]))
        clock.records.clear()
        clock.spin_first = True
        llm.generate(prompt(), one)
        gpus.append(ms(clock.records[0]["start"], clock.records[0]["end"]))
    clock.spin_first = False
    parts = {"wall_ms": walls, "forward_host_ms": hosts, "forward_span_ms": spans,
             "forward_gpu_ms": gpus, "sampling_ms": samplings}
    result = {name: statistics.median(values) for name, values in parts.items()}
    result["rest_ms"] = result["wall_ms"] - result["forward_span_ms"] - result["sampling_ms"]
    result["runs"] = parts
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--lengths", default="128,1024,4096")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N")
    args = parser.parse_args()
    llm = LLM(args.model_dir, device="cuda")
    clock = ForwardClock(llm.engine.backend)
    rng = random.Random(args.seed)
    report = {}
    for length in (int(n) for n in args.lengths.split(",")):
        r = report[length] = measure(llm, clock, length, args.runs, rng)
        print(f"{length:5d} tokens: wall {r['wall_ms']:.2f} ms = forward span "
              f"{r['forward_span_ms']:.2f} (GPU alone {r['forward_gpu_ms']:.2f}, host in it "
              f"{r['forward_host_ms']:.2f}) + sampling {r['sampling_ms']:.2f} + the rest "
              f"{r['rest_ms']:.2f}", flush=True)
    if args.cprofile:
        import cProfile
        import pstats
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        for length in (int(n) for n in args.lengths.split(",")):
            prompts = [random_ids(rng, length, max_token_id(llm)) for _ in range(args.runs)]
            profile = cProfile.Profile()
            profile.enable()
            for ids in prompts:
                llm.generate(ids, one)
            profile.disable()
            print(f"== {length} tokens: the host's functions over {args.runs} requests ==")
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.cprofile)
    path = output_json_path(args.json, "first_token_parts.json")
    if path:
        write_report(path, report)


if __name__ == "__main__":
    main()
