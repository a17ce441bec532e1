#!/usr/bin/env python
"""Write the shipped multi-turn prompt sets (``nemo_like/assets/multiturn-tasks/``), deterministically.

Usage: python scripts/build_multiturn_datasets.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from nemo_like.data.multiturn_tasks import ASSET_DIR, make_guess_number_problems, make_multiply_problems, write_jsonl  # noqa: E402

SIZES = {"train": 4000, "validation": 256}


def main(argv: list[str] | None = None) -> int:
    """Build both sets."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=ASSET_DIR)
    args = p.parse_args(argv)
    for split, n in SIZES.items():
        write_jsonl(make_multiply_problems(n, 0, split), args.out / "tool-arith" / f"{split}.jsonl")
        write_jsonl(make_guess_number_problems(n, 0 if split == "train" else 1), args.out / "guess-number" / f"{split}.jsonl")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
