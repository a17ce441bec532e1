"""Small builders shared by the end-to-end tests (real model, real tokenizer, real actors)."""

from __future__ import annotations

import json
from pathlib import Path

from nemo_like.config import MasterConfig, load_config

REPO = Path(__file__).resolve().parents[2]
TINY_RECIPE = REPO / "examples" / "configs" / "grpo_tiny_cpu.yaml"


# The functional tests' tiny run: 4 prompts x 4 generations, 2 steps, 32 validation prompts, no plot at the end.
TINY_OVERRIDES = [
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "grpo.max_num_steps=2",
    "grpo.max_val_samples=32",
    "grpo.val_period=0",
    "policy.train_micro_batch_size=8",
    "policy.num_cpus_per_worker=0.25",
    "data.train.num_problems=256",
    "logger.progress_bar=false",
    "logger.plot_at_end=false",  # ~2 s per run; the tests that check the plot turn it on
]


def tiny_config(tmp_path: Path, *overrides: str) -> MasterConfig:
    """The shipped tiny recipe, shrunk for tests (:data:`TINY_OVERRIDES`), logging under ``tmp_path``."""
    return load_config(TINY_RECIPE, [*TINY_OVERRIDES, f"logger.log_dir={tmp_path / 'logs'}", *overrides])


def ckpt_overrides(ckpt_dir: Path, period: int = 3) -> tuple[str, ...]:
    """Checkpoint every ``period`` steps into ``ckpt_dir``, keeping every checkpoint (no best-k by a metric)."""
    return (
        "checkpointing.enabled=true",
        f"checkpointing.checkpoint_dir={ckpt_dir}",
        f"checkpointing.save_period={period}",
        "checkpointing.keep_top_k=null",
        "checkpointing.metric_name=null",
    )


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a JSONL file (``metrics.jsonl``, sample dumps, ``results.jsonl``)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def read_metrics(log_dir: Path) -> list[dict]:
    """The per-step records a run wrote to ``<log_dir>/metrics.jsonl``."""
    return read_jsonl(Path(log_dir) / "metrics.jsonl")
