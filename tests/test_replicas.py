"""`cupy-llama serve` as one replica of several behind a load balancer. In this process: every
response names its replica (x-served-by); after SIGTERM /health fails while requests are
still served. Then two real replicas (test_server.py's ServerProcess, the tiny model on the
NumPy backend) behind nginx with examples/nginx.conf, all on 127.0.0.1: the outputs equal
LLM.generate's and both replicas serve; a replica killed mid-wave loses only the streams it
had begun, which end in an error the client sees; a replica sent SIGTERM drains while
nginx loses no request. Last, examples/replicas.sh as a user runs it."""
import asyncio
import contextlib
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from conftest import one_error_line
from test_server import ServerProcess

from cupy_llama import SamplingParams
from cupy_llama.cli import main
from cupy_llama.models import read_config
from cupy_llama.engine.async_engine import EngineInfo
from cupy_llama.server.app import ServerSettings, ServerState, create_app
from cupy_llama.tokenizer import Tokenizer


# ---- the application in this process (no engine process is started) ------------------------

def _state(model_dir, **settings) -> ServerState:
    config = read_config(model_dir)
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
    # without a name, never the host's (the command line names it by its port)
    unnamed = _request(_state(model_dir), "GET", "/version")
    assert unnamed.headers["x-served-by"] == "cupy-llama" != socket.gethostname()


def test_a_leaving_replica_fails_health_but_still_answers(model_dir):
    state = _state(model_dir)
    state.info = EngineInfo("cpu", context_limit=64, num_blocks=8, block_size=16,
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


# ---- two replicas behind nginx ----------------------------------------------------------------

KEY = "replica-key-9d2e"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NGINX = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")  # not on every PATH
REPLICA_LINE = re.compile(r"^([ \t]*server[ \t]+)\S+:\d+([ \t].*)$", re.M)  # of the upstream
LISTEN_LINE = re.compile(r"^([ \t]*listen[ \t]+)\S+;", re.M)
TRIED = re.compile(r"tried (.+) \((.+)\)$")  # the access log's upstream addresses and statuses
TIMEOUT_S = 30


@pytest.fixture(scope="module")
def nginx():
    if NGINX is None:
        if os.environ.get("CUPY_LLAMA_REQUIRE_NGINX"):
            pytest.fail("nginx is not installed, but CUPY_LLAMA_REQUIRE_NGINX says these tests "
                        "must run (apt-get install nginx)")
        pytest.skip("nginx is not installed (Debian, Ubuntu: apt-get install nginx; .ci/run "
                    "installs it)")
    return NGINX


def nginx_config(replicas: list[str], listen: str) -> str:
    """examples/nginx.conf with one upstream line per replica address and the given
    listening address, as examples/replicas.sh writes it."""
    text = (EXAMPLES / "nginx.conf").read_text()
    lines = list(REPLICA_LINE.finditer(text))
    first = lines[0]
    upstream = "\n".join(f"{first.group(1)}{address}{first.group(2)}" for address in replicas)
    text = text[:first.start()] + upstream + text[lines[-1].end():]
    text, count = LISTEN_LINE.subn(rf"\g<1>{listen};", text)
    assert count == 1
    return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """Replicas of `cupy-llama serve` (ServerProcess) and nginx in front of them, on
    127.0.0.1; stop() ends every process, whatever state the test left them in."""

    def __init__(self, model_dir, prefix: Path, nginx: str, args=(), count: int = 2):
        self.replicas: list[ServerProcess] = []
        self.nginx = None
        self.prefix = prefix
        try:
            for _ in range(count):  # they load their models side by side
                self.replicas.append(ServerProcess(model_dir, *args, wait=False,
                                                   env={"CUPY_LLAMA_API_KEY": KEY}))
            addresses = [replica.wait_ready().removeprefix("http://") for replica in self.replicas]
            self.names = [address.rsplit(":", 1)[1] for address in addresses]  # their ports
            (prefix / "logs").mkdir(parents=True)
            port = free_port()
            (prefix / "nginx.conf").write_text(nginx_config(addresses, f"127.0.0.1:{port}"))
            self.nginx_log = open(prefix / "nginx.out", "w+")
            self.nginx = subprocess.Popen(
                [nginx, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-g", "daemon off;"],
                stdin=subprocess.DEVNULL, stdout=self.nginx_log, stderr=subprocess.STDOUT,
                start_new_session=True)
            self.url = f"http://127.0.0.1:{port}"
            self._wait_for_nginx()
        except BaseException:
            self.stop()
            raise

    def _wait_for_nginx(self) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            assert self.nginx.poll() is None, f"nginx exited:\n{self.nginx_logs()}"
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"nginx does not answer:\n{self.nginx_logs()}"
            time.sleep(0.05)

    def nginx_logs(self) -> str:
        texts = []
        for path in (self.prefix / "nginx.out", self.prefix / "logs" / "error.log"):
            if path.exists():
                texts.append(path.read_text(errors="replace"))
        return "\n".join(texts)

    def access_log(self) -> list[str]:
        return (self.prefix / "logs" / "access.log").read_text().splitlines()

    def stop(self) -> None:
        if self.nginx is not None:
            _stop_group(self.nginx, signal.SIGTERM)
            self.nginx_log.close()
        for replica in self.replicas:
            replica.stop(signal.SIGINT)  # at once: no balancer needs telling


def _stop_group(process: subprocess.Popen, sig, timeout: float = 10) -> None:
    if process.poll() is None:
        os.killpg(process.pid, sig)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # whatever of its group is left
    process.wait()


@pytest.fixture
def cluster(model_dir, tmp_path, nginx):
    cluster = Cluster(model_dir, tmp_path / "nginx", nginx)
    try:
        yield cluster
    finally:
        cluster.stop()


# the requests: (prompt, streamed, max_tokens), greedy, each to its max_tokens
def _wave(max_tokens) -> list[tuple[str, bool, int]]:
    return [(f"Request {i}:" + " and more" * (i % 5), i % 2 == 1, max_tokens(i))
            for i in range(40)]


WAVE = _wave(lambda i: 8 + 5 * (i % 7))
# long enough that streams are still running when their replica dies
LONG_WAVE = _wave(lambda i: 128 if i % 2 else 64)


def _expected(llm, wave) -> list:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, _, n in wave]
    return llm.generate([prompt for prompt, _, _ in wave], params)


@dataclass
class Outcome:
    stream: bool
    status: int | None = None
    served_by: str | None = None
    text: str = ""
    finish_reason: str | None = None
    done: bool = False        # a stream's [DONE] came
    error: str | None = None  # what ended it otherwise (a broken connection, an error event)

    def equals(self, want) -> bool:
        return (self.status == 200 and self.error is None and self.text == want.text
                and self.finish_reason == want.finish_reason and self.done == self.stream)


async def _send(client: httpx.AsyncClient, request, on_chunk=lambda outcome: None) -> Outcome:
    prompt, stream, max_tokens = request
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    outcome = Outcome(stream)
    try:
        if not stream:
            response = await client.post("/v1/completions", json=body)
            outcome.status, outcome.served_by = response.status_code, \
                response.headers.get("x-served-by")
            if response.status_code == 200:
                (choice,) = response.json()["choices"]
                outcome.text, outcome.finish_reason = choice["text"], choice["finish_reason"]
            return outcome
        async with client.stream("POST", "/v1/completions", json=body) as response:
            outcome.status, outcome.served_by = response.status_code, \
                response.headers.get("x-served-by")
            if response.status_code != 200:
                await response.aread()
                return outcome
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    outcome.done = True
                elif line:
                    event = json.loads(line.removeprefix("data: "))
                    if "error" in event:
                        outcome.error = event["error"]["message"]
                        continue
                    (choice,) = event["choices"]
                    outcome.text += choice["text"]
                    outcome.finish_reason = choice["finish_reason"]
                    on_chunk(outcome)
    except httpx.TransportError as e:
        outcome.error = f"{type(e).__name__}: {e}"
    return outcome


async def _running(client: httpx.AsyncClient) -> bool:
    """Whether the replica behind client runs any sequence now (its /metrics)."""
    text = (await client.get("/metrics")).text
    line = next(line for line in text.splitlines()
                if line.startswith("cupy_llama:num_requests_running"))
    return float(line.rsplit(" ", 1)[1]) > 0


def _client(url: str, keepalive: bool = True) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=None if keepalive else 0)
    return httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"},
                             timeout=TIMEOUT_S, limits=limits)


def test_nginx_spreads_the_requests_and_outputs_equal_generate(cluster, llm):
    async def wave():
        async with _client(cluster.url) as client:
            return await asyncio.gather(*(_send(client, request) for request in WAVE))

    outcomes = asyncio.run(wave())
    for request, outcome, want in zip(WAVE, outcomes, _expected(llm, WAVE)):
        assert outcome.equals(want), (request, outcome, want.text)
    assert {o.served_by for o in outcomes} == set(cluster.names)  # both served some
    # the API key is the replicas' to check: nginx passes the header on, or its absence
    refused = httpx.get(cluster.url + "/v1/models")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert refused.headers["x-served-by"] in cluster.names
    # bodies up to the replicas' 16 MiB pass (an unknown field is ignored); larger ones stop
    # at nginx, with an error in the API's shape
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "abc", "max_tokens": 2, "padding": "x" * (4 << 20)}
    assert httpx.post(cluster.url + "/v1/completions", json=body, headers=auth,
                      timeout=TIMEOUT_S).status_code == 200
    body["padding"] = "x" * (16 << 20)
    too_large = httpx.post(cluster.url + "/v1/completions", json=body, headers=auth,
                           timeout=TIMEOUT_S)
    assert too_large.status_code == 413
    assert too_large.json()["error"]["code"] == "request_too_large"


def _engine_pid(server_pid: int) -> int:
    """The engine process a replica's server started (its child)."""
    children = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == server_pid:  # the parent's pid
                children.append(int(entry))
    engines = [pid for pid in children
               if b"engine_process_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(engines) == 1, (server_pid, children)
    return engines[0]


def _metric(text: str, name: str, labels: str = "") -> float:
    """One sample's value in a /metrics text (its labels: those before model_name)."""
    prefix = f"cupy_llama:{name}{{{labels}"
    return float(next(line for line in text.splitlines()
                      if line.startswith(prefix)).rsplit(" ", 1)[1])


async def _settled_finishes(client: httpx.AsyncClient, more_than: int) -> int:
    """Requests the replica behind client has finished that generated more than
    more_than tokens, once its engine is stopped: read until a whole round trip of its
    server brings no change, so that every step the engine sent is taken in and every
    request it ended is counted (its server reads the engine and wakes the handlers,
    which count a request before they write its end, on every turn of its event loop)."""
    def view(text: str) -> tuple:
        finished = _metric(text, "request_generation_tokens_count") - _metric(
            text, "request_generation_tokens_bucket", f'le="{float(more_than)}"')
        return _metric(text, "engine_steps_total"), _metric(
            text, "generation_tokens_total"), finished

    before = view((await client.get("/metrics")).text)
    while True:
        now = view((await client.get("/metrics")).text)
        if now == before:
            return int(now[2])
        before = now


@pytest.mark.slow
def test_a_replica_killed_mid_wave_loses_only_the_streams_it_had_begun(cluster, llm):
    victim, survivor = cluster.names
    expected = _expected(llm, LONG_WAVE)
    # the streams are the wave's long requests: the victim's count of long ones finished
    # counts its streams finished
    assert all(stream == (max_tokens > 100) for _, stream, max_tokens in LONG_WAVE)
    engine = _engine_pid(cluster.replicas[0].proc.pid)

    async def wave():
        text_came = asyncio.Event()  # a chunk of a stream from the victim came
        begun: set[int] = set()  # the victim's streams that have text here
        killed = False
        sent_after_kill = [False] * len(LONG_WAVE)

        async with _client(cluster.url) as client, \
                _client(f"http://127.0.0.1:{victim}") as direct:
            gate = asyncio.Semaphore(16)  # 16 at a time: the rest go once the kill is done

            async def one(i: int, request) -> Outcome:
                def on_chunk(outcome: Outcome) -> None:
                    if outcome.served_by == victim:
                        begun.add(i)
                        text_came.set()

                async with gate:
                    sent_after_kill[i] = killed
                    return await _send(client, request, on_chunk)

            tasks = [asyncio.create_task(one(i, request)) for i, request in enumerate(LONG_WAVE)]
            wave_over = asyncio.ensure_future(asyncio.gather(*tasks))
            # The kill must land while the victim has a stream it has begun and not
            # finished. What this process has read of a stream may trail what the
            # victim sent by all of it (a loaded machine), so the victim's engine is
            # stopped first, and then its own count decides: with more streams begun
            # here than it has finished, one of them can never finish before the kill.
            try:
                while True:
                    came = asyncio.ensure_future(text_came.wait())
                    await asyncio.wait([came, wave_over], timeout=TIMEOUT_S,
                                       return_when=asyncio.FIRST_COMPLETED)
                    assert came.done(), "the wave ended before the victim was caught " \
                                        "mid-stream"
                    text_came.clear()
                    os.kill(engine, signal.SIGSTOP)
                    if len(begun) > await _settled_finishes(direct, more_than=100):
                        break
                    os.kill(engine, signal.SIGCONT)  # those it began have all ended
                os.killpg(cluster.replicas[0].proc.pid, signal.SIGKILL)  # server and engine
                killed = True
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(engine, signal.SIGCONT)
            return await wave_over, sent_after_kill

    outcomes, sent_after_kill = asyncio.run(wave())
    assert cluster.replicas[0].proc.wait(timeout=TIMEOUT_S) == -signal.SIGKILL
    cut = []
    for request, outcome, want, late in zip(LONG_WAVE, outcomes, expected, sent_after_kill):
        if outcome.equals(want):
            assert outcome.served_by == survivor or not late, (request, outcome)
            continue
        # only a stream the victim had begun to answer fails, and visibly: no [DONE], and
        # what did arrive is the start of the right text
        assert outcome.stream and outcome.status == 200 and outcome.served_by == victim, \
            (request, outcome, cluster.access_log())
        assert not outcome.done and want.text.startswith(outcome.text), (request, outcome)
        cut.append(outcome)
    assert cut, "the kill cut no stream short"
    assert any(sent_after_kill)  # and those, sent with one replica left, all succeeded
    # nginx took what failed on the victim before answering to the survivor
    tried = [TRIED.search(line).group(1).split(", ") for line in cluster.access_log()]
    victim_address, survivor_address = (f"127.0.0.1:{name}" for name in cluster.names)
    assert [victim_address, survivor_address] in tried, cluster.access_log()

    # with no replica left, nginx's own 502 comes in the API's shape
    os.killpg(cluster.replicas[1].proc.pid, signal.SIGKILL)
    cluster.replicas[1].proc.wait(timeout=TIMEOUT_S)
    gone = httpx.post(cluster.url + "/v1/completions", json={"prompt": "abc"},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT_S)
    assert gone.status_code == 502 and gone.json()["error"]["code"] == "no_replica"


@pytest.mark.slow
def test_a_replica_sent_sigterm_drains_while_nginx_moves_on(model_dir, tmp_path, nginx, llm):
    cluster = Cluster(model_dir, tmp_path / "nginx", nginx, args=("--drain-delay", "2"))
    try:
        _drain(cluster, llm)
    finally:
        cluster.stop()


def _drain(cluster: Cluster, llm) -> None:
    leaving, name = cluster.replicas[0], cluster.names[0]
    streams = [request for request in LONG_WAVE if request[1]][:8]
    expected = _expected(llm, streams)
    short = ("Hello", False, 4)
    (short_want,) = _expected(llm, [short])

    async def scenario():
        begun = asyncio.Event()

        def on_chunk(outcome: Outcome) -> None:
            if outcome.served_by == name:
                begun.set()

        # a new connection for each direct request: they show what the listener does
        async with _client(cluster.url) as client, _client(leaving.url, False) as direct:
            running = [asyncio.create_task(_send(client, request, on_chunk))
                       for request in streams]
            await asyncio.wait_for(begun.wait(), TIMEOUT_S)
            leaving.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + TIMEOUT_S
            while (await direct.get("/health")).status_code != 503:
                assert time.monotonic() < deadline, "/health never turned 503"
                await asyncio.sleep(0.01)
            # /health fails, yet the listener is still open: a request is still answered
            still = await _send(direct, short)
            # through nginx nothing fails meanwhile, nor once the replica has gone
            meanwhile = []
            while leaving.proc.poll() is None:
                assert time.monotonic() < deadline, "the replica did not stop"
                meanwhile.append(await _send(client, short))
                await asyncio.sleep(0.02)  # a steady trickle, not a flood
            meanwhile.append(await _send(client, short))
            return await asyncio.gather(*running), still, meanwhile

    outcomes, still, meanwhile = asyncio.run(scenario())
    assert leaving.proc.wait(timeout=TIMEOUT_S) == 0, leaving.log_text()
    assert still.equals(short_want) and still.served_by == name
    for request, outcome, want in zip(streams, outcomes, expected):  # each ran to its [DONE]
        assert outcome.equals(want), (request, outcome)
    assert name in {o.served_by for o in outcomes}
    assert all(o.equals(short_want) for o in meanwhile), meanwhile
    assert meanwhile[-1].served_by == cluster.names[1]
    with pytest.raises(httpx.ConnectError):
        httpx.get(leaving.url + "/health")


# ---- examples/replicas.sh ---------------------------------------------------------------------

def _free_ports(count: int) -> int:
    """The first of count consecutive free ports on 127.0.0.1."""
    for _ in range(50):
        first = free_port()
        with contextlib.ExitStack() as stack:
            try:
                for port in range(first, first + count):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return first
    raise AssertionError(f"found no {count} consecutive free ports")


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


def _live_processes(pgids: list[int]) -> list[str]:
    """The processes of those process groups that still run (not the exited ones that
    their new parent has not reaped yet)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    state, _, pgid = f.read().rsplit(")", 1)[1].split()[:3]
            except OSError:
                continue  # gone meanwhile
            if int(pgid) in pgids and state != "Z":
                found.append(entry)
    return found


def _environment(pid: int) -> dict:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.decode().partition("=")[::2] for item in f.read().split(b"\0") if item)


# GPUs 7 and 9, which no machine here has: each replica sees one of them, finds no GPU it
# can use and runs on the CPU (device auto); with --device cpu no GPU is handed out at all
@pytest.mark.slow
@pytest.mark.parametrize("ending, gpus, device", [("ctrl-c", "7,9", "auto"),
                                                  ("a replica dies", None, "cpu")])
def test_replicas_sh_serves_through_nginx_and_stops_everything(model_dir, tmp_path, nginx, ending,
                                                               gpus, device, llm):
    """examples/replicas.sh 2 as a user runs it: both replicas serve through nginx. Ctrl-C
    stops everything (exit 130). A replica killed (SIGKILL) during a wave of 40 requests
    that are not streamed costs none of them: each gets the single-replica output, while
    the script restarts the replica, which serves again; the script stops only at Ctrl-C."""
    port = _free_ports(3)  # nginx, then the replicas on the next two
    env = {**os.environ, "PORT": str(port), "NGINX": nginx, "TMPDIR": str(tmp_path),
           "CUPY_LLAMA": f"{sys.executable} -m cupy_llama.cli", "OPENBLAS_NUM_THREADS": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    log = tmp_path / "replicas.err"
    with open(log, "w") as err:
        script = subprocess.Popen(["bash", str(EXAMPLES / "replicas.sh"), "2", "--model",
                                   str(model_dir), "--device", device], env=env, text=True,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                  start_new_session=True)
    groups = []
    try:
        deadline = time.monotonic() + TIMEOUT_S
        line = ""
        while not line.startswith("serving at "):
            assert script.poll() is None and time.monotonic() < deadline, log.read_text()
            if select.select([script.stdout], [], [], 0.2)[0]:
                line = script.stdout.readline()
        url = f"http://127.0.0.1:{port}"
        assert line.startswith(f"serving at {url}/v1 "), line
        groups = _children(script.pid)  # the two replicas and nginx, each its own group
        assert len(groups) == 3 and all(os.getpgid(pid) == pid for pid in groups)
        replicas = {}  # port: process id
        for pid in groups:
            command = open(f"/proc/{pid}/cmdline").read().split("\0")
            if "serve" in command:
                replicas[int(command[command.index("--port") + 1])] = pid
        assert sorted(replicas) == [port + 1, port + 2]
        devices = [_environment(replicas[p]).get("CUDA_VISIBLE_DEVICES") for p in sorted(replicas)]
        assert devices == (gpus.split(",") if gpus else [None, None])

        async def requests():
            async with _client(url) as client:
                return await asyncio.gather(*(_send(client, ("abc", i % 2 == 1, 32))
                                              for i in range(8)))

        outcomes = asyncio.run(requests())
        assert all(o.status == 200 and o.error is None for o in outcomes), outcomes
        assert {o.served_by for o in outcomes} == {str(port + 1), str(port + 2)}
        if ending == "a replica dies":
            _kill_one_during_a_wave(url, replicas[port + 1], port + 1, llm, log)
            groups = _children(script.pid)  # the restarted replica is a new group
        script.send_signal(signal.SIGINT)
        assert script.wait(timeout=TIMEOUT_S) == 130, log.read_text()
        assert "stopped" in log.read_text()
        assert not _live_processes(groups)  # the replicas' engine processes included
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(script.pid, signal.SIGKILL)
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        script.wait()


def _kill_one_during_a_wave(url: str, victim: int, victim_port: int, llm, log) -> None:
    wave = [(f"Request {i}:", False, 48) for i in range(40)]
    expected = _expected(llm, wave)

    async def scenario():
        async with _client(url) as client, _client(f"http://127.0.0.1:{victim_port}") as direct:
            tasks = [asyncio.create_task(_send(client, request)) for request in wave]
            # killed while it runs its share of the wave, the victim has answered none of
            # it, so nginx sends each request again to the other replica. (A kill while a
            # response is being written would cut that response, which no balancer can
            # send again: waiting for a first answer to come back instead made this test
            # kill during the burst of answers at the end of the wave.)
            while not await _running(direct):
                assert not all(t.done() for t in tasks), "the wave ended before the victim ran it"
                await asyncio.sleep(0.005)
            os.killpg(victim, signal.SIGKILL)  # the replica's server and engine
            return await asyncio.gather(*tasks)

    outcomes = asyncio.run(scenario())
    for request, outcome, want in zip(wave, outcomes, expected):
        assert outcome.equals(want), (request, outcome)
    # the script restarts the replica, and it serves again: directly, and through nginx
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        assert time.monotonic() < deadline, log.read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{victim_port}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    assert "replica 0 exited (code 137); restarting it in 1 s" in log.read_text()

    async def until_it_serves():
        async with _client(url) as client:
            while time.monotonic() < deadline:
                outcome = await _send(client, ("abc", False, 4))
                assert outcome.status == 200
                if outcome.served_by == str(victim_port):
                    return True
                await asyncio.sleep(0.2)
        return False

    assert asyncio.run(until_it_serves()), "nginx never sent a request to the restarted replica"
