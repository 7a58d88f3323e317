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


def test_ctrl_c_inside_the_engines_bookkeeping_leaves_nothing_behind(model_dir, monkeypatch):
    """Ctrl-C while a request is half registered (its first sample in the scheduler, the
    request not yet known) or in the middle of a step raises KeyboardInterrupt from
    generate() once the bookkeeping is whole: nothing is left running and every block is
    free, and the engine answers the next call as before."""
    import signal
    llm = LLM(model_dir, device="cpu", log=None)
    engine = llm.engine
    want = llm.generate([[1, 2, 3]], GREEDY)[0].token_ids
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=2)
    for target in ("scheduler.add", "runner.run"):
        owner_name, name = target.split(".")
        owner = getattr(engine, owner_name)
        original = getattr(owner, name)

        def interrupted(*args, **kwargs):
            monkeypatch.setattr(owner, name, original)  # once
            result = original(*args, **kwargs)
            signal.raise_signal(signal.SIGINT)  # Python's handler runs right after this line
            return result
        monkeypatch.setattr(owner, name, interrupted)
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[4, 5, 6], [7, 8]], params)
        assert getattr(owner, name) is original, f"{target} was not reached"
        assert not engine.has_unfinished_requests(), target
        assert engine.stats().num_free_blocks == engine.stats().num_blocks, target
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert llm.generate([[1, 2, 3]], GREEDY)[0].token_ids == want
    llm.close()


def test_ctrl_c_with_an_error_raises_the_error_and_a_second_ctrl_c_raises_at_once(model_dir,
                                                                                  monkeypatch):
    """A turn that gets Ctrl-C and then fails raises its error alone, and the interrupt
    does not outlive the call (the next call runs to its end); a second Ctrl-C in one turn
    raises at once, a way out of a turn that would not end."""
    import signal
    from cupy_llama.errors import RequestError
    llm = LLM(model_dir, device="cpu", log=None)
    engine = llm.engine
    want = llm.generate([[1, 2, 3]], GREEDY)[0].token_ids

    def refused(prompt):
        signal.raise_signal(signal.SIGINT)
        raise RequestError("refused")
    monkeypatch.setattr(engine, "encode_prompt", refused)
    with pytest.raises(RequestError, match="refused"):
        llm.generate([[4, 5, 6]], GREEDY)
    monkeypatch.undo()
    assert llm.generate([[1, 2, 3]], GREEDY)[0].token_ids == want  # no stale Ctrl-C
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    reached = []
    run = engine.runner.run

    def stuck(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)  # deferred
        signal.raise_signal(signal.SIGINT)  # raises here
        reached.append(True)
        return run(*args, **kwargs)
    monkeypatch.setattr(engine.runner, "run", stuck)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[4, 5, 6]], GREEDY)
    assert not reached
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    llm.close()
