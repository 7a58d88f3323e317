"""Write a random-weight Llama model directory (seeded, bf16).

    python scripts/make_random_model.py OUT_DIR [--preset tiny|llama-3.2-1b] [--seed 0]
        [--set key=value ...]   # override config values, e.g. --set num_hidden_layers=4
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cupy_llama.bench.random_model import PRESETS, make_random_model  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config.json value (JSON-parsed)")
    args = parser.parse_args()
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    path = make_random_model(args.out_dir, args.preset, seed=args.seed, **overrides)
    print(path)


if __name__ == "__main__":
    main()
