"""Chat with the families' own formats and end-of-turn tokens, through LLM.chat, `cupy-llama
chat` and `cupy-llama serve` (the openai client, streamed): a Qwen3 model (ChatML,
<|im_end|>) and a Gemma 3 model (<start_of_turn>, <end_of_turn>).

A random model's reply is noise that need not ever end, so the models here are tiny random
ones with two dimensions of the residual stream taken over to script the reply: the
generation prompt's last token ("\\n") makes "!" the likeliest next token, and "!" makes the
end-of-turn token the likeliest. Every reply is "!" and then the turn's end, which must stop
it unseen; with ignore_eos the model goes on past it."""
import os
import subprocess
import sys

import numpy as np
import pytest

from cupy_llama import LLM, SamplingParams
from cupy_llama.bench.random_model import make_random_model
from cupy_llama.bf16 import bf16_bits_to_float32, float32_to_bf16_bits
from cupy_llama.checkpoint import write_safetensors
from cupy_llama.tokenizer import Tokenizer
from cupy_llama.weights import read_safetensors_header

FAMILIES = {"qwen3": (["Qwen3ForCausalLM"], "<|im_end|>"),
            "gemma3": (["Gemma3ForCausalLM"], "<end_of_turn>")}
BIG = 100.0  # what the two scripted dimensions hold; everything else is about 1


def script_reply(model_dir, end_of_turn: str) -> None:
    """Rewrite the weights so that "\\n" -> "!" -> end_of_turn (see the module doc)."""
    script_chain(model_dir, ["\n", "!", end_of_turn])


def script_chain(model_dir, chain: list[str]) -> None:
    """Rewrite the weights so that each token of the chain makes the next the likeliest
    (plain text of one token, or an added token's own text): for each pair, one dimension
    of every token's embedding is -BIG but the first's, +BIG, and only the second's LM-head
    row reads it. No layer writes those dimensions (their rows of o_proj and down are 0),
    so they reach the LM head as embedded."""
    tokenizer = Tokenizer.from_dir(model_dir)

    def token(text):
        token_id = tokenizer.token_to_id(text)
        if token_id is None:
            [token_id] = tokenizer.encode(text, add_special_tokens=False)
        return token_id

    path = model_dir / "model.safetensors"
    header = read_safetensors_header(path)
    data = path.read_bytes()
    tensors = {}
    for name, info in header.items():
        bits = np.frombuffer(data[info.start:info.start + info.nbytes], np.uint16).reshape(info.shape)
        tensors[name] = bf16_bits_to_float32(bits).copy()
    embed, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    ids = [token(text) for text in chain]
    for dim, (trigger, target) in enumerate(zip(ids, ids[1:])):
        embed[:, dim] = -BIG
        embed[trigger, dim] = BIG
        head[:, dim] = 0.0
        head[target, dim] = 1.0
    for name, tensor in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor[:len(ids) - 1, :] = 0.0
    write_safetensors(path, {name: float32_to_bf16_bits(t) for name, t in tensors.items()},
                      metadata={"format": "pt"})


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    architectures, end_of_turn = FAMILIES[request.param]
    model_dir = make_random_model(tmp_path_factory.mktemp(request.param) / "model", "tiny",
                                  seed=0, architectures=architectures, tie_word_embeddings=False)
    script_reply(model_dir, end_of_turn)
    return request.param, model_dir, end_of_turn


def test_the_reply_stops_at_the_end_of_turn_token(family):
    name, model_dir, end_of_turn = family
    llm = LLM(model_dir, device="cpu", log=None)
    eot = llm.tokenizer.token_to_id(end_of_turn)
    assert eot in llm.engine.eos_token_ids
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]
    prompt = llm.tokenizer.apply_chat_template(chat)
    assert prompt.endswith({"qwen3": "<|im_start|>assistant\n",
                            "gemma3": "<start_of_turn>model\n"}[name])
    reply = llm.chat(chat, SamplingParams(temperature=0, max_tokens=8))
    assert (reply.text, reply.token_ids[-1], reply.finish_reason) == ("!", eot, "stop")
    on = llm.chat(chat, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert on.token_ids[:2] == reply.token_ids and len(on.token_ids) == 8
    assert on.finish_reason == "length" and end_of_turn not in on.text


def test_the_chat_command_prints_the_reply(family):
    _, model_dir, _ = family
    result = subprocess.run([sys.executable, "-m", "cupy_llama.cli", "chat", "--model",
                             str(model_dir), "--device", "cpu", "--temperature", "0", "Hello?"],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "!"


def test_serve_streams_the_reply_and_stops_at_the_end_of_turn(family):
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from test_server import ServerProcess

    _, model_dir, _ = family
    server = ServerProcess(model_dir, "--served-model-name", "tiny")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                               timeout=60)
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello?"}], stream=True,
            max_tokens=8, temperature=0)
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert (text, reasons) == ("!", ["stop"])
    finally:
        assert server.stop() == 0, server.log_text()


@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "Qwen2ForCausalLM"])
def test_a_reply_of_tool_calls_renders_in_the_random_models_templates(tmp_path, architecture):
    """An assistant message that only calls tools has content null (OpenAI's form, and what
    `chat --tools` keeps); the ChatML templates of the random models render it as empty."""
    model_dir = make_random_model(tmp_path / "model", "tiny", architectures=[architecture])
    tokenizer = Tokenizer.from_dir(model_dir)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    text = tokenizer.apply_chat_template([
        {"role": "user", "content": "Go."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}])
    assert "<|im_start|>assistant\n<|im_end|>" in text and "done" in text
