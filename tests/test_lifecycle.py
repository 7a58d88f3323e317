"""An engine's lifetime: LLM.close() and `with LLM(...)`, and several engines made one after
another in one process (notebooks, tests and the server do that). On the GPU a closed or
dropped engine must hand its memory back to the device: CuPy caches freed blocks, and the
device's free-memory query does not count them."""
import gc

import pytest

from cupy_llama import LLM, SamplingParams
from cupy_llama.errors import RequestError

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_close_ends_the_engine_and_says_so(model_dir):
    llm = LLM(model_dir, device="cpu", log=None)
    want = llm.generate([1, 2, 3], GREEDY).token_ids
    stream = llm.stream([[4, 5]], GREEDY)
    next(stream)  # a request in flight when the engine closes
    llm.close()
    assert llm.closed
    for use in (lambda: llm.generate([1, 2, 3], GREEDY), lambda: llm.chat([{"role": "user", "content": "hi"}])):
        with pytest.raises(RequestError, match="closed; make a new one"):
            use()
    # the stream read on, and one made before close() and read only after it: the same
    # error, at once (its requests went with the engine)
    with pytest.raises(RequestError, match="closed; make a new one"):
        next(stream)
    llm.close()  # twice: nothing happens
    # a stream of several prompts closed between the outputs of one step: no stale one
    llm = LLM(model_dir, device="cpu", log=None)
    several = llm.stream([[4, 5], [6, 7], [8, 9]], GREEDY)
    next(several)
    llm.close()
    with pytest.raises(RequestError, match="closed; make a new one"):
        next(several)
    with LLM(model_dir, device="cpu", log=None) as again:
        unread = again.stream([[4, 5]], GREEDY)
    with pytest.raises(RequestError, match="closed; make a new one"):
        next(unread)
    with LLM(model_dir, device="cpu", log=None) as again:
        assert again.generate([1, 2, 3], GREEDY).token_ids == want
    assert again.closed


def test_engines_one_after_another_give_the_same_answers(model_dir):
    answers = []
    for _ in range(3):
        llm = LLM(model_dir, device="cpu", log=None, num_kv_blocks=64)
        answers.append(llm.generate([[7, 8, 9], [10]], GREEDY))
        del llm  # dropped, not closed
        gc.collect()
    assert [[o.token_ids for o in a] for a in answers] == [[o.token_ids for o in answers[0]]] * 3


def _gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs CuPy and a CUDA GPU")
def test_gpu_memory_comes_back_after_close_and_after_a_drop(model_dir):
    import cupy
    free_before, _ = cupy.cuda.runtime.memGetInfo()
    first = LLM(model_dir, device="cuda", log=None, gpu_memory_utilization=0.5)
    blocks = first.engine.blocks.num_blocks
    want = first.generate([1, 2, 3], GREEDY).token_ids
    first.close()
    free_after, _ = cupy.cuda.runtime.memGetInfo()
    assert free_after >= free_before - (256 << 20), "close() kept GPU memory"
    second = LLM(model_dir, device="cuda", log=None, gpu_memory_utilization=0.5)
    assert second.engine.blocks.num_blocks >= 0.95 * blocks
    assert second.generate([1, 2, 3], GREEDY).token_ids == want
    del second  # dropped without close: the next engine still finds the memory
    third = LLM(model_dir, device="cuda", log=None, gpu_memory_utilization=0.5)
    assert third.engine.blocks.num_blocks >= 0.95 * blocks
    assert third.generate([1, 2, 3], GREEDY).token_ids == want
    third.close()
