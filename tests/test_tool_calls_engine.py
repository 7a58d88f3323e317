"""Tool calls through LLM.chat on tiny random models with the tool templates of Llama 3.2
(JSON) and Hermes/Qwen: "required" and a named function always give well-formed calls to
listed functions whose arguments follow their schemas, "none" never gives a call, and a
two-turn exchange (a call, its result, an answer) renders and runs."""
import json

import pytest

from cupy_llama import LLM, SamplingParams
from cupy_llama.errors import RequestError

from conftest import QUESTION, SCHEMAS, TOOLS, make_tool_model, read_jsonl

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")



@pytest.fixture(scope="module", params=["llama3_json", "hermes"])
def tool_llm(request, tmp_path_factory):
    model_dir = make_tool_model(tmp_path_factory.mktemp(request.param), request.param)
    llm = LLM(model_dir, device="cpu", log=None)
    yield llm
    llm.close()


def params(seed, **more):
    return SamplingParams(**{"temperature": 1.0, "seed": seed, "max_tokens": 500, **more})


def assert_valid_calls(output, names):
    assert output.finish_reason == "tool_calls", output.text
    assert output.tool_calls, output.text
    for call in output.tool_calls:
        assert call.name in names and call.id
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("seed", range(3))
def test_required_and_named_calls_are_always_valid(tool_llm, seed):
    # (one call: a random model allowed more would write calls until max_tokens)
    required = tool_llm.chat(QUESTION, params(seed), tools=TOOLS, tool_choice="required",
                             parallel_tool_calls=False)
    assert_valid_calls(required, SCHEMAS)
    assert len(required.tool_calls) == 1
    named = tool_llm.chat(QUESTION, params(seed), tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
    assert_valid_calls(named, {"get_time"})
    assert len(named.tool_calls) == 1


def test_a_constraint_that_spells_a_tag_writes_it(tool_llm):
    """A choice spelling the family's call tag (Llama's special <|python_tag|>, Qwen's
    added <tool_call>) is written and ends at "stop": the mask offers only what the
    constraint's matcher then accepts (as text, or as the added token that is text)."""
    tag = "<|python_tag|>" if tool_llm.tokenizer.token_to_id("<|python_tag|>") else "<tool_call>"
    choices = [tag + "x", tag + "yy"]
    for seed in range(3):
        output = tool_llm.generate(["Hi"], params(seed, structured={"choice": choices}))[0]
        assert output.finish_reason == "stop" and output.text in choices, output


def test_without_parallel_calls_auto_keeps_the_first(tool_llm):
    """parallel_tool_calls=False with "auto": a reply that writes several calls (a grammar
    makes this random model write them) keeps the first, whole and streamed, as vLLM."""
    from cupy_llama.tool_choice import tool_call_grammar
    parser = "hermes" if "tool_call" in tool_llm.tokenizer.chat_template else "llama3_json"
    several = tool_call_grammar(parser, TOOLS, "required", True,
                                token_id=tool_llm.tokenizer.token_to_id)
    seen_several = False
    for seed in range(4):
        given = params(seed, structured=several)
        many = tool_llm.chat(QUESTION, given, tools=TOOLS, tool_choice="auto")
        one = tool_llm.chat(QUESTION, given, tools=TOOLS, tool_choice="auto",
                            parallel_tool_calls=False)
        assert one.text == many.text
        first = [(c.name, c.arguments) for c in many.tool_calls or []][:1]
        assert [(c.name, c.arguments) for c in one.tool_calls or []] == first
        seen_several |= len(many.tool_calls or []) > 1
        streamed = list(tool_llm.chat(QUESTION, given, tools=TOOLS, tool_choice="auto",
                                      parallel_tool_calls=False, stream=True))
        indexes = {d.index for o in streamed for d in o.tool_call_deltas or []}
        assert indexes <= {0}
        assert [(c.name, c.arguments) for c in streamed[-1].tool_calls or []] == first
    assert seen_several, "no seed wrote several calls: the test shows nothing"


def test_none_never_calls(tool_llm):
    outputs = tool_llm.chat([QUESTION] * 4, params(1, max_tokens=60), tools=TOOLS,
                            tool_choice="none")
    for output in outputs:
        assert output.tool_calls is None and output.finish_reason != "tool_calls"
    # the template is shown the tools all the same (OpenAI's model and vLLM's prompt see
    # them): a conversation keeps one prompt prefix whatever each turn's tool_choice
    auto = tool_llm.chat(QUESTION, params(1, max_tokens=1), tools=TOOLS)
    plain = tool_llm.chat(QUESTION, params(1, max_tokens=1))
    assert outputs[0].prompt_token_ids == auto.prompt_token_ids != plain.prompt_token_ids


def test_a_two_turn_exchange_runs(tool_llm):
    first = tool_llm.chat(QUESTION, params(5), tools=TOOLS, tool_choice="required",
                          parallel_tool_calls=False)
    call = first.tool_calls[0]
    exchange = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.to_openai()]},
        {"role": "tool", "tool_call_id": call.id, "content": "22C and sunny"}]
    answer = tool_llm.chat(exchange, params(6, max_tokens=20), tools=TOOLS)
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    prompt = tool_llm.tokenizer.decode(answer.prompt_token_ids)
    assert "22C and sunny" in prompt and call.name in prompt


def test_bad_tool_requests_name_the_field(tool_llm):
    with pytest.raises(RequestError, match="tool_choice.function.name 'nope' is not one of"):
        tool_llm.chat(QUESTION, params(0), tools=TOOLS,
                      tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(RequestError, match=r"tools\[0\].type must be \"function\""):
        tool_llm.chat(QUESTION, params(0), tools=[{"type": "retrieval"}])
    with pytest.raises(RequestError, match="leave params.structured out"):
        tool_llm.chat(QUESTION, params(0, structured={"regex": "a"}), tools=TOOLS,
                      tool_choice="required")
    with pytest.raises(RequestError, match="named function sets the output's grammar; "
                                           "leave params.allowed_token_ids out"):
        tool_llm.chat(QUESTION, params(0, allowed_token_ids=[5]), tools=TOOLS,
                      tool_choice="required")
    assert not tool_llm.engine.requests


def test_a_template_that_refuses_tools_says_so(llm):
    """The tiny model's built-in Llama 3 format refuses tools: chat() quotes it, since no
    tool_call_parser would help. A template that renders tools in no known format asks
    for the parser."""
    with pytest.raises(RequestError, match="does not support tools") as caught:
        llm.chat(QUESTION, tools=TOOLS)
    assert "tool_call_parser" not in str(caught.value)
    renders_tools = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools | tojson }}"
    with pytest.raises(RequestError, match="shows no tool-call format.*tool_call_parser="):
        llm.chat(QUESTION, tools=TOOLS, chat_template=renders_tools)
    # the check renders with the chat's template variables, as the chat itself does
    needs_flavour = ("{% if not flavour %}{{ raise_exception('no flavour') }}{% endif %}"
                     "{% if tools %}{{ raise_exception('no tools in this one') }}{% endif %}"
                     "{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(RequestError, match="no tools in this one"):
        llm.chat(QUESTION, tools=TOOLS, chat_template=needs_flavour,
                 chat_template_kwargs={"flavour": "q"})
    # tool_choice "none" asks for no call: a template that refuses tools gets none
    quiet = SamplingParams(max_tokens=1, temperature=0)
    assert llm.chat(QUESTION, quiet, tools=TOOLS, tool_choice="none").prompt_token_ids \
        == llm.chat(QUESTION, quiet).prompt_token_ids
    assert not llm.engine.requests


def reassemble(stream):
    """Each sample's streamed content, calls (id, name, arguments) and final output."""
    samples = {}
    for output in stream:
        content, calls, _ = samples.get(output.index, ("", {}, None))
        content += output.delta
        for piece in output.tool_call_deltas or []:
            if piece.id is not None:
                assert piece.index not in calls
                calls[piece.index] = [piece.id, piece.name, ""]
            calls[piece.index][2] += piece.arguments
        samples[output.index] = (content, calls, output if output.finished else None)
    return samples


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_streamed_calls_add_up_to_the_whole_answer(tool_llm, choice):
    whole = tool_llm.chat(QUESTION, params(7, n=2), tools=TOOLS, tool_choice=choice,
                          parallel_tool_calls=False)
    stream = tool_llm.chat(QUESTION, params(7, n=2), tools=TOOLS, tool_choice=choice,
                           parallel_tool_calls=False, stream=True)
    samples = reassemble(stream)
    assert sorted(samples) == [0, 1]
    for expected in whole:
        content, calls, last = samples[expected.index]
        assert last.text == expected.text  # the same reply, streamed
        assert last.finish_reason == expected.finish_reason == "tool_calls"
        assert last.content == expected.content
        assert content == (expected.content or "")  # no call text ever went out as content
        assert [(c.name, c.arguments) for c in last.tool_calls] == \
            [(c.name, c.arguments) for c in expected.tool_calls]
        assert [calls[i] for i in sorted(calls)] == \
            [[c.id, c.name, c.arguments] for c in last.tool_calls]
    assert not tool_llm.engine.requests


def test_a_stream_left_early_is_aborted(tool_llm):
    stream = tool_llm.chat(QUESTION, params(2, max_tokens=100), tools=TOOLS, stream=True)
    next(iter(stream))
    stream.close()
    assert not tool_llm.engine.requests


def test_streamed_mistral_calls_read_the_special_tag(tmp_path):
    llm = LLM(make_tool_model(tmp_path, "mistral"), device="cpu", log=None)
    try:
        whole = llm.chat(QUESTION, params(4), tools=TOOLS, tool_choice="required",
                         parallel_tool_calls=False)
        samples = reassemble(llm.chat(QUESTION, params(4), tools=TOOLS, stream=True,
                                      tool_choice="required", parallel_tool_calls=False))
        content, calls, last = samples[0]
        assert_valid_calls(last, SCHEMAS)
        assert content == (whole.content or "")
        assert [(c.name, c.arguments) for c in last.tool_calls] == \
            [(c.name, c.arguments) for c in whole.tool_calls]
        assert [calls[i][1:] for i in sorted(calls)] == \
            [[c.name, c.arguments] for c in whole.tool_calls]
    finally:
        llm.close()


def test_a_mistral_reply_with_tools_is_cut_at_its_stop_string(tmp_path):
    """Mistral's calls start at a special token, so replies offered tools keep special
    tokens in their text; a stop string still cuts that text, and the content parsed from
    it, streamed or not (the content used to be decoded again from every token)."""
    llm = LLM(make_tool_model(tmp_path, "mistral"), device="cpu", log=None)
    try:
        free = llm.chat(QUESTION, params(1, max_tokens=40), tools=TOOLS)
        text = free.text
        stop = next(text[i:i + 2] for i in range(3, len(text) - 2)
                    if "\ufffd" not in text[i:i + 2] and "[" not in text[i:i + 2])
        cut = llm.chat(QUESTION, params(1, max_tokens=40, stop=[stop]), tools=TOOLS)
        assert cut.finish_reason == "stop" and stop not in cut.text
        assert cut.text == text[:text.index(stop)]
        assert cut.content == cut.text and not cut.tool_calls  # noise: no call in it
        streamed = list(llm.chat(QUESTION, params(1, max_tokens=40, stop=[stop]),
                                 tools=TOOLS, stream=True))
        assert "".join(o.delta for o in streamed) == cut.content == streamed[-1].content
    finally:
        llm.close()


def test_conversations_with_their_own_params_take_an_enforced_tool_choice(tool_llm):
    """LLM.chat over several conversations, one SamplingParams each, with tool_choice
    "required": each gets the grammar, with its own params."""
    conversations = [QUESTION, [{"role": "user", "content": "And the time in Tokyo?"}]]
    outputs = tool_llm.chat(conversations, [params(0), params(1, max_tokens=400)],
                            tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(outputs) == 2
    for output in outputs:
        assert_valid_calls(output, SCHEMAS)


def test_plain_batch_lines_take_tools(tool_llm, tmp_path):
    """`generate` with plain lines: tools, tool_choice and parallel_tool_calls beside
    messages, as LLM.chat takes them; the parsed calls in the output line."""
    from cupy_llama.cli import main
    single = {"messages": QUESTION, "tools": TOOLS, "temperature": 0, "max_tokens": 500,
              "parallel_tool_calls": False}
    named = {"type": "function", "function": {"name": "get_time"}}
    lines = [{"id": "required", **single, "tool_choice": "required"},
             {"id": "named", **single, "tool_choice": named},
             {"id": "none", **single, "tool_choice": "none", "max_tokens": 20},
             {"id": "prompt", "prompt": "hi", "tools": TOOLS},
             {"id": "unknown", **single, "tool_choice": {"type": "function",
                                                         "function": {"name": "nope"}}},
             {"id": "both", **single, "tool_choice": "required", "guided_choice": ["a"]}]
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code = main(["generate", "--model", str(tool_llm.model_dir), "--device", "cpu",
                 "--input", str(path), "--output", str(out)])
    rows = {row["id"]: row for row in read_jsonl(out)}
    assert code == 1  # the last three lines failed
    for name, choice in (("required", "required"), ("named", named)):
        row = rows[name]
        want = tool_llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=500),
                             tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
        assert row["finish_reason"] == want.finish_reason == "tool_calls"
        assert row["text"] == want.text and row["content"] == want.content
        assert [(c["type"], c["function"]["name"], c["function"]["arguments"])
                for c in row["tool_calls"]] == \
            [("function", c.name, c.arguments) for c in want.tool_calls]
        for call in row["tool_calls"]:
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                SCHEMAS[call["function"]["name"]])
    assert rows["named"]["tool_calls"][0]["function"]["name"] == "get_time"
    assert "tool_calls" not in rows["none"] and rows["none"]["finish_reason"] != "tool_calls"
    assert "tools need 'messages'" in rows["prompt"]["error"]
    assert "tool_choice.function.name 'nope' is not one of the tools" in rows["unknown"]["error"]
    assert "leave out the line's constraint" in rows["both"]["error"]


def test_a_tool_use_template_beside_the_default_calls_tools(tmp_path):
    """A model whose tools come in through a "tool_use" template beside a default one
    (Hermes' tokenizer_config.json): its format is found there and the calls are valid."""
    from cupy_llama.bench.random_model import CHATML_TEMPLATE
    model_dir = make_tool_model(tmp_path / "hermes", "hermes")
    tool_use = (model_dir / "chat_template.jinja").read_text()
    (model_dir / "chat_template.jinja").unlink()
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": CHATML_TEMPLATE},
        {"name": "tool_use", "template": tool_use}], "eos_token": "<|im_end|>"}))
    llm = LLM(model_dir, device="cpu", log=None)
    try:
        assert "<tools>" not in llm.tokenizer.apply_chat_template(QUESTION)
        assert "<tools>" in llm.tokenizer.apply_chat_template(QUESTION, tools=TOOLS)
        output = llm.chat(QUESTION, params(0), tools=TOOLS, tool_choice="required",
                          parallel_tool_calls=False)
        assert_valid_calls(output, {"get_weather", "get_time"})
        assert len(output.tool_calls) == 1
    finally:
        llm.close()


def test_a_named_template_without_a_default_calls_tools(tmp_path):
    """Named templates and no "default": a chat that names the one with the tool format
    renders and parses in it (LLM.chat and a batch line as the server does); naming
    none is refused with the names."""
    from cupy_llama.errors import TokenizerError
    model_dir = make_tool_model(tmp_path / "hermes", "hermes")
    hermes = (model_dir / "chat_template.jinja").read_text()
    (model_dir / "chat_template.jinja").unlink()
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "hermes", "template": hermes}], "eos_token": "<|im_end|>"}))
    llm = LLM(model_dir, device="cpu", log=None)
    try:
        output = llm.chat(QUESTION, params(0), tools=TOOLS, tool_choice="required",
                          parallel_tool_calls=False, chat_template="hermes")
        assert_valid_calls(output, {"get_weather", "get_time"})
        with pytest.raises(TokenizerError, match=r"lists chat templates \('hermes'\)"):
            llm.chat(QUESTION, params(0))
    finally:
        llm.close()
