"""The engine loop behind `cupy-llama serve`: an engine process, and the server's handle on it.

```
server process (asyncio)                         engine process
  AsyncEngine.add / abort  ── frames over a ──►  _EngineLoop: take messages, LLMEngine.step(),
  RequestStream per request ◄── socket pair ───  send every step's deltas and the stats
```

The engine runs in a process of its own, not in a thread beside the HTTP event loop,
because the two would share the interpreter lock and under load the handlers need more
host time than a step lasts. Measured on the NumPy backend (tiny model, one BLAS thread,
a 2-core machine), the server process spends 45-50 us of CPU per chunk it writes (JSON,
ASGI, h11; mostly the socket write itself), against 1.4-2.3 ms of host time per engine
step at 16 sequences and 6-8 ms at 64: the handlers' work is about half the engine's own.
On the H200 the step is 3-4 ms for about 250 outputs, so one process would spend several
milliseconds per step writing chunks while the GPU waits; two processes overlap them (on
that 2-core machine the client, the server and the engine saturate both cores and the two
designs measure within noise of each other: 4.0-4.8k against 4.1-4.8k tok/s at 16 and 64
sequences). vLLM v1 (EngineCore) and SGLang (its scheduler process) split the same way.

The channel: length-prefixed pickles of plain tuples and dicts over a Unix socket pair,
both ends private to this program (pickle is never read from anywhere else). The engine
process never blocks on the server: what the server has not read yet waits in the engine
process's outbox while the engine keeps stepping; the server reads whatever has arrived
at each turn of its event loop and hands each request's deltas to its RequestStream,
which gives a handler everything that queued up since it last looked, so a handler that
fell behind writes one merged chunk instead of a backlog of one chunk per token.

Messages, server to engine: ("settings", model_dir, device, engine_options) first, then
("add", request_id, prompt_ids, params, stream, text), ("abort", request_id[, index]),
("stop",). With text False (the server has the tokenizer, as `serve` does) the engine
sends token ids only: the server process detokenizes and matches stop strings
(DetokenizedSample), and ends a sample at its stop string with an abort of that sample. Engine to server: ("ready", info) or ("failed", kind,
message) once, then ("out", deltas, rejected, stats) after every step that has output
(and after any message handled while idle), at least every PROGRESS_EVERY_S while it
steps (the server's sign that a step finished: requests that are not streamed have no
output until they end), once more as it goes idle (the counters with its last turn's
time in them, for /metrics), and ("crashed", traceback) if the loop dies. The deltas are
the engine's EngineDeltas (engine/output_processor.py) sent as plain tuples, which pickle
about 6x faster than a tuple subclass, and named again on arrival. An "out" message may
carry a fifth field, the step's TokenColumns as a plain tuple of three lists: the one-token
deltas of the streamed samples whose text the server makes, one entry per sample rather
than a tuple each; they come after the message's deltas.
"""
from __future__ import annotations

import asyncio
import bisect
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

from .output_processor import DetokenizedSample, EngineDelta, TokenColumns

# the upper bounds of the tokens-per-step histogram (vLLM's iteration_tokens_total)
COMPILE_POLL_S = 0.005  # an idle loop's wait for a grammar compiling, between messages
# the longest a stepping engine goes without a message to the server (its stall watch,
# --engine-timeout, counts from the last one: a quarter of the shortest timeout serve
# takes, 1 s); steps with output send one anyway
PROGRESS_EVERY_S = 0.25
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

_HEADER = struct.Struct("<I")
_READ_SIZE = 1 << 20
STOP_TIMEOUT_S = 10.0  # how long close() waits for the engine process before killing it


def _frame(message) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


class _FrameReader:
    """Splits a byte stream into the messages _frame() wrote."""

    def __init__(self):
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list:
        buffer = self._buffer
        buffer += data
        messages, start = [], 0
        while len(buffer) - start >= _HEADER.size:
            (length,) = _HEADER.unpack_from(buffer, start)
            end = start + _HEADER.size + length
            if end > len(buffer):
                break
            messages.append(pickle.loads(bytes(buffer[start + _HEADER.size:end])))
            start = end
        del buffer[:start]
        return messages


# ---- the engine process ---------------------------------------------------------------

class _Channel:
    """The engine process's end: a non-blocking socket, an outbox for what the server has
    not taken yet, select() to wait for work when the engine is idle."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        sock.setblocking(False)
        self.reader = _FrameReader()
        self.outbox = bytearray()

    def send(self, message) -> None:
        self.outbox += _frame(message)
        self._flush()

    def send_all_now(self, message) -> None:
        """Send and wait until it is written (the last message before exiting)."""
        self.send(message)
        while self.outbox:
            try:
                select.select([], [self.sock], [], 5.0)
                self._flush()
            except OSError:
                return

    def _flush(self) -> None:
        while self.outbox:
            try:
                sent = self.sock.send(self.outbox)
            except (BlockingIOError, InterruptedError):
                return
            del self.outbox[:sent]

    def receive(self, wait: bool) -> list | None:
        """The messages that have arrived; with wait, blocks until there is one. Writes
        the outbox meanwhile. None once the server has closed its end."""
        messages: list = []
        sock = self.sock
        while True:
            timeout = None if wait and not messages else 0
            readable, writable, _ = select.select([sock], [sock] if self.outbox else [], [],
                                                  timeout)
            if writable:
                self._flush()
            if readable:
                try:
                    data = sock.recv(_READ_SIZE)
                except (BlockingIOError, InterruptedError):
                    continue
                if not data:
                    return None
                messages.extend(self.reader.feed(data))
                continue  # take whatever else is already there
            if timeout == 0:
                return messages


class _EngineLoop:
    """Steps the engine while requests arrive. Requests are added and aborted between
    steps, in the order the server sent them."""

    def __init__(self, engine, channel: _Channel):
        self.engine = engine
        self.channel = channel
        self.num_added_seqs = 0  # sequences of the requests taken in (n per request)
        self.step_seconds = 0.0   # inside LLMEngine.step()
        self.loop_seconds = 0.0   # whole turns that stepped: messages, step, sending
        # steps by the tokens they computed: counts per ITERATION_TOKEN_BUCKETS bound, + inf
        self.iteration_tokens = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self.iteration_tokens_sum = 0

    def run(self) -> None:
        engine, channel = self.engine, self.channel
        sent_at = time.monotonic()
        # constrained requests whose grammar compiles on a worker thread, in arrival order:
        # (future, add message); compiling never holds up the steps
        compiling: list = []
        engine.outputs = None  # the deltas go to the server as they are
        while True:
            busy = engine.has_unfinished_requests()
            turn_started = time.perf_counter()
            messages = channel.receive(wait=not busy and not compiling)
            if messages is None:
                return  # the server is gone
            if not busy:
                turn_started = time.perf_counter()  # idle waiting is no part of a turn
            deltas, rejected, columns = [], [], None
            for message in messages:
                kind = message[0]
                if kind == "add":
                    params = message[3]
                    if params.structured is not None:
                        compiling.append((engine.compile_structured_async(params.structured),
                                          message))
                    else:
                        self._add(message, rejected)
                elif kind == "abort":  # the final delta of each sample still running
                    if len(message) == 2:  # the whole request: also one still compiling
                        compiling, dropped = self._drop_compiling(compiling, message[1])
                        deltas += dropped
                    deltas += engine.abort_deltas(*message[1:])  # (request id[, index])
                elif kind == "stop":
                    return  # engine.close() aborts what still runs and frees the device
            if compiling and not busy:  # nothing to step meanwhile: wait a little for them
                futures.wait([compiling[0][0]], timeout=COMPILE_POLL_S)
            while compiling and compiling[0][0].done():
                future, message = compiling.pop(0)
                self._add(message, rejected, future.exception())
            if engine.has_unfinished_requests():
                started = time.perf_counter()
                columns = TokenColumns.empty()
                step_deltas = engine.step_deltas(columns)
                self.step_seconds += time.perf_counter() - started
                if engine.num_step_tokens:
                    self.iteration_tokens[bisect.bisect_left(ITERATION_TOKEN_BUCKETS,
                                                             engine.num_step_tokens)] += 1
                    self.iteration_tokens_sum += engine.num_step_tokens
                deltas += step_deltas
                stepped = True
            else:
                stepped = False
            if (deltas or rejected or messages or (columns and columns.request_ids)
                    or (stepped and time.monotonic() - sent_at >= PROGRESS_EVERY_S)):
                channel.send(self.step_message(deltas, rejected, columns))
                sent_at = time.monotonic()
            if stepped:
                self.loop_seconds += time.perf_counter() - turn_started
                if not engine.has_unfinished_requests():  # idle from here: the counters
                    channel.send(self.step_message([], []))  # with this turn's time in them

    def _drop_compiling(self, compiling: list, request_id: str) -> tuple[list, list]:
        """(compiling without the request, the final "abort" delta of each of its samples):
        a request aborted while its grammar compiles ends here, as one the engine had
        taken in would, and its sequences count as taken."""
        kept, dropped = [], []
        for future, message in compiling:
            if message[1] != request_id:
                kept.append((future, message))
                continue
            num_samples = message[3].n
            self.num_added_seqs += num_samples
            dropped += [EngineDelta(request_id, index, "", [], "abort")
                        for index in range(num_samples)]
        return kept, dropped

    def _add(self, message, rejected: list, compile_error: BaseException | None = None) -> None:
        """Add a request (compile_error: why its grammar did not compile, or None)."""
        from ..errors import RequestError
        _, request_id, prompt_ids, params, stream, text = message
        self.num_added_seqs += params.n
        try:
            if compile_error is not None:
                raise compile_error
            self.engine.add_request(prompt_ids, params, request_id=request_id, stream=stream,
                                    text=text)
        except RequestError as e:
            rejected.append((request_id, str(e)))

    def step_message(self, deltas: list[EngineDelta], rejected: list,
                     columns: TokenColumns | None = None) -> tuple:
        """The "out" message of a turn: its deltas as plain tuples, the requests refused,
        the stats, and the step's TokenColumns where it has entries."""
        message = ("out", list(map(tuple, deltas)), rejected, self.stats())
        if columns is not None and columns.request_ids:
            message += (tuple(columns),)
        return message

    def stats(self) -> dict:
        """The engine's EngineStats as a dict, and the loop's own counts and times."""
        # vars(), not asdict(): the fields are plain values, and this runs every step
        return {**vars(self.engine.stats()), "num_added_seqs": self.num_added_seqs,
                "step_seconds": self.step_seconds, "loop_seconds": self.loop_seconds,
                "iteration_tokens": self.iteration_tokens,
                "iteration_tokens_sum": self.iteration_tokens_sum}


def _as_delta(output) -> EngineDelta:
    """A RequestOutput's delta as the EngineDelta it was made from (for an engine run in
    the server's own process, as the tests do)."""
    logprobs = output.logprobs
    if logprobs is not None:
        logprobs = [(entry.token_id, entry.logprob, entry.top)
                    for entry in logprobs[len(logprobs) - len(output.delta_token_ids):]]
    times = output.times
    if times is not None:
        times = (times.added, times.scheduled, times.first_token, times.last_token)
    scores, prompt_logprobs = output.prompt_scores, None
    if scores is not None and len(output.token_ids) == len(output.delta_token_ids):
        prompt_logprobs = (scores.values, scores.ids, scores.ranks)  # with the first delta only
    return EngineDelta(output.request_id, output.index, output.delta, output.delta_token_ids,
                       output.finish_reason, logprobs, output.num_cached_tokens, times,
                       prompt_logprobs, output.stop_reason)


def _engine_info(engine) -> dict:
    return {"device": engine.device, "context_limit": engine.context_limit,
            "num_blocks": engine.stats().num_blocks, "block_size": engine.backend.block_size,
            "max_num_seqs": engine.engine_config.max_num_seqs,
            "prefix_caching": engine.engine_config.enable_prefix_caching,
            "eos_token_ids": tuple(sorted(engine.eos_token_ids)),
            "load_seconds": engine.load_seconds, "pid": os.getpid()}


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _stderr_fd() -> int | None:
    """Where the engine process's stdout goes: the server's stderr (its stdout carries
    only the ready line), or the server's stdout when stderr is no file."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def engine_process_main(fd: int) -> None:
    """The engine process: read the settings, load the model, run the loop."""
    # Ctrl-C reaches the whole process group and a service manager may signal every
    # process of the server: the server decides when the engine stops (a "stop" message,
    # or its end of the socket closing)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    channel = _Channel(socket.socket(fileno=fd))
    settings = channel.receive(wait=True)
    if not settings:
        return
    _, model_dir, device, engine_options = settings[0]
    from ..errors import CupyLlamaError, OptionError
    from .llm_engine import LLMEngine
    try:
        engine = LLMEngine.load(model_dir, device, log=_stderr, **engine_options)
    except OptionError as e:
        return channel.send_all_now(("failed", "option", str(e)))
    except CupyLlamaError as e:
        return channel.send_all_now(("failed", "error", str(e)))
    except MemoryError as e:
        detail = (str(e).strip().splitlines() or ["out of memory"])[0]
        return channel.send_all_now(("failed", "memory", detail))
    except BaseException:
        return channel.send_all_now(("failed", "crash", traceback.format_exc()))
    try:
        channel.send(("ready", _engine_info(engine)))
        _EngineLoop(engine, channel).run()
    except BaseException:
        channel.send_all_now(("crashed", traceback.format_exc()))
        raise SystemExit(1)
    finally:
        engine.close()


# ---- the server's side ----------------------------------------------------------------

class EngineStartError(Exception):
    """The engine process could not load the model. kind: "option" (a bad engine option),
    "error" (a model or device error the user can fix), "memory" or "crash"."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class EngineInfo:
    device: str
    context_limit: int      # the longest sequence (prompt + output) the engine runs
    num_blocks: int
    block_size: int
    max_num_seqs: int
    load_seconds: float
    pid: int
    prefix_caching: bool = True
    eos_token_ids: tuple = ()  # the tokens that end a sample with no text of their own


class Rejected:
    """A request the engine refused (its message says why)."""
    __slots__ = ("request_id", "message")

    def __init__(self, request_id: str, message: str):
        self.request_id, self.message = request_id, message


class EngineStopped:
    """The engine process is gone: no more outputs will come."""
    __slots__ = ()


ENGINE_STOPPED = EngineStopped()


class RequestStream:
    """What the engine sent for one server request (one or more engine requests): get()
    waits for the first item and returns every item queued since the last get()."""
    __slots__ = ("_items", "_waiter")

    def __init__(self):
        self._items: list = []
        self._waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> list:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


class _Connection(asyncio.Protocol):
    def __init__(self, engine: "AsyncEngine"):
        self.engine = engine
        self.reader = _FrameReader()

    def data_received(self, data: bytes) -> None:
        for message in self.reader.feed(data):
            self.engine._on_message(message)

    def connection_lost(self, exc) -> None:
        self.engine._on_connection_lost()


class AsyncEngine:
    """The server's handle on the engine process. Call from the event loop's thread only.

    >>> engine = AsyncEngine(model_dir, "cpu", {})
    >>> info = await engine.start()
    >>> stream = RequestStream(); engine.add("r1", [1, 2, 3], SamplingParams(), True, stream)
    >>> deltas = await stream.get()   # EngineDeltas (engine/output_processor.py)
    """

    def __init__(self, model_dir, device: str, engine_options: dict, log=_stderr,
                 on_stopped=None, tokenizer=None):
        """tokenizer: the model's, to make the text here (vLLM v1's split): the engine
        process then sends token ids only and its step loop does no text work; without
        one the engine makes the text."""
        self.model_dir = str(model_dir)
        self.device = device
        self.engine_options = dict(engine_options)
        self.log = log
        self.on_stopped = on_stopped  # called once if the engine process goes away by itself
        self.info: EngineInfo | None = None
        self.stats: dict = {}
        # tokens the engine sent, those of samples no one reads any more included (a client
        # gone, a stop string found here): what it generated, for /metrics
        self.generated_tokens = 0
        self.process: subprocess.Popen | None = None
        self._transport = None
        self._ready: asyncio.Future | None = None
        self._streams: dict[str, RequestStream] = {}
        self._num_unfinished: dict[str, int] = {}  # choices still running, per request
        self.tokenizer = tokenizer
        self._texts: dict[str, list[DetokenizedSample]] = {}  # with a tokenizer: per request
        self._num_seqs_sent = 0  # sequences of the requests sent (n per request)
        # samples told to stop (a stop string found here, a client gone) whose end the
        # engine has not reported yet: its last stats still count them running
        self._ending: dict[str, set[int]] = {}
        self._stopping = False
        self._stopped = False
        # the last sign of the engine's progress: an output frame (one a step with output,
        # one every PROGRESS_EVERY_S while it steps), or work arriving at an idle engine
        # (stalled_for)
        self._progress_at = time.monotonic()

    # ---- lifetime ----------------------------------------------------------------------
    async def start(self) -> EngineInfo:
        """Start the engine process and wait until its model is loaded. EngineStartError
        if it cannot be."""
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH"))
                                            if p)
        code = ("from cupy_llama.engine.async_engine import engine_process_main; "
                f"engine_process_main({theirs.fileno()})")
        try:
            self.process = subprocess.Popen([sys.executable, "-c", code],
                                            pass_fds=[theirs.fileno()], env=env,
                                            stdin=subprocess.DEVNULL, stdout=_stderr_fd())
        finally:
            theirs.close()
        self._ready = loop.create_future()
        self._transport, _ = await loop.create_unix_connection(lambda: _Connection(self),
                                                               sock=ours)
        self._send(("settings", self.model_dir, self.device, self.engine_options))
        self.info = await self._ready
        return self.info

    async def close(self) -> None:
        """Stop the engine process (it aborts what still runs and frees the device)."""
        self._stopping = True
        if self._transport is not None and not self._transport.is_closing():
            self._send(("stop",))
        process = self.process
        if process is None:
            return
        if self.info is None and process.poll() is None:
            process.kill()  # still loading: nothing to finish, nothing to hand back
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if process.poll() is None:
            self.log(f"warning: the engine process did not stop within {STOP_TIMEOUT_S:g} s; "
                     "killing it")
            process.kill()
            process.wait()
        if self._transport is not None:
            self._transport.close()

    def kill(self) -> None:
        """End the engine process at once (it is stuck): the requests it had end as when
        it dies (ENGINE_STOPPED), and on_stopped is called."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()

    def stalled_for(self) -> float:
        """Seconds the engine has made no progress while requests wait for it (0 while
        none does): since its last output frame, or since work came to an idle engine."""
        if not self._streams or self._stopped:
            return 0.0
        return time.monotonic() - self._progress_at

    @property
    def is_running(self) -> bool:
        return self.info is not None and not self._stopped

    # ---- requests ----------------------------------------------------------------------
    def add(self, request_id: str, prompt_ids: list[int], params, stream: bool,
            sink: RequestStream) -> None:
        """Queue a request; its deltas (and a Rejected if the engine refuses it, or
        ENGINE_STOPPED) go to sink. stream=False: only the final delta comes."""
        if self._stopped:
            sink.put(ENGINE_STOPPED)
            return
        if not self._streams:  # the engine was idle: its time to progress starts now
            self._progress_at = time.monotonic()
        self._streams[request_id] = sink
        self._num_unfinished[request_id] = params.n
        self._num_seqs_sent += params.n
        tokenizer = self.tokenizer
        if tokenizer is not None:
            eos = self.info.eos_token_ids if self.info is not None else ()
            self._texts[request_id] = [DetokenizedSample(tokenizer, params, stream, eos,
                                                         prompt_ids) for _ in range(params.n)]
        self._send(("add", request_id, prompt_ids, params, stream, tokenizer is None))

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the engine's next step. Its final
        delta (finish_reason "abort") still goes to its stream."""
        if request_id in self._streams and not self._stopped:
            # where the text is made here, which samples still run is known (without a
            # tokenizer it is not: those count as running until the engine says)
            for index, sample in enumerate(self._texts.get(request_id, ())):
                if not sample.finished:
                    self._end_here(request_id, index)
            self._send(("abort", request_id))

    def _end_here(self, request_id: str, index: int) -> None:
        """A sample told to stop: it runs on in the engine's stats until its end comes."""
        self._ending.setdefault(request_id, set()).add(index)

    def _ended(self, request_id: str, index: int | None = None) -> None:
        """The engine reported a sample's end (index None: the whole request's)."""
        ending = self._ending.get(request_id)
        if ending is not None:
            ending.discard(index)
            if index is None or not ending:
                del self._ending[request_id]

    @property
    def _num_ending(self) -> int:
        """Samples told to stop whose end the engine has not reported (a few at most)."""
        return sum(map(len, self._ending.values()))

    @property
    def num_waiting(self) -> int:
        """Sequences not running yet (a request of n samples has n): the engine's queue as of
        its last step, plus those of requests sent since that it has not taken in."""
        taken = self.stats.get("num_added_seqs", 0)
        return self.stats.get("num_waiting", 0) + self._num_seqs_sent - taken

    def num_would_wait(self, new_seqs: int) -> int:
        """Sequences that would wait for a slot with new_seqs more sent: the queue and the
        new ones, less the sequence slots that are free. A free slot counts even when the KV
        cache is too full to fill it now: the estimate errs towards admitting."""
        running = max(0, self.stats.get("num_running", 0) - self._num_ending)
        free_slots = max(0, self.info.max_num_seqs - running)
        return max(0, self.num_waiting + new_seqs - free_slots)

    def _send(self, message) -> None:
        self._transport.write(_frame(message))

    # ---- what the engine process says --------------------------------------------------
    def _on_message(self, message) -> None:
        kind = message[0]
        if kind == "out":
            _, deltas, rejected, self.stats = message[:4]
            self._progress_at = time.monotonic()
            streams, unfinished, texts = self._streams, self._num_unfinished, self._texts
            generated = 0
            for fields in deltas:
                delta = EngineDelta.of(fields)
                request_id = delta.request_id
                generated += len(delta.token_ids)
                if delta.finish_reason is not None and self._ending:
                    self._ended(request_id, delta.index)  # these stats no longer run it
                sink = streams.get(request_id)
                if sink is None:
                    continue
                samples = texts.get(request_id)
                if samples is not None:
                    delta, stopped = samples[delta.index].process(delta)
                    if delta is None:
                        continue  # the sample ended here at a stop string already
                    if stopped:  # the engine stops it: nothing more of it is shown
                        self._end_here(request_id, delta.index)
                        self._send(("abort", request_id, delta.index))
                sink.put(delta)
                if delta.finish_reason is not None:  # a sample ended (an abort ends each running)
                    self._sample_ended(request_id)
            if len(message) > 4:  # TokenColumns: one-token deltas of samples texted here
                columns = TokenColumns.of(message[4])
                generated += len(columns.token_ids)
                for request_id, index, token_id in zip(*columns):
                    sink = streams.get(request_id)
                    if sink is None:
                        continue
                    delta, stopped = texts[request_id][index].process_token(request_id, index,
                                                                            token_id)
                    if delta is None:
                        continue  # the sample ended here at a stop string already
                    if stopped:
                        self._end_here(request_id, index)
                        self._send(("abort", request_id, index))
                    sink.put(delta)
                    if stopped:
                        self._sample_ended(request_id)
            self.generated_tokens += generated
            for request_id, reason in rejected:
                sink = streams.pop(request_id, None)
                unfinished.pop(request_id, None)
                texts.pop(request_id, None)
                self._ended(request_id)
                if sink is not None:
                    sink.put(Rejected(request_id, reason))
        elif kind == "ready":
            self._ready.set_result(EngineInfo(**message[1]))
        elif kind == "failed":
            _, failure, text = message
            if not self._ready.done():
                self._ready.set_exception(EngineStartError(failure, text))
        elif kind == "crashed":
            self.log(f"error: the engine loop failed:\n{message[1]}")

    def _sample_ended(self, request_id: str) -> None:
        """One of the request's samples has sent its last delta."""
        unfinished = self._num_unfinished
        unfinished[request_id] -= 1
        if not unfinished[request_id]:
            del self._streams[request_id], unfinished[request_id]
            self._texts.pop(request_id, None)

    def _on_connection_lost(self) -> None:
        self._stopped = True
        if self._ready is not None and not self._ready.done():
            code = self.process.wait() if self.process is not None else None
            self._ready.set_exception(EngineStartError(
                "crash", f"the engine process exited (code {code}) while loading the "
                         "model; see the messages above"))
            return
        for sink in self._streams.values():
            sink.put(ENGINE_STOPPED)
        self._streams.clear()
        self._num_unfinished.clear()
        self._texts.clear()
        if self.info is not None and not self._stopping and self.on_stopped is not None:
            self.on_stopped()
