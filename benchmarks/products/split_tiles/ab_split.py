"""The graph-replayed decode step with the few-tile plain products split among a
cluster's blocks (gemm.split_parts of split_tiles.patch) against whole tiles
(SPLIT_MAX_TILE_SHARE = 0) and the wide block for every few-tile plain product
(WIDE_MIN_K = 0), on one loaded model, three alternating rounds. Runs on a tree with the
patch applied (it applies to b835eec):

    git apply benchmarks/products/split_tiles/split_tiles.patch
    python3 scripts/make_random_model.py /tmp/qwen2.5 --preset qwen2.5-1.5b
    python3 benchmarks/products/split_tiles/ab_split.py /tmp/qwen2.5 out.json whole split wide
"""
import json
import sys

import cupy
import numpy as np

sys.path.insert(0, "scripts")
import perf  # noqa: E402
from cupy_llama.backends.cuda import gemm  # noqa: E402
from cupy_llama.backends.cuda.backend import CudaBackend  # noqa: E402
from cupy_llama.models import model_for, read_config  # noqa: E402
from cupy_llama.weights import open_checkpoint  # noqa: E402

BATCHES = (1, 2, 4, 8, 16)
CONTEXTS = (160, 512)
# name -> (SPLIT_MAX_TILE_SHARE, WIDE_MIN_K); argv[3:] picks some
VARIANTS = {"whole": (0.0, gemm.WIDE_MIN_K), "split": (gemm.SPLIT_MAX_TILE_SHARE, gemm.WIDE_MIN_K),
            "wide": (0.0, 0)}

model_dir, out = sys.argv[1], sys.argv[2]
chosen = sys.argv[3:] or ["whole", "split"]
config = read_config(model_dir)
checkpoint = open_checkpoint(model_dir, model_for(config))
backend = CudaBackend(model_for(config), checkpoint, max_model_len=2048, max_num_seqs=16,
                      max_num_batched_tokens=4096, block_size=16, num_kv_blocks=16 * 128,
                      log=lambda message: None)
checkpoint.close()
backend._kv.fill(0)

rng = np.random.default_rng(0)
step_ms = {}
for _ in range(3):
    for name in chosen:
        gemm.SPLIT_MAX_TILE_SHARE, gemm.WIDE_MIN_K = VARIANTS[name]
        gemm._mma_shapes.clear()
        backend.use_switches(backend.switches)  # drops the captured graphs
        for context in CONTEXTS:
            for b in BATCHES:
                batch = perf.decode_batch(b, context, 16, 128, rng)
                step_ms.setdefault(f"{name} b={b} context={context}", []).append(
                    perf.event_time(cupy, lambda: backend.forward(batch), runs=30))
print(model_dir)
medians = {key: float(np.median(values)) for key, values in step_ms.items()}
for context in CONTEXTS:
    for b in BATCHES:
        base = medians[f"{chosen[0]} b={b} context={context}"]
        print(f"b={b} context={context}: " + ", ".join(
            f"{name} {medians[f'{name} b={b} context={context}']:.4f} ms "
            f"({100 * (medians[f'{name} b={b} context={context}'] / base - 1):+.1f}%)"
            for name in chosen))
with open(out, "w") as f:
    json.dump({"model": model_dir, "gpu": gemm.device_name(), "variants": chosen,
               "step_ms": step_ms, "medians": medians}, f, indent=1)
