"""`python -m cupy_llama.cli`: the `cupy-llama` command."""
import sys

from . import main

sys.exit(main())
