"""Eager vs ``torch.compile`` for one W2-sized policy update, in-process (no Ray, no framework around it).

Usage: python benchmarks/compile_training.py [--size 10m|1m] [--steps 6] [--threads 2]

Builds the model of ``benchmarks/vs_trl.py`` (random init), then times one update as the policy worker runs it
for a W2-sized batch (64 sequences of 21 prompt + 64 response tokens, micro-batches of 32; 21 tokens is W2's longest
prompt, its 64 prompts average 17.9, so this batch's FLOP floor is ~4% above the one ``vs_trl.py`` prints): forward, token
log-probabilities (log-softmax over the vocabulary, gathered), a policy-gradient surrogate loss, backward and an
AdamW step. Once with the eager model, once with ``torch.compile(model)`` (inductor, CPU); prints the compile
time (the first step) and the steady-state median of each, and the FLOP floor at ``--peak-gflops``. First it times
our own update of the same batch (``PolicyWorker.train`` in-process: the loss with its metrics, clipping, fused
AdamW), with the shared-prompt forward (each group's prompt computed once; the CPU default) and with the model's own
forward, so both what sharing saves and the framework's overhead over the bare update show. The batch has W2's
shape: 8 prompts x 8 completions.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from vs_trl import build_model


def update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor, micro: int) -> None:
    """One optimizer step over ``ids`` in micro-batches (gradients accumulated)."""
    optimizer.zero_grad(set_to_none=True)
    for start in range(0, ids.shape[0], micro):
        batch = ids[start : start + micro]
        logits = model(input_ids=batch).logits[:, :-1].float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, batch[:, 1:, None]).squeeze(-1)
        loss = -(logprobs * 0.1).mean()  # the shape of a policy-gradient surrogate with a constant advantage
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def time_updates(model: torch.nn.Module, ids: torch.Tensor, micro: int, steps: int) -> tuple[float, list[float]]:
    """``(first step seconds, the later steps' seconds)``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        update(model, optimizer, ids, micro)
        times.append(time.perf_counter() - start)
    return times[0], times[1:]


def policy_worker_and_batch(model_dir: str, ids: torch.Tensor, threads: int, shared_prompt_forward: bool, responses: int = 64):
    """Our :class:`PolicyWorker` in-process, built as a run builds it (the default recipe's loss and optimizer settings,
    micro-batches of 32), and a training batch of ``ids`` whose last ``responses`` tokens are the responses."""
    from recipe_runs import quiet_config

    from nemo_like.algorithms.loss_functions import ClippedPGLossFn
    from nemo_like.models.policy.spec import PolicyWorkerSpec
    from nemo_like.models.policy.worker import PolicyWorker

    overrides = [
        f"policy.model_name={model_dir}", "loss_fn.reference_policy_kl_penalty=0", "policy.train_micro_batch_size=32",
        f"policy.train_global_batch_size={ids.shape[0]}", f"policy.shared_prompt_forward={str(shared_prompt_forward).lower()}",
    ]  # fmt: skip
    cfg = quiet_config(tempfile.gettempdir(), overrides)
    worker = PolicyWorker(0, 1, PolicyWorkerSpec.from_config(cfg, True, ClippedPGLossFn(cfg.loss_fn), threads))  # as a run builds it
    token_mask = torch.zeros(ids.shape)
    token_mask[:, -responses:] = 1
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "token_mask": token_mask,
        "sample_mask": torch.ones(ids.shape[0]),
        "generation_logprobs": torch.full(ids.shape, -5.0) * token_mask,
        "advantages": torch.randn(ids.shape[0], 1) * token_mask,
        "global_valid_toks": token_mask.sum(),
        "global_valid_seqs": torch.tensor(float(ids.shape[0])),
    }
    return worker, batch


def time_policy_worker(model_dir: str, ids: torch.Tensor, steps: int, threads: int, shared_prompt_forward: bool) -> float:
    """Median seconds of our own update of ``ids`` (:func:`policy_worker_and_batch`, the responses being the last 64
    tokens), with the shared-prompt forward or the model's own."""
    worker, batch = policy_worker_and_batch(model_dir, ids, threads, shared_prompt_forward)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        worker.train([batch])
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=("1m", "10m"), default="10m")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peak-gflops", type=float, default=178.0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="compile_") as tmp:
        model_dir, n_params = build_model(Path(tmp) / "model", args.size)
        vocab = AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size
        torch.manual_seed(0)
        prompts = torch.randint(0, vocab - 1, (8, 21)).repeat_interleave(8, dim=0)  # 8 prompts x 8 completions, as W2
        ids = torch.cat([prompts, torch.randint(0, vocab - 1, (64, 64))], dim=1)
        floor = 6 * n_params * ids.numel() / (args.peak_gflops * 1e9)
        print(f"{args.size} ({n_params / 1e6:.1f}M params), batch {tuple(ids.shape)}, micro-batches of 32, {args.threads} threads")
        print(f"  FLOP floor: {floor:.3f} s")
        for shared in (True, False):
            ours = time_policy_worker(model_dir, ids, args.steps, args.threads, shared)
            forward = "shared-prompt forward (the CPU default)" if shared else "the model's own forward"
            print(f"  our PolicyWorker.train, {forward}: median {ours:.3f} s ({ours / floor:.2f}x the floor)")
        for name in ("eager", "torch.compile"):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            model.train()
            if name == "torch.compile":
                model = torch.compile(model)
            first, later = time_updates(model, ids, 32, args.steps)
            median = statistics.median(later)
            print(f"  {name}: first step {first:.2f} s, then median {median:.3f} s ({median / floor:.2f}x the floor)")


if __name__ == "__main__":
    main()
