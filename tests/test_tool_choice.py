"""tools and tool_choice (cupy_llama/tool_choice.py): their checks, and the grammars that
enforce "required", a named function and parallel_tool_calls false in each family's
format. llguidance compiles each grammar for the family's tokenizer; what the grammar lets
a model write parses (tool_parsers.py) into calls to listed functions whose arguments
follow their schemas, and the form each family writes passes the grammar."""
import json

import numpy as np
import pytest

from conftest import make_tool_model
from cupy_llama.errors import RequestError
from cupy_llama.tokenizer import Tokenizer
from cupy_llama.tool_choice import check_tool_choice, check_tools, tool_call_grammar
from cupy_llama.tool_parsers import parse_tool_calls

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
from cupy_llama.structured import GrammarCompiler, allowed_token_ids  # noqa: E402

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 8},
            "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {  # the $defs and $ref pydantic writes
        "name": "book_room",
        "parameters": {"$defs": {"Room": {"type": "object", "properties": {
            "beds": {"type": "integer", "minimum": 1, "maximum": 4}}, "required": ["beds"]}},
            "type": "object", "properties": {"room": {"$ref": "#/$defs/Room"},
                                             "nights": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["room", "nights"]}}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters
]
SCHEMAS = {tool["function"]["name"]: tool["function"].get("parameters", {"type": "object"})
           for tool in TOOLS}
# the form each family writes a call in
WRITTEN = {
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}',
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}',
    "mistral_list": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]',
}
SECOND = {
    "llama3_json": '; {"name": "ping", "parameters": {}}',
    "hermes": '\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>',
    "mistral": "[TOOL_CALLS]ping[ARGS]{}",
}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """style -> (tokenizer, compiler, token_id): the tiny tool models' tokenizers; the
    Mistral list form is a Mistral vocabulary without [ARGS] (tokenizers up to v7)."""
    made = {}
    for style in ("llama3_json", "hermes", "mistral"):
        tok = Tokenizer.from_dir(make_tool_model(tmp_path_factory.mktemp(style), style))
        compiler = GrammarCompiler.from_tokenizer(tok, 512, tok.eos_token_ids)
        made[style] = (tok, compiler, tok.token_to_id)
    tok, compiler, _ = made["mistral"]
    made["mistral_list"] = (tok, compiler, lambda text: None if text == "[ARGS]" else tok.token_to_id(text))
    return made


# ---- checks -----------------------------------------------------------------------------

@pytest.mark.parametrize("tools, error", [
    ({"type": "function"}, "tools must be a list"),
    ([{"type": "retrieval"}], 'tools\\[0\\].type must be "function"'),
    ([{"type": "function"}], "tools\\[0\\].function must be an object"),
    ([{"type": "function", "function": {"name": "get weather"}}], "tools\\[0\\].function.name must be 1 to 64"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
     "tools\\[1\\].function.name 'f' is given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}],
     "tools\\[0\\].function.parameters must be a JSON schema"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "description must be a string"),
])
def test_bad_tools(tools, error):
    with pytest.raises(RequestError, match=error):
        check_tools(tools)


def test_tool_choice_checks():
    tools = check_tools(TOOLS)
    assert check_tool_choice(None, tools) == "auto" and check_tool_choice(None, []) == "none"
    assert check_tool_choice("required", tools) == "required"
    named = {"type": "function", "function": {"name": "ping", "extra": 1}}
    assert check_tool_choice(named, tools) == {"type": "function", "function": {"name": "ping"}}
    with pytest.raises(RequestError, match="tool_choice.function.name 'pong' is not one of the "
                                           "tools \\(get_weather, book_room, ping\\)"):
        check_tool_choice({"type": "function", "function": {"name": "pong"}}, tools)
    with pytest.raises(RequestError, match='tool_choice is "required" but no tools are given'):
        check_tool_choice("required", [])
    # "auto" with nothing to call is a plain reply, never one parsed for calls
    assert check_tool_choice("auto", []) == "none" and check_tool_choice("auto", tools) == "auto"
    with pytest.raises(RequestError, match="'ping' is not one of the tools \\(none are given\\)"):
        check_tool_choice(named, [])
    for bad in ("any", {"type": "function"}, {"type": "allowed_tools"}, 3):
        with pytest.raises(RequestError, match="tool_choice must be one of none, auto, required"):
            check_tool_choice(bad, tools)
    for choice in ("auto", "none"):
        assert tool_call_grammar("hermes", tools, choice) is None


# ---- grammars ---------------------------------------------------------------------------

CHOICES = {
    "required": ("required", True),
    "one call": ("required", False),
    "named": ({"type": "function", "function": {"name": "book_room"}}, True),
}


def walk(compiler, spec, seed, max_steps=600):
    """Tokens a model could write under the grammar: random allowed tokens, a closing
    quote or bracket often where one is allowed, EOS half the times it is allowed."""
    rng = np.random.default_rng(seed)
    matcher = compiler.matcher(spec)
    bitmask = np.zeros((1, compiler.num_words), np.uint32)
    tokens = []
    for _ in range(max_steps):
        if matcher.is_complete:
            return tokens
        matcher.fill_bitmask(bitmask, 0)
        allowed = allowed_token_ids(bitmask[0], compiler.vocab_size)
        others = [t for t in allowed if t not in compiler.eos_token_ids]
        if len(others) < len(allowed) and (not others or rng.random() < 0.5):
            return tokens
        closers = [t for t in (ord('"'), ord("}"), ord("]")) if t in others]
        token = int(rng.choice(closers if closers and rng.random() < 0.3 else others))
        assert matcher.advance(token), matcher.error
        tokens.append(token)
    raise AssertionError("the walk did not end")


@pytest.mark.parametrize("style", ["llama3_json", "hermes", "mistral", "mistral_list"])
@pytest.mark.parametrize("choice", list(CHOICES))
def test_what_the_grammar_admits_parses_into_listed_calls(families, style, choice):
    tok, compiler, token_id = families[style]
    tool_choice, parallel = CHOICES[choice]
    spec = tool_call_grammar(style.removesuffix("_list"), TOOLS, tool_choice, parallel, token_id)
    counts = set()
    for seed in range(3):
        text = tok.decode(walk(compiler, spec, seed), skip_special_tokens=False)
        reply = parse_tool_calls(text, style.removesuffix("_list"))
        assert reply.content is None and reply.tool_calls, text
        for call in reply.tool_calls:
            if choice == "named":
                assert call.name == "book_room"
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        counts.add(len(reply.tool_calls))
    if not parallel or choice == "named":  # a named function is called once
        assert counts == {1}


@pytest.mark.parametrize("style", ["llama3_json", "hermes", "mistral", "mistral_list"])
def test_the_families_own_form_passes(families, style):
    tok, compiler, token_id = families[style]
    name = style.removesuffix("_list")

    def passes(spec, text):
        matcher = compiler.matcher(spec)
        return all(matcher.advance(t) for t in tok.encode(text, add_special_tokens=False)) \
            and matcher.eos_allowed

    required = tool_call_grammar(name, TOOLS, "required", True, token_id)
    assert passes(required, WRITTEN[style])
    assert not passes(required, WRITTEN[style].replace("get_weather", "get_time"))  # not a tool
    assert not passes(required, WRITTEN[style].replace('"c"', '"kelvin"'))  # not its schema
    assert not passes(required, "Let me check. " + WRITTEN[style])  # a call, nothing else
    if style in SECOND:
        assert passes(required, WRITTEN[style] + SECOND[style])
        one = tool_call_grammar(name, TOOLS, "required", False, token_id)
        assert passes(one, WRITTEN[style]) and not passes(one, WRITTEN[style] + SECOND[style])
    named = tool_call_grammar(name, TOOLS, {"type": "function", "function": {"name": "ping"}},
                              True, token_id)
    assert not passes(named, WRITTEN[style])
    if style in SECOND:  # a named function is called once, parallel calls allowed or not
        weather = tool_call_grammar(name, TOOLS, {"type": "function",
                                                  "function": {"name": "get_weather"}},
                                    True, token_id)
        twice = WRITTEN[style] + {"llama3_json": "; ", "hermes": "\n", "mistral": ""}[style] \
            + WRITTEN[style]
        assert passes(required, twice)
        assert passes(weather, WRITTEN[style]) and not passes(weather, twice)


def test_arguments_are_an_object_whatever_the_schema_leaves_out(families):
    """parameters without "type" (hand-written and MCP schemas leave it out) still make
    the call's arguments an object, which the parsers read; a schema of another type is
    refused with the tool."""
    tok, compiler, token_id = families["hermes"]
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"a": {"type": "integer"}}}}}
    spec = tool_call_grammar("hermes", [tool], "required", False, token_id)
    for arguments, holds in (('{"a": 1}', True), ("1", False), ("true", False), ('"x"', False)):
        matcher = compiler.matcher(spec)
        text = f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
        ids = tok.encode(text, add_special_tokens=False)
        assert (all(matcher.advance(t) for t in ids) and matcher.eos_allowed) == holds, arguments
    for seed in range(3):
        text = tok.decode(walk(compiler, spec, seed), skip_special_tokens=False)
        assert parse_tool_calls(text, "hermes").tool_calls, text
    string_tool = {"type": "function", "function": {"name": "g", "parameters": {"type": "string"}}}
    with pytest.raises(RequestError, match='tools\\[0\\].function.parameters must describe an '
                                           'object .*got "type": "string"'):
        check_tools([string_tool])
    assert check_tools([{"type": "function", "function": {"name": "h", "parameters": {
        "type": ["object", "null"], "properties": {}}}}])


def test_a_schema_with_its_own_id_compiles_and_holds(families):
    """parameters that name themselves with $id (as JSON Schema generators may write)
    and refer to their own $defs: the moved copy resolves its references from the
    combined schema's root, and the call still follows the schema."""
    tok, compiler, token_id = families["hermes"]
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "$id": "https://example.com/pick.json", "type": "object",
        "properties": {"x": {"$ref": "#/$defs/X"}}, "required": ["x"],
        "$defs": {"X": {"$id": "https://example.com/x.json", "enum": ["a", "b"]}}}}}
    spec = tool_call_grammar("hermes", [tool], "required", False, token_id)
    matcher = compiler.matcher(spec)  # compiles
    for text, holds in (('{"name": "pick", "arguments": {"x": "a"}}', True),
                        ('{"name": "pick", "arguments": {"x": "c"}}', False)):
        matcher = compiler.matcher(spec)
        ids = tok.encode(f"<tool_call>\n{text}\n</tool_call>", add_special_tokens=False)
        assert (all(matcher.advance(t) for t in ids) and matcher.eos_allowed) == holds, text


def test_a_schema_that_does_not_compile_is_blamed_on_its_tool(families):
    """Under "required" each tool's parameters schema goes into the call grammar: one that
    does not compile is named by its place in tools (param "tools" over HTTP), not
    tool_choice's error; a named choice enforces (and checks) its own tool's only."""
    from cupy_llama.server.protocol import request_error
    tok, compiler, token_id = families["hermes"]
    good = {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}
    bogus = {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}
    with pytest.raises(RequestError, match=r"^tools\[1\]\.function\.parameters: the JSON "
                                           r"schema does not compile: .*bogus") as refused:
        tool_call_grammar("hermes", [good, bogus], "required", False, token_id)
    assert request_error(str(refused.value)).body()["error"]["param"] == "tools"
    named = {"type": "function", "function": {"name": "g"}}
    compiler.matcher(tool_call_grammar("hermes", [good, bogus], named, False, token_id))
