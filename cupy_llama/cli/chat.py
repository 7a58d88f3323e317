"""`cupy-llama chat`: the terminal chat (chat_ui.py), a one-shot answer, or a piped message."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from ..errors import OptionError, RequestError
from . import options
from .options import (CHAT_MAX_TOKENS, ENGINE_NAMES, MODEL_PATH, SAMPLING_NAMES, check_options,
                      device_option, engine_options, given, sampling_options)


@click.command()
@click.argument("prompt", required=False)
@click.option("--model", "model_dir", type=MODEL_PATH,
              help="Model directory (Hugging Face layout). Default: the demo model, built "
                   "on first use.")
@device_option
@click.option("--system", help="System prompt.")
@click.option("--chat-template-kwargs", "template_json", metavar="JSON",
              help='More variables for the chat template, as a JSON object (e.g. '
                   '\'{"enable_thinking": false}\' for Qwen3).')
@sampling_options
@engine_options
def chat(prompt, model_dir, device, system, template_json, **flags):
    """Chat with a model in the terminal; with PROMPT, answer it once and exit.

    Replies stream as they are generated; type /help for the commands. Input history is
    kept in the cache folder. When stdin is not a terminal (and no PROMPT is given), reads
    all of it as one message, prints only the reply and exits. PROMPT and a piped message
    print the reply alone on stdout (statistics go to stderr); stdin is not read when
    PROMPT is given.
    """
    from rich.console import Console

    from .chat_ui import ChatSession, piped_prompt, run_once, run_terminal
    from ..sampling import SamplingParams, model_sampling_defaults

    values = {"max_tokens": CHAT_MAX_TOKENS, **given(flags, SAMPLING_NAMES)}
    engine = given(flags, ENGINE_NAMES)
    check_options(values, engine)
    template_kwargs = _template_kwargs(template_json)
    # the one message is read (and an empty one refused) before the model loads
    if prompt is not None:
        once = prompt.strip()
        if not once:
            raise OptionError("PROMPT is empty; give the message, e.g. cupy-llama chat "
                              "'Hello', or leave it out for an interactive chat")
    else:
        once = None if sys.stdin.isatty() else piped_prompt(sys.stdin.read())
    llm = options.load(model_dir or options.default_model_dir(), device, engine)
    params = SamplingParams.from_dict(values, model_sampling_defaults(llm.config.generation_config))
    session = ChatSession(llm, params, system, template_kwargs)
    if once is not None:
        return run_once(session, once)
    colour = {"color_system": None} if os.environ.get("NO_COLOR") else {}
    return run_terminal(session, Console(**colour), Console(stderr=True, **colour),
                        history_path=_history_path())


def _template_kwargs(text: str | None) -> dict | None:
    """--chat-template-kwargs as a dict, checked before the model loads."""
    if text is None:
        return None
    from ..tokenizer import check_template_kwargs
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise OptionError(f"--chat-template-kwargs is not valid JSON ({e.msg} at column "
                          f"{e.colno}); give an object such as '{{\"enable_thinking\": false}}'") from None
    try:
        return check_template_kwargs(value)
    except RequestError as e:
        raise OptionError(f"--chat-template-kwargs: {str(e).removeprefix('chat_template_kwargs ')}") from None


def _history_path() -> Path:
    from ..cache import cache_dir
    return cache_dir() / "chat_history"


command = chat
