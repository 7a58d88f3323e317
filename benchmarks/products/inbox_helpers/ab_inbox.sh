#!/usr/bin/env bash
# The clustered decode kernels' shared inbox helpers against the attention.cu before them,
# each source in turn, two rounds: bench latency (batch 1: the clustered CUDA-core
# kernels) of random models of the llama-3.2-1b (head_dim 64), qwen3-0.6b (128) and
# gemma-3-1b (256) presets, and bench decode-sweep of the Llama one at batches 8, 16 and
# 64 (the clustered tensor-core kernel).
#   bash benchmarks/products/inbox_helpers/ab_inbox.sh OUT BASE_ATTENTION_CU
# (BASE_ATTENTION_CU: e.g. `git show 8d83a5e:cuda_src/attention.cu > /tmp/base.cu`). Run
# from the repository root on the GPU machine; attention.cu is swapped in place (one
# kernel cache for both) and put back at the end, or when the script stops early.
set -u
OUT=$1; BASE=$2
R=$PWD; T0=$SECONDS
export PYTHONUNBUFFERED=1
mkdir -p "$OUT/ab"
cp cuda_src/attention.cu /tmp/new_attention.cu
trap 'cp /tmp/new_attention.cu "$R/cuda_src/attention.cu"' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
for preset in llama-3.2-1b qwen3-0.6b gemma-3-1b; do
  PYTHONPATH=$R python3 scripts/make_random_model.py --preset $preset /tmp/m/$preset > /dev/null 2>&1 &
done
wait
echo "models $((SECONDS-T0))s"
for i in 1 2; do
  for v in base new; do
    if [ $v = base ]; then cp "$BASE" cuda_src/attention.cu; else cp /tmp/new_attention.cu cuda_src/attention.cu; fi
    for preset in llama-3.2-1b qwen3-0.6b gemma-3-1b; do
      j=$OUT/ab/latency_${preset}_${v}_$i
      PYTHONPATH=$R timeout 120 python3 -m cupy_llama.cli bench latency --device cuda --model /tmp/m/$preset --json $j.json > $j.log 2>&1
      echo "$preset $v $i rc=$? $((SECONDS-T0))s $(grep -o '[0-9,.]* tok/s' $j.log | head -1)"
    done
    j=$OUT/ab/sweep_llama-3.2-1b_${v}_$i
    PYTHONPATH=$R timeout 120 python3 -m cupy_llama.cli bench decode-sweep --device cuda --model /tmp/m/llama-3.2-1b --batch-sizes 8,16,64 --json $j.json > $j.log 2>&1
    echo "llama sweep $v $i rc=$? $((SECONDS-T0))s $(grep 'decode-sweep: batch' $j.log | sed 's/decode-sweep: batch //' | tr '\n' ' ')"
  done
done
cd "$OUT" && tar -czf ab.tgz ab && rm -rf ab
