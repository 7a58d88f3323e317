"""The warpgroup (wgmma) prefill kernels of wgmma_prefill.patch beside the mma.sync ones,
on one sequence of the Llama-3.2-1B attention shape (32 query heads, 8 kv heads, head_dim
64, block size 16), on an H100 or H200 (compute capability 9.0):

    git apply benchmarks/products/wgmma_prefill_tried/wgmma_prefill.patch   # on 8d83a5e
    python3 benchmarks/products/wgmma_prefill_tried/wg_variants.py 4096

Three builds of the patched attention.cu: as patched ("both": S = Q K^T and O += P V on
wgmma), "S on mma.sync" (P V still on wgmma) and "P V on mma.sync" (S still on wgmma),
the last two reading the same core-matrix tiles through ldmatrix. For each: the largest
difference from the mma.sync kernel's output, the tokens that differ by more than 0.02,
and the time of a call of the one- and two-tile forms, beside the mma.sync kernels':
CUDA events around one launch on an idle GPU, median of 20 after 5, so each time holds
the host's launch too (scripts/attention_bench.py holds the GPU with a spin kernel
instead, for the kernel's time alone)."""
import sys
from pathlib import Path

import cupy as cp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from cupy_llama.backends.cuda import attention, kernels  # noqa: E402

H, KV, D, BS = 32, 8, 64, 16
LOG2_E = 1.4426950408889634
n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
rng = np.random.default_rng(0)


def random_bf16(shape):
    x = rng.standard_normal(shape).astype(np.float32)
    return cp.asarray((x.view(np.uint32) >> 16).astype(np.uint16))


def to_float(a):
    return (cp.asnumpy(a).astype(np.uint32) << 16).view(np.float32)


blocks = (n + BS - 1) // BS
k_pool, v_pool = random_bf16((blocks + 4, BS, KV, D)), random_bf16((blocks + 4, BS, KV, D))
tables = cp.asarray(np.arange(blocks, dtype=np.int32)[None, :] + 2)
q = random_bf16((n, H, D))
seq_lens, query_start_loc = cp.asarray(np.array([n], np.int32)), cp.asarray(np.array([0, n], np.int32))


def plan_of(tiles, warpgroup):
    return attention.attention_plan(num_seqs=1, num_heads=H, num_kv_heads=KV, head_dim=D,
                                    block_size=BS, max_query_len=n, num_splits=1, num_sms=132,
                                    prefill_tiles=tiles, warpgroup=warpgroup)


def run(function, plan, out):
    function.max_dynamic_shared_size_bytes = plan.shared_mem
    function(plan.grid, (plan.block,),
             (q, k_pool, v_pool, tables, seq_lens, query_start_loc, out, np.int32(H), np.int32(KV),
              np.int32(BS.bit_length() - 1), np.int32(tables.shape[1]),
              np.float32(D ** -0.5 * LOG2_E), np.int32(plan.grid[0]), np.int32(0)),
             shared_mem=plan.shared_mem)


def gpu_us(function, plan):
    out, times = cp.zeros((n, H * D), cp.uint16), []
    for _ in range(25):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        run(function, plan, out)
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1000)
    return float(np.median(times[5:]))


S_WGMMA = """                const unsigned long long k_desc =
                    wgmma_descriptor(k_tile + 2 * kk * 64, CORE, CHUNKS * CORE);
                if (kk == 0) wgmma_m64k16<KEYS, 0, 0>(s[mt], q_frag[mt][kk], k_desc);
                else wgmma_m64k16<KEYS, 0, 1>(s[mt], q_frag[mt][kk], k_desc);"""
S_MMA_SYNC = """                for (int jj = 0; jj < KEY_NTILES / 2; ++jj) {
                    if (kk == 0)
                        for (int z = 0; z < 4; ++z) s[mt][2 * jj][z] = s[mt][2 * jj + 1][z] = 0.0f;
                    unsigned k_frag[4];
                    const int key = jj * 16 + (lane & 7) + (lane >> 4) * 8;
                    const int dim = kk * 16 + ((lane >> 3) & 1) * 8;
                    ldmatrix_x4(k_frag, k_tile + ((key >> 3) * CHUNKS + (dim >> 3)) * 64 + (key & 7) * 8);
                    mma_bf16(s[mt][2 * jj], q_frag[mt][kk], k_frag[0], k_frag[1]);
                    mma_bf16(s[mt][2 * jj + 1], q_frag[mt][kk], k_frag[2], k_frag[3]);
                }"""
PV_WGMMA = """                wgmma_m64k16<D, 1, 1>(o[mt], p_frag[kk],
                                      wgmma_descriptor(v_tile + 2 * kk * CHUNKS * 64, CHUNKS * CORE,
                                                       CORE));"""
PV_MMA_SYNC = """                for (int nn = 0; nn < D / 16; ++nn) {
                    unsigned v_frag[4];
                    const int key = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                    const int dim = nn * 16 + (lane >> 4) * 8;
                    ldmatrix_x4_trans(v_frag, v_tile + ((key >> 3) * CHUNKS + (dim >> 3)) * 64 + (key & 7) * 8);
                    mma_bf16(o[mt][2 * nn], p_frag[kk], v_frag[0], v_frag[1]);
                    mma_bf16(o[mt][2 * nn + 1], p_frag[kk], v_frag[2], v_frag[3]);
                }"""


def build(variant):
    source = kernels.module_source("attention")
    for old, new in {"both": [], "S on mma.sync": [(S_WGMMA, S_MMA_SYNC)],
                     "P V on mma.sync": [(PV_WGMMA, PV_MMA_SYNC)]}[variant]:
        assert source.count(old) == 1, variant
        source = source.replace(old, new)
    return cp.RawModule(code=source, options=kernels.compile_options(90))


if not kernels.warpgroup_mma():
    sys.exit("needs a GPU of compute capability 9.0 (H100, H200)")
reference = cp.zeros((n, H * D), cp.uint16)
run(kernels.get_kernel("attention", plan_of(1, False).kernel), plan_of(1, False), reference)
reference = to_float(reference)
print(f"{n} new tokens, GPU us per call")
for tiles in (1, 2):
    plan = plan_of(tiles, False)
    print(f"  mma.sync {plan.kernel}: {gpu_us(kernels.get_kernel('attention', plan.kernel), plan):.1f}")
for variant in ("both", "S on mma.sync", "P V on mma.sync"):
    module = build(variant)
    for tiles in (1, 2):
        plan = plan_of(tiles, True)
        function = module.get_function(plan.kernel)
        out = cp.zeros((n, H * D), cp.uint16)
        run(function, plan, out)
        error = np.abs(to_float(out) - reference).reshape(n, H, D).max(axis=(1, 2))
        bad = np.nonzero(error > 0.02)[0]
        print(f"  {variant}, {plan.kernel}: {gpu_us(function, plan):.1f}; max |x - mma.sync| "
              f"{error.max():.3g}, {len(bad)} tokens past 0.02"
              + (f" (first {bad[0]})" if len(bad) else ""), flush=True)
