"""What the work of a vs-TRL step costs in eager PyTorch with no framework at all, against TRL's step, side by side.

Usage (from the repository root, our venv; TRL in .venv-trl as for ``benchmarks/vs_trl.py``):

    python benchmarks/vs_trl_floor.py                 # W1 (default), 2 warm-up + 7 interleaved pairs
    python benchmarks/vs_trl_floor.py --workloads W1,W2

``benchmarks/vs_trl.py`` compares our whole step (Ray actors, the sync loop) with TRL's. This script asks how low any
framework could go with eager PyTorch on this machine: each pair runs one TRL step (its subprocess, as in
``vs_trl.py``) and, in this process, the bare work of a step on the same model and prompts:

* **sample**: our fastest eager sampler, :func:`nemo_like.models.generation.lean_decoder.sample` (the fused
  Llama-family step, KV cache, each prompt prefilled once; 0.6x the time of HF ``generate``:
  ``benchmarks/lean_generation.py``), every completion full length;
* **update**: one optimizer step on the sampled batch with nothing around it: the model's own forward over prompt +
  completion, the completions' log-probabilities (log-softmax, gather), a REINFORCE surrogate with random
  advantages, backward, fused AdamW, ``zero_grad``.

No loss metrics, no logprob transforms, no Ray, no reward, no logging: what the step's eager kernels cost with nothing
around them. Prints each side's median, the ratio bare/TRL pair by pair and the medians of the two parts.

Where the small model's kernels are too small for our training-side changes to pay (W1: 1M parameters, 8 sequences
of ~37 tokens), bare/TRL is what a framework on eager PyTorch can approach at best here; a ratio goal below it needs
fewer or cheaper kernels (a compiled step), not less framework. At W2 our own step is faster than this bare one (its
training forward runs each group's prompt once and its larger products through oneDNN), so there it is a reference
point, not a floor.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from vs_trl import PROMPT_BUDGET, WORKLOADS, TRLProcess, build_model, one_pair, print_pair, prompt_rows, tokenizer, trl_spec

from nemo_like.models.generation.lean_decoder import sample
from nemo_like.models.processed_logprobs import SamplingDistribution


class BareStep:
    """The step's work in eager PyTorch, nothing else: sample the batch, then one REINFORCE update on it."""

    def __init__(self, model_dir: str, work: dict, texts: list[str]) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        tok = tokenizer(model_dir)
        self.prompts = [tok(t, add_special_tokens=False)["input_ids"][:PROMPT_BUDGET] for t in texts]
        self.work, self.pad = work, tok.pad_token_id
        self.stop = self.model.config.eos_token_id
        self.count = 0

    def step(self) -> tuple[float, float]:
        """``(sample seconds, update seconds)`` of one step on the next ``prompts`` prompts."""
        w = self.work
        start = self.count * w["prompts"] % len(self.prompts)
        prompts = [self.prompts[(start + i) % len(self.prompts)] for i in range(w["prompts"])]
        batch = [p for p in prompts for _ in range(w["generations"])]
        self.count += 1
        t0 = time.perf_counter()
        self.model.eval()
        drawn = sample(self.model, batch, w["new_tokens"], SamplingDistribution(), [self.stop], self.pad, seed=self.count)
        t1 = time.perf_counter()
        self.model.train()
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width + w["new_tokens"]), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch):  # right-padded prompt, then its completion
            ids[i, : len(p)] = torch.tensor(p)
            ids[i, len(p) : len(p) + w["new_tokens"]] = drawn.tokens[i]
            mask[i, : len(p) + w["new_tokens"]] = 1
        logits = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        completion = torch.zeros_like(logp)
        for i, p in enumerate(batch):
            completion[i, len(p) - 1 : len(p) - 1 + w["new_tokens"]] = 1.0
        advantages = torch.randn(len(batch), 1)
        loss = -(advantages * logp * completion).sum() / completion.sum()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        return t1 - t0, time.perf_counter() - t1


def run_pairs(name: str, args: argparse.Namespace, tmp: str) -> dict:
    work = WORKLOADS[name]
    model_dir, n_params = build_model(Path(tmp) / f"model-{work['size']}", work["size"])
    rows = prompt_rows(model_dir, 64, work["prompts"], args.warmup + args.steps)
    trl = TRLProcess(args.trl_python, trl_spec(model_dir, tmp, rows, work, None, True, "float32"))
    bare = BareStep(model_dir, work, [text for text, _ in rows])
    pairs = []
    try:
        for i in range(args.warmup + args.steps):
            (t_trl, _, _), parts, load = one_pair(i, trl, bare.step)  # both take the rows in order
            pairs.append({"trl": t_trl, "sample": parts[0], "update": parts[1], "load": load})
            bare_s = sum(parts)
            text = f"TRL {t_trl:.3f}s  bare {bare_s:.3f}s (sample {parts[0]:.3f}, update {parts[1]:.3f})  ratio {bare_s / t_trl:.2f}"
            print_pair(name, i, args.warmup, text)
    finally:
        trl.close()
    steady = pairs[args.warmup :]
    return {
        "workload": name,
        "params": n_params,
        "trl": statistics.median(p["trl"] for p in steady),
        "bare": statistics.median(p["sample"] + p["update"] for p in steady),
        "sample": statistics.median(p["sample"] for p in steady),
        "update": statistics.median(p["update"] for p in steady),
        "ratios": [(p["sample"] + p["update"]) / p["trl"] for p in steady],
        "load": [p["load"] for p in steady],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="W1")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--trl-python", default=".venv-trl/bin/python")
    args = p.parse_args()
    if not Path(args.trl_python).exists():
        print(f"error: no TRL python at {args.trl_python}; run `make bench-trl-venv` first (or pass --trl-python)", file=sys.stderr)
        return 2
    torch.set_num_threads(2)  # as our actors and TRL's process run here
    random.seed(0)
    results = []
    with tempfile.TemporaryDirectory(prefix="vs_trl_floor_") as tmp:
        for name in args.workloads.split(","):
            results.append(run_pairs(name, args, tmp))
    print("\n| workload | TRL s/step | bare eager s/step (sample + update) | bare/TRL (pairs) | median | load (1 min) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        ratios = " ".join(f"{x:.2f}" for x in r["ratios"])
        print(
            f"| {r['workload']} ({r['params'] / 1e6:.1f}M) | {r['trl']:.3f} | {r['bare']:.3f} ({r['sample']:.3f} + {r['update']:.3f}) "
            f"| {ratios} | **{statistics.median(r['ratios']):.2f}** | {min(r['load']):.1f}-{max(r['load']):.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
