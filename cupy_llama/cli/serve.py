"""`cupy-llama serve`: the OpenAI-compatible server (server/)."""
from __future__ import annotations

import errno
import json
import os

import click

from ..errors import CupyLlamaError, OptionError
from . import options
from .options import (ENGINE_NAMES, EXIT_OK, MODEL_PATH, check_options, device_option,
                      engine_options, given, log)


SERVE_ENGINE_NAMES = (*ENGINE_NAMES, "block_size", "enforce_eager")
SERVE_PACKAGES = ("fastapi", "uvicorn", "pydantic", "prometheus_client")


@options.command(stray_hint="serve takes the model as --model PATH")
@click.option("--model", "model_dir", type=MODEL_PATH,
              help="Model directory (Hugging Face layout). Default: the demo model, built "
                   "on first use.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Port to listen on (0: any free one; the ready line says which).")
@click.option("--api-key", envvar="CUPY_LLAMA_API_KEY", show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on the API (default: "
                   "$CUPY_LLAMA_API_KEY, else no key).")
@click.option("--served-model-name", help="The model's name in the API (default: the model "
              "folder's name; the demo model's is smollm2-135m-instruct).")
@device_option
@click.option("--max-waiting", type=click.IntRange(min=0), default=1024, show_default=True,
              help="Sequences that may wait for a free slot (a request of n samples has "
                   "n); past that, 503 with Retry-After.")
@click.option("--log-requests", is_flag=True, help="Also log request bodies and generated "
              "text (by default the log holds method, path, status and time only).")
@click.option("--replica-name", help="This server's name in the x-served-by header of every "
              "response (default: the port).")
@click.option("--drain-delay", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Seconds between SIGTERM and closing the listener, while /health answers "
                   "503 and requests are still served: time for a load balancer to take this "
                   "replica out.")
@click.option("--engine-timeout", type=click.FloatRange(min=1.0),
              help="Seconds the engine may take for a step while requests wait for it; past "
                   "that it counts as stuck: /health answers 503, its requests end with an "
                   "error and the server exits 1, for a supervisor to restart it (default: "
                   "30 on a GPU, 300 on the CPU; at least 1).")
@click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0,
              show_default=True, help="Seconds a connection has to send a request's headers "
              "before it is closed, and the most a request's body may pause (then a 408).")
@click.option("--allowed-origins", metavar="JSON", default="[]", show_default=True,
              help='Origins a browser may call the API from, as a JSON list '
                   '(\'["http://localhost:3000"]\', or \'["*"]\'); none: no cross-origin '
                   'access.')
@click.option("--allowed-methods", metavar="JSON", default='["*"]', show_default=True,
              help="HTTP methods cross-origin requests may use, as a JSON list.")
@click.option("--allowed-headers", metavar="JSON", default='["*"]', show_default=True,
              help="Request headers cross-origin requests may send, as a JSON list.")
@click.option("--tool-call-parser", metavar="NAME",
              help="How the model writes tool calls: llama3_json, hermes or mistral "
                   "(default: the format the chat template shows).")
@click.option("--reasoning-parser", metavar="NAME",
              help="Split a reasoning model's thinking from its answer: qwen3 or "
                   "deepseek_r1. Chat replies then carry it as message.reasoning (and "
                   "reasoning_content), and structured outputs constrain the answer only.")
@click.option("--exclude-tools-when-tool-choice-none", "exclude_tools_none", is_flag=True,
              help="Show the chat template no tools when a request's tool_choice is none "
                   "(vLLM's flag; off: the template sees them, as OpenAI's model does, and "
                   "a model that writes a call anyway answers with its text).")
@click.option("--trust-request-chat-template", is_flag=True,
              help="Render a request's own chat_template (vLLM's flag; off: such a request "
                   "is refused). The template runs on the server: trust the clients.")
@engine_options
@click.option("--block-size", type=int, help="Tokens per KV-cache block (default 16).")
@click.option("--enforce-eager", is_flag=True, default=None, help="Turn CUDA graphs off.")
def serve(model_dir, host, port, api_key, served_model_name, device, max_waiting,
          log_requests, replica_name, drain_delay, engine_timeout, header_timeout,
          allowed_origins, allowed_methods, allowed_headers, tool_call_parser,
          reasoning_parser, exclude_tools_none, trust_request_chat_template, **flags):
    """Serve a model over an OpenAI-compatible HTTP API (/v1/completions,
    /v1/chat/completions, /v1/models, also without /v1; /health, /metrics, /tokenize,
    /detokenize, /tokenizer_info).

    Prints one line with the URL once the model is loaded; Ctrl-C stops it, SIGTERM too
    after --drain-delay. For more than one GPU, run one per GPU (CUDA_VISIBLE_DEVICES)
    behind a load balancer (README: More than one GPU).
    """
    engine = given(flags, SERVE_ENGINE_NAMES)
    check_options({}, engine)
    if api_key is None and os.environ.get("CUPY_LLAMA_API_KEY") == "":
        api_key = ""  # click reads an empty variable as unset: it is a mistake all the same
    if served_model_name is not None and not served_model_name.strip():
        raise OptionError("--served-model-name is empty; give the name clients send, or leave "
                          "it out to use the model directory's")
    if api_key is not None and not api_key.strip():
        raise OptionError("--api-key is empty (or $CUPY_LLAMA_API_KEY is set to nothing), which "
                          "would turn the key off; give a key, or unset it to serve without one")
    cors = {name: _json_list(flag, value) for name, flag, value in (
        ("allowed_origins", "--allowed-origins", allowed_origins),
        ("allowed_methods", "--allowed-methods", allowed_methods),
        ("allowed_headers", "--allowed-headers", allowed_headers))}
    if replica_name is not None and not (replica_name.strip() and replica_name.isascii()
                                         and replica_name.isprintable()):
        raise OptionError(f"--replica-name {replica_name!r} must be printable ASCII (it goes "
                          "into the x-served-by header)")
    if tool_call_parser is not None:
        from ..tool_parsers import PARSER_NAMES
        if tool_call_parser not in PARSER_NAMES:
            raise OptionError(f"--tool-call-parser: unknown parser {tool_call_parser!r}; use "
                              f"one of {', '.join(PARSER_NAMES)}")
    for package in SERVE_PACKAGES:
        try:
            __import__(package)
        except ImportError:
            raise CupyLlamaError(f"cupy-llama serve needs the serve extra ({package} is not "
                                 "installed): pip install 'cupy-llama[serve]', or in a "
                                 "checkout pip install -e '.[serve]'") from None
    from ..engine.async_engine import EngineStartError
    from ..server.app import ServerSettings, run_server
    from ..tokenizer import Tokenizer

    name = served_model_name or options.served_name(model_dir)
    if model_dir is None:
        model_dir = options.default_model_dir()
    config = options.check_model_options(model_dir, engine)  # --max-model-len, before listening
    tokenizer = Tokenizer.from_dir(model_dir, config)
    options.reasoning_parser(reasoning_parser, tokenizer)  # known, and the model thinks so
    sock = _listen(host, port)
    if device == "auto":  # said here, in the command line's short words, not by the engine
        device = options.auto_device(log=log)
    settings = ServerSettings(model_dir=str(model_dir), served_model_name=str(name),
                              device=device, engine_options=engine, api_key=api_key or None,
                              max_waiting=max_waiting, log_requests=log_requests,
                              replica_name=replica_name, drain_delay_s=drain_delay,
                              engine_timeout_s=engine_timeout, header_timeout_s=header_timeout,
                              tool_call_parser=tool_call_parser,
                              exclude_tools_when_tool_choice_none=exclude_tools_none,
                              reasoning_parser=reasoning_parser,
                              trust_request_chat_template=trust_request_chat_template, **cors)
    try:
        run_server(settings, sock, tokenizer, config)
    except EngineStartError as e:
        if e.kind == "option":
            raise OptionError(str(e)) from None
        if e.kind == "memory":
            raise MemoryError(str(e)) from None
        if e.kind == "crash":
            log(str(e).rstrip())
            raise CupyLlamaError("the engine process failed while loading the model (the "
                                 "traceback is above)") from None
        raise CupyLlamaError(str(e)) from None
    except RuntimeError as e:  # the engine process died while serving
        raise CupyLlamaError(str(e)) from None
    finally:
        sock.close()
    return EXIT_OK


def _json_list(flag: str, text: str) -> tuple[str, ...]:
    """A CORS flag's JSON list of strings (vLLM's form)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise OptionError(f"{flag} must be a JSON list of strings, such as "
                          f"'{CORS_EXAMPLES[flag]}', got {text!r}")
    return tuple(value)


CORS_EXAMPLES = {"--allowed-origins": '["http://localhost:3000"]',
                 "--allowed-methods": '["GET", "POST"]',
                 "--allowed-headers": '["Authorization", "Content-Type"]'}


def _listen(host: str, port: int):
    """The server's listening socket, bound before the model loads: a port in use is a
    one-line error at once."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise OptionError(f"--host {host!r} is not an address this machine has ({e.strerror})") \
            from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise CupyLlamaError(f"port {port} on {host} is in use; stop what listens there or "
                                 f"pick another --port") from None
        raise CupyLlamaError(f"cannot listen on {host} port {port} ({e.strerror}); pick "
                             f"another --host or --port") from None
    return sock


command = serve
