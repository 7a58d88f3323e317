"""Smoke test of the CUDA backend on the GPU machine, in one command:

    python3 scripts/selftest.py

Compiles every kernel module (printing the NVRTC log of any that fail), then runs a few
steps (prefill, chunked prefill mixed with decode, pure decode) of tiny random models on
the CPU reference backend and on the CUDA backend, and prints the largest logit difference.
Exit status 0 when everything compiles and the logits agree."""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout's package
from cupy_llama.interface import ForwardBatch
from cupy_llama.models import model_for, read_config
from cupy_llama.bench.random_model import make_random_model
from cupy_llama.weights import open_checkpoint
from cupy_llama.backends.cpu import CpuBackend
from cupy_llama.backends.cuda.device import check_cuda_device, cuda_usable
from cupy_llama.backends.cuda.kernels import compile_all

MAX_MODEL_LEN = 256
BLOCK_SIZE = 16
MODELS = {
    "tiny (head_dim 16, 4 heads / 2 kv heads, tied)": {},
    "head_dim 64, 8 heads / 2 kv heads, untied, llama3 rope": dict(
        hidden_size=512, num_attention_heads=8, num_key_value_heads=2, intermediate_size=768,
        vocab_size=1000, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64)),
}
# per step: new tokens of each sequence (0: the sequence sits this step out)
STEPS = [(40, 20, 0), (1, 30, 7), (1, 1, 100), (1, 1, 1)]
RELATIVE_TOLERANCE = 5e-2


def make_batch(prompts, computed, new_counts) -> ForwardBatch:
    blocks_per_seq = MAX_MODEL_LEN // BLOCK_SIZE
    token_ids, positions, slots, seq_lens, starts, tables = [], [], [], [], [0], []
    for b, n in enumerate(new_counts):
        if n == 0:
            continue
        table = np.arange(b * blocks_per_seq, (b + 1) * blocks_per_seq, dtype=np.int32)[::-1].copy()
        pos = np.arange(computed[b], computed[b] + n, dtype=np.int32)
        token_ids.append(np.asarray(prompts[b][computed[b]:computed[b] + n], np.int32))
        positions.append(pos)
        slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        seq_lens.append(computed[b] + n)
        starts.append(starts[-1] + n)
        tables.append(table)
    return ForwardBatch(token_ids=np.concatenate(token_ids), positions=np.concatenate(positions),
                        slot_mapping=np.concatenate(slots).astype(np.int32),
                        query_start_loc=np.asarray(starts, np.int32),
                        seq_lens=np.asarray(seq_lens, np.int32), block_tables=np.stack(tables),
                        max_query_len=max(n for n in new_counts if n),
                        max_seq_len=max(seq_lens))


def compare_model(name: str, overrides: dict, workdir: Path) -> bool:
    import cupy
    from cupy_llama.backends.cuda.backend import CudaBackend
    model_dir = make_random_model(workdir / f"model{len(list(workdir.iterdir()))}", "tiny",
                                  seed=0, **overrides)
    config = read_config(model_dir)
    checkpoint = open_checkpoint(model_dir, model_for(config))
    num_seqs = len(STEPS[0])
    num_blocks = num_seqs * MAX_MODEL_LEN // BLOCK_SIZE
    cpu = CpuBackend(model_for(config), checkpoint, max_model_len=MAX_MODEL_LEN, max_num_seqs=num_seqs,
                     block_size=BLOCK_SIZE, num_kv_blocks=num_blocks)
    gpu = CudaBackend(model_for(config), checkpoint, max_model_len=MAX_MODEL_LEN, max_num_seqs=num_seqs,
                      max_num_batched_tokens=128, block_size=BLOCK_SIZE,
                      num_kv_blocks=num_blocks, log=lambda m: print("   ", m))
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, config.vocab_size, 200)) for _ in range(num_seqs)]
    computed = [0] * num_seqs
    print(f"  {name} (CUDA graphs: {'on' if gpu.graphs is not None else 'OFF, ' + str(gpu.graphs_off_reason)})")
    ok = gpu.graphs is not None
    for step, new_counts in enumerate(STEPS):
        batch = make_batch(prompts, computed, new_counts)
        expected = cpu.forward(batch)
        started = time.perf_counter()
        got = cupy.asnumpy(gpu.forward(batch))  # decode steps replay CUDA graphs
        elapsed = time.perf_counter() - started
        diff = float(np.max(np.abs(got - expected)))
        scale = float(np.max(np.abs(expected)))
        same_argmax = np.array_equal(np.argmax(got, -1), np.argmax(expected, -1))
        good = np.isfinite(got).all() and diff <= RELATIVE_TOLERANCE * scale
        ok &= good
        print(f"    step {step} new tokens {new_counts}: max |logit diff| {diff:.3e} "
              f"(max |logit| {scale:.3e}), argmax equal {same_argmax}, GPU step {elapsed * 1e3:.1f} ms"
              f"{'' if good else '  <-- MISMATCH'}")
        for b, n in enumerate(new_counts):
            computed[b] += n
    return ok


def main() -> int:
    usable, why = cuda_usable()
    print(f"device: {why}")
    if not usable:
        return 1
    check_cuda_device()
    ok = True
    started = time.perf_counter()
    for module, error in compile_all().items():
        print(f"compile {module}: {'ok' if error is None else 'FAILED'}")
        if error is not None:
            print(error)
            ok = False
    print(f"compiled in {time.perf_counter() - started:.1f} s")
    if not ok:
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in MODELS.items():
            try:
                ok &= compare_model(name, overrides, Path(tmp))
            except Exception as e:  # report and go on with the next model
                import traceback
                traceback.print_exc()
                print(f"  {name}: FAILED with {type(e).__name__}: {e}")
                ok = False
    print("selftest passed" if ok else "selftest FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
