"""Write a random-weight model directory of any supported family (seeded, bf16).

    python scripts/make_random_model.py OUT_DIR [--preset NAME] [--seed 0]
        [--set key=value ...]   # override config values, e.g. --set num_hidden_layers=4

A preset is a released model's shape (or "tiny"); --set 'architectures=["MistralForCausalLM"]'
picks a family that has no preset. A preset's special-token ids come with it: shrinking
llama-3.2-1b's vocab_size below its eos ids (128001...) is refused; start from "tiny".
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cupy_llama.bench.random_model import PRESETS, make_random_model  # noqa: E402
from cupy_llama.errors import CupyLlamaError  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="\n".join(__doc__.splitlines()[5:]))
    parser.add_argument("out_dir")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config.json value (JSON-parsed)")
    args = parser.parse_args()
    overrides = {}
    for item in args.set:
        key, equals, value = item.partition("=")
        if not key or not equals:
            parser.error(f"--set {item!r}: give KEY=VALUE, such as num_hidden_layers=4")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    try:
        path = make_random_model(args.out_dir, args.preset, seed=args.seed, **overrides)
    except CupyLlamaError as e:
        parser.exit(2, f"error: {e}\n")
    except (TypeError, ValueError) as e:  # a value of the wrong kind, before the config's checks
        parser.exit(2, f"error: the --set values make no valid config ({e})\n")
    print(path)


if __name__ == "__main__":
    main()
