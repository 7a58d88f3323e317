"""A reasoning model's thinking apart from its answer (reasoning.py, serve
--reasoning-parser): the split, whole and streamed; where a reply starts; a structured
answer constrained after the thinking only (structured.ReasoningGate), on the engine and
over HTTP.

The model is a tiny random Qwen3 (its tokenizer holds <think> and </think> as plain
tokens, as Qwen3's does) with dimensions of the residual stream taken over to script its
reply, as test_family_chat.py does: the generation prompt's last token "\\n" makes <think>
the likeliest next token, then "a", then </think>, then "b", then <|im_end|>."""
import itertools
from dataclasses import replace

import pytest

from cupy_llama import LLM, SamplingParams
from cupy_llama.bench.random_model import make_random_model
from cupy_llama.errors import RequestError
from cupy_llama.reasoning import (FORMATS, ReasoningParser, ReasoningSplitter,
                                  split_reasoning)
from cupy_llama.structured import StructuredSpec
from cupy_llama.tokenizer import Tokenizer

from test_family_chat import script_chain

QWEN3, R1 = FORMATS["qwen3"], FORMATS["deepseek_r1"]
CHAT = [{"role": "user", "content": "Yes or no?"}]
YES_NO = StructuredSpec.choice(["yes", "no"])

# (format, starts thinking, reply) -> (reasoning, content)
SPLITS = [
    (QWEN3, True, "<think>\nLet me see.\n</think>\n\nParis.", ("\nLet me see.\n", "\n\nParis.")),
    (QWEN3, True, "Let me see.</think>Paris.", ("Let me see.", "Paris.")),
    (QWEN3, True, "<think>cut off by max_tok", ("cut off by max_tok", None)),
    (QWEN3, True, "<think>a <</think>", ("a <", None)),
    (QWEN3, True, "<think>ends at </thi", ("ends at </thi", None)),
    (QWEN3, True, "<think>hm<tool_call>{}</tool_call>", ("hm", "<tool_call>{}</tool_call>")),
    (QWEN3, True, "a</think>b</think>c", ("a", "b</think>c")),  # the answer as written
    (QWEN3, False, "<think>x</think>Paris.", (None, "<think>x</think>Paris.")),
    (R1, True, "Thinking.\n</think>\n\nParis.", ("Thinking.\n", "\n\nParis.")),
    (R1, True, "hm<tool_call>x", ("hm<tool_call>x", None)),  # no implicit end in R1's
]


@pytest.mark.parametrize("fmt, thinking, text, expected", SPLITS)
def test_a_reply_splits_alike_whole_and_streamed_at_any_cut(fmt, thinking, text, expected):
    assert split_reasoning(fmt, text, thinking) == expected
    want_reasoning, want_content = (part or "" for part in expected)
    for cuts in itertools.chain(itertools.combinations(range(1, len(text)), 1),
                                itertools.combinations(range(1, len(text)), 2)):
        splitter = ReasoningSplitter(fmt, thinking)
        bounds = (0, *cuts, len(text))
        pieces = [splitter.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])]
        pieces.append(splitter.finish())
        assert "".join(r for r, _ in pieces) == want_reasoning, cuts
        assert "".join(c for _, c in pieces) == want_content, cuts
        # nothing is sent as reasoning that turns out to be a marker
        assert all("<think>" not in r and "</think>" not in r for r, _ in pieces)


def test_where_a_reply_starts():
    assert QWEN3.thinks("<|im_start|>assistant\n", None)
    assert QWEN3.thinks("<|im_start|>assistant\n", {"enable_thinking": True})
    assert not QWEN3.thinks("<|im_start|>assistant\n", {"enable_thinking": False})
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3's enable_thinking false
    assert not QWEN3.thinks(closed, None) and not R1.thinks(closed, None)
    assert R1.thinks("<｜Assistant｜><think>\n", {"enable_thinking": False})  # R1 ignores it


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
    model_dir, llm = qwen3
    parser = ReasoningParser.for_tokenizer("qwen3", llm.tokenizer)
    assert parser.end_token == llm.tokenizer.token_to_id("</think>") and not parser.special
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(CHAT),
                                  add_special_tokens=False)
    assert parser.thinks(llm.tokenizer, prompt, None)
    closed = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        CHAT, template_kwargs={"enable_thinking": False}), add_special_tokens=False)
    assert not parser.thinks(llm.tokenizer, closed, None)
    with pytest.raises(RequestError, match="unknown parser 'nope'; use one of qwen3, deepseek_r1"):
        ReasoningParser.for_tokenizer("nope", llm.tokenizer)
    llama_dir = make_random_model(tmp_path / "llama", "tiny")
    with pytest.raises(RequestError, match="vocabulary has no </think> token"):
        ReasoningParser.for_tokenizer("qwen3", Tokenizer.from_dir(llama_dir))


def test_the_scripted_reply_thinks_then_answers(qwen3):
    _, llm = qwen3
    reply = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=10))
    assert reply.text == "<think>a</think>b" and reply.finish_reason == "stop"
    assert split_reasoning(QWEN3, reply.text, True) == ("a", "b")


def test_a_constraint_after_the_thinking_leaves_the_thinking_free(qwen3):
    """Constrained from the first token, the reply cannot think (<think> is not "yes" or
    "no"); starting after </think>, the thinking runs as scripted and the answer keeps to
    the constraint, whatever the script would have said ("b")."""
    _, llm = qwen3
    end = llm.tokenizer.token_to_id("</think>")
    greedy = dict(temperature=0, max_tokens=10)
    plain = llm.chat(CHAT, SamplingParams(structured=YES_NO, **greedy))
    assert plain.text in ("yes", "no")
    gated = SamplingParams(structured=replace(YES_NO, starts_after=end), **greedy)
    replies = llm.chat([CHAT, CHAT], gated)
    for reply in replies:
        reasoning, content = split_reasoning(QWEN3, reply.text, True)
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
