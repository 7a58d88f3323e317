"""Few-tile plain products, graph-timed per call with their weights read from HBM (as
scripts/perf.py's kernel comparison), accumulating into a float32 out as o_proj and down
do, under four launch rules: "whole" (the default before split tiles: the wide 16-warp
block from K = 4,096, else 8 warps), "eight" (8 warps always), "wide" (16 warps always)
and "split" (8-warp blocks, two a tile in a cluster). Runs on a tree with
split_tiles.patch applied (it applies to b835eec):

    git apply benchmarks/products/split_tiles/split_tiles.patch
    python3 benchmarks/products/split_tiles/split_micro.py out.json
"""
import json
import sys

import cupy
import numpy as np

sys.path.insert(0, "scripts")
import perf  # noqa: E402
from cupy_llama.backends.cuda import gemm  # noqa: E402

SHAPES = {"qwen2.5 o": (1536, 1536), "qwen2.5 down": (1536, 8960),
          "qwen3 o": (1024, 2048), "qwen3 down": (1024, 3072),
          "gemma3 o": (1152, 1024), "gemma3 down": (1152, 6912),
          "llama o": (2048, 2048), "llama down": (2048, 8192)}
ROWS = (1, 2, 4, 8, 16)
RULES = {"whole": (0.0, 4096), "eight": (0.0, 1 << 30), "wide": (0.0, 0), "split": (1e9, 4096)}

l2_bytes = cupy.cuda.Device().attributes.get("L2CacheSize", 50 << 20)
results = []
for name, (n, k) in SHAPES.items():
    weights = perf.weight_copies(cupy, n, k, l2_bytes)
    for m in ROWS:
        x = cupy.full((m, k), 0x3F80, np.uint16)
        out = cupy.zeros((m, n), np.float32)
        row = {"product": name, "n": n, "k": k, "m": m}
        for _ in range(2):  # two rounds, alternating
            for rule, (share, wide_min_k) in RULES.items():
                gemm.SPLIT_MAX_TILE_SHARE, gemm.WIDE_MIN_K = share, wide_min_k
                gemm._mma_shapes.clear()
                us = perf.graph_us_per_call(
                    cupy, lambda w: gemm.mma(x, w, out, programmatic=True, clusters=True,
                                             accumulate=True), weights)
                row.setdefault(rule, []).append(us)
        results.append(row)
        timings = " ".join(f"{rule} {min(row[rule]):6.2f}" for rule in RULES)
        print(f"{name:13s} m={m:2d} {timings}", flush=True)
    del weights
with open(sys.argv[1], "w") as f:
    json.dump({"gpu": gemm.device_name(), "rules": RULES, "us_per_call": results}, f, indent=1)
