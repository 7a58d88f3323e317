#!/usr/bin/env bash
# The package as a user installs it: build the wheel, install it into a fresh virtual
# environment outside the checkout, check that every kernel source is inside, compile each
# installed .cu on its own with nvcc (sm_80 and sm_90, where nvcc is on PATH), and run a
# CPU generation from the installed package. Run from the repository root; CI calls it.
set -euo pipefail
root=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip wheel -q --no-deps -w "$work/dist" "$root"
wheel=$(ls "$work"/dist/cupy_llama-*.whl)
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --upgrade pip
"$work/venv/bin/python" -m pip install -q "$wheel"
cd "$work"  # nothing of the checkout on sys.path from here on
py="$work/venv/bin/python"
kernels=$("$py" -c "from cupy_llama.backends.cuda.kernels import kernel_dir; print(kernel_dir())")
case "$kernels" in
  "$work"/venv/*) ;;
  *) echo "the installed package reads its kernels from $kernels, not from itself"; exit 1 ;;
esac
for source in "$root"/cuda_src/*.cu "$root"/cuda_src/*.cuh; do
  cmp -s "$source" "$kernels/$(basename "$source")" || { echo "$(basename "$source") missing or different in the wheel"; exit 1; }
done
if command -v nvcc >/dev/null; then
  for arch in sm_80 sm_90; do
    for source in "$kernels"/*.cu; do
      nvcc -std=c++17 -arch=$arch -I"$kernels" -cubin -o "$work/out.cubin" "$source"
    done
  done
  echo "every installed .cu compiles on its own for sm_80 and sm_90"
else
  echo "nvcc not found: the installed kernels were not compiled"
fi
"$py" -c "from cupy_llama.bench.random_model import make_random_model; make_random_model('$work/model', 'tiny', seed=0)"
printf 'Hello there\nThe capital of France is\n' > "$work/prompts.txt"
"$work/venv/bin/cupy-llama" generate --model "$work/model" --input "$work/prompts.txt" \
  --device cpu --temperature 0 --max-tokens 8 --output "$work/out.jsonl"
[ "$(wc -l < "$work/out.jsonl")" -eq 2 ] || { echo "expected 2 result lines"; cat "$work/out.jsonl"; exit 1; }
"$py" -c "import json, sys; rows = [json.loads(l) for l in open('$work/out.jsonl')]; sys.exit(0 if all(r.get('usage', {}).get('completion_tokens') == 8 for r in rows) else 1)"
echo "the installed wheel generates on the CPU"
