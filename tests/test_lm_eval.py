"""lm-evaluation-harness end to end: `lm_eval --model local-completions` against a real
`cupy-llama serve` on a tiny model, on the small local tasks in tests/lm_eval_tasks (a
multiple-choice task, scored by loglikelihood requests: echo with logprobs; and a
generate_until task). The harness tokenizes through the server (/tokenizer_info,
/tokenize, /detokenize: its "remote" tokenizer), so nothing is downloaded. Each item's
log-likelihood must equal the one computed here from the NumPy backend's logits at every
position, within 1e-3, and each generation the engine's own greedy text."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import logits_at_every_position, read_jsonl
from test_server import ServerProcess

from cupy_llama import LLM, SamplingParams

TASKS = Path(__file__).parent / "lm_eval_tasks"
# the harness's command: on PATH, or beside this interpreter (a virtual environment's
# python run without activating it)
LM_EVAL = shutil.which("lm_eval") or shutil.which("lm_eval", path=str(Path(sys.executable).parent))

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(LM_EVAL is None, reason="lm_eval is not installed "
                                 "(pip install -e '.[test]' installs it)")]


def run_lm_eval(url: str, out: Path) -> None:
    args = ",".join([f"base_url={url}/v1/completions", "model=tiny", "tokenizer_backend=remote",
                     "tokenized_requests=True", "num_concurrent=1", "max_retries=1",
                     "timeout=120"])
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(out / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    command = [LM_EVAL, "--model", "local-completions", "--model_args", args,
               "--tasks", "cupy_llama_tiny_mc,cupy_llama_tiny_gen",
               "--include_path", str(TASKS), "--output_path", str(out / "results"),
               "--log_samples", "--batch_size", "1"]
    done = subprocess.run(command, cwd=TASKS, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def samples(out: Path, task: str) -> list[dict]:
    [path] = (out / "results").rglob(f"samples_{task}_*.jsonl")
    return read_jsonl(path)


def continuation_loglikelihood(model_dir, tokenizer, context: str, continuation: str) -> float:
    """What lm-eval's loglikelihood request asks, computed here: the context and the
    context plus continuation tokenized as the harness does (without special tokens, the
    context's trailing spaces moved to the continuation), then the sum of the log-softmax
    of each continuation token after the tokens before it."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    num_context = len(tokenizer.encode(context, add_special_tokens=False))
    logits = logits_at_every_position(model_dir, whole).astype(np.float64)
    top = logits.max(axis=1, keepdims=True)
    scores = logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
    return float(sum(scores[p - 1, whole[p]] for p in range(num_context, len(whole))))


def test_lm_eval_scores_and_generates_through_serve(model_dir, tmp_path):
    server = ServerProcess(model_dir, "--served-model-name", "tiny", "--max-num-seqs", "4")
    try:
        run_lm_eval(server.url, tmp_path)
    finally:
        server.stop()
    llm = LLM(model_dir, device="cpu", log=None)
    tokenizer = llm.tokenizer
    checked = 0
    for sample in samples(tmp_path, "cupy_llama_tiny_mc"):
        arguments = sample["arguments"]
        pairs = [(a["arg_0"], a["arg_1"]) for a in arguments.values()] \
            if isinstance(arguments, dict) else [tuple(a) for a in arguments]
        for (context, continuation), response in zip(pairs, sample["resps"]):
            loglikelihood = float(response[0][0])
            expected = continuation_loglikelihood(model_dir, tokenizer, context, continuation)
            assert abs(loglikelihood - expected) < 1e-3, (context, continuation)
            checked += 1
    assert checked == 11  # every choice of the four questions
    generated = samples(tmp_path, "cupy_llama_tiny_gen")
    assert len(generated) == 3
    for sample in generated:
        arguments = sample["arguments"]
        prompt = (arguments["gen_args_0"]["arg_0"] if isinstance(arguments, dict)
                  else arguments[0][0])
        text = sample["resps"][0][0]
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        expected = llm.generate(ids, SamplingParams(temperature=0, max_tokens=8, stop=["\n"],
                                                    seed=1234)).text
        assert text == expected, prompt
