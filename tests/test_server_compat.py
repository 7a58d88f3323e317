"""What other OpenAI-compatible servers' clients expect of the same request (OpenAI's API
reference and vLLM's server): the legacy completions' logprobs, fields that change the
output (used or refused, never ignored), signed seeds, the shape of streams and bodies,
requests without "model", CORS, the routes without /v1. The application runs in this
process over the test's LLM (inprocess_server.py)."""
import pytest

pytest.importorskip("fastapi")

import re
from typing import get_args

import numpy as np
from inprocess_server import ask, ask_one, make_state

from cupy_llama import SamplingParams
from cupy_llama.sampling import model_sampling_defaults
from cupy_llama.outputs import TokenStrings
from cupy_llama.server import protocol
from cupy_llama.server.protocol import (APIError, ChatCompletionRequest, ChatMessage,
                                        CompletionRequest, DetokenizeRequest, StreamOptions,
                                        TokenizeRequest, parse)

PROMPT = [5, 17, 99, 3, 250, 41, 7]
CHAT = [{"role": "user", "content": "hi"}]
# sampling that often picks a token outside the top few (the model's defaults left aside)
SAMPLED = {"temperature": 1.5, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": 4}


@pytest.fixture
def state(model_dir, llm):
    return make_state(model_dir, llm)


# ---- #1: completions logprobs carry the sampled token -----------------------------------------

def test_completion_logprobs_add_the_sampled_token(state, llm):
    """OpenAI's legacy completions (API reference, Completions: logprobs "the API will
    always return the logprob of the sampled token, so there may be up to logprobs+1
    elements in the response") and vLLM's: top_logprobs at each position holds the
    `logprobs` most likely tokens plus the sampled one when it is not among them;
    logprobs 0 gives the sampled token alone."""
    from test_logprobs import reference_log_softmax
    strings = TokenStrings(llm.tokenizer)
    for k in (0, 1):
        body = {"prompt": PROMPT, "max_tokens": 12, "logprobs": k, **SAMPLED}
        choice = ask_one(state, "POST", "/v1/completions", json=body).json()["choices"][0]
        tokens = llm.generate(PROMPT, SamplingParams(max_tokens=12, **SAMPLED)).token_ids
        rows = reference_log_softmax(llm, PROMPT + tokens, len(PROMPT))
        legacy = choice["logprobs"]
        outside = 0
        for position, token in enumerate(tokens):
            row, top = rows[position], legacy["top_logprobs"][position]
            best = [int(t) for t in np.argsort(-row, kind="stable")[:k]]
            want = {strings(t) for t in best} | {strings(token)}
            assert set(top) == want, (k, position)
            if all(strings(t) != strings(token) for t in best if t != token):  # no merge
                assert top[strings(token)] == pytest.approx(row[token], abs=1e-4)
            assert len(top) <= k + 1
            outside += token not in best
        assert outside > 0  # some sampled tokens were outside the top k: the case at issue


def test_chat_top_logprobs_are_the_top_k_only(state, llm):
    """OpenAI's chat API reference (logprobs.content[].top_logprobs: "List of the most
    likely tokens and their log probability"): exactly top_logprobs entries, the sampled
    token not added; none without top_logprobs."""
    from test_logprobs import reference_log_softmax
    prompt = llm.tokenizer.encode_chat(CHAT)
    tokens = llm.generate(prompt, SamplingParams(max_tokens=8, **SAMPLED)).token_ids
    rows = reference_log_softmax(llm, prompt + tokens, len(prompt))
    for k in (0, 2):
        body = {"messages": CHAT, "max_tokens": 8, "logprobs": True, "top_logprobs": k,
                **SAMPLED}
        content = ask_one(state, "POST", "/v1/chat/completions",
                          json=body).json()["choices"][0]["logprobs"]["content"]
        for position, entry in enumerate(content):
            values = [alternative["logprob"] for alternative in entry["top_logprobs"]]
            assert len(values) == k
            assert np.allclose(values, np.sort(rows[position])[::-1][:k], atol=1e-4)


# ---- #2: every field is used or refused -------------------------------------------------------

# Fields accepted that change no output, and why.
NO_EFFECT = {
    "user": "an end-user id for abuse monitoring (OpenAI); no effect on the output",
    "model": "the one model served; a wrong name is a 404 (test_models)",
    "include_reasoning": "only with serve --reasoning-parser (tests/test_reasoning.py); "
                         "without one a reply is all content",
}
# A value for each field that differs from its default, valid on its own.
SAMPLE = {
    "temperature": 0.5, "top_p": 0.5, "top_k": 3, "min_p": 0.1, "seed": 9, "stop": ["x"],
    "n": 2, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    "max_tokens": 3, "max_completion_tokens": 3, "top_logprobs": 2,
    "add_generation_prompt": False, "continue_final_message": True,
    "chat_template_kwargs": {"flavour": "x"}, "add_special_tokens": True,
    "return_token_strs": True, "prompt": "xyz", "messages": [{"role": "user", "content": "ok"}],
    "tokens": [1, 2], "include_usage": False, "continuous_usage_stats": True, "name": "ann",
    "content": "other", "role": "assistant", "logprobs": True,  # (_body: 2 for completions)
    "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"},
    "guided_json": {"type": "object"}, "guided_regex": "a+", "guided_choice": ["a", "b"],
    "guided_grammar": "start: \"a\"", "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "required", "parallel_tool_calls": False,
    "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    "tool_call_id": "1", "reasoning": "hm", "reasoning_content": "hm",
    "frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.2,
    "logit_bias": {"1": 5}, "min_tokens": 2, "stop_token_ids": [1], "bad_words": ["x"],
    "include_stop_str_in_output": True, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "echo": True, "prompt_logprobs": 1,
    "best_of": 3, "allowed_token_ids": [1, 2], "return_tokens_as_token_ids": True,
    "truncate_prompt_tokens": 2,
    "grammar": "root ::= \"a\"", "json_schema": {"type": "object"},
    "functions": [{"name": "f"}],  # (a request's function_call, and an assistant message's:)
    "function_call": {"name": "f", "arguments": "{}"},
    "chat_template": "{% for m in messages %}[{{ m.content }}]{% endfor %}",
}
# where a field's default differs by endpoint: the value to try there
SAMPLE_ON = {(CompletionRequest, "add_special_tokens"): False}
# A value for each refused field that is not one of its harmless ones (suffix: refused by
# this tokenizer, which has no fill-in-the-middle tokens; test_fim.py takes it on one that has).
REFUSED_VALUE = {"modalities": ["audio"], "use_beam_search": True, "suffix": "end",
                 "audio": {"voice": "x"}, "web_search_options": {}}
# refused on one endpoint only: chat's echo and best_of; legacy completions' are done
REFUSED_ON = {(ChatCompletionRequest, "echo"): True, (ChatCompletionRequest, "best_of"): 3}
BASE = {CompletionRequest: {"prompt": "abc"}, ChatCompletionRequest: {"messages": CHAT},
        TokenizeRequest: {"messages": CHAT}, DetokenizeRequest: {"tokens": [3]}}


def _effect(tokenizer, vocab, defaults, model, body):
    """Everything a request decides: its prompt ids and SamplingParams, the response body
    and stream chunks built from fixed outputs, /tokenize's and /detokenize's answers."""
    from cupy_llama.outputs import RequestOutput, TokenLogprob
    request = parse(model, body)
    if model is DetokenizeRequest:
        return request.text(tokenizer, vocab)
    if model is TokenizeRequest:
        return request.response(tokenizer, request.token_ids(tokenizer), 64)
    prompts, params = request.engine_inputs(tokenizer, vocab, 64, defaults)
    strings = TokenStrings(tokenizer)
    logprobs = [TokenLogprob(4, -1.0, [(4, -1.0), (6, -2.0)]),
                TokenLogprob(5, -1.5, [(7, -1.0), (5, -1.5)])]
    outputs = [[RequestOutput("r", p, [4, 5], "de", "stop", index=j, logprobs=logprobs)
                for j in range(request.n)] for p in prompts]
    stream_class = (protocol.CompletionStream if model is CompletionRequest
                    else protocol.ChatCompletionStream)
    stream = stream_class(request, "id", 1, "m", strings, "fp")
    chunks = stream.chunks(0, "de", [4, 5], [(4, -1.0, [(4, -1.0)])], "stop",
                           protocol.usage(3, 2))
    return prompts, params, request.response_body("id", 1, "m", outputs, strings, "fp"), \
        chunks if request.stream else None


def _fields(model):
    """The dotted names of a model's fields and of the fields of the models inside it."""
    for name, info in model.model_fields.items():
        yield name
        for inner in (StreamOptions, ChatMessage):
            if inner in get_args(info.annotation) or any(
                    inner in get_args(a) for a in get_args(info.annotation)):
                yield from (f"{name}.{leaf}" for leaf in inner.model_fields)


def _body(model, dotted: str, value) -> dict:
    """The model's base request with the field set to value (and what it needs beside)."""
    body = dict(BASE[model])
    head, _, leaf = dotted.partition(".")
    if head == "messages" and leaf:
        role = {"tool_calls": "assistant", "function_call": "assistant",
                "tool_call_id": "tool"}.get(leaf, "user")
        body["messages"] = [{"role": role, "content": "hi", leaf: value}]
    elif head == "stream_options":
        body.update(stream=True, stream_options={"include_usage": True})
        if leaf:
            body["stream_options"][leaf] = value
    elif model is TokenizeRequest and head in ("prompt", "messages"):
        body = {head: value}
    else:
        body[head] = value
    if head == "continue_final_message":
        body.update(add_generation_prompt=False,
                    messages=CHAT + [{"role": "assistant", "content": "I am"}])
    if head == "top_logprobs":
        body["logprobs"] = True
    if head in ("tool_choice", "parallel_tool_calls"):
        body["tools"] = SAMPLE["tools"]
    if head == "function_call":
        body["functions"] = SAMPLE["functions"]
    if head == "parallel_tool_calls":
        body["tool_choice"] = "required"
    if head in ("logprobs", "return_tokens_as_token_ids"):
        body["logprobs"] = True if model is ChatCompletionRequest else 2
    return body


def test_every_field_is_used_or_refused(llm):
    """Issue: a field that changes the output must never pass silently. For every field of
    every request model (and of the models inside them), a value other than its default
    either changes what the request decides (its prompt, its SamplingParams, its response
    or stream, /tokenize's and /detokenize's answers) or is a 400 naming it; NO_EFFECT
    lists the few that change nothing, and why. A new field fails here until it is one of
    those."""
    from cupy_llama.tokenizer import Tokenizer
    # (calls in the Hermes format: {# <tool_call> #} names it)
    template = ("{# <tool_call> #}{% if tools %}<t{{ tools | length }}>{% endif %}"
                "{% for m in messages %}<{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}>"
                "{{ m.content }}{% if m.tool_calls %}<c{{ m.tool_calls | length }}>{% endif %}"
                "{{ m.reasoning | default('') }}"
                "{{ m.tool_call_id | default('') }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}{{ flavour | default('') }}")
    tokenizer = Tokenizer(llm.tokenizer._backend, template, llm.tokenizer.bos_token,
                          llm.tokenizer.eos_token, add_bos=True)
    vocab, defaults = llm.config.vocab_size, model_sampling_defaults(llm.config.generation_config)
    wrong = []
    for model in (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest):
        baseline = _effect(tokenizer, vocab, defaults, model, BASE[model])
        for dotted in _fields(model):
            leaf = dotted.rsplit(".", 1)[-1]
            where = f"{model.__name__}.{dotted}"
            if leaf in NO_EFFECT:
                continue
            only_here = REFUSED_ON.get((model, leaf))
            refused = leaf in protocol.UNSUPPORTED or leaf in REFUSED_VALUE or only_here is not None
            value = (only_here if only_here is not None else REFUSED_VALUE.get(leaf)) if refused \
                else SAMPLE_ON.get((model, leaf), SAMPLE.get(leaf, SAMPLE))
            if value is SAMPLE or value is None:
                wrong.append(f"{where}: no value to try; add it to SAMPLE or REFUSED_VALUE")
                continue
            try:
                effect = _effect(tokenizer, vocab, defaults, model, _body(model, dotted, value))
            except APIError as e:
                if not (refused and e.status == 400 and e.param and e.param.endswith(leaf)):
                    wrong.append(f"{where}: refused ({e.param}: {e.message})")
                continue
            if refused:
                wrong.append(f"{where}: {value!r} passed")
            elif effect == baseline:
                wrong.append(f"{where}: {value!r} changed nothing")
    assert not wrong, "\n".join(wrong)


def test_allowed_token_ids_on_both_endpoints(state, llm):
    """vLLM's allowed_token_ids (its SamplingParams: "only these token ids may be
    generated"), on /v1/completions and /v1/chat/completions: greedy text equals the
    engine's under the same ids, which test_allowed_token_ids checks against a masked
    argmax; ids outside the vocabulary, an empty list, and a second constraint beside it
    are 400s naming allowed_token_ids."""
    allowed = [5, 17, 64, 98, 200, 250]
    greedy = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    chat_prompt = llm.tokenizer.encode_chat(CHAT)
    for path, body, prompt in (("/v1/completions", {"prompt": PROMPT}, PROMPT),
                               ("/v1/chat/completions", {"messages": CHAT}, chat_prompt)):
        want = llm.generate(prompt, SamplingParams(allowed_token_ids=allowed, **greedy))
        assert set(want.token_ids) <= set(allowed) and len(want.token_ids) == 8
        plain = llm.generate(prompt, SamplingParams(**greedy))
        assert plain.text != want.text, "the ids changed nothing: the test proves nothing"
        answer = ask_one(state, "POST", path, json={**body, **greedy,
                                                    "allowed_token_ids": allowed})
        assert answer.status == 200, answer.body
        choice = answer.json()["choices"][0]
        assert choice.get("text", (choice.get("message") or {}).get("content")) == want.text
        vocab = llm.config.vocab_size
        for value, words in (([1, vocab], f"token id {vocab}, outside the vocabulary"),
                             ([], "non-empty list")):
            bad = ask_one(state, "POST", path, json={**body, "allowed_token_ids": value})
            assert bad.status == 400, (path, value)
            assert words in bad.json()["error"]["message"]
        both = ask_one(state, "POST", path, json={**body, "allowed_token_ids": allowed,
                                                  "guided_regex": "a+"})
        error = both.json()["error"]
        assert both.status == 400 and error["param"] == "allowed_token_ids"
        assert error["message"].startswith("allowed_token_ids and guided_regex both")


# ---- /tokenize takes vLLM's chat options; chat completions take chat_template_kwargs ------------

def test_tokenize_takes_the_chat_options_vllm_takes(state, llm):
    """vLLM's /tokenize (TokenizeChatRequest): add_generation_prompt (default true),
    continue_final_message (the last message left open), chat_template_kwargs, and
    add_special_tokens (default false for messages); return_token_strs."""
    tokenizer = llm.tokenizer
    chat = CHAT + [{"role": "assistant", "content": "Hello the"}]

    def tokens(**body):
        answer = ask_one(state, "POST", "/tokenize", json=body)
        assert answer.status == 200, answer.body
        return answer.json()

    assert tokens(messages=CHAT)["tokens"] == tokenizer.encode_chat(CHAT)
    assert tokens(messages=CHAT, add_generation_prompt=False)["tokens"] == \
        tokenizer.encode_chat(CHAT, add_generation_prompt=False)
    open_ended = tokens(messages=chat, add_generation_prompt=False,
                        continue_final_message=True)["tokens"]
    text = tokenizer.decode(open_ended, skip_special_tokens=False)
    assert text.endswith("Hello the")  # no end-of-turn after the last message
    closed = tokenizer.decode(tokenizer.encode_chat(chat, add_generation_prompt=False),
                              skip_special_tokens=False)
    assert closed.startswith(text) and len(closed) > len(text)
    both = ask_one(state, "POST", "/tokenize", json={"messages": chat,
                                                      "continue_final_message": True})
    assert both.status == 400 and both.json()["error"]["param"] == "continue_final_message"
    bad = ask_one(state, "POST", "/tokenize", json={"messages": CHAT,
                                                     "chat_template_kwargs": {"messages": 1}})
    assert bad.status == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
    prefixed = tokens(messages=CHAT, add_special_tokens=True)["tokens"]
    assert prefixed == tokenizer.encode("", add_special_tokens=True) + tokenizer.encode_chat(CHAT)
    strs = tokens(prompt="abc", return_token_strs=True)
    assert strs["token_strs"] == [tokenizer.id_to_token(t) for t in strs["tokens"]]
    empty = ask_one(state, "POST", "/tokenize", json={"messages": []})  # was a 500
    assert empty.status == 400 and empty.json()["error"]["param"] == "messages"


def test_chat_template_kwargs_reach_the_template(model_dir, llm, tmp_path):
    """vLLM's chat_template_kwargs on /v1/chat/completions: variables for the chat
    template (the Python API's and the command line's chat_template_kwargs); invalid ones
    are a 400 naming the field."""
    import shutil
    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if flavour is defined %}[{{ flavour }}]{% endif %}assistant:")
    state = make_state(folder, llm)
    body = {"messages": CHAT, "max_tokens": 1, "temperature": 0}
    plain, spiced, bad = ask(state, [
        ("POST", "/v1/chat/completions", {"json": body}),
        ("POST", "/v1/chat/completions", {"json": {**body, "chat_template_kwargs":
                                                   {"flavour": "salty"}}}),
        ("POST", "/v1/chat/completions", {"json": {**body, "chat_template_kwargs":
                                                   {"add_generation_prompt": False}}})])
    assert plain.status == spiced.status == 200
    grew = spiced.json()["usage"]["prompt_tokens"] - plain.json()["usage"]["prompt_tokens"]
    assert grew == len(state.tokenizer.encode("[salty]", add_special_tokens=False))
    assert bad.status == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


MARKED = ("MARK:{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
          "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_a_request_chat_template_renders_as_llm_chat_does(model_dir, llm):
    """vLLM's chat_template on /v1/chat/completions and /tokenize (ChatCompletionRequest,
    TokenizeChatRequest: "A Jinja template to use for this conversion"), taken only from a
    server started with --trust-request-chat-template, as vLLM's: the prompt is what the
    template renders, and the reply equals LLM.chat's with the same template; a template
    that does not compile or render is a 400 naming chat_template and quoting the error."""
    trusting = make_state(model_dir, llm, trust_request_chat_template=True)
    tokenizer = trusting.tokenizer
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    rendered = "MARK:<user>hi<assistant>"
    want = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                    chat_template=MARKED)
    assert want.prompt_token_ids == tokenizer.encode_chat(CHAT, chat_template=MARKED)
    assert tokenizer.decode(want.prompt_token_ids, skip_special_tokens=False) == rendered
    assert want.prompt_token_ids != tokenizer.encode_chat(CHAT)
    chat, tokens, syntax, raising, plain_prompt = ask(trusting, [
        ("POST", "/v1/chat/completions", {"json": {**body, "chat_template": MARKED}}),
        ("POST", "/tokenize", {"json": {"messages": CHAT, "chat_template": MARKED}}),
        ("POST", "/v1/chat/completions", {"json": {**body, "chat_template": "{% if %}"}}),
        ("POST", "/v1/chat/completions", {"json": {
            **body, "chat_template": "{{ raise_exception('no users here') }}"}}),
        ("POST", "/tokenize", {"json": {"prompt": "x", "chat_template": MARKED}})])
    assert chat.status == 200, chat.body
    answer = chat.json()
    assert answer["choices"][0]["message"]["content"] == want.text
    assert answer["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert tokens.json()["tokens"] == want.prompt_token_ids
    empty = ask_one(trusting, "POST", "/v1/chat/completions",
                    json={**body, "chat_template": "{# nothing #}"})
    for bad, words in ((syntax, "chat_template is not valid jinja ("),
                       (raising, "chat_template: no users here"),
                       (empty, "chat_template renders these messages as no text")):
        error = bad.json()["error"]
        assert bad.status == 400 and error["param"] == "chat_template", bad.body
        assert error["message"].startswith(words)
    assert plain_prompt.status == 400 and plain_prompt.json()["error"]["param"] == "chat_template"
    refusing = make_state(model_dir, llm)
    for path, extra in (("/v1/chat/completions", body), ("/tokenize", {"messages": CHAT})):
        refused = ask_one(refusing, "POST", path, json={**extra, "chat_template": MARKED})
        error = refused.json()["error"]
        assert refused.status == 400 and error["param"] == "chat_template"
        assert "--trust-request-chat-template" in error["message"]
    wrong_type = ask_one(trusting, "POST", "/v1/chat/completions",
                         json={**body, "chat_template": 5})
    assert wrong_type.status == 400 and wrong_type.json()["error"]["param"] == "chat_template"


def test_a_request_names_one_of_the_models_templates(model_dir, llm, tmp_path):
    """A model whose tokenizer_config.json lists named templates and none called "default"
    (transformers loads it and fails only a chat that names none): a chat that names one
    renders it without --trust-request-chat-template, as LLM.chat does; one that names none
    is a 400 that lists them (the built-in Llama 3 format, which this model's vocabulary
    would get without a template, does not stand in for the model's own)."""
    import json
    import shutil
    folder = tmp_path / "named"
    shutil.copytree(model_dir, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config["chat_template"] = [{"name": "marked", "template": MARKED}]
    config_path.write_text(json.dumps(config))
    state = make_state(folder, llm)
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    want = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                    chat_template=MARKED)
    named, tokens, other, unnamed = ask(state, [
        ("POST", "/v1/chat/completions", {"json": {**body, "chat_template": "marked"}}),
        ("POST", "/tokenize", {"json": {"messages": CHAT, "chat_template": "marked"}}),
        ("POST", "/v1/chat/completions", {"json": {**body, "chat_template": "marks"}}),
        ("POST", "/v1/chat/completions", {"json": body})])
    assert named.status == 200, named.body
    assert named.json()["choices"][0]["message"]["content"] == want.text
    assert named.json()["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert tokens.json()["tokens"] == want.prompt_token_ids
    # any other text is a template of the request's own, which still needs the flag
    message = other.json()["error"]["message"]
    assert other.status == 400 and "(send one's name: 'marked')" in message
    assert "--trust-request-chat-template" in message
    assert unnamed.status == 400, unnamed.body
    assert "lists chat templates ('marked') but none named 'default'" in \
        unnamed.json()["error"]["message"]


def test_max_new_tokens_is_a_requests_default_length(model_dir, llm, tmp_path):
    """generation_config.json's max_new_tokens is the length of a request that leaves
    max_tokens out, as vLLM takes it: a chat's (in place of the context's room) and a
    completion's below OpenAI's 16; a request's own max_tokens stands."""
    import json
    import shutil
    folder = tmp_path / "short"
    shutil.copytree(model_dir, folder)
    gen_path = folder / "generation_config.json"
    gen_path.write_text(json.dumps({**json.loads(gen_path.read_text()), "max_new_tokens": 5}))
    state = make_state(folder, llm)
    plain = {"temperature": 0, "ignore_eos": True}
    chat, completion, own = ask(state, [
        ("POST", "/v1/chat/completions", {"json": {"messages": CHAT, **plain}}),
        ("POST", "/v1/completions", {"json": {"prompt": "Hi", **plain}}),
        ("POST", "/v1/chat/completions", {"json": {"messages": CHAT, "max_tokens": 8,
                                                   **plain}})])
    for answer, length in ((chat, 5), (completion, 5), (own, 8)):
        assert answer.status == 200, answer.body
        assert answer.json()["usage"]["completion_tokens"] == length
        assert answer.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("flag, setting", [
    ("--trust-request-chat-template", "trust_request_chat_template"),
    ("--exclude-tools-when-tool-choice-none", "exclude_tools_when_tool_choice_none")])
def test_serve_takes_vllms_flags(model_dir, monkeypatch, flag, setting):
    """serve's flags named as vLLM's reach the server's settings; off by default."""
    from cupy_llama.cli import main
    from cupy_llama.server import app
    seen = []

    def fake_run_server(settings, sock, tokenizer, config):
        seen.append(getattr(settings, setting))
        sock.close()

    monkeypatch.setattr(app, "run_server", fake_run_server)
    for flags in ([], [flag]):
        assert main(["serve", "--model", str(model_dir), "--port", "0", "--device", "cpu",
                     *flags]) == 0
    assert seen == [False, True]


# ---- #3: signed seeds ---------------------------------------------------------------------------

def test_negative_seeds_are_accepted_as_vllm_accepts_them(state):
    """vLLM's seed: any signed 64-bit integer, -1 meaning none (a fresh seed per request,
    test_server_protocol.py). Another negative seed means the unsigned seed of its 64 bits,
    deterministically; past the 64-bit range is a 400."""
    body = {"prompt": "abc", "max_tokens": 8, **SAMPLED}
    answers = ask(state, [("POST", "/v1/completions", {"json": {**body, "seed": seed}})
                          for seed in (-2, -2, 2**64 - 2, -2**63, -2**63 - 1, 2**64)])
    texts = [a.json()["choices"][0]["text"] if a.status == 200 else a.status for a in answers]
    assert texts[0] == texts[1] == texts[2] and isinstance(texts[3], str)
    assert texts[4:] == [400, 400]
    assert answers[4].json()["error"]["param"] == "seed"


# ---- #4: stream and response shape -------------------------------------------------------------

def test_chat_streams_open_with_the_role_and_bodies_carry_a_fingerprint(state, model_dir, llm):
    """OpenAI's chat stream: the first chunk's delta is {"role": "assistant", "content": ""}
    and the text starts in the next; system_fingerprint on chat completions and chunks
    (chat completion object reference), the same for the same model and device and another
    for another model."""
    body = {"messages": CHAT, "max_tokens": 4, "temperature": 0}
    streamed, whole = ask(state, [("POST", "/v1/chat/completions",
                                   {"json": {**body, "stream": True, "n": 2}}),
                                  ("POST", "/v1/chat/completions", {"json": body})])
    events = streamed.events()
    for index in (0, 1):
        mine = [e for e in events if e["choices"][0]["index"] == index]
        assert mine[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in e["choices"][0]["delta"] for e in mine[1:])
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in mine) != ""
    fingerprint = whole.json()["system_fingerprint"]
    assert re.fullmatch(r"fp_[0-9a-f]{10}", fingerprint)
    assert {e["system_fingerprint"] for e in events} == {fingerprint}
    assert protocol.system_fingerprint(model_dir, "cpu") == fingerprint
    assert protocol.system_fingerprint(model_dir, "cuda") != fingerprint


def test_continuous_usage_stats_put_usage_on_every_chunk(state):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk
    carries the usage so far; the last chunk the whole request's."""
    body = {"prompt": "abc", "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = ask_one(state, "POST", "/v1/completions", json=body).events()
    *chunks, last = events
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"] for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 6 == last["usage"]["completion_tokens"]
    plain = ask_one(state, "POST", "/v1/completions",
                    json={**body, "stream_options": {"include_usage": True}}).events()
    assert all(c["usage"] is None for c in plain[:-1])


def test_a_request_without_model_is_served_by_the_only_model(state):
    """vLLM serves a request that names no model with its one model; a wrong name stays a
    404."""
    served, wrong = ask(state, [
        ("POST", "/v1/chat/completions", {"json": {"messages": CHAT, "max_tokens": 2}}),
        ("POST", "/v1/chat/completions", {"json": {"messages": CHAT, "model": "other"}})])
    assert served.status == 200 and served.json()["model"] == "m"
    assert wrong.status == 404 and wrong.json()["error"]["code"] == "model_not_found"


# ---- #5: CORS -------------------------------------------------------------------------------------

def test_cors_is_off_by_default_and_follows_the_allowed_origins(model_dir, llm):
    """vLLM's --allowed-origins / --allowed-methods / --allowed-headers (Starlette's CORS
    middleware; the Fetch standard's preflight): by default no cross-origin access; with an
    allowed origin, a preflight from it is answered and a cross-origin request carries
    Access-Control-Allow-Origin, while another origin gets neither."""
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type,authorization"}
    request = ("POST", "/v1/completions", {"json": {"prompt": "x", "max_tokens": 1},
                                           "headers": {"Origin": "http://ui.example"}})
    closed = ask(make_state(model_dir, llm), [("OPTIONS", "/v1/completions",
                                               {"headers": preflight}), request])
    assert closed[0].status == 405
    assert "access-control-allow-origin" not in closed[1].headers and closed[1].status == 200
    state = make_state(model_dir, llm, allowed_origins=("http://ui.example",),
                       allowed_methods=("POST", "GET"), allowed_headers=("content-type",
                                                                         "authorization"))
    other = {**preflight, "Origin": "http://evil.example"}
    ok, refused, cross, foreign = ask(state, [
        ("OPTIONS", "/v1/completions", {"headers": preflight}),
        ("OPTIONS", "/v1/completions", {"headers": other}),
        request,
        ("POST", "/v1/completions", {"json": {"prompt": "x", "max_tokens": 1},
                                     "headers": {"Origin": "http://evil.example"}})])
    assert ok.status == 200 and ok.headers["access-control-allow-origin"] == "http://ui.example"
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert refused.status == 400 and "access-control-allow-origin" not in refused.headers
    assert cross.headers["access-control-allow-origin"] == "http://ui.example"
    assert foreign.status == 200 and "access-control-allow-origin" not in foreign.headers


# ---- #7: routes without /v1 -----------------------------------------------------------------------

def test_routes_answer_without_the_v1_prefix(state):
    """llama.cpp's server answers /chat/completions, /completions and /models as their /v1/
    routes."""
    answers = ask(state, [
        ("GET", "/models", {}), ("GET", "/v1/models", {}),
        ("POST", "/completions", {"json": {"prompt": "abc", "max_tokens": 3, "temperature": 0}}),
        ("POST", "/v1/completions", {"json": {"prompt": "abc", "max_tokens": 3, "temperature": 0}}),
        ("POST", "/chat/completions", {"json": {"messages": CHAT, "max_tokens": 3, "temperature": 0}}),
        ("POST", "/v1/chat/completions", {"json": {"messages": CHAT, "max_tokens": 3,
                                                   "temperature": 0}}),
        ("GET", "/models/m", {})])
    assert [a.status for a in answers] == [200] * 7
    bare, prefixed = answers[0].json(), answers[1].json()
    assert bare["data"][0]["id"] == prefixed["data"][0]["id"] == "m"
    for short, full in ((answers[2], answers[3]), (answers[4], answers[5])):
        assert short.json()["choices"] == full.json()["choices"]


def test_the_readme_serve_examples_run_against_the_quick_start_server(model_dir, llm):
    """README's Serve section: its curl and openai examples name the model that plain
    `cupy-llama serve` (the Quick start's demo model) serves, its ready line is the one the
    server prints, and the curl body is answered."""
    import json as json_module
    from pathlib import Path
    from cupy_llama.cli.demo import DEMO_NAME
    from cupy_llama.server.app import ServerSettings, ready_line
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    serve = readme[readme.index("## Serve\n"):readme.index("`cupy-llama bench serve`")]
    names = re.findall(r'"model": "([^"]+)"', serve) + re.findall(r'model="([^"]+)"', serve)
    assert names and set(names) == {DEMO_NAME}, names
    printed = re.search(r"^# (serving .*)$", serve, re.M).group(1)

    class Info:
        device, context_limit, load_seconds = "cpu", 8192, 1.2

    assert printed == ready_line(ServerSettings(model_dir="x", served_model_name=DEMO_NAME),
                                 "http://127.0.0.1:8000", Info())
    body = json_module.loads(re.search(r"-d '(\{.*\})'", serve).group(1))
    state = make_state(model_dir, llm)
    state.settings.served_model_name = DEMO_NAME
    answer = ask_one(state, "POST", "/v1/chat/completions", json={**body, "max_tokens": 4})
    assert answer.status == 200 and answer.json()["model"] == DEMO_NAME
