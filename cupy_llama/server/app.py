"""The HTTP server: FastAPI routes over the engine process (engine/async_engine.py).

A request goes: API key, body (size limit, JSON), the endpoint's request model
(server/protocol.py) to prompts and SamplingParams, one engine request per prompt, then
the engine's deltas back through a RequestStream to JSON or server-sent events. Parsing a
body and tokenizing its prompts run in a worker thread (a prompt of megabytes takes seconds
to tokenize), and text that cannot fit the context is refused before it is tokenized, so a
large request delays only itself. The server starts listening before the model is loaded
(/health answers 503 until then) and prints its URL once the engine reports ready. Every
response names the server in an x-served-by header (--replica-name, else the port), so
that behind a load balancer a client sees which replica answered. A client that goes away
aborts its requests: the engine frees their blocks before its next step. An engine that
finishes no step for engine_timeout_s while requests wait for it (a hung device) is
stopped, its requests end with an error, and the server exits with an error, as when the
engine process dies, so that a supervisor restarts it. On SIGTERM /health answers 503 first and
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
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field, replace

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from .. import __version__
from ..engine.async_engine import (ENGINE_STOPPED, AsyncEngine, EngineStartError, Rejected,
                                   RequestStream)
from ..errors import RequestError
from ..outputs import PromptScores, RequestOutput, TokenStrings
from ..reasoning import ReasoningParser
from ..sampling import model_sampling_defaults
from . import protocol
from .metrics import CONTENT_TYPE, Metrics
from .protocol import APIError

DEFAULT_MAX_WAITING = 1024
MAX_BODY_BYTES = 16 << 20        # larger bodies get 413 (a 100k-token prompt is about 1 MB)
# a body up to this size is parsed (and its prompt tokenized) on the event loop, a larger one
# in a worker thread: a 4k-token prompt takes a few milliseconds, while with the work in
# threads the engine got none of a burst of requests until all of it had arrived (a request
# with a constraint, tools or its own chat template is prepared in a thread whatever its
# size: prepared_in_thread)
INLINE_BODY_BYTES = 16 << 10
SHUTDOWN_GRACE_S = 2.0           # how long running requests may go on once a shutdown begins
DRAIN_DELAY_S = 1.0              # SIGTERM: /health 503 for this long before the listener closes
HEADER_TIMEOUT_S = 10.0          # a connection must send a request's headers within this
KEEP_ALIVE_S = 5                 # an idle kept-alive connection is closed after this
MAX_HEADER_BYTES = 16 << 10      # a request line and headers larger than this get 400
LINGER_S = 2.0                   # a refused request's connection drains this long at most
# --engine-timeout's default: far above any legitimate step (a GPU step takes milliseconds,
# its first kernels compile while the model loads); a CPU step of a long prompt on a large
# model can take a minute
ENGINE_TIMEOUT_S = {"cuda": 30.0, "cpu": 300.0}
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
    replica_name: str | None = None  # x-served-by; run_server's default: the port
    engine_timeout_s: float | None = None  # None: ENGINE_TIMEOUT_S of the device
    header_timeout_s: float = HEADER_TIMEOUT_S
    # CORS (vLLM's --allowed-origins, ...): no origin means no cross-origin access
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    tool_call_parser: str | None = None  # None: the format the chat template shows
    # vLLM's --exclude-tools-when-tool-choice-none: such a request's template sees no tools
    exclude_tools_when_tool_choice_none: bool = False
    reasoning_parser: str | None = None  # None: a reply is all content (reasoning.py)
    # vLLM's --trust-request-chat-template: a request's own chat_template is rendered (it
    # runs on the server, sandboxed but unbounded in time and memory); off: a 400
    trust_request_chat_template: bool = False


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
        self.token_strings = TokenStrings(tokenizer)
        self.vocab_size = model_config.vocab_size
        self.model_defaults = model_sampling_defaults(model_config.generation_config)
        self.max_bytes_per_token = protocol.max_bytes_per_token(tokenizer)
        self.reasoning = None if settings.reasoning_parser is None else \
            ReasoningParser.for_tokenizer(settings.reasoning_parser, tokenizer)
        # structured outputs: constraints are compiled here, before a request is queued,
        # so that one that does not compile is a 400 (the engine compiles its own copy)
        self._grammars = None
        self._grammars_lock = threading.Lock()
        self._eos_token_ids = set(model_config.eos_token_ids) | set(
            getattr(tokenizer, "eos_token_ids", ()))
        self.engine = AsyncEngine(settings.model_dir, settings.device, settings.engine_options,
                                  on_stopped=self._engine_stopped, tokenizer=tokenizer)
        self.metrics = Metrics(lambda: (self.engine.stats, max(0, self.engine.num_waiting),
                                        self.engine.generated_tokens),
                               settings.served_model_name)
        self.phase = self.LOADING
        self.info = None
        self.fingerprint: str | None = None  # system_fingerprint, once the device is known
        self.engine_timeout_s: float | None = settings.engine_timeout_s
        self.failure: Exception | None = None  # why the server stopped by itself
        self.created = int(time.time())
        self.jobs: set[_Job] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_ready = lambda info: None
        self.request_exit = lambda: None     # asks the HTTP server to stop
        self._watchdog: asyncio.Task | None = None

    async def load(self) -> None:
        try:
            self.info = await self.engine.start()
        except EngineStartError as e:
            self.failure = e
            self.request_exit()
            return
        info = self.info
        self.fingerprint = protocol.system_fingerprint(self.settings.model_dir, info.device)
        if self.engine_timeout_s is None:
            self.engine_timeout_s = ENGINE_TIMEOUT_S.get(info.device, ENGINE_TIMEOUT_S["cpu"])
        self.metrics.set_cache_config(block_size=info.block_size, num_blocks=info.num_blocks,
                                      prefix_caching=info.prefix_caching)
        if self.phase == self.LOADING:
            self.phase = self.READY
            self._watchdog = asyncio.get_running_loop().create_task(self._watch_engine())
            self.on_ready(self.info)

    def failure_message(self) -> str:
        """What a request cut off by the engine's end is told."""
        if self.failure is not None:
            return f"{self.failure}"
        return "the engine process stopped; the server is shutting down"

    @property
    def max_prompt_bytes(self) -> int:
        """The most bytes of prompt text that can fit the context (see
        protocol.max_bytes_per_token): more is refused before it is tokenized."""
        return self.info.context_limit * self.max_bytes_per_token

    def _engine_stopped(self) -> None:
        if self.failure is None:
            self.failure = RuntimeError("the engine process stopped unexpectedly; see the "
                                        "messages above")
        self.phase = self.DRAINING
        self.request_exit()

    # ---- the watchdog ------------------------------------------------------------------
    async def _watch_engine(self) -> None:
        """Checks, a few times per engine_timeout_s, that an engine with requests to run
        keeps finishing steps."""
        interval = min(1.0, self.engine_timeout_s / 4)
        while self.phase in (self.READY, self.LEAVING):
            await asyncio.sleep(interval)
            self.check_engine()

    def check_engine(self) -> None:
        """An engine that has finished no step for engine_timeout_s while requests run or
        wait (a hung GPU, a stopped process) is stuck: /health answers 503, the engine
        process is killed (its requests end with an error: a 503, or an error event and
        [DONE] in a stream that has begun) and the server exits with an error, as when the
        engine process dies, so that a supervisor restarts it."""
        stalled = self.engine.stalled_for()
        if stalled < self.engine_timeout_s or self.phase == self.DRAINING:
            return
        message = (f"the engine has finished no step for {stalled:.0f} s while requests "
                   f"were waiting for it (--engine-timeout {self.engine_timeout_s:g}); "
                   "stopping, so that a supervisor can restart the server")
        log.error(message)
        self.failure = RuntimeError(message)
        self.phase = self.DRAINING
        self.engine.kill()

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
            count = len(self.jobs)
            log.info("shutting down: %d request%s still running get%s %.0f s to finish", count,
                     "" if count == 1 else "s", "s" if count == 1 else "",
                     self.settings.shutdown_grace_s)
        self.loop.call_later(self.settings.shutdown_grace_s, self._cut_short)

    def _cut_short(self) -> None:
        for job in list(self.jobs):
            job.abort_unfinished()

    # ---- checks every route makes ------------------------------------------------------
    def check_key(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            what = ("missing API key" if not header.strip() else
                    "the Authorization header holds no bearer key")
            raise APIError(401, f"{what}; send the header 'Authorization: Bearer KEY'",
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
        """A request without a model is served by the one model, as vLLM does."""
        served = self.settings.served_model_name
        if name is not None and name != served:
            raise APIError(404, f"model {name!r} does not exist; this server serves "
                                f"{served!r} (see GET /v1/models)", param="model",
                           code="model_not_found")

    def compile_structured(self, params: list) -> None:
        """Compile the requests' constraints (in a worker thread: the first builds the
        compiler, seconds for a large vocabulary); a 400 naming the field for one that does
        not compile, or naming the `structured` extra where llguidance is missing."""
        from ..structured import GrammarCompiler
        for sampling in params:
            spec = sampling.structured
            if spec is None:
                continue
            try:
                with self._grammars_lock:
                    if self._grammars is None:
                        self._grammars = GrammarCompiler.from_tokenizer(
                            self.tokenizer, self.vocab_size, self._eos_token_ids)
                self._grammars.compile(spec)
            except RequestError as e:
                field = spec.source.split(".", 1)[0]
                raise APIError(400, str(e), param=field) from None

    def check_sequences(self, num_prompts: int, n: int) -> None:
        """400 for a request of more sequences than the server could ever take in (no
        retry would help)."""
        new_seqs, limit = num_prompts * n, self.settings.max_waiting
        at_once = self.engine.info.max_num_seqs
        if new_seqs > at_once + limit:
            what = f"{num_prompts} prompts x n={n}" if num_prompts > 1 else f"n={n}"
            raise APIError(400, f"this request needs {new_seqs} sequences ({what}) but the "
                                f"server runs {at_once} at once and lets {limit} wait "
                                "(--max-num-seqs, --max-waiting); send fewer prompts or a "
                                "smaller n", param="n" if n > 1 else "prompt")

    def check_sizes(self, body) -> None:
        """Bounds a body's lists must keep, checked on its JSON before the request model
        reads it and its prompts are rendered and tokenized (seconds for a body of
        hundreds of thousands of entries, which would hold up the other streams): no more
        messages than the context has tokens (every template writes each message), no more
        prompts than the server could take in."""
        if not isinstance(body, dict):
            return
        messages, prompt = body.get("messages"), body.get("prompt")
        context = self.info.context_limit
        if isinstance(messages, list) and len(messages) > context:
            raise APIError(400, f"messages has {len(messages):,} entries, more than the "
                                f"model's context of {context:,} tokens can hold; send fewer",
                           param="messages", code="context_length_exceeded")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            n = body.get("n")
            self.check_sequences(len(prompt), n if isinstance(n, int) and n > 0 else 1)

    def start_job(self, response_id: str, prompts: list[list[int]], params: list,
                  stream: bool, n: int) -> "_Job":
        self.check_sequences(len(prompts), n)
        new_seqs, limit = len(prompts) * n, self.settings.max_waiting
        would_wait = self.engine.num_would_wait(new_seqs)
        if would_wait > limit:
            counted = f"{would_wait} sequence{'s' if would_wait != 1 else ''}"
            raise APIError(503, f"the server is busy: {counted} would wait for a free slot, "
                                f"more than --max-waiting {limit}; retry in a moment",
                           code="server_busy", headers=RETRY_AFTER)
        job = _Job(self, response_id, prompts, n, stream)
        for request_id, prompt, sampling in zip(job.request_ids, prompts, params):
            self.metrics.request_params(sampling.max_tokens, sampling.n)
            self.engine.add(request_id, prompt, sampling, stream, job.sink)
        self.jobs.add(job)
        return job


# ---- one HTTP request's engine requests ---------------------------------------------------

class _Choice:
    __slots__ = ("texts", "token_ids", "logprobs", "finish_reason", "stop_reason")

    def __init__(self):
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list | None = None  # (token id, logprob, top) per token, when asked
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # the stop string or token that ended it


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
        self._prompt_scores = [None] * len(prompts)  # per prompt, where asked
        self._opened: set = set()  # (prompt index, choice index) of choices streamed
        self.num_unfinished = len(prompts) * n
        self.arrival = time.monotonic()

    @property
    def done(self) -> bool:
        return self.num_unfinished == 0

    async def next_updates(self) -> dict:
        """Everything that arrived since the last call, merged per choice:
        {(prompt index, choice index): [text, token_ids, logprobs, finish_reason,
        stop_reason]}."""
        items = await self.sink.get()
        now = time.monotonic()
        updates: dict = {}
        for item in items:
            if not isinstance(item, tuple):  # an EngineDelta, else the engine's word
                self._fail(item)
            (request_id, index, text, token_ids, finish_reason, logprobs, num_cached, times,
             prompt_logprobs, stop_reason) = item
            i = self._prompt_of[request_id]
            if prompt_logprobs is not None and self._prompt_scores[i] is None:
                self._prompt_scores[i] = PromptScores(*prompt_logprobs)
            choice = self.choices[i][index]
            if choice.finish_reason is not None:
                continue
            if index == 0:  # the sample that computed the prompt
                self._cached[i] = num_cached
            self._record(i, choice, text, token_ids, logprobs, finish_reason, stop_reason,
                         times, now)
            update = updates.get((i, index))
            if update is None:
                updates[(i, index)] = [text, list(token_ids), logprobs, finish_reason,
                                       stop_reason]
            else:
                update[0] += text
                update[1] += token_ids
                if logprobs:
                    update[2] = (update[2] or []) + logprobs
                update[3], update[4] = finish_reason, stop_reason
        return updates

    def _record(self, i: int, choice: _Choice, text: str, token_ids: list[int], logprobs,
                finish_reason: str | None, stop_reason, times, now: float) -> None:
        metrics = self.metrics
        if not self._admitted[i]:
            self._admitted[i] = True
            metrics.prompt_tokens.inc(len(self.prompts[i]))
        if text:
            choice.texts.append(text)
        if token_ids:
            choice.token_ids += token_ids
            if logprobs is not None:
                choice.logprobs = (choice.logprobs or []) + logprobs
        if finish_reason is not None:
            choice.finish_reason, choice.stop_reason = finish_reason, stop_reason
            self.num_unfinished -= 1
            if all(c.finish_reason is not None for c in self.choices[i]):
                self._running.discard(self.request_ids[i])
            metrics.request_finished(finish_reason, len(self.prompts[i]),
                                     len(choice.token_ids), self.arrival, times, now)

    def _fail(self, item) -> None:
        if item is DISCONNECTED:
            raise _ClientGone()
        if isinstance(item, Rejected):
            self._running.discard(item.request_id)
            raise protocol.request_error(item.message)
        if item is ENGINE_STOPPED:
            self._running.clear()
            raise APIError(503, self.state.failure_message(), code="engine_stopped")
        raise TypeError(f"unexpected item {item!r}")

    async def final_outputs(self) -> list[list[RequestOutput]]:
        while not self.done:
            await self.next_updates()
        return [[RequestOutput(request_id, prompt, list(c.token_ids), "".join(c.texts),
                               c.finish_reason, logprobs=c.logprobs, index=index,
                               num_cached_tokens=cached, prompt_scores=scored,
                               stop_reason=c.stop_reason)
                 for index, c in enumerate(choices)]
                for request_id, prompt, choices, cached, scored in zip(
                    self.request_ids, self.prompts, self.choices, self._cached,
                    self._prompt_scores)]

    def sse(self, stream_builder, updates: dict) -> bytes:
        parts = []
        for (i, j), (text, token_ids, logprobs, finish_reason, stop_reason) in updates.items():
            usage = None
            if stream_builder.continuous_usage:  # this choice's so far, as vLLM counts it
                usage = protocol.usage(len(self.prompts[i]), len(self.choices[i][j].token_ids))
            if (i, j) not in self._opened:  # its first chunks: echo's prompt, where asked
                self._opened.add((i, j))
                opening_usage = None if usage is None else protocol.usage(len(self.prompts[i]), 0)
                for chunk in stream_builder.opening(i * self.n + j, i, self.prompts,
                                                    self._prompt_scores[i], opening_usage):
                    parts.append(protocol.sse_event(chunk))
            event = stream_builder.text_event(i * self.n + j, text, finish_reason, usage)
            if event is not None:
                parts.append(event)
                continue
            for chunk in stream_builder.chunks(i * self.n + j, text, token_ids, logprobs,
                                               finish_reason, usage, stop_reason):
                parts.append(protocol.sse_event(chunk))
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
                        self.metrics.request_aborted()
            self.abort_unfinished()
            self._running.clear()
        self.state.jobs.discard(self)
        if self.state.settings.log_requests:
            texts = ["".join(c.texts) for choices in self.choices for c in choices]
            log.info("response %s: %s", self.response_id, json.dumps(texts, ensure_ascii=False))


class _ErrorResponse(JSONResponse):
    """An error in OpenAI's shape, as ASCII JSON: a message may quote a request's value, and
    a lone surrogate (a request's "\\ud800") has no UTF-8 form; escaped, it reads back the
    same."""

    def __init__(self, error: APIError):
        super().__init__(error.body(), status_code=error.status, headers=error.headers)

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


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
            yield protocol.sse_event(stream_builder.usage_chunk(job.usage()))
        yield SSE_DONE
    except _ClientGone:
        return
    except APIError as e:  # the engine went away mid-stream
        yield b"data: " + json.dumps(e.body()).encode() + b"\n\n"
        yield SSE_DONE


async def _read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request's body, at most limit bytes, each of its parts arriving within
    timeout_s of the one before (a client that stops sending its body would otherwise hold
    the connection for ever): APIError 413 or 408 otherwise."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.strip().isdigit():
            raise APIError(400, f"Content-Length {length!r} is not a number")
        if int(length) > limit:
            raise APIError(413, f"the request body has {int(length):,} bytes, more than the "
                                f"limit of {limit:,}", code="request_too_large",
                           headers={"Connection": "close"})
    body = bytearray()
    parts = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(parts.__anext__(), timeout_s)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body stopped arriving for {timeout_s:g} s; send "
                                "it whole", code="request_timeout",
                           headers={"Connection": "close"}) from None
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the request body is larger than the limit of {limit:,} "
                                "bytes", code="request_too_large",
                           headers={"Connection": "close"})
    return bytes(body)


def _decode_json(body: bytes):
    """The body's JSON; APIError(400) for what Python's parser refuses, valid JSON among it
    (nesting past the interpreter's recursion limit, integers of more than 4300 digits)."""
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise APIError(400, "the request body nests arrays or objects too deeply; send at "
                            "most a few hundred levels") from None
    except ValueError:  # the int-string conversion limit
        raise APIError(400, f"the request body holds an integer of more than "
                            f"{sys.get_int_max_str_digits()} digits; send smaller numbers") \
            from None


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
    stream). No bodies: those are logged by the routes, and only with --log-requests.
    Successful /health probes (a balancer's, every few seconds) log at DEBUG. A request
    cancelled before its answer started (a second Ctrl-C ends the event loop, which cancels
    every request still running) is answered 503 shutting_down, as one that arrives while
    the server drains, not with the web server's plain-text 500."""

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
        except asyncio.CancelledError:
            if not status:
                error = APIError(503, "the server stopped before answering; send the request "
                                      "again once it is back", code="shutting_down")
                await send_and_note({"type": "http.response.start", "status": 503,
                                     "headers": [(b"content-type", b"application/json"),
                                                 (b"connection", b"close")]})
                await send_and_note({"type": "http.response.body",
                                     "body": json.dumps(error.body()).encode()})
            raise
        finally:
            code = status[0] if status else 500
            level = logging.DEBUG if scope["path"] == "/health" and code == 200 else logging.INFO
            log.log(level, "%s %s %s %.1f ms", scope["method"], scope["path"], code,
                    1e3 * (time.perf_counter() - started))


def prepared_in_thread(parsed, decoded) -> bool:
    """Whether a request small enough to parse on the event loop still has its prompt
    prepared in a worker thread: where it brings its own chat template (a template may
    loop a while) or names a constraint or tools (their grammars and schemas are
    converted and checked then: GBNF's conversion takes a quarter of a second at 16 KiB)."""
    if getattr(parsed, "chat_template", None) is not None:
        return True
    return isinstance(decoded, dict) and any(decoded.get(name) is not None
                                             for name in protocol.CONSTRAINT_FIELDS)


def create_app(state: ServerState):
    """The ASGI application: FastAPI's routes inside _ServedBy."""
    settings = state.settings

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.loop = asyncio.get_running_loop()
        loading = asyncio.create_task(state.load())
        try:
            yield
        except asyncio.CancelledError:
            # a second Ctrl-C: uvicorn leaves without the shutdown event, and the loop's
            # end cancels the wait for it here; the engine still closes, and nothing is
            # left for starlette to report as a failed shutdown (a traceback)
            pass
        finally:
            state.phase = state.DRAINING
            loading.cancel()
            await state.engine.close()

    app = FastAPI(title="cupy-llama", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url=None, lifespan=lifespan)
    if settings.allowed_origins:  # inside the access log: preflight requests are logged
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=list(settings.allowed_methods),
                           allow_headers=list(settings.allowed_headers))
    app.add_middleware(_AccessLog)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return _ErrorResponse(e)

    @app.exception_handler(_ClientGone)
    async def client_gone(request, e: _ClientGone):
        # the client left while its body came in (any route): nobody reads the answer,
        # the access log shows it
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        if e.status_code == 404:
            routes = sorted(f"{method} {route.path}" for route in app.routes
                            if isinstance(route, APIRoute) and route.include_in_schema
                            for method in route.methods)
            message = (f"{request.method} {request.url.path} is not served here; the routes "
                       f"are {', '.join(routes)}")
        else:
            message = f"{request.method} {request.url.path}: {e.detail}"
        # the headers stay: a 405's Allow names the methods the route takes
        return _ErrorResponse(APIError(e.status_code, message, headers=e.headers))

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        # where it failed, not what it said: an exception's message may quote the request
        frames = "".join(traceback.format_tb(e.__traceback__))
        log.error("internal error on %s %s: %s (message withheld: it may quote the "
                  "request)\nTraceback (most recent call last):\n%s%s", request.method,
                  request.url.path, type(e).__name__, frames, type(e).__name__)
        return _ErrorResponse(APIError(500, "internal server error; see the server log"))

    async def body_of(request: Request, model, then=None):
        """(the body parsed by the endpoint's request model, its JSON, then(parsed) or None):
        the parse, the checks of its model and chat template, and `then`, at once for a
        body of up to INLINE_BODY_BYTES, else in one hop to a worker thread (a large body
        takes a while); `then` in a thread too where prepared_in_thread says. So a burst of
        requests reaches the engine as each is read: with the work in threads, the engine
        got none of a burst until all of it had arrived (benchmarks/NOTES.md, "The served
        run's first step")."""
        state.check_key(request)
        state.check_ready()
        try:
            body = await _read_body(request, settings.max_body_bytes,
                                    settings.header_timeout_s)
        except ClientDisconnect:
            raise _ClientGone() from None

        def parse():
            decoded = _decode_json(body)
            if model in (protocol.CompletionRequest, protocol.ChatCompletionRequest):
                state.check_sizes(decoded)  # before the request model reads every entry
            parsed = protocol.parse(model, decoded)
            state.check_model(parsed.model)
            template = getattr(parsed, "chat_template", None)
            named = getattr(state.tokenizer, "named_templates", {})
            if (template is not None and not settings.trust_request_chat_template
                    and template not in named):
                names = f" (send one's name: {', '.join(map(repr, named))})" if named else ""
                raise APIError(
                    400, f"chat_template: this server renders only the model's chat "
                         f"templates{names}; start it with --trust-request-chat-template to "
                         f"take a request's own", param="chat_template",
                    code="unsupported_parameter")
            return parsed, decoded

        def parse_then():
            parsed, decoded = parse()
            return parsed, decoded, None if then is None else then(parsed)

        if len(body) > INLINE_BODY_BYTES:
            return await asyncio.to_thread(parse_then)
        parsed, decoded = parse()
        if then is None:
            return parsed, decoded, None
        if prepared_in_thread(parsed, decoded):
            return parsed, decoded, await asyncio.to_thread(then, parsed)
        return parsed, decoded, then(parsed)

    def log_request(response_id: str, body: dict) -> None:
        if settings.log_requests:
            log.info("request %s: %s", response_id, json.dumps(body, ensure_ascii=False))

    def route(method: str, path: str, prefixed_too: bool = False):
        """A route; with prefixed_too also without its /v1 prefix (llama.cpp's server answers
        both, and some clients leave the prefix out)."""
        def add(handler):
            paths = [path, path.removeprefix("/v1")] if prefixed_too else [path]
            for i, each in enumerate(paths):
                app.add_api_route(each, handler, methods=[method], include_in_schema=i == 0)
            return handler
        return add

    @route("GET", "/health")
    async def health():
        state.check_healthy()
        return JSONResponse({"status": "ok"})

    @route("GET", "/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @route("GET", "/version")
    async def version():
        return JSONResponse({"version": __version__})

    @route("GET", "/v1/models", prefixed_too=True)
    async def models(request: Request):
        state.check_key(request)
        state.check_ready()
        return JSONResponse(protocol.model_list(settings.served_model_name, state.created,
                                                state.info.context_limit))

    @route("GET", "/v1/models/{name:path}", prefixed_too=True)
    async def model(name: str, request: Request):
        state.check_key(request)
        state.check_ready()
        state.check_model(name)
        return JSONResponse(protocol.model_card(name, state.created, state.info.context_limit))

    async def generate(request: Request, request_model, stream_class):
        """/v1/completions and /v1/chat/completions: the body parsed by the endpoint's
        request model and its prompts tokenized (body_of), its engine requests started, and
        the answer streamed or whole."""
        def engine_inputs(parsed):
            if isinstance(parsed, protocol.ChatCompletionRequest):
                parsed.set_tool_parser(settings.tool_call_parser,
                                       settings.exclude_tools_when_tool_choice_none)
                parsed.set_reasoning_parser(state.reasoning)
            return parsed.engine_inputs(state.tokenizer, state.vocab_size,
                                        state.info.context_limit, state.model_defaults,
                                        state.max_prompt_bytes)

        parsed, body, (prompts, params) = await body_of(request, request_model, engine_inputs)
        if params and params[0].structured is not None:
            await asyncio.to_thread(state.compile_structured, params)
        state.check_ready()  # it may have begun to stop meanwhile
        response_id = protocol.new_id(parsed.ID_PREFIX)
        log_request(response_id, body)
        job = state.start_job(response_id, prompts, params, parsed.stream,
                              parsed.samples_per_prompt)
        created, name, strings = int(time.time()), settings.served_model_name, state.token_strings
        stream = stream_class(parsed, response_id, created, name, strings, state.fingerprint) \
            if parsed.stream else None
        return await _respond(request, job, stream, lambda outputs: parsed.response_body(
            response_id, created, name, outputs, strings, state.fingerprint))

    @route("POST", "/v1/completions", prefixed_too=True)
    async def completions(request: Request):
        return await generate(request, protocol.CompletionRequest, protocol.CompletionStream)

    @route("POST", "/v1/chat/completions", prefixed_too=True)
    async def chat_completions(request: Request):
        return await generate(request, protocol.ChatCompletionRequest,
                              protocol.ChatCompletionStream)

    @route("POST", "/tokenize")
    async def tokenize(request: Request):
        parsed, _, token_ids = await body_of(
            request, protocol.TokenizeRequest,
            lambda parsed: parsed.token_ids(state.tokenizer, state.max_prompt_bytes))
        return JSONResponse(parsed.response(state.tokenizer, token_ids,
                                            state.info.context_limit))

    @route("GET", "/tokenizer_info")
    async def tokenizer_info(request: Request):
        """vLLM's: the tokenizer's special tokens and chat template, which clients such as
        lm-evaluation-harness read to tokenize through /tokenize (no tokenizer download)."""
        state.check_key(request)
        state.check_ready()
        return JSONResponse(protocol.tokenizer_info(state.tokenizer, state.info.context_limit))

    @route("POST", "/detokenize")
    async def detokenize(request: Request):
        parsed, _, _ = await body_of(request, protocol.DetokenizeRequest)
        return JSONResponse(protocol.detokenize_response(parsed.text(state.tokenizer,
                                                                         state.vocab_size)))

    return _ServedBy(app, settings.replica_name or "cupy-llama")


# ---- running it ---------------------------------------------------------------------------

class _HTTP(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with two changes. A request the HTTP layer refuses (a bad
    request line or header, a bad Content-Length, headers past MAX_HEADER_BYTES) gets
    OpenAI's error shape instead of plain text. And a connection must send each request's
    headers within header_timeout_s (uvicorn times out idle kept-alive connections only, so
    a client that connects and sends nothing, or its headers a byte at a time, would hold
    a connection for ever)."""

    header_timeout_s = HEADER_TIMEOUT_S  # run_server sets the settings' value

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        self._lingering = False
        self._arm_header_timer()
        # h11 bounds only headers that are still arriving: a whole head that came in one
        # read is parsed whatever its size. So where a request is next (the client idle),
        # the bytes its parse takes from the receive buffer are the head's as sent (the
        # parsed request has lost the headers' optional whitespace)
        conn, next_event = self.conn, self.conn.next_event

        def next_event_within_bound():
            if conn.their_state is not h11.IDLE:
                return next_event()
            before = len(conn.trailing_data[0])
            event = next_event()
            if isinstance(event, h11.Request) and \
                    before - len(conn.trailing_data[0]) > MAX_HEADER_BYTES:
                raise h11.RemoteProtocolError("request headers too large")
            return event

        self.conn.next_event = next_event_within_bound

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._waiting_cycle = self.cycle  # a new cycle: its headers came
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.cycle is self._waiting_cycle and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # the rest of a refused request: read and dropped
            return
        super().data_received(data)
        if self._header_timer is not None and self.cycle is not self._waiting_cycle:
            self._header_timer.cancel()
            self._header_timer = None

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm_header_timer()  # before the next cycle starts (a pipelined request)
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(APIError(400, "the request is not valid HTTP/1.1 (its request line, "
                                        "a header or Content-Length is malformed, or the "
                                        f"headers are larger than {MAX_HEADER_BYTES // 1024} "
                                        "KiB)", code="invalid_http_request").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self._close_lingering()

    def _close_lingering(self) -> None:
        """Close after a refusal without losing it: a socket closed with unread bytes (the
        rest of a large head still arriving) resets the connection, and the client may
        lose the answer with it. So send the answer and our end of the stream, drop what
        still comes, and close once the client has closed its end, or after LINGER_S.
        A refusal inside a request whose head was taken (a malformed body) closes at
        once, as uvicorn does: its application may still answer, and must find the
        connection gone rather than write past the refusal."""
        cycle = self.cycle
        if not self.transport.can_write_eof() or (
                cycle is not None and not cycle.response_complete):
            self.transport.close()
            return
        self._lingering = True
        if self._header_timer is not None:  # its close would reset the connection too
            self._header_timer.cancel()
            self._header_timer = None
        self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    def eof_received(self):
        if self._lingering:
            self.transport.close()
        return super().eof_received()


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


def _setup_logging() -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s",
                                           "%m-%d %H:%M:%S"))
    for name in ("cupy_llama.server", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False
    log.setLevel(logging.INFO)
    return handler


def url_of(sock) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def ready_line(settings: ServerSettings, url: str, info) -> str:
    """The one line on stdout once the model is loaded: the name clients send as "model",
    the URL, and whether they need the API key."""
    key = "API key required" if settings.api_key is not None else "no API key"
    return (f"serving {settings.served_model_name!r} at {url}/v1 ({info.device}, context "
            f"{info.context_limit} tokens, {key}, loaded in {info.load_seconds:.1f} s); "
            "Ctrl-C stops")


def run_server(settings: ServerSettings, sock, tokenizer, model_config) -> None:
    """Serve on the bound socket until a signal (or the engine's failure) ends it. Raises
    EngineStartError when the model could not be loaded, RuntimeError when the engine
    process died or got stuck."""
    handler = _setup_logging()
    if settings.replica_name is None:
        settings = replace(settings, replica_name=str(sock.getsockname()[1]))
    state = ServerState(settings, tokenizer, model_config)
    url = url_of(sock)
    state.on_ready = lambda info: print(ready_line(settings, url, info), flush=True)
    http = type("HTTP", (_HTTP,), {"header_timeout_s": settings.header_timeout_s})
    config = uvicorn.Config(create_app(state), log_config=None, log_level="warning",
                            access_log=False, lifespan="on", http=http,
                            timeout_keep_alive=KEEP_ALIVE_S,
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                            timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 5)
    server = _Server(config, state)
    # a second Ctrl-C (uvicorn's forced exit) cancels the requests still running, and
    # uvicorn would log each one's CancelledError as a traceback: they were asked to stop
    handler.addFilter(lambda record: not (
        server.force_exit and record.exc_info is not None
        and isinstance(record.exc_info[1], asyncio.CancelledError)))
    state.request_exit = lambda: setattr(server, "should_exit", True)
    log.info("listening on %s as replica %s; loading %s", url, settings.replica_name,
             settings.model_dir)
    server.run(sockets=[sock])
    if state.failure is not None:
        raise state.failure
