"""Structured outputs and tools through the server (the app in this process, tests/
inprocess_server.py, and the openai client over the same app): 50 varied JSON schemas each
answered with JSON that validates, regex / choice / json_object / Lark constraints on both
endpoints under every field name OpenAI and vLLM give them, tool calls with the Llama 3.2
JSON and Hermes templates (required and named always valid, none never, streamed chunks
that reassemble to the whole answer, a two-turn exchange), and bad input answered with a
400 naming the field while the next request is served."""
import asyncio
import json
import random
import re
import sys

import httpx
import pytest

pytest.importorskip("fastapi")

from cupy_llama import LLM  # noqa: E402
from cupy_llama.server.app import create_app  # noqa: E402

from conftest import QUESTION, SCHEMAS, TOOLS, make_tool_model  # noqa: E402
from inprocess_server import Answer, ask, ask_one, make_state, with_app  # noqa: E402

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

CHAT = [{"role": "user", "content": "Answer in JSON."}]
SAMPLED = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


@pytest.fixture
def state(model_dir, llm):
    return make_state(model_dir, llm)


def ask_together(state, requests) -> list[Answer]:
    """The requests at once (so the engine batches them); their answers, whole."""
    async def go():
        state.loop = asyncio.get_running_loop()
        await state.load()
        transport = httpx.ASGITransport(app=create_app(state), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://app",
                                     timeout=120) as client:
            async def one(method, path, kwargs):
                response = await client.request(method, path, **kwargs)
                return Answer(response.status_code, response.headers, await response.aread())
            answers = await asyncio.gather(*(one(*r) for r in requests))
        if state._watchdog is not None:
            state._watchdog.cancel()
        return answers
    return asyncio.run(go())


# ---- 50 JSON schemas ---------------------------------------------------------------------------

def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema of 1 to 4 properties: bounded strings (some with patterns),
    integers and numbers with bounds, enums, booleans, arrays with min/max items, nested
    objects; some properties optional. Strings and numbers are bounded, as a random model
    would otherwise write one until max_tokens."""
    properties = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(["string", "pattern", "integer", "number", "enum", "boolean",
                           "array", "object" if depth < 2 else "integer"])
        if kind == "string":
            schema = {"type": "string", "maxLength": rng.randint(1, 8)}
        elif kind == "pattern":
            schema = {"type": "string", "pattern": rng.choice(
                ["^[a-z]{2,5}$", "^[A-Z][0-9]{2}$", "^(yes|no)-[0-9]$"])}
        elif kind == "integer":
            low = rng.randint(-50, 50)
            schema = {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
        elif kind == "number":
            schema = {"type": "number", "minimum": -10, "maximum": 10}
        elif kind == "enum":
            schema = {"enum": rng.sample(["red", "green", "blue", 7, None, True], rng.randint(1, 4))}
        elif kind == "boolean":
            schema = {"type": "boolean"}
        elif kind == "array":
            low = rng.randint(0, 2)
            schema = {"type": "array", "minItems": low, "maxItems": low + rng.randint(0, 3),
                      "items": rng.choice([{"type": "integer", "minimum": 0, "maximum": 9},
                                           {"enum": ["a", "b", "c"]}, {"type": "boolean"}])}
        else:
            schema = random_schema(rng, depth + 1)
        properties[f"p{i}_{kind}"] = schema
    names = list(properties)
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


@pytest.mark.slow
def test_fifty_json_schemas_are_followed(state):
    rng = random.Random(29)
    schemas = [random_schema(rng) for _ in range(50)]
    requests = [("POST", "/v1/chat/completions", {"json": {
        "messages": CHAT, "max_tokens": 500, "seed": i, **SAMPLED,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": f"s{i}", "schema": schema, "strict": True}}}})
        for i, schema in enumerate(schemas)]
    answers = ask_together(state, requests)
    for schema, answer in zip(schemas, answers):
        assert answer.status == 200, answer.body
        choice = answer.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_every_field_name_of_a_constraint(state):
    """response_format, structured_outputs and the guided_* aliases, on both endpoints."""
    pattern = r"[a-c]{2,4}-[0-9]{2}"
    grammar = 'start: item ("," item)*\nitem: /[0-9]{1,3}/ | "x"\n'
    cases = [  # (field, value, check of the text)
        ("structured_outputs", {"regex": pattern}, lambda t: re.fullmatch(pattern, t)),
        ("guided_regex", pattern, lambda t: re.fullmatch(pattern, t)),
        ("structured_outputs", {"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ("guided_choice", ["left", "right"], lambda t: t in ("left", "right")),
        ("response_format", {"type": "json_object"}, lambda t: isinstance(json.loads(t), dict)),
        ("structured_outputs", {"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
        ("guided_json", {"type": "object", "properties": {"n": {"enum": [1, 2]}},
                         "required": ["n"]}, lambda t: json.loads(t)["n"] in (1, 2)),
        ("structured_outputs", {"grammar": grammar},
         lambda t: re.fullmatch(r"([0-9]{1,3}|x)(,([0-9]{1,3}|x))*", t)),
        ("guided_grammar", grammar, lambda t: re.fullmatch(r"([0-9]{1,3}|x)(,([0-9]{1,3}|x))*", t)),
        # llama.cpp's: GBNF (the same language as the Lark grammar above) and a JSON schema
        ("grammar", 'root ::= item ("," item)*\nitem ::= [0-9]{1,3} | "x"\n',
         lambda t: re.fullmatch(r"([0-9]{1,3}|x)(,([0-9]{1,3}|x))*", t)),
        ("json_schema", {"type": "object", "properties": {"k": {"enum": ["a", "b"]}},
                         "required": ["k"], "additionalProperties": False},
         lambda t: json.loads(t) in ({"k": "a"}, {"k": "b"})),
        ("response_format", {"type": "text"}, lambda t: True),
    ]
    requests, checks = [], []
    for i, (field, value, check) in enumerate(cases):
        for path, body in (("/v1/completions", {"prompt": "Say:"}),
                           ("/v1/chat/completions", {"messages": CHAT})):
            requests.append(("POST", path, {"json": {**body, field: value, "seed": i,
                                                     "max_tokens": 300, **SAMPLED}}))
            checks.append((field, path, check))
    for (field, path, check), answer in zip(checks, ask_together(state, requests)):
        assert answer.status == 200, (field, path, answer.body)
        choice = answer.json()["choices"][0]
        text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
        if field == "response_format" and check(text) is True:
            continue  # {"type": "text"}: no constraint
        assert choice["finish_reason"] == "stop", (field, path, choice)
        assert check(text), (field, path, text)


def test_a_streamed_constraint_holds(state):
    answer = ask_one(state, "POST", "/v1/chat/completions", json={
        "messages": CHAT, "stream": True, "max_tokens": 300, "seed": 1, **SAMPLED,
        "structured_outputs": {"regex": "[0-9]{3}-[a-z]{3}"}})
    text = "".join(event["choices"][0]["delta"].get("content", "")
                   for event in answer.events() if event["choices"])
    assert re.fullmatch("[0-9]{3}-[a-z]{3}", text), text


BAD = [  # (what, endpoint, fields, the param named, words in the message)
    ("invalid schema", "/v1/chat/completions",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
         "type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format", "does not compile"),
    ("missing schema", "/v1/chat/completions",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "response_format.json_schema.schema is missing"),
    ("bad grammar", "/v1/completions", {"structured_outputs": {"grammar": "start: nowhere"}},
     "structured_outputs", "grammar does not compile"),
    ("bad regex", "/v1/completions", {"guided_regex": "a(b"}, "guided_regex",
     "regular expression does not compile"),
    ("two constraints", "/v1/completions",
     {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "send one of them"),
    ("bad GBNF", "/v1/chat/completions", {"grammar": 'root ::= "a" | missing'}, "grammar",
     "grammar: the GBNF grammar does not convert: Rule 'missing' not found"),
    ("GBNF not Lark", "/v1/completions", {"grammar": 'start: "a"'}, "grammar",
     "grammar: the GBNF grammar does not convert: Expected ::="),
    ("json_schema not an object", "/v1/completions", {"json_schema": ["a"]}, "json_schema",
     "json_schema must be a JSON schema"),
    ("invalid json_schema", "/v1/chat/completions", {"json_schema": {"type": "strin"}},
     "json_schema", "json_schema: the JSON schema does not compile"),
    ("grammar and json_schema", "/v1/completions",
     {"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "json_schema",
     "grammar and json_schema both constrain the output; send one of them"),
    ("json_schema and response_format", "/v1/chat/completions",
     {"response_format": {"type": "json_object"}, "json_schema": {"type": "object"}},
     "json_schema", "response_format and json_schema both constrain the output"),
    ("grammar and guided_regex", "/v1/completions",
     {"guided_regex": "a", "grammar": 'root ::= "a"'}, "grammar",
     "guided_regex and grammar both constrain the output"),
    ("unknown type", "/v1/chat/completions", {"response_format": {"type": "yaml"}},
     "response_format", "response_format.type must be"),
    ("unknown tool", "/v1/chat/completions",
     {"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", "tool_choice.function.name 'g' is not one of the tools"),
    ("bad tool", "/v1/chat/completions", {"tools": [{"type": "code_interpreter"}]},
     "tools", "tools[0].type must be"),
    ("required without tools", "/v1/chat/completions", {"tool_choice": "required"},
     "tool_choice", "no tools are given"),
]


@pytest.mark.parametrize("what, path, fields, param, words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_400_naming_the_field(state, what, path, fields, param, words):
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": CHAT}
    bad, good = ask(state, [("POST", path, {"json": {**body, **fields, "max_tokens": 3}}),
                            ("POST", path, {"json": {**body, "max_tokens": 3}})])
    assert bad.status == 400, bad.body
    error = bad.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert good.status == 200, "the next request was not served"


def test_without_llguidance_a_constraint_names_the_extra(model_dir, llm, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # importing it now fails
    answer = ask_one(make_state(model_dir, llm), "POST", "/v1/completions", json={
        "prompt": "x", "guided_choice": ["a", "b"]})
    assert answer.status == 400
    error = answer.json()["error"]
    assert "pip install 'cupy-llama[structured]'" in error["message"]
    assert error["param"] == "guided_choice"


# ---- tools ---------------------------------------------------------------------------------------



def tool_request(seed, **fields):
    return {"messages": QUESTION, "tools": TOOLS, "max_tokens": 500, "seed": seed,
            "parallel_tool_calls": False, **SAMPLED, **fields}


def assert_valid_calls(choice, names):
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert len(calls) == 1
    for call in calls:
        assert call["type"] == "function" and call["id"]
        assert call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def test_required_named_and_none(tool_server):
    model_dir, llm = tool_server
    named = {"type": "function", "function": {"name": "get_time"}}
    requests = [("POST", "/v1/chat/completions", {"json": tool_request(seed, tool_choice=choice)})
                for seed in range(3) for choice in ("required", named, "none")]
    answers = ask_together(make_state(model_dir, llm), requests)
    for (_, _, kwargs), answer in zip(requests, answers):
        assert answer.status == 200, answer.body
        choice = answer.json()["choices"][0]
        wanted = kwargs["json"]["tool_choice"]
        if wanted == "none":
            assert "tool_calls" not in choice["message"] and choice["finish_reason"] != "tool_calls"
        else:
            assert_valid_calls(choice, SCHEMAS if wanted == "required" else {"get_time"})


def test_streamed_calls_reassemble_to_the_whole_answer(tool_server):
    model_dir, llm = tool_server
    body = tool_request(7, tool_choice="required")
    whole, streamed = ask(make_state(model_dir, llm), [
        ("POST", "/v1/chat/completions", {"json": body}),
        ("POST", "/v1/chat/completions", {"json": {**body, "stream": True}})])
    message = whole.json()["choices"][0]["message"]
    calls, content, finish = {}, "", None
    events = streamed.events()
    # a forced reply is all calls: it opens with content null, as its message has it
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert message["content"] is None
    for event in events:
        for choice in event["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for entry in delta.get("tool_calls", []):
                if "id" in entry:
                    calls[entry["index"]] = {"name": entry["function"]["name"],
                                             "arguments": entry["function"]["arguments"]}
                else:
                    calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    assert finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message["tool_calls"]]
    assert content == (message["content"] or "")
    assert "<tool_call>" not in content and '"name"' not in content


def test_without_parallel_calls_auto_answers_the_first(tool_server):
    """parallel_tool_calls false with "auto": a reply of several calls (a guided grammar
    makes the random model write them) answers the first, whole and streamed."""
    from cupy_llama.tool_choice import tool_call_grammar
    from cupy_llama.tool_parsers import tool_parser_for_template
    model_dir, llm = tool_server
    parser = tool_parser_for_template(llm.tokenizer.chat_template)
    several = tool_call_grammar(parser, TOOLS, "required", True, token_id=llm.tokenizer.token_to_id)
    state = make_state(model_dir, llm)
    for seed in range(8):  # a seed whose reply holds several calls
        body = tool_request(seed, guided_grammar=several.text)
        many = ask(state, [("POST", "/v1/chat/completions",
                            {"json": {**body, "parallel_tool_calls": True}})])[0]
        many = many.json()["choices"][0]["message"].get("tool_calls") or []
        if len(many) > 1:
            break
    assert len(many) > 1, "no seed wrote several calls: the test shows nothing"
    one, streamed = ask(state, [
        ("POST", "/v1/chat/completions", {"json": body}),
        ("POST", "/v1/chat/completions", {"json": {**body, "stream": True}})])
    one = one.json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"] for c in one] == [many[0]["function"]]
    indexes = {entry["index"] for event in streamed.events() for choice in event["choices"]
               for entry in choice["delta"].get("tool_calls", [])}
    assert indexes == {0}


def weather_model(pydantic):
    """The pydantic model the client tests ask for as a json_schema response_format."""
    class Weather(pydantic.BaseModel):
        """The weather of a city."""
        city: str = pydantic.Field(max_length=8)
        celsius: int = pydantic.Field(ge=-40, le=50)
    return Weather


def test_a_two_turn_exchange_through_the_openai_client(tool_server):
    """The openai client: a required call, its result as a tool message, then an answer;
    and chat.completions.parse with a pydantic model (response_format json_schema)."""
    openai = pytest.importorskip("openai")
    pydantic = pytest.importorskip("pydantic")
    model_dir, llm = tool_server
    state = make_state(model_dir, llm)

    Weather = weather_model(pydantic)

    async def go(transport):
        client = openai.AsyncOpenAI(base_url="http://app/v1", api_key="none", max_retries=0,
                                    http_client=httpx.AsyncClient(transport=transport))
        first = await client.chat.completions.create(
            model="m", messages=QUESTION, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=500, seed=3, temperature=1.0)
        call = first.choices[0].message.tool_calls[0]
        answer = await client.chat.completions.create(model="m", tools=TOOLS, max_tokens=10,
                                                      messages=QUESTION + [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "22C and sunny"}])
        parsed = await client.chat.completions.parse(
            model="m", messages=CHAT, response_format=Weather, max_tokens=300, seed=2,
            temperature=1.0)
        return first, answer, parsed

    first, answer, parsed = with_app(state, go)
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    weather = parsed.choices[0].message.parsed
    assert isinstance(weather, Weather) and -40 <= weather.celsius <= 50


def test_langchain_bind_tools_and_with_structured_output(tool_server):
    """LangChain's ChatOpenAI against the app: bind_tools(...).invoke with a required call,
    and with_structured_output(PydanticModel).invoke (a json_schema response_format)."""
    langchain_openai = pytest.importorskip("langchain_openai")
    pydantic = pytest.importorskip("pydantic")
    model_dir, llm = tool_server
    state = make_state(model_dir, llm)

    Weather = weather_model(pydantic)

    async def go(transport):
        chat = langchain_openai.ChatOpenAI(
            model="m", base_url="http://app/v1", api_key="none", max_retries=0,
            temperature=1.0, seed=3, max_tokens=500,
            http_async_client=httpx.AsyncClient(transport=transport))
        called = await chat.bind_tools(TOOLS, tool_choice="required",
                                       parallel_tool_calls=False).ainvoke("Weather in Paris?")
        structured = await chat.with_structured_output(Weather, method="json_schema").ainvoke(
            "Weather in Paris?")
        return called, structured

    called, structured = with_app(state, go)
    (call,) = called.tool_calls
    jsonschema.validate(call["args"], SCHEMAS[call["name"]])
    assert isinstance(structured, Weather)


def test_the_tool_call_parser_option(model_dir, llm, tmp_path, capsys):
    """--tool-call-parser: an unknown name is a usage error before anything loads; without
    it, tools on a template that renders them in no known format are a 400 that names the
    option (one that refuses tools, the built-in Llama 3 format, says that instead); with
    it, the named format is enforced and parsed, whatever the template shows."""
    from cupy_llama.cli import main
    from conftest import one_error_line
    assert main(["serve", "--model", str(model_dir), "--tool-call-parser", "nope"]) == 2
    assert "--tool-call-parser: unknown parser 'nope'" in one_error_line(capsys.readouterr().err)
    body = tool_request(1, tool_choice="required")
    state = make_state(model_dir, llm)
    refused = ask_one(state, "POST", "/v1/chat/completions", json=body)
    assert refused.status == 400 and refused.json()["error"]["param"] == "tools"
    assert "does not support tools" in refused.json()["error"]["message"]
    renders_tools = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools | tojson }}"
    without = ask_one(make_state(model_dir, llm, trust_request_chat_template=True), "POST",
                      "/v1/chat/completions", json={**body, "chat_template": renders_tools})
    assert without.status == 400 and without.json()["error"]["param"] == "tools"
    assert "--tool-call-parser" in without.json()["error"]["message"]
    llama_dir = make_tool_model(tmp_path, "llama3_json")
    with LLM(llama_dir, device="cpu", log=None) as llama:
        state = make_state(llama_dir, llama, tool_call_parser="hermes")
        answer = ask_one(state, "POST", "/v1/chat/completions", json=body)
    assert answer.status == 200, answer.body
    choice = answer.json()["choices"][0]
    assert_valid_calls(choice, SCHEMAS)
    assert choice["message"]["content"] is None  # the <tool_call> tags are the parser's
