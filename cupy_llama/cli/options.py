"""What the commands share: the command decorator (an argument a command does not take
refused saying what it takes), the option decorators, checking option values before the
model loads, choosing the device, loading a model and the demo model default.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import click

from ..errors import ConfigError, OptionError, RequestError, option_flag

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def log(message: str) -> None:
    click.echo(message, err=True)


DEVICES = ("auto", "cpu", "cuda")  # as backends.DEVICES (importing it would import numpy)
QUANTIZATIONS = ("fp8",)  # as config.QUANTIZATIONS (tests/test_cli.py checks)
CHAT_MAX_TOKENS = 1024
PROGRESS_INTERVAL_S = 10.0  # generate's progress lines when stderr is not a terminal
class _ModelPath(click.Path):
    """Any path but an empty one: a missing folder or a file is the loader's one-line error
    (exit 1), the same for every command, rather than click's usage error for some of the
    cases. An empty --model (an unset variable in a script) is a usage error everywhere,
    rather than the demo model for some commands and the current folder for others."""

    def convert(self, value, param, ctx):
        if value == "":
            self.fail("is empty; name a model folder, or leave --model out for the demo "
                      "model", param, ctx)
        return super().convert(value, param, ctx)


MODEL_PATH = _ModelPath()


class _HintedCommand(click.Command):
    """A command that refuses an argument it does not take saying what it takes instead
    (`serve MODEL`, as `vllm serve` is spelled, gets "serve takes the model as --model
    PATH"), where click would say only "Got unexpected extra argument"."""

    allow_extra_args = True  # kept in ctx.args for parse_args to refuse

    def __init__(self, *args, stray_hint: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.stray_hint = stray_hint

    def parse_args(self, ctx, args):
        rest = super().parse_args(ctx, args)
        if ctx.args and not ctx.resilient_parsing:
            plural = "s" if len(ctx.args) > 1 else ""
            ctx.fail(f"unexpected argument{plural} {', '.join(map(repr, ctx.args))}; "
                     f"{self.stray_hint}")
        return rest


def command(name: str | None = None, *, stray_hint: str):
    """click.command, with an argument the command does not take refused with stray_hint
    (what the command takes, and where)."""
    return click.command(name, cls=_HintedCommand, stray_hint=stray_hint)


# ---- options shared by the commands -------------------------------------------------------

def _options(*decorators):
    def apply(f):
        for decorator in reversed(decorators):
            f = decorator(f)
        return f
    return apply


device_option = click.option(
    "--device", type=click.Choice(DEVICES), default="auto", show_default=True,
    help="Where to run: the GPU when usable (auto), the NumPy backend (cpu) or the GPU (cuda).")

def _logit_bias(ctx, param, values) -> dict | None:
    """--logit-bias ID=BIAS, repeated: {id: bias} (None when not given)."""
    bias = {}
    for value in values:
        token, _, number = value.partition("=")
        try:
            bias[int(token)] = float(number)
        except ValueError:
            raise click.BadParameter(f"expected ID=BIAS such as 50256=-100, got {value!r}") from None
    return bias or None


sampling_options = _options(
    click.option("--temperature", type=float, help="0 means greedy (default: the model's "
                 "generation_config.json where it says do_sample, else greedy)."),
    click.option("--top-p", type=float, help="Nucleus sampling mass in (0, 1]."),
    click.option("--top-k", type=int, help="Keep the k most likely tokens (0: off)."),
    click.option("--min-p", type=float, help="Drop tokens below min_p x the top probability."),
    click.option("--max-tokens", type=int, help=f"Most tokens per reply (default: the "
                 f"model's max_new_tokens, else {CHAT_MAX_TOKENS} in chat, 256 in generate)."),
    click.option("--seed", type=int,
                 help="Sampling seed (default, or -1: a fresh one per request)."),
    click.option("--repetition-penalty", type=float, help="Divide the logits of tokens seen "
                 "in the prompt or the reply ([0.01, 100]; 1: off; vLLM's)."),
    click.option("--frequency-penalty", type=float, help="Subtract this times each token's "
                 "count in the reply from its logit ([-2, 2]; 0: off)."),
    click.option("--presence-penalty", type=float, help="Subtract this from the logit of "
                 "every token already in the reply ([-2, 2]; 0: off)."),
    click.option("--min-tokens", type=int, help="Hold end-of-sequence and stop tokens off "
                 "until the reply has this many tokens."),
    click.option("--logit-bias", multiple=True, metavar="ID=BIAS", callback=_logit_bias,
                 help="Add BIAS ([-100, 100]) to token ID's logit (repeatable)."))

engine_options = _options(
    click.option("--max-model-len", type=int, help="Context limit in tokens (default: the "
                 "model's, at most 8192)."),
    click.option("--max-num-seqs", type=int, help="Sequences decoded together in one step."),
    click.option("--max-num-batched-tokens", type=int, help="New tokens per step."),
    click.option("--num-kv-blocks", type=int, help="KV cache size in blocks (default: from "
                 "the memory left)."),
    click.option("--gpu-memory-utilization", type=float, help="Fraction of GPU memory to use "
                 "(default 0.9)."),
    click.option("--no-prefix-caching", "enable_prefix_caching", is_flag=True, flag_value=False,
                 default=None, help="Compute every prompt in full instead of reusing the KV "
                 "blocks of prompts seen before."),
    click.option("--quantization", type=click.Choice(QUANTIZATIONS), help="Turn the "
                 "projections' bf16 weights into FP8 (e4m3, a scale per row) at load: half "
                 "their memory, faster decode (default: the checkpoint's own format)."))

SAMPLING_NAMES = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "stop",
                  "ignore_eos", "repetition_penalty", "frequency_penalty", "presence_penalty",
                  "min_tokens", "logit_bias")
ENGINE_NAMES = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks",
                "gpu_memory_utilization", "enable_prefix_caching", "quantization")


def template_kwargs(text: str | None) -> dict | None:
    """--chat-template-kwargs as a dict, checked before the model loads."""
    if text is None:
        return None
    import json

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


def given(options: dict, names) -> dict:
    """The options among names that the user set: an option not given is None (flags too,
    so --no-prefix-caching can say False), or () when it repeats."""
    unset = lambda value: value is None or value == ()  # noqa: E731
    return {name: options[name] for name in names if name in options and not unset(options[name])}


def _flagged(message: str) -> str:
    """A message about a setting, with the setting named by its command-line flag, and so
    every other setting it names whose name holds an underscore (no English word does):
    "min_tokens ... from 0 to max_tokens (2)" -> "--min-tokens ... to --max-tokens (2)"."""
    names = (*SAMPLING_NAMES, *ENGINE_NAMES, "enforce_eager", "block_size")  # serve's too
    for name in names:
        if message.startswith(name + " "):
            message = option_flag(name) + message[len(name):]
            break
    for name in names:
        if "_" in name:
            message = re.sub(rf"(?<![\w-]){name}\b", option_flag(name), message)
    return message


def check_options(sampling: dict, engine: dict) -> None:
    """Bad sampling or engine option values fail here, before the model loads, as usage
    errors naming the option."""
    from ..config import EngineConfig
    from ..sampling import SamplingParams
    if "" in sampling.get("stop", ()):  # a list of the repeated flag's values
        raise OptionError("--stop must be a non-empty string: the text that ends a reply")
    try:
        SamplingParams.from_dict(sampling)
        EngineConfig(**engine)
    except (RequestError, ConfigError) as e:
        raise OptionError(_flagged(str(e))) from None


def check_model_options(model_dir, engine: dict, sampling: dict | None = None):
    """The model's config.json and that it has weights (a bad folder is a one-line error,
    exit 1), then the options the model must take, as usage errors: --max-model-len beyond
    its context, a --logit-bias token id outside its vocabulary. Returns the ModelConfig as
    the engine will run it (--quantization applied)."""
    from ..config import EngineConfig
    from ..models import read_config
    from ..weights import find_weights

    config = read_config(model_dir)  # generation defaults checked too
    find_weights(model_dir)  # a folder of GGUF files and a config.json, say
    try:
        engine_config = EngineConfig(**engine)
        engine_config.resolved_max_model_len(config)
    except ConfigError as e:
        raise OptionError(_flagged(str(e))) from None
    vocab = config.vocab_size
    outside = next((t for t in (sampling or {}).get("logit_bias") or () if t >= vocab), None)
    if outside is not None:
        raise OptionError(f"--logit-bias names token id {outside}, outside the model's "
                          f"vocabulary of {vocab} tokens (ids 0 to {vocab - 1}); give ids "
                          f"below {vocab}")
    return engine_config.model_config(config)


def check_max_tokens(max_tokens: int | None, config, engine: dict) -> None:
    """--max-tokens stands for every request of the command (each of generate's lines that
    leaves max_tokens out, each of chat's replies), its prompt beside it in the context:
    one that fills the context alone leaves no request room for a prompt, a usage error
    before the model loads (a generate line whose prompt and max_tokens together pass the
    context fails on its own, as the server refuses it). config: check_model_options'."""
    from ..config import EngineConfig

    if max_tokens is None:
        return
    context = EngineConfig(**engine).resolved_max_model_len(config)
    if max_tokens < context:
        return
    model_limit = config.context_limit
    more = (f", or raise --max-model-len (the model takes up to {model_limit})"
            if max_tokens < model_limit else "")
    raise OptionError(f"--max-tokens {max_tokens} leaves no room for a prompt: the context "
                      f"holds {context} tokens, prompt and reply together; ask for fewer "
                      f"than {context}{more}")


def resolve_device(device: str, engine: dict) -> tuple[str, dict]:
    """The device `auto` means here (with the reason when it is the CPU), and the engine
    options without those the device does not have, each named in a warning."""
    from ..backends import device_options

    if device == "auto":
        device = auto_device(log=log)
    _, ignored = device_options(device, engine)
    if ignored:
        flags = " and ".join(option_flag(name) for name in ignored)
        verb = "applies" if len(ignored) == 1 else "apply"
        log(f"warning: {flags} {verb} to the GPU only; ignored on the CPU")
    return device, {k: v for k, v in engine.items() if k not in ignored}


def load(model_dir, device: str, engine: dict):
    from ..llm import LLM

    check_model_options(model_dir, engine)
    device, engine = resolve_device(device, engine)
    started = time.perf_counter()
    log(f"loading {model_dir} ...")
    llm = LLM(model_dir, device=device, log=log, **engine)
    log(f"loaded on {llm.device} in {time.perf_counter() - started:.1f} s")
    return llm


def reasoning_parser(name: str | None, tokenizer):
    """--reasoning-parser (serve, generate) bound to the model's tokenizer, or None: an
    OptionError for an unknown name or a model that does not think in that format."""
    if name is None:
        return None
    from ..reasoning import ReasoningParser
    try:
        return ReasoningParser.for_tokenizer(name, tokenizer)
    except RequestError as e:
        raise OptionError(str(e)) from None


def served_name(model_dir) -> str:
    """The model's name in the API when none is given: its folder's name as given (never
    its path, which would tell clients and metrics where it lives; a link keeps its own
    name, not its target's, such as a Hub snapshot's hash); the demo model's name."""
    if model_dir is None:
        from .demo import DEMO_NAME
        return DEMO_NAME
    return Path(os.path.abspath(Path(model_dir).expanduser())).name


def default_model_dir() -> Path:
    from .demo import build_demo_model, demo_model_dir, is_built

    path = demo_model_dir()
    if not is_built(path):
        log(f"no --model given: building the demo model (SmolLM2-135M-Instruct) in {path}; "
            "this happens once")
        path = build_demo_model(log=log)
    return path


def auto_device(log=None) -> str:
    """cuda when a usable GPU is there, else cpu (and log hears why in one short line, when
    given: every command says it, so it says the reason's first clause and how to silence
    it)."""
    from ..backends import resolve_device as backend_device
    if log is None:
        return backend_device("auto")
    reasons = []
    device = backend_device("auto", lambda line: reasons.append(line))
    if device == "cpu" and reasons:
        reason = reasons[0].removeprefix("warning: running on the CPU (slow): ")
        log(f"warning: running on the CPU (slow): {reason.split(';')[0]}; --device cpu "
            "hides this warning")
    return device
