"""What a launch of the warpgroup kernels' shape costs with nothing inside (NOTES "Tried,
dropped: products of 17 to 256 rows on TMA and warpgroup MMA"): a chain of 16 empty
kernels (384 threads, grid 128) that wait for the one before and let the next start
(griddepcontrol), replayed from a CUDA graph, for dynamic shared memory 0 / 80 / 160 /
197 KB, clusters of 1 / 4 / 8 CTAs, launched programmatically or not. Microseconds a
kernel, median of 30 replays. Runs on main (sm_90+):

    PYTHONPATH=. python3 benchmarks/products/warpgroup_tried/launch_cost.py OUT.json
"""
import ctypes
import json
import sys

import cupy as cp
import numpy as np

from cupy_llama.backends.cuda import launch
from cupy_llama.backends.cuda.kernels import opt_in_shared

SRC = r'''
extern "C" __global__ void __launch_bounds__(384, 1) empty(int cluster) {
    extern __shared__ unsigned char dynamic[];
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
    if (cluster > 1) {
        asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    }
    if (threadIdx.x == 0 && cluster < 0) dynamic[0] = 1;
}
'''
kernel = cp.RawModule(code=SRC, options=("-std=c++17",)).get_function("empty")
results = []
for smem_kb in (0, 80, 160, 197):
    smem = smem_kb * 1024
    opt_in_shared(kernel, smem)
    for cluster in (1, 4, 8):
        for programmatic in (False, True):
            stream = cp.cuda.Stream(non_blocking=True)
            def chain():
                for _ in range(16):
                    launch.launch(kernel, 128, 384, smem, stream.ptr, [ctypes.c_int(cluster)],
                                  programmatic, cluster=cluster)
            with stream:
                chain(); stream.synchronize()
                stream.begin_capture(); chain(); graph = stream.end_capture()
                times = []
                for _ in range(30):
                    a, b = cp.cuda.Event(), cp.cuda.Event()
                    a.record(stream); graph.launch(stream); b.record(stream); b.synchronize()
                    times.append(cp.cuda.get_elapsed_time(a, b) * 1000 / 16)
            row = dict(smem_kb=smem_kb, cluster=cluster, programmatic=programmatic,
                       us_per_kernel=float(np.median(times)))
            results.append(row)
            print(row, flush=True)
json.dump(results, open(sys.argv[1], "w"), indent=1)
