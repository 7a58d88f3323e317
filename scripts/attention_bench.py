"""The scalar attention kernel against the decode and tensor-core prefill kernels, on the
Llama-3.2-1B attention shape (32 query heads, 8 kv heads, head_dim 64, bf16 paged KV
cache, block size 16), in one command on the GPU machine:

    python3 scripts/attention_bench.py [--runs 20] [--seed 0]

Decode: batch 1, 8, 64 and 256, every sequence at context 512 and 2048, four ways: the
scalar kernel and the decode kernel, each with the split count an eager step picks
(from the batch's longest context) and with the one a captured CUDA graph uses (its
bucket's count for max_model_len 8192, split lengths derived on the device).
Prefill: one sequence of 1,024 new tokens, one of 4,096, and a chunk of 1,024 new tokens
after 3,072 cached ones (scalar kernel vs tensor-core kernel). --prefill-widths: the
tensor-core prefill kernel as the launcher chooses it and at each of its widths, for one
sequence of 128 to 8,192 new tokens and the chunk after cached ones.
Random data in a random paged cache (each sequence's blocks scattered over the pool).
Times are GPU times from CUDA events, the median of --runs after warm-up, taken while a
spin kernel holds the GPU so the host's launch overhead stays out of the number (it is in
the eager per-op timings of perf.py). Every output is compared with the scalar kernel's
(max |new - old|) and, up to batch 64 and for every prefill, with a float32 dense
reference computed with CuPy. A table is printed last; with $OUT set, everything also
goes to $OUT/attention_bench.json."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout's package
from cupy_llama.backends.cuda import attention
from cupy_llama.backends.cuda.device import device_limits
from cupy_llama.backends.cuda.launch import launch_attributes_usable
from cupy_llama.util import cdiv  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 64, 16
MAX_MODEL_LEN = 8192  # what `cupy-llama bench` runs with: fixes the graph split counts
DECODE_BATCHES = (1, 8, 64, 256)
DECODE_CONTEXTS = (512, 2048)
PREFILLS = ((0, 1024), (0, 4096), (3072, 1024))  # (cached tokens, new tokens)
# --prefill-widths: one sequence of 128 to 8,192 new tokens, and a chunk after cached ones
PREFILL_WIDTH_CASES = tuple((0, n) for n in (128, 256, 512, 1024, 2048, 4096, 8192)) + ((3072, 1024),)
REFERENCE_MAX_BATCH = 64
WARMUP = 3
SPIN_CYCLES = 40_000_000  # ~20 ms at 2 GHz: longer than the host needs to queue the runs
DECODE_VARIANTS = ("old", "new", "old graph", "new graph")
DECODE_KERNEL_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)

SPIN_SOURCE = r"""
extern "C" __global__ void spin_kernel(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


# ------------------------------------------------------------------- split rules

def old_decode_splits(num_seqs: int, num_kv_heads: int, group: int, max_seq_len: int,
                      num_sms: int, max_model_len: int = MAX_MODEL_LEN) -> int:
    """The split rule the scalar kernel shipped with: CTAs of 16 rows, about 2 per SM,
    at least 256 keys per split, at most 32 splits."""
    max_splits = max(1, min(32, cdiv(max_model_len, 256)))
    ctas = num_seqs * num_kv_heads * cdiv(group, 16)
    wanted = cdiv(2 * num_sms, ctas)
    return max(1, min(wanted, max_splits, max_seq_len // 256))


def new_decode_splits(num_seqs: int, max_seq_len: int, num_sms: int) -> int:
    return attention.choose_decode_splits(num_seqs, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS,
                                          max_seq_len, num_sms,
                                          attention.max_decode_splits(MAX_MODEL_LEN))


# ----------------------------------------------------------- dense references (xp)

def bits_to_float32(xp, bits):
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def gather_dense(xp, pool_bits, tables, length: int):
    """[B, length, nkv, d] float32 of sequences whose blocks are tables [B, W] in a pool
    [num_blocks, block_size, nkv, d] of bf16 bits."""
    blocks = pool_bits[tables]  # [B, W, block_size, nkv, d]
    num_seqs, width, block_size = blocks.shape[:3]
    dense = blocks.reshape(num_seqs, width * block_size, *blocks.shape[3:])[:, :length]
    return bits_to_float32(xp, xp.ascontiguousarray(dense))


def _softmax(xp, scores):
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = xp.exp(scores)
    return probs / probs.sum(axis=-1, keepdims=True)


def decode_reference(xp, q, keys, values, scale: float):
    """q [B, nh, d], keys/values [B, S, nkv, d] (float32, every sequence S long) ->
    [B, nh * d]: the last position attends to all S keys."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    grouped = q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    probs = _softmax(xp, xp.einsum("bkgd,bskd->bkgs", grouped, keys) * np.float32(scale))
    return xp.einsum("bkgs,bskd->bkgd", probs, values).reshape(num_seqs, num_heads * head_dim)


def prefill_reference(xp, q, keys, values, scale: float):
    """One sequence: q [T, nh, d] are the last T positions of keys/values [S, nkv, d]
    (float32) -> [T, nh * d], causal."""
    num_new, num_heads, head_dim = q.shape
    seq_len, num_kv_heads = keys.shape[:2]
    group = num_heads // num_kv_heads
    positions = xp.arange(seq_len - num_new, seq_len)
    visible = xp.arange(seq_len)[None, :] <= positions[:, None]  # [T, S]
    out = xp.empty((num_new, num_heads, head_dim), xp.float32)
    for h in range(num_kv_heads):  # one kv head at a time bounds the score memory
        heads = slice(h * group, (h + 1) * group)
        scores = xp.einsum("tgd,sd->gts", q[:, heads], keys[:, h]) * np.float32(scale)
        probs = _softmax(xp, xp.where(visible[None], scores, -xp.inf))
        out[:, heads] = xp.einsum("gts,sd->tgd", probs, values[:, h])
    return out.reshape(num_new, num_heads * head_dim)


def max_abs_diff(xp, a, b) -> float:
    """max |a - b| over float arrays; NaN anywhere gives NaN."""
    return float(xp.abs(a.astype(xp.float32) - b.astype(xp.float32)).max())


# ------------------------------------------------------------------------ the GPU

class Bench:
    def __init__(self, cupy, runs: int, seed: int):
        self.cp = cupy
        self.runs = runs
        self.rng = np.random.default_rng(seed)
        self.device_rng = cupy.random.RandomState(seed)
        self.num_sms = device_limits()["sms"]
        self._spin = cupy.RawKernel(SPIN_SOURCE, "spin_kernel")
        splits = attention.max_decode_splits(MAX_MODEL_LEN)
        max_parts = max(DECODE_BATCHES) * NUM_HEADS * max(32, splits)
        self.partial_out = cupy.empty(max_parts * HEAD_DIM, np.float32)
        self.partial_lse = cupy.empty(max_parts, np.float32)
        needed = max(max(DECODE_BATCHES) * cdiv(max(DECODE_CONTEXTS), BLOCK_SIZE),
                     max(cdiv(c + n, BLOCK_SIZE) for c, n in PREFILLS + PREFILL_WIDTH_CASES))
        self.num_blocks = needed + 1024
        shape = (self.num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.k_pool = self.random_bf16(shape)
        self.v_pool = self.random_bf16(shape)

    def random_bf16(self, shape):
        """Standard normal values as bf16 bits (round to nearest even), made on the GPU in
        chunks."""
        cp = self.cp
        out = cp.empty(shape, np.uint16)
        flat = out.reshape(-1)
        chunk = 1 << 24
        for start in range(0, flat.size, chunk):
            n = min(chunk, flat.size - start)
            bits = self.device_rng.standard_normal(n, dtype=np.float32).view(np.uint32)
            flat[start:start + n] = ((bits + ((bits >> 16) & 1) + 0x7FFF) >> 16).astype(np.uint16)
        return out

    def scattered_tables(self, num_seqs: int, seq_len: int):
        width = cdiv(seq_len, BLOCK_SIZE)
        ids = self.rng.permutation(self.num_blocks)[:num_seqs * width]
        return ids.reshape(num_seqs, width).astype(np.int32)

    def gpu_time_us(self, launch) -> float:
        """Median GPU time of one launch() in microseconds."""
        cp = self.cp
        for _ in range(WARMUP):
            launch()
        stream = cp.cuda.get_current_stream()
        stream.synchronize()
        self._spin((1,), (1,), (np.int64(SPIN_CYCLES),))  # the runs queue up behind it
        pairs = []
        for _ in range(self.runs):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            launch()
            end.record(stream)
            pairs.append((start, end))
        pairs[-1][1].synchronize()
        return 1000.0 * statistics.median(cp.cuda.get_elapsed_time(s, e) for s, e in pairs)

    def decode_kernels_case(self, num_seqs: int, context: int) -> dict:
        """The CUDA-core decode kernel against the tensor-core one, each with the split
        count an eager step picks and with the one a CUDA graph uses (split lengths derived
        on the device): where the second pays (attention.DECODE_MMA_MIN_SEQS)."""
        cp = self.cp
        tables = cp.asarray(self.scattered_tables(num_seqs, context))
        q = self.random_bf16((num_seqs, NUM_HEADS, HEAD_DIM))
        inputs = (q, tables, cp.full(num_seqs, context, np.int32),
                  cp.arange(num_seqs + 1, dtype=np.int32))
        eager = new_decode_splits(num_seqs, context, self.num_sms)
        graph = new_decode_splits(num_seqs, MAX_MODEL_LEN, self.num_sms)
        result = dict(case=f"decode b={num_seqs} ctx={context}", batch=num_seqs,
                      context=context, splits={"eager": eager, "graph": graph}, us={},
                      max_diff={}, max_err_vs_reference={})
        outputs = {}
        for kernel, label in (("decode", "cuda cores"), ("decode_mma", "tensor cores")):
            for mode, splits, max_seq_len in (("eager", eager, context), ("graph", graph, None)):
                out = cp.empty((num_seqs, NUM_HEADS * HEAD_DIM), np.uint16)
                def launch(out=out, kernel=kernel, splits=splits, max_seq_len=max_seq_len):
                    self.run_attention(inputs, out, kernel=kernel, num_splits=splits,
                                       max_seq_len=max_seq_len, max_query_len=1)
                name = f"{label} {mode}"
                result["us"][name] = self.gpu_time_us(launch)
                outputs[name] = bits_to_float32(cp, out)
        # the clustered kernels with the graph's split count: the CUDA-core one where a CTA
        # covers its keys in one step, the tensor-core one wherever the keys split
        clustered = []
        if context <= attention.cluster_max_keys(HEAD_DIM, NUM_HEADS // NUM_KV_HEADS):
            clustered.append(("decode", "clusters graph"))
        if graph > 1:
            clustered.append(("decode_mma", "mma clusters graph"))
        for kernel, name in clustered if launch_attributes_usable() else ():
            out = cp.empty((num_seqs, NUM_HEADS * HEAD_DIM), np.uint16)
            def launch(out=out, kernel=kernel):
                attention.paged_attention(
                    inputs[0], self.k_pool, self.v_pool, inputs[1], inputs[2], inputs[3], out,
                    scale=HEAD_DIM ** -0.5, max_query_len=1, max_seq_len=None,
                    num_splits=graph, partial_out=self.partial_out,
                    partial_lse=self.partial_lse, kernel=kernel, clusters=True)
            result["us"][name] = self.gpu_time_us(launch)
            outputs[name] = bits_to_float32(cp, out)
        first = outputs["cuda cores eager"]
        for name, out in outputs.items():
            result["max_diff"][name] = max_abs_diff(cp, out, first)
        if num_seqs <= REFERENCE_MAX_BATCH:
            expected = decode_reference(cp, bits_to_float32(cp, q),
                                        gather_dense(cp, self.k_pool, tables, context),
                                        gather_dense(cp, self.v_pool, tables, context),
                                        HEAD_DIM ** -0.5)
            for name, out in outputs.items():
                result["max_err_vs_reference"][name] = max_abs_diff(cp, out, expected)
        return result

    def run_attention(self, inputs, out, *, kernel, num_splits, max_seq_len, max_query_len,
                      prefill_tiles=None):
        q, tables, seq_lens, query_start_loc = inputs
        attention.paged_attention(q, self.k_pool, self.v_pool, tables, seq_lens, query_start_loc,
                                  out, scale=HEAD_DIM ** -0.5, max_query_len=max_query_len,
                                  max_seq_len=max_seq_len, num_splits=num_splits,
                                  partial_out=self.partial_out, partial_lse=self.partial_lse,
                                  kernel=kernel, prefill_tiles=prefill_tiles)

    # ---- cases -----------------------------------------------------------------------
    def decode_case(self, num_seqs: int, context: int) -> dict:
        cp = self.cp
        tables_host = self.scattered_tables(num_seqs, context)
        q = self.random_bf16((num_seqs, NUM_HEADS, HEAD_DIM))
        inputs = (q, cp.asarray(tables_host), cp.full(num_seqs, context, np.int32),
                  cp.arange(num_seqs + 1, dtype=np.int32))
        group = NUM_HEADS // NUM_KV_HEADS
        variants = {  # name: (kernel, num_splits, max_seq_len)
            "old": ("scalar", old_decode_splits(num_seqs, NUM_KV_HEADS, group, context, self.num_sms), context),
            "new": ("auto", new_decode_splits(num_seqs, context, self.num_sms), context),
            "old graph": ("scalar", old_decode_splits(num_seqs, NUM_KV_HEADS, group, MAX_MODEL_LEN,
                                                      self.num_sms), None),
            "new graph": ("auto", new_decode_splits(num_seqs, MAX_MODEL_LEN, self.num_sms), None),
        }
        result = dict(case=f"decode b={num_seqs} ctx={context}", kind="decode", batch=num_seqs,
                      context=context, new_tokens=1, splits={}, us={}, max_diff_vs_old={},
                      max_err_vs_reference={})
        outputs = {}
        for name, (kernel, splits, max_seq_len) in variants.items():
            out = cp.empty((num_seqs, NUM_HEADS * HEAD_DIM), np.uint16)
            def launch(out=out, kernel=kernel, splits=splits, max_seq_len=max_seq_len):
                self.run_attention(inputs, out, kernel=kernel, num_splits=splits,
                                   max_seq_len=max_seq_len, max_query_len=1)
            result["splits"][name] = splits
            result["us"][name] = self.gpu_time_us(launch)
            outputs[name] = bits_to_float32(cp, out)
        self.compare(result, outputs, lambda: decode_reference(
            cp, bits_to_float32(cp, q), gather_dense(cp, self.k_pool, inputs[1], context),
            gather_dense(cp, self.v_pool, inputs[1], context), HEAD_DIM ** -0.5)
            if num_seqs <= REFERENCE_MAX_BATCH else None)
        return result

    def prefill_case(self, cached: int, num_new: int) -> dict:
        cp = self.cp
        seq_len = cached + num_new
        tables = cp.asarray(self.scattered_tables(1, seq_len))
        q = self.random_bf16((num_new, NUM_HEADS, HEAD_DIM))
        inputs = (q, tables, cp.full(1, seq_len, np.int32), cp.asarray(np.array([0, num_new], np.int32)))
        name = f"prefill {num_new}" + (f" after {cached}" if cached else "")
        result = dict(case=name, kind="prefill", batch=1, context=seq_len, new_tokens=num_new,
                      splits={}, us={}, max_diff_vs_old={}, max_err_vs_reference={})
        outputs = {}
        for variant, kernel in (("old", "scalar"), ("new", "auto")):
            out = cp.empty((num_new, NUM_HEADS * HEAD_DIM), np.uint16)
            def launch(out=out, kernel=kernel):
                self.run_attention(inputs, out, kernel=kernel, num_splits=1,
                                   max_seq_len=seq_len, max_query_len=num_new)
            result["splits"][variant] = 1
            result["us"][variant] = self.gpu_time_us(launch)
            outputs[variant] = bits_to_float32(cp, out)
        self.compare(result, outputs, lambda: prefill_reference(
            cp, bits_to_float32(cp, q), gather_dense(cp, self.k_pool, tables, seq_len)[0],
            gather_dense(cp, self.v_pool, tables, seq_len)[0], HEAD_DIM ** -0.5))
        return result

    def prefill_widths_case(self, cached: int, num_new: int) -> dict:
        """The tensor-core prefill kernel as the launcher chooses it, and forced to each of
        its widths (16-row tiles a warp), each against the float32 reference."""
        cp = self.cp
        seq_len = cached + num_new
        tables = cp.asarray(self.scattered_tables(1, seq_len))
        q = self.random_bf16((num_new, NUM_HEADS, HEAD_DIM))
        inputs = (q, tables, cp.full(1, seq_len, np.int32), cp.asarray(np.array([0, num_new], np.int32)))
        chosen = attention.attention_plan(
            num_seqs=1, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
            block_size=BLOCK_SIZE, max_query_len=num_new, num_splits=1, num_sms=self.num_sms)
        result = dict(case=f"prefill {num_new}" + (f" after {cached}" if cached else ""),
                      kind="prefill widths", context=seq_len, new_tokens=num_new,
                      chosen=chosen.kernel, us={}, max_err_vs_reference={})
        widths = sorted(t for d, t in attention.PREFILL_KERNELS if d == HEAD_DIM)
        expected = prefill_reference(
            cp, bits_to_float32(cp, q), gather_dense(cp, self.k_pool, tables, seq_len)[0],
            gather_dense(cp, self.v_pool, tables, seq_len)[0], HEAD_DIM ** -0.5)
        for name, tiles in [("chosen", None)] + [(f"tiles {t}", t) for t in widths]:
            out = cp.empty((num_new, NUM_HEADS * HEAD_DIM), np.uint16)
            def launch(out=out, tiles=tiles):
                self.run_attention(inputs, out, kernel="auto", num_splits=1, max_seq_len=seq_len,
                                   max_query_len=num_new, prefill_tiles=tiles)
            result["us"][name] = self.gpu_time_us(launch)
            result["max_err_vs_reference"][name] = max_abs_diff(cp, bits_to_float32(cp, out),
                                                                expected)
        return result

    def compare(self, result, outputs, reference):
        cp = self.cp
        for name, out in outputs.items():
            if name != "old":
                result["max_diff_vs_old"][name] = max_abs_diff(cp, out, outputs["old"])
        expected = reference()
        if expected is not None:
            for name, out in outputs.items():
                result["max_err_vs_reference"][name] = max_abs_diff(cp, out, expected)


# ------------------------------------------------------------------------ report

def print_table(results, file=None):
    file = file or sys.stdout
    print("\nattention kernels, GPU us per call (median); diff: max |new - old| of the bf16 "
          "outputs; err: max |x - float32 reference|", file=file)
    header = (f"{'case':<24}{'old':>10}{'new':>10}{'speedup':>9}{'old graph':>11}{'new graph':>11}"
              f"{'speedup':>9}{'splits o/n/og/ng':>18}{'diff':>9}{'err old':>9}{'err new':>9}")
    print(header, file=file)
    for r in results:
        if "error" in r:
            print(f"{r['case']:<24}  FAILED: {r['error']}", file=file)
            continue
        us, splits = r["us"], r["splits"]
        speed = us["old"] / us["new"] if us.get("new") else float("nan")
        graph = (us["old graph"] / us["new graph"]) if "new graph" in us else None
        split_text = "/".join(str(splits[v]) for v in DECODE_VARIANTS if v in splits)
        err = r["max_err_vs_reference"]
        print(f"{r['case']:<24}{us['old']:>10.1f}{us['new']:>10.1f}{speed:>8.1f}x"
              f"{(format(us['old graph'], '.1f') if 'old graph' in us else '-'):>11}"
              f"{(format(us['new graph'], '.1f') if 'new graph' in us else '-'):>11}"
              f"{(format(graph, '.1f') + 'x' if graph else '-'):>9}{split_text:>18}"
              f"{max(r['max_diff_vs_old'].values()):>9.2g}"
              f"{(format(err['old'], '.2g') if 'old' in err else '-'):>9}"
              f"{(format(max(v for k, v in err.items() if k != 'old'), '.2g') if len(err) > 1 else '-'):>9}",
              file=file)


def print_rows(results, title: str, header: str, row, file=None):
    """A table of one line per result: row(result) formats it; failed cases say why."""
    file = file or sys.stdout
    print(title, file=file)
    print(header, file=file)
    for r in results:
        print(f"{r['case']:<24}  FAILED: {r['error']}" if "error" in r else row(r), file=file)


def print_kernel_table(results, file=None):
    names = ("cuda cores eager", "tensor cores eager", "cuda cores graph", "tensor cores graph",
             "clusters graph", "mma clusters graph")

    def row(r):
        err = max((v for k, v in r["max_err_vs_reference"].items()
                   if k.startswith(("tensor", "mma"))), default=float("nan"))
        return (f"{r['case']:<24}" + "".join(f"{r['us'].get(n, float('nan')):>20.1f}" for n in names)
                + f"{str(r['splits']['eager']) + '/' + str(r['splits']['graph']):>12}{err:>9.2g}")

    print_rows(results, "\ndecode attention, GPU us per call (median), with the combine kernel "
               "where split; err: max |x - float32 reference| of the tensor-core runs",
               f"{'case':<24}" + "".join(f"{n:>20}" for n in names) + f"{'splits e/g':>12}{'err':>9}",
               row, file)


def print_widths_table(results, file=None):
    names = next((list(r["us"]) for r in results if "us" in r), [])

    def row(r):
        return (f"{r['case']:<24}" + "".join(f"{r['us'][n]:>12.1f}" for n in names)
                + f"{r['chosen']:>28}{max(r['max_err_vs_reference'].values()):>9.2g}")

    print_rows(results, "\ntensor-core prefill by width (16-row tiles a warp), GPU us per call "
               "(median); err: max |x - float32 reference|",
               f"{'case':<24}" + "".join(f"{n:>12}" for n in names)
               + f"{'chosen kernel':>28}{'err':>9}", row, file)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="timed runs per kernel (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decode-kernels", action="store_true",
                        help="only the CUDA-core against the tensor-core decode kernel, "
                             f"batch {', '.join(map(str, DECODE_KERNEL_BATCHES))}")
    parser.add_argument("--prefill-widths", action="store_true",
                        help="only the tensor-core prefill kernel, chosen and at each width, "
                             "for 128 to 8,192 new tokens")
    args = parser.parse_args(argv)
    from cupy_llama.backends.cuda.device import check_cuda_device, device_name, import_cupy
    check_cuda_device()
    cupy = import_cupy()
    started = time.perf_counter()
    bench = Bench(cupy, args.runs, args.seed)
    report = dict(gpu=device_name(cupy.cuda.Device()), num_sms=bench.num_sms,
                  shape=dict(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                             block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN),
                  runs=args.runs, seed=args.seed, setup_s=None, results=[])
    compile_started = time.perf_counter()
    for name in ("paged_attention_dpl2", "decode_attention_d64_g4", "attention_combine_kernel",
                 *attention.PREFILL_KERNELS.values()):
        attention.get_kernel("attention", name)
    report["compile_s"] = time.perf_counter() - compile_started
    report["setup_s"] = time.perf_counter() - started
    print(f"{report['gpu']}: {bench.num_sms} SMs; setup {report['setup_s']:.1f} s (attention.cu "
          f"compile {report['compile_s']:.1f} s)", file=sys.stderr)
    if args.decode_kernels:
        cases = [("kernels", b, c) for c in DECODE_CONTEXTS for b in DECODE_KERNEL_BATCHES]
    elif args.prefill_widths:
        cases = [("widths", cached, n) for cached, n in PREFILL_WIDTH_CASES]
    else:
        cases = [("decode", b, c) for c in DECODE_CONTEXTS for b in DECODE_BATCHES]
        cases += [("prefill", cached, n) for cached, n in PREFILLS]
    run = {"kernels": bench.decode_kernels_case, "decode": bench.decode_case,
           "prefill": bench.prefill_case, "widths": bench.prefill_widths_case}
    for kind, x, y in cases:
        try:
            result = run[kind](x, y)
        except Exception as e:  # keep going: one failing case must not hide the others
            label = (f"prefill {y} after {x}" if kind in ("prefill", "widths")
                     else f"decode b={x} ctx={y}")
            result = dict(case=label, kind=kind, error=f"{type(e).__name__}: {e}"[:300])
        report["results"].append(result)
        print(json.dumps(result), file=sys.stderr)
    report["total_s"] = time.perf_counter() - started
    out_dir = os.environ.get("OUT")
    if out_dir:
        name = ("decode_kernels.json" if args.decode_kernels else
                "prefill_widths.json" if args.prefill_widths else "attention_bench.json")
        path = Path(out_dir) / name
        path.write_text(json.dumps(report, indent=1))
        print(f"wrote {path}", file=sys.stderr)
    table = (print_kernel_table if args.decode_kernels else
             print_widths_table if args.prefill_widths else print_table)
    table(report["results"])
    return 1 if any("error" in r for r in report["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
