"""How far below the other tokens the stop token's logit sits in ``benchmarks/vs_trl.py``'s models, at the positions
that sample a completion's tokens (the equal-work premise: no completion may end early).

Usage: python benchmarks/stop_token_gap.py [W1 W2 W3]   (default: W1 W2; W3 builds a 35M model, ~1 min more)

Per workload: the model vs_trl builds, one of its prompts, one sampled completion of the workload's length; prints the
smallest and the median gap between the stop token's logit and the mean of the others, and the smallest gap to the
least likely other token, in nats.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_trl  # noqa: E402


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            work = vs_trl.WORKLOADS[name]
            directory, params = vs_trl.build_model(Path(tmp) / name, work["size"])
            model, tok = AutoModelForCausalLM.from_pretrained(directory).eval(), vs_trl.tokenizer(directory)
            prompt = torch.tensor([tok(vs_trl.prompt_rows(directory, 1, 1, 1)[0][0], add_special_tokens=False)["input_ids"]])
            torch.manual_seed(0)
            out = model.generate(prompt, do_sample=True, temperature=1.0, max_new_tokens=work["new_tokens"], top_k=0, top_p=1.0)
            with torch.no_grad():
                logits = model(out).logits[0, prompt.shape[1] - 1 : -1]  # the positions that sampled a token
            eos = tok.eos_token_id
            others = torch.cat([logits[:, :eos], logits[:, eos + 1 :]], dim=1)
            below_mean, below_min = others.mean(-1) - logits[:, eos], others.min(-1).values - logits[:, eos]
            print(
                f"{name} ({params / 1e6:.1f}M params): stop logit below the mean of the others: min {below_mean.min():.1f}, "
                f"median {below_mean.median():.1f} nats; below the least likely other token: min {below_min.min():.1f}",
                flush=True,
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="*", help=f"of {sorted(vs_trl.WORKLOADS)} (default: W1 W2)")
    names = parser.parse_args().workloads or ["W1", "W2"]
    if unknown := [n for n in names if n not in vs_trl.WORKLOADS]:  # not argparse's choices: it refuses an empty list
        parser.error(f"unknown workloads {unknown}: choose from {sorted(vs_trl.WORKLOADS)}")
    main(names)
