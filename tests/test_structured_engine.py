"""Structured outputs through the engine on the NumPy backend: every constrained answer of
a tiny random model (whose free output is noise) follows its constraint, a complete
grammar ends with "stop", a constraint that does not compile is refused before anything
is queued, and constrained rows leave the rest of the batch, preemption, prefix caching,
n > 1 and the raw log-probabilities as they were (docs/ARCHITECTURE.md, "Structured
outputs and tools")."""
import json
import re

import numpy as np
import pytest

from cupy_llama import LLM, SamplingParams
from cupy_llama.errors import RequestError
from cupy_llama.structured import StructuredSpec

from conftest import ScriptedChannel, assert_all_blocks_free, read_jsonl

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a person:", "Who is it?", "Name and age, please"]


def generate(llm, prompts, **params):
    params.setdefault("max_tokens", 300)
    return llm.generate(prompts, SamplingParams(**params))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answers_validate(llm, temperature):
    outputs = generate(llm, PROMPTS, temperature=temperature, seed=3, n=2,
                       structured={"json": PERSON})
    assert len(outputs) == 2 * len(PROMPTS)
    for output in outputs:
        assert output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(output.text), PERSON)
    assert_all_blocks_free(llm)


def test_regex_choice_json_object_and_grammar(llm):
    pattern = r"[a-c]{2,4}-[0-9]{2}"
    for output in generate(llm, PROMPTS, temperature=1.0, seed=1,
                           structured=StructuredSpec.regex(pattern)):
        assert re.fullmatch(pattern, output.text), output.text
        assert output.finish_reason == "stop"
    choices = ["yes", "no", "maybe later"]
    texts = {o.text for o in generate(llm, PROMPTS * 4, temperature=1.5, seed=2,
                                      structured={"choice": choices})}
    assert texts <= set(choices) and len(texts) > 1, texts
    for output in generate(llm, PROMPTS, temperature=1.0, seed=4,
                           structured={"json_object": True}):
        assert isinstance(json.loads(output.text), dict), output.text
    grammar = 'start: item ("," item)*\nitem: /[0-9]{1,3}/ | "x"\n'
    for output in generate(llm, PROMPTS, temperature=1.0, seed=5, max_tokens=40,
                           structured=StructuredSpec.grammar(grammar)):
        # the grammar's language, as a regular expression
        if output.finish_reason == "stop":
            assert re.fullmatch(r"([0-9]{1,3}|x)(,([0-9]{1,3}|x))*", output.text), output.text
        else:  # cut by max_tokens: a prefix of the language
            assert re.fullmatch(r"([0-9]{1,3}|x)(,([0-9]{1,3}|x))*,?", output.text), output.text
    assert_all_blocks_free(llm)


def test_a_complete_grammar_stops_without_eos(llm):
    """A choice ends as soon as it is written: "stop", no EOS token in the output."""
    output = generate(llm, "x", temperature=0.0, structured={"choice": ["abc"]}, max_tokens=50)
    assert (output.text, output.finish_reason) == ("abc", "stop")
    assert not set(output.token_ids) & llm.engine.eos_token_ids


def test_a_constraint_the_requests_bans_leave_nothing_of_ends_before_the_bad_token(llm):
    """bad_words that ban every token the grammar allows next: the sample ends ("abort")
    with the text written so far, streamed or not, and nothing the grammar rejects."""
    params = dict(temperature=0.0, structured={"choice": ["yes", "no"]},
                  bad_words=["yes", "no"], max_tokens=20)
    output = generate(llm, "x", **params)
    assert output.finish_reason == "abort"
    assert output.text in ("ye", "n") and output.token_ids == llm.tokenizer.encode(
        output.text, add_special_tokens=False)
    streamed = list(llm.stream(["x"], SamplingParams(**params)))  # cumulative outputs
    assert len(streamed) > 1 and streamed[-1].text == output.text
    assert streamed[-1].finish_reason == "abort"
    assert_all_blocks_free(llm)


def test_a_constraint_that_does_not_compile_is_refused_before_queueing(llm):
    bad = [SamplingParams(max_tokens=4),
           SamplingParams(max_tokens=4, structured={"grammar": "start: nothing_here"})]
    with pytest.raises(RequestError, match="structured.grammar: the grammar does not "
                                           "compile: .*unknown name"):
        llm.generate(["a", "b"], bad)
    with pytest.raises(RequestError, match="regular expression does not compile"):
        llm.stream(["a"], SamplingParams(structured={"regex": "a(b"}))
    assert_all_blocks_free(llm)
    assert llm.engine.stats().num_steps >= 0 and not llm.engine.requests
    with pytest.raises(RequestError, match="structured must be"):
        SamplingParams(structured=["not", "a", "spec"])


def test_constrained_rows_leave_the_others_alone(llm):
    """Greedy unconstrained prompts give the same tokens beside constrained ones as alone."""
    plain = SamplingParams(max_tokens=12, temperature=0.0)
    alone = [o.token_ids for o in llm.generate(PROMPTS, plain)]
    mixed = llm.generate(PROMPTS + PROMPTS, [plain] * 3 + [SamplingParams(
        max_tokens=300, temperature=1.0, seed=7, structured={"json": PERSON})] * 3)
    assert [o.token_ids for o in mixed[:3]] == alone
    for output in mixed[3:]:
        jsonschema.validate(json.loads(output.text), PERSON)


def test_logprobs_are_the_raw_models(llm):
    """The first token's alternatives are the same with and without a constraint (the raw
    distribution), while the chosen token follows the constraint."""
    free = generate(llm, "Answer:", temperature=0.0, max_tokens=1, logprobs=5)
    bound = generate(llm, "Answer:", temperature=0.0, max_tokens=5, logprobs=5,
                     structured={"choice": ["zz", "qq"]})
    assert bound.text in ("zz", "qq")
    assert bound.logprobs[0].top == free.logprobs[0].top
    assert bound.logprobs[0].logprob <= free.logprobs[0].top[0][1]
    if bound.token_ids[0] != free.token_ids[0]:
        assert bound.logprobs[0].logprob < free.logprobs[0].logprob


def test_preemption_and_prefix_caching_change_nothing(model_dir, llm):
    params = SamplingParams(max_tokens=200, temperature=0.0, structured={"json": PERSON})
    prompts = [f"{p} {i}" * 6 for i, p in enumerate(PROMPTS * 4)]
    ample = [o.token_ids for o in llm.generate(prompts, params)]
    small = LLM(model_dir, device="cpu", log=None, num_kv_blocks=24, block_size=16,
                max_num_seqs=64)
    tight = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0, "no preemption: the pool was too big"
    assert [o.token_ids for o in tight] == ample
    again = llm.generate(prompts, params)  # their prompts' blocks are cached now
    assert sum(o.num_cached_tokens for o in again) > 0
    assert [o.token_ids for o in again] == ample
    assert_all_blocks_free(small)
    small.close()


def test_masked_sampling_on_the_numpy_backend():
    """NumpyOps: deferred rows wait for sample_masked, which draws them under their masks
    (greedy: the masked argmax) and leaves the raw log-probabilities."""
    from cupy_llama.backends.numpy_ops import NumpyOps
    from cupy_llama.interface import SamplingTensors
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 70)).astype(np.float32)
    ops = NumpyOps()
    tensors = SamplingTensors(
        temperature=np.zeros(4, np.float32), top_k=np.zeros(4, np.int32),
        top_p=np.ones(4, np.float32), min_p=np.zeros(4, np.float32),
        seeds=np.zeros(4, np.uint64), steps=np.zeros(4, np.int32),
        num_logprobs=np.full(4, 2, np.int32), deferred=np.array([False, True, False, True]))
    allowed = [5, 61]
    bitmask = np.zeros((2, 3), np.uint32)
    for token in allowed:
        bitmask[:, token // 32] |= np.uint32(1 << (token % 32))
    pending = ops.sample_async(logits, tensors)
    ops.sample_masked(pending, [3], bitmask)
    tokens = pending.get()
    assert tokens[0] == np.argmax(logits[0]) and tokens[2] == np.argmax(logits[2])
    assert tokens[3] == allowed[int(np.argmax(logits[3, allowed]))]
    top = pending.logprobs().of_row(3, 2)[2]
    assert [t for t, _ in top] == list(np.argsort(-logits[3])[:2])


def test_a_plain_batch_file_takes_constraints(model_dir, tmp_path):
    """`generate` with plain lines: structured (vLLM's object) and the server's names."""
    from cupy_llama.cli import main
    lines = [{"id": "a", "prompt": "x", "max_tokens": 300, "structured": {"json": PERSON}},
             {"id": "b", "prompt": "y", "max_tokens": 50, "guided_choice": ["up", "down"]},
             {"id": "c", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300,
              "response_format": {"type": "json_schema",  # bounded: a random model ends it
                                  "json_schema": {"name": "person", "schema": PERSON}}},
             {"id": "d", "prompt": "z", "structured_outputs": {"grammar": "start: nowhere"}},
             {"id": "e", "prompt": "w", "max_tokens": 50, "grammar": 'root ::= "x" [0-9]{2}'},
             {"id": "f", "prompt": "v", "max_tokens": 300, "json_schema": PERSON}]
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code = main(["generate", "--model", str(model_dir), "--device", "cpu", "--input",
                 str(path), "--output", str(out)])
    rows = {row["id"]: row for row in read_jsonl(out)}
    assert code == 1  # line d failed
    jsonschema.validate(json.loads(rows["a"]["text"]), PERSON)
    assert rows["b"]["text"] in ("up", "down")
    jsonschema.validate(json.loads(rows["c"]["text"]), PERSON)
    assert re.fullmatch("x[0-9]{2}", rows["e"]["text"]), rows["e"]
    jsonschema.validate(json.loads(rows["f"]["text"]), PERSON)
    assert "structured_outputs.grammar: the grammar does not compile" in rows["d"]["error"]


def test_a_constrained_prompt_in_chunks_beside_logprobs(model_dir, llm):
    """Steps where a constrained sequence computes only part of its prompt (deferred, with
    no token to draw) still finish their draw: the other rows' tokens and logprobs come."""
    chunked = LLM(model_dir, device="cpu", log=None, max_num_batched_tokens=32)
    long_prompt = "a long prompt " * 12
    plain = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
    bound = SamplingParams(temperature=0.0, max_tokens=300, structured={"json": PERSON})
    outputs = chunked.generate(["Hi", long_prompt], [plain, bound])
    assert outputs[0].token_ids == llm.generate("Hi", plain).token_ids
    assert len(outputs[0].logprobs) == 12
    jsonschema.validate(json.loads(outputs[1].text), PERSON)
    assert outputs[1].text == llm.generate(long_prompt, bound).text
    chunked.close()


def test_a_request_aborted_while_its_grammar_compiles_ends_there(llm):
    """serve's engine loop compiles a grammar on a worker thread before it takes the request
    in. Aborted meanwhile (its client gone), the request still ends: a final "abort" delta
    for each sample, its sequences counted as taken, so the server drops its stream and
    its waiting count (a request left behind made the server refuse work and then stop its
    own engine as stalled)."""
    from concurrent.futures import Future

    from cupy_llama.engine.async_engine import _EngineLoop
    from cupy_llama.engine.output_processor import EngineDelta

    engine = llm.engine
    never = Future()  # a grammar still compiling
    params = SamplingParams(max_tokens=5, n=2, structured={"regex": "[a-z]+"})
    plain = SamplingParams(max_tokens=2, temperature=0)
    channel = ScriptedChannel([
        [("add", "slow", [5, 6, 7], params, True, False)],
        [("add", "plain", [5, 6], plain, False, False), ("abort", "slow")],
    ])
    loop = _EngineLoop(engine, channel)
    original = engine.compile_structured_async
    engine.compile_structured_async = lambda spec: never
    try:
        loop.run()
    finally:
        engine.compile_structured_async = original
        engine.outputs = None
    deltas = [EngineDelta.of(d) for message in channel.sent for d in message[1]]
    ended = {(d.request_id, d.index): d.finish_reason for d in deltas if d.finished}
    assert ended[("slow", 0)] == ended[("slow", 1)] == "abort"
    assert ended[("plain", 0)] == "length"
    assert channel.sent[-1][3]["num_added_seqs"] == 3
    assert not engine.has_unfinished_requests()
