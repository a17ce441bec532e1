"""Metric sinks behind one interface: ``metrics.jsonl``, TensorBoard and Weights & Biases.

Every backend receives the same metric names and the same step. :func:`start_backends` builds the
enabled optional backends; one that cannot start (package missing, not logged in, no network) is
reported by one warning and left out, so logging problems never stop a training run.
"""

from __future__ import annotations

import json
import math
import netrc
import numbers
import os
import sys
import time
import urllib.parse
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nemo_like.config.loader import recipe_yaml
from nemo_like.config.schema import LoggerConfig

Scalar = int | float


class LogBackend:
    """One metrics sink. Subclasses override what they support; the defaults do nothing."""

    name = "backend"

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        """Record one step's metrics."""

    def log_hyperparams(self, config: dict[str, Any]) -> None:
        """Record the resolved config of the run."""

    def close(self, failed: bool = False) -> None:
        """Flush and release resources; ``failed``: the run (or this attempt of it) ended with an error, which a
        dashboard that records an outcome records."""


def jsonable(value: Any) -> Any:
    """``value`` made JSON-safe at any depth: tensors and numpy arrays or scalars as Python values, non-finite floats as
    strings ('nan', 'inf') instead of invalid JSON (a NaN inside a list had been written as a bare ``NaN``, and a numpy
    float stopped the run)."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    return value


def from_jsonable(value: Any) -> Any:
    """The inverse of :func:`jsonable`: 'nan', 'inf' and '-inf' (as ``metrics.jsonl`` stores them) back to floats."""
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf"):
        return float(value)
    return value


def numeric_metrics(metrics: dict[str, Any]) -> dict[str, Scalar]:
    """The real-number entries of ``metrics`` as Python numbers (what scalar dashboards can plot): numpy scalars and
    0-d tensors or arrays too, as ``metrics.jsonl`` writes them (a 0-d tensor reached the file and no dashboard; a
    ``[1]``-shaped one is a list there, so not a scalar here either). Bools are flags, not metrics (a record's
    ``run_start``): left out."""
    numbers_only = {key: _as_number(value) for key, value in metrics.items()}
    return {k: v for k, v in numbers_only.items() if isinstance(v, numbers.Real) and not isinstance(v, bool)}


def _as_number(value: Any) -> Any:
    """A 0-d tensor, array or numpy scalar as its Python number; anything else unchanged."""
    return value.item() if getattr(value, "ndim", None) == 0 and hasattr(value, "item") else value


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and ``None`` become strings (hparams want scalars)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_config(value, prefix=f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat


def drop_torn_tail(path: Path) -> None:
    """Cut a last line without its newline (a process killed mid-write) off ``path``, so the next record starts a line
    of its own instead of continuing the torn one."""
    size = path.stat().st_size if path.exists() else 0
    if size == 0:
        return
    with path.open("rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":  # the usual case: only the last byte is read
            return
        end = size - 1
        while end > 0:  # back to the torn line's start, a block at a time (a record is one line)
            start = max(0, end - 65536)
            f.seek(start)
            cut = f.read(end - start).rfind(b"\n")
            if cut >= 0:
                f.truncate(start + cut + 1)
                return
            end = start
        f.truncate(0)  # the file is one torn line


#: Set in the first record a fresh run writes to ``metrics.jsonl``: where a run begins in a file several runs wrote
#: (:func:`starts_new_run`). A resumed run's records continue its run and carry none.
RUN_START = "run_start"


def starts_new_run(record: dict[str, Any], previous_step: int | None) -> bool:
    """Whether ``record`` (of a ``metrics.jsonl``, after a record of ``previous_step``) begins another run: it carries
    :data:`RUN_START`, or (files written before the marker) its step goes down. Steps alone missed a fresh run that
    started at or past the last step of the one before (a 1-step smoke test, then a run without step-0 validation)."""
    return previous_step is not None and (bool(record.get(RUN_START)) or int(record["step"]) < previous_step)


class JsonlBackend(LogBackend):
    """One JSON object per call in ``<log_dir>/metrics.jsonl`` (always on; appends). ``fresh``: a fresh run's (not a
    resumed one's): its first record carries :data:`RUN_START`."""

    name = "jsonl"

    def __init__(self, path: Path, fresh: bool = False) -> None:
        self.path = path
        self._mark_start = fresh
        drop_torn_tail(path)
        self._file = path.open("a", buffering=1)

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        record = {"step": step, **({RUN_START: True} if self._mark_start else {}), **{k: jsonable(v) for k, v in metrics.items()}}
        self._mark_start = False
        self._file.write(json.dumps(record, allow_nan=False) + "\n")  # jsonable made every value JSON: a leak fails here

    def close(self, failed: bool = False) -> None:
        self._file.close()


def wait_past_event_files(directory: Path) -> None:
    """Sleep until the clock's second is past that of the newest event file in ``directory`` (at most a second):
    TensorBoard reads a directory's event files in name order, and a name is the second it was made in, then a
    per-process counter, which sorts 10 before 9 (a resumed run's file, whose purge hides the steps an earlier run
    logged, was read before that run's)."""
    seconds = [int(part) for p in directory.glob("events.out.tfevents.*") if (part := p.name.split(".")[3]).isdigit()]
    if seconds:
        time.sleep(max(0.0, max(seconds) + 1 - time.time()))


class TensorBoardBackend(LogBackend):
    """Scalars, plus the config as HParams and as text, in ``<log_dir>/tensorboard``."""

    name = "tensorboard"

    def __init__(self, log_dir: Path, purge_step: int | None = None) -> None:
        """``purge_step``: a resumed run's first step; TensorBoard hides what earlier runs logged from that step on."""
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

        wait_past_event_files(Path(log_dir))
        self.writer = SummaryWriter(str(log_dir), purge_step=purge_step)
        self._session_end = None

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in numeric_metrics(metrics).items():
            self.writer.add_scalar(key, value, step)

    def log_hyperparams(self, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        # Written into this run's own event file (SummaryWriter.add_hparams would start a second run).
        experiment, session_start, self._session_end = hparams(flatten_config(config), {"train/reward": 0.0, "validation/accuracy": 0.0})
        file_writer = self.writer._get_file_writer()
        file_writer.add_summary(experiment)
        file_writer.add_summary(session_start)
        self.writer.add_text("config", "```yaml\n" + recipe_yaml(config) + "```")

    def close(self, failed: bool = False) -> None:
        if self._session_end is not None:  # the HParams view's outcome: hparams() writes a success
            self.writer._get_file_writer().add_summary(failed_session_end(self._session_end) if failed else self._session_end)
        self.writer.close()


def failed_session_end(success: Any) -> Any:
    """A copy of TensorBoard's HParams session-end record ``success`` (what ``hparams()`` returns) saying the session
    failed."""
    from tensorboard.plugins.hparams.api_pb2 import Status
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    record = type(success)()
    record.CopyFrom(success)
    plugin_data = record.value[0].metadata.plugin_data
    content = HParamsPluginData.FromString(plugin_data.content)
    content.session_end_info.status = Status.Value("STATUS_FAILURE")
    plugin_data.content = content.SerializeToString()
    return record


class WandbBackend(LogBackend):
    """A Weights & Biases run (``WANDB_MODE=offline`` writes it locally; upload later with ``wandb sync``)."""

    name = "wandb"

    def __init__(self, project: str, name: str | None, log_dir: Path) -> None:
        import wandb

        self._wandb = wandb
        if sys.stdin is not None and sys.stdin.isatty() and not wandb_credentials_found():
            # On a terminal wandb.init asks for a key and waits (forever, the run's log_dir lock held; at end of input it
            # raises KeyboardInterrupt): say so here instead, as the warning of any backend that cannot start
            _wandb_teardown(wandb)  # wandb.setup() read the settings to decide: a later run reads them afresh
            raise RuntimeError("not logged in to W&B (run `wandb login`, set WANDB_API_KEY, or set WANDB_MODE=offline)")
        run_dir = Path(os.environ.get("WANDB_DIR") or log_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            # console="off": wandb does not wrap stdout/stderr (keeps the live progress bar intact).
            self.run = wandb.init(project=project, name=name, dir=str(run_dir), settings=wandb.Settings(console="off"))
        except BaseException:
            _wandb_teardown(wandb)  # forget the settings cached from the environment
            raise

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(numeric_metrics(metrics), step=step)

    def log_hyperparams(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)  # a non-zero exit code marks the run failed
        _wandb_teardown(self._wandb)


WANDB_MODES_WITHOUT_LOGIN = ("offline", "disabled", "dryrun")


def wandb_credentials_found() -> bool:
    """Whether W&B can start without asking: an offline or disabled ``WANDB_MODE``, ``WANDB_API_KEY`` or an identity
    token file in the environment, a key for the W&B host in the netrc file (``$NETRC``, else ``~/.netrc``), or (read
    by wandb itself) a mode or key in its settings files: ``wandb offline`` writes ``mode = offline`` to
    ``./wandb/settings``, not to the environment."""
    if os.environ.get("WANDB_MODE", "").strip().lower() in WANDB_MODES_WITHOUT_LOGIN:
        return True
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        if netrc.netrc(os.environ.get("NETRC") or None).authenticators(host or "") is not None:
            return True
    except (OSError, netrc.NetrcParseError):
        pass
    return _wandb_settings_allow_start()


def _wandb_settings_allow_start() -> bool:
    """Whether wandb's own settings (its settings files over the environment, as ``wandb.init`` will read them) name a
    mode that needs no login or an API key."""
    try:
        import wandb

        settings = wandb.setup().settings
    except Exception:  # noqa: BLE001 - unreadable settings: wandb.init would ask, so warn as without credentials
        return False
    return str(settings.mode).lower() in WANDB_MODES_WITHOUT_LOGIN or bool(settings.api_key)


def _wandb_teardown(wandb: Any) -> None:
    """Stop wandb's service so a later run in this process reads the environment afresh."""
    try:
        wandb.teardown()
    except Exception:  # noqa: BLE001 - best effort during shutdown
        pass


def optional_backend_factories(cfg: LoggerConfig, purge_step: int | None = None) -> dict[str, Callable[[], LogBackend]]:
    """Constructors of the optional backends that ``cfg`` enables, by backend name (``purge_step``: see
    :class:`TensorBoardBackend`)."""
    log_dir = Path(cfg.log_dir)
    factories: dict[str, Callable[[], LogBackend]] = {}
    if cfg.tensorboard_enabled:
        factories["TensorBoard"] = lambda: TensorBoardBackend(log_dir / "tensorboard", purge_step)
    if cfg.wandb_enabled:
        factories["Weights & Biases"] = lambda: WandbBackend(cfg.wandb.project, cfg.wandb.name, log_dir)
    return factories


def start_backends(cfg: LoggerConfig, purge_step: int | None = None) -> list[LogBackend]:
    """Start the enabled optional backends; each one that fails warns once and is skipped."""
    started = []
    for label, factory in optional_backend_factories(cfg, purge_step).items():
        try:
            started.append(factory())
        except Exception as exc:  # noqa: BLE001 - any start-up failure must not stop training
            warn_backend(f"{label} logging disabled: it failed to start ({type(exc).__name__}: {exc})")
    return started


def warn_backend(message: str) -> None:
    """Report a logging-backend problem as a ``RuntimeWarning`` (shown on stderr)."""
    warnings.warn(message + "; training continues with the other logging backends.", RuntimeWarning, stacklevel=3)
