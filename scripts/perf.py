"""Timings of the CUDA hot path, in one command on the GPU machine:

    python3 scripts/perf.py MODEL_DIR [--context 512] [--tune | --steps-only | --kernels-only]
        [--batches 1,8,64,256] [--contexts 512,2048] [--json PATH]

For MODEL_DIR (for example the Llama-3.2-1B-shaped random model of
`python3 scripts/make_random_model.py DIR --preset llama-3.2-1b`) it reports
  1. kernel by kernel, one decode step at batch 1, 8, 64 and 256 and contexts 512 and
     2,048: every kernel the engine's step launches (each product by its weight, with
     what the skinny kernels fuse into it, attention, and where they run on their own the
     norms, RoPE, SiLU, the LM head; sampling), each timed as a CUDA graph of all of
     its calls of one step back to back (the 16 layers' own weights and caches, so each
     call reads them from HBM as the step does), against its own bound: its bytes over
     4.5 TB/s or its FLOPs over 790 TFLOP/s, whichever is larger; beside the
     graph-replayed step;
  2. each op of a decode layer at 1 to 16 rows (sublayer_comparison), composed of cuBLAS
     and the small kernels against the fused skinny kernels with plain and programmatic
     launches and against what "auto" chooses, graph-timed with weights from HBM, and the
     time of one decode step replayed from a CUDA graph at batch 1, 8, 64 and 256 beside
     the eager step, for each of those variants (STEP_VARIANTS);
  3. cuBLAS against both custom skinny kernels of gemv.cu (the SIMT "gemv" and the
     tensor-core "mma") for every weight shape and M = 1..16, each timed as a CUDA graph
     of back-to-back calls over enough weight copies that every call reads its weight from
     HBM (as in a decode step, and without host launch overhead in the number); the
     fastest per shape and M is the choice table that gemm's "auto" switch reads;
  4. end-to-end batch-1 greedy decode (host batch building, step, sampling, token
     readback), tok/s with graphs (cuBLAS and "auto" skinny products) and eager;
then a short table. With $OUT set, everything also goes to $OUT/perf.json (or to --json)
and the choice table to $OUT/gemm_choice_<gpu>.json (commit it beside gemm.py). With
--tune only step 3 runs (no weights are loaded; the model directory gives the shapes),
and with --merge the table written keeps the shapes of the one beside gemm.py that this
model lacks (tune each model in turn, copying the table there after each);
--steps-only skips it; --kernels-only runs step 1 alone. --batches and --contexts choose
the batch sizes (of steps 1, 2 and 4) and contexts (of step 1). The KV cache is zeroed
instead of prefilled: timings do not depend on its values."""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout's package
from cupy_llama.interface import ForwardBatch, SamplingTensors
from cupy_llama.models import model_for, read_config
from cupy_llama.weights import open_checkpoint
from cupy_llama.backends.cuda import gemm
from cupy_llama.backends.cuda import sampling as sampling_kernels
from cupy_llama.backends.cuda.switches import KernelSwitches
from cupy_llama.util import cdiv  # noqa: E402

RUNS, WARMUP = 20, 3
GRAPH_BATCHES = (1, 8, 64, 256)
KERNEL_CONTEXTS = (512, 2048)
HBM_BYTES_S = 4.5e12      # the bounds of the kernel table (streaming read, measured)
TENSOR_FLOP_S = 790e12    # bf16 tensor-core products (cuBLAS 8192^3, measured)
GEMV_ROWS = tuple(range(1, gemm.SKINNY_MAX_ROWS + 1))
GEMV_PRINT_ROWS = (1, 2, 4, 8, 16)
GEMV_CALLS = 16       # calls per captured graph
GEMV_REPLAYS = 10     # timed replays of it (median)
FLUSH_L2_TIMES = 3    # the weight copies of one shape together hold this many L2 sizes
# decode-step variants: name -> (skinny switch, programmatic launches); "cublas" composes
# every sublayer of cuBLAS and the separate small kernels, "fused" takes the skinny
# kernels wherever they can, "auto" is what a backend runs by default
STEP_VARIANTS = {"cublas": KernelSwitches(skinny_gemm="cublas", programmatic=False),
                 "auto": KernelSwitches(),
                 "fused": KernelSwitches(skinny_gemm="mma", programmatic=False),
                 "fused+pdl": KernelSwitches(skinny_gemm="mma")}
E2E_STEPS = 256


def median(values):
    return statistics.median(values) if values else float("nan")


# the ops a step runs as kernels of their own (beside the products the sublayer openers
# fuse, recorded through _RecordingProducts, and attention)
RECORDED_OPS = ("embedding", "rms_norm", "add_rms_norm", "linear", "rope_and_cache",
                "act_and_mul", "softcap", "gather_rows")


class _RecordingProducts:
    """gemm.Products whose fused sublayer products are recorded where they run."""

    def __init__(self, products, calls):
        self._products, self._calls = products, calls

    def __getattr__(self, name):
        target = getattr(self._products, name)
        if name not in ("norm_linear", "norm_gate_up_act", "norm_qkv_rope"):
            return target

        def recorded(x, norm_weight, eps, weight, *args, **kwargs):
            def run():
                return target(x, norm_weight, eps, weight, *args, **kwargs)
            if not run():
                return False
            self._calls.append((f"{name} {weight.shape[0]}x{weight.shape[1]}", run))
            return True
        return recorded


def recording_ops(ops):
    """The backend's ops, run as usual, with every kernel call of one eager step kept in
    .calls as (label, call): the kernel table replays each label's calls of the step in a
    CUDA graph. The ops' own sublayer openers run, so a step records what the engine
    launches: the fused products, or the parts a composed sublayer runs; the head norms
    that a decode step hands to attention (CudaOps.norm_qkv_rope) replay with it."""
    base = type(ops)

    def recorded(name):
        def call(self, *args, **kwargs):
            def run():
                getattr(base, name)(self, *args, **kwargs)
            self.calls.append((op_label(name, args), run))
            run()
        return call

    def attention(self, *args, **kwargs):
        handed = getattr(self, "_rope", None)  # norm_qkv_rope's, consumed by the call

        def run():
            if handed is not None:
                self._rope = handed
            base.attention(self, *args, **kwargs)
        self.calls.append(("attention", run))
        run()

    members = {name: recorded(name) for name in RECORDED_OPS if hasattr(base, name)}
    recording = object.__new__(type("Recording" + base.__name__, (base,),
                                    {**members, "attention": attention}))
    recording.__dict__.update(vars(ops))  # the same buffers, streams and kernels
    recording.calls = []
    if hasattr(ops, "products"):
        recording.products = _RecordingProducts(ops.products, recording.calls)
    return recording


def op_label(name: str, args) -> str:
    """A product by its weight's shape; any other op by name."""
    if name == "linear":
        return f"linear {args[1].shape[0]}x{args[1].shape[1]}"
    return name


class _RecordingBackend:
    def __init__(self, backend, ops):
        self.ops, self.weights, self.kv_caches = ops, backend.weights, backend.kv_caches
        self.rope_tables, self.buffers = backend.rope_tables, backend.buffers


def decode_batch(num_seqs: int, context: int, block_size: int, blocks_per_seq: int, rng) -> ForwardBatch:
    """Sequence b has `context` tokens cached in blocks b * blocks_per_seq ...; one new token."""
    used = cdiv(context + 1, block_size)
    tables = (np.arange(num_seqs, dtype=np.int32)[:, None] * blocks_per_seq
              + np.arange(used, dtype=np.int32)[None, :])
    positions = np.full(num_seqs, context, np.int32)
    slots = tables[:, context // block_size] * block_size + context % block_size
    return ForwardBatch(token_ids=rng.integers(0, 10000, num_seqs).astype(np.int32),
                        positions=positions, slot_mapping=slots.astype(np.int32),
                        query_start_loc=np.arange(num_seqs + 1, dtype=np.int32),
                        seq_lens=np.full(num_seqs, context + 1, np.int32), block_tables=tables,
                        max_query_len=1, max_seq_len=context + 1)


def greedy(num_seqs: int) -> SamplingTensors:
    return SamplingTensors(temperature=np.zeros(num_seqs, np.float32),
                           top_k=np.zeros(num_seqs, np.int32), top_p=np.ones(num_seqs, np.float32),
                           min_p=np.zeros(num_seqs, np.float32),
                           seeds=np.zeros(num_seqs, np.uint64), steps=np.zeros(num_seqs, np.int32))


def event_time(cupy, fn, runs=RUNS, warmup=WARMUP) -> float:
    """Median milliseconds of fn() between CUDA events on the current stream."""
    stream = cupy.cuda.get_current_stream()
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = stream.record()
        fn()
        end = stream.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return median(times)


def graph_ms(cupy, calls, replays: int = GEMV_REPLAYS) -> float:
    """Median milliseconds of one replay of a CUDA graph of `calls` back to back (each run
    once eagerly first: compiled, kernel attributes set, outside the capture)."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for call in calls:
            call()
        stream.synchronize()
        stream.begin_capture()
        try:
            for call in calls:
                call()
        finally:
            graph = stream.end_capture()
        return event_time(cupy, graph.launch, runs=replays, warmup=2)


def op_bound_us(label: str, calls: int, config, num_seqs: int, context: int) -> float:
    """The bound of an op's calls of one decode step: the fewest bytes they must move over
    HBM_BYTES_S, or their FLOPs over TENSOR_FLOP_S, whichever is larger (weights read once,
    activations in and out once: bf16, with the residual stream and the logits float32)."""
    B, H, V = num_seqs, config.hidden_size, config.vocab_size
    d, nh, nkv, I = (config.head_dim, config.num_attention_heads, config.num_key_value_heads,
                     config.intermediate_size)
    qkv = (nh + 2 * nkv) * d
    name, _, shape = label.partition(" ")
    flops = 0
    if shape:
        n, k = map(int, shape.split("x"))
        x_bytes = 4 * B * k if name.startswith("norm_") else 2 * B * k
        if n == V:
            out_bytes = 4 * B * n            # float32 logits
        elif n == H:
            out_bytes = 8 * B * n            # added into the residual: read and written
        elif name == "norm_gate_up_act":
            out_bytes = 2 * B * n // 2       # silu(gate) * up
        else:
            out_bytes = 2 * B * n            # bf16 (qkv: q out, k and v into the cache)
        bytes_, flops = 2 * n * k + x_bytes + out_bytes, 2 * B * n * k
    elif name == "attention":
        bytes_ = 2 * B * (context + 1) * nkv * d * 2 + 4 * B * nh * d
        flops = 4 * B * nh * (context + 1) * d
    elif name == "rms_norm":
        bytes_ = 4 * B * H + 2 * B * H + 2 * H
    elif name == "rope_and_cache":
        bytes_ = 4 * B * qkv
    elif name == "act_and_mul":
        bytes_ = 2 * B * 2 * I + 2 * B * I
    elif name == "sample":
        bytes_ = 4 * B * V
    else:  # embedding, gather_rows: a row per sequence in and out
        bytes_ = 8 * B * H
    return calls * max(bytes_ / HBM_BYTES_S, flops / TENSOR_FLOP_S) * 1e6


def record_step(backend, batch: ForwardBatch):
    """(logits, calls): one eager forward pass of `batch`, with its kernel calls recorded
    in order (recording_ops)."""
    recording = recording_ops(backend.ops)
    logits = backend.model.forward(_RecordingBackend(backend, recording), batch)
    return logits, recording.calls


def kernel_table(cupy, backend, config, num_seqs: int, context: int, blocks_per_seq: int,
                 rng) -> dict:
    """Every op of one decode step (see the module doc, item 1): {label: {"calls",
    "us_per_step", "bound_us"}} and the graph-replayed step itself ("step")."""
    batch = decode_batch(num_seqs, context, backend.block_size, blocks_per_seq, rng)
    logits, calls = record_step(backend, batch)
    cupy.cuda.get_current_stream().synchronize()
    by_label = {}
    for label, call in calls:
        by_label.setdefault(label, []).append(call)
    staged = np.zeros(sampling_kernels.settings_bytes(num_seqs), np.uint8)
    for name, view in sampling_kernels.settings_views(staged, num_seqs).items():
        view[:] = greedy(num_seqs).row(name)
    settings = cupy.asarray(staged)
    tokens = cupy.empty(num_seqs, np.int32)
    by_label["sample"] = [lambda: sampling_kernels.sample_settings(logits, settings, num_seqs,
                                                                   tokens)]
    rows = {}
    for label, calls in by_label.items():
        rows[label] = {"calls": len(calls), "us_per_step": graph_ms(cupy, calls) * 1e3,
                       "bound_us": op_bound_us(label, len(calls), config, num_seqs, context)}
    step = {"eager_ms": event_time(cupy, lambda: backend.model.forward(backend, batch))}
    if backend.graphs is not None:
        step["graph_ms"] = event_time(cupy, lambda: backend.forward(batch))
    weights = int(backend._blob.nbytes)
    kv = config.num_hidden_layers * 2 * num_seqs * (context + 1) * config.kv_size * 2
    step["bound_ms"] = (weights + kv) / HBM_BYTES_S * 1e3
    return {"ops": rows, "step": step}


def gemv_shapes(config) -> dict:
    return {"qkv": (config.q_size + 2 * config.kv_size, config.hidden_size),
            "o_proj": (config.hidden_size, config.q_size),
            "gate_up": (2 * config.intermediate_size, config.hidden_size),
            "down": (config.hidden_size, config.intermediate_size),
            "lm_head": (config.vocab_size, config.hidden_size)}


def graph_us_per_call(cupy, launch, weights) -> float:
    """Microseconds per call of GEMV_CALLS launches cycling over `weights` (or any other
    inputs: scripts/bench_sampling.py passes logits rows), replayed from one CUDA graph
    (median of GEMV_REPLAYS); NaN where the kernel refuses its input or cannot be captured."""
    stream = cupy.cuda.Stream(non_blocking=True)
    try:
        with stream:
            for weight in weights[:2]:  # compile, set kernel attributes, outside the capture
                launch(weight)
            stream.synchronize()
            stream.begin_capture()
            try:
                for call in range(GEMV_CALLS):
                    launch(weights[call % len(weights)])
            finally:
                graph = stream.end_capture()
            ms = event_time(cupy, graph.launch, runs=GEMV_REPLAYS, warmup=1)
    except (ValueError, NotImplementedError, RuntimeError, cupy.cuda.runtime.CUDARuntimeError):
        return float("nan")
    return ms * 1e3 / GEMV_CALLS


def weight_copies(cupy, n: int, k: int, l2_bytes: int) -> list:
    """Copies of an [n, k] bf16 weight that together hold FLUSH_L2_TIMES L2 sizes, so that
    calls cycling over them read every weight from HBM: random bit patterns of values in
    [2^-7, 2^-5) (finite, no denormals), views of one allocation."""
    copies = max(1, cdiv(FLUSH_L2_TIMES * l2_bytes, 2 * n * k))
    pool = cupy.random.randint(0x3C00, 0x3D00, copies * n * k, dtype=np.int32).astype(np.uint16)
    return [pool[i * n * k:(i + 1) * n * k].reshape(n, k) for i in range(copies)]


def gemv_comparison(cupy, config) -> list:
    """Every skinny kernel for every weight shape and M in GEMV_ROWS."""
    l2_bytes = cupy.cuda.Device().attributes.get("L2CacheSize", 50 << 20)
    launchers = {"cublas": gemm.cublas_linear, "gemv": gemm.gemv,
                 "mma": lambda x, w, out: gemm.mma(x, w, out, programmatic=True)}
    rows = []
    for name, (n, k) in gemv_shapes(config).items():
        nbytes = 2 * n * k
        weights = weight_copies(cupy, n, k, l2_bytes)
        out_dtype = np.float32 if name == "lm_head" else np.uint16
        for m in GEMV_ROWS:
            x = cupy.full((m, k), 0x3F80, np.uint16)  # bf16 1.0
            out = cupy.empty((m, n), out_dtype)
            row = {"weight": name, "n": n, "k": k, "m": m}
            for kernel, launcher in launchers.items():
                us = graph_us_per_call(cupy, lambda w: launcher(x, w, out), weights)
                row[f"{kernel}_us"] = us
                row[f"{kernel}_tb_s"] = nbytes / us / 1e6
            timed = [kernel for kernel in launchers if not math.isnan(row[f"{kernel}_us"])]
            row["best"] = min(timed, key=lambda kernel: row[f"{kernel}_us"]) if timed else "cublas"
            rows.append(row)
        del weights
    return rows


SUBLAYER_ROWS = (1, 4, 8, 16)
STAGING_CLUSTERS = (1, 2, 4)  # the fused+pdl variant again, every product clustered so


def every_staging_cluster(cluster: int, w: int, pro: int, m_rows: int, k: int) -> int:
    """In place of gemm.staging_cluster: every normed product of bf16 weights and at least
    2 x rows stages x in clusters of `cluster`."""
    return cluster if w == gemm.W_BF16 and pro == gemm.PRO_NORM and m_rows >= 2 else 1


def sublayer_comparison(cupy, backend, config) -> list:
    """Each op of a decode layer at M in SUBLAYER_ROWS, as the model runs it, composed of
    cuBLAS and the small kernels ("cublas") against the fused skinny kernels with plain
    and programmatic launches, and the latter with each of STAGING_CLUSTERS blocks
    sharing the staging of x in every normed product; graph-timed like gemv_comparison
    (weights from HBM)."""
    ops = backend.ops
    l2_bytes = cupy.cuda.Device().attributes.get("L2CacheSize", 50 << 20)
    H = config.hidden_size
    k_cache, v_cache = backend.kv_caches[0]
    norm_w = backend.weights["final_norm"]
    rows = []
    for m in SUBLAYER_ROWS:
        residual = cupy.random.standard_normal((m, H), np.float32)
        buf = backend.buffers(m, m)
        meta = ops.upload(decode_batch(m, 16, backend.block_size, 4, np.random.default_rng(0)))
        cases = {
            "qkv+rope": (gemv_shapes(config)["qkv"], lambda w: ops.norm_qkv_rope(
                residual, norm_w, 1e-5, w, meta, backend.rope_tables["full_attention"], k_cache, v_cache, buf["q"],
                buf["h"], buf["qkv"])),
            "o_proj+add": (gemv_shapes(config)["o_proj"],
                           lambda w: ops.linear(buf["attn"], w, residual, accumulate=True)),
            "gate_up+silu": (gemv_shapes(config)["gate_up"], lambda w: ops.norm_gate_up_act(
                residual, norm_w, 1e-5, w, buf["act"], buf["h"], buf["gate_up"])),
            "down+add": (gemv_shapes(config)["down"],
                         lambda w: ops.linear(buf["act"], w, residual, accumulate=True)),
            "lm_head+norm": (gemv_shapes(config)["lm_head"], lambda w: ops.norm_linear(
                residual, norm_w, 1e-5, w, buf["logits"], buf["last_h"])),
        }
        buf["attn"].fill(0x3C00)
        buf["act"].fill(0x3C00)
        for name, ((n, k), run) in cases.items():
            weights = weight_copies(cupy, n, k, l2_bytes)
            row = {"op": name, "m": m, "n": n, "k": k}
            for variant, switches in STEP_VARIANTS.items():
                backend.use_switches(switches)
                ops = backend.ops
                row[f"{variant}_us"] = graph_us_per_call(cupy, run, weights)
            chosen = gemm.staging_cluster
            for cluster in STAGING_CLUSTERS:  # ops: the fused+pdl variant's, the last
                gemm.staging_cluster = functools.partial(every_staging_cluster, cluster)
                row[f"staging cluster {cluster}_us"] = graph_us_per_call(cupy, run, weights)
            gemm.staging_cluster = chosen
            rows.append(row)
            del weights
    return rows


def choice_table(gpu: str, rows: list) -> dict:
    """The JSON gemm.load_choice_table reads: the fastest kernel per shape and M."""
    choices, timings = {}, {}
    for row in rows:
        shape = f"{row['n']}x{row['k']}"
        choices.setdefault(shape, {})[str(row["m"])] = row["best"]
        timings.setdefault(shape, {})[str(row["m"])] = {
            kernel: None if math.isnan(row[f"{kernel}_us"]) else round(row[f"{kernel}_us"], 2)
            for kernel in gemm.KERNELS}
    return {"gpu": gpu, "measured_by": "python3 scripts/perf.py MODEL_DIR --tune",
            "choices": choices, "us_per_call": timings}


def choice_file_name(gpu: str) -> str:
    """"NVIDIA H200" -> gemm_choice_h200.json"""
    slug = re.sub(r"[^a-z0-9]+", "_", gpu.lower().replace("nvidia", "")).strip("_")
    return f"gemm_choice_{slug or 'gpu'}.json"


def merged_table(table: dict, directory: Path = gemm.CHOICE_DIR) -> dict:
    """`table` plus the shapes it lacks from this GPU's choice file beside gemm.py: one
    table for several models, each tuned in turn with --merge (a shape both hold takes
    the new timing)."""
    path = directory / choice_file_name(table["gpu"])
    if not path.exists():
        return table
    old = json.loads(path.read_text(encoding="utf-8"))
    if old.get("gpu") != table["gpu"]:
        return table
    return {**table, "measured_by": MERGED_BY,
            "choices": {**old.get("choices", {}), **table["choices"]},
            "us_per_call": {**old.get("us_per_call", {}), **table["us_per_call"]}}


MERGED_BY = ("python3 scripts/perf.py MODEL_DIR --tune --merge, once per model (a random "
             "model of each `make_random_model.py --preset`), the table copied beside "
             "gemm.py after each")


def tune(cupy, config, gpu: str, merge: bool = False) -> tuple[list, dict]:
    """Time the skinny kernels and write the choice table to $OUT when set (merge: with
    the other shapes of the table beside gemm.py); returns the rows and the table (a
    backend made with it uses it: gemm.Products(table=...))."""
    rows = gemv_comparison(cupy, config)
    table = choice_table(gpu, rows)
    if merge:
        table = merged_table(table)
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir, choice_file_name(gpu)).write_text(json.dumps(table, indent=2) + "\n")
    return rows, table


def end_to_end(cupy, backend, config, context, use_graphs: bool, rng) -> float:
    """Batch-1 greedy decode tok/s: host batch, step, sampling, token readback per step."""
    bps = cdiv(backend.max_model_len, backend.block_size)
    token = 0
    sampling = greedy(1)
    stamps = []
    for step in range(E2E_STEPS):
        batch = decode_batch(1, context + step, backend.block_size, bps, rng)
        batch.token_ids[0] = token
        logits = backend.forward(batch) if use_graphs else backend.model.forward(backend, batch)
        token = int(backend.ops.sample(logits, sampling)[0])
        stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def int_list(text: str) -> tuple[int, ...]:
    """"1,8,64" -> (1, 8, 64): positive integers."""
    try:
        values = tuple(int(item) for item in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--context", type=int, default=512, help="cached tokens per sequence")
    parser.add_argument("--batches", type=int_list, default=GRAPH_BATCHES,
                        help="decode batch sizes, comma-separated (default 1,8,64,256)")
    parser.add_argument("--contexts", type=int_list, default=KERNEL_CONTEXTS,
                        help="contexts of the kernel table, comma-separated (default 512,2048)")
    parser.add_argument("--json", help="write the results here (default: $OUT/perf.json "
                                       "where OUT is set)")
    parser.add_argument("--tune", action="store_true",
                        help="only time the skinny products and write the choice table")
    parser.add_argument("--merge", action="store_true",
                        help="with --tune: keep the shapes of the choice table beside gemm.py "
                             "that this model lacks")
    parser.add_argument("--steps-only", action="store_true",
                        help="skip the skinny-product table (per-op and step times only)")
    parser.add_argument("--kernels-only", action="store_true",
                        help="only the kernel-by-kernel table of decode steps")
    args = parser.parse_args(argv)
    import cupy
    from cupy_llama.backends.cuda.backend import CudaBackend

    rng = np.random.default_rng(0)
    config = read_config(args.model_dir)
    gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    if args.tune:
        started = time.perf_counter()
        rows, _ = tune(cupy, config, gpu, merge=args.merge)
        print_gemv_table(rows)
        print(f"tuned in {time.perf_counter() - started:.1f} s")
        return 0
    checkpoint = open_checkpoint(args.model_dir, model_for(config))
    max_num_seqs = max(args.batches)
    max_model_len = max(2048, max(args.contexts) + 1, args.context + E2E_STEPS + 16)
    blocks_per_seq = cdiv(max_model_len, 16)
    started = time.perf_counter()
    backend = CudaBackend(model_for(config), checkpoint, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=4096, block_size=16,
                          num_kv_blocks=max_num_seqs * blocks_per_seq, log=lambda m: print(m, file=sys.stderr))
    checkpoint.close()
    initial = backend.switches  # from the environment; restored after the variants
    result = {"model_dir": str(args.model_dir), "context": args.context,
              "gpu": gpu, "switches": vars(initial),
              "start_seconds": round(time.perf_counter() - started, 2),
              "graphs_off_reason": backend.graphs_off_reason,
              "weight_bytes": int(backend._blob.nbytes)}
    backend._kv.fill(0)

    result["kernels"] = {}
    for context in args.contexts:
        for b in args.batches:
            result["kernels"][f"b={b} context={context}"] = kernel_table(
                cupy, backend, config, b, context, blocks_per_seq, rng)
    if args.kernels_only:
        return finish(result, args.json)

    result["gemv"], result["gemm_choice"] = ([], {}) if args.steps_only else tune(cupy, config, gpu)
    result["sublayer_us"] = sublayer_comparison(cupy, backend, config)
    result["step_ms"] = {}
    for name, switches in STEP_VARIANTS.items():
        backend.use_switches(switches)
        for b in args.batches:
            batch = decode_batch(b, args.context, 16, blocks_per_seq, rng)
            row = {"eager": event_time(cupy, lambda: backend.model.forward(backend, batch))}
            if backend.graphs is not None:
                row["graph"] = event_time(cupy, lambda: backend.forward(batch))
            result["step_ms"][f"{name} b={b}"] = row

    result["e2e_batch1_tok_s"] = {}
    for skinny in ("cublas", "auto"):
        backend.use_switches(KernelSwitches(programmatic=initial.programmatic,
                                            clusters=initial.clusters, skinny_gemm=skinny))
        if backend.graphs is not None:
            result["e2e_batch1_tok_s"][f"graph {skinny}"] = end_to_end(cupy, backend, config, args.context, True, rng)
        result["e2e_batch1_tok_s"][f"eager {skinny}"] = end_to_end(cupy, backend, config, args.context, False, rng)
    backend.use_switches(initial)
    return finish(result, args.json)


def finish(result, json_path: str | None = None) -> int:
    result["bandwidth_floor_ms"] = result["weight_bytes"] / HBM_BYTES_S * 1e3
    out_dir = os.environ.get("OUT")
    if json_path is None and out_dir:
        json_path = str(Path(out_dir, "perf.json"))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print_table(result)
    return 0


def print_table(result) -> None:
    for key, table in result["kernels"].items():
        step = table["step"]
        print(f"\n== decode step {key}: graph {step.get('graph_ms', float('nan')):.3f} ms, "
              f"eager {step['eager_ms']:.3f} ms, bound {step['bound_ms']:.3f} ms ==")
        print(f"{'op':<30}{'calls':>6}{'us/step':>10}{'bound us':>10}{'x bound':>9}")
        for label, row in sorted(table["ops"].items(), key=lambda item: -item[1]["us_per_step"]):
            ratio = row["us_per_step"] / row["bound_us"] if row["bound_us"] else float("nan")
            print(f"{label:<30}{row['calls']:>6}{row['us_per_step']:>10.1f}"
                  f"{row['bound_us']:>10.1f}{ratio:>9.2f}")
        total = sum(row["us_per_step"] for row in table["ops"].values())
        print(f"{'sum of the ops':<30}{'':>6}{total:>10.1f}")
    if "step_ms" not in result:
        return
    print_gemv_table(result["gemv"])
    print("\n== decode layer ops: us per call, graph-timed, weights from HBM ==")
    for row in result.get("sublayer_us", []):
        variants = ("cublas", "auto", "fused", "fused+pdl") + tuple(
            f"staging cluster {c}" for c in STAGING_CLUSTERS)
        print(f"{row['op']:<14} M={row['m']:<3}" + "".join(
            f" {v} {row.get(v + '_us', float('nan')):7.1f}" for v in variants))
    print("\n== decode step ms: eager vs graph replay ==")
    for key, row in result["step_ms"].items():
        print(f"{key:<16} eager {row['eager']:8.3f}  graph {row.get('graph', float('nan')):8.3f}")
    print(f"\nbandwidth floor (weights / 4.5 TB/s): {result['bandwidth_floor_ms']:.3f} ms "
          f"= {1e3 / result['bandwidth_floor_ms']:.0f} tok/s")
    print("end-to-end batch-1 decode tok/s: " + ", ".join(
        f"{k} {v:.0f}" for k, v in result["e2e_batch1_tok_s"].items()))
    if result["graphs_off_reason"]:
        print(f"CUDA graphs were OFF: {result['graphs_off_reason']}")


def print_gemv_table(rows) -> None:
    print("\n== skinny products: us per call (TB/s of weight read), graph-timed, weights from HBM ==")
    for row in rows:
        if row["m"] in GEMV_PRINT_ROWS:
            print(f"{row['weight']:<8} {row['n']:>6}x{row['k']:<5} M={row['m']:<3}" + "".join(
                f" {kernel} {row[kernel + '_us']:7.1f} ({row[kernel + '_tb_s']:.2f})"
                for kernel in gemm.KERNELS) + f"  best {row['best']}")
    print("fastest by M = 1..16 (c cublas, g gemv, m mma):")
    for name in dict.fromkeys(row["weight"] for row in rows):
        picks = "".join(row["best"][0] for row in rows if row["weight"] == name)
        print(f"  {name:<8} {picks}")


if __name__ == "__main__":
    sys.exit(main())
