"""What evaluation harnesses send to /v1/completions: echo with logprobs (OpenAI's legacy
completions shape over the prompt and the completion, the first token's log-probability
null, text_offset counting from the start of the echoed prompt), max_tokens 0 with echo
(the prompt scored, nothing generated), and vLLM's prompt_logprobs on both endpoints;
checked against the engine's own prompt_logprobs and a NumPy forward pass."""
import numpy as np
import pytest

pytest.importorskip("fastapi")

from inprocess_server import ask, ask_one, make_state  # noqa: E402

from cupy_llama import SamplingParams  # noqa: E402
from cupy_llama.outputs import TokenStrings  # noqa: E402

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def state(model_dir, llm):
    return make_state(model_dir, llm)


def reference_scores(model_dir, prompt):
    """log-softmax after each prefix of prompt, [len(prompt), V], from one forward pass."""
    from conftest import logits_at_every_position
    x = logits_at_every_position(model_dir, prompt).astype(np.float64)
    top = x.max(axis=1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=1, keepdims=True))


def test_echo_with_logprobs_scores_the_prompt_in_the_legacy_shape(state, llm, model_dir):
    text = "The cat sat"
    prompt = llm.tokenizer.encode(text)
    body = {"prompt": text, "max_tokens": 3, "logprobs": 2, "echo": True, "temperature": 0}
    choice = ask_one(state, "POST", "/v1/completions", json=body).json()["choices"][0]
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=2))
    assert choice["text"] == text + plain.text
    legacy = choice["logprobs"]
    strings = TokenStrings(llm.tokenizer)
    assert legacy["tokens"] == [strings(t) for t in prompt + plain.token_ids]
    assert legacy["token_logprobs"][0] is None and legacy["top_logprobs"][0] is None
    scores = reference_scores(model_dir, prompt)
    for position in range(1, len(prompt)):
        expected = scores[position - 1, prompt[position]]
        assert abs(legacy["token_logprobs"][position] - expected) < 1e-4
        top = legacy["top_logprobs"][position]
        assert strings(prompt[position]) in top and 2 <= len(top) <= 3
    generated = [e.logprob for e in plain.logprobs]
    np.testing.assert_allclose(legacy["token_logprobs"][len(prompt):], generated, atol=1e-5)
    # text_offset: where each token's text starts in the echoed text
    offsets, pieces = legacy["text_offset"], legacy["tokens"]
    assert offsets == [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    assert len(legacy["tokens"]) == len(legacy["token_logprobs"]) == len(offsets)


def test_max_tokens_0_with_echo_scores_only(state, llm, model_dir):
    prompt = llm.tokenizer.encode("one two three four")
    body = {"prompt": prompt, "max_tokens": 0, "logprobs": 0, "echo": True}
    answer = ask_one(state, "POST", "/v1/completions", json=body).json()
    choice = answer["choices"][0]
    assert len(choice["logprobs"]["tokens"]) == len(prompt)
    assert answer["usage"]["completion_tokens"] == 0
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    scores = reference_scores(model_dir, prompt)
    got = choice["logprobs"]["token_logprobs"]
    np.testing.assert_allclose(got[1:], [scores[p - 1, prompt[p]] for p in range(1, len(prompt))],
                               atol=1e-4)
    assert choice["text"] == llm.tokenizer.decode(prompt, skip_special_tokens=False)
    # without echo, 0 is refused, naming the field
    refused = ask_one(state, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert refused.status == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_max_tokens_0_with_echo_ends_on_length(state, llm):
    """The token made to score the prompt is no stop the client asked for: where it is an
    EOS (logit_bias forces it here), the choice still ends on "length", whole and
    streamed, as any other token leaves it."""
    eos = min(llm.engine.eos_token_ids)
    body = {"prompt": "one two", "max_tokens": 0, "echo": True, "logit_bias": {str(eos): 100}}
    whole, streamed = ask(state, [
        ("POST", "/v1/completions", {"json": body}),
        ("POST", "/v1/completions", {"json": {**body, "stream": True}})])
    assert whole.status == 200 and streamed.status == 200, (whole.body, streamed.body)
    [choice] = whole.json()["choices"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("length", None)
    events = streamed.events()
    [last] = [c for e in events for c in e["choices"] if c["finish_reason"] is not None]
    assert (last["finish_reason"], last["stop_reason"]) == ("length", None)
    assert reassembled(events)[0][0]["text"] == choice["text"] == "one two"


def reassembled(events) -> tuple[dict, dict | None]:
    """A streamed completion's chunks put back together: {choice index: {"text",
    "logprobs", "finish_reason"}} (each logprobs list concatenated), and the usage chunk's
    usage."""
    choices, usage = {}, None
    for event in events:
        if not event["choices"]:
            usage = event["usage"]
            continue
        (chunk,) = event["choices"]
        choice = choices.setdefault(chunk["index"], {"text": "", "logprobs": None,
                                                     "finish_reason": None})
        choice["text"] += chunk["text"]
        if chunk["logprobs"] is not None:
            if choice["logprobs"] is None:
                choice["logprobs"] = {key: [] for key in chunk["logprobs"]}
            for key, values in chunk["logprobs"].items():
                choice["logprobs"][key] += values
        if chunk["finish_reason"] is not None:
            assert choice["finish_reason"] is None, "a choice finished twice"
            choice["finish_reason"] = chunk["finish_reason"]
    return choices, usage


@pytest.mark.parametrize("body", [
    {"prompt": "The cat sat", "max_tokens": 3, "logprobs": 2, "temperature": 0},
    {"prompt": ["one two", "The cat sat on"], "max_tokens": 4, "logprobs": 1, "n": 2,
     "temperature": 1.0, "seed": 5},
    {"prompt": [[5, 9, 14, 3], [7, 7, 2]], "max_tokens": 0, "logprobs": 0},
    {"prompt": "abc def", "max_tokens": 2, "n": 2, "temperature": 0},
], ids=["logprobs", "n2-two-prompts", "max-tokens-0-token-ids", "no-logprobs"])
def test_streamed_echo_reassembles_to_the_whole_body(state, body):
    body = {**body, "echo": True}
    whole, streamed = ask(state, [
        ("POST", "/v1/completions", {"json": body}),
        ("POST", "/v1/completions", {"json": {**body, "stream": True, "stream_options": {
            "include_usage": True}}})])
    assert whole.status == 200 and streamed.status == 200, (whole.body, streamed.body)
    expected = whole.json()
    events = streamed.events()
    choices, usage = reassembled(events)
    assert sorted(choices) == [c["index"] for c in expected["choices"]]
    for choice in expected["choices"]:
        got = choices[choice["index"]]
        assert got["text"] == choice["text"]
        assert got["finish_reason"] == choice["finish_reason"]
        assert got["logprobs"] == choice["logprobs"]  # tokens, logprobs, tops, text_offset
    assert usage == expected["usage"]
    # each choice's first chunk is its prompt, whole: the completion comes after it
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    n = body.get("n", 1)
    firsts = {}
    for event in events:
        for chunk in event["choices"]:
            firsts.setdefault(chunk["index"], chunk)
    for index, chunk in firsts.items():
        echoed = chunk["text"]
        assert expected["choices"][index]["text"].startswith(echoed)
        if isinstance(prompts[index // n], str):
            assert echoed == prompts[index // n]
        if chunk["logprobs"] is not None:
            assert chunk["logprobs"]["token_logprobs"][0] is None
            assert chunk["logprobs"]["text_offset"][0] == 0


def test_vllm_prompt_logprobs_on_both_endpoints(state, llm, model_dir):
    prompt = llm.tokenizer.encode("abc def")
    body = {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 1}
    choice = ask_one(state, "POST", "/v1/completions", json=body).json()["choices"][0]
    scored = choice["prompt_logprobs"]
    scores = reference_scores(model_dir, prompt)
    assert scored[0] is None and len(scored) == len(prompt)
    for position in range(1, len(prompt)):
        entry = scored[position][str(prompt[position])]
        row = scores[position - 1]
        assert abs(entry["logprob"] - row[prompt[position]]) < 1e-4
        best = int(np.argmax(row))
        assert scored[position][str(best)]["rank"] == 1
        # the token's own place, also where it is not the best (vLLM's: never null)
        own = row[prompt[position]]
        assert 1 + np.sum(row > own + 1e-4) <= entry["rank"] <= np.sum(row > own - 1e-4), entry
    chat = ask_one(state, "POST", "/v1/chat/completions",
                   json={"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 0}).json()
    chat_prompt = llm.tokenizer.encode_chat(CHAT, add_generation_prompt=True)
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(chat_prompt)
    assert all(list(entry) == [str(t)] for entry, t in zip(chat["prompt_logprobs"][1:],
                                                           chat_prompt[1:]))


def test_best_of_answers_the_n_most_likely_samples_and_counts_them_all(state, llm):
    sampled = {"temperature": 1.5, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": 11}
    body = {"prompt": "abc", "max_tokens": 5, "n": 2, "best_of": 5, **sampled}
    answer = ask_one(state, "POST", "/v1/completions", json=body).json()
    prompt = llm.tokenizer.encode("abc")
    samples = llm.generate(prompt, SamplingParams(n=5, max_tokens=5, logprobs=0, **sampled))
    ranked = sorted(samples, key=lambda o: -sum(e.logprob for e in o.logprobs))
    assert [c["text"] for c in answer["choices"]] == [o.text for o in ranked[:2]]
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in answer["choices"])
    assert answer["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in samples)
    for refused in ({"n": 3, "best_of": 2}, {"best_of": 2, "stream": True}):
        got = ask_one(state, "POST", "/v1/completions", json={"prompt": "x", **refused})
        assert got.status == 400 and got.json()["error"]["param"] == "best_of"
