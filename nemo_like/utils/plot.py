"""Training curves from ``metrics.jsonl`` as one PNG (matplotlib, Agg: no display needed).

The standard panel: reward, validation accuracy, loss, gen_kl / token_mult_prob_error, advantages
(mean, min, max) and step time by phase (stacked). ``nemo-like plot LOG_DIR`` renders it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nemo_like.utils.log_backends import RUN_START, from_jsonable, starts_new_run
from nemo_like.utils.throughput import STEP_PHASES

# (title, metrics on the left y axis, metrics on a second, right y axis)
STANDARD_PANELS: list[tuple[str, list[str], list[str]]] = [
    ("Reward", ["train/reward"], []),
    ("Validation accuracy", ["validation/accuracy"], []),
    ("Loss", ["train/loss"], []),
    ("Train/generation mismatch", ["train/gen_kl"], ["train/token_mult_prob_error"]),
    ("Advantages", ["train/advantages/mean", "train/advantages/min", "train/advantages/max"], []),
]
# Added to the standard panels when the run was async (its records have trajectory ages).
ASYNC_PANEL = (
    "Async: sample age (updates) / idle (s)",
    ["train/avg_trajectory_age", "train/max_trajectory_age"],
    ["idle/trainer_waiting_for_data", "idle/generation_waiting_for_pacing"],
)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of the last run in ``metrics.jsonl``, merged per step (a later line wins), sorted by step.

    A fresh run in the same ``logger.log_dir`` appends to the file: the last run is what follows the last record marked
    ``"run_start": true`` (a fresh run's first), or in files without the marker the last place where the step goes down
    (a resumed run goes on from its checkpoint's step, and the lines past it were trimmed, so it stays one run). A torn
    last line (a process killed mid-write) is skipped; any other line that is not JSON raises ``ValueError`` naming the
    file and line. Non-finite values, stored as strings ('nan',
    'inf'), come back as floats.
    """
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc})") from None
    except OSError as exc:  # not "cannot write the plot": the caller's OSError is the figure's
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    lines = text.splitlines()
    runs: list[dict[int, dict[str, Any]]] = [{}]
    last_step = None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            if number == len(lines) and not text.endswith("\n"):
                break  # torn: the writer died mid-line
            raise ValueError(f"{path}: line {number} is not JSON ({exc})") from None
        try:
            step = int(record["step"])
        except (KeyError, TypeError, ValueError):  # another JSON Lines file (eval's results.jsonl, say)
            raise ValueError(f"{path}: line {number} is not a metrics record (a JSON object with an integer 'step')") from None
        if starts_new_run(record, last_step):
            runs.append({})
        last_step = step
        runs[-1].setdefault(step, {}).update({k: from_jsonable(v) for k, v in record.items() if k != RUN_START})
    by_step = runs[-1]
    return [by_step[s] for s in sorted(by_step)]


#: Dashed lines on a panel's right axis, one colour each (the async panel has two idle lines), apart from the left
#: axis's default cycle (tab:blue, tab:orange, tab:green, ...).
TWIN_COLORS = ("tab:red", "tab:purple", "tab:brown", "tab:pink")


def series(records: Sequence[dict[str, Any]], metric: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of the records that hold a numeric ``metric`` (NaN kept: the line breaks there)."""
    points = [(r["step"], float(r[metric])) for r in records if isinstance(r.get(metric), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def marked_points(values: Sequence[float]) -> list[int] | None:
    """Indices of the points to mark: every one in a short series, else the finite points that no line segment
    reaches (both neighbours NaN or absent: ``train/loss`` between steps without an optimizer step); None: none."""
    finite = [math.isfinite(v) for v in values]
    if len(values) < 30:
        return [i for i, f in enumerate(finite) if f] or None
    isolated = [i for i, f in enumerate(finite) if f and not (i > 0 and finite[i - 1]) and not (i + 1 < len(finite) and finite[i + 1])]
    return isolated or None


def _plot_series(ax: Any, steps: list[int], values: list[float], **style: Any) -> bool:
    """One metric's line on ``ax``; whether it has a finite value to show (an all-NaN metric is 'no data')."""
    marks = marked_points(values)
    if not any(math.isfinite(v) for v in values):
        return False
    ax.plot(steps, values, marker="." if marks else None, markevery=marks, **style)
    return True


def _line_panel(ax: Any, records: Sequence[dict[str, Any]], title: str, metrics: Sequence[str], twin: Sequence[str] = ()) -> None:
    """Lines of ``metrics`` on ``ax`` (and of ``twin`` on a second y axis); 'no data' when none exist."""
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    plotted = False
    for metric in metrics:
        plotted |= _plot_series(ax, *series(records, metric), label=metric)
    handles, labels = ax.get_legend_handles_labels()
    if twin:
        ax2 = ax.twinx()
        for i, metric in enumerate(twin):
            style = dict(color=TWIN_COLORS[i % len(TWIN_COLORS)], linestyle="--", label=metric)
            plotted |= _plot_series(ax2, *series(records, metric), **style)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if not plotted:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    elif handles:
        ax.legend(handles, labels, fontsize=7)
    ax.grid(alpha=0.3)


def _timing_panel(ax: Any, records: Sequence[dict[str, Any]]) -> None:
    """Stacked bars: seconds of each phase per training step."""
    from matplotlib.ticker import MaxNLocator

    ax.set_title("Step time by phase (s)", fontsize=10)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    train = [r for r in records if "timing/train/total_step_time" in r]
    if not train:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
        return
    steps = [r["step"] for r in train]
    bottom = [0.0] * len(train)
    for phase in STEP_PHASES:
        values = [float(r.get(f"timing/train/{phase}", 0.0) or 0.0) for r in train]
        if any(v > 0 for v in values):
            ax.bar(steps, values, bottom=bottom, label=phase, width=0.8)
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")


def _grid(n_panels: int) -> tuple[Any, list[Any]]:
    """A figure with ``n_panels`` axes in rows of up to 3 (no pyplot: no global backend state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = min(3, max(n_panels, 1))
    rows = max(1, math.ceil(n_panels / cols))
    fig = Figure(figsize=(5 * cols, 3.6 * rows))
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(n_panels)]
    return fig, axes


def plot_metrics(metrics_path: str | Path, out: str | Path | None = None, metrics: Sequence[str] | None = None) -> Path:
    """Render ``metrics_path`` (a ``metrics.jsonl``) to a PNG; returns its path.

    With ``metrics``, one panel per listed metric; otherwise the standard panel. ``out`` defaults
    to ``metrics.png`` beside the metrics file. ``ValueError`` for a line that is not JSON or a listed metric the file
    does not hold.
    """
    metrics_path = Path(metrics_path)
    records = read_metrics(metrics_path)
    if not records:
        raise ValueError(f"{metrics_path} holds no metrics records")
    present = {key for record in records for key in record}
    missing = [m for m in metrics or [] if m not in present]
    if missing:
        raise ValueError(
            f"--metrics: {missing} not logged by the last run in {metrics_path} (the plot reads the file's last run: a run "
            f"that starts its steps again appends a new one); it logged {sorted(present - {'step'})}"
        )
    out_path = Path(out) if out is not None else metrics_path.with_name("metrics.png")
    if out_path.is_dir() or str(out or "").endswith(("/", os.sep)):  # a directory, or a new one named as one: the
        # figure goes in it (savefig wrote DIR.png beside it; Path drops a trailing slash)
        out_path = out_path / "metrics.png"
    elif not out_path.suffix:  # savefig adds .png to a name without one: return the path it writes
        out_path = out_path.with_suffix(".png")
    if metrics:
        fig, axes = _grid(len(metrics))
        for ax, metric in zip(axes, metrics):
            _line_panel(ax, records, metric, [metric])
    else:
        panels = list(STANDARD_PANELS)
        if any("train/avg_trajectory_age" in r for r in records):
            panels.append(ASYNC_PANEL)
        fig, axes = _grid(len(panels) + 1)
        for ax, (title, left, right) in zip(axes, panels):
            _line_panel(ax, records, title, left, right)
        _timing_panel(axes[-1], records)
    fig.suptitle(str(metrics_path.parent), fontsize=10)
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    return out_path
