"""The `cupy-llama` command: one module per subcommand, the options they share in
options.py, and main(), which maps errors to exit codes.

Exit codes: 0 ok, 1 runtime error (a one-line message, no traceback), 2 usage error,
130 interrupted.
"""
from __future__ import annotations

import errno
import sys

import click

from ..errors import CupyLlamaError, OptionError
from . import bench, chat, fetch_demo, generate, info, serve
from .options import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE


@click.group(context_settings={"help_option_names": ["-h", "--help"]},
             invoke_without_command=True)
@click.version_option(package_name="cupy-llama")
@click.pass_context
def cli(ctx):
    """A small, fast, readable LLM inference engine for the Llama, Mistral, Qwen and Gemma
    families."""
    if ctx.invoked_subcommand is None:  # bare `cupy-llama`: the help, as --help gives it
        click.echo(ctx.get_help())


for _module in (chat, generate, info, serve, bench, fetch_demo):
    cli.add_command(_module.command)


def _command_flags(argv) -> set[str]:
    """The option flags of the command that argv (default: sys.argv) runs."""
    args = sys.argv[1:] if argv is None else argv
    command = cli.commands.get(next((a for a in args if not a.startswith("-")), ""))
    return {flag for param in (command.params if command else ()) for flag in param.opts}


def _one_line(message: str) -> str:
    """click's message on one line: a list it spreads over indented lines ("Choose
    from:\n\tthroughput,\n\tlatency") continues its line, other lines join with "; "."""
    joined = ""
    for line in (line.strip() for line in message.splitlines()):
        if line:
            joined += (" " if joined.endswith((":", ",")) else "; ") + line if joined else line
    return joined


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
    except SystemExit as e:
        # click ends with exit(1) when stdout is a closed pipe (`... | head -1`), after
        # wrapping stdout so later flushes stay quiet; the reader has what it wanted,
        # which is not an error
        if type(sys.stdout).__name__.endswith("PacifyFlushWrapper"):
            return EXIT_OK
        return e.code if isinstance(e.code, int) else EXIT_ERROR
    except click.ClickException as e:
        message = _one_line(e.format_message())
        context = getattr(e, "ctx", None)
        if isinstance(e, click.UsageError) and context is not None:
            message += f" (see '{context.command_path} --help')"
        click.echo(f"error: {message}", err=True)
        return EXIT_USAGE if isinstance(e, click.UsageError) else e.exit_code
    except CupyLlamaError as e:
        click.echo(f"error: {e}", err=True)
        return EXIT_USAGE if isinstance(e, OptionError) else EXIT_ERROR
    except BrokenPipeError:
        return EXIT_OK
    except OSError as e:
        if e.filename is not None:  # a file or folder the user named, or the cache
            click.echo(f"error: cannot use {e.filename!r} ({e.strerror or e}); check the "
                       "path and its permissions", err=True)
            return EXIT_ERROR
        # stdout on a full disk (generate's output names itself: _Output)
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
            click.echo(f"error: cannot write the output ({e.strerror}); free some space or "
                       "send the output elsewhere", err=True)
            return EXIT_ERROR
        raise  # not the user's doing: keep the traceback
    except MemoryError as e:  # host memory (NumPy) or GPU memory (CuPy)
        detail = (str(e).strip().splitlines() or ["out of memory"])[0]
        flags = [f for f in ("--max-num-seqs", "--num-kv-blocks", "--gpu-memory-utilization")
                 if f in _command_flags(argv)]
        hint = f"; ask for less: {', '.join(flags)}" if flags else ""
        click.echo(f"error: out of memory ({detail}){hint}", err=True)
        return EXIT_ERROR
    return result if isinstance(result, int) else EXIT_OK

