"""Tool-call parsers (cupy_llama/tool_parsers.py) on replies in the forms the families'
models write (Llama 3.x JSON, Hermes/Qwen <tool_call>, Mistral [TOOL_CALLS] in its list and
its v11+ forms, as the families' chat templates and vLLM's parser tests show them): calls
and the content around them, malformed calls left as content, and streams that add up to
the whole reply's parse however the text is cut."""
import itertools
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CHAT_TEMPLATES
from cupy_llama.errors import RequestError
from cupy_llama.tokenizer import LLAMA3_CHAT_TEMPLATE
from cupy_llama.tool_parsers import (PARSER_NAMES, ParsedReply, StreamDelta, ToolCall,
                                     make_tool_parser, parse_tool_calls,
                                     tool_parser_for_template)
from cupy_llama.bench.random_model import CHATML_TEMPLATE, MISTRAL_TEMPLATE

# (parser, reply, content, [(name, arguments as written)])
WELL_FORMED = [
    ("llama3_json", '{"name": "get_weather", "parameters": {"location": "Paris, France", '
     '"unit": "celsius"}}', None,
     [("get_weather", '{"location": "Paris, France", "unit": "celsius"}')]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"location": "Paris"}}',
     None, [("get_weather", '{"location": "Paris"}')]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
     '{"name": "get_time", "parameters": {"timezone": "Europe/Oslo"}}', None,
     [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"timezone": "Europe/Oslo"}')]),
    ("llama3_json", 'Let me look that up.\n\n{"name": "search", "arguments": {"query": "llamas"}}',
     "Let me look that up.", [("search", '{"query": "llamas"}')]),
    ("llama3_json", '{"name": "run", "parameters": {"code": "if (a) { b(\\"}\\"); }", "n": [1, {}]}}',
     None, [("run", '{"code": "if (a) { b(\\"}\\"); }", "n": [1, {}]}')]),
    ("llama3_json", '{"type": "function", "name": "get_weather", "parameters": {"city": "Zürich"}}',
     None, [("get_weather", '{"city": "Zürich"}')]),
    ("llama3_json", "Hello! How can I help you today?", "Hello! How can I help you today?", []),
    ("hermes", '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": '
     '"San Francisco, CA, USA"}}\n</tool_call>', None,
     [("get_current_temperature", '{"location": "San Francisco, CA, USA"}')]),
    ("hermes", "I'll check both cities.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
     "{\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", "
     "\"arguments\": {\"city\": \"Rome\"}}\n</tool_call>", "I'll check both cities.",
     [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')]),
    ("hermes", '<tool_call>\n{"arguments": {"expression": "2 * 21"}, "name": "calculate"}\n'
     '</tool_call>\nThat is all.', "That is all.", [("calculate", '{"expression": "2 * 21"}')]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", "{}")]),
    # cut off by max_tokens inside the closing tag: the tag's start is the call's
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_cal', "Sure.",
     [("get_time", "{}")]),
    ("hermes", "Plain text with a < sign and <b>tags</b>.", "Plain text with a < sign and <b>tags</b>.", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": '
     '"Paris, France", "format": "celsius"}}]', None,
     [("get_current_weather", '{"location": "Paris, France", "format": "celsius"}')]),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}, "id": "bdKLz0tH1"}, '
     '{"name": "multiply", "arguments": {"a": 3, "b": 6}}]', None,
     [("add", '{"a": 3.5, "b": 4}'), ("multiply", '{"a": 3, "b": 6}')]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None,
     [("get_weather", '{"city": "Paris"}')]),
    ("mistral", 'Sure, let me check.[TOOL_CALLS]add[ARGS]{"a": 3.5, "b": 4}'
     '[TOOL_CALLS]multiply[ARGS]{"a": 3, "b": 6}', "Sure, let me check.",
     [("add", '{"a": 3.5, "b": 4}'), ("multiply", '{"a": 3, "b": 6}')]),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"}', None, [("get_weather", '{"city": "Paris"}')]),
]
# the model's own call id (Mistral v11's [CALL_ID]) is kept
WITH_CALL_ID = ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}')

# replies whose calls do not parse: the whole reply is content
MALFORMED = [
    ("llama3_json", '{"name": "get_weather", "parameters": {"location": "Paris"'),  # cut off
    ("llama3_json", 'Here is the JSON: {"name": "Ada Lovelace", "born": 1815}'),  # not a call
    ("llama3_json", "In C: int f(int x) { return x; }"),
    ("llama3_json", '<|python_tag|>brave_search.call(query="weather in Paris")'),
    ("llama3_json", '{"name": "f", "parameters": "not an object"}'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>'),  # bad JSON
    ("hermes", "<tool_call>\n{'name': 'f', 'arguments': {}}\n</tool_call>"),
    ("hermes", "<tool_call>\nget_weather(city='Paris')\n</tool_call> and more"),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'),  # cut off
    ("mistral", "[TOOL_CALLS]get weather now"),
    ("mistral", '[TOOL_CALLS] [{"name": "a", "arguments": {}}, oops'),
    ("mistral", "[TOOL_CALLS]"),
]


def counting_ids():
    counter = itertools.count()
    return lambda: f"id{next(counter)}"


def streamed(parser_name: str, pieces) -> tuple[str | None, list[tuple], list[StreamDelta]]:
    """(content, [(id, name, arguments)], deltas) of the reply fed in these pieces."""
    parser = make_tool_parser(parser_name, make_id=counting_ids())
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    content, calls = "", {}
    for delta in deltas:
        content += delta.content
        indexes = [entry.index for entry in delta.tool_calls]
        assert len(indexes) == len(set(indexes)), "one entry per call in a delta, as OpenAI's"
        for entry in delta.tool_calls:
            if entry.id is not None:  # a call's first entry: its id, name and first arguments
                assert entry.index not in calls
                calls[entry.index] = [entry.id, entry.name, entry.arguments]
            else:  # then fragments of its arguments
                calls[entry.index][2] += entry.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content or None, [tuple(calls[i]) for i in range(len(calls))], deltas


def whole(parser_name: str, text: str) -> ParsedReply:
    return parse_tool_calls(text, parser_name, make_id=counting_ids())


@pytest.mark.parametrize("parser_name, text, content, calls", WELL_FORMED)
def test_calls_and_content(parser_name, text, content, calls):
    reply = parse_tool_calls(text, parser_name)
    assert reply.content == content
    assert [(call.name, call.arguments) for call in reply.tool_calls] == calls
    for call in reply.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)
        pattern = r"[A-Za-z0-9]{9}" if parser_name == "mistral" else r"call_[A-Za-z0-9]{24}"
        assert re.fullmatch(pattern, call.id)
    assert len({call.id for call in reply.tool_calls}) == len(calls)


def test_the_models_own_call_id_is_kept():
    reply = parse_tool_calls(WITH_CALL_ID[1], WITH_CALL_ID[0])
    assert [(c.id, c.name) for c in reply.tool_calls] == [("a1b2c3d4e", "get_weather")]


@pytest.mark.parametrize("parser_name, text", MALFORMED)
def test_malformed_calls_stay_content(parser_name, text):
    reply = parse_tool_calls(text, parser_name)
    assert reply.content == text and reply.tool_calls == []


@pytest.mark.parametrize("parser_name, text, content, calls", WELL_FORMED + [
    (*WITH_CALL_ID, None, None)])
@pytest.mark.parametrize("cut", ["whole", "characters", "tokens"])
def test_streams_add_up_to_the_whole_reply(parser_name, text, content, calls, cut):
    pieces = {"whole": [text], "characters": list(text),
              "tokens": re.findall(r"\s*\w+|\s*[^\w\s]+|\s+", text)}[cut]
    assert "".join(pieces) == text
    reply = whole(parser_name, text)
    stream_content, stream_calls, deltas = streamed(parser_name, pieces)
    assert stream_content == reply.content
    assert stream_calls == [(c.id, c.name, c.arguments) for c in reply.tool_calls]
    never_content(parser_name, deltas, reply)


def never_content(parser_name, deltas, reply):
    """No delta's content holds text of a call: an opener, or the call's own JSON."""
    streamed_content = "".join(delta.content for delta in deltas)
    for marker in {"llama3_json": ['"parameters"', "<|python_tag|>"], "hermes": ["<tool_call>", "</tool_call>"],
                   "mistral": ["[TOOL_CALLS]", "[ARGS]"]}[parser_name]:
        assert marker not in streamed_content or (reply.content and marker in reply.content)
    for call in reply.tool_calls:
        assert call.arguments not in streamed_content


@settings(max_examples=40, deadline=None)
@given(case=st.sampled_from(WELL_FORMED), cuts=st.lists(st.integers(1, 400), max_size=30))
def test_any_cut_of_a_stream_adds_up(case, cuts):
    parser_name, text = case[0], case[1]
    points = sorted(set(c % (len(text) + 1) for c in cuts))
    pieces = [text[a:b] for a, b in zip([0] + points, points + [len(text)])]
    reply = whole(parser_name, text)
    content, calls, _ = streamed(parser_name, pieces)
    assert content == reply.content
    assert calls == [(c.id, c.name, c.arguments) for c in reply.tool_calls]


@pytest.mark.parametrize("parser_name, text", MALFORMED)
def test_malformed_streams_never_raise_nor_show_call_text(parser_name, text):
    """A call that breaks before it shows its shape streams as content, like the whole
    parse; one that breaks after (a reply cut off in its arguments) stays the call that
    was streamed, its arguments those sent, and the rest of its text never shows."""
    content, calls, deltas = streamed(parser_name, list(text))
    if calls:
        assert content is None or text.startswith(content)
        for _, name, arguments in calls:
            assert name in text and arguments in text
        streamed_content = "".join(d.content for d in deltas)
        assert all(arguments not in streamed_content for _, _, arguments in calls)
    else:
        assert content == text


@pytest.mark.parametrize("parser_name, text, content, calls",
                         [case for case in WELL_FORMED if len(case[3]) > 1])
def test_max_calls_keeps_the_first_calls_whole_and_streamed(parser_name, text, content,
                                                            calls):
    """parallel_tool_calls false keeps the first call; the others' text is no content."""
    reply = parse_tool_calls(text, parser_name, make_id=counting_ids(), max_calls=1)
    assert [(c.name, c.arguments) for c in reply.tool_calls] == calls[:1]
    assert reply.content == content
    parser = make_tool_parser(parser_name, make_id=counting_ids(), max_calls=1)
    deltas = [parser.feed(ch) for ch in text] + [parser.finish()]
    assert {d.index for delta in deltas for d in delta.tool_calls} == {0}
    assert "".join(delta.content for delta in deltas) == (content or "")


def test_held_text_is_released_when_it_is_no_call():
    parser = make_tool_parser("hermes")
    assert parser.feed("Use the <tool").content == "Use the"  # " <tool" may open a call
    assert parser.feed("box> here").content == " <toolbox> here"
    assert parser.finish().content == ""
    parser = make_tool_parser("llama3_json")
    assert parser.feed('Say {"name": "Ada"').content == "Say"  # it may still become a call
    assert parser.feed(', "born": 1815} ok\n').content == ' {"name": "Ada", "born": 1815} ok'
    assert parser.finish().content == "\n"  # trailing whitespace waits for the end


def test_openai_shapes():
    call = ToolCall("call_1", "f", '{"a": 1}')
    assert call.to_openai() == {"id": "call_1", "type": "function",
                                "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert ParsedReply(None, [call]).to_openai() == {
        "role": "assistant", "content": None, "tool_calls": [call.to_openai()]}
    assert ParsedReply("hi").to_openai() == {"role": "assistant", "content": "hi"}
    parser = make_tool_parser("hermes", make_id=lambda: "call_1")
    delta = parser.feed('Hi <tool_call>{"name": "f", "arguments": {"a"')
    assert delta.to_openai() == {"content": "Hi", "tool_calls": [
        {"index": 0, "id": "call_1", "type": "function",
         "function": {"name": "f", "arguments": '{"a"'}}]}
    assert parser.feed(": 1}}</tool_call>").to_openai() == {
        "tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}
    assert parser.finish().to_openai() == {} and not parser.finish()
    assert make_tool_parser("mistral").keeps_special_tokens
    assert not make_tool_parser("hermes").keeps_special_tokens


def test_the_chat_template_names_the_parser():
    templates = {path.stem: path.read_text() for path in CHAT_TEMPLATES.glob("*.jinja")}
    assert tool_parser_for_template(templates["llama3.2_json_tools"]) == "llama3_json"
    assert tool_parser_for_template(templates["hermes_tools"]) == "hermes"
    assert tool_parser_for_template(templates["mistral_tools"]) == "mistral"
    for template in (LLAMA3_CHAT_TEMPLATE, CHATML_TEMPLATE, MISTRAL_TEMPLATE, None, ""):
        assert tool_parser_for_template(template) is None  # formats without tool calls
    with pytest.raises(RequestError, match="--tool-call-parser: unknown tool-call parser 'qwen'; "
                                           "use one of llama3_json, hermes, mistral"):
        make_tool_parser("qwen")
    assert PARSER_NAMES == ("llama3_json", "hermes", "mistral")
