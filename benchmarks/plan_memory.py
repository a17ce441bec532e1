"""The memory planner's training-step estimate against a measured step, on this CPU.

Usage: python benchmarks/plan_memory.py

For each configuration (model size, micro-batch, activation checkpointing) a fresh process loads a one-rank
PolicyWorker (fp32, random-init Qwen2 built locally: no download), runs one warm-up step of one 16-token row (so
gradients and AdamW state exist and the allocator caches nothing of the measured size), then measures the
resident memory above the level just before the measured step (sampled every millisecond by a thread) during one
training step of the configured micro-batch. The planner predicts that step's peak above the loaded model and AdamW
state as ``max(activations + gradients, gradients)`` (gradients stay allocated from the warm-up step, so the
measured peak is the activations' on top of them): the table prints the planner's activations, the measured
increase, and their ratio. Parameters, gradients and AdamW state are exact (tests/unit/plan/test_memory_plan.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

CONFIGS = [  # name, model overrides, micro-batch rows, sequence length, activation checkpointing
    ("16M rows4 s256", dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, vocab_size=32000), 4, 256, False),
    ("16M rows8 s256", dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, vocab_size=32000), 8, 256, False),
    ("16M rows8 s256 ckpt", dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, vocab_size=32000), 8, 256, True),
    ("63M rows4 s256", dict(), 4, 256, False),
    ("63M rows4 s512", dict(), 4, 512, False),
    ("63M rows4 s512 ckpt", dict(), 4, 512, True),
]


def rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(model_dir: str, rows: int, seq: int, checkpointing: bool, out: str) -> None:
    """One process: warm-up step, then the measured step's peak RSS above the level before it."""
    import torch
    from memory import train_batch

    from nemo_like.algorithms.loss_functions import ClippedPGLossFn
    from nemo_like.config.loss import ClippedPGLossConfig
    from nemo_like.config.schema import OptimizerConfig
    from nemo_like.models.policy.worker import PolicyWorker

    torch.set_num_threads(2)
    worker = PolicyWorker(
        rank=0,
        world_size=1,
        model_name=model_dir,
        precision="float32",
        temperature=1.0,
        num_threads=2,
        seed=0,
        loss_fn=ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0)),
        optimizer=OptimizerConfig(),
        max_grad_norm=1.0,
        train_micro_batch_size=rows,
        shared_prompt_forward=False,
        dtensor_cfg={"activation_checkpointing": checkpointing},
    )
    worker.train([train_batch(rows=1, seq=16)])  # gradients and AdamW state allocated, nothing of the measured size cached
    baseline, peak, running = rss_bytes(), [0], [True]

    def sample() -> None:
        while running[0]:
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.001)

    thread = threading.Thread(target=sample)
    thread.start()
    worker.train([train_batch(rows=rows, seq=seq)])
    running[0] = False
    thread.join()
    Path(out).write_text(json.dumps({"increase": max(0, peak[0] - baseline), "footprint": worker.memory_footprint()}))


def predicted(model_dir: str, rows: int, seq: int, checkpointing: bool) -> int:
    from nemo_like.config import DEFAULT_RECIPE, load_config
    from nemo_like.models.footprint import model_footprint
    from nemo_like.plan.memory import policy_memory

    overrides = [
        f"policy.model_name={model_dir}",
        f"policy.train_micro_batch_size={rows}",
        f"policy.max_total_sequence_length={seq}",
        "policy.generation.max_new_tokens=16",
        f"policy.dtensor_cfg.activation_checkpointing={str(checkpointing).lower()}",
        "policy.logprob_batch_size=1",
    ]
    cfg = load_config(DEFAULT_RECIPE, overrides, warn=False)
    params, shape = model_footprint(model_dir, "float32")
    return policy_memory(cfg, params, shape).activations


def main() -> None:
    from memory import build_model

    print("config                  planned activations  measured increase  measured/planned")
    with tempfile.TemporaryDirectory() as tmp:
        built: dict[str, str] = {}
        for name, overrides, rows, seq, ckpt in CONFIGS:
            key = json.dumps(overrides, sort_keys=True)
            if key not in built:
                built[key] = str(Path(tmp) / f"model{len(built)}")
                build_model(Path(built[key]), **overrides)
            out = Path(tmp) / "out.json"
            args = [sys.executable, __file__, "--run", built[key], str(rows), str(seq), str(int(ckpt)), str(out)]
            subprocess.run(args, check=True)
            measured = json.loads(out.read_text())["increase"]
            plan = predicted(built[key], rows, seq, ckpt)
            print(f"{name:<24}{plan / 2**20:>14.1f} MiB{measured / 2**20:>15.1f} MiB{measured / plan:>15.2f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--run":
        measure(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), bool(int(sys.argv[5])), sys.argv[6])
    else:
        main()
