"""The graph-replayed decode step with the q/k head norms fused into the qkv product's
epilogue (EPI_ROPE_NORM, head_norm_epilogue.patch) against the composed ops (norm and
product, then the head-norm RoPE kernel), on one loaded model, three alternating rounds,
context 512, batches 1 to 16. Runs on a tree with the patch applied:

    git apply benchmarks/products/head_norm_tried/head_norm_epilogue.patch
    python3 scripts/make_random_model.py /tmp/qwen3 --preset qwen3-0.6b
    python3 benchmarks/products/head_norm_tried/ab_head_norm.py /tmp/qwen3 out.json
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
HEAD_NORM_ARG = 12  # norm_qkv_rope's head_norm, when passed by position

model_dir, out = sys.argv[1], sys.argv[2]
config = read_config(model_dir)
checkpoint = open_checkpoint(model_dir, model_for(config))
backend = CudaBackend(model_for(config), checkpoint, max_model_len=2048, max_num_seqs=16,
                      max_num_batched_tokens=4096, block_size=16, num_kv_blocks=16 * 128,
                      log=lambda message: None)
checkpoint.close()
backend._kv.fill(0)

fused_product = gemm.Products.norm_qkv_rope
fuse = [True]
calls = {"fused": 0, "declined": 0}


def norm_qkv_rope(self, *args, **kwargs):
    """The patched product, or False (the caller composes the ops) while fuse is off."""
    head_norm = args[HEAD_NORM_ARG] if len(args) > HEAD_NORM_ARG else kwargs.get("head_norm")
    if head_norm is not None and not fuse[0]:
        return False
    done = fused_product(self, *args, **kwargs)
    if head_norm is not None:
        calls["fused" if done else "declined"] += 1
    return done


gemm.Products.norm_qkv_rope = norm_qkv_rope
rng = np.random.default_rng(0)
step_ms = {}
for _ in range(3):
    for name, on in (("composed", False), ("fused", True)):
        fuse[0] = on
        backend.use_switches(backend.switches)  # drops the captured graphs
        for b in BATCHES:
            batch = perf.decode_batch(b, 512, 16, 128, rng)
            step_ms.setdefault(f"{name} b={b}", []).append(
                perf.event_time(cupy, lambda: backend.forward(batch), runs=30))
print(model_dir, calls)
for key, values in step_ms.items():
    print(key, [round(v, 4) for v in values], round(float(np.median(values)), 4))
with open(out, "w") as f:
    json.dump({"model": model_dir, "context": 512, "step_ms": step_ms, "calls": calls}, f,
              indent=1)
