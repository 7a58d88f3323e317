"""The engine end to end on the NumPy backend with a tiny random model: continuous batching,
preemption, abort and the stopping rules."""
import json
import shutil

import pytest
from conftest import assert_all_blocks_free

from cupy_llama import LLM, SamplingParams
from cupy_llama.engine.llm_engine import LLMEngine
from cupy_llama.errors import ConfigError, RequestError
from cupy_llama.sampling import model_sampling_defaults

GREEDY = dict(temperature=0, ignore_eos=True)


def prompts(count, seed=0, min_len=3, max_len=40):
    """Token-id prompts of mixed lengths (ids below 256 are plain bytes)."""
    import random
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def solo(llm, prompt, **params):
    return llm.generate(prompt, SamplingParams(**params)).token_ids


def test_preemption_changes_nothing(model_dir, llm):
    batch = prompts(34, seed=1, min_len=5, max_len=30)
    params = SamplingParams(max_tokens=20, **GREEDY)
    ample = llm.generate(batch, params)
    small = LLM(model_dir, device="cpu", log=None, num_kv_blocks=32, block_size=16,
                max_num_seqs=64)
    tight = small.generate(batch, params)
    assert small.engine.scheduler.num_preemptions > 0, "the pool was big enough; no preemption"
    assert [o.token_ids for o in tight] == [o.token_ids for o in ample]
    assert [o.text for o in tight] == [o.text for o in ample]
    assert all(len(o.token_ids) == 20 for o in tight)
    assert_all_blocks_free(small)


def test_batch_invariance(model_dir):
    # a small token budget so long prompts are prefilled in chunks beside other decodes
    llm = LLM(model_dir, device="cpu", log=None, max_num_batched_tokens=64, max_num_seqs=32)
    target = prompts(1, seed=2, min_len=20, max_len=20)[0]
    others = prompts(16, seed=3, min_len=1, max_len=150)
    alone = solo(llm, target, max_tokens=24, **GREEDY)
    outputs = llm.generate(others[:7] + [target] + others[7:], SamplingParams(max_tokens=24, **GREEDY))
    assert outputs[7].token_ids == alone
    # and the other way round: each of the others matches its own solo run
    for prompt, output in list(zip(others[:7] + [target] + others[7:], outputs))[:4]:
        assert output.token_ids == solo(llm, prompt, max_tokens=24, **GREEDY)


def test_seeded_sampling_is_independent_of_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    target = prompts(1, seed=4)[0]
    alone = llm.generate(target, params).token_ids
    together = llm.generate(prompts(5, seed=5) + [target], params)[-1].token_ids
    assert together == alone
    other_seed = llm.generate(target, SamplingParams(temperature=1.0, top_k=50, seed=99,
                                                     max_tokens=16, ignore_eos=True)).token_ids
    assert other_seed != alone


def test_slots_are_refilled(model_dir):
    llm = LLM(model_dir, device="cpu", log=None, max_num_seqs=4)
    engine = llm.engine
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=60, **GREEDY), request_id="long")
    for i in range(3):
        engine.add_request([4, 5], SamplingParams(max_tokens=5 + i, **GREEDY), request_id=f"mid{i}")
    engine.add_request([6, 7, 8], SamplingParams(max_tokens=3, **GREEDY), request_id="short")
    for i in range(6):
        engine.add_request([9] * (i + 1), SamplingParams(max_tokens=4, **GREEDY), request_id=f"more{i}")
    schedule = engine.scheduler.schedule
    after_schedule = []

    def recording_schedule():
        batch = schedule()
        after_schedule.append((len(engine.scheduler.running), len(engine.scheduler.waiting)))
        return batch

    engine.scheduler.schedule = recording_schedule
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert all(running == 4 for running, waiting in after_schedule if waiting), \
        "a slot stayed empty while requests waited"
    assert sum(1 for _, waiting in after_schedule if waiting) > 5
    assert finished.index("short") < finished.index("long")
    assert finished[-1] == "long"
    assert_all_blocks_free(llm)


def test_abort_midway_leaves_the_others_exact(llm):
    engine = llm.engine
    batch = prompts(20, seed=6)
    params = SamplingParams(max_tokens=24, **GREEDY)
    expected = [solo(llm, p, max_tokens=24, **GREEDY) for p in batch]
    ids = [engine.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(batch)]
    aborted = {"r2", "r5", "r11", "r12", "r19"}
    final, steps = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
        steps += 1
        if steps == 8:
            for request_id in aborted:
                [output] = engine.abort(request_id)
                assert output.finish_reason == "abort" and len(output.token_ids) < 24
    assert set(final) == set(ids) - aborted
    for i, request_id in enumerate(ids):
        if request_id not in aborted:
            assert final[request_id].token_ids == expected[i], request_id
    assert engine.abort("r2") == []  # already gone
    assert_all_blocks_free(llm)


def test_stop_strings_end_the_text_and_are_not_shown(llm):
    prompt = prompts(1, seed=7)[0]
    full = llm.generate(prompt, SamplingParams(max_tokens=40, **GREEDY))
    text = full.text
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    cut = text.index(stop)
    params = SamplingParams(max_tokens=40, stop=["never appears here", stop], **GREEDY)
    out = llm.generate(prompt, params)
    assert out.finish_reason == "stop"
    assert out.text == text[:cut]
    assert len(out.token_ids) < 40
    deltas = [o.delta for o in llm.stream(prompt, params)]
    assert "".join(deltas) == text[:cut]
    assert all(stop not in d for d in deltas)


def test_stop_reason_names_the_stop_string_or_token(llm):
    """vLLM's stop_reason on RequestOutput, from LLM.generate and on the last output of
    LLM.stream (None on the others): the stop string that ended the text (kept in it or
    not), the stop token id that ended it (an int); None for EOS, for a token that is
    both EOS and a stop token (vLLM checks EOS first), for length and for an abort."""
    prompt = prompts(1, seed=11)[0]
    free = llm.generate(prompt, SamplingParams(max_tokens=40, **GREEDY))
    text = free.text
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    token = next(t for t in free.token_ids[3:] if t not in free.token_ids[:3])
    at = free.token_ids.index(token)
    assert not llm.engine.eos_token_ids & set(free.token_ids[:at + 1])  # the model's own EOS
    cases = [  # (params, finish_reason, stop_reason)
        (dict(stop=["never appears here", stop]), "stop", stop),
        (dict(stop=[stop], include_stop_str_in_output=True), "stop", stop),
        (dict(stop_token_ids=[token]), "stop", token),
        (dict(stop_token_ids=[token], include_stop_str_in_output=True), "stop", token),
        (dict(stop_token_ids=[token], stop=["never appears here"]), "stop", token),
        (dict(stop=["never appears here"]), "length", None),
        (dict(), "length", None),
    ]
    for fields, finish_reason, stop_reason in cases:
        params = SamplingParams(max_tokens=40, **GREEDY, **fields)
        out = llm.generate(prompt, params)
        assert (out.finish_reason, out.stop_reason) == (finish_reason, stop_reason), fields
        assert type(out.stop_reason) is type(stop_reason)
        streamed = list(llm.stream(prompt, params))
        assert [o.stop_reason for o in streamed] == [None] * (len(streamed) - 1) + [stop_reason]
    # min_tokens: a stop token or string that comes earlier does not count
    held = llm.generate(prompt, SamplingParams(max_tokens=40, stop_token_ids=[token],
                                               min_tokens=at + 1, **GREEDY))
    assert held.stop_reason in (None, token) and len(held.token_ids) > at + 1
    assert (held.finish_reason == "stop") == (held.stop_reason == token)
    assert llm.generate(prompt, SamplingParams(max_tokens=40, stop=[stop], min_tokens=40,
                                               **GREEDY)).stop_reason is None
    llm.engine.eos_token_ids.add(token)
    try:
        for fields in (dict(), dict(stop_token_ids=[token])):
            out = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0, **fields))
            assert (out.finish_reason, out.stop_reason) == ("stop", None), fields
            assert out.token_ids == free.token_ids[:at + 1]
        ignoring = llm.generate(prompt, SamplingParams(max_tokens=40, stop_token_ids=[token],
                                                       **GREEDY))
        assert ignoring.stop_reason == token  # ignore_eos: only the stop token is left
    finally:
        llm.engine.eos_token_ids.discard(token)
    request_id = llm.engine.add_request(prompt, SamplingParams(max_tokens=40,
                                                               stop_token_ids=[token], **GREEDY))
    llm.engine.step()
    [aborted] = llm.engine.abort(request_id)
    assert (aborted.finish_reason, aborted.stop_reason) == ("abort", None)
    assert_all_blocks_free(llm)


def test_a_stop_token_s_text_is_kept_where_asked_streamed_or_not(llm):
    """include_stop_str_in_output keeps the text of the stop token (or EOS) that ended a
    sample, as vLLM does; without it the text ends before that token. The same text
    whether it is made token by token (streamed, or watched for stop strings) or once at
    the end."""
    prompt = prompts(1, seed=11)[0]
    free = llm.generate(prompt, SamplingParams(max_tokens=20, **GREEDY)).token_ids
    token = next(t for t in free[3:] if t not in free[:3])
    upto = free[:free.index(token) + 1]
    assert not llm.engine.eos_token_ids & set(upto)
    for include in (False, True):
        want = llm.tokenizer.decode(upto if include else upto[:-1])
        for fields in (dict(stop_token_ids=[token], **GREEDY),
                       dict(stop_token_ids=[token], stop=["never here"], **GREEDY),
                       dict(temperature=0)):  # EOS (below)
            params = SamplingParams(max_tokens=20, include_stop_str_in_output=include,
                                    **fields)
            if "stop_token_ids" not in fields:
                llm.engine.eos_token_ids.add(token)
            try:
                whole = llm.generate(prompt, params)
                streamed = "".join(o.delta for o in llm.stream(prompt, params))
            finally:
                llm.engine.eos_token_ids.discard(token)
            assert whole.token_ids == upto and whole.finish_reason == "stop"
            assert (whole.text, streamed) == (want, want), (include, fields)
    assert_all_blocks_free(llm)


def test_streaming_deltas_concatenate_to_the_final_text(llm):
    batch = prompts(6, seed=8)
    params = SamplingParams(max_tokens=30, **GREEDY)
    final = llm.generate(batch, params)
    texts, token_ids, last = {}, {}, {}
    for output in llm.stream(batch, params):
        texts[output.request_id] = texts.get(output.request_id, "") + output.delta
        token_ids.setdefault(output.request_id, []).extend(output.delta_token_ids)
        last[output.request_id] = output
    assert len(last) == 6 and all(o.finished for o in last.values())
    ordered = sorted(last, key=int)
    assert [texts[r] for r in ordered] == [o.text for o in final]
    assert [token_ids[r] for r in ordered] == [o.token_ids for o in final]
    assert_all_blocks_free(llm)


def test_leaving_a_stream_early_aborts_its_requests(llm):
    stream = llm.stream(prompts(3, seed=9), SamplingParams(max_tokens=50, **GREEDY))
    next(stream)
    stream.close()
    assert_all_blocks_free(llm)


def test_eos_from_generation_config_stops(model_dir, llm, tmp_path):
    prompt = prompts(1, seed=10)[0]
    free_run = solo(llm, prompt, max_tokens=30, **GREEDY)
    eos = free_run[12]
    first = free_run.index(eos)
    # a copy of the model whose generation_config.json (only) names that token as EOS
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    gen = json.loads((copy / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], eos]
    (copy / "generation_config.json").write_text(json.dumps(gen))
    other = LLM(copy, device="cpu", log=None)
    out = other.generate(prompt, SamplingParams(temperature=0, max_tokens=30))
    assert out.finish_reason == "stop"
    assert out.token_ids == free_run[:first + 1]
    ignoring = other.generate(prompt, SamplingParams(max_tokens=30, **GREEDY))
    assert ignoring.token_ids == free_run and ignoring.finish_reason == "length"


def test_max_tokens(llm):
    for n in (1, 7):
        out = llm.generate([1, 2, 3], SamplingParams(max_tokens=n, **GREEDY))
        assert len(out.token_ids) == n and out.finish_reason == "length"


def test_context_limit(model_dir):
    llm = LLM(model_dir, device="cpu", log=None, max_model_len=64)
    out = llm.generate([5] * 50, SamplingParams(max_tokens=100, **GREEDY))
    assert len(out.token_ids) == 14 and out.finish_reason == "length"
    with pytest.raises(RequestError, match=r"64 tokens but the context limit is 64"):
        llm.generate([5] * 64, SamplingParams(max_tokens=1))
    assert_all_blocks_free(llm)


def test_a_sequence_stops_when_it_would_outgrow_the_cache(model_dir):
    # 4 blocks of 16 tokens: a sequence can never hold more than 64 tokens
    llm = LLM(model_dir, device="cpu", log=None, num_kv_blocks=4, block_size=16)
    outs = llm.generate([[1] * 10, [2] * 20], SamplingParams(max_tokens=200, **GREEDY))
    assert [len(o.token_ids) for o in outs] == [54, 44]
    assert all(o.finish_reason == "length" for o in outs)
    with pytest.raises(RequestError, match=r"70 tokens and needs 5 KV blocks of 16.*only 4"):
        llm.generate([1] * 70, SamplingParams(max_tokens=1))
    # past max_model_len too: the cache is what binds, and what the error names
    limit = llm.engine.max_model_len
    with pytest.raises(RequestError, match=rf"{limit} tokens and needs \d+ KV blocks"):
        llm.generate([1] * limit, SamplingParams(max_tokens=1))
    assert_all_blocks_free(llm)


def test_a_cache_shorter_than_max_model_len_is_a_warning_at_load(model_dir):
    lines = []
    LLM(model_dir, device="cpu", log=lines.append, num_kv_blocks=4, block_size=16).close()
    warning = [line for line in lines if line.startswith("warning: the KV cache holds")]
    assert len(warning) == 1 and "holds 64 tokens, fewer than max_model_len" in warning[0]
    lines.clear()
    LLM(model_dir, device="cpu", log=lines.append, max_model_len=64, num_kv_blocks=4,
        block_size=16).close()
    assert not [line for line in lines if "warning" in line]


def test_a_stream_refuses_out_of_vocabulary_ids_at_the_call(llm):
    """As a bad prompt is, and as generate refuses them: before any request is added."""
    from dataclasses import replace

    from cupy_llama.structured import StructuredSpec
    vocab = llm.config.vocab_size
    for field, value in (("logit_bias", {vocab: 1.0}), ("stop_token_ids", [vocab]),
                         ("allowed_token_ids", [1, vocab])):
        with pytest.raises(RequestError, match=f"{field} holds token id {vocab}, outside"):
            llm.stream("a b c", SamplingParams(max_tokens=2, **{field: value}))
    gated = replace(StructuredSpec.regex("[ab]+"), starts_after=vocab)
    with pytest.raises(RequestError, match=f"structured.starts_after holds token id {vocab}"):
        llm.stream("a b c", SamplingParams(max_tokens=2, structured=gated))
    # generate checks the ids first too, before a constraint compiles (this one would not)
    broken = replace(StructuredSpec.regex("("), starts_after=vocab)
    for call in (llm.stream, llm.generate):
        with pytest.raises(RequestError, match="structured.starts_after holds token id"):
            call("a b c", SamplingParams(max_tokens=2, structured=broken))
    assert_all_blocks_free(llm)


def test_a_stream_collected_in_the_middle_of_a_step_closes_after_it(llm, monkeypatch):
    """A half-read stream dropped in a reference cycle is finalized whenever the garbage
    collector runs, which may be in the middle of a step (here: between scheduling and
    launching it); its requests close at the engine's next turn, never inside that step."""
    import gc
    params = SamplingParams(max_tokens=8, **GREEDY)
    first, second = prompts(2, seed=23)
    want = llm.generate(second, params).token_ids
    stream = llm.stream(first, params)
    next(stream)
    cycle = [stream]
    cycle.append(cycle)
    del stream, cycle
    schedule = llm.engine.scheduler.schedule

    def schedule_then_collect(*args, **kwargs):
        batch = schedule(*args, **kwargs)
        gc.collect()
        return batch
    monkeypatch.setattr(llm.engine.scheduler, "schedule", schedule_then_collect)
    assert llm.generate(second, params).token_ids == want
    monkeypatch.undo()
    assert_all_blocks_free(llm)  # closed by the end of that call's turns


def test_calls_from_several_threads_take_turns(llm):
    """generate and stream from several threads at once share the engine step by step:
    each gets its own greedy text, nothing fails, and nothing is left behind."""
    import threading
    params = SamplingParams(max_tokens=12, **GREEDY)
    prompts_ = prompts(3, seed=21)
    want = [llm.generate(p, params).token_ids for p in prompts_]
    got, errors = [], []

    def work(k):
        try:
            for _ in range(4):
                prompt = prompts_[k % 3]
                if k % 2:
                    tokens = [o for o in llm.stream(prompt, params)][-1].token_ids
                else:
                    tokens = llm.generate(prompt, params).token_ids
                got.append(tokens == want[k % 3])
        except Exception as e:  # noqa: BLE001 (the test reports it)
            errors.append(repr(e))
    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and got == [True] * 16
    assert_all_blocks_free(llm)


def test_sampling_params_take_vllm_s_forms():
    """Tuples for stop and bad_words as for stop_token_ids; a temperature below 1e-5
    decodes greedily, as vLLM's does (dividing logits by less leaves float32's range)."""
    params = SamplingParams(stop=("a", "b"), bad_words=("c",), stop_token_ids=(1, 2))
    assert (params.stop, params.bad_words, params.stop_token_ids) == (["a", "b"], ["c"], [1, 2])
    for tiny in (1e-6, 1e-30, 1e-40):
        assert SamplingParams(temperature=tiny).is_greedy
    assert SamplingParams(temperature=1e-5).temperature == 1e-5


def test_bad_requests_name_the_value(llm):
    with pytest.raises(RequestError, match="-0.5"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(RequestError, match="max_tokens.*0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(RequestError, match="token id 512"):
        llm.generate([1, 512], SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match="already in use"):
        llm.engine.add_request([1], SamplingParams(), request_id="x")
        llm.engine.add_request([1], SamplingParams(), request_id="x")
    llm.engine.abort("x")
    assert_all_blocks_free(llm)


def test_a_rejected_prompt_leaves_no_request_behind(model_dir):
    llm = LLM(model_dir, device="cpu", max_model_len=64, log=None)
    with pytest.raises(RequestError):
        llm.generate([[1, 2, 3], list(range(100))], SamplingParams(max_tokens=4, **GREEDY))
    assert_all_blocks_free(llm)
    with pytest.raises(RequestError, match="context limit is 64"):  # at the call, not at next()
        llm.stream([[1, 2, 3], list(range(100))], SamplingParams(max_tokens=4, **GREEDY))
    with pytest.raises(RequestError, match="token id 512"):
        llm.stream([[1, 512]], SamplingParams(max_tokens=4, **GREEDY))
    assert_all_blocks_free(llm)
    outputs = list(llm.stream([5, 6, 7], SamplingParams(max_tokens=3, **GREEDY)))
    assert {o.request_id for o in outputs} == {outputs[-1].request_id}


def test_a_half_read_stream_survives_a_generate_in_between(llm):
    params = SamplingParams(max_tokens=12, **GREEDY)
    first, second = prompts(2, seed=11)
    expected = solo(llm, first, max_tokens=12, **GREEDY)
    stream = llm.stream(first, params)
    head = next(stream)
    other = llm.generate(second, params)
    assert other.token_ids == solo(llm, second, max_tokens=12, **GREEDY)
    rest = list(stream)
    assert rest and rest[-1].finished
    assert head.delta_token_ids + [t for o in rest for t in o.delta_token_ids] == expected
    assert_all_blocks_free(llm)


def test_abort_from_outside_ends_a_stream(llm):
    stream = llm.stream(prompts(1, seed=12)[0], SamplingParams(max_tokens=50, **GREEDY))
    head = next(stream)
    llm.engine.abort(head.request_id)
    rest = list(stream)  # must end, not wait forever
    assert rest[-1].finish_reason == "abort"
    assert_all_blocks_free(llm)


def test_numpy_integers_are_token_ids(llm):
    import numpy as np
    params = SamplingParams(max_tokens=4, **GREEDY)
    prompt = prompts(1, seed=13)[0]
    assert llm.generate(list(np.array(prompt, dtype=np.int64)), params).token_ids == \
        llm.generate(prompt, params).token_ids


def test_a_list_is_one_prompt_of_ids_only_when_every_element_is_an_id(llm):
    """LLM.generate reads a flat list as one token-id prompt only where every element is
    an int (Python or NumPy, no bool); a list of strings is a batch of text prompts."""
    import numpy as np
    params = SamplingParams(max_tokens=2, **GREEDY)
    prompt = prompts(1, seed=14)[0]
    assert not isinstance(llm.generate(prompt, params), list)
    assert not isinstance(llm.generate([*prompt[:-1], np.int32(prompt[-1])], params), list)
    assert len(llm.generate(["Hello", "there"], params)) == 2
    with pytest.raises(RequestError):
        llm.generate([*prompt[:-1], True], params)


def test_model_defaults_sample_only_when_generation_config_says_do_sample(model_dir, llm, tmp_path):
    """As in transformers: generation_config.json's temperature/top_p apply with
    do_sample true; without do_sample (or without the file) decoding is greedy."""
    assert llm.default_sampling_params().temperature == 0.6  # the tiny model says do_sample
    assert llm.default_sampling_params().top_p == 0.9
    quiet = tmp_path / "model"
    shutil.copytree(model_dir, quiet)
    (quiet / "generation_config.json").write_text(json.dumps({"eos_token_id": 257, "temperature": 0.6}))
    assert LLM(quiet, device="cpu", log=None).default_sampling_params().temperature == 0
    (quiet / "generation_config.json").unlink()
    assert LLM(quiet, device="cpu", log=None).default_sampling_params().temperature == 0


def test_max_new_tokens_is_the_default_output_length(model_dir, llm, tmp_path):
    """generation_config.json's max_new_tokens (vLLM reads it so) is the output length of a
    request that names none: LLM's default params and their copies; one that names its
    own max_tokens keeps it."""
    assert llm.default_sampling_params().max_tokens == SamplingParams().max_tokens  # none set
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    gen = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**gen, "max_new_tokens": 5}))
    short = LLM(copy, device="cpu", log=None)
    try:
        assert short.default_sampling_params().max_tokens == 5
        out = short.generate("Hello", SamplingParams.from_dict(
            {"temperature": 0, "ignore_eos": True}, model_sampling_defaults(
                short.config.generation_config)))
        assert len(out.token_ids) == 5
        out = short.generate("Hello", SamplingParams(temperature=0, ignore_eos=True,
                                                     max_tokens=7))
        assert len(out.token_ids) == 7
        assert len(short.generate("Hello").token_ids) <= 5
    finally:
        short.close()


def test_steps_are_pipelined(llm):
    """Step k is launched before step k-1's tokens are read, so the device never waits for
    the host; the outputs are those of a plain greedy run all the same."""
    engine, events = llm.engine, []
    run, finish = engine.runner.run, engine._finish_step

    def traced_run(batch):
        events.append("launch")
        return run(batch)

    def traced_finish(launched):
        events.append("read")
        return finish(launched)

    engine.runner.run, engine._finish_step = traced_run, traced_finish
    try:
        outputs = llm.generate(prompts(3, seed=9), SamplingParams(max_tokens=6, **GREEDY))
    finally:
        engine.runner.run, engine._finish_step = run, finish
    assert all(len(o.token_ids) == 6 for o in outputs)
    # launch 1; then each step: launch k, read k-1; the last read has nothing to launch
    assert events[:3] == ["launch", "launch", "read"]
    assert events[-1] == "read" and events.count("launch") == events.count("read")
    assert_all_blocks_free(llm)


def test_a_sequence_preempted_while_its_token_is_coming_gets_that_token(model_dir, llm):
    """With steps pipelined, the scheduler may preempt a sequence whose last token is still
    on its way (a placeholder); recomputing it must use the real token."""
    batch = prompts(34, seed=1, min_len=5, max_len=30)
    params = SamplingParams(max_tokens=20, **GREEDY)
    ample = llm.generate(batch, params)
    small = LLM(model_dir, device="cpu", log=None, num_kv_blocks=32, block_size=16,
                max_num_seqs=64)
    scheduler, pending_victims = small.engine.scheduler, []
    preempt = scheduler._preempt

    def traced_preempt(seq):
        pending_victims.append(any(t < 0 for t in seq.output_token_ids))
        preempt(seq)

    scheduler._preempt = traced_preempt
    tight = small.generate(batch, params)
    assert any(pending_victims), "no sequence was preempted with a token in flight"
    assert [o.token_ids for o in tight] == [o.token_ids for o in ample]
    assert all(t >= 0 for o in tight for t in o.token_ids)
    assert_all_blocks_free(small)


def test_a_stop_found_one_step_late_shows_nothing_after_it(llm):
    """EOS and stop strings are seen only when the next step is already queued: its token
    must not reach the output."""
    prompt = prompts(1, seed=4)[0]
    free = solo(llm, prompt, max_tokens=12, **GREEDY)
    eos = free[5]
    llm.engine.eos_token_ids.add(eos)
    try:
        out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0))
    finally:
        llm.engine.eos_token_ids.discard(eos)
    first = free.index(eos)
    assert out.token_ids == free[:first + 1] and out.finish_reason == "stop"
    assert_all_blocks_free(llm)


def test_abort_before_the_last_token_arrives_says_abort(llm):
    engine = llm.engine
    request_id = engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, **GREEDY))
    for _ in range(3):  # the third launch is the last token: the sequence ends at launch
        engine.step()
    [output] = engine.abort(request_id)
    assert output.finish_reason == "abort" and len(output.token_ids) == 2
    assert all(t >= 0 for t in output.token_ids)
    engine.step()  # the step still running finds nothing to hand out
    assert_all_blocks_free(llm)


def test_an_interrupted_step_loses_no_token(llm):
    """Ctrl-C while step() waits for the device: the next step() hands out those tokens
    before launching anything, and the result is the uninterrupted one."""
    prompt = prompts(1, seed=5)[0]
    expected = solo(llm, prompt, max_tokens=8, **GREEDY)
    engine = llm.engine

    class InterruptedOnce:  # the first wait for these tokens is interrupted
        def __init__(self, sampled):
            self.sampled, self.raised = sampled, False

        def get(self):
            if not self.raised:
                self.raised = True
                raise KeyboardInterrupt
            return self.sampled.get()

    launch, launches = engine._launch, []

    def launch_and_wrap(batch):
        launched = launch(batch)
        launches.append(launched)
        if len(launches) == 3:
            launched.sampled = InterruptedOnce(launched.sampled)
        return launched

    engine._launch = launch_and_wrap
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=8, **GREEDY))
    final, interruptions = None, 0
    try:
        while final is None and len(launches) < 50:
            try:
                outputs = engine.step()
            except KeyboardInterrupt:
                interruptions += 1
                continue
            final = next((o for o in outputs if o.finished), None)
    finally:
        engine._launch = launch
    assert interruptions == 1
    assert final is not None and final.request_id == request_id
    assert final.token_ids == expected and final.finish_reason == "length"
    assert_all_blocks_free(llm)


def test_a_list_of_params_is_checked_like_one(llm):
    """Each SamplingParams of a list is checked again when used, as a single one is: a
    value set after construction is refused, not run or failed deep in the engine."""
    edited = SamplingParams(max_tokens=4, **GREEDY)
    edited.max_tokens = 0
    with pytest.raises(RequestError, match="max_tokens.*0"):
        llm.generate(["a"], [edited])
    with pytest.raises(RequestError, match="max_tokens.*0"):
        llm.generate("a", edited)
    edited.max_tokens, edited.top_k = 4, -3
    with pytest.raises(RequestError, match="top_k.*-3"):
        llm.generate(["a"], [edited])
    for params, message in (({"temperature": 0}, "got dict"), ("greedy", "got str"),
                            (5, "got int"), ([SamplingParams(), "x"], "every element.*got str"),
                            ([SamplingParams()] * 3, "list of 2.*got a list of 3")):
        with pytest.raises(RequestError, match=message):
            llm.generate(["a", "b"], params)
    assert_all_blocks_free(llm)


def test_numpy_scalars_are_sampling_values():
    import numpy as np
    params = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9), top_k=np.int64(3),
                            min_p=np.float32(0.25), max_tokens=np.int32(7), seed=np.uint64(9))
    assert (params.temperature, params.top_k, params.max_tokens, params.seed) == (0.5, 3, 7, 9)
    assert all(type(getattr(params, f)) is float for f in ("temperature", "top_p", "min_p"))
    assert all(type(getattr(params, f)) is int for f in ("top_k", "max_tokens", "seed"))
    with pytest.raises(RequestError, match="max_tokens"):
        SamplingParams(max_tokens=np.int64(0))


def test_none_takes_the_default_where_vllm_declares_a_field_optional(llm):
    """Code written for vLLM passes None for stop, stop_token_ids, logit_bias and
    bad_words (none), and for max_tokens (no limit but the context's)."""
    params = SamplingParams(stop=None, stop_token_ids=None, logit_bias=None, bad_words=None,
                            max_tokens=None, temperature=0, ignore_eos=True)
    assert (params.stop, params.stop_token_ids, params.logit_bias, params.bad_words) == \
        ([], [], {}, [])
    prompt = [5] * 20
    out = llm.generate(prompt, params)
    assert out.finish_reason == "length"
    assert len(prompt) + len(out.token_ids) == llm.engine.context_limit
    assert_all_blocks_free(llm)


def test_min_tokens_error_names_only_a_max_tokens_that_was_given():
    """max_tokens None has no number: a bad min_tokens says what it must be without the
    stand-in for "none"; a max_tokens that was given is named with its value."""
    for value in (-1, 1.5, True, 2**63):
        message = str(pytest.raises(RequestError, SamplingParams, max_tokens=None,
                                    min_tokens=value).value)
        assert message.startswith("min_tokens must be an integer from 0 to 2**63 - 1, got ")
        assert str(value) in message and "max_tokens" not in message, message
        assert str(2**63 - 1) not in message, message
    message = str(pytest.raises(RequestError, SamplingParams, max_tokens=5, min_tokens=6).value)
    assert "max_tokens (5)" in message and "got 6" in message


def test_min_tokens_past_the_context_bans_eos_up_to_it(llm):
    """max_tokens None: any min_tokens >= 0 is taken, and one past the context limit
    keeps the stop tokens banned until the context ends the output."""
    prompt = [5] * (llm.engine.context_limit - 6)
    first = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0)).token_ids[0]
    for min_tokens in (6, 2**40):
        out = llm.generate(prompt, SamplingParams(max_tokens=None, min_tokens=min_tokens,
                                                  stop_token_ids=[first], temperature=0))
        assert out.finish_reason == "length" and len(out.token_ids) == 6, min_tokens
        assert first not in out.token_ids
    assert_all_blocks_free(llm)


def test_chat_answers_a_list_of_conversations_with_a_list(llm):
    conversation = [{"role": "user", "content": "a"}]
    params = SamplingParams(max_tokens=2, **GREEDY)
    one = llm.chat(conversation, params)
    listed = llm.chat([conversation], params)
    assert isinstance(listed, list) and len(listed) == 1
    assert listed[0].token_ids == one.token_ids
    assert len(llm.chat([conversation, conversation], params)) == 2
    with pytest.raises(RequestError, match="date_string must be a string.*got int"):
        llm.chat(conversation, params, date_string=5)


def test_vllm_prompt_dicts_are_taken(llm):
    """TextPrompt {"prompt": ...} and TokensPrompt {"prompt_token_ids": ...}, alone or in
    a list, are the text or ids they hold; a dict of other keys is refused by them."""
    params = SamplingParams(max_tokens=3, **GREEDY)
    ids = llm.tokenizer.encode("a b c")
    by_text, by_ids = llm.generate("a b c", params), llm.generate(ids, params)
    assert llm.generate({"prompt": "a b c"}, params).token_ids == by_text.token_ids
    assert llm.generate({"prompt_token_ids": ids}, params).token_ids == by_ids.token_ids
    both = llm.generate([{"prompt": "a b c"}, {"prompt_token_ids": ids}], params)
    assert [o.token_ids for o in both] == [by_text.token_ids, by_ids.token_ids]
    with pytest.raises(RequestError, match=r"a prompt dict must be .*got the keys "
                                           r"\['multi_modal_data', 'prompt'\]"):
        llm.generate({"prompt": "x", "multi_modal_data": {}}, params)
    # each key holds its own kind: a chat template's text under prompt_token_ids (a
    # tokenizer's apply_chat_template without tokenize=True) would be encoded again, BOS
    # and all
    text = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Hi"}])
    with pytest.raises(RequestError, match="'prompt_token_ids' must be a list of token ids, "
                                           "got str .*tokenize=True"):
        llm.generate({"prompt_token_ids": text}, params)
    with pytest.raises(RequestError, match="'prompt' must be text, got list"):
        llm.generate([{"prompt": ids}], params)
    with pytest.raises(RequestError, match="token ids \\(integers >= 0\\), got the element True"):
        llm.generate({"prompt_token_ids": [1, True]}, params)
    assert llm.generate({"prompt_token_ids": tuple(ids)}, params).token_ids == by_ids.token_ids


def test_sampling_params_by_vllm_s_keyword(llm):
    """generate, stream and chat take the SamplingParams as sampling_params=, vLLM's name,
    and use_tqdm (which shows nothing here)."""
    params = SamplingParams(max_tokens=3, **GREEDY)
    expected = llm.generate("a b c", params).token_ids
    assert llm.generate("a b c", sampling_params=params, use_tqdm=False).token_ids == expected
    assert llm.generate(["a b c"], sampling_params=[params])[0].token_ids == expected
    assert [o.token_ids for o in llm.stream("a b c", sampling_params=params)][-1] == expected
    chat = [{"role": "user", "content": "Hi"}]
    assert (llm.chat(chat, sampling_params=params, use_tqdm=False).token_ids
            == llm.chat(chat, params).token_ids)
    with pytest.raises(RequestError, match="give the SamplingParams once"):
        llm.generate("a b c", params, sampling_params=params)


def test_a_vllm_script_s_chat_prompt(llm):
    """The pattern of vLLM scripts: the tokenizer by get_tokenizer(), the prompt text by
    transformers' apply_chat_template(..., tokenize=False, add_generation_prompt=True),
    template variables as keywords; tokenize=True gives its ids."""
    tokenizer = llm.get_tokenizer()
    chat = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == tokenizer.apply_chat_template(chat)
    ids = tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    assert ids == tokenizer.encode_chat(chat)
    params = SamplingParams(max_tokens=3, **GREEDY)
    assert llm.generate(ids, params).token_ids == llm.chat(chat, params).token_ids
    flavoured = tokenizer.apply_chat_template(chat, chat_template="{{ flavour }}", flavour="x")
    assert flavoured == "x" == tokenizer.apply_chat_template(
        chat, chat_template="{{ flavour }}", template_kwargs={"flavour": "x"})
    # the stop tokens of vLLM's Llama 3 examples, by transformers' names
    assert tokenizer.eos_token_id == tokenizer.token_to_id(tokenizer.eos_token) is not None
    eos = tokenizer.eos_token
    assert tokenizer.convert_tokens_to_ids(eos) == tokenizer.eos_token_id
    assert tokenizer.convert_tokens_to_ids([eos, "no such token"]) == [tokenizer.eos_token_id, None]


def test_chat_continues_the_final_message(llm):
    """continue_final_message: the reply goes on from the last message's text, as a
    completion of the rendered chat cut after it; add_generation_prompt follows it."""
    chat = [{"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "The colour is"}]
    params = SamplingParams(max_tokens=4, **GREEDY)
    reply = llm.chat(chat, params, continue_final_message=True)
    text = llm.tokenizer.apply_chat_template(chat, add_generation_prompt=False,
                                             continue_final_message=True)
    assert text.endswith("The colour is")
    assert reply.prompt_token_ids == llm.tokenizer.encode_chat(
        chat, add_generation_prompt=False, continue_final_message=True)
    assert reply.token_ids == llm.generate(reply.prompt_token_ids, params).token_ids
    answered = llm.chat(chat, params)  # a new turn after the assistant's message
    assert answered.prompt_token_ids[:len(reply.prompt_token_ids)] == reply.prompt_token_ids
    assert len(answered.prompt_token_ids) > len(reply.prompt_token_ids)
    bare = llm.chat(chat[:1], params, add_generation_prompt=False)
    assert bare.prompt_token_ids == llm.tokenizer.encode_chat(chat[:1],
                                                              add_generation_prompt=False)
    with pytest.raises(RequestError, match="cannot both be true"):
        llm.chat(chat, params, continue_final_message=True, add_generation_prompt=True)


def test_chat_takes_content_as_text_parts(llm):
    """OpenAI's content parts, as the server and vLLM's LLM.chat take them: the texts one a
    line; a part that is not text is refused by its place."""
    params = SamplingParams(max_tokens=3, **GREEDY)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                          {"type": "text", "text": "there"}]}]
    joined = [{"role": "user", "content": "Hello\nthere"}]
    assert llm.chat(parts, params).prompt_token_ids == llm.chat(joined, params).prompt_token_ids
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(RequestError, match=r"messages\[0\]\['content'\]\[0\] must be "
                                           r".*'image_url'.*only text content"):
        llm.chat(image, params)
    with pytest.raises(RequestError, match=r"\['content'\]\[0\]\['text'\] must be a string"):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": 5}]}], params)
    # an assistant's refusal part is its text (OpenAI's, as vLLM reads it); a user's is not
    refused = [*joined, {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
               {"role": "user", "content": "Why?"}]
    said = [*joined, {"role": "assistant", "content": "No."}, {"role": "user", "content": "Why?"}]
    assert llm.chat(refused, params).prompt_token_ids == llm.chat(said, params).prompt_token_ids
    with pytest.raises(RequestError, match=r"\['content'\]\[0\] must be \{'type': 'text'.*"
                                           r"'refusal'"):
        llm.chat([{"role": "user", "content": [{"type": "refusal", "refusal": "No."}]}], params)


def test_bad_model_folders_and_options_are_config_errors(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="is a file, not a model directory"):
        LLM(model_dir / "config.json", device="cpu", log=None)
    with pytest.raises(ConfigError, match=r"LLM needs a model folder: LLM\('path/to/model'\)"):
        LLM(None, device="cpu", log=None)
    with pytest.raises(ConfigError, match="model_dir must be the path.*got int"):
        LLM(5, device="cpu", log=None)
    with pytest.raises(ConfigError, match="give the model folder once"):
        LLM(model_dir, model=model_dir, device="cpu", log=None)
    llm = LLM(model=str(model_dir), device="cpu", log=None)  # vLLM's keyword
    assert llm.model_dir == model_dir
    llm.close()
    home = model_dir.parent  # "~/..." is the home folder's, as in a shell
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(home))
        llm = LLM(f"~/{model_dir.name}", device="cpu", log=None)
        assert llm.model_dir == model_dir
        llm.close()
        LLMEngine.load(f"~/{model_dir.name}", "cpu").close()  # the tokenizer and weights too
    with pytest.raises(ConfigError, match="unknown LLM option 'dtype'; the options are .*max_num_seqs"):
        LLM(model_dir, device="cpu", log=None, dtype="float16")
    with pytest.raises(ConfigError, match="gpu_memory_utilization must be a number"):
        LLM(model_dir, device="cpu", log=None, gpu_memory_utilization="x")
    with pytest.raises(ConfigError, match="enforce_eager must be True or False"):
        LLM(model_dir, device="cpu", log=None, enforce_eager="no")
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    gen_path = copy / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    for bad, message in (({**gen, "top_k": -2}, "generation_config.json: top_k.*-2.*fix or remove"),
                         ({**gen, "temperature": "0.7"}, "generation_config.json: temperature"),
                         # do_sample 1 samples (model_samples): its bad value is an error too
                         ({**gen, "do_sample": 1, "temperature": -1},
                          "generation_config.json: temperature"),
                         ([1, 2], "generation_config.json must hold a JSON object"),
                         # as a string, "false" would be true
                         ({**gen, "do_sample": "false"},
                          "generation_config.json: do_sample must be true or false, got \"false\""),
                         ({**gen, "max_new_tokens": 0},
                          "generation_config.json: max_new_tokens must be an integer >= 1, got 0")):
        gen_path.write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=message):
            LLM(copy, device="cpu", log=None)


def test_the_cpu_fallback_warning_does_not_suggest_the_cpu(model_dir):
    """device="auto" without a usable GPU warns that it runs on the CPU; the reason it
    gives drops its own hint to run with --device cpu (that is what happens)."""
    from cupy_llama.backends.cuda import cuda_usable
    if cuda_usable()[0]:
        pytest.skip("a GPU is usable here: no fallback")
    lines = []
    llm = LLM(model_dir, log=lines.append)
    warnings = [line for line in lines if line.startswith("warning:")]
    assert llm.device == "cpu" and len(warnings) == 1
    assert "running on the CPU" in warnings[0] and "--device cpu" not in warnings[0]
    assert LLM(model_dir, log=None).device == "cpu"  # log None: the fallback is silent


def test_invalid_generation_fields_without_do_sample_are_ignored(model_dir, tmp_path):
    """transformers ignores the sampling fields of a greedy generation config; so does the
    engine when one is invalid (with do_sample true it is a ConfigError, above)."""
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    gen = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps(
        {**gen, "do_sample": False, "top_p": 0.0, "top_k": 5}))
    params = LLM(copy, device="cpu", log=None).default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 1.0, 5)
    # do_sample null is left out: greedy
    (copy / "generation_config.json").write_text(json.dumps({**gen, "do_sample": None}))
    assert LLM(copy, device="cpu", log=None).default_sampling_params().temperature == 0.0


def test_llama3_rope_scaling_takes_an_integral_float_length():
    from cupy_llama.models import config_from_dicts
    raw = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 12,
           "vocab_size": 16, "rope_scaling": {"rope_type": "llama3", "factor": 32.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192.0}}
    assert config_from_dicts(raw).rope["full_attention"].original_max_position_embeddings == 8192
    raw["rope_scaling"]["original_max_position_embeddings"] = 8192.5
    with pytest.raises(ConfigError, match="original_max_position_embeddings must be a positive integer"):
        config_from_dicts(raw)


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3ForCausalLM",
                                          "Gemma3ForCausalLM", "MistralForCausalLM"])
@pytest.mark.parametrize("layers", ["2", 2.0, 0, True])
def test_a_layer_count_that_is_no_count_is_named(architecture, layers):
    """Each family sizes per-layer fields by num_hidden_layers before the rest is checked:
    a string, a float or 0 there is the field's own error, not Python's."""
    from cupy_llama.models import config_from_dicts
    raw = {"architectures": [architecture], "hidden_size": 8, "num_hidden_layers": layers,
           "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 12,
           "vocab_size": 16, "head_dim": 4}
    with pytest.raises(ConfigError, match=r"config.json: num_hidden_layers must be a positive "
                                          r"integer, got"):
        config_from_dicts(raw)


def test_params_may_be_any_iterable_and_chat_batches_may_be_tuples(llm):
    params = [SamplingParams(max_tokens=2, **GREEDY), SamplingParams(max_tokens=3, **GREEDY)]
    outs = llm.generate(["a", "b"], (p for p in params))
    assert [len(o.token_ids) for o in outs] == [2, 3]
    conversation = ({"role": "user", "content": "a"},)
    replies = llm.chat((conversation, conversation), params[0])
    assert len(replies) == 2 and replies[0].token_ids == replies[1].token_ids


def test_engine_numbers_may_be_numpy_and_are_stored_as_python_ones():
    import numpy as np
    from cupy_llama.config import EngineConfig
    config = EngineConfig(max_num_seqs=np.int64(4), num_kv_blocks=np.int32(9),
                          gpu_memory_utilization=np.float32(0.5))
    assert (config.max_num_seqs, config.num_kv_blocks, config.gpu_memory_utilization) == (4, 9, 0.5)
    assert type(config.max_num_seqs) is int and type(config.gpu_memory_utilization) is float
    for bad in (np.True_, True, 2.0, np.float64(4.0)):
        with pytest.raises(ConfigError, match="max_num_seqs must be a positive integer"):
            EngineConfig(max_num_seqs=bad)
    with pytest.raises(ConfigError, match="gpu_memory_utilization must be a number"):
        EngineConfig(gpu_memory_utilization=True)


def test_enforce_eager_takes_integer_and_numpy_booleans():
    import numpy as np
    from cupy_llama.config import EngineConfig
    for value in (1, np.True_, np.int64(1)):
        assert EngineConfig(enforce_eager=value).enforce_eager is True
    assert EngineConfig(enforce_eager=0).enforce_eager is False
    with pytest.raises(ConfigError, match="enforce_eager must be True or False, got 2"):
        EngineConfig(enforce_eager=2)


def test_ignore_eos_takes_flags_as_enforce_eager_does():
    import numpy as np
    for value in (1, np.True_, np.int64(1), True):
        assert SamplingParams(ignore_eos=value).ignore_eos is True
    assert SamplingParams(ignore_eos=np.False_).ignore_eos is False
    for bad in (2, "yes", 1.0, None):
        with pytest.raises(RequestError, match="ignore_eos must be true or false"):
            SamplingParams(ignore_eos=bad)


def test_options_the_cpu_ignores_are_named_in_a_warning(model_dir):
    lines = []
    LLM(model_dir, device="cpu", log=lines.append, enforce_eager=True, gpu_memory_utilization=0.5)
    assert ("warning: enforce_eager and gpu_memory_utilization apply to the GPU only; "
            "ignored on the CPU") in lines
    lines.clear()
    LLM(model_dir, device="cpu", log=lines.append, max_num_seqs=2)
    assert not [line for line in lines if line.startswith("warning:")]
    LLM(model_dir, device="cpu", log=None, enforce_eager=True)  # log None: silent


def test_steady_steps_build_what_a_rebuild_builds(model_dir):
    """In the engine's pipelined steps, a steady step (ScheduledBatch.follows) reads no
    sequence: its inputs and sampling rows come from the last step's by the diff. Each
    equals what a runner that never saw a step gathers from the sequences (their tokens
    still placeholders), and the samples equal those of a run with no steady step."""
    from types import MethodType

    from cupy_llama.engine.model_runner import ModelRunner
    from test_model_runner import FORWARD_FIELDS, assert_same_fields

    def run(steady: bool):
        llm = LLM(model_dir, device="cpu", log=None, max_num_seqs=6, block_size=4)
        engine, counts = llm.engine, {"steady": 0, "dropped": 0}
        runner = engine.runner
        if not steady:
            engine.scheduler._follow = lambda batch, last: None
        build, sampling = runner.build_batch, runner.sampling_tensors

        def fresh():
            other = ModelRunner(runner.config, runner.backend)
            other.slots.eos_token_ids = runner.slots.eos_token_ids
            return other

        def checked_build(self, batch):
            counts["steady"] += batch.follows is not None and batch.inputs_in_flight
            counts["dropped"] += bool(batch.dropped)
            forward = build(batch)
            assert_same_fields(forward, fresh().build_batch(batch), FORWARD_FIELDS)
            return forward

        def checked_sampling(self, batch):
            tensors = sampling(batch)
            expected = fresh().sampling_tensors(batch)
            assert_same_fields(tensors, expected, [n for n in vars(expected) if n != "resets"])
            return tensors

        runner.build_batch = MethodType(checked_build, runner)
        runner.sampling_tensors = MethodType(checked_sampling, runner)
        params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.8, seed=i, n=1 + i % 2,
                                 frequency_penalty=0.5 if i % 3 == 0 else 0.0,
                                 logit_bias={5: 2.0} if i % 4 == 1 else {}, ignore_eos=True)
                  for i in range(10)]
        outputs = llm.generate(prompts(10, seed=4), params)
        assert_all_blocks_free(llm)
        return [(o.request_id, o.index, o.token_ids) for o in outputs], counts

    with_steady, counts = run(True)
    assert counts["steady"] > 10 and counts["dropped"] > 0, counts
    assert with_steady == run(False)[0]


def count_steady_rows(engine, short: bool, used: dict, key: str) -> None:
    """Count in used[key] the steps whose rows the engine carries (its steady rows); with
    short False it carries none, so every row takes the long way."""
    steady_rows = engine._steady_rows

    def counted(last, batch):
        rows = steady_rows(last, batch) if short else None
        used[key] += rows is not None
        return rows

    engine._steady_rows = counted


def test_steady_rows_take_the_short_way_as_the_long_way_would(model_dir, monkeypatch):
    """A steady step's rows resolved with array tests (LLMEngine._finish_rows: the output
    limit, EOS, the samples that never take the short way) give the deltas and columns,
    step by step (in any order within a step), of a run where every row takes the long way through stop_status."""
    from cupy_llama.engine import llm_engine
    from cupy_llama.engine.output_processor import TokenColumns

    monkeypatch.setattr(llm_engine, "STEADY_ROWS_MIN", 1)  # every steady step, however small

    def run(short: bool):
        llm = LLM(model_dir, device="cpu", log=None, max_num_seqs=8, block_size=4)
        engine, used = llm.engine, {"steady": 0}
        count_steady_rows(engine, short, used, "steady")
        # a token in 29 is EOS: samples end now and then at EOS
        engine.eos_token_ids = set(range(3, engine.config.vocab_size, 29))
        for i, prompt in enumerate(prompts(12, seed=5)):
            params = SamplingParams(max_tokens=3 + 2 * i, temperature=1.0, seed=i,
                                    n=1 + i % 3 // 2, logprobs=1 if i % 5 == 2 else None,
                                    stop_token_ids=[7, 11] if i % 4 == 3 else [],
                                    ignore_eos=i % 6 == 5)
            engine.add_request(prompt, params, request_id=f"r{i}", stream=i % 3 != 1,
                               text=i % 2 == 0)
        steps = []
        for _ in range(500):
            if not engine.has_unfinished_requests():
                break
            columns = TokenColumns.empty()
            deltas = engine.step_deltas(columns)
            # (within a step, the rows taken the short way come first)
            steps.append((sorted((d[0], d[1], d[2], d[3], d[4], d[5] is None) for d in deltas),
                          sorted(zip(*columns))))
        assert not engine.has_unfinished_requests()
        assert_all_blocks_free(llm)
        return steps, used["steady"]

    with_short, used = run(True)
    assert used > 10, used
    assert with_short == run(False)[0]


def test_steady_rows_abort_and_time_their_samples_as_the_long_way_does(model_dir, monkeypatch):
    """While a steady step's rows carry a sample, its resolved and sent counts and its last
    token's time live in the rows' lanes (_Lanes): a sample aborted between steps, or
    whose sibling ends, drops its tokens still coming and reports what the long way
    reports, and every final delta's times are in order."""
    from cupy_llama.engine import llm_engine
    from cupy_llama.engine.output_processor import TokenColumns

    monkeypatch.setattr(llm_engine, "STEADY_ROWS_MIN", 1)

    def run(short: bool):
        llm = LLM(model_dir, device="cpu", log=None, max_num_seqs=8, block_size=4)
        engine, used = llm.engine, {"lanes": 0, "released": 0}
        count_steady_rows(engine, short, used, "lanes")
        for i, prompt in enumerate(prompts(8, seed=7)):
            params = SamplingParams(max_tokens=12 + 3 * i, temperature=1.0, seed=i,
                                    n=1 + i % 2, ignore_eos=True)
            engine.add_request(prompt, params, request_id=f"r{i}", stream=i % 3 != 1,
                               text=False)
        steps, times = [], []
        for step in range(500):
            if not engine.has_unfinished_requests():
                break
            deltas = []
            if step in (7, 9, 13):  # aborts between steps: a whole request, then samples
                deltas += engine.abort_deltas(f"r{step % 8}", None if step == 7 else 0)
            columns = TokenColumns.empty()
            deltas += engine.step_deltas(columns)
            steps.append((sorted((d[0], d[1], d[3], d[4]) for d in deltas),
                          sorted(zip(*columns))))
            times += [d[7] for d in deltas if d[4] is not None]
            if engine._in_flight is None or engine._in_flight.rows is None:
                # no rows carried on: every sample holds its own values again
                used["released"] += sum(1 for samples in engine.requests.values()
                                        for sample in samples if sample._lanes is None)
                assert all(sample._lanes is None for samples in engine.requests.values()
                           for sample in samples)
        assert not engine.has_unfinished_requests()
        assert_all_blocks_free(llm)
        return steps, times, used

    with_short, times, used = run(True)
    assert used["lanes"] > 10 and used["released"] > 0, used
    assert with_short == run(False)[0]
    assert sum(reason == "abort" for step, _ in with_short for *_, reason in step) == 4
    assert len(times) == 12, times
    for added, scheduled, first, last in times:  # (r7 is aborted before it is scheduled)
        assert (added <= scheduled <= first <= last if scheduled is not None
                else first is None and last is None), (added, scheduled, first, last)
    assert sum(scheduled is not None for _, scheduled, _, _ in times) == 10


@pytest.mark.parametrize("rows_min", [1, None])
def test_a_steady_step_caches_every_block_a_full_pass_would(model_dir, monkeypatch, rows_min):
    """A steady step scheduled without the pass offers the prefix cache only the blocks of
    the sequences that got a block (ScheduledBatch.grown); after each step, a pass over
    every sequence of the step (BlockManager.on_computed) finds nothing more to cache.
    rows_min 1: the steady steps' rows as arrays, the placeholders added in the
    scheduler's pass (update_after_step's placeholders)."""
    from cupy_llama.engine import llm_engine

    if rows_min is not None:
        monkeypatch.setattr(llm_engine, "STEADY_ROWS_MIN", rows_min)
    llm = LLM(model_dir, device="cpu", log=None, max_num_seqs=8, block_size=4)
    scheduler, blocks = llm.engine.scheduler, llm.engine.scheduler.blocks
    update, counts = scheduler.update_after_step, {"grown": 0, "cached": 0}

    def checked(batch, **placeholders):
        sampled = update(batch, **placeholders)
        settled = [seq.kv_hashes.num_settled for seq in batch.seqs]
        counts["grown"] += batch.grown is not None
        counts["cached"] += len(blocks.cached)
        blocks.on_computed(batch.seqs)
        assert [seq.kv_hashes.num_settled for seq in batch.seqs] == settled
        return sampled

    scheduler.update_after_step = checked
    params = [SamplingParams(max_tokens=10 + 3 * i, temperature=0.8, seed=i, n=1 + i % 2,
                             ignore_eos=True) for i in range(8)]
    llm.generate(prompts(8, seed=6), params)
    assert counts["grown"] > 10 and counts["cached"] > 0, counts
    assert_all_blocks_free(llm)
