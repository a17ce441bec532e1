"""Training throughput on long-tailed lengths: padded fixed micro-batches vs token-budget batching vs packing.

Usage: python benchmarks/packing.py [--samples 64] [--steps 2]

A random-init Qwen2 (hidden 256, 4 layers, vocabulary 2048; built locally, no download) trains on
``--samples`` sequences whose lengths follow a long tail (most 16-64 tokens, one in eight 384-512),
in one :class:`PolicyWorker` (one rank, fp32), on the model's own forward (``policy.shared_prompt_forward=false``),
three ways:

* ``padded``: ``policy.train_micro_batch_size=8`` samples per micro-batch in arrival order, each padded
  to its longest sample;
* ``token_budget``: ``policy.dynamic_batching`` with ``train_mb_tokens=1024``;
* ``packed``: ``policy.sequence_packing`` with ``train_mb_tokens=1024``;

then ``padded_shared_forward`` and ``token_budget_shared_forward``: the same micro-batches through the shared-prompt
forward, the CPU default for a Llama-family model, whose matmuls run no padding token (and no prompt twice; these
samples have distinct prompts); its attention still runs on blocks as wide as the micro-batch's longest sample.

It prints real (unpadded) tokens per second of ``train`` for each (best of ``--steps`` steps after a
warm-up step) and the ratios to ``padded``, measured in the same run. Not a test.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

MODES = {  # name: (micro-batch plan, shared-prompt forward)
    "padded": (None, False),
    "token_budget": ({"mode": "token_budget", "train_size": 1024, "logprob_size": 2048}, False),
    "packed": ({"mode": "packed", "train_size": 1024, "logprob_size": 2048}, False),
    "padded_shared_forward": (None, True),
    "token_budget_shared_forward": ({"mode": "token_budget", "train_size": 1024, "logprob_size": 2048}, True),
}


def long_tailed_batch(samples: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    long = torch.rand(samples, generator=g) < 1 / 8
    lengths = torch.where(long, torch.randint(384, 513, (samples,), generator=g), torch.randint(16, 65, (samples,), generator=g))
    seq = int(lengths.max())
    cols = torch.arange(seq)
    attention = (cols[None] < lengths[:, None]).long()
    token_mask = ((cols[None] >= 8) & (attention == 1)).float()
    return {
        "input_ids": torch.randint(3, 2000, (samples, seq), generator=g) * attention,
        "attention_mask": attention,
        "token_mask": token_mask,
        "sample_mask": torch.ones(samples),
        "generation_logprobs": -torch.rand(samples, seq, generator=g) * token_mask,
        "advantages": torch.randn(samples, 1, generator=g).expand(samples, seq) * token_mask,
        "global_valid_toks": token_mask.sum(),
        "global_valid_seqs": torch.tensor(float(samples)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    opts = parser.parse_args()

    from memory import build_model  # benchmarks/memory.py

    from nemo_like.algorithms.loss_functions import ClippedPGLossFn
    from nemo_like.config.loss import ClippedPGLossConfig
    from nemo_like.config.schema import OptimizerConfig
    from nemo_like.models.policy.worker import PolicyWorker

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "qwen2-small"
        n = build_model(
            model_dir,
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=4,
            vocab_size=2048,
            tie_word_embeddings=True,
        )
        batches = [long_tailed_batch(opts.samples, seed) for seed in range(opts.steps + 1)]
        real = batches[0]["attention_mask"].sum().item()
        padded_total = batches[0]["attention_mask"].numel()
        print(
            f"random-init Qwen2 {n / 1e6:.1f}M parameters; {opts.samples} samples/step, {real / opts.samples:.0f} real tokens per sample on average, "
            f"longest {batches[0]['attention_mask'].shape[1]} ({100 * real / padded_total:.0f}% of a fully padded batch is real)"
        )
        speeds = {}
        for mode, (batching, shared) in MODES.items():
            worker = PolicyWorker(
                rank=0,
                world_size=1,
                model_name=str(model_dir),
                precision="float32",
                temperature=1.0,
                num_threads=2,
                seed=0,
                loss_fn=ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0)),
                optimizer=OptimizerConfig(),
                train_micro_batch_size=8,
                batching=batching,
                shared_prompt_forward=shared,
            )
            worker.train([batches[0]])  # warm-up
            best = 0.0
            for batch in batches[1:]:
                start = time.perf_counter()
                worker.train([batch])
                best = max(best, batch["attention_mask"].sum().item() / (time.perf_counter() - start))
            speeds[mode] = best
            print(f"{mode:<28}{best:>10.0f} real tokens/s   ({worker.forward_passes['train'] // (opts.steps + 1)} micro-batches per step)")
        for mode in list(MODES)[1:]:
            print(f"{mode} / padded: {speeds[mode] / speeds['padded']:.2f}x")


if __name__ == "__main__":
    main()
