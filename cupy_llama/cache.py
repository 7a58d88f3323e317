"""Where cupy-llama keeps what it makes once and reuses: the demo model, the benchmarks'
random models and the chat's input history."""
from __future__ import annotations

import os
from pathlib import Path

DEFAULT_CACHE = Path("~/.cache/cupy-llama").expanduser()


def cache_dir() -> Path:
    """$CUPY_LLAMA_CACHE, else $XDG_CACHE_HOME/cupy-llama, else ~/.cache/cupy-llama."""
    if os.environ.get("CUPY_LLAMA_CACHE"):
        return Path(os.environ["CUPY_LLAMA_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "cupy-llama"
    return DEFAULT_CACHE
