#!/usr/bin/env python
"""Build ``nemo_like/assets/tiny-arith-teacher``: the shipped tiny model after the default recipe's GRPO run, the
teacher of the distillation demo (``examples/configs/distill_tiny_cpu.yaml``).

It runs ``nemo-like train`` exactly as ``make demo`` does (the default recipe, 100 steps, seed 42: held-out accuracy
0.223 -> 0.691, bitwise reproducible run to run on one stack; the weights move with the kernels' rounding: a rebuild
on 2026-12-05 differed from the shipped ones by at most 2.2e-5, one on an Intel Xeon on 2026-12-07 by 7.8e-5, with the same
accuracies; ``--out`` is replaced whole, so it must be new, empty or a teacher this script wrote), with a checkpoint after the last step, then copies that
checkpoint's HF-format ``policy/`` and the tokenizer into the asset directory and records the run's validation
accuracy in ``build_info.json``.

Usage:
  python scripts/build_tiny_teacher.py [--out DIR] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "nemo_like" / "assets" / "tiny-arith-teacher"
STEPS = 100


def train(work: Path) -> Path:
    """The default recipe's run with a final checkpoint; returns the checkpoint's ``policy/`` directory."""
    command = [
        sys.executable,
        "-m",
        "nemo_like.cli",
        "train",
        f"grpo.max_num_steps={STEPS}",
        f"logger.log_dir={work / 'logs'}",
        "checkpointing.enabled=true",
        f"checkpointing.checkpoint_dir={work / 'ckpt'}",
        f"checkpointing.save_period={STEPS}",
        "checkpointing.resume=false",
    ]
    subprocess.run(command, check=True, cwd=ROOT)
    return work / "ckpt" / f"step_{STEPS}" / "policy"


def final_accuracy(log_dir: Path) -> tuple[float, float]:
    """Held-out accuracy at step 0 and at the last step, from the run's metrics.jsonl."""
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    accuracy = [(r["step"], r["validation/accuracy"]) for r in records if "validation/accuracy" in r]
    return accuracy[0][1], accuracy[-1][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--work", type=Path, default=None, help="where the run's logs and checkpoint go (default: a temp dir)")
    args = parser.parse_args()
    if args.out.exists() and any(args.out.iterdir()) and not (args.out / "build_info.json").is_file():
        parser.error(
            f"--out {args.out} holds files and is not a teacher this script wrote (no build_info.json), which it replaces whole: pass a new or empty directory"
        )
    from nemo_like.models.assets import default_model_path
    from nemo_like.models.loading import load_tokenizer

    work = args.work or Path(tempfile.mkdtemp(prefix="tiny-teacher-"))
    policy_dir = train(work)
    before, after = final_accuracy(work / "logs")
    if args.out.exists():
        shutil.rmtree(args.out)
    shutil.copytree(policy_dir, args.out)
    load_tokenizer(default_model_path()).save_pretrained(args.out)
    import torch
    import transformers

    info = {"base": "embedded:tiny-arith-qwen2", "recipe": "examples/configs/grpo_tiny_cpu.yaml", "steps": STEPS, "seed": 42}
    info["script"] = "scripts/build_tiny_teacher.py"
    info["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}  # the weights follow the kernels
    info["validation_accuracy"] = {"step_0": before, f"step_{STEPS}": after}
    (args.out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"teacher written to {args.out}: held-out accuracy {before:.3f} (step 0) -> {after:.3f} (step {STEPS})")


if __name__ == "__main__":
    main()
