"""Same as ``nemo-like train``: ``python examples/run_grpo.py --config FILE [overrides...]``."""

import sys

from nemo_like.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
