"""Where a decode step of the engine goes at batch 128 and 256 (prompt 128, 128 new tokens,
greedy): wall per step, and on the GPU, per step, the replay (from the point the step's
graph was queued, its metadata wait included), the sampling, and the gap before the next
step. Runs whichever checkout is on PYTHONPATH.  python3 first_form.py MODEL LABEL OUT.json
STAGE_INLINE=1 (main only): the decode replay's metadata copied on the step's stream, as 5a3c064 did."""
import json
import os
import random
import statistics
import sys
import time

import cupy
from cupy_llama.llm import LLM
from cupy_llama.sampling import SamplingParams
from cupy_llama.backends.cuda import graphs as graphs_mod
from cupy_llama.backends.cuda import ops as ops_mod

model, label, out = sys.argv[1:4]
marks = []  # per step: dict
current = {}


def wrap_run(original):
    def run(self, *args, **kwargs):
        e0 = cupy.cuda.Event()
        e0.record()
        result = original(self, *args, **kwargs)
        e1 = cupy.cuda.Event()
        e1.record()
        current["graph"] = (e0, e1)
        return result
    return run


if os.environ.get("STAGE_INLINE") == "1":
    def staged_inline(self, batch):
        bucket = self.bucket_for(batch.num_seqs)
        limit = self.limit_for(bucket, batch.max_seq_len)
        graph, logits = self._graphs.get((bucket, limit)) or self.capture(bucket, limit)
        stream = cupy.cuda.get_current_stream()
        self._stage(batch, bucket)
        graph.launch(stream)
        self._replayed.record(stream)
        return logits[:batch.num_seqs]
    graphs_mod.DecodeGraphs.run = staged_inline
graphs_mod.DecodeGraphs.run = wrap_run(graphs_mod.DecodeGraphs.run)

original_sample = ops_mod.CudaOps.sample_async


def sample_async(self, *args, **kwargs):
    started = time.perf_counter()
    result = original_sample(self, *args, **kwargs)
    current["sample_host_s"] = time.perf_counter() - started
    e2 = cupy.cuda.Event()
    e2.record()
    current["sampled"] = e2
    return result


ops_mod.CudaOps.sample_async = sample_async
original_get = ops_mod.PendingTokens.get


def get(self):
    started = time.perf_counter()
    result = original_get(self)
    current["wait_s"] = current.get("wait_s", 0.0) + time.perf_counter() - started
    return result


ops_mod.PendingTokens.get = get

options = {"num_kv_blocks": int(os.environ["KV_BLOCKS"])} if os.environ.get("KV_BLOCKS") else {}
llm = LLM(model, device="cuda", log=None, **options)
engine = llm.engine
rng = random.Random(0)


def prompts(n, length):
    return [[rng.randrange(1, 120000) for _ in range(length)] for _ in range(n)]


results = {"label": label, "kv_blocks_option": options, "stage_inline": os.environ.get("STAGE_INLINE") == "1", "rows": []}
for batch in (128, 256):
    llm.generate(prompts(batch, 8), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    for repeat in range(2):
        ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
               for p in prompts(batch, 128)]
        steps, pages = [], None
        while engine.has_unfinished_requests():
            if pages is None and len(engine.scheduler.running) == batch:
                blocks = [b for seq in engine.scheduler.running for b in seq.block_table]
                pages = {"blocks": len(blocks), "lowest": min(blocks), "highest": max(blocks),
                         "pages_2mib": len({b // 128 for b in blocks})}
            current.clear()
            started = time.perf_counter()
            outputs = engine.step()
            ended = time.perf_counter()
            steps.append({"t0": started, "t1": ended, "n": sum(len(o.delta_token_ids) for o in outputs),
                          **current})
        cupy.cuda.Device().synchronize()
        steady = [s for s in steps if s["n"] == batch and "graph" in s]
        wall, graph, sample, gap, host, wait, sample_host = [], [], [], [], [], [], []
        for a, b in zip(steady, steady[1:]):
            wall.append(1e3 * (b["t1"] - a["t1"]))
            e0, e1 = a["graph"]
            graph.append(cupy.cuda.get_elapsed_time(e0, e1))
            sample.append(cupy.cuda.get_elapsed_time(e1, a["sampled"]))
            gap.append(cupy.cuda.get_elapsed_time(a["sampled"], b["graph"][0]))
            wait.append(1e3 * a.get("wait_s", 0.0))
            host.append(1e3 * (a["t1"] - a["t0"]) - 1e3 * a.get("wait_s", 0.0))
            sample_host.append(1e3 * a["sample_host_s"])
        med = {k: statistics.median(v) for k, v in (
            ("wall_ms", wall), ("gpu_graph_ms", graph), ("gpu_sample_ms", sample),
            ("gpu_gap_ms", gap), ("host_busy_ms", host), ("host_wait_ms", wait),
            ("host_sample_async_ms", sample_host))}
        row = {"batch": batch, "repeat": repeat, "steady_steps": len(steady), **med,
               "gap_p90_ms": sorted(gap)[int(0.9 * len(gap))] if gap else None,
               "kv": pages, "kv_blocks_total": engine.runner.backend.num_kv_blocks}
        results["rows"].append(row)
        print(label, json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
              flush=True)
with open(out, "w") as f:
    json.dump(results, f, indent=1)
