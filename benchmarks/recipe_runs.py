"""Shared by the benchmarks: run the embedded recipe for a few steps, quietly, without validation."""

from __future__ import annotations

from nemo_like.config import DEFAULT_RECIPE, MasterConfig, load_config
from nemo_like.train import train


def quiet_config(log_dir: str, overrides: list[str], steps: int | None = None) -> MasterConfig:
    """The embedded recipe with no validation, no progress bar or timing lines, logging to ``log_dir``, then
    ``overrides`` (and ``steps`` steps when given)."""
    return load_config(
        DEFAULT_RECIPE,
        [
            *([f"grpo.max_num_steps={steps}"] if steps is not None else []),
            "grpo.val_at_start=false",
            "grpo.val_at_end=false",
            "grpo.val_period=0",
            "logger.progress_bar=false",
            "logger.console_timing_period=0",
            f"logger.log_dir={log_dir}",
            *overrides,
        ],
    )


def run_recipe(steps: int, log_dir: str, overrides: list[str]) -> list[dict]:
    """Train ``steps`` steps of the embedded recipe with ``overrides``; returns the per-step records."""
    return train(quiet_config(log_dir, overrides, steps))
