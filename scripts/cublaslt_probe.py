"""Whether cuBLASLt's own algorithm list beats the cuBLAS call that computes every product
of more than 16 rows today (gemm.cublas_linear, cublasGemmEx with the default algorithm),
in one command on the GPU machine:

    python3 scripts/cublaslt_probe.py [--rows 17,24,32,48,64,96,128,192,256]

For each product of a Llama-3.2-1B decode layer (qkv, o, gate/up, down and the LM head;
bf16 weights and rows, bf16 out, or float32 out added to as the residual products do) and
each row count, it times cuBLAS and every algorithm of cuBLASLt's heuristic list for the
same product (bf16 in, float32 compute), each as a CUDA graph of back-to-back calls over
enough weight copies that every call reads its weight from HBM, as in a decode step. It
prints microseconds per product (median of the graph's replays) for cuBLAS, cuBLASLt's
first choice and its fastest, and writes them to $OUT/cublaslt_probe.json (or --json)."""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout's package
from cupy_llama.bench.report import output_json_path, write_report  # noqa: E402
from cupy_llama.backends.cuda import cublaslt, gemm  # noqa: E402

CALLS = 16  # products per graph, each over its own weight copy where memory allows
RUNS = 15
# name, N (out features), K (in features), float32 out added to (the residual products)
SHAPES = (("qkv", 3072, 2048, False), ("o", 2048, 2048, True),
          ("gate_up", 16384, 2048, False), ("down", 2048, 8192, True),
          ("lm_head", 128256, 2048, False))


def graph_time_us(launch_calls) -> float:
    """Median GPU time of one call: launch_calls() issues CALLS products, captured once
    into a CUDA graph that is replayed RUNS times between events."""
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        launch_calls()  # outside the graph first: cuBLAS picks its kernels
        stream.synchronize()
        stream.begin_capture()
        launch_calls()
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        times = []
        for _ in range(RUNS):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) * 1000 / CALLS)
    return statistics.median(times)


def random_bf16(shape):
    import cupy
    return cupy.random.standard_normal(shape, dtype=np.float32).astype(cupy.float16).view(np.uint16)


def probe(lt, name: str, n: int, k: int, residual: bool, rows: list[int]) -> dict:
    import cupy
    copies = 2 if n * k * 2 > 256 << 20 else CALLS  # two LM heads already pass the L2
    weights = [random_bf16((n, k)) for _ in range(copies)]
    desc = lt.new_desc()
    lt.set_int(desc, cublaslt.DESC_TRANSA, cublaslt.CUBLAS_OP_T)
    lt.set_int(desc, cublaslt.DESC_TRANSB, cublaslt.CUBLAS_OP_N)
    a = lt.layout(cublaslt.CUDA_R_16BF, k, n, k)  # the weight, [K, N] column-major
    results = {}
    for m in rows:
        x = random_bf16((m, k))
        out = cupy.zeros((m, n), np.float32 if residual else np.uint16)
        b = lt.layout(cublaslt.CUDA_R_16BF, k, m, k)  # x, [K, M] column-major
        d = lt.layout(cublaslt.CUDA_R_32F if residual else cublaslt.CUDA_R_16BF, n, m, n)

        def with_cublas():
            for i in range(CALLS):
                gemm.cublas_linear(x, weights[i % copies], out, accumulate=residual)

        def with_lt(algo):
            def calls():
                stream = cupy.cuda.get_current_stream().ptr
                for i in range(CALLS):
                    lt.run(desc, algo, weights[i % copies], a, x, b, out, d,
                           1.0 if residual else 0.0, stream)
            return calls

        listed = lt.algorithms(desc, a, b, d, 32)
        lt_times = [graph_time_us(with_lt(algo)) for algo in listed]
        best = min(range(len(lt_times)), key=lt_times.__getitem__)
        results[m] = {"cublas_us": graph_time_us(with_cublas), "lt_first_us": lt_times[0],
                      "lt_best_us": lt_times[best], "lt_best_index": best,
                      "lt_listed": len(listed)}
        r = results[m]
        print(f"{name:8s} {m:4d} rows: cuBLAS {r['cublas_us']:7.2f} us, cuBLASLt first "
              f"{r['lt_first_us']:7.2f}, fastest {r['lt_best_us']:7.2f} (#{best} of "
              f"{len(listed)}): {r['cublas_us'] / r['lt_best_us']:.2f}x", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="17,24,32,48,64,96,128,192,256",
                        help="row counts, comma-separated")
    parser.add_argument("--json", help="write the results here (default: $OUT/cublaslt_probe.json)")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    lt = cublaslt.FP8Lt()  # its handle, workspace and preference serve any types
    report = {name: probe(lt, name, n, k, residual, rows) for name, n, k, residual in SHAPES}
    path = output_json_path(args.json, "cublaslt_probe.json")
    if path:
        write_report(path, report)


if __name__ == "__main__":
    main()
