"""allowed_token_ids (vLLM's extension): only the listed ids are ever sampled, drawn under a
fixed mask through the structured-outputs path (no llguidance needed), on the NumPy backend
against a reference that recomputes every position and takes the masked argmax."""
import numpy as np
import pytest
from conftest import assert_all_blocks_free, logits_at_every_position
from test_cuda_ops import _gpu_available

from cupy_llama import SamplingParams
from cupy_llama.errors import RequestError
from cupy_llama.structured import AllowedTokensMatcher, allowed_token_ids, bitmask_words

PROMPT = list(range(10, 30))
ALLOWED = [5, 17, 64, 98, 200, 250]  # ids with text (the tokenizer has 261)


def reference_masked_greedy(model_dir, prompt, allowed, max_tokens):
    out = []
    for _ in range(max_tokens):
        logits = logits_at_every_position(model_dir, prompt + out)[-1]
        masked = np.full_like(logits, -np.inf)
        masked[allowed] = logits[allowed]
        out.append(int(np.argmax(masked)))
    return out


def test_the_matcher_fills_exactly_the_allowed_bits():
    words = bitmask_words(1000)
    bitmask = np.zeros((3, words + 2), np.uint32)
    bitmask[1, words:] = 7  # words past the vocabulary's are left alone
    matcher = AllowedTokensMatcher([999, 0, 31, 32, 31], words)
    matcher.fill_bitmask(bitmask, 1)
    assert allowed_token_ids(bitmask[1, :words], 1000).tolist() == [0, 31, 32, 999]
    assert (bitmask[1, words:] == 7).all() and not bitmask[0].any() and not bitmask[2].any()
    assert matcher.advance(32) and not matcher.advance(33)
    assert not matcher.is_complete and matcher.error is None and matcher.fork() is matcher


def test_greedy_emits_only_allowed_ids_as_the_masked_argmax(model_dir, llm):
    expected = reference_masked_greedy(model_dir, PROMPT, ALLOWED, 12)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                              allowed_token_ids=ALLOWED)).token_ids
    assert out == expected and set(out) <= set(ALLOWED)
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12,
                                                ignore_eos=True)).token_ids
    assert not set(plain) <= set(ALLOWED), "greedy picks allowed ids anyway: proves nothing"
    assert_all_blocks_free(llm)


def test_sampled_batches_keep_each_request_to_its_own_ids(llm):
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = llm.generate(PROMPT, plain).token_ids
    outs = llm.generate([PROMPT, PROMPT[:7], PROMPT], [
        SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=10, ignore_eos=True,
                       allowed_token_ids=ALLOWED),
        SamplingParams(temperature=1.0, seed=4, max_tokens=10, ignore_eos=True,
                       allowed_token_ids=(7, 8)),
        plain])
    for out in outs[:3]:
        assert set(out.token_ids) <= set(ALLOWED) and len(out.token_ids) == 10
    assert set(outs[3].token_ids) <= {7, 8} and len(outs[3].token_ids) == 10
    assert outs[4].token_ids == alone  # an unconstrained neighbour is untouched
    assert_all_blocks_free(llm)


def test_eos_ends_the_output_only_where_it_is_allowed(llm):
    eos = min(llm.engine.eos_token_ids)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8,
                                              allowed_token_ids=[eos]))
    assert out.finish_reason == "stop" and out.token_ids == [eos] and out.text == ""
    out = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=1, max_tokens=8,
                                              allowed_token_ids=[5, 6]))
    assert out.finish_reason == "length" and set(out.token_ids) <= {5, 6}
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("ids, message", [
    ([], "non-empty list"), ([1, -2], "non-empty list"), ([1, True], "non-empty list"),
    ("5", "non-empty list"), ([1.5], "non-empty list")])
def test_malformed_ids_are_refused(ids, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(allowed_token_ids=ids)


def test_ids_outside_the_vocabulary_are_refused(llm):
    vocab = llm.engine.config.vocab_size
    with pytest.raises(RequestError, match=rf"token id {vocab}, outside the vocabulary"):
        llm.generate(PROMPT, SamplingParams(allowed_token_ids=[3, vocab]))
    with pytest.raises(RequestError, match=f"the vocabulary has only {vocab}"):
        llm.generate(PROMPT, SamplingParams(allowed_token_ids=[1] * (vocab + 1)))
    assert_all_blocks_free(llm)


def test_with_a_structured_constraint_it_is_refused():
    from cupy_llama.structured import StructuredSpec
    with pytest.raises(RequestError, match="allowed_token_ids and structured"):
        SamplingParams(allowed_token_ids=[1], structured=StructuredSpec.regex("a+"))


def test_batch_files_take_allowed_token_ids_on_both_kinds_of_line(model_dir, llm):
    """A plain line passes it as a sampling field; an OpenAI batch line's body as the
    server takes it: each output is the masked argmax; a bad list is that line's error."""
    import io
    import json

    from cupy_llama.cli.batch_io import read_requests, run_batch
    pytest.importorskip("pydantic")
    expected = reference_masked_greedy(model_dir, PROMPT, ALLOWED, 6)
    text = llm.tokenizer.decode(expected)
    common = {"temperature": 0, "max_tokens": 6, "ignore_eos": True,
              "allowed_token_ids": ALLOWED}
    plain = [{"id": "a", "prompt": PROMPT, **common},
             {"id": "b", "prompt": PROMPT, **common, "allowed_token_ids": []}]
    batch = [{"custom_id": "c", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": PROMPT, **common}}]
    rows = []
    for lines in (plain, batch):
        requests = read_requests("".join(json.dumps(x) + "\n" for x in lines).encode(), "jsonl")
        out = io.StringIO()
        run_batch(llm, requests, out, {})
        rows += [json.loads(line) for line in out.getvalue().splitlines()]
    assert rows[0]["text"] == text and rows[0]["usage"]["completion_tokens"] == 6
    assert "allowed_token_ids must be a non-empty list" in rows[1]["error"]
    assert rows[2]["response"]["body"]["choices"][0]["text"] == text
    assert_all_blocks_free(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_allowed_token_ids_through_the_cuda_engine(model_dir, enforce_eager):
    """The CUDA engine (graphs on and off) draws allowed_token_ids rows with
    ops.sample_masked: greedy and sampled, n > 1, with logprobs, beside plain requests
    that come out as they do alone."""
    from cupy_llama import LLM
    with LLM(model_dir, device="cuda", log=None, enforce_eager=enforce_eager) as llm:
        plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        alone = llm.generate(PROMPT, plain).token_ids
        params = [SamplingParams(temperature=0.0 if i < 4 else 1.0, seed=i, max_tokens=24,
                                 ignore_eos=True, n=2 if i == 5 else 1,
                                 logprobs=2 if i % 3 == 0 else None,
                                 allowed_token_ids=ALLOWED[i % 3:])
                  for i in range(8)]
        outputs = llm.generate([PROMPT[i:] for i in range(8)] + [PROMPT], params + [plain])
        for output, allowed in zip(outputs, [ALLOWED[i % 3:] for i, p in enumerate(params)
                                             for _ in range(p.n)]):
            assert set(output.token_ids) <= set(allowed) and len(output.token_ids) == 24
        assert outputs[-1].token_ids == alone
