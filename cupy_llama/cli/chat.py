"""`cupy-llama chat`: the terminal chat (chat_ui.py), a one-shot answer, or a piped message."""
from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import click

from ..errors import OptionError, RequestError
from . import options
from .options import (CHAT_MAX_TOKENS, ENGINE_NAMES, MODEL_PATH, SAMPLING_NAMES, check_options,
                      device_option, engine_options, given, sampling_options)


@options.command(stray_hint="chat takes one PROMPT (quote a message of several words: "
                            "cupy-llama chat 'Name three rivers.') and the model as --model "
                            "PATH")
@click.argument("prompt", required=False)
@click.option("--model", "model_dir", type=MODEL_PATH,
              help="Model directory (Hugging Face layout). Default: the demo model, built "
                   "on first use.")
@device_option
@click.option("--system", help="System prompt.")
@click.option("--chat-template-kwargs", "template_json", metavar="JSON",
              help='More variables for the chat template, as a JSON object (e.g. '
                   '\'{"enable_thinking": false}\' for Qwen3).')
@click.option("--tools", "tools_path", type=click.Path(exists=True, dir_okay=False),
              help="A JSON file holding a list of OpenAI tools ({\"type\": \"function\", "
                   "\"function\": {\"name\", \"description\", \"parameters\"}}) shown to "
                   "the chat template; the model's calls are shown as calls, answered with "
                   "/tool CALL RESULT.")
@click.option("--tool-choice", metavar="auto|required|none|NAME",
              help="With --tools: may the model call (auto, the default), must it (required, "
                   "enforced by a grammar), no call (none: the template still sees the tools), "
                   "or must it call the tool NAME "
                   "(once). required and NAME hold for every reply, the one after the "
                   "results too: a reply in words needs auto.")
@click.option("--tool-call-parser", metavar="NAME",
              help="With --tools: the tool-call format (llama3_json, hermes or mistral) where "
                   "the chat template does not show one.")
@click.option("--parallel-tool-calls/--no-parallel-tool-calls", default=None,
              help="With --tools: may a reply hold several calls (the default), or one at most.")
@sampling_options
@engine_options
def chat(prompt, model_dir, device, system, template_json, tools_path, tool_choice,
         tool_call_parser, parallel_tool_calls, **flags):
    """Chat with a model in the terminal; with PROMPT, answer it once and exit.

    Replies stream as they are generated; type /help for the commands. Input history is
    kept in the cache folder. When stdin is not a terminal (and no PROMPT is given), reads
    all of it as one message, prints only the reply and exits; PROMPT - does the same
    whatever stdin is. PROMPT and a piped message print the reply alone on stdout
    (statistics go to stderr); stdin is not read when another PROMPT is given.
    """
    from rich.console import Console

    from .chat_ui import ChatSession, piped_prompt, run_once, run_terminal
    from ..sampling import SamplingParams, model_sampling_defaults

    values = {"max_tokens": CHAT_MAX_TOKENS, **given(flags, SAMPLING_NAMES)}
    engine = given(flags, ENGINE_NAMES)
    check_options(values, engine)
    template_kwargs = options.template_kwargs(template_json)
    tools = _chat_tools(tools_path, tool_choice, tool_call_parser, parallel_tool_calls)
    # the one message is read (and an empty one refused) before the model loads
    if prompt == "-":  # stdin, as generate's --input - reads it
        once = piped_prompt(_stdin_text())
    elif prompt is not None:
        once = prompt.strip()
        if not once:
            raise OptionError("PROMPT is empty; give the message, e.g. cupy-llama chat "
                              "'Hello', or leave it out for an interactive chat")
        if model_dir is None:  # `chat MODEL`: not a message
            _refuse_model_as_prompt(prompt)
    else:
        once = None if sys.stdin.isatty() else piped_prompt(_stdin_text())
    source = "stdin" if prompt in (None, "-") else "PROMPT"
    for text, what in ((once, source), (system, "--system")):
        _check_text(text, what)
    model_dir = model_dir or options.default_model_dir()
    config = options.check_model_options(model_dir, engine, values)  # before the weights
    options.check_max_tokens(given(flags, SAMPLING_NAMES).get("max_tokens"), config, engine)
    if tools is not None and tools.tool_choice != "none":
        _check_tools_template(model_dir, config, tools, template_kwargs)  # before the weights
    llm = options.load(model_dir, device, engine)
    if llm.tokenizer.chat_template is None:
        raise _no_chat_template(llm.tokenizer)
    model_defaults = model_sampling_defaults(llm.config.generation_config)
    if "max_tokens" not in given(flags, SAMPLING_NAMES):  # the model's max_new_tokens first
        values["max_tokens"] = model_defaults.get("max_tokens", CHAT_MAX_TOKENS)
    params = SamplingParams.from_dict(values, model_defaults)
    session = ChatSession(llm, params, system, template_kwargs, tools)
    if once is not None:
        return run_once(session, once)
    colour = {"color_system": None} if os.environ.get("NO_COLOR") else {}
    return run_terminal(session, Console(**colour), Console(stderr=True, **colour),
                        history_path=_history_path())


def _stdin_text() -> str:
    """What was piped in, as text whatever the locale's error handling: bytes that are no
    UTF-8 stay as lone surrogates, for _check_text to name."""
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    return data.decode("utf-8", "surrogateescape") if isinstance(data, bytes) else data


def _check_text(text: str | None, what: str) -> None:
    """OptionError, before the model loads, for text that is no valid Unicode (bytes that
    were no UTF-8 reach us as lone surrogates)."""
    from ..tokenizer import check_unicode
    if text is None:
        return
    try:
        check_unicode(text, what)
    except RequestError as e:
        raise OptionError(str(e)) from None


def _no_chat_template(tokenizer):
    from ..errors import TokenizerError
    if tokenizer.named_templates:
        names = ", ".join(repr(name) for name in tokenizer.named_templates)
        return TokenizerError(f"this model's tokenizer_config.json lists chat templates "
                              f"({names}) but none named 'default', which chat needs; copy "
                              f"the one to chat with into the model folder as "
                              f"chat_template.jinja, or send plain prompts with "
                              f"`cupy-llama generate --raw`")
    return TokenizerError("this model has no chat template (no chat_template.jinja and no "
                          "chat_template in tokenizer_config.json), which chat needs; add "
                          "one to the model folder, or send plain prompts with "
                          "`cupy-llama generate --raw`")


def _check_tools_template(model_dir, config, tools, template_kwargs) -> None:
    """--tools: the chat template must render the tools, and without --tool-call-parser
    show a tool-call format this engine knows. The tokenizer's files say, so this is found
    before the weights load (the engine reads them again: a fraction of a second, paid with
    --tools only). A template that fails without the tools as well is left for the chat
    to report, as it is without --tools."""
    from ..tokenizer import Tokenizer
    from ..tool_parsers import PARSER_NAMES, tool_parser_for_template

    tokenizer = Tokenizer.from_dir(model_dir, config)
    if tokenizer.chat_template is None:
        raise _no_chat_template(tokenizer)
    refusal = tokenizer.tools_refusal(tools.tools, template_kwargs=template_kwargs)
    if refusal is not None:
        raise OptionError(f"--tools: {refusal}")
    if tools.parser is None and tool_parser_for_template(tokenizer.template_for_tools) is None:
        raise OptionError("--tools: the model's chat template shows no tool-call format this "
                          "engine knows; use a model whose template calls tools, or name the "
                          f"format with --tool-call-parser ({', '.join(PARSER_NAMES)})")


# a Hugging Face model folder's files by name (its weights: *.safetensors), which --model takes
_MODEL_FOLDER_FILES = ("config.json", "model.safetensors.index.json")


def _refuse_model_as_prompt(prompt: str) -> None:
    """OptionError for a PROMPT that names a model rather than a message: a folder, a GGUF
    file (by its name, existing or not, or its magic bytes) or a file of a model folder.
    A message of several words that mentions such a name is a message."""
    from ..config import GGUF_REFUSED, is_gguf

    if os.path.isdir(prompt):
        raise OptionError(f"PROMPT {prompt!r} is a folder, not a message; chat takes the "
                          f"model as --model PATH: cupy-llama chat --model {shlex.quote(prompt)}")
    path = Path(prompt)
    one_word = len(prompt.split()) == 1
    if (one_word and path.suffix.lower() == ".gguf") or (os.path.isfile(prompt) and is_gguf(path)):
        # no command loads it: the fix is a model folder, not moving the file to --model
        raise OptionError(f"PROMPT {prompt!r} names a GGUF file, not a message; {GGUF_REFUSED}")
    if os.path.isfile(prompt) and (path.name in _MODEL_FOLDER_FILES
                                   or path.suffix == ".safetensors"):
        folder = os.path.dirname(prompt) or "."
        raise OptionError(f"PROMPT {prompt!r} is a file of a model folder, not a message; chat "
                          "takes the folder as --model PATH: cupy-llama chat --model "
                          f"{shlex.quote(folder)}")


def _chat_tools(path: str | None, choice: str | None, parser: str | None,
                parallel: bool | None):
    """--tools and the flags that go with it, checked before the model loads."""
    from .chat_ui import ChatTools
    from ..tool_choice import TOOL_CHOICES, check_tool_choice, check_tools, enforced_functions
    from ..tool_parsers import check_parser_name

    if path is None:
        given = {"--tool-choice": choice, "--tool-call-parser": parser,
                 "--parallel-tool-calls" if parallel else "--no-parallel-tool-calls": parallel}
        flag = next((flag for flag, value in given.items() if value is not None), None)
        if flag is not None:
            raise OptionError(f"{flag} needs --tools FILE, the tools the model may call")
        return None
    try:
        tools = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise OptionError(f"--tools: cannot read {path} ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise OptionError(f"--tools: {path} is not JSON ({e}); give a list of OpenAI tools, "
                          '[{"type": "function", "function": {"name": ...}}]') from None
    if not isinstance(tools, list) or not tools:
        raise OptionError(f"--tools: {path} must hold a non-empty JSON list of OpenAI tools, "
                          '[{"type": "function", "function": {"name": ...}}]')
    try:
        tools = check_tools(tools, field=path)
        if choice is not None and choice not in TOOL_CHOICES:
            names = [tool["function"]["name"] for tool in tools]
            if choice not in names:
                raise OptionError(f"--tool-choice: {choice!r} is none of auto, required, none "
                                  f"or a tool of {path} ({', '.join(names)})")
            choice = {"type": "function", "function": {"name": choice}}
        choice = check_tool_choice(choice, tools, field="--tool-choice")
        if choice not in ("auto", "none"):  # the schemas a grammar will hold replies to
            enforced_functions(tools, choice, field=path)
        if parser is not None:
            check_parser_name(parser)
    except RequestError as e:
        raise OptionError(f"--tools: {e}" if str(e).startswith(path) else str(e)) from None
    return ChatTools(tools, choice, parser, parallel is not False)


def _history_path() -> Path:
    from ..cache import cache_dir
    return cache_dir() / "chat_history"


command = chat
