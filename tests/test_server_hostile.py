"""`cupy-llama serve` under hostile input and a stuck engine, in this process
(inprocess_server.py: the application over the test's LLM, no port): valid JSON that
Python's parser or the error handler used to fail on, integers sent as 5.0, what the log and
the headers tell, 405s, a watchdog for an engine that stops stepping, and a bounded
schema-driven fuzz of both generating endpoints. test_server.py sends the large prompts,
the malformed HTTP and the slow headers to a real server."""
import pytest

pytest.importorskip("fastapi")

import asyncio
import contextlib
import json
import logging
import time

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inprocess_server import ask, ask_one, make_state, with_app

from cupy_llama.cli import main
from cupy_llama.server.app import ServerSettings, create_app, ready_line
from cupy_llama.server.protocol import ChatCompletionRequest, CompletionRequest

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def state(model_dir, llm):
    return make_state(model_dir, llm)


def assert_openai_error(answer, status: int, param=None) -> dict:
    assert answer.status == status, answer.body[:300]
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def test_valid_json_that_used_to_be_a_500_is_a_400_logged_once(state, caplog):
    """Deep nesting (RecursionError in the parser), an integer of 5,000 digits (Python's
    int-string limit), a lone surrogate in a value an error message quotes (no UTF-8 form)
    and /tokenize with no messages (an uncaught ValidationError) each gave a 500."""
    deep = lambda depth: b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"  # noqa: E731
    cases = [
        ("/v1/completions", deep(5_000), None),
        ("/v1/completions", deep(100_000), None),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"7" * 5_000 + b"}", None),
        ("/v1/completions", b'{"prompt": "x", "temperature": "\\ud800"}', "temperature"),
        ("/v1/chat/completions", b'{"messages": [{"role": "\\ud800", "content": "x"}]}',
         "messages[0].role"),
        ("/v1/completions", b'{"prompt": "x", "model": "\\udfff"}', "model"),
        ("/tokenize", b'{"messages": []}', "messages"),
    ]
    caplog.set_level(logging.INFO, logger="cupy_llama.server")
    answers = ask(state, [("POST", path, {"content": body,
                                          "headers": {"content-type": "application/json"}})
                          for path, body, _ in cases])
    for (path, body, param), answer in zip(cases, answers):
        status = 404 if param == "model" else 400
        error = assert_openai_error(answer, status, param)
        if b"\\ud800" in body or b"\\udfff" in body:
            assert "\\ud" in error["message"] or "\ud800" in error["message"] \
                or "\udfff" in error["message"]
    records = [r for r in caplog.records if r.name == "cupy_llama.server"]
    assert not [r for r in records if r.levelno >= logging.ERROR], [r.message for r in records]
    assert len([r for r in records if " 400 " in r.getMessage() or " 404 " in r.getMessage()]) \
        == len(cases)  # one access line each, nothing more


def test_integers_sent_as_floats_with_no_fraction_are_integers(state, llm):
    """JSON Schema counts 5.0 as an integer and OpenAI's API takes it: max_tokens, top_k, n,
    logprobs and token ids accept integral floats; 5.5 stays a 400."""
    ids = llm.tokenizer.encode("abc")
    base = {"max_tokens": 3, "temperature": 0}
    whole, floats, half, bad_id = ask(state, [
        ("POST", "/v1/completions", {"json": {"prompt": ids, **base}}),
        ("POST", "/v1/completions", {"json": {"prompt": [float(t) for t in ids], "max_tokens": 3.0,
                                              "top_k": 392.0, "n": 1.0, "logprobs": 1.0,
                                              "temperature": 0}}),
        ("POST", "/v1/completions", {"json": {"prompt": ids, **base, "max_tokens": 5.5}}),
        ("POST", "/v1/completions", {"json": {"prompt": [221.5], **base}})])
    assert whole.status == floats.status == 200, floats.body
    assert floats.json()["choices"][0]["text"] == whole.json()["choices"][0]["text"]
    assert_openai_error(half, 400, "max_tokens")
    assert_openai_error(bad_id, 400, "prompt")
    detokenized = ask_one(state, "POST", "/detokenize", json={"tokens": [float(t) for t in ids]})
    assert detokenized.status == 200


def test_health_probes_log_at_debug(state, caplog):
    """A balancer's /health every few seconds would fill the log: a 200 logs at DEBUG; a
    503 (loading, stopping) and every other request at INFO."""
    caplog.set_level(logging.DEBUG, logger="cupy_llama.server")
    ask(state, [("GET", "/health", {}), ("GET", "/version", {})])
    levels = {r.getMessage().split(" ")[1]: r.levelno for r in caplog.records
              if r.getMessage().startswith("GET ")}
    assert levels == {"/health": logging.DEBUG, "/version": logging.INFO}


def test_405_keeps_its_allow_header(state):
    answer = ask_one(state, "GET", "/v1/completions")
    assert_openai_error(answer, 405)
    assert answer.headers["allow"] == "POST"


def test_a_traceback_in_the_log_quotes_no_request_value(state, caplog):
    """An unexpected error is logged with where it happened, not with its message, which
    may quote the request."""
    value = "-".join(("my", "secret", "plan"))  # as a request's value would be

    def broken():
        raise RuntimeError(f"the prompt was: {value}")

    state.metrics.render = broken
    caplog.set_level(logging.INFO, logger="cupy_llama.server")
    answer = ask_one(state, "GET", "/metrics")
    assert_openai_error(answer, 500)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "RuntimeError" in text and "Traceback" in text and "in broken" in text
    assert value not in text


def test_the_ready_line_says_whether_a_key_is_needed_and_an_empty_key_is_refused(
        model_dir, capsys, monkeypatch):
    class Info:
        device, context_limit, load_seconds = "cpu", 4096, 1.0

    keyed = ServerSettings(model_dir="x", served_model_name="smollm2", api_key="k")
    assert "API key required" in ready_line(keyed, "http://127.0.0.1:8000", Info())
    open_line = ready_line(ServerSettings(model_dir="x", served_model_name="smollm2"),
                           "http://127.0.0.1:8000", Info())
    assert open_line.startswith("serving 'smollm2' at http://127.0.0.1:8000/v1 ")
    assert "no API key" in open_line
    # an empty key would turn authentication off: a usage error, from the flag or the variable
    assert main(["serve", "--model", str(model_dir), "--api-key", ""]) == 2
    assert "--api-key is empty" in capsys.readouterr().err
    monkeypatch.setenv("CUPY_LLAMA_API_KEY", "")
    assert main(["serve", "--model", str(model_dir)]) == 2
    assert "--api-key is empty" in capsys.readouterr().err
    monkeypatch.delenv("CUPY_LLAMA_API_KEY")
    # an empty name is refused too, rather than replaced by the directory's unasked
    assert main(["serve", "--model", str(model_dir), "--served-model-name", " "]) == 2
    assert "--served-model-name is empty" in capsys.readouterr().err


# ---- a stuck engine -------------------------------------------------------------------------

def test_an_engine_that_stops_stepping_fails_health_and_its_requests(model_dir, llm):
    """The watchdog (--engine-timeout): an engine that has finished no step for the timeout
    while a request waits is stuck; /health answers 503, the engine is killed, the request
    ends with a 503 (a stream that had begun: an error event and [DONE]), and the server is
    asked to exit with the failure, for a supervisor to restart it."""
    state = make_state(model_dir, llm, stepping=False, engine_timeout_s=0.05)
    exits = []

    async def scenario():
        state.loop = asyncio.get_running_loop()
        await state.load()
        state.request_exit = lambda: exits.append(True)
        transport = httpx.ASGITransport(app=create_app(state), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            assert (await client.get("/health")).status_code == 200
            waiting = asyncio.create_task(client.post("/v1/completions", json={
                "prompt": "abc", "max_tokens": 4}))
            while not state.engine.sinks:  # the request reached the engine, which is stuck
                await asyncio.sleep(0.001)
            state.engine.stalled = 0.01
            state.check_engine()
            assert not state.engine.killed  # below the timeout: nothing happens
            state.engine.stalled = 0.06
            await asyncio.sleep(0.3)  # the watchdog's turn (a quarter of the timeout)
            health = await client.get("/health")
            answer = await waiting
        state._watchdog.cancel()
        return health, answer

    health, answer = asyncio.run(scenario())
    for request_id in list(llm.engine.requests):  # the request the stuck engine held
        llm.engine.abort(request_id)
    assert state.engine.killed and exits
    assert health.status_code == 503
    assert answer.status_code == 503
    assert "--engine-timeout" in answer.json()["error"]["message"]
    assert "--engine-timeout" in str(state.failure)


# ---- a fuzz of the request models -----------------------------------------------------------

JSON = st.recursive(st.none() | st.booleans() | st.integers(-10, 10**6) |
                    st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=3) |
                    st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant",
                                                          "tool", "developer", 3])},
                                optional={"content": JSON | st.text(max_size=30),
                                          "name": JSON, "tool_calls": JSON})


def _bodies(model, required: dict):
    """A request body: the model's own fields (sometimes a field of the other endpoint, or
    an unknown one) with JSON values of any shape, plus its required field."""
    names = sorted(set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
                   | {"colour"})
    plausible = {"max_tokens": st.integers(-2, 40), "n": st.integers(0, 3),
                 "temperature": st.floats(-1, 3), "logprobs": st.integers(-1, 25) | st.booleans(),
                 "stream": st.booleans(), "top_logprobs": st.integers(-1, 25),
                 "seed": st.integers(-2**64, 2**65), "stop": st.text(max_size=3) | JSON}
    fields = {name: plausible.get(name, JSON) | JSON for name in names if name not in required}
    return st.fixed_dictionaries(required, optional=fields)


@pytest.fixture(scope="module")
def fuzz_client(model_dir, llm):
    """One event loop and client for every example: the app over an engine that ends each
    request at once."""
    state = make_state(model_dir, llm, instant=True)
    loop = asyncio.new_event_loop()
    state.loop = loop
    loop.run_until_complete(state.load())
    state._watchdog.cancel()
    transport = httpx.ASGITransport(app=create_app(state), raise_app_exceptions=False)
    client = httpx.AsyncClient(transport=transport, base_url="http://app")

    def send(path: str, body) -> httpx.Response:
        async def go():
            response = await client.post(path, json=body)
            await response.aread()
            return response
        return loop.run_until_complete(asyncio.wait_for(go(), 30))  # no hang

    yield send
    loop.run_until_complete(client.aclose())
    loop.close()


def _check(response) -> None:
    assert response.status_code in (200, 400, 404), (response.status_code, response.text[:300])
    if response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]")
    else:
        assert response.json()["choices"]


FUZZ = settings(max_examples=200, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@pytest.mark.slow
@FUZZ
@given(body=_bodies(CompletionRequest, {"prompt": st.text(max_size=40) | JSON}))
def test_fuzzed_completions_never_get_a_500(fuzz_client, body):
    _check(fuzz_client("/v1/completions", body))


@pytest.mark.slow
@FUZZ
@given(body=_bodies(ChatCompletionRequest, {"messages": st.lists(MESSAGE, max_size=3) | JSON}))
def test_fuzzed_chat_completions_never_get_a_500(fuzz_client, body):
    _check(fuzz_client("/v1/chat/completions", body))


def test_cors_flags_take_json_lists_as_vllm_does(model_dir, capsys):
    """--allowed-origins and its siblings take vLLM's JSON lists; anything else is a usage
    error naming the flag, before the model loads."""
    for flag, value, example in (("--allowed-origins", "http://ui.example", '"http://'),
                                 ("--allowed-methods", '"POST"', '"GET"'),
                                 ("--allowed-headers", "[1]", '"Authorization"')):
        assert main(["serve", "--model", str(model_dir), flag, value]) == 2
        err = capsys.readouterr().err
        assert f"{flag} must be a JSON list of strings, such as '[{example}" in err  # its own kind


def test_serve_s_own_engine_flags_are_named_in_their_errors(model_dir, capsys):
    assert main(["serve", "--model", str(model_dir), "--block-size", "0"]) == 2
    assert "--block-size must be a positive integer, got 0" in capsys.readouterr().err


# ---- the HTTP layer: uvicorn with the server's protocol, on a socket ------------------------

@contextlib.contextmanager
def _http_server(header_timeout: float):
    """uvicorn on 127.0.0.1 (a free port) with the server's HTTP protocol and a trivial
    application, in a thread; always stopped."""
    import socket
    import threading
    import uvicorn
    from cupy_llama.server.app import _HTTP

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    http = type("HTTP", (_HTTP,), {"header_timeout_s": header_timeout})
    server = uvicorn.Server(uvicorn.Config(app, http=http, lifespan="off", log_config=None,
                                           log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.01)
        yield sock.getsockname()
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def test_http_errors_outside_the_app_are_openai_errors_and_headers_time_out():
    """A bad Content-Length is refused by the HTTP layer, in OpenAI's shape too; a
    connection that sends nothing, or its headers a byte at a time, is closed after the
    header timeout (1 s here; --header-timeout), while a request sent at once is served."""
    import socket
    import select
    with _http_server(header_timeout=1.0) as address:
        with socket.create_connection(address, timeout=30) as sock:
            sock.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 12x\r\n\r\n")
            answer = b""
            while data := sock.recv(65536):
                answer += data
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
        assert json.loads(body)["error"]["code"] == "invalid_http_request"
        for trickle in (False, True):
            with socket.create_connection(address, timeout=30) as sock:
                started, closed_at = time.monotonic(), None
                if trickle:
                    for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                        try:
                            sock.sendall(bytes([byte]))
                        except OSError:
                            break
                        if select.select([sock], [], [], 0.1)[0] and sock.recv(1) == b"":
                            break
                sock.settimeout(30)
                assert sock.recv(1) == b""  # closed, with nothing said
                closed_at = time.monotonic()
                assert 0.9 < closed_at - started < 20, (trickle, closed_at - started)
        with socket.create_connection(address, timeout=30) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = b""
            while data := sock.recv(65536):
                answer += data
            assert answer.startswith(b"HTTP/1.1 200") and b"\r\nok\r\n" in answer


def test_headers_past_16_kib_are_refused_also_when_sent_at_once():
    """h11 bounds a head that is still arriving; one that comes in a single read must be
    refused too."""
    import socket
    from cupy_llama.server.app import MAX_HEADER_BYTES

    def answer_to(header_bytes: int, padded: bool) -> bytes:
        head = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        filler = MAX_HEADER_BYTES + header_bytes - len(head) - len(b"X-Big: \r\n\r\n")
        # padded: the value is optional whitespace but its last byte, which the parser
        # strips, so only the bytes sent can say the head's size
        value = b" " * (filler - 1) + b"a" if padded else b"a" * filler
        with socket.create_connection(address, timeout=30) as sock:
            sock.sendall(head + b"X-Big: " + value + b"\r\n\r\n")
            answer = b""
            while data := sock.recv(65536):
                answer += data
        return answer

    with _http_server(header_timeout=10.0) as address:
        for padded in (False, True):
            assert answer_to(0, padded).startswith(b"HTTP/1.1 200"), padded  # at the bound
            for past in (1, 100_000):
                head, _, body = answer_to(past, padded).partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 400"), (past, padded, head)
                assert json.loads(body)["error"]["code"] == "invalid_http_request"


def test_a_refused_head_still_arriving_gets_its_answer():
    """A head that is refused while megabytes of it are still on their way: the server
    answers, then drops the rest until the client has sent it (closing at once, with
    unread bytes, would reset the connection and could lose the answer)."""
    import socket
    head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (2 << 20) + b"\r\n\r\n"
    with _http_server(header_timeout=10.0) as address:
        for _ in range(3):
            with socket.create_connection(address, timeout=30) as sock:
                sock.sendall(head)  # the server reads it all, though it answered long before
                sock.shutdown(socket.SHUT_WR)
                answer = b""
                while data := sock.recv(65536):
                    answer += data
            status, _, body = answer.partition(b"\r\n\r\n")
            assert status.startswith(b"HTTP/1.1 400"), status
            assert json.loads(body)["error"]["code"] == "invalid_http_request"


def test_a_body_that_stops_arriving_is_a_408(model_dir, llm):
    """A client that sends part of a body and then nothing (Content-Length or chunked)
    gets a 408 once the body has paused for --header-timeout (0.5 s here), with the
    connection closed; a body sent at once is served as before."""
    state = make_state(model_dir, llm, header_timeout_s=0.5)

    async def stalled():
        yield b'{"model": "m", "prompt": "hi",'
        await asyncio.sleep(30)
        yield b' "max_tokens": 2}'

    async def work(transport):
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            started = time.monotonic()
            slow = await client.post("/v1/completions", content=stalled())
            waited = time.monotonic() - started
            whole = await client.post("/v1/completions",
                                      json={"model": "m", "prompt": "hi", "max_tokens": 2})
        return slow, waited, whole

    slow, waited, whole = with_app(state, work)
    assert slow.status_code == 408 and slow.headers["connection"] == "close"
    error = slow.json()["error"]
    assert error["code"] == "request_timeout" and "stopped arriving for 0.5 s" in error["message"]
    assert 0.4 < waited < 20
    assert whole.status_code == 200


def test_bodies_of_more_entries_than_could_run_are_refused_before_they_are_read(state):
    """Chat messages past the context's token count, and completion prompts past what the
    server could take in, are 400s decided on the body's JSON, before the request model
    reads each entry and the prompts are rendered and tokenized (seconds of held-up
    streams for a body of hundreds of thousands of entries)."""
    context = None

    async def work(transport):
        nonlocal context
        context = state.info.context_limit
        many = [{"role": "user", "content": ""}] * (context + 1)
        at_once = state.engine.info.max_num_seqs + state.settings.max_waiting
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            chat = await client.post("/v1/chat/completions", json={"model": "m", "messages": many})
            prompts = await client.post("/v1/completions", json={
                "model": "m", "prompt": ["a"] * (at_once + 1), "max_tokens": 1})
            doubled = await client.post("/v1/completions", json={
                "model": "m", "prompt": ["a"] * (at_once // 2 + 1), "n": 2, "max_tokens": 1})
            ids = await client.post("/v1/completions", json={  # one prompt of token ids
                "model": "m", "prompt": [5] * 10, "max_tokens": 1})
        return chat, prompts, doubled, ids

    from cupy_llama.server import protocol
    parse, read = protocol.parse, []

    def counted(model, body):
        read.append(model.__name__)
        return parse(model, body)

    protocol.parse = counted
    try:
        chat, prompts, doubled, ids = with_app(state, work)
    finally:
        protocol.parse = parse
    assert read == ["CompletionRequest"]  # only the body that runs was read
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    assert f"more than the model's context of {context:,} tokens" in chat.json()["error"]["message"]
    for answer, param in ((prompts, "prompt"), (doubled, "n")):
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param
        assert "sequences" in answer.json()["error"]["message"]
    assert ids.status_code == 200
