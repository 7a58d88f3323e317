#!/usr/bin/env bash
# The decode attention kernels alone (scripts/attention_bench.py --decode-kernels, the
# Llama-3.2-1B attention shape) and `cupy-llama bench decode-sweep` of Llama-3.2-1B and
# Qwen3-0.6B random models past 8 sequences: this tree ("new") beside BASE_TREE ("base",
# a checkout of the commit before the tensor-core cluster's inboxes), alternating, ROUNDS
# rounds; the files are named as in h100/. Run from the repository root on a GPU:
#   bash benchmarks/products/mma_inbox/ab_decode.sh OUT_DIR BASE_TREE [MODELS_DIR]
set -eu
out=$(realpath -m "$1") base=$(realpath "$2") models=$(realpath -m "${3:-/tmp/inbox_models}")
rounds=${ROUNDS:-2} here=$PWD
mkdir -p "$out/decode_kernels" "$out/decode_sweep" "$models"
for preset in qwen3-0.6b llama-3.2-1b; do
  [ -d "$models/$preset" ] || python3 scripts/make_random_model.py --preset $preset "$models/$preset" > /dev/null
done
tree_of() { [ "$1" = base ] && echo "$base" || echo "$here"; }
for i in $(seq "$rounds"); do
  for tag in base new; do
    scratch=$(mktemp -d)
    (cd "$(tree_of $tag)" && OUT="$scratch" PYTHONPATH="$(tree_of $tag)" \
      python3 scripts/attention_bench.py --decode-kernels > "$out/decode_kernels/table_${tag}_$i.txt" 2>&1)
    mv "$scratch/decode_kernels.json" "$out/decode_kernels/decode_kernels_${tag}_$i.json"
    rmdir "$scratch"
    echo "kernels $tag round $i: $(grep 'decode b=8 ctx=512' "$out/decode_kernels/table_${tag}_$i.txt" | tail -1)"
  done
done
sweep() {  # preset tag round batches
  json=$out/decode_sweep/$1_$2_$3.json
  (cd "$(tree_of $2)" && PYTHONPATH="$(tree_of $2)" python3 -m cupy_llama.cli bench decode-sweep \
    --device cuda --model "$models/$1" --batch-sizes $4 --json "$json" > "${json%.json}.log" 2>&1)
  echo "$1 $2 round $3: $(grep 'decode-sweep: batch' "${json%.json}.log" | tr '\n' ' ')"
}
for i in $(seq "$rounds"); do
  for tag in base new; do
    sweep llama-3.2-1b $tag $i 8,16,32,64
    sweep qwen3-0.6b $tag $i 8,32,64
  done
done
