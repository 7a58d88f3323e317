"""The engine's output path without a model: the stop function, stop-string matching, the
per-sample text deltas and the output accumulator, against independent references."""
import pickle
import random
from dataclasses import replace

import pytest

from cupy_llama.engine.llm_engine import _Sample
from cupy_llama.engine.output_processor import (DetokenizedSample, EngineDelta,
                                                OutputAccumulator, TokenColumns, find_stop,
                                                output_limit, stop_status)
from cupy_llama.engine.sequence import Sequence, SequenceStatus
from cupy_llama.outputs import TokenLogprob
from cupy_llama.sampling import SamplingParams

STOPPED, LENGTH = SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH


def test_stop_status_decides_eos_and_lengths():
    params = SamplingParams(max_tokens=5)
    eos = {2, 7}
    assert stop_status(params, 3, 1, 11, eos, 100) == (None, None)
    assert stop_status(params, 7, 1, 11, eos, 100) == (STOPPED, None)
    assert stop_status(params, 3, 5, 15, eos, 100) == (LENGTH, None)    # max_tokens
    assert stop_status(params, 3, 2, 100, eos, 100) == (LENGTH, None)   # the context limit
    assert stop_status(params, 2, 5, 100, eos, 100) == (STOPPED, None)  # EOS says why, not length
    ignoring = SamplingParams(max_tokens=5, ignore_eos=True)
    assert stop_status(ignoring, 7, 1, 11, eos, 100) == (None, None)
    # a token not known yet (its step launching): only the lengths decide
    assert stop_status(params, None, 4, 14, eos, 100) == (None, None)
    assert stop_status(params, None, 5, 15, eos, 100) == (LENGTH, None)


def test_stop_status_names_the_stop_token_as_vllm_does():
    """vLLM's check_stop: a stop token is the stop reason, EOS is none; EOS is checked
    first, so a token that is both has none, unless the request ignores EOS. Before
    min_tokens neither stops; at max_tokens a stop token still says why."""
    eos = {2, 7}
    stops = SamplingParams(max_tokens=5, stop_token_ids=[4, 7])
    assert stop_status(stops, 4, 1, 11, eos, 100) == (STOPPED, 4)
    assert stop_status(stops, 4, 5, 15, eos, 100) == (STOPPED, 4)
    assert stop_status(stops, 7, 1, 11, eos, 100) == (STOPPED, None)  # EOS and a stop token
    assert stop_status(stops, 2, 1, 11, eos, 100) == (STOPPED, None)
    ignoring = SamplingParams(max_tokens=5, stop_token_ids=[4, 7], ignore_eos=True)
    assert stop_status(ignoring, 7, 1, 11, eos, 100) == (STOPPED, 7)
    assert stop_status(ignoring, 2, 1, 11, eos, 100) == (None, None)
    held = SamplingParams(max_tokens=5, stop_token_ids=[4], min_tokens=2)
    assert stop_status(held, 4, 2, 12, eos, 100) == (None, None)
    assert stop_status(held, 4, 3, 13, eos, 100) == (STOPPED, 4)


def test_output_limit_is_stop_status_length_rule():
    """The engine checks a sequence's lengths as num_output_tokens >= output_limit (at
    launch, and before its short way at the token): the same as stop_status's lengths."""
    rng = random.Random(1)
    for _ in range(3000):
        max_tokens = rng.randint(1, 40)
        params = SamplingParams(max_tokens=max_tokens, min_tokens=rng.choice([0, min(3, max_tokens)]),
                                ignore_eos=rng.random() < 0.5,
                                stop_token_ids=rng.choice([[], [5], [4, 9]]))
        num_prompt, context_limit = rng.randint(1, 60), rng.randint(2, 100)
        num_outputs = rng.randint(1, 70)
        limit = output_limit(params, num_prompt, context_limit)
        token = rng.choice([None, 1, 2, 4, 5, 9])
        status, _ = stop_status(params, token, num_outputs, num_prompt + num_outputs, {2, 7},
                                context_limit)
        if token is None:
            assert (status is LENGTH) == (num_outputs >= limit)
        if num_outputs >= limit:
            assert status is not None
        elif token not in {2, 7, 4, 5, 9}:  # the engine's short way: nothing ends it
            assert status is None


def test_find_stop_is_the_earliest_match_ending_in_the_new_text():
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 12)))
        old = rng.randint(0, len(text))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 3)))
                 for _ in range(rng.randint(1, 3))]
        # brute force: every start of every stop string whose match ends past `old`
        starts = [i for s in stops for i in range(len(text) - len(s) + 1)
                  if text.startswith(s, i) and i + len(s) > old]
        assert find_stop(text, stops, old) == (min(starts) if starts else None), \
            (text, old, stops)
    assert find_stop("abc", [], 0) is None


class CharTokenizer:
    """Token i is the letter chr(97 + i % 26); ids from 26 on are two letters."""
    vocab_size = 60
    eos_token_ids = ()

    def decode_unchecked(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) * (1 + (i >= 26)) for i in ids)

    def text_context(self, prompt_ids):
        return []  # a decode drops no space


def run_sample(token_ids, stops, stream=True, min_tokens=0):
    """Feed tokens to a sample as the engine does; its deltas and where it stopped."""
    seq = Sequence("r", [1], SamplingParams(max_tokens=100, stop=stops, min_tokens=min_tokens),
                   0, 0)
    sample = _Sample(seq, CharTokenizer(), stream, text=True)
    deltas = []
    for index, token_id in enumerate(token_ids):
        seq.output_token_ids.append(token_id)
        sample.num_resolved = index + 1
        stopped = sample.text.incremental and sample.text.add(token_id)
        if stopped or index == len(token_ids) - 1:
            if not stopped:
                sample.finish_text(last_is_eos=False)
            sample.finish_reason = "stop" if stopped else "length"
            deltas.append(sample.delta())
            return deltas, index if stopped else None
        if stream:
            deltas.append(sample.delta())
    return deltas, None


def test_a_stop_string_counts_only_past_min_tokens():
    """As EOS and stop tokens: min_tokens 1 with a stop string that the first token spells
    gives that token's text, never an empty one (vLLM's rule); the tokens held off count
    whether or not they have text (an id past the tokenizer's vocabulary has none)."""
    for min_tokens, stop_at, text in ((0, 0, ""), (1, 1, "a"), (2, 2, "aa"), (3, None, "aaa")):
        deltas, stopped_at = run_sample([0, 0, 0], ["a"], min_tokens=min_tokens)
        assert stopped_at == stop_at
        assert "".join(d.text for d in deltas) == text
    deltas, stopped_at = run_sample([CharTokenizer.vocab_size, 0, 0], ["a"], min_tokens=1)
    assert stopped_at == 1 and "".join(d.text for d in deltas) == ""


def test_streamed_text_never_shows_part_of_a_stop_string():
    rng = random.Random(1)
    tokenizer = CharTokenizer()
    for _ in range(500):
        token_ids = [rng.randrange(0, 30) for _ in range(rng.randint(1, 25))]
        stops = ["".join(rng.choice("abcd") for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 2))]
        deltas, stopped_at = run_sample(token_ids, stops)
        # reference: the first token after which some stop string is in the text; the
        # text then ends where the earliest one starts
        completing, expected_text = len(token_ids) - 1, None
        for k in range(len(token_ids)):
            text = tokenizer.decode_unchecked(token_ids[:k + 1])
            starts = [text.find(s) for s in stops if s in text]
            if starts:
                completing, expected_text = k, text[:min(starts)]
                break
        if expected_text is None:
            expected_text = tokenizer.decode_unchecked(token_ids)
            assert stopped_at is None
        else:
            assert stopped_at == completing
        sent = ""
        for delta in deltas[:-1]:
            sent += delta.text
            assert expected_text.startswith(sent)  # nothing shown is taken back
        assert sent + deltas[-1].text == expected_text, (token_ids, stops)
        assert [t for d in deltas for t in d.token_ids] == token_ids[:completing + 1]


def test_a_sample_not_streamed_sends_one_delta():
    deltas, _ = run_sample([3, 4, 5, 30], [], stream=False)
    [delta] = deltas
    assert delta.text == "defee" and delta.token_ids == [3, 4, 5, 30]
    assert delta.finish_reason == "length"


def detokenized(stops=(), stream=True, eos=(), **params):
    """A DetokenizedSample over CharTokenizer, as serve's server process keeps one."""
    return DetokenizedSample(CharTokenizer(), SamplingParams(max_tokens=100, stop=list(stops),
                                                             **params), stream, eos)


def test_the_server_process_names_the_stop_string_it_finds():
    """serve's split: a stop string found in the server process is the final delta's
    stop_reason, whether the token came alone (TokenColumns) or in a delta, with or
    without the stop string in the text; min_tokens holds it off as in the engine."""
    for include, text in ((False, "ab"), (True, "abcd")):
        sample = detokenized(["zz", "cd"], include_stop_str_in_output=include)
        deltas = [sample.process_token("r", 0, token)[0] for token in (0, 1, 2, 3)]
        assert [d.stop_reason for d in deltas] == [None, None, None, "cd"]
        assert deltas[-1].finish_reason == "stop" and "".join(d.text for d in deltas) == text
        assert sample.process_token("r", 0, 4) == (None, False)  # it has ended here
        sample = detokenized(["zz", "cd"], include_stop_str_in_output=include)
        delta, stopped = sample.process(EngineDelta("r", 0, "", [0, 1, 2, 3, 4], None))
        assert stopped and delta.token_ids == [0, 1, 2, 3] and delta.text == text
        assert (delta.finish_reason, delta.stop_reason) == ("stop", "cd")
    # min_tokens: the first "a" comes too early; "ab", which ends past it, is the reason
    sample = detokenized(["a", "ab"], min_tokens=1)
    first, _ = sample.process_token("r", 0, 0)
    last, stopped = sample.process_token("r", 0, 1)
    assert stopped and first.stop_reason is None and last.stop_reason == "ab"
    assert first.text + last.text == ""
    sample = detokenized(["a", "ab"], min_tokens=1, include_stop_str_in_output=True)
    delta, _ = sample.process(EngineDelta("r", 0, "", [0, 1, 2], None))
    assert (delta.text, delta.stop_reason) == ("ab", "ab")


def test_a_stop_string_before_the_engine_s_end_wins():
    """The engine sends token ids only and goes on past a stop string until it is told:
    its final delta (a stop token's, or length's) may already hold tokens after the stop
    string. The server's reason is the string, and the tokens after it are dropped; the
    engine, which has ended the sample, is not told to stop it, and its times stand."""
    for finish, reason in (("stop", 9), ("length", None)):
        sample = detokenized(["cd"], stream=False, stop_token_ids=[9])
        times = (1.0, 2.0, 3.0, 4.0)
        delta, stopped = sample.process(EngineDelta("r", 0, "", [0, 2, 3, 4, 9], finish,
                                                    None, 0, times, stop_reason=reason))
        assert not stopped and delta.times == times
        assert delta.token_ids == [0, 2, 3] and delta.text == "a"
        assert (delta.finish_reason, delta.stop_reason) == ("stop", "cd")


def test_the_engine_s_stop_reason_passes_through_the_server_process():
    """What the engine decided (stop_status) reaches the client as it said it: a stop
    token's id, none for EOS (even one that is a stop token too) or for length, none on
    a delta that is not the last."""
    cases = [  # (params, final delta's tokens, finish reason, the engine's stop reason)
        (dict(stop_token_ids=[9]), [0, 1, 9], "stop", 9),
        (dict(stop_token_ids=[9], include_stop_str_in_output=True), [0, 1, 9], "stop", 9),
        (dict(), [0, 1, 7], "stop", None),                     # EOS
        (dict(stop_token_ids=[7]), [0, 1, 7], "stop", None),   # EOS and a stop token
        (dict(stop_token_ids=[9]), [0, 1, 2], "length", None),
        (dict(stop_token_ids=[9]), [0, 1], "abort", None),
    ]
    for stream in (False, True):
        for stops in ((), ("zz",)):
            for params, token_ids, finish, reason in cases:
                sample = detokenized(stops, stream, eos=(7,), **params)
                if stream:
                    delta, _ = sample.process(EngineDelta("r", 0, "", [5], None))
                    assert delta.stop_reason is None
                delta, stopped = sample.process(EngineDelta("r", 0, "", token_ids, finish,
                                                            stop_reason=reason))
                assert not stopped and delta.finish_reason == finish
                assert delta.stop_reason == reason and type(delta.stop_reason) is type(reason)


def test_a_kept_stop_token_is_matched_for_stop_strings():
    """A token that ends the sample in the engine (EOS, a stop token) and would complete
    a stop string: its text is dropped, and the engine's reason stands (its id, or none
    for EOS); with include_stop_str_in_output its text is kept and matched as vLLM's
    detokenizer matches it, so the stop string is the reason and the text ends with it."""
    for include, text, string in ((False, "ab", False), (True, "abc", True)):
        for params, reason in ((dict(stop_token_ids=[2]), 2), (dict(), None)):  # c; EOS
            for stream in (False, True):
                sample = detokenized(["bc"], stream, eos=(2,), include_stop_str_in_output=include,
                                     **params)
                delta, stopped = sample.process(EngineDelta("r", 0, "", [0, 1, 2], "stop",
                                                            stop_reason=reason))
                assert not stopped and delta.token_ids == [0, 1, 2]  # the engine has ended it
                assert (delta.finish_reason, delta.stop_reason, delta.text) == \
                    ("stop", "bc" if string else reason, text), (include, params, stream)
    # a kept stop token whose text completes no stop string leaves the engine's reason
    sample = detokenized(["cx"], stop_token_ids=[2], include_stop_str_in_output=True)
    delta, stopped = sample.process(EngineDelta("r", 0, "", [0, 1, 2], "stop", stop_reason=2))
    assert not stopped and (delta.stop_reason, delta.text) == (2, "abc")
    # a token the engine did not stop at (ignore_eos) is matched as any, and the engine
    # that goes on is to be told
    sample = detokenized(["bc"], eos=(2,), ignore_eos=True, include_stop_str_in_output=True)
    delta, stopped = sample.process(EngineDelta("r", 0, "", [0, 1, 2], None))
    assert stopped and (delta.stop_reason, delta.text) == ("bc", "abc")


def test_engine_deltas_travel_as_plain_tuples():
    delta = EngineDelta("r1", 2, "hi", [5, 6], "stop", [(5, -0.1, [])], 3, (1.0, 2.0, 3.0, 4.0),
                        stop_reason=6)
    assert (delta.request_id, delta.index, delta.text, delta.token_ids) == ("r1", 2, "hi", [5, 6])
    assert delta.finished and delta.num_cached_tokens == 3 and delta.times[3] == 4.0
    wire = pickle.loads(pickle.dumps(tuple(delta)))
    assert type(wire) is tuple
    assert EngineDelta.of(wire) == delta and EngineDelta.of(wire).finish_reason == "stop"
    assert EngineDelta.of(wire).stop_reason == 6
    assert EngineDelta("r1", 0, "", []).stop_reason is None  # the default: every other delta


def test_the_accumulator_makes_cumulative_outputs():
    outputs = OutputAccumulator()
    outputs.add("a", [1, 2], n=2)
    rng = random.Random(2)
    expected = {0: ([], ""), 1: ([], "")}
    finished = set()
    seen = []
    while len(finished) < 2:
        index = rng.randrange(2)
        if index in finished:
            continue
        new = [rng.randrange(100) for _ in range(rng.randint(0, 3))]
        text = "".join(rng.choice("xyz") for _ in range(rng.randint(0, 3)))
        end = rng.random() < 0.2
        logprobs = [(t, -1.0 * t, [(t, -1.0 * t)]) for t in new]
        delta = EngineDelta("a", index, text, new, "length" if end else None, logprobs, 4,
                            (1.0, 2.0, 3.0, 4.0) if end else None)
        [output] = outputs.process([delta, EngineDelta("unknown", 0, "x", [1])])
        tokens, full = expected[index]
        expected[index] = (tokens + new, full + text)
        assert output.token_ids == tokens + new and output.text == full + text
        assert output.delta == text and output.delta_token_ids == new
        assert output.prompt_token_ids == [1, 2] and output.index == index
        assert output.num_cached_tokens == 4
        assert output.logprobs == [TokenLogprob(t, -1.0 * t, [(t, -1.0 * t)])
                                   for t in tokens + new]
        seen.append(output)
        if end:
            finished.add(index)
            assert output.finished and output.times.last_token == 4.0
            assert ("a" in outputs) == (len(finished) < 2)
        else:
            assert output.times is None
    # outputs handed out earlier are not changed by later ones
    assert all(len(o.token_ids) <= len(expected[o.index][0]) for o in seen)
    assert outputs.process([EngineDelta("a", 0, "late", [9], "stop")]) == []


class _Sink:
    def __init__(self):
        self.items = []

    def put(self, item):
        self.items.append(item)


@pytest.mark.parametrize("columns", [False, True], ids=["deltas", "columns"])
def test_text_made_in_the_server_process_is_the_engines(llm, columns):
    """serve's split: the engine sends token ids only, the server process makes the text
    and ends samples at their stop strings. Its outputs equal the engine's own. columns:
    the steps' one-token deltas go as TokenColumns, in the engine loop's pickled message."""
    from conftest import assert_all_blocks_free

    from cupy_llama.engine.async_engine import AsyncEngine, EngineInfo, _EngineLoop
    engine = llm.engine
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 30))] for _ in range(6)]
    plain = [llm.generate(p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)).text
             for p in prompts]
    params = []
    for i, text in enumerate(plain):
        stop = next((text[j:j + 2] for j in range(2 + i, len(text) - 2)
                     if "\ufffd" not in text[j:j + 2]), "zz")
        params.append(SamplingParams(
            max_tokens=30, temperature=0 if i % 2 else 0.8, seed=i, ignore_eos=True, n=1 + i % 2,
            logprobs=1 if i % 3 == 0 else None, stop=[stop, "never here"] if i % 2 else []))
    # request 0 ends at an EOS token that has text (it is not shown)
    free = llm.generate(prompts[0], SamplingParams(max_tokens=30, temperature=0,
                                                   ignore_eos=True)).token_ids
    eos = next(t for t in free[4:] if t < 256 and t not in free[:4])
    params[0] = SamplingParams(max_tokens=30, temperature=0)
    # request 2 ends at a stop token (its stop reason), request 4 at one that is EOS too
    # (none: EOS comes first)
    for i, eos_too in ((2, False), (4, True)):
        drawn = llm.generate(prompts[i], params[i]).token_ids
        token = next(t for t in drawn[3:] if t not in drawn[:3])
        params[i] = replace(params[i], stop_token_ids=[token])
        if eos_too:
            params[i] = replace(params[i], ignore_eos=False)
            eos_and_stop = token
    streams = [i % 3 != 1 for i in range(len(prompts))]
    expected = {}
    engine.eos_token_ids.update((eos, eos_and_stop))
    for i, (prompt, sampling) in enumerate(zip(prompts, params)):
        for output in llm.generate([prompt], sampling):
            expected[str(i), output.index] = output
    assert expected["0", 0].token_ids[-1] == eos and expected["0", 0].finish_reason == "stop"
    assert expected["2", 0].stop_reason == params[2].stop_token_ids[0]
    assert (expected["4", 0].finish_reason, expected["4", 0].stop_reason) == ("stop", None)
    assert expected["4", 0].token_ids[-1] == eos_and_stop

    sent = []
    server = AsyncEngine("unused", "cpu", {}, tokenizer=engine.tokenizer)
    server._send = sent.append
    # what the engine process reports when it is ready: the EOS tokens, whose text is not shown
    server.info = EngineInfo(device="cpu", context_limit=engine.context_limit, num_blocks=1,
                             block_size=1, max_num_seqs=1, load_seconds=0.0, pid=0,
                             eos_token_ids=tuple(sorted(engine.eos_token_ids)))
    sinks = {}
    num_column_entries = 0
    accumulator, engine.outputs = engine.outputs, None  # the deltas come out as they are
    try:
        for i, (prompt, sampling) in enumerate(zip(prompts, params)):
            sinks[str(i)] = _Sink()
            server.add(str(i), prompt, sampling, streams[i], sinks[str(i)])
        for _, request_id, prompt, sampling, stream, text in sent:
            assert text is False
            engine.add_request(prompt, sampling, request_id=request_id, stream=stream, text=text)
        sent.clear()
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            deltas = []
            for message in sent:  # the samples the server ended at a stop string
                assert message[0] == "abort" and len(message) == 3
                deltas += engine.abort_deltas(*message[1:])
            sent.clear()
            if not columns:
                deltas += engine.step_deltas()
                server._on_message(("out", [tuple(d) for d in deltas], [], {}))
                continue
            step_columns = TokenColumns.empty()
            deltas += engine.step_deltas(step_columns)
            num_column_entries += len(step_columns.request_ids)
            message = _EngineLoop(engine, None).step_message(deltas, [], step_columns)
            server._on_message(pickle.loads(pickle.dumps(message)))
    finally:
        engine.outputs = accumulator
        engine.eos_token_ids.difference_update((eos, eos_and_stop))
    assert not server._streams and not server._texts
    assert (num_column_entries > 0) == columns
    for (request_id, index), output in expected.items():
        mine = [d for d in sinks[request_id].items if d.index == index]
        assert [d.finish_reason for d in mine[:-1]] == [None] * (len(mine) - 1)
        if not streams[int(request_id)] and not params[int(request_id)].stop:
            assert len(mine) == 1  # not streamed: one delta at the end
        assert mine[-1].finish_reason == output.finish_reason
        assert [d.stop_reason for d in mine] == [None] * (len(mine) - 1) + [output.stop_reason]
        # the engine's, or for a sample a stop string ended in the server process, those
        # that came with its first tokens and the time it ended there
        added, scheduled, first, last = mine[-1].times
        assert added is not None and scheduled >= added and last >= first >= scheduled
        assert "".join(d.text for d in mine) == output.text, (request_id, index)
        assert [t for d in mine for t in d.token_ids] == output.token_ids
        if output.logprobs is not None:
            assert [entry[0] for d in mine for entry in d.logprobs] == output.token_ids
    assert {type(o.stop_reason) for o in expected.values()} == {type(None), str, int}
    assert_all_blocks_free(llm)


def test_an_engine_going_idle_reports_its_last_turn(llm):
    """The counters go out with each step's output, before that turn's loop time is
    added; as the engine goes idle it sends them once more, so /metrics ends with every
    turn's time (a one-step request's loop time covering its step)."""
    from conftest import ScriptedChannel

    from cupy_llama.engine import async_engine
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    channel = ScriptedChannel([[("add", "one", [5, 6, 7], params, False, True)]])
    loop = async_engine._EngineLoop(llm.engine, channel)
    try:
        loop.run()
    finally:
        llm.engine.outputs = None
    last = channel.sent[-1]
    assert last[0] == "out" and last[1] == [] and last[2] == []
    assert last[3]["loop_seconds"] == loop.loop_seconds > 0
    assert 0 < last[3]["step_seconds"] <= last[3]["loop_seconds"]
    assert [d for message in channel.sent for d in message[1]][0][4] == "length"


def test_a_stepping_engine_says_so_without_output(llm, monkeypatch):
    """A request that is not streamed has no output until it ends; the engine loop still
    sends a message at least every PROGRESS_EVERY_S while it steps, since the server's
    stall watch (--engine-timeout) counts from the last one. Here every step's, and one
    more as it goes idle."""
    from conftest import ScriptedChannel

    from cupy_llama.engine import async_engine
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for every, least, most in ((0.0, 13, 14), (3600.0, 2, 3)):
        monkeypatch.setattr(async_engine, "PROGRESS_EVERY_S", every)
        channel = ScriptedChannel([[("add", "quiet", [5, 6, 7], params, False, True)]])
        try:
            async_engine._EngineLoop(llm.engine, channel).run()
        finally:
            llm.engine.outputs = None
        assert least <= len(channel.sent) <= most, (every, len(channel.sent))
        finals = [d for message in channel.sent for d in message[1]]
        assert len(finals) == 1 and len(finals[0][3]) == 12  # the one delta, at the end
        assert all(message[0] == "out" for message in channel.sent)
