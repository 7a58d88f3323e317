"""The HTTP server: FastAPI routes over the engine process (engine/async_engine.py).

A request goes: API key, body (size limit, JSON), the endpoint's request model
(server/protocol.py) to prompts and SamplingParams, one engine request per prompt, then
the engine's deltas back through a RequestStream to JSON or server-sent events. The
server starts listening before the model is loaded (/health answers 503 until then) and
prints its URL once the engine reports ready. Every response names the server in an
x-served-by header (--replica-name, else hostname:port), so that behind a load balancer a
client sees which replica answered. A client that goes away aborts its requests: the
engine frees their blocks before its next step. On SIGTERM /health answers 503 first and
requests that still arrive are served for drain_delay_s (time for a balancer to take the
replica out); then, as at once on SIGINT, it stops accepting connections, gives what is
running SHUTDOWN_GRACE_S to finish, cuts the rest short (a last chunk with finish_reason
"length", then [DONE]), stops the engine process and returns.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field, replace

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from .. import __version__
from ..engine.async_engine import (ENGINE_STOPPED, AsyncEngine, EngineStartError, Rejected,
                                   RequestStream)
from ..outputs import RequestOutput
from ..sampling import model_sampling_defaults
from . import protocol
from .metrics import CONTENT_TYPE, Metrics
from .protocol import APIError

DEFAULT_MAX_WAITING = 1024
MAX_BODY_BYTES = 16 << 20        # larger bodies get 413 (a 100k-token prompt is about 1 MB)
SHUTDOWN_GRACE_S = 2.0           # how long running requests may go on once a shutdown begins
DRAIN_DELAY_S = 1.0              # SIGTERM: /health 503 for this long before the listener closes
SERVED_BY = b"x-served-by"       # the response header that names the replica
CLIENT_CLOSED = 499              # nginx's code for a client that left before the response
RETRY_AFTER = {"Retry-After": "1"}
SSE_DONE = b"data: [DONE]\n\n"

log = logging.getLogger("cupy_llama.server")


@dataclass
class ServerSettings:
    model_dir: str
    served_model_name: str
    device: str = "auto"
    engine_options: dict = field(default_factory=dict)
    api_key: str | None = None
    max_waiting: int = DEFAULT_MAX_WAITING
    log_requests: bool = False
    max_body_bytes: int = MAX_BODY_BYTES
    shutdown_grace_s: float = SHUTDOWN_GRACE_S
    drain_delay_s: float = DRAIN_DELAY_S
    replica_name: str | None = None  # x-served-by; run_server's default: hostname:port


class _ClientGone(Exception):
    pass


class _Disconnected:
    __slots__ = ()


DISCONNECTED = _Disconnected()  # put in a request's stream when its client goes away


# ---- the state the routes share -----------------------------------------------------------

class ServerState:
    # LEAVING: after SIGTERM, /health answers 503 while requests are still served, until
    # the listener closes; DRAINING: no new requests, running ones finish
    LOADING, READY, LEAVING, DRAINING = "loading", "ready", "leaving", "draining"

    def __init__(self, settings: ServerSettings, tokenizer, model_config):
        self.settings = settings
        self.tokenizer = tokenizer
        self.token_strings = protocol.TokenStrings(tokenizer)
        self.vocab_size = model_config.vocab_size
        self.model_defaults = model_sampling_defaults(model_config.generation_config)
        self.engine = AsyncEngine(settings.model_dir, settings.device, settings.engine_options,
                                  on_stopped=self._engine_stopped)
        self.metrics = Metrics(lambda: (self.engine.stats, max(0, self.engine.num_waiting)),
                               settings.served_model_name)
        self.phase = self.LOADING
        self.info = None
        self.failure: Exception | None = None  # why the server stopped by itself
        self.created = int(time.time())
        self.jobs: set[_Job] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_ready = lambda info: None
        self.request_exit = lambda: None     # asks the HTTP server to stop

    async def load(self) -> None:
        try:
            self.info = await self.engine.start()
        except EngineStartError as e:
            self.failure = e
            self.request_exit()
            return
        if self.phase == self.LOADING:
            self.phase = self.READY
            self.on_ready(self.info)

    def _engine_stopped(self) -> None:
        self.failure = RuntimeError("the engine process stopped unexpectedly; see the "
                                    "messages above")
        self.phase = self.DRAINING
        self.request_exit()

    def begin_leaving(self) -> None:
        """SIGTERM: /health answers 503 at once, so a load balancer takes this replica out,
        while requests that still reach it are served (one that has not noticed yet would
        otherwise hand its client an error); after drain_delay_s, begin_shutdown()."""
        if self.phase != self.READY:  # loading, or stopping already: nothing to announce
            self.request_exit()
            self.begin_shutdown()
            return
        self.phase = self.LEAVING
        delay = self.settings.drain_delay_s
        log.info("leaving: /health answers 503; the listener closes in %.1f s", delay)
        self.loop.call_later(delay, self._stop_accepting)

    def _stop_accepting(self) -> None:
        if self.phase == self.LEAVING:
            self.request_exit()
            self.begin_shutdown()

    def begin_shutdown(self) -> None:
        """Refuse new requests; after the grace period, cut short what still runs."""
        if self.phase == self.DRAINING:
            return
        self.phase = self.DRAINING
        if self.jobs:
            log.info("shutting down: %d requests still running get %.0f s to finish",
                     len(self.jobs), self.settings.shutdown_grace_s)
        self.loop.call_later(self.settings.shutdown_grace_s, self._cut_short)

    def _cut_short(self) -> None:
        for job in list(self.jobs):
            job.abort_unfinished()

    # ---- checks every route makes ------------------------------------------------------
    def check_key(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(401, "missing API key; send the header 'Authorization: Bearer KEY'",
                           code="invalid_api_key")
        if not hmac.compare_digest(token.strip().encode("latin-1"), key.encode("utf-8")):
            raise APIError(401, "wrong API key; send the server's --api-key as "
                                "'Authorization: Bearer KEY'", code="invalid_api_key")

    def check_ready(self) -> None:
        """The API answers while the server is ready, and while it is leaving."""
        if self.phase == self.LOADING:
            raise APIError(503, "the model is still loading; retry when /health answers 200",
                           code="not_ready", headers=RETRY_AFTER)
        if self.phase == self.DRAINING:
            raise APIError(503, "the server is shutting down", code="shutting_down")

    def check_healthy(self) -> None:
        """/health: 200 only while ready, so that a balancer sends nothing new to a server
        that is leaving."""
        self.check_ready()
        if self.phase == self.LEAVING:
            raise APIError(503, "the server is shutting down; it still answers requests "
                                "until its listener closes", code="shutting_down")

    def check_model(self, name: str | None) -> None:
        served = self.settings.served_model_name
        if name is not None and name != served:
            raise APIError(404, f"model {name!r} does not exist; this server serves "
                                f"{served!r} (see GET /v1/models)", param="model",
                           code="model_not_found")

    def start_job(self, response_id: str, prompts: list[list[int]], params: list,
                  stream: bool, n: int) -> "_Job":
        new_seqs, limit = len(prompts) * n, self.settings.max_waiting
        at_once = self.engine.info.max_num_seqs
        if new_seqs > at_once + limit:  # could never be taken in: no retry would help
            what = f"{len(prompts)} prompts x n={n}" if len(prompts) > 1 else f"n={n}"
            raise APIError(400, f"this request needs {new_seqs} sequences ({what}) but the "
                                f"server runs {at_once} at once and lets {limit} wait "
                                "(--max-num-seqs, --max-waiting); send fewer prompts or a "
                                "smaller n", param="n" if n > 1 else "prompt")
        would_wait = self.engine.num_would_wait(new_seqs)
        if would_wait > limit:
            counted = f"{would_wait} sequence{'s' if would_wait != 1 else ''}"
            raise APIError(503, f"the server is busy: {counted} would wait for a free slot, "
                                f"more than --max-waiting {limit}; retry in a moment",
                           code="server_busy", headers=RETRY_AFTER)
        job = _Job(self, response_id, prompts, n, stream)
        for request_id, prompt, sampling in zip(job.request_ids, prompts, params):
            self.engine.add(request_id, prompt, sampling, stream, job.sink)
        self.jobs.add(job)
        return job


# ---- one HTTP request's engine requests ---------------------------------------------------

class _Choice:
    __slots__ = ("texts", "token_ids", "logprobs", "finish_reason", "first_at", "last_at")

    def __init__(self):
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list | None = None  # (token id, logprob, top) per token, when asked
        self.finish_reason: str | None = None
        self.first_at: float | None = None
        self.last_at = 0.0


class _Job:
    """Prompts x n choices of one HTTP request, fed by one RequestStream."""

    def __init__(self, state: ServerState, response_id: str, prompts: list[list[int]], n: int,
                 stream: bool):
        self.state = state
        self.metrics = state.metrics
        self.response_id = response_id
        self.prompts = prompts
        self.n = n
        self.stream = stream
        self.sink = RequestStream()
        self.request_ids = [f"{response_id}-{i}" for i in range(len(prompts))]
        self._prompt_of = {request_id: i for i, request_id in enumerate(self.request_ids)}
        self.choices = [[_Choice() for _ in range(n)] for _ in prompts]
        self._running = set(self.request_ids)
        self._admitted = [False] * len(prompts)
        self._cached = [0] * len(prompts)  # prompt tokens the prefix cache held, per prompt
        self.num_unfinished = len(prompts) * n
        self.arrival = time.monotonic()

    @property
    def done(self) -> bool:
        return self.num_unfinished == 0

    async def next_updates(self) -> dict:
        """Everything that arrived since the last call, merged per choice:
        {(prompt index, choice index): [text, token ids, logprobs, finish_reason]}."""
        items = await self.sink.get()
        now = time.monotonic()
        updates: dict = {}
        for item in items:
            if type(item) is not tuple:
                self._fail(item)
            request_id, index, text, token_ids, finish_reason, logprobs, num_cached = item
            i = self._prompt_of[request_id]
            choice = self.choices[i][index]
            if choice.finish_reason is not None:
                continue
            if index == 0:  # the sample that computed the prompt
                self._cached[i] = num_cached
            self._record(i, choice, text, token_ids, logprobs, finish_reason, now)
            update = updates.get((i, index))
            if update is None:
                updates[(i, index)] = [text, token_ids, logprobs, finish_reason]
            else:
                update[0] += text
                update[1] = update[1] + token_ids
                if logprobs:
                    update[2] = (update[2] or []) + logprobs
                update[3] = finish_reason
        return updates

    def _record(self, i: int, choice: _Choice, text: str, token_ids: list[int], logprobs,
                finish_reason: str | None, now: float) -> None:
        metrics = self.metrics
        if not self._admitted[i]:
            self._admitted[i] = True
            metrics.prompt_tokens.inc(len(self.prompts[i]))
        if text:
            choice.texts.append(text)
        if token_ids:
            if choice.first_at is None:
                choice.first_at = now
                if self.stream:
                    metrics.time_to_first_token.observe(now - self.arrival)
            choice.token_ids += token_ids
            if logprobs is not None:
                choice.logprobs = (choice.logprobs or []) + logprobs
            choice.last_at = now
            metrics.generation_tokens.inc(len(token_ids))
        if finish_reason is not None:
            choice.finish_reason = finish_reason
            self.num_unfinished -= 1
            if all(c.finish_reason is not None for c in self.choices[i]):
                self._running.discard(self.request_ids[i])
            metrics.request_finished(finish_reason)
            metrics.e2e_request_latency.observe(now - self.arrival)
            num_tokens = len(choice.token_ids)
            if self.stream and num_tokens > 1:
                metrics.time_per_output_token.observe(
                    (choice.last_at - choice.first_at) / (num_tokens - 1))

    def _fail(self, item) -> None:
        if item is DISCONNECTED:
            raise _ClientGone()
        if isinstance(item, Rejected):
            self._running.discard(item.request_id)
            raise protocol.request_error(item.message)
        if item is ENGINE_STOPPED:
            self._running.clear()
            raise APIError(500, "the engine process stopped; the server is shutting down")
        raise TypeError(f"unexpected item {item!r}")

    async def final_outputs(self) -> list[list[RequestOutput]]:
        while not self.done:
            await self.next_updates()
        return [[RequestOutput(request_id, prompt, list(c.token_ids), "".join(c.texts),
                               c.finish_reason, logprobs=c.logprobs, index=index,
                               num_cached_tokens=cached) for index, c in enumerate(choices)]
                for request_id, prompt, choices, cached in zip(self.request_ids, self.prompts,
                                                               self.choices, self._cached)]

    def sse(self, stream_builder, updates: dict) -> bytes:
        parts = []
        for (i, j), (text, token_ids, logprobs, finish_reason) in updates.items():
            chunk = stream_builder.chunk(i * self.n + j, text, logprobs, finish_reason)
            parts.append(_sse(chunk))
        return b"".join(parts)

    def usage(self) -> dict:
        return protocol.usage(sum(len(p) for p in self.prompts),
                              sum(len(c.token_ids) for choices in self.choices for c in choices),
                              sum(self._cached))

    def abort_unfinished(self) -> None:
        for request_id in self._running:
            self.state.engine.abort(request_id)

    def close(self) -> None:
        """The client has what it gets: abort what still runs (it went away)."""
        if self not in self.state.jobs:
            return  # closed already
        if self._running:
            for choices in self.choices:
                for choice in choices:
                    if choice.finish_reason is None:
                        self.metrics.request_finished("abort")
            self.abort_unfinished()
            self._running.clear()
        self.state.jobs.discard(self)
        if self.state.settings.log_requests:
            texts = ["".join(c.texts) for choices in self.choices for c in choices]
            log.info("response %s: %s", self.response_id, json.dumps(texts, ensure_ascii=False))


def _sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() \
        + b"\n\n"


class _EventStream(Response):
    """Server-sent events from an async iterator of bytes. on_close runs however the
    response ends, even if it never starts (it aborts what no client waits for)."""
    media_type = "text/event-stream"

    def __init__(self, events, on_close):
        self.status_code = 200
        self.background = None
        self.events = events
        self.on_close = on_close
        # no body attribute: no Content-Length, the stream is sent chunked
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": self.raw_headers})
            async for data in self.events:
                if data:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.events.aclose()
            self.on_close()


async def _watch_disconnect(receive, sink: RequestStream) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            sink.put(DISCONNECTED)
            return


async def _respond(request: Request, job: _Job, stream_builder, final_body) -> Response:
    """Wait for the job and answer: a JSON body (final_body(outputs)), or with
    stream_builder an event stream, started once the first tokens are there (so that a
    request the engine refuses is still an HTTP error)."""
    watcher = asyncio.create_task(_watch_disconnect(request.receive, job.sink))

    def close() -> None:
        watcher.cancel()
        job.close()

    streaming = False
    try:
        if stream_builder is None:
            return JSONResponse(final_body(await job.final_outputs()))
        first = await job.next_updates()
        streaming = True
        return _EventStream(_events(job, stream_builder, first), close)
    except _ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        if not streaming:
            close()


async def _events(job: _Job, stream_builder, updates: dict):
    try:
        while True:
            yield job.sse(stream_builder, updates)
            if job.done:
                break
            updates = await job.next_updates()
        if stream_builder.include_usage:
            yield _sse(stream_builder.usage_chunk(job.usage()))
        yield SSE_DONE
    except _ClientGone:
        return
    except APIError as e:  # the engine went away mid-stream
        yield _sse(e.body())
        yield SSE_DONE


async def _read_json(request: Request, limit: int):
    length = request.headers.get("content-length")
    if length is not None:
        if not length.strip().isdigit():
            raise APIError(400, f"Content-Length {length!r} is not a number")
        if int(length) > limit:
            raise APIError(413, f"the request body has {int(length):,} bytes, more than the "
                                f"limit of {limit:,}", code="request_too_large",
                           headers={"Connection": "close"})
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the request body is larger than the limit of {limit:,} "
                                "bytes", code="request_too_large",
                           headers={"Connection": "close"})
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None


# ---- the application ----------------------------------------------------------------------

class _ServedBy:
    """Adds the replica's name to every response, errors included (this wraps the whole
    application, outside FastAPI's last-resort error handler)."""

    def __init__(self, app, name: str):
        self.app = app
        self.header = (SERVED_BY, name.encode("latin-1"))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_name(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_name)


class _AccessLog:
    """One log line per request: method, path, status, milliseconds (to the end of a
    stream). No bodies: those are logged by the routes, and only with --log-requests."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        status = []

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            log.info("%s %s %s %.1f ms", scope["method"], scope["path"],
                     status[0] if status else 500, 1e3 * (time.perf_counter() - started))


def create_app(state: ServerState):
    """The ASGI application: FastAPI's routes inside _ServedBy."""
    settings = state.settings

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.loop = asyncio.get_running_loop()
        loading = asyncio.create_task(state.load())
        try:
            yield
        finally:
            state.phase = state.DRAINING
            loading.cancel()
            await state.engine.close()

    app = FastAPI(title="cupy-llama", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url=None, lifespan=lifespan)
    app.add_middleware(_AccessLog)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        if e.status_code == 404:
            routes = sorted(f"{method} {route.path}" for route in app.routes
                            if isinstance(route, APIRoute) for method in route.methods)
            message = (f"{request.method} {request.url.path} is not served here; the routes "
                       f"are {', '.join(routes)}")
        else:
            message = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(APIError(e.status_code, message).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse(APIError(500, "internal server error; see the server log").body(),
                            status_code=500)

    async def body_of(request: Request, model):
        state.check_key(request)
        state.check_ready()
        try:
            body = await _read_json(request, settings.max_body_bytes)
        except ClientDisconnect:
            raise _ClientGone() from None
        parsed = protocol.parse(model, body)
        state.check_model(parsed.model)
        return parsed, body

    def log_request(response_id: str, body: dict) -> None:
        if settings.log_requests:
            log.info("request %s: %s", response_id, json.dumps(body, ensure_ascii=False))

    @app.get("/health")
    async def health():
        state.check_healthy()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        return JSONResponse({"version": __version__})

    @app.get("/v1/models")
    async def models(request: Request):
        state.check_key(request)
        state.check_ready()
        return JSONResponse(protocol.model_list(settings.served_model_name, state.created,
                                                state.info.context_limit))

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):
        state.check_key(request)
        state.check_ready()
        state.check_model(name)
        return JSONResponse(protocol.model_card(name, state.created, state.info.context_limit))

    async def generate(request: Request, request_model, stream_class):
        """/v1/completions and /v1/chat/completions: the body parsed by the endpoint's
        request model, its engine requests started, and the answer streamed or whole."""
        try:
            parsed, body = await body_of(request, request_model)
        except _ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        prompts, params = parsed.engine_inputs(state.tokenizer, state.vocab_size,
                                               state.info.context_limit, state.model_defaults)
        response_id = protocol.new_id(parsed.ID_PREFIX)
        log_request(response_id, body)
        job = state.start_job(response_id, prompts, params, parsed.stream, parsed.n)
        created, name, strings = int(time.time()), settings.served_model_name, state.token_strings
        stream = stream_class(parsed, response_id, created, name, strings) \
            if parsed.stream else None
        return await _respond(request, job, stream, lambda outputs: parsed.response_body(
            response_id, created, name, outputs, strings))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, protocol.CompletionRequest, protocol.CompletionStream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, protocol.ChatCompletionRequest,
                              protocol.ChatCompletionStream)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        parsed, _ = await body_of(request, protocol.TokenizeRequest)
        return JSONResponse(protocol.tokenize_response(parsed.token_ids(state.tokenizer),
                                                       state.info.context_limit))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        parsed, _ = await body_of(request, protocol.DetokenizeRequest)
        return JSONResponse(protocol.detokenize_response(parsed.text(state.tokenizer)))

    return _ServedBy(app, settings.replica_name or socket.gethostname())


# ---- running it ---------------------------------------------------------------------------

class _Server(uvicorn.Server):
    """uvicorn's server, with a shutdown that drains the engine first and ends the process
    normally (uvicorn's own signal handling raises the signal again once it is done)."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self.leaving = False

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        state = self.state
        # SIGTERM is how a service manager or an orchestrator stops a replica: announce it
        # on /health before the listener closes. Ctrl-C, or a second signal, stops at once.
        if sig == signal.SIGTERM and not self.leaving and not self.should_exit \
                and state.loop is not None and state.settings.drain_delay_s > 0:
            self.leaving = True
            state.loop.call_soon_threadsafe(state.begin_leaving)
            return
        super().handle_exit(sig, frame)
        if state.loop is not None:
            state.loop.call_soon_threadsafe(state.begin_shutdown)


def _setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s",
                                           "%m-%d %H:%M:%S"))
    for name in ("cupy_llama.server", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False
    log.setLevel(logging.INFO)


def url_of(sock) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_server(settings: ServerSettings, sock, tokenizer, model_config) -> None:
    """Serve on the bound socket until a signal (or the engine's failure) ends it. Raises
    EngineStartError when the model could not be loaded, RuntimeError when the engine
    process died."""
    _setup_logging()
    if settings.replica_name is None:
        port = sock.getsockname()[1]
        settings = replace(settings, replica_name=f"{socket.gethostname()}:{port}")
    state = ServerState(settings, tokenizer, model_config)
    url = url_of(sock)

    def ready(info) -> None:
        print(f"serving {settings.served_model_name!r} at {url}/v1 ({info.device}, context "
              f"{info.context_limit} tokens, loaded in {info.load_seconds:.1f} s); "
              "Ctrl-C stops", flush=True)

    state.on_ready = ready
    config = uvicorn.Config(create_app(state), log_config=None, log_level="warning",
                            access_log=False, lifespan="on", timeout_keep_alive=5,
                            timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 5)
    server = _Server(config, state)
    state.request_exit = lambda: setattr(server, "should_exit", True)
    log.info("listening on %s as %s; loading %s", url, settings.replica_name, settings.model_dir)
    server.run(sockets=[sock])
    if state.failure is not None:
        raise state.failure
