"""OpenAI's deprecated functions API on /v1/chat/completions (`functions`, `function_call`,
assistant messages with `function_call` and "function" messages), which the server takes as
the tools and tool_choice they stand for: the same prompt and the same grammar as the tools
form, answered in the legacy shape (message.function_call {name, arguments}, one call,
finish_reason "function_call", streamed as delta.function_call), on the Llama 3.2 JSON,
Hermes and Mistral templates, through the openai client too; and its malformed or
conflicting fields as 400s naming the field."""
import json
from dataclasses import replace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from cupy_llama.sampling import model_sampling_defaults  # noqa: E402
from cupy_llama.server.protocol import APIError, ChatCompletionRequest, parse  # noqa: E402
from cupy_llama.tokenizer import Tokenizer  # noqa: E402

from conftest import QUESTION, SCHEMAS, TOOLS  # noqa: E402
from inprocess_server import ask, ask_one, make_state, with_app  # noqa: E402

FUNCTIONS = [tool["function"] for tool in TOOLS]  # the same two, in the older form
SAMPLED = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
CHAT = "/v1/chat/completions"


def engine_inputs(model_dir, llm, body):
    request = parse(ChatCompletionRequest, body)
    tokenizer = Tokenizer.from_dir(model_dir)
    defaults = model_sampling_defaults(llm.config.generation_config)
    (prompt,), (params,) = request.engine_inputs(tokenizer, llm.config.vocab_size, 4096,
                                                 defaults)
    return prompt, params


def function_request(seed, **fields):
    return {"messages": QUESTION, "functions": FUNCTIONS, "max_tokens": 500, "seed": seed,
            **SAMPLED, **fields}


def assert_one_valid_call(choice, names):
    assert choice["finish_reason"] == "function_call", choice
    message = choice["message"]
    assert "tool_calls" not in message and message["role"] == "assistant"
    call = message["function_call"]
    assert set(call) == {"name", "arguments"} and call["name"] in names
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_functions_are_the_tools_they_stand_for(tool_server):
    """The prompt the chat template renders and the grammar of a named call are those of
    the tools form (a named tool_choice, one call: the older API has no parallel calls)."""
    model_dir, llm = tool_server
    named = {"type": "function", "function": {"name": "get_time"}}
    cases = [({"function_call": {"name": "get_time"}},
              {"tool_choice": named, "parallel_tool_calls": False}),
             ({}, {}),  # "auto": the default with functions, as with tools
             ({"function_call": "auto"}, {"tool_choice": "auto"})]
    for legacy, modern in cases:
        older = engine_inputs(model_dir, llm, {"messages": QUESTION, "functions": FUNCTIONS,
                                               **legacy})
        newer = engine_inputs(model_dir, llm, {"messages": QUESTION, "tools": TOOLS, **modern})
        assert older == newer, legacy
    plain = engine_inputs(model_dir, llm, {"messages": QUESTION})
    none = engine_inputs(model_dir, llm, {"messages": QUESTION, "functions": FUNCTIONS,
                                          "function_call": "none"})
    tools_none = engine_inputs(model_dir, llm, {"messages": QUESTION, "tools": TOOLS,
                                                "tool_choice": "none"})
    auto = engine_inputs(model_dir, llm, {"messages": QUESTION, "tools": TOOLS})
    # "none" shows the template the functions, as tool_choice "none" does (OpenAI's model
    # and vLLM's prompt see them): only the reply is left as it comes
    assert none == tools_none and none[0] == auto[0]
    # nothing constrained, nothing kept for a parser (max_tokens: what the context leaves)
    assert replace(none[1], max_tokens=1) == replace(plain[1], max_tokens=1)
    assert older[0] != plain[0], "the functions changed no prompt: the test proves nothing"


def test_named_auto_and_none_answer_in_the_legacy_shape(tool_server):
    model_dir, llm = tool_server
    requests = [("POST", CHAT, {"json": function_request(seed, function_call=choice)})
                for seed in range(3) for choice in ({"name": "get_time"}, "auto", "none")]
    answers = ask(make_state(model_dir, llm), requests)
    for (_, _, kwargs), answer in zip(requests, answers):
        assert answer.status == 200, answer.body
        choice = answer.json()["choices"][0]
        wanted = kwargs["json"]["function_call"]
        assert "tool_calls" not in choice["message"], choice
        assert choice["finish_reason"] != "tool_calls", choice
        if wanted == "none":
            assert "function_call" not in choice["message"], choice
            assert choice["finish_reason"] != "function_call"
        elif wanted == "auto":  # the model may answer or call; a call has the legacy shape
            if "function_call" in choice["message"]:
                assert_one_valid_call(choice, SCHEMAS)
            else:
                assert isinstance(choice["message"]["content"], str)
        else:
            assert_one_valid_call(choice, {"get_time"})


def test_a_streamed_call_reassembles_to_the_whole_answer(tool_server):
    model_dir, llm = tool_server
    body = function_request(5, function_call={"name": "get_weather"})
    whole, streamed = ask(make_state(model_dir, llm), [
        ("POST", CHAT, {"json": body}), ("POST", CHAT, {"json": {**body, "stream": True}})])
    message = whole.json()["choices"][0]["message"]
    call, content, finish, names = None, "", None, 0
    for event in streamed.events():
        for choice in event["choices"]:
            delta = choice["delta"]
            assert "tool_calls" not in delta, delta
            content += delta.get("content") or ""
            piece = delta.get("function_call")
            if piece is not None:
                if "name" in piece:
                    names += 1
                    call = {"name": piece["name"], "arguments": ""}
                call["arguments"] += piece["arguments"]
            finish = choice["finish_reason"] or finish
    assert finish == "function_call" and names == 1
    assert call == message["function_call"]
    assert content == (message["content"] or "")


def test_a_two_turn_exchange_through_the_openai_client(tool_server):
    """The openai client's functions / function_call: a named call, then its result as a
    "function" message after the assistant's function_call, then an answer. The second
    turn's prompt is the one the tools form of the same exchange renders."""
    openai = pytest.importorskip("openai")
    model_dir, llm = tool_server

    async def go(transport):
        import httpx
        client = openai.AsyncOpenAI(base_url="http://app/v1", api_key="none", max_retries=0,
                                    http_client=httpx.AsyncClient(transport=transport))
        first = await client.chat.completions.create(
            model="m", messages=QUESTION, functions=FUNCTIONS,
            function_call={"name": "get_weather"}, max_tokens=500, seed=3, temperature=1.0)
        turn = first.choices[0].message.model_dump(exclude_none=True)
        history = QUESTION + [turn, {"role": "function", "name": "get_weather",
                                     "content": "22C and sunny"}]
        answer = await client.chat.completions.create(
            model="m", messages=history, functions=FUNCTIONS, max_tokens=10, seed=3)
        return first, history, answer

    first, history, answer = with_app(make_state(model_dir, llm), go)
    assert first.choices[0].finish_reason == "function_call"
    call = first.choices[0].message.function_call
    assert call.name == "get_weather" and not first.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    assert answer.choices[0].finish_reason in ("stop", "length", "function_call")
    # the deprecated API has no ids: the server makes one up, as Mistral's templates take
    # them (9 letters and digits: they refuse others)
    modern = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call00001", "type": "function",
            "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "name": "get_weather", "tool_call_id": "call00001",
         "content": "22C and sunny"}]
    assert engine_inputs(model_dir, llm, {"messages": history, "functions": FUNCTIONS}) == \
        engine_inputs(model_dir, llm, {"messages": modern, "tools": TOOLS})


CALLED = {"role": "assistant", "content": None,
          "function_call": {"name": "get_time", "arguments": "{\"zone\": \"UTC\"}"}}
BAD = [  # (what, fields, the param named, words in the message)
    ("functions and tools", {"functions": FUNCTIONS, "tools": TOOLS}, "functions",
     "functions and tools are both given; send tools and tool_choice, or functions and "
     "function_call (their deprecated form)"),
    ("function_call and tool_choice", {"function_call": "auto", "tool_choice": "auto"},
     "function_call", "function_call and tool_choice are both given"),
    ("functions and tool_choice", {"functions": FUNCTIONS, "tool_choice": "required"},
     "functions", "functions and tool_choice are both given"),
    ("function_call and tools", {"function_call": "none", "tools": TOOLS},
     "function_call", "function_call and tools are both given"),
    ("function_call required", {"functions": FUNCTIONS, "function_call": "required"},
     "function_call", "function_call must be \"none\", \"auto\" or {\"name\": ...}"),
    ("function_call unknown", {"functions": FUNCTIONS, "function_call": {"name": "nope"}},
     "function_call", "function_call.name 'nope' is not one of the functions "
     "(get_weather, get_time)"),
    ("function_call without functions", {"function_call": {"name": "get_time"}},
     "function_call", "is not one of the functions (none are given)"),
    ("functions not a list", {"functions": "get_time"}, "functions",
     "functions must be a list"),
    ("a bad function name", {"functions": [{"name": "no spaces"}]}, "functions",
     "functions[0].name must be 1 to 64 letters"),
    ("a function twice", {"functions": FUNCTIONS + FUNCTIONS[:1]}, "functions",
     "functions[2].name 'get_weather' is given twice"),
    ("bad parameters", {"functions": [{"name": "f", "parameters": [1]}]}, "functions",
     "functions[0].parameters must be a JSON schema"),
    ("a named call beside a constraint", {"functions": FUNCTIONS,
     "function_call": {"name": "get_time"}, "response_format": {"type": "json_object"}},
     "function_call", "function_call naming a function sets the answer's grammar"),
    ("a user's function_call", {"messages": [{"role": "user", "content": "x",
                                              "function_call": CALLED["function_call"]}]},
     "messages[0].function_call", "only assistant messages call functions"),
    ("a malformed function_call", {"messages": QUESTION + [{**CALLED, "function_call": "x"}]},
     "messages[1].function_call", "must be {\"name\": ..., \"arguments\""),
    ("function_call and tool_calls", {"messages": QUESTION + [{**CALLED, "tool_calls": []}]},
     "messages[1].function_call", "send tool_calls or function_call, not both"),
    ("a function message without a name",
     {"messages": QUESTION + [CALLED, {"role": "function", "content": "12:00"}]},
     "messages[2].name", "messages[2].name is required"),
]


@pytest.mark.parametrize("what, fields, param, words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_400_naming_the_field(tool_server, what, fields, param, words):
    model_dir, llm = tool_server
    body = {"messages": QUESTION, "max_tokens": 3, **fields}
    bad, good = ask(make_state(model_dir, llm), [
        ("POST", CHAT, {"json": body}),
        ("POST", CHAT, {"json": {"messages": QUESTION, "max_tokens": 3}})])
    assert bad.status == 400, bad.body
    error = bad.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert "\n" not in error["message"]
    assert good.status == 200, "the next request was not served"


def test_harmless_values_change_nothing(tool_server):
    """An empty functions list and function_call "none" without functions are no tools."""
    model_dir, llm = tool_server
    plain = engine_inputs(model_dir, llm, {"messages": QUESTION})
    for fields in ({"functions": []}, {"function_call": "none"}, {"function_call": "auto"}):
        assert engine_inputs(model_dir, llm, {"messages": QUESTION, **fields}) == plain, fields
    with pytest.raises(APIError):  # (and a value that is not harmless is not taken as one)
        engine_inputs(model_dir, llm, {"messages": QUESTION, "functions": {}})


def test_a_legacy_calls_made_up_id_is_one_every_template_takes():
    """The deprecated API's calls have no ids; the one the server makes up for the template
    (and the "function" reply that answers it) is 9 letters and digits, the only form
    Mistral's templates take ("Tool call IDs should be alphanumeric strings with length
    9!")."""
    import re
    history = QUESTION + [CALLED, {"role": "function", "name": "get_time", "content": "12:00"}]
    request = parse(ChatCompletionRequest, {"model": "m", "messages": history,
                                            "functions": FUNCTIONS})
    call, answer = request.conversation()[1:3]
    made_up = call["tool_calls"][0]["id"]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", made_up) and answer["tool_call_id"] == made_up


def test_a_stop_string_cuts_a_reply_offered_tools(tool_server):
    """With tools (auto) a reply's content is cut at its stop string, whole or streamed,
    in every format (Mistral's keeps special tokens in its text to see its call tag)."""
    model_dir, llm = tool_server
    state = make_state(model_dir, llm)
    body = {"model": "m", "messages": QUESTION, "tools": TOOLS, "max_tokens": 40,
            "temperature": 1.0, "seed": 5}
    free = ask_one(state, "POST", "/v1/chat/completions", json=body).json()
    text = free["choices"][0]["message"]["content"] or ""
    assert free["choices"][0]["finish_reason"] == "length" and len(text) > 8  # noise to cut
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    whole, streamed = ask(state, [
        ("POST", "/v1/chat/completions", {"json": {**body, "stop": [stop]}}),
        ("POST", "/v1/chat/completions", {"json": {**body, "stop": [stop], "stream": True}})])
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == text[:text.index(stop)]
    deltas = [e["choices"][0]["delta"].get("content") or "" for e in streamed.events() if e["choices"]]
    assert "".join(deltas) == choice["message"]["content"]
