"""The OpenAI protocol layer on plain dicts (what a batch front end calls), and the
application's states that a subprocess cannot be caught in reliably: loading, draining,
a request the engine refuses."""
import pytest

# the serve extra (in the test extra); a machine without it, running only -m gpu, skips
pytest.importorskip("fastapi")

import asyncio
import json

import httpx

from cupy_llama import SamplingParams
from cupy_llama.outputs import TokenStrings
from cupy_llama.models import read_config
from cupy_llama.engine.async_engine import ENGINE_STOPPED, Rejected
from cupy_llama.outputs import RequestOutput
from cupy_llama.reasoning import ReasoningParser, reasoning_format
from cupy_llama.sampling import model_sampling_defaults
from cupy_llama.server import protocol
from cupy_llama.server.app import ServerSettings, ServerState, create_app, _Job
from cupy_llama.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                        DetokenizeRequest, TokenizeRequest, parse)


def error_of(model, body) -> APIError:
    with pytest.raises(APIError) as caught:
        parse(model, body)
    return caught.value


def test_validation_errors_name_the_field_and_the_value():
    e = error_of(CompletionRequest, {"prompt": "x", "n": "2"})
    assert (e.status, e.param) == (400, "n") and "integer" in e.message and '"2"' in e.message
    e = error_of(ChatCompletionRequest, {"messages": [{"content": "x"}]})
    assert e.param == "messages[0].role" and e.message == "messages[0].role is required"
    e = error_of(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                         "stream": "yes", "logprobs": 3})
    assert e.param == "stream" and "1 more problem" in e.message
    assert error_of(CompletionRequest, ["x"]).message.endswith("got an array")


def test_validation_errors_speak_json_not_python():
    """A field of several forms lists them, an object is an object, never a class name or a
    form's tag in the path."""
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for model, body, param, message in (
            (CompletionRequest, {"prompt": "x", "stop": [1]}, "stop",
             "stop must be a string or an array of strings (got [1])"),
            (CompletionRequest, {"prompt": "x", "stop": [1], "n": "2"}, "stop",
             "stop must be a string or an array of strings (got [1]); and 1 more problem"),
            (ChatCompletionRequest, {"messages": ["hi"]}, "messages[0]",
             'messages[0] must be an object (got "hi")'),
            (ChatCompletionRequest, {**chat, "stream_options": 5}, "stream_options",
             "stream_options must be an object (got 5)")):
        e = error_of(model, body)
        assert (e.param, e.message) == (param, message)


def test_null_is_a_field_left_out():
    """OpenAI's API marks n, stream, logprobs and include_usage nullable, and clients that
    write every unset field send null: it takes the default. A field with no default stays
    required."""
    chat = {"messages": [{"role": "user", "content": "x"}]}
    nulls = dict.fromkeys(("n", "stream", "logprobs", "ignore_eos", "add_generation_prompt",
                           "include_reasoning", "add_special_tokens",
                           "return_tokens_as_token_ids", "continue_final_message"))
    request, plain = parse(ChatCompletionRequest, {**chat, **nulls}), parse(ChatCompletionRequest, chat)
    for name in nulls:
        assert getattr(request, name) == getattr(plain, name), name
    request = parse(CompletionRequest, {"prompt": "x", "n": None, "stream": True,
                                        "stream_options": {"include_usage": None,
                                                           "continuous_usage_stats": None}})
    assert (request.n, request.include_usage) == (1, False)
    assert parse(CompletionRequest, {"prompt": "x", "add_special_tokens": None}).add_special_tokens
    e = error_of(ChatCompletionRequest, {"messages": None})
    assert (e.param, e.message) == ("messages", "messages must be an array (got null)")
    assert error_of(CompletionRequest, {"prompt": "x", "n": 0}).param == "n"


def test_prompt_logprobs_are_not_streamed():
    """As vLLM: a streamed request cannot ask for them (no chunk would carry them)."""
    for model, body in ((CompletionRequest, {"prompt": "x"}),
                        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})):
        e = error_of(model, {**body, "prompt_logprobs": 1, "stream": True})
        assert (e.status, e.param) == (400, "prompt_logprobs") and "stream" in e.message
        assert parse(model, {**body, "prompt_logprobs": 1, "stream": False}).prompt_logprobs == 1
    # echo's prompt logprobs, the legacy completions form, stream in the first chunk
    assert parse(CompletionRequest, {"prompt": "x", "echo": True, "logprobs": 1, "stream": True})


def test_tool_choice_auto_without_tools_is_a_plain_chat():
    """Clients that always send tool_choice send "auto" with no tools too: nothing can be
    called, so the reply is not parsed for calls (and no tool-call format is needed)."""
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert not parse(ChatCompletionRequest, {**chat, "tool_choice": "auto"}).uses_tools
    assert not parse(ChatCompletionRequest, {**chat, "tool_choice": "auto", "tools": []}).uses_tools
    assert error_of(ChatCompletionRequest, {**chat, "tool_choice": "required"}).param == "tool_choice"
    named = {"type": "function", "function": {"name": "f"}}
    assert error_of(ChatCompletionRequest, {**chat, "tool_choice": named}).param == "tool_choice"


def test_each_unsupported_field_is_refused_by_name_and_its_harmless_values_pass():
    chat = {"messages": [{"role": "user", "content": "x"}]}
    harmless = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {},
                "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
                "modalities": ["text"], "repetition_penalty": 1, "best_of": 1,
                "skip_special_tokens": True, "parallel_tool_calls": False}
    parse(ChatCompletionRequest, {**chat, **harmless})
    for name, value in (("audio", {}),
                        ("modalities", ["text", "audio"]), ("web_search_options", {})):
        e = error_of(ChatCompletionRequest, {**chat, name: value})
        assert (e.status, e.param, e.code) == (400, name, "unsupported_parameter"), name
        assert e.message.startswith(f"{name} is not supported")
    assert error_of(CompletionRequest, {"prompt": "x", "best_of": 0}).param == "best_of"
    # only what is out of scope is refused whatever the model: audio, modalities, web
    # search, beam search
    assert set(protocol.UNSUPPORTED) == {"audio", "modalities", "web_search_options",
                                         "use_beam_search"}
    assert error_of(CompletionRequest, {"prompt": "x", "suffix": 1}).param == "suffix"


def test_sampling_controls_reach_sampling_params_and_bad_values_name_the_field(llm):
    defaults = model_sampling_defaults(llm.config.generation_config)
    controls = {"frequency_penalty": 0.5, "presence_penalty": -0.25, "repetition_penalty": 1.1,
                "logit_bias": {"7": -100, "9": 2.5}, "min_tokens": 2, "stop_token_ids": [3],
                "include_stop_str_in_output": True, "skip_special_tokens": False,
                "spaces_between_special_tokens": False, "bad_words": ["a"],
                "allowed_token_ids": [4, 9]}
    for model, base in ((CompletionRequest, {"prompt": "x"}),
                        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})):
        params = parse(model, {**base, **controls}).sampling_params(5, 100, defaults)
        assert params.logit_bias == {7: -100.0, 9: 2.5}
        for name, value in controls.items():
            if name != "logit_bias":
                assert getattr(params, name) == value, name
        nulls = parse(model, {**base, **{name: None for name in controls}})
        assert nulls.sampling_params(5, 100, defaults) == SamplingParams(
            **{**defaults, "max_tokens": 16 if model is CompletionRequest else 95})
        for name, value in (("frequency_penalty", 3), ("logit_bias", {"1": 200}),
                            ("min_tokens", 1000), ("stop_token_ids", ["a"]),
                            ("allowed_token_ids", []), ("allowed_token_ids", [1, -1])):
            e = pytest.raises(APIError, parse(model, {**base, name: value}).sampling_params,
                              5, 100, defaults).value
            assert (e.status, e.param) == (400, name) and name in e.message, name


def test_min_tokens_past_a_max_tokens_left_out_names_its_source(llm):
    """A max_tokens the client left out is the context's room (chat) or OpenAI's 16
    (completions): a min_tokens past it says which, and how to fix the request, not a
    max_tokens nobody sent; one that was sent is named as it was."""
    defaults = model_sampling_defaults(llm.config.generation_config)
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for model, base in ((CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, chat)):
        e = pytest.raises(APIError, parse(model, {**base, "min_tokens": 96}).sampling_params,
                          5, 100, defaults).value
        assert (e.status, e.param) == (400, "min_tokens"), model
        assert "96" in e.message and "95 tokens" in e.message and "context limit of 100" \
            in e.message and "max_tokens" not in e.message, e.message
    assert parse(ChatCompletionRequest, {**chat, "min_tokens": 95}).sampling_params(
        5, 100, defaults).min_tokens == 95  # all the room is allowed
    e = pytest.raises(APIError, parse(CompletionRequest, {"prompt": "x", "min_tokens": 20})
                      .sampling_params, 5, 100, defaults).value
    assert (e.status, e.param) == (400, "min_tokens")
    assert "16 when it is left out" in e.message and "at least 20" in e.message, e.message
    assert parse(CompletionRequest, {"prompt": "x", "min_tokens": 20, "max_tokens": 20}) \
        .sampling_params(5, 100, defaults).min_tokens == 20
    e = pytest.raises(APIError, parse(ChatCompletionRequest, {**chat, "min_tokens": 20,
                                                              "max_tokens": 10})
                      .sampling_params, 5, 100, defaults).value
    assert e.param == "min_tokens" and "max_tokens (10)" in e.message


def test_prompts_and_sampling_params(llm):
    tokenizer, vocab = llm.tokenizer, llm.config.vocab_size
    defaults = model_sampling_defaults(llm.config.generation_config)
    request = parse(CompletionRequest, {"prompt": ["a", "bc"], "top_k": -1, "stop": "zz",
                                        "seed": 3, "ignore_eos": True})
    assert request.prompt_token_ids(tokenizer, vocab) == [tokenizer.encode("a"),
                                                          tokenizer.encode("bc")]
    params = request.sampling_params(5, 100, defaults)
    assert params == SamplingParams(**{**defaults, "top_k": 0, "stop": ["zz"], "seed": 3,
                                       "ignore_eos": True, "max_tokens": 16})
    assert request.sampling_params(90, 100, defaults).max_tokens == 10  # what is left
    one = pytest.raises(APIError, parse(CompletionRequest, {"prompt": "a", "max_tokens": 20})
                        .sampling_params, 1, 10, defaults).value.message
    assert one.startswith("1 prompt token + max_tokens 20 = 21 tokens, past the context "
                          "limit of 10"), one
    # seed -1 is none, as vLLM takes it; another negative seed, its 64 bits unsigned
    for seed, meant in ((-1, None), (-2, 2**64 - 2), (2**64 - 1, 2**64 - 1)):
        assert parse(CompletionRequest, {"prompt": "a", "seed": seed}) \
            .sampling_params(5, 100, defaults).seed == meant
    e = pytest.raises(APIError, request.sampling_params, 100, 100, defaults).value
    assert "100 tokens" in e.message and e.code == "context_length_exceeded"
    # an empty text that the tokenizer gives no token (no BOS): the field, not the engine
    for prompt, param in (("", "prompt"), (["a", ""], "prompt[1]")):
        e = pytest.raises(APIError, parse(CompletionRequest, {
            "prompt": prompt, "add_special_tokens": False}).prompt_token_ids,
            tokenizer, vocab).value
        assert (e.status, e.param) == (400, param) and "empty" in e.message, e.message
    assert parse(CompletionRequest, {"prompt": ""}).prompt_token_ids(tokenizer, vocab) == [
        tokenizer.encode("")]  # BOS alone is a prompt
    # a chat template that renders nothing: the messages, not the engine
    e = pytest.raises(APIError, parse(ChatCompletionRequest, {"messages": [
        {"role": "user", "content": "x"}]}).sampling_params, 0, 100, defaults).value
    assert (e.status, e.param) == (400, "messages") and "empty" in e.message
    for prompt in ([], [[]], [1, "a"], [True], 5, [[1, 2], "a"]):
        assert pytest.raises(APIError, parse(CompletionRequest, {"prompt": prompt})
                             .prompt_token_ids, tokenizer, vocab).value.param.startswith("prompt")
    chat = parse(ChatCompletionRequest, {"messages": [
        {"role": "developer", "content": "be terse"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}], "max_tokens": 7, "max_completion_tokens": 9})
    assert chat.conversation() == [{"role": "system", "content": "be terse"},
                                   {"role": "user", "content": "a\nb"},
                                   {"role": "assistant", "content": ""}]
    assert chat.sampling_params(10, 100, defaults).max_tokens == 9
    assert parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}) \
        .sampling_params(10, 100, defaults).max_tokens == 90
    e = pytest.raises(APIError, parse(ChatCompletionRequest, {"messages": [
        {"role": "user", "content": None}]}).conversation).value
    assert e.param == "messages[0].content"
    # an assistant's refusal part is its text (OpenAI sends them, vLLM reads them); a
    # user's is refused by its place
    refused = parse(ChatCompletionRequest, {"messages": [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"},
                                          {"type": "text", "text": "sorry"}]}]})
    assert refused.conversation()[1] == {"role": "assistant", "content": "no\nsorry"}
    for role, part, param in (("user", {"type": "refusal", "refusal": "no"}, "type"),
                              ("assistant", {"type": "refusal", "refusal": 5}, "refusal")):
        e = pytest.raises(APIError, parse(ChatCompletionRequest, {"messages": [
            {"role": role, "content": [part]}]}).conversation).value
        assert (e.status, e.param) == (400, f"messages[0].content[0].{param}"), e.message


def test_detokenize_takes_the_ids_of_the_tokenizer_and_of_the_model(llm):
    """/detokenize takes what /tokenize may give (a tokenizer's added tokens past a smaller
    model table) and what a completion may make (a model table padded past the
    tokenizer's, whose extra ids have no text)."""
    tokenizer = llm.tokenizer
    last = tokenizer.vocab_size - 1
    request = parse(DetokenizeRequest, {"tokens": [65, last]})
    whole = tokenizer.decode([65, last], skip_special_tokens=False)
    assert request.text(tokenizer, last) == whole  # the tokenizer's id past the model's
    assert request.text(tokenizer, last + 5) == whole
    padded = parse(DetokenizeRequest, {"tokens": [65, last + 3]})
    assert padded.text(tokenizer, last + 5) == tokenizer.decode([65])
    e = pytest.raises(APIError, padded.text, tokenizer, last + 1).value
    assert (e.status, e.param) == (400, "tokens") and f"[0, {last + 1})" in e.message


def test_add_special_tokens_as_vllm_takes_it(llm):
    """Completions put the tokenizer's BOS before a text unless add_special_tokens is
    false (a client that renders a chat itself, or scores a text as it is); chat leaves it
    to the template unless add_special_tokens is true, as vLLM does. /tokenize counts the
    same ids."""
    tokenizer, vocab = llm.tokenizer, llm.config.vocab_size
    bos = tokenizer.encode("", add_special_tokens=True)
    assert bos, "the test model's tokenizer adds no BOS: the test proves nothing"
    for body, expected in (({"prompt": "Hi"}, bos + tokenizer.encode("Hi", add_special_tokens=False)),
                           ({"prompt": ["Hi"], "add_special_tokens": False},
                            tokenizer.encode("Hi", add_special_tokens=False))):
        assert parse(CompletionRequest, body).prompt_token_ids(tokenizer, vocab) == [expected]
        counted = parse(TokenizeRequest, {"prompt": "Hi", **{
            k: v for k, v in body.items() if k == "add_special_tokens"}}).token_ids(tokenizer)
        assert counted == expected
    messages = [{"role": "user", "content": "Hi"}]
    templated = tokenizer.encode_chat(messages)
    for extra, expected in (({}, templated), ({"add_special_tokens": True}, bos + templated)):
        chat = parse(ChatCompletionRequest, {"messages": messages, **extra})
        assert chat.engine_inputs(tokenizer, vocab, 512, {})[0] == [expected]
        assert parse(TokenizeRequest, {"messages": messages, **extra}).token_ids(tokenizer) \
            == expected


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    """vLLM's truncate_prompt_tokens: a prompt's last k tokens (-1: the context's), on both
    endpoints, before the length check, and past the prompt's byte limit (the point of it
    is a prompt too long); echo shows what was kept. k past the context, 0 or below -1 is
    a 400 naming the field."""
    tokenizer, vocab = llm.tokenizer, llm.config.vocab_size
    text = "the quick brown fox jumps over the lazy dog " * 8
    ids = tokenizer.encode(text)
    assert len(ids) > 40
    request = parse(CompletionRequest, {"prompt": [text, "hi"], "truncate_prompt_tokens": 5,
                                        "echo": True, "max_tokens": 2})
    prompts, params = request.engine_inputs(tokenizer, vocab, 64, {}, max_prompt_bytes=40)
    assert prompts == [ids[-5:], tokenizer.encode("hi")]
    assert request.prompt_texts(prompts, TokenStrings(tokenizer))[0] == \
        tokenizer.decode(ids[-5:], skip_special_tokens=False)
    whole = parse(CompletionRequest, {"prompt": text, "truncate_prompt_tokens": -1})
    assert whole.engine_inputs(tokenizer, vocab, 512, {})[0] == [ids]
    messages = [{"role": "user", "content": text}]
    chat = parse(ChatCompletionRequest, {"messages": messages, "truncate_prompt_tokens": 7})
    assert chat.engine_inputs(tokenizer, vocab, 512, {})[0] == [tokenizer.encode_chat(messages)[-7:]]
    for k in (0, -2):
        assert error_of(CompletionRequest, {"prompt": "x", "truncate_prompt_tokens": k}).param \
            == "truncate_prompt_tokens"
    e = pytest.raises(APIError, parse(CompletionRequest, {
        "prompt": "x", "truncate_prompt_tokens": 65}).engine_inputs, tokenizer, vocab, 64, {}).value
    assert e.param == "truncate_prompt_tokens" and "64" in e.message


def test_truncate_prompt_tokens_minus_one_leaves_room_for_the_output(llm):
    """vLLM's -1 keeps as much of the prompt as the context holds beside the output asked
    for (max_model_len - max_tokens; completions' default 16 where it is left out), so
    the request runs with all it asked for; a chat that asks for nothing gets the whole
    context, and where that leaves no room the 400 names both fields, not the prompt."""
    tokenizer, vocab = llm.tokenizer, llm.config.vocab_size
    text = "the quick brown fox jumps over the lazy dog " * 8
    ids = tokenizer.encode(text)
    messages = [{"role": "user", "content": text}]
    chat_ids = tokenizer.encode_chat(messages)
    assert len(ids) > 40 and len(chat_ids) > 40
    for body, whole, kept, max_tokens in (
            ({"prompt": text}, ids, 30 - 16, 16),
            ({"prompt": text, "max_tokens": 5}, ids, 25, 5),
            ({"prompt": text, "max_tokens": 0, "echo": True}, ids, 29, 1),  # scores the prompt
            ({"messages": messages, "max_tokens": 5}, chat_ids, 25, 5),
            ({"messages": messages, "max_completion_tokens": 29}, chat_ids, 1, 29)):
        model = ChatCompletionRequest if "messages" in body else CompletionRequest
        request = parse(model, {**body, "truncate_prompt_tokens": -1})
        [prompt], [params] = request.engine_inputs(tokenizer, vocab, 30, {})
        assert prompt == whole[-kept:] and params.max_tokens == max_tokens, body
    chat = parse(ChatCompletionRequest, {"messages": messages, "truncate_prompt_tokens": -1})
    [prompt], [params] = chat.engine_inputs(tokenizer, vocab, len(chat_ids) + 3, {})
    assert prompt == chat_ids and params.max_tokens == 3  # it fits: nothing is cut
    e = pytest.raises(APIError, chat.engine_inputs, tokenizer, vocab, 30, {}).value
    assert (e.status, e.param) == (400, "truncate_prompt_tokens")
    assert "max_tokens" in e.message and "no room" in e.message and "shorten" not in e.message
    for body in ({"prompt": text, "max_tokens": 30}, {"messages": messages, "max_tokens": 40}):
        model = ChatCompletionRequest if "messages" in body else CompletionRequest
        e = pytest.raises(APIError, parse(model, {**body, "truncate_prompt_tokens": -1})
                          .engine_inputs, tokenizer, vocab, 30, {}).value
        assert (e.status, e.param) == (400, "max_tokens") and "at most 29" in e.message, body
    # the model's own default length (generation_config.json's max_new_tokens) is the
    # output a request that names none gets, so -1 leaves room for that much
    for body, kept, max_tokens in (({"prompt": text}, 30 - 10, 10),
                                   ({"messages": messages}, 30 - 10, 10)):
        model = ChatCompletionRequest if "messages" in body else CompletionRequest
        request = parse(model, {**body, "truncate_prompt_tokens": -1})
        whole = chat_ids if "messages" in body else ids
        [prompt], [params] = request.engine_inputs(tokenizer, vocab, 30, {"max_tokens": 10})
        assert prompt == whole[-kept:] and params.max_tokens == max_tokens, body
    [prompt], [params] = parse(CompletionRequest, {"prompt": text, "truncate_prompt_tokens": -1}
                               ).engine_inputs(tokenizer, vocab, 30, {"max_tokens": 100})
    assert prompt == ids[-(30 - 16):] and params.max_tokens == 16  # OpenAI's 16 is lower
    # a default is not an ask: a prompt that fits stays whole, its reply gets the room left
    chat = parse(ChatCompletionRequest, {"messages": messages, "truncate_prompt_tokens": -1})
    [prompt], [params] = chat.engine_inputs(tokenizer, vocab, len(chat_ids) + 3,
                                            {"max_tokens": 10})
    assert prompt == chat_ids and params.max_tokens == 3
    # and a model default past the context leaves no room: the 400 names the truncation,
    # not a max_tokens the client never sent
    e = pytest.raises(APIError, chat.engine_inputs, tokenizer, vocab, 30,
                      {"max_tokens": 4096}).value
    assert (e.status, e.param) == (400, "truncate_prompt_tokens") and "no room" in e.message
    # a max_tokens below 1 is refused as such, not as a prompt too long
    e = pytest.raises(APIError, parse(ChatCompletionRequest, {
        "messages": messages, "max_tokens": 0, "truncate_prompt_tokens": -1}).engine_inputs,
        tokenizer, vocab, 30, {}).value
    assert e.param == "max_tokens" and "at least 1" in e.message


def test_builders_make_openai_bodies():
    outputs = [[RequestOutput("r-0", [1, 2, 3], [7, 8], "hi", "stop", stop_reason="!")],
               [RequestOutput("r-1", [4], [9, 9, 9], "abc", "abort")]]
    request = parse(CompletionRequest, {"prompt": ["x", "y"]})
    body = protocol.completion_response(request, "cmpl-1", 123, "m", outputs, None, "fp_1")
    two = [[RequestOutput("r-0", [1] * 40, [7], "b", "stop", index=1),
            RequestOutput("r-0", [1] * 40, [8, 9], "a", "length", index=0, num_cached_tokens=32)]]
    body_n = protocol.completion_response(parse(CompletionRequest, {"prompt": "x", "n": 2}),
                                          "cmpl-2", 1, "m", two)
    assert [(c["index"], c["text"]) for c in body_n["choices"]] == [(0, "a"), (1, "b")]
    assert body_n["usage"] == {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43,
                               "prompt_tokens_details": {"cached_tokens": 32}}
    assert body == {"id": "cmpl-1", "object": "text_completion", "created": 123, "model": "m",
                    "system_fingerprint": "fp_1", "choices": [{"index": 0, "text": "hi", "logprobs": None,
                                 "finish_reason": "stop", "stop_reason": "!"},
                                {"index": 1, "text": "abc", "logprobs": None,
                                 "finish_reason": "length",  # cut short: "length"
                                 "stop_reason": None}],
                    "usage": {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9,
                              "prompt_tokens_details": {"cached_tokens": 0}}}
    chat = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                         "stream": True, "stream_options": {"include_usage": True}})
    stream = protocol.ChatCompletionStream(chat, "c-1", 5, "m", None, "fp_2")
    # OpenAI's first chunk: the role and empty content; the text follows
    # a step that adds no text sends nothing; the end is sent even when it adds none
    (opening, first), nothing, (last,), (end,) = (
        stream.chunks(0, "a", [1], None, None), stream.chunks(0, "", [2], None, None),
        stream.chunks(0, "b", [3], None, None),
        stream.chunks(0, "", [4], None, "length", None, 7))
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["delta"] == {"content": "a"} and nothing == []
    assert last["choices"][0]["delta"] == {"content": "b"} and end["choices"][0]["delta"] == {}
    chunks = (opening, first, last, end)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    # vLLM's stop_reason beside the finish_reason, on the last chunk only
    assert [c["choices"][0].get("stop_reason", "-") for c in chunks] == ["-", "-", "-", 7]
    assert all(c["usage"] is None and c["object"] == "chat.completion.chunk"
               and c["system_fingerprint"] == "fp_2" for c in chunks)
    usage = stream.usage_chunk(protocol.usage(3, 2))
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5


# ---- the application in this process (no engine process is started) ------------------------

@pytest.fixture
def state(model_dir):
    config = read_config(model_dir)
    from cupy_llama.tokenizer import Tokenizer
    settings = ServerSettings(model_dir=str(model_dir), served_model_name="m", device="cpu")
    return ServerState(settings, Tokenizer.from_dir(model_dir, config), config)


def _get(state, method, path, **kwargs):
    async def go():
        transport = httpx.ASGITransport(app=create_app(state))  # runs no lifespan: no engine
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.request(method, path, **kwargs)
    return asyncio.run(go())


def test_health_and_requests_are_503_while_loading_and_draining(state):
    for phase, code in ((state.LOADING, "not_ready"), (state.DRAINING, "shutting_down")):
        state.phase = phase
        for method, path, body in (("GET", "/health", None), ("GET", "/v1/models", None),
                                   ("POST", "/v1/completions", {"prompt": "x"})):
            response = _get(state, method, path, json=body)
            assert response.status_code == 503, (phase, path)
            assert response.json()["error"]["code"] == code
        assert response.headers.get("retry-after") == ("1" if phase == state.LOADING else None)
    assert _get(state, "GET", "/metrics").status_code == 200  # always


def test_an_engine_refusal_or_its_end_is_an_error_of_the_request(state):
    async def go(item):
        job = _Job(state, "cmpl-x", [[1, 2]], 1, False)
        job.sink.put(item)
        with pytest.raises(APIError) as caught:
            await job.final_outputs()
        return caught.value

    refused = asyncio.run(go(Rejected("cmpl-x-0", "the prompt has 9 tokens but the context "
                                                  "limit is 8 (...)")))
    assert (refused.status, refused.param) == (400, None) and "9 tokens" in refused.message
    stopped = asyncio.run(go(ENGINE_STOPPED))
    assert stopped.status == 503 and stopped.type == "server_error"


def test_a_handler_behind_gets_one_merged_update_per_choice(state):
    async def go():
        job = _Job(state, "cmpl-m", [[1, 2], [3]], 1, True)
        for text, ids in (("a", [10]), ("", [11]), ("bc", [12, 13])):
            job.sink.put(("cmpl-m-0", 0, text, ids, None, [(t, -1.0, []) for t in ids], 0, None,
                          None, None))
        job.sink.put(("cmpl-m-1", 0, "x", [20], "length", None, 0, None, None, None))
        job.sink.put(("cmpl-m-0", 0, "d", [14], "stop", [(14, -2.0, [])], 0, None, None, "cd"))
        updates = await job.next_updates()
        return job, updates

    job, updates = asyncio.run(go())
    logprobs = [(10, -1.0, []), (11, -1.0, []), (12, -1.0, []), (13, -1.0, []), (14, -2.0, [])]
    assert updates == {(0, 0): ["abcd", [10, 11, 12, 13, 14], logprobs, "stop", "cd"],
                       (1, 0): ["x", [20], None, "length", None]}
    assert [c[0].stop_reason for c in job.choices] == ["cd", None]
    assert job.choices[0][0].token_ids == [10, 11, 12, 13, 14]
    assert job.choices[0][0].logprobs == logprobs and job.choices[1][0].logprobs is None
    assert job.done and job.usage() == protocol.usage(3, 6)
    stream = protocol.CompletionStream(parse(CompletionRequest, {"prompt": "x"}), "c", 1, "m")
    events = job.sse(stream, updates).decode().split("\n\n")
    choices = [json.loads(e[len("data: "):])["choices"][0] for e in events if e]
    assert [(c["text"], c["stop_reason"]) for c in choices] == [("abcd", "cd"), ("x", None)]



def test_a_job_streams_plain_text_as_the_built_chunks(state):
    """_Job.sse of unfinished updates of two prompts with two samples each: the events
    (text_event's, where it takes a chunk) are the bytes chunks() builds, one a choice, at
    choice index prompt * n + sample."""
    async def go():
        job = _Job(state, "cmpl-p", [[1, 2], [3]], 2, True)
        for request_id, sample, text, ids in (("cmpl-p-0", 0, "a", [10]), ("cmpl-p-0", 1, "b", [11]),
                                              ("cmpl-p-1", 0, "c", [12]), ("cmpl-p-1", 1, "d", [13])):
            job.sink.put((request_id, sample, text, ids, None, None, 0, None, None, None))
        return job, await job.next_updates()

    job, updates = asyncio.run(go())
    assert len(updates) == 4
    request = parse(CompletionRequest, {"prompt": ["x", "y"], "n": 2, "stream": True})
    events = job.sse(protocol.CompletionStream(request, "cmpl-p", 1, "m"), updates)
    built = protocol.CompletionStream(request, "cmpl-p", 1, "m")
    assert events == b"".join(
        protocol.sse_event(chunk) for (i, j), (text, ids, logprobs, finish, stop) in updates.items()
        for chunk in built.chunks(i * 2 + j, text, ids, logprobs, finish, None, stop))
    choices = [json.loads(e[len("data: "):])["choices"][0] for e in events.decode().split("\n\n") if e]
    assert sorted((c["index"], c["text"]) for c in choices) == [(0, "a"), (1, "b"), (2, "c"), (3, "d")]

def test_logprobs_in_both_shapes(llm):
    strings = TokenStrings(llm.tokenizer)
    beyond = llm.tokenizer.vocab_size  # a padded model vocabulary's id: no text
    h, i = llm.tokenizer.encode("h", add_special_tokens=False)[0], \
        llm.tokenizer.encode("i", add_special_tokens=False)[0]
    entries = [(h, -0.5, [(h, -0.5), (i, -1.25)]), (beyond, float("-inf"), [])]
    legacy, offset = protocol.completion_logprobs(entries, strings, 3)
    assert legacy == {"tokens": ["h", ""], "token_logprobs": [-0.5, -9999.0],
                      "top_logprobs": [{"h": -0.5, "i": -1.25}, {"": -9999.0}],
                      "text_offset": [3, 4]}
    assert offset == 4
    chat = protocol.chat_logprobs(entries[:1], strings)
    assert chat == {"content": [{"token": "h", "logprob": -0.5, "bytes": [104], "top_logprobs": [
        {"token": "h", "logprob": -0.5, "bytes": [104]},
        {"token": "i", "logprob": -1.25, "bytes": [105]}]}], "refusal": None}
    # a token of part of a character: its text is U+FFFD, its bytes are its own (OpenAI's)
    lone = next(t for t in range(llm.tokenizer.vocab_size)
                if llm.tokenizer.token_bytes(t) == b"\xc3")
    assert protocol.chat_logprobs([(lone, -1.0, [])], strings)["content"][0] == {
        "token": "\ufffd", "logprob": -1.0, "bytes": [0xC3], "top_logprobs": []}
    special = llm.tokenizer.bos_token_id
    assert strings(special) == llm.tokenizer.bos_token  # spelled out, not skipped
    # return_tokens_as_token_ids: tokens named by id (byte tokens share "\ufffd"); the
    # offsets still count the text, and the bytes are still the token's own
    by_id = parse(CompletionRequest, {"prompt": "x", "return_tokens_as_token_ids": True}) \
        .token_names(strings)
    legacy, offset = protocol.completion_logprobs(entries + [(lone, -1.0, [])], by_id, 3)
    assert legacy["tokens"] == [f"token_id:{h}", f"token_id:{beyond}", f"token_id:{lone}"]
    assert legacy["top_logprobs"][0] == {f"token_id:{h}": -0.5, f"token_id:{i}": -1.25}
    assert legacy["text_offset"] == [3, 4, 4] and offset == 5
    assert protocol.chat_logprobs([(lone, -1.0, [(h, -2.0)])], by_id)["content"][0] == {
        "token": f"token_id:{lone}", "logprob": -1.0, "bytes": [0xC3],
        "top_logprobs": [{"token": f"token_id:{h}", "logprob": -2.0, "bytes": [104]}]}
    for model, stream_class, body in (
            (CompletionRequest, protocol.CompletionStream, {"prompt": "x", "logprobs": 1}),
            (ChatCompletionRequest, protocol.ChatCompletionStream,
             {"messages": [{"role": "user", "content": "x"}], "logprobs": True})):
        request = parse(model, {**body, "return_tokens_as_token_ids": True})
        chunks = stream_class(request, "c", 1, "m", strings).chunks(0, "h", [h], entries[:1],
                                                                    None)
        assert f"token_id:{h}" in json.dumps(chunks[-1]["choices"][0]["logprobs"])
    assert strings(h) == "h"  # the view leaves the names of other requests alone


def test_admission_counts_free_slots_and_refuses_what_could_never_run(state):
    """--max-waiting bounds the sequences that would wait for a slot: free slots take new
    ones first (an idle server with --max-waiting 0 serves), and a request needing more
    sequences than run at once plus may wait is a 400, not a 503 to retry for ever."""
    from cupy_llama.engine.async_engine import EngineInfo
    engine = state.engine
    engine.info = EngineInfo(device="cpu", context_limit=64, num_blocks=8, block_size=16,
                             max_num_seqs=2, load_seconds=0.0, pid=0)
    sent = []
    engine.add = lambda request_id, prompt, params, stream, sink: sent.append(request_id)

    def admit(n: int, max_waiting: int, running: int, waiting: int = 0, prompts=1):
        state.settings.max_waiting = max_waiting
        engine.stats = {"num_running": running, "num_waiting": waiting, "num_added_seqs": 0}

        async def go():
            return state.start_job(f"cmpl-{len(sent)}", [[1, 2]] * prompts,
                                   [SamplingParams(n=n)] * prompts, False, n)
        try:
            asyncio.run(go())
        except APIError as e:
            return e
        return None

    assert admit(n=2, max_waiting=0, running=0) is None           # two free slots
    assert admit(n=1, max_waiting=3, running=2, waiting=3).status == 503
    busy = admit(n=1, max_waiting=0, running=2)
    assert (busy.status, busy.code, busy.headers) == (503, "server_busy", {"Retry-After": "1"})
    assert "1 sequence would wait" in busy.message and "--max-waiting 0" in busy.message
    assert admit(n=3, max_waiting=1, running=0) is None           # 2 run, 1 waits
    never = admit(n=3, max_waiting=0, running=0)
    assert (never.status, never.param) == (400, "n") and "needs 3 sequences" in never.message
    assert admit(n=1, max_waiting=0, running=0, prompts=3).param == "prompt"
    assert sent == ["cmpl-0-0", "cmpl-1-0"]  # the two admitted requests alone reached the engine


def test_a_sample_ended_here_frees_its_slot_for_admission(llm):
    """A sample the server ends at a stop string (or a client's abort) still runs in the
    engine's last stats until the engine reports its end: admission counts its slot free
    meanwhile, or back-to-back requests that stop at a stop string get 503s with slots
    free."""
    from cupy_llama.engine.async_engine import AsyncEngine, EngineInfo, RequestStream
    engine = AsyncEngine("unused", "cpu", {}, tokenizer=llm.tokenizer)
    engine.info = EngineInfo(device="cpu", context_limit=64, num_blocks=8, block_size=16,
                             max_num_seqs=1, load_seconds=0.0, pid=0)
    sent = []
    engine._transport = type("Transport", (), {"write": lambda self, frame: sent.append(frame)})()
    ids = llm.tokenizer.encode("one two three", add_special_tokens=False)
    stop = llm.tokenizer.decode(ids[1:])  # the text of the tokens after the first
    for request_id in ("r1", "r2"):
        engine.add(request_id, [1, 2], SamplingParams(max_tokens=8, stop=[stop]), True,
                   RequestStream())

    def out(running, *deltas):
        stats = {"num_running": running, "num_waiting": 0, "num_added_seqs": 2}
        engine._on_message(("out", [tuple(d) for d in deltas], [], stats))

    def delta(request_id, tokens, finish=None):
        return (request_id, 0, None, tokens, finish, None, 0, None, None, None)

    out(1, delta("r1", ids[:1]))
    assert engine.num_would_wait(1) == 1  # r1 runs: a new sequence would wait
    out(1, delta("r1", ids[1:]))  # r1's text reaches the stop string: it ends here
    assert engine.num_would_wait(1) == 0  # its slot counts free before the engine says so
    engine.abort("r2")  # a client gone: its sample counts as ending too
    out(0, delta("r1", [], "abort"), delta("r2", [], "abort"))  # the engine's own ends
    assert engine._num_ending == 0 and engine._ending == {}
    assert engine.num_would_wait(1) == 0
    # without a tokenizer which samples still run is not known here: an abort marks none
    # (they count as running until the engine says), so nothing can be marked for ever
    bare = AsyncEngine("unused", "cpu", {})
    bare.info, bare._transport = engine.info, engine._transport
    bare.add("r3", [1, 2], SamplingParams(max_tokens=8, n=2), True, RequestStream())
    bare.abort("r3")
    assert bare._num_ending == 0


def test_metrics_count_every_token_the_engine_sent(llm):
    """generation_tokens counts the tokens in the engine's output as it arrives, whether a
    handler reads them or not: those of a request whose client went away while they were
    in flight, and those past a stop string found here, beside the deltas and the token
    columns of requests still read."""
    from cupy_llama.engine.async_engine import AsyncEngine, EngineInfo, RequestStream
    from cupy_llama.server.metrics import Metrics
    engine = AsyncEngine("unused", "cpu", {}, tokenizer=llm.tokenizer)
    engine.info = EngineInfo(device="cpu", context_limit=64, num_blocks=8, block_size=16,
                             max_num_seqs=4, load_seconds=0.0, pid=0)
    engine._transport = type("Transport", (), {"write": lambda self, frame: None})()
    metrics = Metrics(lambda: ({}, 0, engine.generated_tokens), "m")
    sinks = {request_id: RequestStream() for request_id in ("r1", "r2", "r3")}
    ids = llm.tokenizer.encode("one two three four", add_special_tokens=False)
    for request_id, sink in sinks.items():
        stop = [llm.tokenizer.decode(ids[1:2])] if request_id == "r3" else None
        engine.add(request_id, [1, 2], SamplingParams(max_tokens=8, stop=stop), True, sink)

    def out(*deltas, columns=None):
        message = ("out", [(request_id, 0, None, tokens, finish, None, 0, None, None, None)
                           for request_id, tokens, finish in deltas], [], {})
        engine._on_message(message if columns is None else message + (columns,))

    out(("r1", ids[:2], None), ("r2", ids[:1], None), columns=(["r1", "r2"], [0, 0], ids[2:4]))
    engine.abort("r2")  # the client went away with tokens still coming
    out(("r2", ids[:3], "abort"), ("r3", ids[:3], None))  # r3 stops at its second token here
    out(("r3", ids[3:], "abort"))
    assert engine.generated_tokens == 2 + 1 + 2 + 3 + 3 + len(ids[3:])
    rendered = metrics.render().decode()
    assert f'cupy_llama:generation_tokens_total{{model_name="m"}} {engine.generated_tokens}.0' \
        in rendered


def test_a_chats_thinking_and_tool_calls_count_toward_its_bytes(llm):
    """An assistant message's reasoning and tool calls are rendered by templates that show
    them, so the size check before rendering counts them with the content: a chat too long
    to fit is refused before its template runs, wherever its text is."""
    tokenizer = llm.tokenizer
    big = "x" * 5000
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": big}}
    for assistant in ({"content": big}, {"content": "", "reasoning": big},
                      {"content": "", "reasoning_content": big}, {"tool_calls": [call]}):
        request = parse(ChatCompletionRequest, {"messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", **assistant},
            {"role": "user", "content": "again"}]})
        e = pytest.raises(APIError, request.prompt_token_ids, tokenizer, 4000).value
        assert (e.status, e.param, e.code) == (400, "messages", "context_length_exceeded"), assistant
        assert request.prompt_token_ids(tokenizer, 40_000)  # rendered where it fits


def test_a_plain_text_chunk_is_encoded_as_the_chunk_would_be():
    """CompletionStream.text_event: the event of a chunk that carries text alone, made from
    the choice's head and tail, is the event of the chunk chunks() builds, byte for byte,
    for any text (quotes, escapes, control characters, non-ASCII) and choice; chunks that
    carry anything else (log-probabilities, a finish, usage so far, echo's scores) are
    left to chunks()."""
    texts = ["", " hello", 'say "hi"\n', "\\ back\tslash", "\x00\x01\x1f", "é中🎉", "\u2028\ufeff"]
    bodies = [{"prompt": "x"}, {"prompt": "x", "stream_options": {"include_usage": True}},
              {"prompt": "x", "echo": True, "n": 3}]
    for body in bodies:
        request = parse(CompletionRequest, {**body, "stream": True})
        fast = protocol.CompletionStream(request, "cmpl-1", 7, "model", None, "fp_1")
        built = protocol.CompletionStream(request, "cmpl-1", 7, "model", None, "fp_1")
        for index in (0, 2):
            for text in texts:
                event = fast.text_event(index, text, None, None)
                chunks = built.chunks(index, text, [5], None, None)
                assert event == b"".join(protocol.sse_event(c) for c in chunks), (body, text)
    request = parse(CompletionRequest, {"prompt": "x", "stream": True})
    stream = protocol.CompletionStream(request, "cmpl-1", 7, "model")
    assert stream.text_event(0, "a", "stop", None) is None
    assert stream.text_event(0, "a", None, protocol.usage(1, 1)) is None
    with_logprobs = parse(CompletionRequest, {"prompt": "x", "stream": True, "logprobs": 1})
    assert protocol.CompletionStream(with_logprobs, "c", 7, "m").text_event(
        0, "a", None, None) is None
    scores_only = parse(CompletionRequest, {"prompt": "x", "stream": True, "echo": True,
                                            "max_tokens": 0})
    assert protocol.CompletionStream(scores_only, "c", 7, "m").text_event(
        0, "a", None, None) is None
    # a model name holding the mark's JSON: the chunk is built
    odd = protocol.CompletionStream(request, "c", 7, protocol._TEXT_MARK)
    assert odd.text_event(0, "a", None, None) is None


def test_constraints_tools_and_own_templates_are_prepared_off_the_event_loop():
    """A small body is parsed on the server's event loop, but a prompt whose preparation
    converts a grammar, checks schemas or renders the request's own template (each may
    take a while) is prepared in a worker thread."""
    from cupy_llama.server.app import prepared_in_thread

    def decide(model, body):
        return prepared_in_thread(parse(model, body), body)

    messages = [{"role": "user", "content": "x"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert not decide(CompletionRequest, {"prompt": "x"})
    assert not decide(CompletionRequest, {"prompt": "x", "grammar": None})
    assert decide(CompletionRequest, {"prompt": "x", "grammar": 'root ::= "a"'})
    assert decide(CompletionRequest, {"prompt": "x", "response_format": {"type": "json_object"}})
    assert not decide(ChatCompletionRequest, {"messages": messages})
    assert decide(ChatCompletionRequest, {"messages": messages, "tools": tools})
    assert decide(ChatCompletionRequest, {"messages": messages, "guided_choice": ["a", "b"]})
    assert decide(ChatCompletionRequest, {"messages": messages, "chat_template": "{{ 1 }}"})


def test_every_event_is_one_line_for_clients_that_split_lines_as_python_does():
    """JSON lets U+0085, U+2028 and U+2029 stand inside a string, but httpx's and requests'
    iter_lines end a line at each (str.splitlines): an event whose text held one reached
    such a client in two pieces, neither of them JSON. Escaped, every event is one line
    there too and reads back as the same text, whether built or made by text_event."""
    text = "a\x85b\u2028c\u2029d é"
    completion = parse(CompletionRequest, {"prompt": "x", "stream": True})
    chat = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                         "stream": True})
    for stream, read in ((protocol.CompletionStream(completion, "c", 7, "m\u2028"),
                          lambda choice: choice["text"]),
                         (protocol.ChatCompletionStream(chat, "c", 7, "m\u2028"),
                          lambda choice: choice["delta"].get("content", ""))):
        stream.chunks(0, "", [], None, None)  # a chat choice's opening
        events = [stream.text_event(0, text, None, None)]
        events += [protocol.sse_event(c) for c in stream.chunks(0, text, [5], None, "length")]
        for event in events:
            lines = event.decode().splitlines()
            assert lines[0].startswith("data: ") and lines[1:] == [""], event
            body = json.loads(lines[0][len("data: "):])
            assert read(body["choices"][0]) == text and body["model"] == "m\u2028"


def test_a_plain_chat_content_chunk_is_encoded_as_the_chunk_would_be():
    """ChatCompletionStream.text_event likewise after a choice's opening chunk: the same
    bytes as chunks() for any text (none for an empty piece, which chunks() drops), and
    None for the opening chunk, log-probabilities, a finish, usage so far, tools and a
    reasoning split."""
    texts = [" hello", 'say "hi"\n', "\x00\x1f", "é中🎉", ""]
    messages = [{"role": "user", "content": "x"}]
    for body in [{}, {"stream_options": {"include_usage": True}}, {"n": 2}]:
        request = parse(ChatCompletionRequest, {"messages": messages, "stream": True, **body})
        fast = protocol.ChatCompletionStream(request, "chatcmpl-1", 7, "model", None, "fp_1")
        built = protocol.ChatCompletionStream(request, "chatcmpl-1", 7, "model", None, "fp_1")
        for index in (0, 1):
            assert fast.text_event(index, "a", None, None) is None  # not opened yet
            fast.chunks(index, "", [], None, None)
            built.chunks(index, "", [], None, None)
            for text in texts:
                event = fast.text_event(index, text, None, None)
                chunks = built.chunks(index, text, [5], None, None)
                assert event == b"".join(protocol.sse_event(c) for c in chunks), (body, text)
        assert fast.text_event(0, "a", "stop", None) is None
        assert fast.text_event(0, "a", None, protocol.usage(1, 1)) is None
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    reasoning = ReasoningParser(reasoning_format("qwen3"), 2, 1, False, frozenset(),
                                lambda ids: "")
    for body in [{"logprobs": True}, {"tools": tools}, "reasoning"]:
        request = parse(ChatCompletionRequest, {"messages": messages, "stream": True,
                                                **(body if body != "reasoning" else {})})
        if body == "reasoning":
            request.set_reasoning_parser(reasoning)
        stream = protocol.ChatCompletionStream(request, "c", 7, "m")
        stream._started.add(0)  # as if opened (a tool-call stream's needs the server's parser)
        assert stream.text_event(0, "a", None, None) is None, body


def test_a_tools_request_hears_what_its_template_lacks(llm):
    """A template that refuses tools (the built-in Llama 3 format) says so: naming a
    --tool-call-parser would not help there. One that renders tools in no format the
    server knows asks for the parser."""
    defaults = model_sampling_defaults(llm.config.generation_config)
    body = {"messages": [{"role": "user", "content": "w"}],
            "tools": [{"type": "function", "function": {"name": "f"}}]}

    def refusal(**fields):
        request = parse(ChatCompletionRequest, {**body, **fields})
        with pytest.raises(APIError) as caught:
            request.engine_inputs(llm.tokenizer, llm.config.vocab_size, 256, defaults)
        return caught.value

    e = refusal()
    assert (e.status, e.param) == (400, "tools")
    assert "does not support tools" in e.message and "--tool-call-parser" not in e.message
    e = refusal(tools=None, functions=[{"name": "f"}])  # the older form names its field
    assert e.param == "functions" and "does not support tools" in e.message
    renders_tools = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools | tojson }}"
    e = refusal(chat_template=renders_tools)
    assert (e.status, e.param) == (400, "tools")
    assert "shows no tool-call format" in e.message and "--tool-call-parser" in e.message
    # tool_choice "none" shows the template the tools where it takes them (OpenAI's model
    # and vLLM's prompt see them), and makes a plain chat of one that refuses them
    def prompt(exclude_tools_when_none=False, **fields):
        request = parse(ChatCompletionRequest, {**body, **fields})
        request.set_tool_parser(None, exclude_tools_when_none)
        return request.engine_inputs(llm.tokenizer, llm.config.vocab_size, 256, defaults)[0]

    plain = prompt(tools=None)
    assert prompt(tool_choice="none") == plain
    maybe_tools = "{% for m in messages %}{{ m.content }}{% endfor %}" \
                  "{% if tools %}{{ tools | tojson }}{% endif %}"
    shown = prompt(tool_choice="none", chat_template=maybe_tools)
    unshown = prompt(tools=None, chat_template=maybe_tools)
    assert shown != unshown and '"name": "f"' in llm.tokenizer.decode(shown[0])
    # serve's --exclude-tools-when-tool-choice-none (vLLM's): "none" shows none
    assert prompt(True, tool_choice="none", chat_template=maybe_tools) == unshown
