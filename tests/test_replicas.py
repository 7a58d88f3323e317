"""`cupy-llama serve` as one replica of several behind a load balancer: every response names
its replica (x-served-by), and after SIGTERM /health fails while requests are still
served."""
import asyncio
import socket

import httpx
from conftest import one_error_line

from cupy_llama.cli import main
from cupy_llama.config import ModelConfig
from cupy_llama.engine.async_engine import EngineInfo
from cupy_llama.server.app import ServerSettings, ServerState, create_app
from cupy_llama.tokenizer import Tokenizer


# ---- the application in this process (no engine process is started) ------------------------

def _state(model_dir, **settings) -> ServerState:
    config = ModelConfig.from_dir(model_dir)
    return ServerState(ServerSettings(model_dir=str(model_dir), served_model_name="m",
                                      device="cpu", **settings),
                       Tokenizer.from_dir(model_dir, config), config)


def _request(state, method, path, **kwargs) -> httpx.Response:
    async def go():
        # no lifespan runs: no engine; an app's own exception comes back as its 500
        transport = httpx.ASGITransport(app=create_app(state), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.request(method, path, **kwargs)
    return asyncio.run(go())


def test_every_response_names_the_replica(model_dir):
    state = _state(model_dir, replica_name="gpu-host-3:8001")
    answers = [_request(state, "GET", "/health"),  # 503: still loading
               _request(state, "POST", "/v1/completions", json={"prompt": "x"})]
    state.phase = state.READY
    answers += [_request(state, "GET", "/version"), _request(state, "GET", "/no/such/route")]

    def broken():
        raise RuntimeError("a bug")

    state.metrics.render = broken  # an unexpected error: FastAPI's last-resort 500
    answers.append(_request(state, "GET", "/metrics"))
    assert [a.status_code for a in answers] == [503, 503, 200, 404, 500]
    assert all(a.headers["x-served-by"] == "gpu-host-3:8001" for a in answers)
    assert answers[-1].json()["error"]["type"] == "server_error"
    # without a name, the host's (the command line adds the port it listens on)
    unnamed = _request(_state(model_dir), "GET", "/version")
    assert unnamed.headers["x-served-by"] == socket.gethostname()


def test_a_leaving_replica_fails_health_but_still_answers(model_dir):
    state = _state(model_dir)
    state.info = EngineInfo("cpu", max_model_len=64, num_blocks=8, block_size=16,
                            max_num_seqs=4, load_seconds=0.0, pid=0)
    state.phase = state.LEAVING  # SIGTERM came; the listener is still open
    health = _request(state, "GET", "/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "shutting_down"
    assert _request(state, "POST", "/tokenize", json={"prompt": "abc"}).status_code == 200
    state.phase = state.DRAINING  # the listener is closed
    assert _request(state, "POST", "/tokenize", json={"prompt": "abc"}).status_code == 503


def test_a_replica_name_must_fit_a_header(model_dir, capsys):
    for name in ("", "tab\there", "caf\u00e9"):
        assert main(["serve", "--model", str(model_dir), "--replica-name", name]) == 2, name
        assert "--replica-name" in one_error_line(capsys.readouterr().err)
