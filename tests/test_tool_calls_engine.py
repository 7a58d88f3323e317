"""Tool calls through LLM.chat on tiny random models with the tool templates of Llama 3.2
(JSON) and Hermes/Qwen: "required" and a named function always give well-formed calls to
listed functions whose arguments follow their schemas, "none" never gives a call, and a
two-turn exchange (a call, its result, an answer) renders and runs."""
import json

import pytest

from cupy_llama import LLM, SamplingParams
from cupy_llama.errors import RequestError

from conftest import QUESTION, SCHEMAS, TOOLS, make_tool_model

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


def test_none_never_calls(tool_llm):
    for output in tool_llm.chat([QUESTION] * 4, params(1, max_tokens=60), tools=TOOLS,
                                tool_choice="none"):
        assert output.tool_calls is None and output.finish_reason != "tool_calls"


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
    assert not tool_llm.engine.requests
