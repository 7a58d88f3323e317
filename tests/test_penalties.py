"""The sampling controls beside temperature and the filters: repetition, frequency and
presence penalties, logit_bias, min_tokens, stop_token_ids, bad_words and the text
options, on the NumPy backend: each formula against values worked out by hand, then the
engine against a loop that recomputes every step from scratch and counts on its own
(unpipelined), through preemption, prefix caching and n > 1 samples."""
from collections import Counter

import numpy as np
import pytest
from conftest import assert_all_blocks_free, read_jsonl

from cupy_llama import LLM, SamplingParams
from cupy_llama.backends.numpy_ops import penalized_logits
from cupy_llama.errors import RequestError

PROMPT = list(range(10, 30))
GREEDY = dict(temperature=0, ignore_eos=True)


def test_penalties_on_known_logits():
    logits = np.array([2.0, -1.0, 0.5, 3.0, 1.0], np.float32)
    prompt_seen = np.array([True, False, False, False, False])
    counts = np.array([0, 2, 1, 0, 0])
    out = penalized_logits(logits, prompt_seen, counts, repetition=2.0, frequency=0.5,
                           presence=1.0, bias_ids=np.array([3, 4]), bias_values=[-100.0, 2.5])
    # 0: in the prompt, positive: 2 / 2; 1: in the output twice, negative: -1 * 2, then
    # -0.5 * 2 - 1; 2: once: 0.5 / 2 - 0.5 - 1; 3: biased only; 4: biased then unseen
    np.testing.assert_allclose(out, [1.0, -4.0, -1.25, -97.0, 3.5], rtol=0, atol=1e-6)


def test_a_ban_stays_a_ban_and_neutral_settings_change_nothing():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(64).astype(np.float32)
    counts = rng.integers(0, 3, 64)
    same = penalized_logits(logits, counts > 1, counts, 1.0, 0.0, 0.0, np.zeros(0, int), [])
    np.testing.assert_array_equal(same, logits)
    banned = penalized_logits(logits, counts > 1, counts, 1.3, -2.0, -2.0, np.array([5]),
                              [-np.inf])
    assert banned[5] == -np.inf and np.isfinite(np.delete(banned, 5)).all()


def reference_greedy(model_dir, prompt, max_tokens, *, repetition=1.0, frequency=0.0,
                     presence=0.0, bias=None):
    """Greedy decoding that recomputes every position each step (logits_at_every_position)
    and counts the output with a Counter: no slot state, no pipelining."""
    from conftest import logits_at_every_position
    out = []
    for _ in range(max_tokens):
        logits = logits_at_every_position(model_dir, prompt + out)[-1]
        counts = Counter(out)
        count = np.array([counts[t] for t in range(logits.shape[0])])
        seen = np.isin(np.arange(logits.shape[0]), prompt)
        ids = np.array(sorted(bias or {}), int)
        values = [bias[t] for t in ids] if bias else []
        out.append(int(np.argmax(penalized_logits(logits, seen, count, repetition, frequency,
                                                  presence, ids, values))))
    return out


PENALTIES = dict(repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.4)


def test_the_engine_equals_a_from_scratch_reference(model_dir, llm):
    expected = reference_greedy(model_dir, PROMPT, 16, repetition=1.5, frequency=0.7,
                                presence=0.4, bias={300: 1.5, 12: -3.0})
    got = llm.generate(PROMPT, SamplingParams(max_tokens=16, logit_bias={300: 1.5, 12: -3.0},
                                              **PENALTIES, **GREEDY)).token_ids
    assert got == expected
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=16, **GREEDY)).token_ids
    assert plain != got, "the penalties changed nothing: the test proves nothing"
    assert_all_blocks_free(llm)


def test_a_strong_presence_penalty_never_repeats(llm):
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=30, **GREEDY)).token_ids
    assert len(set(plain)) < len(plain), "greedy repeats nothing: the test proves nothing"
    out = llm.generate(PROMPT, SamplingParams(max_tokens=30, presence_penalty=2.0,
                                              **GREEDY)).token_ids
    assert len(set(out)) == len(out)


def test_logit_bias_of_100_makes_greedy_pick_the_token(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, logit_bias={"77": 100}, **GREEDY))
    assert out.token_ids == [77] * 8


def test_min_tokens_holds_eos_off_and_stop_token_ids_stop(llm):
    eos = min(llm.engine.eos_token_ids)
    # EOS pushed to the top: it comes right after min_tokens, never before
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, min_tokens=5,
                                              logit_bias={eos: 100}))
    assert out.token_ids[:5] == [t for t in out.token_ids[:5] if t != eos] and len(out.token_ids) == 6
    assert out.token_ids[5] == eos and out.finish_reason == "stop"
    # under ignore_eos EOS stops nothing, and min_tokens still holds it off (vLLM)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, min_tokens=5,
                                              ignore_eos=True, logit_bias={eos: 100}))
    assert eos not in out.token_ids[:5] and out.token_ids[5:] == [eos] * 3
    assert out.finish_reason == "length"
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=12, **GREEDY)).token_ids
    stop = plain[6]
    out = llm.generate(PROMPT, SamplingParams(max_tokens=12, stop_token_ids=[stop], **GREEDY))
    assert out.token_ids == plain[:plain.index(stop) + 1] and out.finish_reason == "stop"
    # and min_tokens holds a stop token off too (banned on the device)
    late = llm.generate(PROMPT, SamplingParams(max_tokens=12, stop_token_ids=[stop],
                                               min_tokens=plain.index(stop) + 1, **GREEDY))
    assert stop not in late.token_ids[:plain.index(stop) + 1]
    assert_all_blocks_free(llm)


def test_min_tokens_holds_a_stop_string_off_as_it_does_stop_tokens(llm):
    """A stop string that the first tokens spell ends the text only past min_tokens, so
    min_tokens 1 never returns an empty text."""
    forced = 77  # every token this one (a logit bias of 100), whose text is the stop string
    stop = llm.engine.tokenizer.decode([forced])
    assert stop, "the forced token has no text: the test proves nothing"
    for min_tokens in (0, 1, 2):
        out = llm.generate(PROMPT, SamplingParams(max_tokens=8, stop=[stop], min_tokens=min_tokens,
                                                  logit_bias={forced: 100}, **GREEDY))
        assert out.text == stop * min_tokens and out.finish_reason == "stop"
        assert out.token_ids == [forced] * (min_tokens + 1)


def test_penalties_survive_preemption_and_prefix_caching(model_dir, llm):
    import random
    rng = random.Random(3)
    shared = [rng.randrange(256) for _ in range(40)]
    batch = [shared + [rng.randrange(256) for _ in range(rng.randint(1, 20))] for _ in range(30)]
    params = SamplingParams(max_tokens=20, **PENALTIES, **GREEDY)
    ample = [o.token_ids for o in llm.generate(batch, params)]
    tight = LLM(model_dir, device="cpu", log=None, num_kv_blocks=32, block_size=16,
                max_num_seqs=64)
    assert [o.token_ids for o in tight.generate(batch, params)] == ample
    assert tight.engine.scheduler.num_preemptions > 0, "no preemption: the test proves nothing"
    uncached = LLM(model_dir, device="cpu", log=None, enable_prefix_caching=False)
    assert [o.token_ids for o in uncached.generate(batch, params)] == ample
    # each equals its own run alone (the first, from scratch)
    assert ample[0] == reference_greedy(model_dir, batch[0], 20, repetition=1.5, frequency=0.7,
                                        presence=0.4)
    assert_all_blocks_free(tight)


def test_n_samples_keep_their_own_counts(llm):
    alone = llm.generate(PROMPT, SamplingParams(max_tokens=16, **PENALTIES, **GREEDY)).token_ids
    outs = llm.generate(PROMPT, SamplingParams(n=3, max_tokens=16, **PENALTIES, **GREEDY))
    assert [o.token_ids for o in outs] == [alone] * 3


def test_bad_words_are_never_generated(llm):
    favoured = SamplingParams(max_tokens=6, logit_bias={65: 100}, **GREEDY)
    assert llm.generate(PROMPT, favoured).token_ids == [65] * 6
    # "A" is one byte token, banned on the device; " A" is two, a spelling vLLM leaves out
    assert llm.engine.bad_word_bans(["A"]) == ([65], None)
    banned = SamplingParams(max_tokens=6, logit_bias={65: 100}, bad_words=["A"], **GREEDY)
    assert 65 not in llm.generate(PROMPT, banned).token_ids


def test_include_stop_str_in_output_and_skip_special_tokens(llm):
    letters = {t: 30 for t in range(ord("a"), ord("z") + 1)}  # text: byte tokens
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=12, logit_bias=letters, **GREEDY)).text
    stop = plain[5:7]
    cut = llm.generate(PROMPT, SamplingParams(max_tokens=12, stop=[stop], logit_bias=letters,
                                              **GREEDY))
    kept = llm.generate(PROMPT, SamplingParams(max_tokens=12, stop=[stop], logit_bias=letters,
                                               include_stop_str_in_output=True, **GREEDY))
    assert cut.text == plain[:plain.index(stop)]
    assert kept.text == plain[:plain.index(stop) + len(stop)]
    special = sorted(llm.engine.tokenizer.all_special_ids)[0]
    with_special = llm.generate(PROMPT, SamplingParams(max_tokens=3, logit_bias={special: 100},
                                                       skip_special_tokens=False, **GREEDY))
    without = llm.generate(PROMPT, SamplingParams(max_tokens=3, logit_bias={special: 100},
                                                  **GREEDY))
    assert without.text == "" and with_special.text == \
        llm.engine.tokenizer.decode([special] * 3, skip_special_tokens=False)
    # a stop token's text (stop_token_ids, EOS) ends the text only where asked, as vLLM
    plain_ids = llm.generate(PROMPT, SamplingParams(max_tokens=12, logit_bias=letters,
                                                     **GREEDY)).token_ids
    token = plain_ids[4]
    for include in (False, True):
        out = llm.generate(PROMPT, SamplingParams(max_tokens=12, logit_bias=letters,
                                                  stop_token_ids=[token],
                                                  include_stop_str_in_output=include, **GREEDY))
        upto = plain_ids[:plain_ids.index(token) + 1]
        assert out.token_ids == upto and out.finish_reason == "stop"
        assert out.text == llm.engine.tokenizer.decode(upto if include else upto[:-1])


@pytest.mark.parametrize("field, value, words", [
    ("repetition_penalty", 0, "[0.01, 100]"), ("repetition_penalty", 1e-39, "[0.01, 100]"),
    ("repetition_penalty", 101, "[0.01, 100]"), ("frequency_penalty", 2.5, "[-2, 2]"),
    ("presence_penalty", -3, "[-2, 2]"), ("logit_bias", {"x": 1}, "token ids"),
    ("logit_bias", [1, 2], "an object such as"),
    ("logit_bias", {1: 101}, "[-100, 100]"), ("logit_bias", {i: 1 for i in range(301)}, "300"),
    ("min_tokens", -1, "min_tokens"), ("stop_token_ids", [-1], "stop_token_ids"),
    ("bad_words", [" "], "bad_words"), ("skip_special_tokens", "maybe", "true or false"),
])
def test_out_of_range_values_are_refused_by_name(field, value, words):
    with pytest.raises(RequestError, match=field.split("_")[0]) as error:
        SamplingParams(**{field: value})
    assert words in str(error.value)


@pytest.mark.parametrize("field", ["seed", "max_tokens", "n", "top_k", "min_tokens",
                                   "logprobs", "logit_bias", "temperature", "top_p"])
def test_a_huge_value_is_refused_and_quoted_in_short(field):
    """A RequestError whose quote of the value is cut short, for numbers of 4,000 digits
    below a field's range and of 400 above it (past float's range: no OverflowError)."""
    values = [{-10 ** 4000: 1.0} if field == "logit_bias" else -10 ** 4000]
    if field != "max_tokens":  # the context caps it, not SamplingParams
        values.append({5: 10 ** 400} if field == "logit_bias" else 10 ** 400)
    for value in values:
        with pytest.raises(RequestError, match=field) as error:
            SamplingParams(**{field: value})
        assert len(str(error.value)) < 200


def test_top_k_minus_one_is_off_as_in_vllm():
    """top_k=-1 is off (vLLM's default), as 0."""
    assert SamplingParams(top_k=-1).top_k == 0
    with pytest.raises(RequestError, match="top_k"):
        SamplingParams(top_k=-2)


def test_seed_minus_one_is_none_as_in_vllm():
    """seed=-1 is no seed (vLLM's), so each request draws a fresh one; other negative seeds
    are refused with the rule named."""
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=0).seed == 0
    with pytest.raises(RequestError, match=r"seed must be an integer in \[0, 2\^64\) \(-1 "
                                           r"means none\), got -2"):
        SamplingParams(seed=-2)


def test_generation_config_s_repetition_penalty_is_a_default(tmp_path, model_dir):
    """generation_config.json's repetition_penalty is the model's default, as transformers
    and vLLM apply it."""
    import json
    import shutil
    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, "repetition_penalty": 1.05}))
    assert LLM(folder, device="cpu", log=None).default_sampling_params().repetition_penalty == 1.05


def test_ids_outside_the_vocabulary_are_refused_by_name(llm):
    """The bias and ban tables index the logits by these ids: one past the vocabulary is a
    request error naming the field, and the engine keeps serving."""
    vocab = llm.engine.config.vocab_size
    for params, field in ((SamplingParams(max_tokens=2, logit_bias={vocab: 5.0}), "logit_bias"),
                          (SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=[vocab]),
                           "stop_token_ids")):
        with pytest.raises(RequestError, match=rf"{field} holds token id {vocab}, outside the "
                                               rf"vocabulary \[0, {vocab}\)"):
            llm.generate(PROMPT, params)
    assert len(llm.generate(PROMPT, SamplingParams(max_tokens=2, logit_bias={vocab - 1: 5.0},
                                                   ignore_eos=True)).token_ids) == 2
    assert_all_blocks_free(llm)


# ---- the command line ---------------------------------------------------------------------

def test_generate_takes_the_controls_and_help_lists_them(model_dir, llm, tmp_path, capsys):
    import json

    from cupy_llama.cli import main
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt": PROMPT}) + "\n" +
                    json.dumps({"prompt": PROMPT, "presence_penalty": 2.0,
                                "stop_token_ids": [7]}) + "\n")
    out = tmp_path / "out.jsonl"
    flags = ["--repetition-penalty", "1.5", "--frequency-penalty", "0.7",
             "--presence-penalty", "0.4", "--logit-bias", "300=1.5", "--logit-bias", "12=-3",
             "--min-tokens", "2"]
    code = main(["generate", "--model", str(model_dir), "--input", str(path), "--output",
                 str(out), "--device", "cpu", "--temperature", "0", "--max-tokens", "16",
                 "--ignore-eos", *flags])
    assert code == 0
    lines = read_jsonl(out)
    common = dict(max_tokens=16, min_tokens=2, logit_bias={300: 1.5, 12: -3.0},
                  repetition_penalty=1.5, frequency_penalty=0.7, **GREEDY)
    first = llm.generate(PROMPT, SamplingParams(presence_penalty=0.4, **common))
    second = llm.generate(PROMPT, SamplingParams(presence_penalty=2.0, stop_token_ids=[7],
                                                 **common))
    assert [line["text"] for line in lines] == [first.text, second.text]
    assert lines[0]["usage"]["completion_tokens"] == len(first.token_ids)
    # a bad value is a usage error naming the flag, before the model loads
    assert main(["generate", "--model", str(model_dir), "--input", str(path), "--device",
                 "cpu", "--frequency-penalty", "3"]) == 2
    assert "--frequency-penalty" in capsys.readouterr().err
    assert main(["generate", "--model", str(model_dir), "--input", str(path), "--device",
                 "cpu", "--logit-bias", "x"]) == 2
    capsys.readouterr()
    for command in ("generate", "chat"):
        assert main([command, "--help"]) == 0
        shown = capsys.readouterr().out
        for flag in ("--repetition-penalty", "--frequency-penalty", "--presence-penalty",
                     "--min-tokens", "--logit-bias"):
            assert flag in shown, (command, flag)


def test_chat_set_takes_the_penalties(llm):
    from cupy_llama.cli.chat_ui import ChatSession
    session = ChatSession(llm, SamplingParams(**GREEDY))
    assert session.set("repetition_penalty", "1.2") == "repetition_penalty = 1.2"
    assert session.set("presence_penalty", "-0.5") == "presence_penalty = -0.5"
    assert session.set("min_tokens", "3") == "min_tokens = 3"
    assert (session.params.repetition_penalty, session.params.presence_penalty,
            session.params.min_tokens) == (1.2, -0.5, 3)
    with pytest.raises(RequestError, match="frequency_penalty"):
        session.set("frequency_penalty", "9")
    assert "frequency_penalty = 0.0" in session.settings()
