"""`cupy-llama info`: a model's shape, parameters and memory plan on a device."""
from __future__ import annotations

import click

from . import options
from .options import (ENGINE_NAMES, MODEL_PATH, auto_device, check_model_options,
                      check_options, device_option, engine_options, given)


@options.command(stray_hint="info takes the model as --model PATH")
@click.option("--model", "model_dir", type=MODEL_PATH,
              help="Model directory (Hugging Face layout). Default: the demo model, built "
                   "on first use.")
@device_option
@engine_options
def info(model_dir, device, **flags):
    """Show a model's shape, parameter count, dtype and memory plan on a device."""
    engine = given(flags, ENGINE_NAMES)
    check_options({}, engine)
    model_dir = model_dir or options.default_model_dir()
    config = check_model_options(model_dir, engine)
    if device == "auto":
        device = auto_device(log=options.log)
    # the plan first: an error there (no GPU, say) comes before any of the report
    rows = _cpu_memory_plan(model_dir, config, engine) if device == "cpu" \
        else _loaded_memory_plan(model_dir, device, engine)
    for label, value in _describe(config, device, _eos_ids(model_dir, config)):
        click.echo(f"{label:<14}{value}")
    click.echo(f"memory plan ({device}):")
    width = max(len(label) for label, _ in rows) + 2
    for label, value in rows:
        click.echo(f"  {label:<{width}}{value}")


def _eos_ids(model_dir, config) -> list[int]:
    """The tokens that end a reply, as the engine stops at them: config.json's and
    generation_config.json's, and the tokenizer's (its EOS and the chat template's
    end-of-turn tokens)."""
    from ..tokenizer import Tokenizer
    return sorted(set(config.eos_token_ids) | set(Tokenizer.from_dir(model_dir, config).eos_token_ids))


def _describe(config, device: str, eos_ids: list[int]) -> list[tuple[str, str]]:
    return [
        ("architecture", config.architecture + (" (its language model; images are not "
                                                "read)" if config.architecture.endswith(
                                                    "ForConditionalGeneration") else "")),
        ("shape", f"hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
                  f"{config.num_attention_heads} heads ({config.num_key_value_heads} KV), "
                  f"head_dim {config.head_dim}, intermediate {config.intermediate_size}"),
        ("features", _features(config)),
        ("attention", f"scale {config.attn_scale:.4g}; {_layers(config)}"),
        ("vocabulary", f"{config.vocab_size} tokens, embeddings "
                       f"{'tied' if config.tie_word_embeddings else 'untied'}"),
        ("context", f"{_positions(config)}; rope "
                    + "; ".join(f"{kind.split('_')[0]}: {_rope(rope)}"
                                for kind, rope in config.rope.items())),
        ("parameters", f"{config.num_parameters:,} ({_count(config.num_parameters)})"),
        ("dtype", config.torch_dtype),
        ("weights", _weights(config, device)),
        ("eos ids", ", ".join(map(str, eos_ids)) or "none"),
    ]


def _weights(config, device: str) -> str:
    """The weights' format and, on the GPU, the memory they take there (bf16 as they would
    be without FP8, for comparison); the CPU computes in float32 (its plan says how much)."""
    from dataclasses import replace

    from ..models import model_for
    source = "the checkpoint's" if config.checkpoint_quantization else "quantized at load"
    fp8 = f"projections FP8 (e4m3, a float32 scale per row; {source}), the rest bf16"
    if device == "cpu":
        return f"{'bf16' if config.quantization is None else fp8}; float32 on the CPU"
    size = model_for(config).weight_plan()[1]
    if config.quantization is None:
        return f"bf16, {_size(size)} on the GPU"
    bf16 = model_for(replace(config, quantization=None, checkpoint_quantization=None)).weight_plan()[1]
    return f"{fp8}: {_size(size)} on the GPU against {_size(bf16)} in bf16"


def _features(config) -> str:
    """What sets the model apart from a plain Llama layer."""
    features = []
    if config.qkv_bias:
        features.append("q/k/v bias")
    if config.qk_norm:
        features.append("q/k norm per head")
    if config.norm_offset:
        features.append(f"norms x ({config.norm_offset:g} + w)")
    if config.sandwich_norms:
        features.append("norms on the sublayers' outputs")
    features.append("GeGLU (tanh GELU)" if config.hidden_act == "gelu_tanh" else "SwiGLU")
    if config.embed_scale is not None:
        features.append(f"embeddings x {config.embed_scale:g}")
    for what, cap in (("attention scores", config.attn_logit_softcap),
                      ("logits", config.final_logit_softcap)):
        if cap is not None:
            features.append(f"{what} soft-capped at {cap:g}")
    return ", ".join(features)


def _layers(config) -> str:
    """Which layers are full and which slide, as ranges."""
    if config.sliding_window is None:
        return "every layer full"
    sliding = [i for i, kind in enumerate(config.layer_types) if kind == "sliding_attention"]
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    text = f"window {config.sliding_window} on {_ranges(sliding)}"
    return text + (f", full on {_ranges(full)}" if full else "")


def _ranges(indices: list[int]) -> str:
    """"layer 3" for one, else "layers 0-4, 6": runs of adjacent indices joined."""
    runs, start = [], None
    for i, index in enumerate(indices):
        if start is None:
            start = index
        if i + 1 == len(indices) or indices[i + 1] != index + 1:
            runs.append(f"{start}" if start == index else f"{start}-{index}")
            start = None
    return ("layer " if len(indices) == 1 else "layers ") + ", ".join(runs)


def _positions(config) -> str:
    if config.context_limit == config.max_position_embeddings:
        return f"{config.max_position_embeddings} positions"
    return (f"{config.max_position_embeddings} positions, {config.context_limit} with the "
            f"yarn rope_scaling")


def _rope(rope) -> str:
    text = f"theta {rope.theta:g}"
    if rope.rope_type != "default":
        text += f", {rope.rope_type} x{rope.factor:g}"
    return text


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB" if num_bytes < 2**30 else f"{num_bytes / 2**30:,.2f} GiB"


def _cpu_memory_plan(model_dir, config, engine: dict) -> list[tuple[str, str]]:
    """The CPU backend's plan (backends/cpu.py plan), from the headers without loading the
    weights, and the dtype the checkpoint stores."""
    from ..backends import device_options
    from ..backends.cpu import plan
    from ..config import EngineConfig
    from ..models import model_for
    from ..weights import open_checkpoint

    engine_config = EngineConfig(**device_options("cpu", engine)[0])
    max_model_len = engine_config.resolved_max_model_len(config)
    model = model_for(config)
    with open_checkpoint(model_dir, model) as checkpoint:
        stored = ", ".join(sorted(checkpoint.source_dtypes))
    memory = plan(model, engine_config, max_model_len)
    rows = [(name, f"{_size(nbytes)}  {note}" + (f" (stored as {stored})" if name == "weights" else ""))
            for name, nbytes, note in memory.rows]
    # as the engine caps it (LLMEngine.context_limit): a cache smaller than one sequence
    context = min(max_model_len, memory.num_kv_blocks * memory.block_size)
    return rows + [("context", f"{context} tokens per sequence")]


def _loaded_memory_plan(model_dir, device: str, engine: dict) -> list[tuple[str, str]]:
    """The plan as the loaded backend reports it."""
    llm = options.load(model_dir, device, engine)
    try:
        return ([(name, f"{_size(nbytes)}  {note}") for name, nbytes, note in llm.backend.memory_plan()]
                + [("context", f"{llm.context_limit} tokens per sequence")])
    finally:
        llm.close()


command = info
