"""The server's application in the test process, with the engine process replaced by the
test's own LLM (a real LLMEngine, stepped on the event loop): requests go through
httpx.ASGITransport, so no port, no subprocess and no model load per test."""
import asyncio
from dataclasses import dataclass

import httpx

from cupy_llama.models import read_config
from cupy_llama.engine.async_engine import ENGINE_STOPPED, EngineInfo, Rejected, _as_delta
from cupy_llama.engine.output_processor import EngineDelta
from cupy_llama.errors import RequestError
from cupy_llama.server.app import ServerSettings, ServerState, create_app
from cupy_llama.tokenizer import Tokenizer


class LocalEngine:
    """AsyncEngine's interface over an LLM in this process. stepping=False: the engine
    takes requests and never steps (a hung device); instant=True: each sample ends at once
    with two tokens, without running the model (for fuzzing what surrounds it)."""

    def __init__(self, llm, stepping: bool = True, instant: bool = False):
        self.llm = llm
        self.stepping = stepping
        self.instant = instant
        self.info = None
        self.stats: dict = {}
        self.num_waiting = 0
        self.generated_tokens = 0
        self.sinks: dict = {}
        self.killed = False
        self.stalled = 0.0  # what stalled_for() says
        self.on_stopped = None
        self._pump = None

    async def start(self) -> EngineInfo:
        engine = self.llm.engine
        self.info = EngineInfo(device="cpu", context_limit=engine.context_limit,
                               num_blocks=engine.stats().num_blocks,
                               block_size=engine.backend.block_size,
                               max_num_seqs=engine.engine_config.max_num_seqs,
                               load_seconds=0.0, pid=0)
        return self.info

    async def close(self) -> None:
        pass

    def num_would_wait(self, new_seqs: int) -> int:
        return 0

    def stalled_for(self) -> float:
        return self.stalled

    def kill(self) -> None:
        self.killed = True
        for sink in self.sinks.values():
            sink.put(ENGINE_STOPPED)
        self.sinks.clear()
        if self.on_stopped is not None:
            self.on_stopped()

    def add(self, request_id, prompt, params, stream, sink) -> None:
        if self.instant:
            top = [(1, -0.5), (2, -1.5)][:params.logprobs or 0]
            logprobs = None if params.logprobs is None else [(1, -0.5, top), (2, -1.5, top)]
            for index in range(params.n):
                sink.put(EngineDelta(request_id, index, "ab", [1, 2], "length", logprobs))
            self.generated_tokens += 2 * params.n
            return
        try:
            self.llm.engine.add_request(prompt, params, request_id=request_id, stream=stream)
        except RequestError as e:
            sink.put(Rejected(request_id, str(e)))
            return
        self.sinks[request_id] = sink
        if self.stepping and (self._pump is None or self._pump.done()):
            self._pump = asyncio.get_running_loop().create_task(self._step_all())

    def abort(self, request_id) -> None:
        for output in self.llm.engine.abort(request_id):
            self._deliver(output)

    def _deliver(self, output) -> None:
        self.generated_tokens += len(output.delta_token_ids)
        sink = self.sinks.get(output.request_id)
        if sink is not None:
            sink.put(_as_delta(output))

    async def _step_all(self) -> None:
        engine = self.llm.engine
        while engine.has_unfinished_requests():
            for output in engine.step():
                self._deliver(output)
            self.stats = {"num_steps": engine.stats().num_steps}
            await asyncio.sleep(0)


def make_state(model_dir, llm=None, stepping: bool = True, instant: bool = False,
               **settings) -> ServerState:
    """A ServerState serving "m" from model_dir; llm: the engine's (LocalEngine)."""
    config = read_config(model_dir)
    state = ServerState(ServerSettings(model_dir=str(model_dir), served_model_name="m",
                                       device="cpu", **settings),
                        Tokenizer.from_dir(model_dir, config), config)
    if llm is not None:
        state.engine = LocalEngine(llm, stepping, instant)
        state.engine.on_stopped = state._engine_stopped
    return state


@dataclass
class Answer:
    status: int
    headers: httpx.Headers
    body: bytes

    def json(self):
        import json
        return json.loads(self.body)

    def events(self) -> list:
        """A streamed answer's events; the last must be [DONE]."""
        import json
        data = [line[len(b"data: "):] for line in self.body.split(b"\n") if line]
        assert data and data[-1] == b"[DONE]", self.body[-300:]
        return [json.loads(d) for d in data[:-1]]


def with_app(state: ServerState, work, load: bool = True):
    """Run `await work(transport)` in one event loop, transport an httpx.ASGITransport over
    the app (after state.load() when load is set); what it returns. Clients of any kind
    (httpx, openai, LangChain) take the transport as their HTTP client's."""
    async def go():
        state.loop = asyncio.get_running_loop()
        if load and state.info is None:
            await state.load()
        transport = httpx.ASGITransport(app=create_app(state), raise_app_exceptions=False)
        try:
            return await work(transport)
        finally:
            if state._watchdog is not None:
                state._watchdog.cancel()
    return asyncio.run(go())


def ask(state: ServerState, requests, load: bool = True) -> list[Answer]:
    """Send (method, path, kwargs) requests to the app one after another, in one event loop
    (after state.load() when load is set); their answers, whole."""
    async def work(transport):
        answers = []
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            for method, path, kwargs in requests:
                response = await client.request(method, path, **kwargs)
                answers.append(Answer(response.status_code, response.headers,
                                      await response.aread()))
        return answers
    return with_app(state, work, load)


def ask_one(state, method, path, **kwargs) -> Answer:
    return ask(state, [(method, path, kwargs)])[0]
