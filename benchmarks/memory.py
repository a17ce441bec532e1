"""Memory of one policy rank: FSDP2 dp 1 vs dp 2, and chunked vs full-vocabulary logprobs.

Usage: python benchmarks/memory.py [--skip-dp] [--skip-chunk]

1. **dp 1 vs dp 2** on a random-init Qwen2 of ~63M parameters (hidden 512, 8 layers, vocabulary
   32k, untied head), built locally in a temporary directory (no download). Each configuration runs
   in fresh processes (gloo for dp 2) that do one training step of a small batch with
   :class:`PolicyWorker`; each rank reports the bytes it holds in parameters, gradients and AdamW
   state (its shards: :meth:`PolicyWorker.memory_footprint`) and its peak RSS.
2. **chunked vs full logprobs** on a random-init Qwen2 with a 150k vocabulary (hidden 256, 2 layers):
   one logprob pass of 2 x 1024 tokens, in a fresh process each, peak RSS above the RSS right before
   the pass (the model and inputs already in memory).

Prints the numbers side by side and their ratios. Not a test.
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def build_model(directory: Path, **overrides) -> int:
    """Save a random-init Qwen2 with the shipped tiny model's layout and ``overrides``; returns its parameter count."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    cfg = dict(
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    cfg.update(overrides)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**cfg))
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def train_batch(rows: int = 4, seq: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(rows, seq, dtype=torch.long)
    token_mask = torch.ones(rows, seq)
    token_mask[:, :8] = 0
    return {
        "input_ids": torch.randint(3, 30000, (rows, seq), generator=g),
        "attention_mask": mask,
        "token_mask": token_mask,
        "sample_mask": torch.ones(rows),
        "generation_logprobs": -torch.rand(rows, seq, generator=g) * token_mask,
        "advantages": torch.randn(rows, 1, generator=g).expand(rows, seq) * token_mask,
        "global_valid_toks": token_mask.sum() * 2,
        "global_valid_seqs": torch.tensor(float(rows * 2)),
    }


def dp_rank(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    """One rank: one optimizer step on its half (dp 2) or all (dp 1) of 8 samples; writes its numbers."""
    from nemo_like.algorithms.loss_functions import ClippedPGLossFn
    from nemo_like.config.loss import ClippedPGLossConfig
    from nemo_like.config.schema import OptimizerConfig
    from nemo_like.models.policy.worker import PolicyWorker

    worker = PolicyWorker(
        rank=rank,
        world_size=world,
        model_name=model_dir,
        precision="float32",
        temperature=1.0,
        num_threads=1,
        seed=0,
        loss_fn=ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0)),
        optimizer=OptimizerConfig(),
        max_grad_norm=1.0,
        train_micro_batch_size=4,
        shared_prompt_forward=False,  # sharded ranks run the model's own forward; so does the one-rank baseline
    )
    if world > 1:
        worker.setup_distributed("127.0.0.1", port)
    batch = train_batch(rows=8 // world)
    worker.train([batch])
    Path(out).write_text(json.dumps({**worker.memory_footprint(), "peak_rss_mb": peak_rss_mb()}))


def chunk_pass(model_dir: str, chunk: int | None, out: str) -> None:
    """One no-grad logprob pass of 2 x 1024 tokens; writes the peak RSS above the pre-pass level."""
    from nemo_like.models.loading import load_causal_lm
    from nemo_like.models.logprobs import sequence_logprobs

    torch.set_num_threads(2)
    model = load_causal_lm(model_dir).eval()
    ids = torch.randint(3, 150000, (2, 1024), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        sequence_logprobs(model, ids[:, :8], mask[:, :8], 1.0, chunk)  # warm up kernels at negligible size
        before = status_mb("VmRSS")
        reset_peak_rss()  # the peak since now: ru_maxrss keeps the model load's (above the RSS before the pass)
        sequence_logprobs(model, ids, mask, 1.0, chunk)
    Path(out).write_text(json.dumps({"peak_above_baseline_mb": status_mb("VmHWM") - before, "baseline_mb": before}))


def status_mb(field: str) -> float:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``: resident now; ``VmHWM``: the peak since the last reset) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field} (Linux only)")


def reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark (``VmHWM``) to the current RSS (Linux: ``/proc/self/clear_refs``)."""
    Path("/proc/self/clear_refs").write_text("5")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dp_comparison(tmp: Path) -> None:
    model_dir = tmp / "qwen2-63m"
    n = build_model(model_dir)
    print(f"dp 1 vs dp 2: random-init Qwen2, {n / 1e6:.1f}M parameters, fp32, AdamW, one step")
    results = {}
    for world in (1, 2):
        port = free_port()
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--run",
                    "dp_rank",
                    str(r),
                    str(world),
                    str(port),
                    str(model_dir),
                    str(tmp / f"dp{world}_r{r}.json"),
                ],
                env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
            )
            for r in range(world)
        ]
        for p in procs:
            if p.wait():
                raise SystemExit(f"dp {world} rank failed")
        results[world] = json.loads((tmp / f"dp{world}_r0.json").read_text())
    mb = 2**20
    print(f"{'rank 0 holds (MiB)':<24}{'dp 1':>10}{'dp 2':>10}{'dp2/dp1':>10}")
    for key in ("params", "grads", "optimizer"):
        a, b = results[1][key] / mb, results[2][key] / mb
        print(f"{key:<24}{a:>10.1f}{b:>10.1f}{b / a:>10.2f}")
    tot1 = sum(results[1][k] for k in ("params", "grads", "optimizer")) / mb
    tot2 = sum(results[2][k] for k in ("params", "grads", "optimizer")) / mb
    print(f"{'params+grads+optimizer':<24}{tot1:>10.1f}{tot2:>10.1f}{tot2 / tot1:>10.2f}   (fall: {100 * (1 - tot2 / tot1):.0f}%)")
    r1, r2 = results[1]["peak_rss_mb"], results[2]["peak_rss_mb"]
    print(f"{'peak RSS of the process':<24}{r1:>10.1f}{r2:>10.1f}{r2 / r1:>10.2f}   (includes torch/transformers, ~0.5 GB)")


def chunk_comparison(tmp: Path) -> None:
    model_dir = tmp / "qwen2-150k"
    n = build_model(
        model_dir,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=150000,
        tie_word_embeddings=True,
    )
    print(f"\nchunked vs full logprobs: random-init Qwen2 with a 150k vocabulary ({n / 1e6:.1f}M parameters), 2 x 1024 tokens, no grad")
    peaks = {}
    for chunk in (None, 256):
        out = tmp / f"chunk_{chunk}.json"
        subprocess.run(
            [sys.executable, __file__, "--run", "chunk_pass", str(model_dir), str(chunk or 0), str(out)],
            check=True,
            env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
        )
        peaks[chunk] = json.loads(out.read_text())["peak_above_baseline_mb"]
    print(f"{'peak above baseline (MiB)':<26}{'full':>10}{'chunk 256':>12}{'full/chunked':>14}")
    print(f"{'logprob pass':<26}{peaks[None]:>10.1f}{peaks[256]:>12.1f}{peaks[None] / max(peaks[256], 1e-9):>14.1f}x")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--run":
        what, args = sys.argv[2], sys.argv[3:]
        if what == "dp_rank":
            dp_rank(int(args[0]), int(args[1]), int(args[2]), args[3], args[4])
        else:
            chunk_pass(args[0], int(args[1]) or None, args[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-dp", action="store_true")
    parser.add_argument("--skip-chunk", action="store_true")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if not opts.skip_dp:
            dp_comparison(Path(tmp))
        if not opts.skip_chunk:
            chunk_comparison(Path(tmp))


if __name__ == "__main__":
    main()
