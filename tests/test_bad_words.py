"""bad_words of more than one token (vLLM's semantics): a word of tokens t1..tn bans tn where
the output ends with t1..t(n-1), prompt tokens not counting. The matcher against a
brute-force reference over random token streams; then the engine on the NumPy backend
against a loop that recomputes every position and bans by the definition (unpipelined),
through n > 1 samples, preemption, grammars and the server; words of one token stay off
the mask path."""
import numpy as np
import pytest
from conftest import assert_all_blocks_free, logits_at_every_position

from cupy_llama import LLM, SamplingParams
from cupy_llama.backends.numpy_ops import penalized_logits
from cupy_llama.errors import RequestError
from cupy_llama.sampling import MAX_BAD_WORD_SEQUENCES, MAX_BAD_WORD_TOKENS
from cupy_llama.structured import (AllowedTokensMatcher, BadWordsMatcher, CombinedMatcher,
                                   allowed_token_ids, bitmask_words)
from test_cuda_ops import _gpu_available

PROMPT = list(range(10, 30))
LETTERS = {t: 30.0 for t in range(ord("a"), ord("z") + 1)}  # text the tokenizer spells bytewise
GREEDY = dict(temperature=0, ignore_eos=True, logit_bias=LETTERS)


def banned_by_definition(sequences, output):
    """Each sequence's last token where the output ends with the rest of it."""
    return {s[-1] for s in sequences
            if len(s) - 1 <= len(output) and list(output[len(output) - len(s) + 1:]) == list(s[:-1])}


def contains(tokens, sequence) -> bool:
    n = len(sequence)
    return any(list(tokens[i:i + n]) == list(sequence) for i in range(len(tokens) - n + 1))


def disallowed(matcher, vocab):
    words = bitmask_words(vocab)
    bitmask = np.zeros((2, words + 1), np.uint32)
    bitmask[1, words] = 7  # a word past the row's is left alone
    matcher.fill_bitmask(bitmask, 1)
    assert bitmask[1, words] == 7 and not bitmask[0].any()
    return set(range(vocab)) - set(allowed_token_ids(bitmask[1, :words], vocab).tolist())


# ---- the matcher ----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_the_matcher_bans_what_the_definition_bans(seed):
    """Random sequences over a few tokens (so they match often) and random streams that
    sometimes take a banned token (refused), roll back, or fork: at every step the mask
    clears exactly the definition's bans, and a fork goes its own way."""
    rng = np.random.default_rng(seed)
    vocab, alphabet = 70, [3, 4, 5, 33, 64, 69]  # ids on both sides of word boundaries
    sequences = [tuple(rng.choice(alphabet, rng.integers(2, 5)).tolist()) for _ in range(8)]
    matcher = BadWordsMatcher(sequences, bitmask_words(vocab))
    output, forks = [], []
    for _ in range(300):
        expected = banned_by_definition(sequences, output)
        assert disallowed(matcher, vocab) == expected, output
        assert set(matcher.banned()) == expected
        if expected and rng.random() < 0.2:
            token = int(rng.choice(sorted(expected)))
            assert not matcher.advance(token) and str(token) in matcher.error
            matcher.error = None
            continue
        if output and rng.random() < 0.1:
            back = int(rng.integers(1, len(output) + 1))
            matcher.rollback(back)
            del output[len(output) - back:]
            continue
        if rng.random() < 0.05:
            forks.append((matcher.fork(), list(output)))
        token = int(rng.choice([t for t in alphabet if t not in expected]))
        assert matcher.advance(token)
        output.append(token)
        assert matcher.num_tokens == len(output)
    assert forks, "no fork was made: proves nothing"
    for fork, fork_output in forks:  # each kept its state while the original went on
        assert disallowed(fork, vocab) == banned_by_definition(sequences, fork_output)


def test_the_matcher_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="two tokens or more"):
        BadWordsMatcher([(1, 2), (3,)], 1)
    with pytest.raises(ValueError, match="cannot roll back 1 of 0"):
        BadWordsMatcher([(1, 2)], 1).rollback(1)


def test_combined_with_allowed_ids_the_masks_are_anded():
    words = bitmask_words(100)
    allowed = AllowedTokensMatcher([1, 2, 7, 99], words)
    combined = CombinedMatcher(allowed, BadWordsMatcher([(1, 2), (1, 7), (2, 2, 99)], words))
    assert disallowed(combined, 100) == set(range(100)) - {1, 2, 7, 99}
    assert combined.advance(1)
    assert disallowed(combined, 100) == set(range(100)) - {1, 99}
    assert not combined.advance(7) and "7" in combined.error  # the bad word's refusal
    fork = combined.fork()
    assert combined.advance(99) and combined.advance(2) and combined.advance(2)
    assert disallowed(combined, 100) == set(range(100)) - {1, 2, 7}  # "2 2 99" would end
    assert not combined.advance(5)  # outside allowed_token_ids
    assert disallowed(fork, 100) == set(range(100)) - {1, 99}  # the fork stayed after "1"
    combined.rollback(3)  # back to after "1 99"
    assert disallowed(combined, 100) == set(range(100)) - {1, 2, 7, 99}
    assert combined.eos_allowed and not combined.is_complete


def test_bans_that_leave_nothing_end_the_sample_saying_why(llm, caplog):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=5, allowed_token_ids=[97],
                                              bad_words=["aa"], logprobs=1, **GREEDY))
    # the token drawn from nothing is not kept: the output is what the constraint allows
    assert out.token_ids == [97] and out.text == "a" and out.finish_reason == "abort"
    assert [entry.token_id for entry in out.logprobs] == [97]
    assert "bad_words ban every token the constraint allows" in caplog.text
    assert_all_blocks_free(llm)


def test_combined_with_a_grammar_completion_is_the_grammars(llm):
    pytest.importorskip("llguidance")
    from cupy_llama.structured import StructuredSpec
    engine = llm.engine
    grammar = engine.compile_structured(StructuredSpec.choice(["ab", "ba"])).matcher()
    bad = BadWordsMatcher([tuple(engine.tokenizer.encode("ab", add_special_tokens=False))],
                          engine._bitmask_words())
    combined = CombinedMatcher(grammar, bad)
    vocab = 32 * engine._bitmask_words()  # what a row covers
    assert disallowed(combined, vocab) == set(range(vocab)) - {ord("a"), ord("b")}
    assert combined.advance(ord("a"))
    assert disallowed(combined, vocab) == set(range(vocab))  # "b" is the grammar's and banned
    combined.rollback(1)
    assert combined.advance(ord("b")) and not combined.is_complete
    assert combined.advance(ord("a")) and combined.is_complete and combined.eos_allowed


# ---- how words are spelled, and the limits ---------------------------------------------------

def test_words_are_spelled_as_vllm_spells_them(llm):
    engine = llm.engine
    # the tiny model's tokenizer spells bytes: "A" one token; " A" two, a spelling vLLM keeps
    # only with as many tokens as the word alone
    assert engine.bad_word_sequences(["A", "  ab", "ab"]) == [(65,), (97, 98)]
    banned, bad = engine.bad_word_bans(["A", "ab", "x"])
    assert banned == [65, 120] and bad.banned() == [] and bad.fork().advance(97)

    class Merging:  # a tokenizer where " ab" is one token of its own
        vocab_size = engine.tokenizer.vocab_size

        def encode(self, text, add_special_tokens=True):
            assert not add_special_tokens
            return {"ab": [97, 98], " ab": [300, 98],  # a word token of its own: kept
                    "cd": [99, 100], " cd": [32, 99, 100],  # longer: left out
                    "ef": [101, 102], " ef": [101, 103],  # the same first token: left out
                    "gh": [103, 600], " gh": [601, 104]}[text]  # outside the vocabulary

    real, engine.tokenizer = engine.tokenizer, Merging()
    try:
        assert engine.bad_word_sequences(["ab", "cd", "ef", "gh"]) == [
            (97, 98), (300, 98), (99, 100), (101, 102)]
    finally:
        engine.tokenizer = real


@pytest.mark.parametrize("words, message", [
    (list("abcdefghijk"), "ban 11 words of one token; at most 10"),  # (the limit lowered)
    ([f"{i:03d}" for i in range(MAX_BAD_WORD_SEQUENCES + 1)],
     f"spell {MAX_BAD_WORD_SEQUENCES + 1} sequences of more than one token; at most "
     f"{MAX_BAD_WORD_SEQUENCES}"),
    (["y" * 600, "z" * 600], f"spell 1200 tokens in all; at most {MAX_BAD_WORD_TOKENS}"),
])
def test_limits_are_refused_naming_bad_words(llm, monkeypatch, words, message):
    # the byte tokenizer has fewer one-token words than MAX_BANNED_TOKENS
    monkeypatch.setattr("cupy_llama.engine.llm_engine.MAX_BANNED_TOKENS", 10)
    with pytest.raises(RequestError, match=message) as error:
        llm.generate(PROMPT, SamplingParams(max_tokens=2, bad_words=words))
    assert str(error.value).startswith("bad_words")
    assert_all_blocks_free(llm)


def test_too_many_words_are_refused_before_tokenizing():
    with pytest.raises(RequestError, match="bad_words holds 257 words; at most 256"):
        SamplingParams(bad_words=["w"] * 257)


# ---- through the engine ------------------------------------------------------------------

def reference_greedy(model_dir, prompt, max_tokens, bias, sequences):
    """Greedy decoding that recomputes every position each step and bans by the definition
    over the output alone: no matcher, no pipelining."""
    ids = np.array(sorted(bias), int)
    values = [bias[t] for t in ids]
    out = []
    for _ in range(max_tokens):
        logits = logits_at_every_position(model_dir, prompt + out)[-1]
        zero = np.zeros(logits.shape[0], int)
        logits = penalized_logits(logits, zero > 0, zero, 1.0, 0.0, 0.0, ids, values)
        logits[sorted(banned_by_definition(sequences, out))] = -np.inf
        out.append(int(np.argmax(logits)))
    return out


def encode(llm, word):
    return tuple(llm.engine.tokenizer.encode(word, add_special_tokens=False))


def test_a_word_of_the_greedy_output_is_never_generated(model_dir, llm):
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=24, **GREEDY))
    word = plain.text[3:6]
    assert contains(plain.token_ids, encode(llm, word)), "the word is not in the output"
    out = llm.generate(PROMPT, SamplingParams(max_tokens=24, bad_words=[word], **GREEDY))
    assert not contains(out.token_ids, encode(llm, word))
    assert out.token_ids == reference_greedy(model_dir, PROMPT, 24, LETTERS, [encode(llm, word)])
    assert out.token_ids[:4] == plain.token_ids[:4]  # the ban acts where the word would end
    assert_all_blocks_free(llm)


def test_words_of_one_token_and_of_several_together(model_dir, llm):
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=16, **GREEDY)).text
    words = [plain[0], plain[4:6], plain[6:9]]
    out = llm.generate(PROMPT, SamplingParams(max_tokens=16, bad_words=words, **GREEDY))
    sequences = [encode(llm, w) for w in words]
    assert not any(contains(out.token_ids, s) for s in sequences)
    assert out.token_ids == reference_greedy(model_dir, PROMPT, 16, LETTERS, sequences)


def test_prompt_tokens_do_not_count(llm):
    """A word that would end at the first output token, started by the prompt's last one,
    bans nothing: only output tokens count."""
    prompt = "the prompt ends in q"
    first = llm.generate(prompt, SamplingParams(max_tokens=1, **GREEDY)).text
    out = llm.generate(prompt, SamplingParams(max_tokens=3, bad_words=["q" + first], **GREEDY))
    assert out.text[0] == first
    out = llm.generate(prompt, SamplingParams(max_tokens=3, bad_words=[first], **GREEDY))
    assert out.text[0] != first  # the same token as a word of its own is banned


def test_only_words_of_several_tokens_take_the_mask_path(llm, monkeypatch):
    ops = llm.engine.runner.backend.ops
    masked_draws = []
    draw = ops.sample_masked
    monkeypatch.setattr(ops, "sample_masked",
                        lambda pending, rows, bitmask: (masked_draws.append(list(rows)),
                                                        draw(pending, rows, bitmask))[1])
    llm.generate(PROMPT, SamplingParams(max_tokens=4, bad_words=["A", "b"], **GREEDY))
    assert masked_draws == []
    llm.generate(PROMPT, SamplingParams(max_tokens=4, bad_words=["A", "bc"], **GREEDY))
    assert any(masked_draws)


def test_n_samples_and_sampled_rows_keep_their_own_output(llm):
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=20, **GREEDY)).text
    word = plain[2:4]
    params = dict(max_tokens=20, bad_words=[word], **GREEDY)
    alone = llm.generate(PROMPT, SamplingParams(**params)).token_ids
    outs = llm.generate(PROMPT, SamplingParams(n=3, **params))
    assert [o.token_ids for o in outs] == [alone] * 3  # a shared tail would break the ban
    sampled = llm.generate([PROMPT, PROMPT[5:]], SamplingParams(
        n=4, seed=1, max_tokens=40, bad_words=[word, plain[8:10]],
        **{**GREEDY, "temperature": 1.0}))
    for out in sampled:
        assert not contains(out.token_ids, encode(llm, word))
        assert not contains(out.token_ids, encode(llm, plain[8:10]))
    assert_all_blocks_free(llm)


def test_preemption_and_prefix_caching_change_nothing(model_dir, llm):
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=20, **GREEDY)).text
    params = SamplingParams(max_tokens=64, bad_words=[plain[2:4], plain[5:8]], **GREEDY)
    prompts = [f"prompt {i} " * 6 for i in range(12)]
    ample = [o.token_ids for o in llm.generate(prompts, params)]
    small = LLM(model_dir, device="cpu", log=None, num_kv_blocks=24, block_size=16,
                max_num_seqs=64)
    try:
        tight = small.generate(prompts, params)
        assert small.engine.scheduler.num_preemptions > 0, "no preemption: the pool was too big"
        assert [o.token_ids for o in tight] == ample
        assert_all_blocks_free(small)
    finally:
        small.close()
    again = llm.generate(prompts, params)  # their prompts' blocks are cached now
    assert sum(o.num_cached_tokens for o in again) > 0
    assert [o.token_ids for o in again] == ample


def test_with_a_grammar_the_output_follows_both(llm):
    pytest.importorskip("llguidance")
    import json
    import re
    from cupy_llama.structured import StructuredSpec
    pattern = "[a-d]{12}"
    regex = dict(max_tokens=40, temperature=0, structured=StructuredSpec.regex(pattern))
    plain = llm.generate(PROMPT, SamplingParams(**regex)).text
    word = plain[1:3]
    out = llm.generate(PROMPT, SamplingParams(bad_words=[word], **regex))
    assert re.fullmatch(pattern, out.text) and word not in out.text, (plain, out.text)
    assert out.finish_reason == "stop"
    anything = dict(max_tokens=200, temperature=0, structured=StructuredSpec.json_object())
    plain = llm.generate("Answer:", SamplingParams(**anything)).text
    word = plain[:2]
    outs = llm.generate(["Answer:"], SamplingParams(bad_words=[word], n=2, **anything))
    for out in outs:
        assert isinstance(json.loads(out.text), dict) and not out.text.startswith(word)
    assert_all_blocks_free(llm)


def test_through_the_server_a_word_of_several_tokens_is_served(model_dir, llm):
    pytest.importorskip("fastapi")
    from inprocess_server import ask, make_state
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=12, **GREEDY)).text
    word = plain[3:6]
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(t): v for t, v in LETTERS.items()}}
    served, refused = ask(make_state(model_dir, llm), [
        ("POST", "/v1/completions", {"json": {**body, "bad_words": [word, "two words"]}}),
        ("POST", "/v1/completions", {"json": {**body, "bad_words": ["y" * 600, "z" * 600]}})])
    assert served.status == 200, served.body
    assert served.json()["choices"][0]["text"] == llm.generate(
        PROMPT, SamplingParams(max_tokens=12, bad_words=[word, "two words"], **GREEDY)).text
    assert word not in served.json()["choices"][0]["text"]
    assert refused.status == 400
    error = refused.json()["error"]
    assert error["param"] == "bad_words" and f"at most {MAX_BAD_WORD_TOKENS}" in error["message"]


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_bad_words_through_the_cuda_engine(model_dir, enforce_eager):
    """The CUDA engine (graphs on and off) draws rows with bad words of several tokens with
    ops.sample_masked: none of their words comes out, greedy n > 1 samples agree, and a
    plain neighbour comes out as it does alone."""
    with LLM(model_dir, device="cuda", log=None, enforce_eager=enforce_eager) as llm:
        plain = SamplingParams(max_tokens=32, **GREEDY)
        alone = llm.generate(PROMPT, plain)
        words = [alone.text[3:6], alone.text[10:12], alone.text[0]]
        sequences = [encode(llm, w) for w in words]
        assert contains(alone.token_ids, sequences[0])
        banned = [SamplingParams(max_tokens=32, bad_words=words, n=2 if i == 1 else 1,
                                 seed=i, logprobs=2 if i == 2 else None,
                                 **{**GREEDY, "temperature": 0.0 if i < 2 else 1.0})
                  for i in range(4)]
        outputs = llm.generate([PROMPT] * 4 + [PROMPT], banned + [plain])
        for output in outputs[:-1]:
            assert not any(contains(output.token_ids, s) for s in sequences)
            assert len(output.token_ids) == 32
        assert outputs[0].token_ids == outputs[1].token_ids == outputs[2].token_ids
        assert outputs[-1].token_ids == alone.token_ids
