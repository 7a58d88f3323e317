"""A reasoning model's thinking apart from its answer (reasoning.py, serve
--reasoning-parser): the split, whole and streamed; where a reply starts; a structured
answer constrained after the thinking only (structured.ReasoningGate), on the engine and
over HTTP.

The model is a tiny random Qwen3 (its tokenizer holds <think> and </think> as plain
tokens, as Qwen3's does) with dimensions of the residual stream taken over to script its
reply, as test_family_chat.py does: the generation prompt's last token "\\n" makes <think>
the likeliest next token, then "a", then </think>, then "b", then <|im_end|>. A second one
(`quoting`) writes "</think>" in ordinary tokens before the </think> token: only the token
ends the thinking. A third (`r1`) has DeepSeek-R1-Distill's turns, whose role markers are no
special tokens: a user message quoting a marker does not say where the reply starts."""
import io
import itertools
import json
from dataclasses import replace

import pytest

from cupy_llama import LLM, SamplingParams
from cupy_llama.bench.random_model import make_random_model
from cupy_llama.errors import RequestError
from cupy_llama.reasoning import ReasoningParser, ReasoningSplitter, split_reasoning
from cupy_llama.structured import StructuredSpec
from cupy_llama.tokenizer import Tokenizer

from test_family_chat import script_chain

CHAT = [{"role": "user", "content": "Yes or no?"}]
YES_NO = StructuredSpec.choice(["yes", "no"])
MARKERS = ("<think>", "</think>")

# (parser, starts thinking, reply) -> (reasoning, content). A reply is written as its
# parts: "<think>" or "</think>" alone is that marker's token; any other part is spelled
# in ordinary tokens, one character at a time, the markers' text in it too.
SPLITS = [
    ("qwen3", True, ["<think>", "\nLet me see.\n", "</think>", "\n\nParis."],
     ("\nLet me see.\n", "\n\nParis.")),
    ("qwen3", True, ["Let me see.", "</think>", "Paris."], ("Let me see.", "Paris.")),
    ("qwen3", True, ["<think>", "cut off by max_tok"], ("cut off by max_tok", None)),
    ("qwen3", True, ["<think>", "a <", "</think>"], ("a <", None)),
    ("qwen3", True, ["<think>", "ends at </thi"], ("ends at </thi", None)),
    ("qwen3", True, ["<think>", "hm<tool_call>{}"], ("hm<tool_call>{}", None)),
    ("qwen3", True, ["a", "</think>", "b", "</think>", "c"], ("a", "b</think>c")),
    ("qwen3", False, ["<think>", "x", "</think>", "Paris."], (None, "<think>x</think>Paris.")),
    ("deepseek_r1", True, ["Thinking.\n", "</think>", "\n\nParis."],
     ("Thinking.\n", "\n\nParis.")),
    ("qwen3", True, ["<think>", "<think>", "a", "</think>", "b"], ("a", "b")),
    # the markers' text in ordinary tokens is the thinking's: only the tokens end it
    ("qwen3", True, ["<think>", "a</think>b"], ("a</think>b", None)),
    ("qwen3", True, ["<think>", "a</think>", "</think>", "b"], ("a</think>", "b")),
    ("qwen3", True, ["<think>", "<think>x</think></think>", "</think>", "</think>y"],
     ("<think>x</think></think>", "</think>y")),
    ("deepseek_r1", True, ["say </think>", "<think>", "then <think>", "</think>", "ok"],
     ("say </think>then <think>", "ok")),
]


@pytest.fixture(scope="module")
def parsers(tmp_path_factory):
    """The parsers by name, on a tiny Qwen3 tokenizer (byte-level, <think> and </think>
    plain added tokens)."""
    from cupy_llama.bench.random_model import write_tokenizer
    folder = tmp_path_factory.mktemp("qwen3_tokenizer")
    write_tokenizer(folder, 512, "qwen3")
    tokenizer = Tokenizer.from_dir(folder)
    return {name: ReasoningParser.for_tokenizer(name, tokenizer)
            for name in ("qwen3", "deepseek_r1")}


def reply_tokens(parser, parts) -> list[int]:
    """The token ids of a reply written as parts (SPLITS)."""
    token_id = {parser.format.start: parser.start_token, parser.format.end: parser.end_token}
    ids = []
    for part in parts:
        if part in MARKERS:
            ids.append(token_id[part])
        else:
            ids += [ord(ch) for ch in part]  # the test vocabulary's byte tokens
    assert parser.decode(ids) == "".join(parts)
    return ids


def split_in_pieces(parser, thinking, ids, cuts) -> list[tuple[str, str]]:
    """The splitter's pieces of a reply fed in pieces: cuts are (tokens, characters) fed
    by the end of each piece but the last; a piece's text lags its tokens, never leads."""
    splitter, text = ReasoningSplitter(parser, thinking), parser.decode(ids)
    bounds = [(0, 0), *cuts, (len(ids), len(text))]
    pieces = [splitter.feed(text[c:d], ids[a:b]) for (a, c), (b, d) in zip(bounds, bounds[1:])]
    return pieces + [splitter.finish()]


@pytest.mark.parametrize("name, thinking, parts, expected", SPLITS)
def test_a_reply_splits_alike_whole_and_streamed_at_any_cut(parsers, name, thinking, parts,
                                                            expected):
    parser = parsers[name]
    ids = reply_tokens(parser, parts)
    text = parser.decode(ids)
    assert split_reasoning(parser, text, ids, thinking) == expected
    want = tuple(part or "" for part in expected)
    ends = [len(parser.decode(ids[:n])) for n in range(len(ids) + 1)]  # each prefix's text
    points = [(n, c) for n in range(len(ids) + 1) for c in range(ends[n] + 1)]
    caught_up = [(n, ends[n]) for n in range(len(ids) + 1)]
    for cuts in itertools.chain(
            ([point] for point in points),  # one cut, the text anywhere behind its tokens
            itertools.combinations(caught_up, 2),  # two, the text up to its tokens
            ([(len(ids), c)] for c in range(len(text) + 1))):  # every token first
        pieces = split_in_pieces(parser, thinking, ids, cuts)
        assert tuple("".join(piece[k] for piece in pieces) for k in (0, 1)) == want, cuts


def test_the_split_ends_the_thinking_where_the_gate_does(parsers):
    """Token by token, the split's thinking and the engine's gate end together: at the
    </think> token, not at its text in ordinary tokens."""
    from cupy_llama.structured import AllowedTokensMatcher, ReasoningGate
    parser = parsers["qwen3"]
    ids = reply_tokens(parser, ["<think>", "a</think>", "b", "</think>", "{}"])
    anything = AllowedTokensMatcher(range(512), 16)
    gate = ReasoningGate(anything, parser.end_token, anything)
    splitter = ReasoningSplitter(parser, True)
    for token_id in ids:
        gate.advance(token_id)
        splitter.feed(parser.decode([token_id]), [token_id])
        assert splitter.thinking == gate.thinking, token_id
    assert not gate.thinking and gate.num_thinking == len(ids) - 2


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(model dir, LLM on the CPU) of the scripted tiny Qwen3 (module doc)."""
    model_dir = make_random_model(tmp_path_factory.mktemp("qwen3") / "model", "tiny", seed=0,
                                  architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False)
    script_chain(model_dir, ["\n", "<think>", "a", "</think>", "b", "<|im_end|>"])
    llm = LLM(model_dir, device="cpu", log=None)
    yield model_dir, llm
    llm.close()


def test_the_parser_knows_the_model_thinks(qwen3, tmp_path):
    """Where a reply starts: as the last marker of the prompt's last turn says; where it
    has none, not thinking where Qwen3's enable_thinking is false, else thinking."""
    model_dir, llm = qwen3
    tokenizer = llm.tokenizer
    parser = ReasoningParser.for_tokenizer("qwen3", tokenizer)
    assert parser.end_token == tokenizer.token_to_id("</think>") and not parser.special
    r1 = ReasoningParser.for_tokenizer("deepseek_r1", tokenizer)
    assert parser.thinks(tokenizer.encode_chat(CHAT), None)
    closed = tokenizer.encode_chat(CHAT, template_kwargs={"enable_thinking": False})
    assert not parser.thinks(closed, None) and not r1.thinks(closed, None)
    assert not parser.thinks(tokenizer.encode_chat(CHAT), {"enable_thinking": False})
    assert r1.thinks(tokenizer.encode_chat(CHAT), {"enable_thinking": False})  # R1's ignores it

    def turn(text):  # a last turn: <|im_start|> then text
        return [tokenizer.token_to_id("<|im_start|>")] + tokenizer.encode(
            text, add_special_tokens=False)

    earlier = tokenizer.encode_chat(CHAT + [
        {"role": "assistant", "content": "<think>x</think>y"},
        {"role": "user", "content": "Again?"}], add_generation_prompt=False)
    assert parser.thinks(earlier + turn("assistant\n"), None)  # an earlier turn's </think>
    assert not parser.thinks(earlier + turn("assistant\n<think>\nhm\n</think>\n\nThe"), None)
    assert parser.thinks(earlier + turn("assistant\n<think>\nLet me"), None)
    # what the chat reads to show a thinking its template opened
    assert parser.last_marker(earlier + turn("assistant\n<think>\n")) == parser.start_token
    assert parser.last_marker(earlier + turn("assistant\n")) is None
    # a template that opens <think> whatever enable_thinking says (QwQ, the Thinking-2507
    # models): the prompt's marker wins over the keyword
    assert parser.thinks(earlier + turn("assistant\n<think>\n"), {"enable_thinking": False})
    with pytest.raises(RequestError, match="unknown parser 'nope'; use one of qwen3, deepseek_r1"):
        ReasoningParser.for_tokenizer("nope", llm.tokenizer)
    llama_dir = make_random_model(tmp_path / "llama", "tiny")
    with pytest.raises(RequestError, match="vocabulary has no </think> token"):
        ReasoningParser.for_tokenizer("qwen3", Tokenizer.from_dir(llama_dir))


def test_the_scripted_reply_thinks_then_answers(qwen3):
    _, llm = qwen3
    reply = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=10))
    assert reply.text == "<think>a</think>b" and reply.finish_reason == "stop"
    parser = ReasoningParser.for_tokenizer("qwen3", llm.tokenizer)
    assert split_reasoning(parser, reply.text, reply.token_ids, True) == ("a", "b")


def test_a_constraint_after_the_thinking_leaves_the_thinking_free(qwen3):
    """Constrained from the first token, the reply cannot think (<think> is not "yes" or
    "no"); starting after </think>, the thinking runs as scripted and the answer keeps to
    the constraint, whatever the script would have said ("b")."""
    _, llm = qwen3
    parser = ReasoningParser.for_tokenizer("qwen3", llm.tokenizer)
    end = parser.end_token
    greedy = dict(temperature=0, max_tokens=10)
    plain = llm.chat(CHAT, SamplingParams(structured=YES_NO, **greedy))
    assert plain.text in ("yes", "no")
    gated = SamplingParams(structured=replace(YES_NO, starts_after=end), **greedy)
    replies = llm.chat([CHAT, CHAT], gated)
    for reply in replies:
        reasoning, content = split_reasoning(parser, reply.text, reply.token_ids, True)
        assert reasoning == "a" and content in ("yes", "no"), reply.text
        assert reply.finish_reason == "stop"
    # cut off while thinking: nothing is constrained yet
    short = llm.chat(CHAT, SamplingParams(structured=gated.structured, temperature=0,
                                          max_tokens=2))
    assert short.text == "<think>a" and short.finish_reason == "length"


def test_a_gated_constraint_forks_and_rolls_back(qwen3):
    """ReasoningGate keeps its place through fork and rollback, the end token included."""
    _, llm = qwen3
    from cupy_llama.structured import GrammarCompiler
    tokenizer = llm.tokenizer
    compiler = GrammarCompiler.from_tokenizer(tokenizer, llm.engine.config.vocab_size,
                                              llm.engine.eos_token_ids)
    end = tokenizer.token_to_id("</think>")
    spec = StructuredSpec("choice", YES_NO.text, starts_after=end)
    engine = llm.engine
    gate = engine._grammar_matcher(compiler.compile(spec), SamplingParams(structured=spec))
    words = compiler.compile(spec)._num_words
    import numpy as np
    mask = np.zeros((1, words), np.uint32)
    think = tokenizer.encode("a", add_special_tokens=False)
    assert all(gate.advance(t) for t in think) and gate.thinking and gate.eos_allowed
    gate.fill_bitmask(mask, 0)
    assert np.unpackbits(mask.view(np.uint8), bitorder="little")[
        :engine.config.vocab_size].all()  # every token, while thinking
    assert gate.advance(end) and not gate.thinking and not gate.eos_allowed
    fork = gate.fork()
    yes = tokenizer.encode("yes", add_special_tokens=False)
    assert all(fork.advance(t) for t in yes) and fork.is_complete
    assert not gate.is_complete  # the fork went its own way
    fork.rollback(len(yes) + 1)  # back before </think>: thinking again
    assert fork.thinking and fork.num_after == 0 and fork.num_thinking == len(think)
    assert not gate.advance(tokenizer.encode("b", add_special_tokens=False)[0])
    assert gate.error is not None
    with pytest.raises(RequestError, match="starts_after must be a token id"):
        StructuredSpec("choice", YES_NO.text, starts_after=-1)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.generate("x", SamplingParams(structured=StructuredSpec(
            "choice", YES_NO.text, starts_after=10**6)))


# ---- over HTTP --------------------------------------------------------------------------

def chat(state, **fields):
    from inprocess_server import ask_one
    return ask_one(state, "POST", "/v1/chat/completions",
                   json={"messages": CHAT, "temperature": 0, "max_tokens": 10, **fields})


def streamed(answer) -> tuple[str, str, list]:
    """A streamed reply's reasoning and content, joined, and its deltas."""
    deltas = [event["choices"][0]["delta"] for event in answer.events() if event["choices"]]
    for delta in deltas:
        assert delta.get("reasoning") == delta.get("reasoning_content"), delta
    return ("".join(d.get("reasoning") or "" for d in deltas),
            "".join(d.get("content") or "" for d in deltas), deltas)


def test_the_server_answers_reasoning_apart(qwen3):
    pytest.importorskip("fastapi")
    from inprocess_server import make_state
    model_dir, llm = qwen3
    state = make_state(model_dir, llm, reasoning_parser="qwen3")
    message = chat(state).json()["choices"][0]["message"]
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == \
        ("a", "a", "b")
    answer = chat(state, stream=True)
    reasoning, content, deltas = streamed(answer)
    assert (reasoning, content) == ("a", "b")
    assert not any("think>" in json.dumps(delta) for delta in deltas)
    # no chunk carries nothing (the markers' tokens show as none)
    assert all(e["choices"][0]["delta"] or e["choices"][0]["finish_reason"]
               for e in answer.events() if e["choices"])
    hidden = chat(state, include_reasoning=False).json()["choices"][0]["message"]
    assert (hidden["reasoning"], hidden["content"]) == (None, "b")
    assert streamed(chat(state, stream=True, include_reasoning=False))[:2] == ("", "b")
    # no thinking asked for: the template closes it in the prompt, and the reply (which
    # the script makes think anyway) is all answer
    off = chat(state, chat_template_kwargs={"enable_thinking": False}).json()
    assert off["choices"][0]["message"]["content"] == "<think>a</think>b"
    assert off["choices"][0]["message"]["reasoning"] is None
    cut = chat(state, max_tokens=2).json()["choices"][0]
    assert (cut["message"]["reasoning"], cut["message"]["content"], cut["finish_reason"]) == \
        ("a", None, "length")
    plain = chat(make_state(model_dir, llm)).json()["choices"][0]["message"]
    assert plain["content"] == "<think>a</think>b" and "reasoning" not in plain


def test_a_returned_thinking_reaches_the_template(qwen3):
    """An assistant message sent back with its reasoning (either name) gives the chat
    template both, as Qwen3's reads the thinking of a tool-call loop."""
    pytest.importorskip("fastapi")
    from inprocess_server import ask_one, make_state
    model_dir, llm = qwen3
    state = make_state(model_dir, llm, reasoning_parser="qwen3",
                       trust_request_chat_template=True)
    template = ("{% for m in messages %}{{ m.role }}={{ m.reasoning }}|{{ m.reasoning_content }}"
                "|{{ m.content }};{% endfor %}")
    for name in ("reasoning", "reasoning_content"):
        answer = ask_one(state, "POST", "/tokenize", json={
            "chat_template": template, "add_generation_prompt": False,
            "messages": CHAT + [{"role": "assistant", "content": "b", name: "a"}]})
        assert answer.status == 200, answer.body
        text = llm.tokenizer.decode(answer.json()["tokens"], skip_special_tokens=False)
        assert text.endswith("assistant=a|a|b;"), text


def test_a_structured_answer_follows_the_thinking_over_http(qwen3):
    pytest.importorskip("fastapi")
    pytest.importorskip("llguidance")
    from inprocess_server import make_state
    model_dir, llm = qwen3
    state = make_state(model_dir, llm, reasoning_parser="qwen3")
    for stream in (False, True):
        answer = chat(state, stream=stream, structured_outputs={"choice": ["yes", "no"]})
        if stream:
            reasoning, content, _ = streamed(answer)
        else:
            message = answer.json()["choices"][0]["message"]
            reasoning, content = message["reasoning"], message["content"]
        assert reasoning == "a" and content in ("yes", "no"), (reasoning, content)
    # thinking off: constrained from the first token, as without a parser
    off = chat(state, structured_outputs={"choice": ["yes", "no"]},
               chat_template_kwargs={"enable_thinking": False}).json()["choices"][0]
    assert off["message"]["content"] in ("yes", "no") and off["message"]["reasoning"] is None


def test_tool_calls_are_read_from_the_answer_only(qwen3):
    pytest.importorskip("fastapi")
    pytest.importorskip("llguidance")
    from conftest import TOOLS
    from inprocess_server import make_state
    model_dir, llm = qwen3
    state = make_state(model_dir, llm, reasoning_parser="qwen3", tool_call_parser="hermes")
    named = {"type": "function", "function": {"name": "get_weather"}}
    for stream in (False, True):
        answer = chat(state, stream=stream, tools=TOOLS, tool_choice=named, max_tokens=400,
                      parallel_tool_calls=False)
        if stream:
            reasoning, content, deltas = streamed(answer)
            calls = [c for d in deltas for c in d.get("tool_calls", [])]
            name = calls[0]["function"]["name"]
            arguments = "".join(c["function"]["arguments"] for c in calls)
            finish = [e["choices"][0]["finish_reason"] for e in answer.events()
                      if e["choices"]][-1]
        else:
            choice = answer.json()["choices"][0]
            reasoning, content = choice["message"]["reasoning"], choice["message"]["content"]
            [call] = choice["message"]["tool_calls"]
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            finish = choice["finish_reason"]
        assert reasoning == "a" and not content, (reasoning, content)
        assert name == "get_weather" and isinstance(json.loads(arguments), dict)
        assert finish == "tool_calls"


def test_the_reasoning_parser_option(qwen3, tmp_path, capsys):
    """An unknown name, or a model that does not think in that format, is a usage error
    before the model loads."""
    from cupy_llama.cli import main
    from conftest import one_error_line
    model_dir, _ = qwen3
    assert main(["serve", "--model", str(model_dir), "--reasoning-parser", "nope"]) == 2
    assert "--reasoning-parser: unknown parser 'nope'" in one_error_line(capsys.readouterr().err)
    llama_dir = make_random_model(tmp_path / "llama", "tiny")
    assert main(["serve", "--model", str(llama_dir), "--reasoning-parser", "qwen3"]) == 2
    assert "has no </think> token" in one_error_line(capsys.readouterr().err)


def test_generate_splits_openai_batch_lines(qwen3, tmp_path, capsys):
    """generate --reasoning-parser: OpenAI chat lines are answered as serve answers them;
    a file of plain lines is a usage error, before the model loads."""
    pytest.importorskip("pydantic")
    from cupy_llama.cli import main
    from conftest import one_error_line, read_jsonl
    model_dir, _ = qwen3
    body = {"messages": CHAT, "temperature": 0, "max_tokens": 10}
    lines = [{"custom_id": "think", "method": "POST", "url": "/v1/chat/completions",
              "body": body},
             {"custom_id": "off", "method": "POST", "url": "/v1/chat/completions",
              "body": {**body, "chat_template_kwargs": {"enable_thinking": False}}}]
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["generate", "--model", str(model_dir), "--device", "cpu", "--input", str(path),
            "--output", str(out)]
    assert main(args + ["--reasoning-parser", "qwen3"]) == 0
    messages = {row["custom_id"]: row["response"]["body"]["choices"][0]["message"]
                for row in read_jsonl(out)}
    assert (messages["think"]["reasoning"], messages["think"]["content"]) == ("a", "b")
    assert (messages["off"]["reasoning"], messages["off"]["content"]) == \
        (None, "<think>a</think>b")
    assert main(args + ["--overwrite"]) == 0  # without the option: no split
    assert read_jsonl(out)[0]["response"]["body"]["choices"][0]["message"]["content"] == \
        "<think>a</think>b"
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"messages": CHAT}) + "\n")
    capsys.readouterr()
    assert main(["generate", "--model", str(model_dir), "--input", str(plain),
                 "--reasoning-parser", "qwen3"]) == 2
    assert "this file has plain lines" in one_error_line(capsys.readouterr().err)
    assert main(args + ["--overwrite", "--reasoning-parser", "r1"]) == 2
    assert "unknown parser 'r1'" in one_error_line(capsys.readouterr().err)
    assert main(["generate", "--model", str(model_dir), "--input", str(plain),
                 "--reasoning-parser", "r1"]) == 2  # the name first, then the file
    assert "unknown parser 'r1'" in one_error_line(capsys.readouterr().err)


# ---- the tag spelled in ordinary tokens -------------------------------------------------

YES_NO_SCHEMA = {"enum": ["yes", "no"]}


@pytest.fixture(scope="module")
def quoting(tmp_path_factory):
    """(model dir, LLM on the CPU) of a tiny Qwen3 scripted to think "a", then "</think>"
    spelled in ordinary tokens ("<", "/", "t", ..., ">"), then the </think> token, then
    to answer "b"."""
    model_dir = make_random_model(tmp_path_factory.mktemp("quoting") / "model", "tiny",
                                  seed=0, architectures=["Qwen3ForCausalLM"],
                                  tie_word_embeddings=False)
    script_chain(model_dir, ["\n", "<think>", "a", *"</think>", "</think>", "b", "<|im_end|>"])
    llm = LLM(model_dir, device="cpu", log=None)
    yield model_dir, llm
    llm.close()


def test_a_spelled_tag_neither_ends_the_thinking_nor_frees_the_answer(quoting):
    """The engine's gate ends the thinking at the </think> token; the split agrees, so a
    structured answer is the whole content, after the spelled tag and the token."""
    pytest.importorskip("llguidance")
    _, llm = quoting
    parser = ReasoningParser.for_tokenizer("qwen3", llm.tokenizer)
    reply = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=20))
    assert reply.text == "<think>a</think></think>b"
    assert split_reasoning(parser, reply.text, reply.token_ids, True) == ("a</think>", "b")
    spec = replace(StructuredSpec.json(YES_NO_SCHEMA), starts_after=parser.end_token)
    gated = llm.chat(CHAT, SamplingParams(structured=spec, temperature=0, max_tokens=20))
    reasoning, content = split_reasoning(parser, gated.text, gated.token_ids, True)
    assert reasoning == "a</think>" and json.loads(content) in ("yes", "no"), gated.text
    # cut off after the spelled tag: still thinking, as the gate is
    cut = llm.chat(CHAT, SamplingParams(structured=spec, temperature=0, max_tokens=10))
    assert split_reasoning(parser, cut.text, cut.token_ids, True) == ("a</think>", None)


def test_a_spelled_tag_stays_in_the_reasoning_over_http(quoting):
    pytest.importorskip("fastapi")
    pytest.importorskip("llguidance")
    from inprocess_server import make_state
    model_dir, llm = quoting
    state = make_state(model_dir, llm, reasoning_parser="qwen3")
    schema = {"type": "json_schema", "json_schema": {"name": "yes_no", "schema": YES_NO_SCHEMA}}
    for stream in (False, True):
        for fields, want in (({}, "b"), ({"response_format": schema}, None)):
            answer = chat(state, stream=stream, max_tokens=20, **fields)
            if stream:
                reasoning, content, _ = streamed(answer)
            else:
                message = answer.json()["choices"][0]["message"]
                reasoning, content = message["reasoning"], message["content"]
            assert reasoning == "a</think>", (stream, fields, reasoning, content)
            if want is None:
                assert json.loads(content) in ("yes", "no"), content
            else:
                assert content == want


def test_generate_keeps_a_spelled_tag_in_the_reasoning(quoting, tmp_path):
    pytest.importorskip("pydantic")
    pytest.importorskip("llguidance")
    from cupy_llama.cli import main
    from conftest import read_jsonl
    model_dir, _ = quoting
    schema = {"type": "json_schema", "json_schema": {"name": "yes_no", "schema": YES_NO_SCHEMA}}
    line = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": CHAT, "temperature": 0, "max_tokens": 20,
                     "response_format": schema}}
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text(json.dumps(line) + "\n")
    assert main(["generate", "--model", str(model_dir), "--device", "cpu", "--input",
                 str(path), "--output", str(out), "--reasoning-parser", "qwen3"]) == 0
    message = read_jsonl(out)[0]["response"]["body"]["choices"][0]["message"]
    assert message["reasoning"] == "a</think>" and json.loads(message["content"]) in ("yes", "no")


def piped_chat(model_dir, max_tokens: int):
    """`echo 'Yes or no?' | cupy-llama chat` on the model, greedy: the finished process."""
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-m", "cupy_llama.cli", "chat", "--model",
                             str(model_dir), "--device", "cpu", "--temperature", "0",
                             "--max-tokens", str(max_tokens)], input="Yes or no?\n",
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result


def test_the_chat_shows_a_spelled_tag_as_thinking(quoting):
    model_dir, _ = quoting
    result = piped_chat(model_dir, 20)
    assert result.stdout == "b\n"
    assert "\na</think>\n" in result.stderr


# ---- cupy-llama chat ---------------------------------------------------------------------

VIEWS = [  # (prompt opened <think>, reply as in SPLITS) -> (thinking, answer) as shown
    (False, ["<think>", "\nLet me see.\n", "</think>", "\n\nParis."],
     ("\nLet me see.\n", "Paris.")),
    (False, ["Paris, no thinking."], ("", "Paris, no thinking.")),
    (False, ["<thinker>"], ("", "<thinker>")),
    (False, ["<thi"], ("", "<thi")),
    (False, ["<think>", "cut off"], ("cut off", "")),
    (True, ["Hm.", "</think>", "\n\nParis."], ("Hm.", "Paris.")),
    (False, ["<think>x</think>y"], ("", "<think>x</think>y")),  # no marker token: no thinking
    (True, ["a</think>", "</think>", "b"], ("a</think>", "b")),
]


@pytest.mark.parametrize("opened, parts, expected", VIEWS)
def test_the_chat_shows_the_thinking_apart_at_any_cut(parsers, opened, parts, expected):
    from cupy_llama.cli.chat_ui import ThinkingView
    parser = parsers["deepseek_r1"]  # the chat's markers
    ids = reply_tokens(parser, parts)
    for cut in range(len(ids) + 1):
        view, text = ThinkingView(parser, opened), parser.decode(ids[:cut])
        pieces = (view.feed(text, ids[:cut]) + view.feed(parser.decode(ids)[len(text):], ids)
                  + view.finish())
        shown = tuple("".join(t for kind, t in pieces if kind == want)
                      for want in ("thinking", "answer"))
        assert shown == expected, cut


def test_piped_chat_writes_the_answer_alone(qwen3):
    model_dir, _ = qwen3
    result = piped_chat(model_dir, 10)
    assert result.stdout == "b\n"
    assert "\na\n" in result.stderr and "tok/s" in result.stderr


def test_the_terminal_chat_dims_the_thinking(qwen3, tmp_path):
    from test_chat import ask, finish, spawn
    model_dir, _ = qwen3
    child = spawn(model_dir, "--temperature", "0", "--max-tokens", "10", cache=tmp_path)
    assert ask(child, "Yes or no?") == "\x1b[2ma\x1b[0m\nb"  # the answer on a line of its own
    child.sendeof()
    finish(child, 0)


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("out_tty, err_tty, colour, err_text, out_text", [
    # both the terminal: the thinking dimmed, the answer on a line of its own
    (True, True, True, "\x1b[2ma\x1b[0m\n", "b"),
    (True, True, False, "a\n", "b"),
    # the answer piped: stdout holds it alone; the thinking's line stays open (run_once
    # ends it before the statistics)
    (False, True, True, "\x1b[2ma\x1b[0m", "b"),
    (False, False, True, "a", "b"),
])
def test_one_prompt_in_a_terminal_shows_the_thinking_apart(monkeypatch, out_tty, err_tty,
                                                            colour, err_text, out_text):
    from cupy_llama.cli.chat_ui import _PieceWriter
    monkeypatch.setenv("TERM", "xterm-256color")
    if colour:
        monkeypatch.delenv("NO_COLOR", raising=False)
    else:
        monkeypatch.setenv("NO_COLOR", "1")
    out, err = _Stream(out_tty), _Stream(err_tty)
    write = _PieceWriter(out, err, lambda text: text)
    write([("thinking", "a")])
    write([("answer", "b")])
    assert (err.getvalue(), out.getvalue()) == (err_text, out_text)
    assert write.thought == ("" if out_tty and err_tty else "a")
    monkeypatch.setenv("TERM", "dumb")  # a terminal that shows no styles gets none
    monkeypatch.delenv("NO_COLOR", raising=False)
    err = _Stream(err_tty)
    _PieceWriter(_Stream(out_tty), err, lambda text: text)([("thinking", "a")])
    assert err.getvalue() == "a"


def test_piped_chat_splits_where_the_markers_are_special_tokens(tmp_path):
    """Where <think> and </think> are special tokens (skipped in a reply's text by
    default), the chat keeps them in the text it splits, as serve does: the answer is
    still stdout's, the thinking stderr's."""
    model_dir = make_random_model(tmp_path / "model", "tiny", seed=0,
                                  architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False)
    path = model_dir / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    for token in tokenizer["added_tokens"]:
        if token["content"] in ("<think>", "</think>"):
            token["special"] = True
    path.write_text(json.dumps(tokenizer))
    script_chain(model_dir, ["\n", "<think>", "a", "</think>", "b", "<|im_end|>"])
    result = piped_chat(model_dir, 20)
    assert result.stdout == "b\n"
    assert "\na\n" in result.stderr


# ---- a template whose role markers are no special tokens ----------------------------------

# DeepSeek-R1-Distill's turns: <｜User｜> and <｜Assistant｜> are added tokens but not special
# ones, so the prompt's last special token may come before the last user message; the
# generation prompt opens the thinking ("<｜Assistant｜><think>\n"). R1_BARE's does not: the
# model writes <think> itself.
R1_TURNS = ("{{ bos_token }}{%- for m in messages %}"
            "{%- if m.role == 'system' %}{{ m.content }}"
            "{%- elif m.role == 'user' %}{{ '<｜User｜>' + m.content }}"
            "{%- elif m.role == 'assistant' %}{{ '<｜Assistant｜>' + m.content + eos_token }}"
            "{%- endif %}{%- endfor %}")
R1_TEMPLATE = (R1_TURNS + "{%- if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}"
               "{%- endif %}")
R1_BARE = R1_TURNS + "{%- if add_generation_prompt %}{{ '<｜Assistant｜>' }}{%- endif %}"
QUOTING_USER = [{"role": "user", "content": "Why does </think> end it?"}]


@pytest.fixture(scope="module")
def r1(tmp_path_factory):
    """(model dir, LLM on the CPU) of a tiny Qwen3 with R1_TEMPLATE and R1's role tokens,
    scripted to go from <｜Assistant｜> to <think>, "\\n", "a", </think>, "b" and the end of
    its turn: after R1_BARE's generation prompt it writes "<think>\\na</think>b", after
    R1_TEMPLATE's (which ends in "<think>\\n") "a</think>b"."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend
    model_dir = make_random_model(tmp_path_factory.mktemp("r1") / "model", "tiny", seed=0,
                                  architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False)
    path = model_dir / "tokenizer.json"
    backend = Backend.from_file(str(path))
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t in ("<｜User｜>", "<｜Assistant｜>")])
    backend.save(str(path))
    (model_dir / "chat_template.jinja").write_text(R1_TEMPLATE)
    script_chain(model_dir, ["<｜Assistant｜>", "<think>", "\n", "a", "</think>", "b",
                             "<|im_end|>"])
    llm = LLM(model_dir, device="cpu", log=None)
    yield model_dir, llm
    llm.close()


def test_a_quoted_marker_does_not_say_where_the_reply_starts(r1):
    """The last turn ends where the template's generation prompt begins, at its role
    marker, special token or not: a user's message quoting a marker is an earlier turn's."""
    _, llm = r1
    tokenizer = llm.tokenizer
    parser = ReasoningParser.for_tokenizer("deepseek_r1", tokenizer)
    opened = tokenizer.encode_chat(QUOTING_USER)
    assert parser.end_token in opened  # the quote is the </think> token in the prompt
    assert parser.last_marker(opened) == parser.start_token  # the template's <think>
    bare = tokenizer.encode_chat(QUOTING_USER, chat_template=R1_BARE)
    assert parser.end_token in bare and tokenizer.decode(bare[-1:], False) == "<｜Assistant｜>"
    assert parser.last_marker(bare) is None and parser.thinks(bare, None)
    asking = tokenizer.encode_chat([{"role": "user", "content": "Is <think> a tag?"}],
                                   chat_template=R1_BARE)
    assert parser.start_token in asking and parser.last_marker(asking) is None

    def continued(content):  # the reply goes on from an assistant message's start
        return tokenizer.encode_chat(QUOTING_USER + [{"role": "assistant", "content": content}],
                                     add_generation_prompt=False, continue_final_message=True)

    assert parser.last_marker(continued("Sure")) is None
    assert parser.last_marker(continued("<think>\nLet me")) == parser.start_token
    assert not parser.thinks(continued("<think>\nhm</think>\n\nIt"), None)


def test_the_server_splits_a_reply_after_a_quoted_marker(r1):
    """Over HTTP: the quoted </think> leaves the reply's thinking to the reply."""
    pytest.importorskip("fastapi")
    from inprocess_server import make_state
    model_dir, llm = r1
    state = make_state(model_dir, llm, reasoning_parser="deepseek_r1",
                       trust_request_chat_template=True)
    for template, reasoning in ((None, "a"), (R1_BARE, "\na")):
        fields = {} if template is None else {"chat_template": template}
        message = chat(state, messages=QUOTING_USER, **fields).json()["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == (reasoning, "b"), template


# ---- tool calls in LLM.chat, the chat and generate's plain lines ------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def written(llm, *parts, max_tokens=200) -> SamplingParams:
    """Greedy params whose grammar writes exactly the parts, "<think>" and "</think>" as
    their tokens and any other part in ordinary ones (a whole reply, whatever the model)."""
    tokenizer = llm.tokenizer
    lark = "start: " + " ".join(f"<[{tokenizer.token_to_id(p)}]>" if p in MARKERS
                                else json.dumps(p) for p in parts)
    return SamplingParams(structured=StructuredSpec.grammar(lark), temperature=0,
                          max_tokens=max_tokens)


# (reply, the name of its one call or None); "<think>" and "</think>" alone are the tokens
THOUGHT_CALLS = [
    (("<think>", "I could call " + CALL, "</think>", "No call."), None),
    (("<think>", "hm", "</think>", CALL), "get_weather"),
    ((CALL,), "get_weather"),  # no thinking
]


def chat_outputs(llm, messages, params, **tools):
    """LLM.chat's whole reply, and the streamed one: (its last output, its deltas joined,
    its calls' names from tool_call_deltas)."""
    whole = llm.chat(messages, params, **tools)
    outputs = list(llm.chat(messages, params, stream=True, **tools))
    names = [d.name for o in outputs for d in o.tool_call_deltas or [] if d.name]
    return whole, (outputs[-1], "".join(o.delta for o in outputs), names)


def assert_calls_read_from_the_answer(llm, parts, name):
    from conftest import TOOLS
    text = "".join(parts)
    content = text.replace(CALL, "") if name else text
    whole, (last, deltas, names) = chat_outputs(llm, CHAT, written(llm, *parts), tools=TOOLS,
                                                tool_call_parser="hermes")
    for output in (whole, last):
        assert output.text == text
        assert [c.name for c in output.tool_calls or []] == ([name] if name else [])
        assert (output.content or "") == content
        assert output.finish_reason == ("tool_calls" if name else "stop")
    assert deltas == content and names == ([name] if name else [])


@pytest.mark.parametrize("parts, name", THOUGHT_CALLS)
def test_llm_chat_reads_tool_calls_from_the_answer_only(qwen3, parts, name):
    """A call written in the thinking is thinking, as serve's reasoning split has it: only
    the answer after the </think> token is parsed. The content is the rest of the reply's
    text, the thinking included as written."""
    pytest.importorskip("llguidance")
    assert_calls_read_from_the_answer(qwen3[1], parts, name)


def test_a_call_after_a_spelled_tag_is_thinking(qwen3):
    """The tag in ordinary tokens does not end the thinking: only the </think> token does
    (a reply whose tokens are written out, since a grammar's text would take the token)."""
    from cupy_llama.outputs import RequestOutput
    _, llm = qwen3
    parser = ReasoningParser.for_tokenizer("qwen3", llm.tokenizer)
    for parts, name in ((("<think>", "a</think>" + CALL), None),
                        (("<think>", "a</think>", "</think>", CALL), "get_weather")):
        ids = reply_tokens(parser, parts)
        output = RequestOutput("0", llm.tokenizer.encode_chat(CHAT), ids, "".join(parts),
                               finish_reason="stop")
        llm.parse_tool_calls(output, "hermes")
        assert [c.name for c in output.tool_calls or []] == ([name] if name else [])
        assert output.content == ("".join(parts).replace(CALL, "") if name else output.text)


def test_calls_follow_special_markers(tmp_path):
    """Where <think> and </think> are special tokens, a reply offered tools keeps them in
    its text, as serve's does, or its thinking would never end and no call be read."""
    pytest.importorskip("llguidance")
    model_dir = make_random_model(tmp_path / "model", "tiny", seed=0,
                                  architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False)
    path = model_dir / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    for token in tokenizer["added_tokens"]:
        if token["content"] in MARKERS:
            token["special"] = True
    path.write_text(json.dumps(tokenizer))
    with LLM(model_dir, device="cpu", log=None) as llm:
        assert_calls_read_from_the_answer(llm, THOUGHT_CALLS[1][0], "get_weather")


def test_the_chat_shows_no_call_a_thinking_writes(qwen3):
    """`chat --tools`: a call in the reply's thinking is neither shown nor kept as a call."""
    pytest.importorskip("llguidance")
    from conftest import TOOLS
    from cupy_llama.cli.chat_ui import ChatSession, ChatTools
    _, llm = qwen3
    parts = THOUGHT_CALLS[0][0]
    session = ChatSession(llm, written(llm, *parts), tools=ChatTools(TOOLS, parser="hermes"))
    assert "".join(session.reply("Weather in Paris?")) == "".join(parts)
    assert session.history[-1] == {"role": "assistant", "content": "".join(parts)}
    assert not session.waiting_calls() and session.turns[-1].finish_reason == "stop"


def test_plain_lines_read_tool_calls_from_the_answer_only(qwen3, tmp_path):
    """`generate`'s plain lines with tools parse as LLM.chat does."""
    pytest.importorskip("llguidance")
    from cupy_llama.cli import main
    from conftest import TOOLS, read_jsonl
    model_dir, llm = qwen3
    lines = []
    for k, (parts, _) in enumerate(THOUGHT_CALLS):
        lark = written(llm, *parts).structured.text
        lines.append({"id": str(k), "messages": CHAT, "tools": TOOLS, "temperature": 0,
                      "max_tokens": 200, "tool_call_parser": "hermes",
                      "structured": {"grammar": lark}})
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["generate", "--model", str(model_dir), "--device", "cpu", "--input",
                 str(path), "--output", str(out)]) == 0
    rows = {row["id"]: row for row in read_jsonl(out)}
    for k, (parts, name) in enumerate(THOUGHT_CALLS):
        text, row = "".join(parts), rows[str(k)]
        assert row["text"] == text
        assert (row["content"] or "") == (text.replace(CALL, "") if name else text)
        assert [c["function"]["name"] for c in row.get("tool_calls") or []] == \
            ([name] if name else [])


def test_an_enforced_call_follows_the_thinking_a_template_opens(r1, tmp_path):
    """R1_TEMPLATE opens the thinking in the prompt: tool_choice's grammar starts after
    </think>, as serve's does, so the model thinks first (as scripted) and then calls;
    from the first token, the grammar would leave it no thinking. In LLM.chat and in
    generate's plain lines."""
    pytest.importorskip("llguidance")
    from cupy_llama.cli import main
    from conftest import TOOLS, read_jsonl
    model_dir, llm = r1
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole, (last, deltas, names) = chat_outputs(
        llm, QUOTING_USER, SamplingParams(temperature=0, max_tokens=400), tools=TOOLS,
        tool_choice=named, tool_call_parser="hermes", parallel_tool_calls=False)
    for output in (whole, last):
        assert output.text.startswith("a</think><tool_call>"), output.text
        assert [c.name for c in output.tool_calls] == ["get_weather"]
        assert output.content == "a</think>" and output.finish_reason == "tool_calls"
    assert deltas == "a</think>" and names == ["get_weather"]
    line = {"messages": QUOTING_USER, "tools": TOOLS, "tool_choice": named, "temperature": 0,
            "max_tokens": 400, "tool_call_parser": "hermes", "parallel_tool_calls": False}
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text(json.dumps(line) + "\n")
    assert main(["generate", "--model", str(model_dir), "--device", "cpu", "--input",
                 str(path), "--output", str(out)]) == 0
    [row] = read_jsonl(out)
    assert row["text"] == whole.text and row["content"] == "a</think>"
    assert [c["function"]["name"] for c in row["tool_calls"]] == ["get_weather"]


# ChatML with no thinking of its own: enable_thinking changes nothing it writes
PLAIN_CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_llm_reasoning_parser_constrains_after_the_thinking(qwen3):
    """LLM(reasoning_parser="qwen3") takes a Qwen3 reply to think as serve's parser does,
    though its prompt opens no thinking: tool_choice's grammar and params.structured start
    after </think>, so the model thinks as scripted and then keeps to them; where
    enable_thinking is false (the template writes an empty thinking) they hold from the
    first token. Without the option the reply is constrained from its first token."""
    pytest.importorskip("llguidance")
    from conftest import TOOLS
    model_dir, plain = qwen3
    named = {"type": "function", "function": {"name": "get_weather"}}
    tools = dict(tools=TOOLS, tool_choice=named, tool_call_parser="hermes",
                 parallel_tool_calls=False)
    greedy = SamplingParams(temperature=0, max_tokens=400)
    unguarded = plain.chat(CHAT, greedy, **tools)
    assert unguarded.text.startswith("<tool_call>"), unguarded.text
    with LLM(model_dir, device="cpu", log=None, reasoning_parser="qwen3") as llm:
        whole, (last, deltas, names) = chat_outputs(llm, CHAT, greedy, **tools)
        for output in (whole, last):
            assert output.text.startswith("<think>a</think><tool_call>"), output.text
            assert [c.name for c in output.tool_calls] == ["get_weather"]
            assert output.content == "<think>a</think>"
            assert output.finish_reason == "tool_calls"
        assert deltas == "<think>a</think>" and names == ["get_weather"]
        answer = llm.chat(CHAT, SamplingParams(structured=YES_NO, temperature=0, max_tokens=10))
        assert answer.text in ("<think>a</think>yes", "<think>a</think>no"), answer.text
        off = {"enable_thinking": False}
        closed = llm.chat(CHAT, greedy, chat_template_kwargs=off, **tools)
        assert closed.text.startswith("<tool_call>") and closed.content is None, closed.text
        assert [c.name for c in closed.tool_calls] == ["get_weather"]
        # a template that writes no empty thinking for enable_thinking false: only the
        # keyword says the reply does not think, whole and streamed
        whole, (last, deltas, names) = chat_outputs(
            llm, CHAT, greedy, chat_template=PLAIN_CHATML, chat_template_kwargs=off, **tools)
        for output in (whole, last):
            assert output.text.startswith("<tool_call>"), output.text
            assert [c.name for c in output.tool_calls] == ["get_weather"]
            assert output.content is None and output.finish_reason == "tool_calls"
        assert deltas == "" and names == ["get_weather"]
        thinking = llm.chat(CHAT, greedy, chat_template=PLAIN_CHATML, **tools)
        assert thinking.text.startswith("<think>a</think><tool_call>"), thinking.text


def test_llm_reasoning_parser_is_checked(qwen3, tmp_path):
    from cupy_llama.errors import ConfigError
    model_dir, _ = qwen3
    with pytest.raises(ConfigError, match="reasoning_parser: unknown parser 'nope'; use one "
                                          "of qwen3, deepseek_r1"):
        LLM(model_dir, device="cpu", log=None, reasoning_parser="nope")
    with pytest.raises(ConfigError, match="reasoning_parser must be a parser's name such as "
                                          "'qwen3', got list"):
        LLM(model_dir, device="cpu", log=None, reasoning_parser=["qwen3"])
    llama_dir = make_random_model(tmp_path / "llama", "tiny")
    with pytest.raises(ConfigError, match="reasoning_parser qwen3: this model's vocabulary "
                                          "has no </think> token.*leave reasoning_parser out"):
        LLM(llama_dir, device="cpu", log=None, reasoning_parser="qwen3")
