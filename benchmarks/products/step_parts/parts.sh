#!/usr/bin/env bash
# What three parts of a Llama-3.2-1B batch-1 decode step add to it (ablate.py: the
# sampling kernel, the o_proj products, the embedding lookup left out), two rounds,
# beside main; then main's bench latency of three more presets and bench ttft.
#   OUT=DIR bash benchmarks/products/step_parts/parts.sh
# Run from the repository root on the GPU machine; random models go to /root/m.
set -u
export PYTHONUNBUFFERED=1 CUPY_LLAMA_CACHE=/root/cache PYTHONPATH=$PWD
T0=$SECONDS; A=benchmarks/products/step_parts/ablate.py
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
for p in llama-3.2-1b qwen3-0.6b gemma-3-1b qwen2.5-1.5b; do
  [ -d /root/m/$p ] || python3 scripts/make_random_model.py --preset $p /root/m/$p > /dev/null 2>&1 &
done
wait; echo "models $((SECONDS-T0))s"
mkdir -p $OUT/r
for i in 1 2; do
  for v in main nosample no_o noembed; do
    j=$OUT/r/lat_llama_${v}_$i
    timeout 150 python3 $A $v bench latency --device cuda --model /root/m/llama-3.2-1b --json $j.json > $j.log 2>&1
    echo "llama $v $i rc=$? $((SECONDS-T0))s $(grep -o '[0-9,.]* tok/s ([0-9.]* ms/token)' $j.log | head -1)"
  done
done
for p in qwen3-0.6b gemma-3-1b qwen2.5-1.5b; do
  j=$OUT/r/lat_${p}_main
  timeout 120 python3 -m cupy_llama.cli bench latency --device cuda --model /root/m/$p --json $j.json > $j.log 2>&1
  echo "$p rc=$? $((SECONDS-T0))s $(grep -o 'latency:.*' $j.log | head -1)"
done
j=$OUT/r/ttft_llama_main
timeout 150 python3 -m cupy_llama.cli bench ttft --device cuda --model /root/m/llama-3.2-1b --json $j.json > $j.log 2>&1
echo "ttft rc=$? $((SECONDS-T0))s $(grep -o 'ttft:.*' $j.log | tr '\n' ' ')"
cd $OUT && tar -czf r.tgz r
echo "all done $((SECONDS-T0))s"
