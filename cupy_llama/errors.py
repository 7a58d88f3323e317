"""Exception types. Every error a user can cause is a `CupyLlamaError` whose message is one
line that says what is wrong and how to fix it; the CLI prints it and exits 1 (2 for an
`OptionError`)."""


class CupyLlamaError(Exception):
    """Base class for errors the user can act on."""


class ModelError(CupyLlamaError):
    """The model directory cannot be used (missing files, unsupported model)."""


class ConfigError(ModelError):
    """config.json / generation_config.json is missing, malformed or unsupported."""


class CheckpointError(ModelError):
    """A safetensors file (or its index) breaks a rule, or tensors are missing/wrong."""


class TokenizerError(ModelError):
    """tokenizer.json or the chat template cannot be used."""


class RequestError(CupyLlamaError, ValueError):
    """A prompt or sampling parameter is invalid (names the offending value)."""


class DeviceError(CupyLlamaError):
    """The requested device cannot run the model (no CuPy, no GPU, no bf16, no memory)."""


class DemoModelError(CupyLlamaError):
    """The demo model could not be built."""


class OptionError(RequestError):
    """A command-line option has a bad value: a usage error (the CLI exits 2)."""


def option_flag(name: str) -> str:
    """The command-line flag of an option's Python name: max_num_seqs -> --max-num-seqs."""
    return "--" + name.replace("_", "-")


def check_output_path(path: str, flag: str) -> None:
    """An output file named by option `flag` is checked before the work, not found out when
    the results are written: its folder must exist and the file open for appending
    (nothing is written, and a file this made is removed again). OptionError if not."""
    from pathlib import Path

    target = Path(path).expanduser()
    parent = target.resolve().parent
    if parent.exists() and not parent.is_dir():
        raise OptionError(f"{flag}: {str(parent)!r} is a file, not a folder; pick another path")
    if not parent.is_dir():
        raise OptionError(f"{flag}: folder {str(parent)!r} does not exist; create it or pick "
                          "another path")
    existed = target.exists()
    try:
        with open(target, "a"):
            pass
    except OSError as e:
        raise OptionError(f"{flag}: cannot write {path!r} ({e.strerror or e}); pick another "
                          "path") from None
    if not existed:
        target.unlink()
