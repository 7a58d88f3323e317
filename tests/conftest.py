"""Fixtures shared by the engine and CLI tests: one tiny random model per test module and
an LLM on the NumPy backend; the engine checks several test files make (every block free,
the prompt tokens the steps compute); the check of a one-line CLI error; and the tools of
scripts/ as modules."""
import importlib.util
import json
from contextlib import contextmanager
from pathlib import Path

import pytest

from cupy_llama import LLM
from cupy_llama.bench.random_model import make_random_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_random_model(tmp_path_factory.mktemp("tiny") / "model", "tiny", seed=0, std=0.15)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, device="cpu", log=None)


def assert_all_blocks_free(llm):
    """Nothing left of any request: every KV block back in the pool, none referenced."""
    blocks = llm.engine.blocks
    assert blocks.num_free_blocks == blocks.num_blocks
    blocks.check_invariants([])
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()


@contextmanager
def prompt_tokens_computed(llm):
    """Counts, per request id, the prompt tokens the steps inside the block compute (a
    prefix-cache hit or a forked sample computes fewer than its prompt)."""
    scheduler, counts = llm.engine.scheduler, {}
    schedule = scheduler.schedule

    def counting_schedule():
        batch = schedule()
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            if start < seq.num_prompt_tokens:
                counts[seq.request_id] = counts.get(seq.request_id, 0) + \
                    min(start + n, seq.num_prompt_tokens) - start
        return batch

    scheduler.schedule = counting_schedule
    try:
        yield counts
    finally:
        scheduler.schedule = schedule


def logits_at_every_position(model_dir, prompt, config=None):
    """The CPU backend's logits after every token of `prompt` in one prefill: each position
    a query range of its own over one block table (in reverse block order, so a block
    table the kernels read wrongly shows). config: the ModelConfig to run (default: the
    folder's)."""
    import numpy as np

    from cupy_llama.backends.cpu import CpuBackend
    from cupy_llama.interface import ForwardBatch
    from cupy_llama.models import model_for, read_config
    from cupy_llama.weights import open_checkpoint
    model = model_for(config or read_config(model_dir))
    n, block_size = len(prompt), 16
    num_blocks = -(-n // block_size)
    with open_checkpoint(model_dir, model) as checkpoint:
        backend = CpuBackend(model, checkpoint, max_model_len=max(256, n), max_num_seqs=n,
                             num_kv_blocks=num_blocks, block_size=block_size)
    table = np.arange(num_blocks, dtype=np.int32)[::-1].copy()
    positions = np.arange(n, dtype=np.int32)
    slots = table[positions // block_size] * block_size + positions % block_size
    batch = ForwardBatch(
        token_ids=np.asarray(prompt, np.int32), positions=positions,
        slot_mapping=slots.astype(np.int32), query_start_loc=np.arange(n + 1, dtype=np.int32),
        seq_lens=positions + 1, block_tables=np.repeat(table[None], n, axis=0),
        max_query_len=1, max_seq_len=n)
    return backend.forward(batch)


def read_jsonl(path: Path) -> list:
    """The objects of a JSON Lines file, split at "\n" only: a generated text may hold
    U+2028, U+0085 or other characters that str.splitlines also takes for line ends."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n")
            if line.strip()]


class ScriptedChannel:
    """The engine loop's channel to the server (engine/async_engine.py _EngineLoop), played
    from a script: each turn's messages, then none while the engine is busy, then stop
    once it is idle; what the loop sends is kept in `sent`."""

    def __init__(self, turns):
        self.turns, self.sent = list(turns), []

    def receive(self, wait):
        return self.turns.pop(0) if self.turns else [("stop",)] if wait else []

    def send(self, message):
        self.sent.append(message)


def one_error_line(err: str) -> str:
    """The one `error:` line, last on stderr (after any progress lines), no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in err, err
    return errors[0]


def script_module(name: str):
    """scripts/<name>.py as a module (the measurement tools live outside the package)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- tiny models whose chat templates offer tools (tests/fixtures/chat_templates) -------

CHAT_TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
# style -> (random_model shape overrides, template file, tokens added to the byte-level
# tokenizer as (text, special)), after the released tokenizers: Llama 3.1+'s
# <|python_tag|> and <|eom_id|> are special; Qwen2.5's <tool_call> tags are added tokens
# that are not special; Mistral's v11 tool tokens are special
TOOL_MODEL_STYLES = {
    "llama3_json": (dict(), "llama3.2_json_tools.jinja",
                    [("<|python_tag|>", True), ("<|eom_id|>", True)]),
    "hermes": (dict(architectures=["Qwen2ForCausalLM"]), "hermes_tools.jinja",
               [("<tool_call>", False), ("</tool_call>", False)]),
    "mistral": (dict(architectures=["MistralForCausalLM"]), "mistral_tools.jinja",
                [("[TOOL_CALLS]", True), ("[ARGS]", True), ("[CALL_ID]", True),
                 ("[AVAILABLE_TOOLS]", True), ("[/AVAILABLE_TOOLS]", True),
                 ("[TOOL_RESULTS]", True), ("[/TOOL_RESULTS]", True)]),
}


def make_tool_model(out_dir, style: str, seed: int = 0) -> Path:
    """A tiny random model (byte-level tokenizer) whose chat template and tokens are those
    of a tool-calling family: "llama3_json", "hermes" or "mistral"."""
    from tokenizers import AddedToken, Tokenizer

    overrides, template, tokens = TOOL_MODEL_STYLES[style]
    model_dir = make_random_model(out_dir, "tiny", seed=seed, std=0.15, **overrides)
    path = model_dir / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    for text, special in tokens:
        token = AddedToken(text, special=special, normalized=False)
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([token])
    tokenizer.save(str(path))
    (model_dir / "chat_template.jinja").write_text((CHAT_TEMPLATES / template).read_text())
    return model_dir


# two tools the tool-calling tests offer (test_tool_calls_engine.py, test_server_structured.py):
# bounded and patterned arguments, so a call that validates was made under the grammar
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["llama3_json", "hermes", "mistral"])
def tool_server(request, tmp_path_factory):
    """(model dir, LLM on the CPU) of a tool-calling tiny model in each template style."""
    model_dir = make_tool_model(tmp_path_factory.mktemp(request.param), request.param)
    llm = LLM(model_dir, device="cpu", log=None)
    yield model_dir, llm
    llm.close()
