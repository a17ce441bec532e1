"""One multi-turn sync step on the tiny recipe (the Countdown test environment, 1-3 turns per sample) with
a chosen generation backend; prints the multi-turn metrics and the largest difference between the
generation logprob and the training pass's logprob over every sampled token of every turn (they are
the same weights in a sync step, so a misaligned or re-tokenised sequence shows up as a large value).

Usage: python benchmarks/multi_turn_exactness.py [--backend vllm|hf] [overrides ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # custom_envs:CountdownEnv and the tests' tiny config


def main() -> None:
    import torch
    from functional.helpers import read_jsonl, tiny_config

    from nemo_like.train import train

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="vllm", choices=["vllm", "hf"])
    args, overrides = parser.parse_known_args()
    tmp = Path(tempfile.mkdtemp())
    history = train(
        tiny_config(
            tmp,
            f"policy.generation.backend={args.backend}",
            "grpo.max_rollout_turns=3",
            "policy.max_total_sequence_length=96",
            "+env.arithmetic.class=custom_envs:CountdownEnv",
            "grpo.max_val_samples=8",
            "grpo.max_num_steps=1",
            "grpo.val_at_end=false",
            "logger.dump_train_data=true",
            *overrides,
        )
    )
    step = next(r for r in history if "train/reward" in r)
    for key in sorted(k for k in step if k.startswith("multi_turn/")):
        print(f"{key} = {step[key]:.4g}")
    rows = read_jsonl(tmp / "logs" / "train_data_step1.jsonl")
    worst, tokens = 0.0, 0
    for row in rows:
        gen, trained = torch.tensor(row["generation_logprobs"]), torch.tensor(row["prev_logprobs"])
        assert len(gen) == sum(row["response_mask"]), row["prompt_id"]
        worst, tokens = max(worst, (gen - trained).abs().max().item()), tokens + len(gen)
    print(f"{len(rows)} samples, turns {sorted(r['num_turns'] for r in rows)}, {tokens} sampled tokens")
    print(f"max |generation - training| logprob over sampled tokens: {worst:.3g}")


if __name__ == "__main__":
    main()
