#!/usr/bin/env bash
# A greedy step's sampling kernel without candidate slots (ops.py, tried and dropped: the
# copy of NOTES "Change 56"'s first call), the staged metadata copy (graphs.py) on top of
# it, and that tree with the sampling kernel left out (step_parts/ablate.py nosample),
# against main's two files, each in turn, two rounds: bench latency of four presets; then
# the GPU tests that sample.
#   OUT=DIR bash benchmarks/products/staged_copy/greedy_slots.sh BASE_DIR NEW_OPS NEW_GRAPHS
# BASE_DIR holds main's cupy_llama/backends/cuda/{ops,graphs}.py (as ops.py, graphs.py);
# NEW_OPS and NEW_GRAPHS the two files tried. Run from the repository root on the GPU
# machine; the files are swapped in place and put back at the end. Random models go to
# /root/m, results to OUT/r.tgz.
set -u
BASE=$1; NEW_OPS=$2; NEW_GRAPHS=$3
export PYTHONUNBUFFERED=1 CUPY_LLAMA_CACHE=/root/cache PYTHONPATH=$PWD
T0=$SECONDS; F=cupy_llama/backends/cuda/ops.py; G=cupy_llama/backends/cuda/graphs.py
A=benchmarks/products/step_parts/ablate.py
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
for p in llama-3.2-1b qwen3-0.6b gemma-3-1b qwen2.5-1.5b; do
  [ -d /root/m/$p ] || python3 scripts/make_random_model.py --preset $p /root/m/$p > /dev/null 2>&1 &
done
wait; echo "models $((SECONDS-T0))s"
cp $F /root/kept_ops.py; cp $G /root/kept_graphs.py
trap 'cp /root/kept_ops.py '$PWD/$F'; cp /root/kept_graphs.py '$PWD/$G EXIT
mkdir -p $OUT/r
for i in 1 2; do
  for v in base slots both nosample; do
    if [ $v = base ]; then cp $BASE/ops.py $F; else cp $NEW_OPS $F; fi
    if [ $v = slots ] || [ $v = base ]; then cp $BASE/graphs.py $G; else cp $NEW_GRAPHS $G; fi
    a=main; [ $v = nosample ] && a=nosample
    for p in llama-3.2-1b qwen3-0.6b gemma-3-1b qwen2.5-1.5b; do
      j=$OUT/r/lat_${p}_${v}_$i
      timeout 150 python3 $A $a bench latency --device cuda --model /root/m/$p --json $j.json > $j.log 2>&1
      echo "$p $v $i rc=$? $((SECONDS-T0))s $(grep -o '[0-9,.]* tok/s ([0-9.]* ms/token)' $j.log | head -1)"
    done
  done
done
cp $NEW_OPS $F; cp $NEW_GRAPHS $G
left=$((560 - SECONDS + T0)); [ $left -gt 30 ] || left=30
timeout $left python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_cuda_ops.py tests/test_cuda_graphs.py tests/test_cuda_penalties.py tests/test_cuda_structured.py > $OUT/r/gpu_tests.log 2>&1
echo "tests rc=$? $((SECONDS-T0))s $(tail -1 $OUT/r/gpu_tests.log)"
cd $OUT && tar -czf r.tgz r && rm -rf r
echo "all done $((SECONDS-T0))s"
