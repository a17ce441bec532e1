"""Metrics sinks: ``metrics.jsonl`` (always), the console, and TensorBoard when enabled."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from nemo_like.config.schema import LoggerConfig


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible rather than dropping them
    return value


class Logger:
    """One JSON object per step in ``<log_dir>/metrics.jsonl``; the resolved config beside it."""

    def __init__(self, cfg: LoggerConfig, total_steps: int) -> None:
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.log_dir / "metrics.jsonl"
        self._jsonl = self.metrics_path.open("a", buffering=1)
        self._tb = None
        if cfg.tensorboard_enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.log_dir / "tensorboard"))
        self.progress = ConsoleProgress(total_steps, enabled=cfg.progress_bar)

    def save_config(self, resolved: dict[str, Any]) -> Path:
        path = self.log_dir / "config.yaml"
        path.write_text(yaml.safe_dump(resolved, sort_keys=False))
        return path

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self.progress.close()
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


class ConsoleProgress:
    """A live bar (step, reward, ETA) on a terminal; one plain line per step elsewhere (CI logs)."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.enabled = total, enabled
        self.start = time.monotonic()
        self._rich = None
        if enabled and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._rich = Progress(
                TextColumn("GRPO"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"), TimeRemainingColumn()
            )
            self._task = self._rich.add_task("train", total=total, info="")
            self._rich.start()

    def update(self, step: int, info: str) -> None:
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.update(self._task, completed=step, info=info)
            return
        elapsed = time.monotonic() - self.start
        eta = elapsed / max(step, 1) * (self.total - step)
        print(f"[step {step}/{self.total}] {info} | elapsed {elapsed:.0f}s eta {eta:.0f}s", file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        if self._rich is not None:
            self._rich.console.print(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
