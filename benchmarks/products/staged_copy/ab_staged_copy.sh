#!/usr/bin/env bash
# A decode replay's metadata copied beside the step before (graphs.py, NOTES "Change
# 56") against the graphs.py before it, each in turn: decode-sweep at batches 8, 16, 64
# and 256 (one round), bench latency of four presets (two rounds), bench throughput (two
# rounds); then the whole GPU suite on this tree.
#   OUT=DIR bash benchmarks/products/staged_copy/ab_staged_copy.sh BASE_GRAPHS
# BASE_GRAPHS: the graphs.py before the change (e.g. `git show 41d98d5:cupy_llama/backends/
# cuda/graphs.py > /tmp/graphs.py`). Run from the repository root on the GPU machine; the
# file is swapped in place and put back at the end. Random models go to /root/m, results
# to OUT/r.tgz.
set -u
BASE_GRAPHS=$1
export PYTHONUNBUFFERED=1 CUPY_LLAMA_CACHE=/root/cache PYTHONPATH=$PWD
T0=$SECONDS; G=cupy_llama/backends/cuda/graphs.py
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
for p in llama-3.2-1b qwen3-0.6b gemma-3-1b qwen2.5-1.5b; do
  [ -d /root/m/$p ] || python3 scripts/make_random_model.py --preset $p /root/m/$p > /dev/null 2>&1 &
done
wait; echo "models $((SECONDS-T0))s"
mkdir -p $OUT/r
cp $G /root/new_graphs.py; trap 'cp /root/new_graphs.py '$PWD/$G EXIT
use() { if [ $1 = base ]; then cp $BASE_GRAPHS $G; else cp /root/new_graphs.py $G; fi; }
for v in base new; do
  use $v; j=$OUT/r/sweep_llama_${v}_1
  timeout 100 python3 -m cupy_llama.cli bench decode-sweep --device cuda --model /root/m/llama-3.2-1b --batch-sizes 8,16,64,256 --json $j.json > $j.log 2>&1
  echo "sweep $v rc=$? $((SECONDS-T0))s $(grep 'decode-sweep: batch' $j.log | sed 's/decode-sweep: batch //' | tr '\n' ' ')"
done
for i in 1 2; do for v in base new; do
  use $v
  for p in llama-3.2-1b qwen3-0.6b gemma-3-1b qwen2.5-1.5b; do
    j=$OUT/r/lat_${p}_${v}_$i
    timeout 100 python3 -m cupy_llama.cli bench latency --device cuda --model /root/m/$p --json $j.json > $j.log 2>&1
    echo "$p $v $i rc=$? $((SECONDS-T0))s $(grep -o '[0-9,.]* tok/s ([0-9.]* ms/token)' $j.log | head -1)"
  done
done; done
for i in 1 2; do for v in base new; do
  use $v; j=$OUT/r/throughput_llama_${v}_$i
  timeout 100 python3 -m cupy_llama.cli bench throughput --device cuda --model /root/m/llama-3.2-1b --json $j.json > $j.log 2>&1
  echo "throughput $v $i rc=$? $((SECONDS-T0))s $(grep -o 'throughput:.*' $j.log | head -1)"
done; done
use new
timeout 400 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ > $OUT/r/gpu_tests_all.log 2>&1
echo "tests rc=$? $((SECONDS-T0))s $(tail -1 $OUT/r/gpu_tests_all.log)"
cd $OUT && tar -czf r.tgz r && rm -rf r
echo "all done $((SECONDS-T0))s"
