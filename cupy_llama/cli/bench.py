"""`cupy-llama bench`: the engine's benchmarks (bench/offline.py) and a server under load
(bench/serve.py)."""
from __future__ import annotations

import os
import shlex

import click

from ..bench.workloads import PRESETS
from ..errors import OptionError, option_flag
from . import options
from .options import (DEVICES, EXIT_OK, MODEL_PATH, QUANTIZATIONS, auto_device, check_options, given,
                      resolve_device)


class _Mode(click.Choice):
    """MODE, where a path given in its place (`bench MODEL`) is told where models go."""

    def convert(self, value, param, ctx):
        if value not in self.choices and os.path.exists(value):
            self.fail(f"{value!r} is a path, not a MODE; bench takes the model as --model "
                      f"PATH: cupy-llama bench latency --model {shlex.quote(value)}", param, ctx)
        return super().convert(value, param, ctx)


@options.command(stray_hint="bench takes one MODE and the model as --model PATH")
@click.argument("mode", metavar="MODE", type=_Mode((
    "throughput", "latency", "ttft", "decode-sweep", "all", "prefix", "serve")))
@click.option("--model", "model_dir", type=MODEL_PATH,
              help="Model directory. Default: a random-weight model of --preset's shape, "
                   "written once into the cache.")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True,
              help="The GPU when usable (auto), the GPU (cuda), or the NumPy backend (cpu: it "
                   "checks the engine end to end; its numbers say nothing about a GPU).")
@click.option("--preset", type=click.Choice(PRESETS),
              help="Shape of the random model when no --model is given (default: "
                   "llama-3.2-1b on the GPU, tiny on the CPU).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False),
              help="Write the full report (settings, versions, every number) here.")
@click.option("--hf/--no-hf", default=False, show_default=True,
              help="Also run each workload through transformers, in this process, and print "
                   "the ratio.")
@click.option("--max-num-seqs", type=int, help="Sequences decoded together (default on cuda: 256).")
@click.option("--max-num-batched-tokens", type=int, help="New tokens per step.")
@click.option("--enforce-eager", is_flag=True, default=None, help="Turn CUDA graphs off.")
@click.option("--no-prefix-caching", "enable_prefix_caching", is_flag=True, flag_value=False,
              default=None, help="Prefix caching off (bench prefix runs with it on and off).")
@click.option("--gpu-memory-utilization", type=float, help="Fraction of GPU memory to use.")
@click.option("--quantization", type=click.Choice(QUANTIZATIONS), help="Turn the projections' "
              "bf16 weights into FP8 at load (default: the checkpoint's own format).")
@click.option("--num-requests", type=int, default=256, show_default=True,
              help="Requests in the throughput workload (fewer: for quick checks only).")
@click.option("--seed", type=int, default=0, show_default=True, help="Workload seed.")
@click.option("--scale", type=float, default=1.0, show_default=True,
              help="Multiply every prompt and output length by this, in (0, 1] (quick checks "
                   "only).")
@click.option("--batch-sizes", default="1,8,32,64,128,256", show_default=True,
              help="Batch sizes of decode-sweep.")
@click.option("--commit", help="Commit to record (also $CUPY_LLAMA_COMMIT); else git's HEAD, which is kept beside a named commit it differs from.")
@click.option("--url", help="serve: the OpenAI-compatible server to measure (default: start "
              "`cupy-llama serve` on a free port).")
@click.option("--max-concurrency", type=int, help="serve: requests in flight at most "
              "(default: all).")
@click.option("--request-rate", type=float, help="serve: Poisson arrivals per second "
              "(default: inf, all at once).")
@click.option("--input-len", type=int, help="serve: every prompt this many tokens (default: "
              "the workload's lengths).")
@click.option("--output-len", type=int, help="serve: every request this many new tokens.")
@click.option("--temperature", type=float, help="serve: sampling temperature (default 0.6, "
              "as throughput).")
@click.option("--client-processes", type=int, help="serve: processes the clients are spread "
              "over (default: one per 32 concurrent streams).")
@click.option("--api-key", envvar="OPENAI_API_KEY", help="serve: the server's API key "
              "(default: $OPENAI_API_KEY).")
def bench(mode, **flags):
    """Measure throughput, batch-1 latency, time to first token or decode speed by batch size,
    or an OpenAI-compatible server under load.

    MODE is throughput (the standard offline workload), latency, ttft, decode-sweep, all (the
    four), prefix (shared-prefix and multi-turn workloads with prefix caching on and off), or
    serve (the standard workload through a server's /v1/completions, streamed). Statistics go
    to stderr while it runs, a table to stdout at the end.
    """
    names = ("max_num_seqs", "max_num_batched_tokens", "enforce_eager", "gpu_memory_utilization",
             "enable_prefix_caching", "quantization")
    engine = given(flags, names)
    check_options({}, engine)
    rest = {name: value for name, value in flags.items() if name not in names}
    if rest["preset"] is not None and rest["model_dir"] is not None:
        raise OptionError("--preset names the shape of a random model, and --model gives the "
                          "model itself; give one of them")
    serve_only = {name: rest.pop(name) for name in BENCH_SERVE_NAMES}
    if mode == "serve":
        return _bench_serve(engine, serve_only, rest)
    serve_flags = [name for name, value in serve_only.items() if value is not None
                   and name != "api_key"]
    if serve_flags:
        raise OptionError(f"{option_flag(serve_flags[0])} applies to bench serve only")
    from ..bench.offline import bench_command
    bench_command(mode, engine=engine, out=click.echo, resolve_device=resolve_device, **rest)
    return EXIT_OK


BENCH_SERVE_NAMES = ("url", "max_concurrency", "request_rate", "input_len", "output_len",
                     "temperature", "client_processes", "api_key")


def _bench_serve(engine: dict, serve_only: dict, rest: dict) -> int:
    from ..bench.workloads import DEFAULT_BATCH_SIZES
    from ..bench.serve import bench_serve_command

    if rest["hf"]:
        raise OptionError("--hf does not apply to bench serve (measure transformers' own "
                          "server with --url)")
    if rest["batch_sizes"] != ",".join(map(str, DEFAULT_BATCH_SIZES)):
        raise OptionError("--batch-sizes does not apply to bench serve")
    options = {name: value for name, value in serve_only.items() if value is not None}
    if "request_rate" in options and options["request_rate"] <= 0:
        raise OptionError(f"--request-rate must be > 0, got {options['request_rate']}")
    preset = rest["preset"]
    if preset is None:  # the model's shape follows where the server runs, as in bench
        from ..bench.workloads import DEFAULT_PRESETS
        preset = DEFAULT_PRESETS[auto_device() if rest["device"] == "auto" else rest["device"]]
    bench_serve_command(out=click.echo, model_dir=rest["model_dir"], preset=preset,
                        device=rest["device"], num_requests=rest["num_requests"],
                        seed=rest["seed"], scale=rest["scale"], json_path=rest["json_path"],
                        commit=rest["commit"], engine=engine, **options)
    return EXIT_OK


command = bench
