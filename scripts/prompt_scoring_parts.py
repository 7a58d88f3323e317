"""Where scoring a prompt's rows goes on the GPU: the final norm and LM head of one piece of
rows, and the log-probability kernel over it, timed apart with CUDA events (median of 20
after 5 warm-up rounds), for k = 1 and 5 top tokens, at a piece of max_num_seqs rows and
at the largest piece the logits buffer holds (the backend's score_rows)
(docs/ARCHITECTURE.md, "Prompt log-probabilities").

    python3 scripts/prompt_scoring_parts.py MODEL_DIR [--json FILE]
"""
import argparse
import json
import sys

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    import cupy as cp

    from cupy_llama import LLM
    llm = LLM(args.model_dir, device="cuda", log=None)
    backend = llm.engine.backend
    model = backend.model
    report = {"model_dir": args.model_dir, "score_rows": backend.score_rows}
    for piece in sorted({backend.max_num_seqs, backend.score_rows}):
        buf = backend.buffers(piece, piece)
        residual = buf["residual"]
        residual[...] = cp.random.standard_normal(residual.shape).astype(residual.dtype)
        rows = cp.arange(piece, dtype=np.int32)
        targets = cp.random.randint(0, llm.config.vocab_size, piece).astype(np.int32)
        for k in (1, 5):
            values = cp.empty((piece, 1 + k), np.float32)
            ids = cp.empty((piece, 1 + k), np.int32)
            times = {"norm_and_lm_head_ms": [], "logprob_kernel_ms": []}
            for i in range(25):
                events = [cp.cuda.Event() for _ in range(3)]
                events[0].record()
                logits = model.logits_of(backend, residual, rows, buf)
                events[1].record()
                backend.ops.token_logprobs(logits, targets, k, values, ids)
                events[2].record()
                events[2].synchronize()
                if i >= 5:
                    times["norm_and_lm_head_ms"].append(
                        cp.cuda.get_elapsed_time(events[0], events[1]))
                    times["logprob_kernel_ms"].append(
                        cp.cuda.get_elapsed_time(events[1], events[2]))
            report[f"rows={piece} k={k}"] = {name: float(np.median(v))
                                              for name, v in times.items()}
    llm.close()
    text = json.dumps(report, indent=2)
    if args.json_path:
        with open(args.json_path, "w") as f:
            f.write(text + "\n")
    print(text, file=sys.stdout)


if __name__ == "__main__":
    main()
