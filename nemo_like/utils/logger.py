"""The run's logger: fans each step's metrics out to every backend, and drives the console progress.

Backends (``nemo_like/utils/log_backends.py``): ``metrics.jsonl`` (always), TensorBoard
(``logger.tensorboard_enabled``), Weights & Biases (``logger.wandb_enabled``). All get the same
metric names and step; a backend that fails warns once and is dropped, training goes on.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from nemo_like.config.loader import recipe_yaml
from nemo_like.config.schema import LoggerConfig
from nemo_like.utils.log_backends import JsonlBackend, LogBackend, from_jsonable, start_backends, warn_backend
from nemo_like.utils.run_control import new_threads_spared_stop_signals


class Logger:
    """One JSON object per step in ``<log_dir>/metrics.jsonl``, the same metrics in the enabled
    dashboards, and the resolved config beside them (``config.yaml``, TB hparams, W&B config)."""

    def __init__(
        self,
        cfg: LoggerConfig,
        total_steps: int,
        resumed_step: int | None = None,
        replayed: Sequence[dict[str, Any]] = (),
        elapsed_s: float = 0.0,
    ) -> None:
        """``resumed_step``: the checkpoint's step a resumed run continues after (TensorBoard then hides the later steps
        an earlier run logged: they are redone; ``metrics.jsonl`` is trimmed by the caller); ``None``, a fresh run, hides
        every step earlier runs logged in this ``log_dir`` (one curve per run, as the plot draws the last run alone).
        ``replayed``: the resumed run's own records that ``metrics.jsonl`` holds again after another run's
        (:func:`nemo_like.algorithms.checkpointing.trim_metrics_after`); the dashboards hide every earlier step and get
        these again, so the resumed steps continue their own curve there too. ``elapsed_s``: seconds the run has
        already run (a restart's new logger: the console's ``elapsed`` counts from the run's start)."""
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.log_dir / "metrics.jsonl"
        purge_step = 0 if resumed_step is None or replayed else resumed_step + 1
        # A fresh run, or a restart that starts it again from step 0 (resumed_step -1: its first attempt's records, the
        # marked one included, were trimmed): its first record begins a run in metrics.jsonl
        fresh = resumed_step is None or resumed_step < 0
        with new_threads_spared_stop_signals():  # their threads must never take a run's SIGTERM / SIGINT
            self.backends: list[LogBackend] = [
                JsonlBackend(self.metrics_path, fresh=fresh),
                *start_backends(cfg, purge_step),
            ]
            self.progress = ConsoleProgress(total_steps, enabled=cfg.progress_bar, elapsed_s=elapsed_s)
        for record in replayed:  # already in metrics.jsonl, where a non-finite value is a string ('nan')
            metrics = {key: from_jsonable(value) for key, value in record.items() if key != "step"}
            self._call_all("log_metrics", metrics, int(record["step"]), dashboards_only=True)
        self.extra: dict[str, Any] = {}  # added to every record from now on (e.g. faults/run_restarts after a restart)
        self.records: list[dict[str, Any]] = []  # what this logger logged, as {"step": step, **metrics}

    def save_config(self, resolved: dict[str, Any]) -> Path:
        """Write ``config.yaml`` and hand the config to the backends as hyperparameters."""
        path = self.log_dir / "config.yaml"
        path.write_text(recipe_yaml(resolved), encoding="utf-8")
        self._call_all("log_hyperparams", resolved)
        return path

    def log(self, metrics: dict[str, Any], step: int) -> dict[str, Any]:
        """Send one step's metrics, with :attr:`extra` added to them (in place), to every backend; returns the record
        kept in :attr:`records` (``{"step": step, **metrics}``), for the caller's history to share rather than copy."""
        metrics.update(self.extra)
        self._call_all("log_metrics", metrics, step)
        # Interned keys: a run keeps every record (train() returns them), and keys built per step (timing/train/<phase>)
        # were new strings each time: ~16 KiB a step of ~120 metrics, ~7 KiB interned
        self.records.append({"step": step, **{sys.intern(key): value for key, value in metrics.items()}})
        return self.records[-1]

    def close(self, failed: bool = False) -> None:
        """Stop the progress display and close every backend; ``failed``: the run (or this attempt) ended with an
        error (W&B and TensorBoard's HParams view record the outcome)."""
        self.progress.close()
        self._call_all("close", failed)

    def _call_all(self, method: str, *args: Any, dashboards_only: bool = False) -> None:
        """Call ``method`` on each backend (``dashboards_only``: not on ``metrics.jsonl``); an optional one that raises
        warns once and is dropped."""
        for backend in list(self.backends):
            if isinstance(backend, JsonlBackend):
                if dashboards_only:
                    continue
                getattr(backend, method)(*args)  # metrics.jsonl is the record of the run: errors surface
                continue
            try:
                getattr(backend, method)(*args)
            except Exception as exc:  # noqa: BLE001 - a dashboard failure must not stop training
                self.backends.remove(backend)
                warn_backend(f"{backend.name} logging stopped: {method} failed ({type(exc).__name__}: {exc})")


ETA_WINDOW = 8  # steps whose durations the ETA averages


def eta_seconds(
    step_seconds: Sequence[float],
    remaining: int,
    window: int = ETA_WINDOW,
    validation_seconds: Sequence[float] = (),
    validations: int = 0,
) -> float | None:
    """Seconds left: the mean of the last ``window`` step durations (validations left out) times the ``remaining``
    steps, plus the mean of the last ``window`` validations times the ``validations`` still to come (none until one
    was measured); ``None`` while no step duration is known. Only step durations count, so the start-up before the
    first step (actors, model loading, the step-0 validation) never inflates it."""
    if remaining <= 0:
        return 0.0
    recent = list(step_seconds)[-window:]
    if not recent:
        return None
    validated = list(validation_seconds)[-window:]
    ahead = sum(validated) / len(validated) * validations if validated else 0.0
    return sum(recent) / len(recent) * remaining + ahead


def format_seconds(seconds: float) -> str:
    """``42s``, ``12m05s``, ``3h02m``."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_eta(seconds: float | None) -> str:
    return "eta ?" if seconds is None else f"eta {format_seconds(seconds)}"


class ConsoleProgress:
    """A live bar (step, reward, ETA) on a terminal; one plain line per step elsewhere (CI logs).

    A step's duration is the time between two consecutive updates, so the first update of a run (or of a
    resumed run) has none yet and shows ``eta ?``; the ETA is :func:`eta_seconds` of the recent ones. The bar starts at
    the first update: the set-up's lines (Ray's, the data's, a user's reward function's prints) were glued onto a bar
    that had nothing to show yet. While it is up, what the run writes to stdout goes above it when stdout is a terminal
    too (Ray's actors print there); stdout sent elsewhere (`train > run.log`) stays untouched."""

    def __init__(self, total: int, enabled: bool = True, clock: Callable[[], float] = time.monotonic, elapsed_s: float = 0.0) -> None:
        """``elapsed_s``: seconds the run ran before this display started (an in-process restart's)."""
        self.total, self.enabled, self.clock = total, enabled, clock
        self.start = clock() - elapsed_s
        self.step_seconds: deque[float] = deque(maxlen=ETA_WINDOW)
        self.validation_seconds: deque[float] = deque(maxlen=ETA_WINDOW)
        self._last_update: tuple[int, float] | None = None  # (step, time) of the previous update
        self._rich = None
        self._info = ""  # the last update's text
        self._live = enabled and sys.stderr.isatty()  # a bar, from the first update on

    def _start_bar(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._rich = Progress(
            TextColumn("GRPO"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}", markup=False),
            TextColumn("{task.fields[eta]}", markup=False),
            console=Console(stderr=True),  # the stream whose terminal turned it on (rich's default is stdout)
            redirect_stdout=sys.stdout.isatty(),  # above the bar on the terminal; a file (`train > run.log`) untouched
        )
        self._task = self._rich.add_task("train", total=self.total, info="", eta=format_eta(None))
        self._rich.start()

    def set_total(self, total: int) -> None:
        """The last step the run can reach, once known (``grpo.max_num_epochs`` may end it before ``max_num_steps``)."""
        self.total = total
        if self._rich is not None:
            self._rich.update(self._task, total=total)

    def update(self, step: int, info: str, validation_s: float = 0.0, validations_left: int = 0) -> None:
        """Step ``step`` ended: its line (``info``); ``validation_s``: the seconds of the validation it ended with,
        counted apart from the steps' (a 60 s validation every 20 steps swung the ETA by a third); ``validations_left``:
        the validations the steps still to run end with."""
        if not self.enabled:
            return
        if self._live and self._rich is None:
            self._start_bar()
        now = self.clock()
        if self._last_update is not None and step > self._last_update[0]:
            last_step, last_time = self._last_update
            self.step_seconds.append(max(0.0, now - last_time - validation_s) / (step - last_step))
        if validation_s > 0:
            self.validation_seconds.append(validation_s)
        self._last_update = (step, now)
        eta = format_eta(eta_seconds(self.step_seconds, self.total - step, ETA_WINDOW, self.validation_seconds, validations_left))
        self._info = info
        if self._rich is not None:
            self._rich.update(self._task, completed=step, info=info, eta=eta)
            return
        print(f"[step {step}/{self.total}] {info} | elapsed {format_seconds(now - self.start)} {eta}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def during(self, text: str) -> Iterator[None]:
        """Long work between two steps' updates (a validation pass, minutes of silence otherwise): with the bar up, it
        shows ``text`` in the last step's place while the block runs; without one, ``text`` is a line."""
        if not self.enabled:
            yield
            return
        if self._rich is None:
            print(text, file=sys.stderr, flush=True)
            yield
            return
        self._rich.update(self._task, info=text, refresh=True)
        try:
            yield
        finally:
            if self._rich is not None:  # the last step's text again (an end-of-run validation has no update after it)
                self._rich.update(self._task, info=self._info)

    def message(self, text: str) -> None:
        if self._rich is not None:
            self._rich.console.print(text, markup=False, highlight=False)  # "[setup] ..." is text, not rich markup
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        self._live = False
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
