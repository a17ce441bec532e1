"""The run's logger: fans each step's metrics out to every backend, and drives the console progress.

Backends (``nemo_like/utils/log_backends.py``): ``metrics.jsonl`` (always), TensorBoard
(``logger.tensorboard_enabled``), Weights & Biases (``logger.wandb_enabled``). All get the same
metric names and step; a backend that fails warns once and is dropped, training goes on.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import yaml

from nemo_like.config.schema import LoggerConfig
from nemo_like.utils.log_backends import JsonlBackend, LogBackend, start_backends, warn_backend


class Logger:
    """One JSON object per step in ``<log_dir>/metrics.jsonl``, the same metrics in the enabled
    dashboards, and the resolved config beside them (``config.yaml``, TB hparams, W&B config)."""

    def __init__(self, cfg: LoggerConfig, total_steps: int) -> None:
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.log_dir / "metrics.jsonl"
        self.backends: list[LogBackend] = [JsonlBackend(self.metrics_path), *start_backends(cfg)]
        self.progress = ConsoleProgress(total_steps, enabled=cfg.progress_bar)

    def save_config(self, resolved: dict[str, Any]) -> Path:
        """Write ``config.yaml`` and hand the config to the backends as hyperparameters."""
        path = self.log_dir / "config.yaml"
        path.write_text(yaml.safe_dump(resolved, sort_keys=False))
        self._call_all("log_hyperparams", resolved)
        return path

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Send one step's metrics to every backend."""
        self._call_all("log_metrics", metrics, step)

    def close(self) -> None:
        """Stop the progress display and close every backend."""
        self.progress.close()
        self._call_all("close")

    def _call_all(self, method: str, *args: Any) -> None:
        """Call ``method`` on each backend; an optional one that raises warns once and is dropped."""
        for backend in list(self.backends):
            if isinstance(backend, JsonlBackend):
                getattr(backend, method)(*args)  # metrics.jsonl is the record of the run: errors surface
                continue
            try:
                getattr(backend, method)(*args)
            except Exception as exc:  # noqa: BLE001 - a dashboard failure must not stop training
                self.backends.remove(backend)
                warn_backend(f"{backend.name} logging stopped: {method} failed ({type(exc).__name__}: {exc})")


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
