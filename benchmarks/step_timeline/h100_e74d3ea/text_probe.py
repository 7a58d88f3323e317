"""A steady 256-sequence LLMEngine.step() with and without text, on the CPU: the engine of
scripts/profile_host_path.py (its stub backend, the Llama-3.2-1B config and tokenizer),
bench decode-sweep's batch-256 workload (256 random 128-token prompts, 128 greedy tokens
each, EOS ignored), streamed with text (text=True) and with token ids only (text=False),
two runs each way in turn. Prints the median host time of the steps where every request
got a token.

    python3 benchmarks/step_timeline/h100_e74d3ea/text_probe.py
"""
import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))
import profile_host_path  # noqa: E402  (it puts this checkout's package on the path)
from cupy_llama.sampling import SamplingParams  # noqa: E402

BATCH, PROMPT, NEW_TOKENS = 256, 128, 128


def steady_step_ms(text: bool) -> float:
    args = argparse.Namespace(max_num_seqs=BATCH, max_num_batched_tokens=8192, seed=0,
                              no_prefix_caching=False, num_kv_blocks=65536)
    with tempfile.TemporaryDirectory() as folder:
        engine, _ = profile_host_path.make_engine(args, Path(folder), parts=False)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for _ in range(BATCH):
        engine.add_request([rng.randrange(1, 120_000) for _ in range(PROMPT)], params, text=text)
    steady = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        outputs = engine.step()
        if len(outputs) == BATCH:
            steady.append(time.perf_counter() - started)
    return 1e3 * statistics.median(steady)


for text in (True, False, True, False):
    print(f"text={text}: {steady_step_ms(text):.3f} ms a steady step")
