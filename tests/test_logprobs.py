"""Log-probabilities of generated tokens on the NumPy backend: the raw log-softmax of the
model's logits at each generated position (checked against a forward pass of the whole
sequence, float64), the top k sorted and holding the chosen token when it ranks within k;
through sampling, batching, preemption and streaming."""
import numpy as np
import pytest

from cupy_llama import LLM, SamplingParams
from cupy_llama.interface import ForwardBatch
from cupy_llama.errors import RequestError
from cupy_llama.util import cdiv

PROMPT = [5, 17, 99, 3, 250, 41, 7]


def reference_log_softmax(llm, tokens: list[int], num_prompt: int) -> np.ndarray:
    """[len(tokens) - num_prompt, V] float64: the log-softmax after each prefix tokens[:p],
    p = num_prompt .. len(tokens) - 1, from ONE forward pass in which each of those
    positions is the last token of its own query range (one shared block table)."""
    n = len(tokens) - 1  # the last token's logits are not needed
    backend = llm.backend
    block_size = backend.block_size
    table = np.arange(cdiv(n, block_size), dtype=np.int32)
    positions = np.arange(n, dtype=np.int32)
    ends = np.arange(num_prompt, n + 1, dtype=np.int32)  # query ranges end after these
    batch = ForwardBatch(
        token_ids=np.array(tokens[:n], np.int32), positions=positions,
        slot_mapping=(table[positions // block_size] * block_size + positions % block_size).astype(np.int32),
        query_start_loc=np.concatenate([[0], ends]).astype(np.int32), seq_lens=ends,
        block_tables=np.repeat(table[None], len(ends), axis=0),
        max_query_len=int(np.diff(np.concatenate([[0], ends])).max()), max_seq_len=n)
    logits = backend.model.forward(backend, batch).astype(np.float64)
    llm.engine.blocks.reset_prefix_cache()  # blocks 0 .. n now hold these tokens' K/V
    return logits - (logits.max(1, keepdims=True)
                     + np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)))


def check_against_reference(llm, out, k):
    expected = reference_log_softmax(llm, PROMPT + out.token_ids, len(PROMPT))
    assert len(out.logprobs) == len(out.token_ids)
    for position, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = expected[position]
        assert entry.token_id == token
        assert abs(entry.logprob - row[token]) < 1e-4, (position, entry.logprob, row[token])
        assert len(entry.top) == k
        values = [value for _, value in entry.top]
        assert values == sorted(values, reverse=True)
        best = np.argsort(-row, kind="stable")[:k]
        assert [i for i, _ in entry.top] == best.tolist()
        assert np.allclose(values, row[best], atol=1e-4)
        if np.sum(row > row[token]) < k:  # the chosen token ranks within k
            assert token in [i for i, _ in entry.top]


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_greedy_logprobs_are_the_log_softmax(llm, k):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                              logprobs=k))
    check_against_reference(llm, out, k)
    assert out.logprobs[0].token_id == out.logprobs[0].top[0][0] if k else True


def test_sampled_logprobs_are_before_temperature_and_filters(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=1.7, top_k=30, max_tokens=12,
                                              ignore_eos=True, seed=3, logprobs=4))
    check_against_reference(llm, out, 4)


def test_logprobs_do_not_depend_on_the_batch_or_preemption(model_dir, llm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    alone = llm.generate(PROMPT, params)
    small = LLM(model_dir, device="cpu", log=None, num_kv_blocks=12, block_size=16)
    others = [[i + 1] * (20 + i) for i in range(6)]
    together = small.generate(others + [PROMPT], [SamplingParams(temperature=0, max_tokens=40,
                                                                 ignore_eos=True)] * 6 + [params])
    assert small.engine.scheduler.num_preemptions > 0
    mine = together[-1]
    assert mine.token_ids == alone.token_ids
    for a, b in zip(mine.logprobs, alone.logprobs):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-5
        assert [i for i, _ in a.top] == [i for i, _ in b.top]
    assert all(o.logprobs is None for o in together[:-1])


def test_streamed_deltas_carry_their_logprobs(llm):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    whole = llm.generate(PROMPT, params)
    seen = []
    for output in llm.stream([PROMPT], params):
        assert len(output.logprobs) == len(output.token_ids)
        seen += output.logprobs[len(output.token_ids) - len(output.delta_token_ids):]
    assert [e.token_id for e in seen] == whole.token_ids
    assert [e.logprob for e in seen] == [e.logprob for e in whole.logprobs]


def test_no_logprobs_unless_asked_and_bad_values_are_refused(llm):
    assert llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3)).logprobs is None
    for bad in (-1, 21, 2.5, True, "3"):
        with pytest.raises(RequestError, match="logprobs must be an integer in \\[0, 20\\]"):
            SamplingParams(logprobs=bad)
    assert SamplingParams(logprobs=np.int64(3)).logprobs == 3
