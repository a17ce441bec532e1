"""Logger fan-out without Ray: metrics.jsonl, TensorBoard, and a backend that really fails to start."""

import json
import time
from pathlib import Path

import pytest

from nemo_like.config.schema import LoggerConfig
from nemo_like.utils.log_backends import flatten_config, jsonable, numeric_metrics
from nemo_like.utils.logger import Logger


def test_flatten_config_makes_dotted_scalar_hparams():
    flat = flatten_config({"a": {"b": 1, "c": {"d": None}}, "e": [1, 2], "f": "x", "g": True})
    assert flat == {"a.b": 1, "a.c.d": "None", "e": "[1, 2]", "f": "x", "g": True}


def test_numeric_metrics_and_jsonable():
    assert numeric_metrics({"a": 1, "b": 2.5, "c": "text", "d": True}) == {"a": 1, "b": 2.5}
    assert jsonable(float("nan")) == "nan" and jsonable(1.5) == 1.5


def test_a_nested_non_finite_value_or_a_numpy_scalar_is_written_as_valid_json_and_reaches_the_dashboards(tmp_path):
    """jsonable converted a top-level float only: a NaN in a list was written as a bare NaN (not JSON), a numpy float
    stopped the run (TypeError), and the dashboards dropped the numpy value the file would have held."""
    import numpy as np
    import torch

    nested = {"list": [1.0, float("nan")], "dict": {"a": float("inf")}, "np": np.float32(0.5), "t": torch.tensor([1.0, float("-inf")])}
    assert jsonable(nested) == {"list": [1.0, "nan"], "dict": {"a": "inf"}, "np": 0.5, "t": [1.0, "-inf"]}
    assert numeric_metrics({"np": np.float64(2.5), "i": np.int64(3), "flag": np.bool_(True)}) == {"np": 2.5, "i": 3}
    # a 0-d tensor reached metrics.jsonl and no dashboard; a [1]-shaped one is a list in the file, so no scalar here
    assert numeric_metrics({"t": torch.tensor(2.5), "a": np.array(4), "one": torch.tensor([1.0])}) == {"t": 2.5, "a": 4}
    logger = Logger(LoggerConfig(log_dir=str(tmp_path), progress_bar=False), total_steps=1)
    logger.log({"m/np": np.float32(0.25), "m/nested": [float("nan")]}, step=1)
    logger.close()
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"invalid JSON constant {c}")) == {
        "step": 1,
        "run_start": True,
        "m/np": 0.25,
        "m/nested": ["nan"],
    }


def test_the_kept_records_share_their_keys_across_steps(tmp_path):
    """A run keeps every step's record (train() returns them): keys built per step (timing/train/<phase>) were new
    strings in every record, ~16 KiB a step of ~120 metrics where ~7 KiB hold the values."""
    logger = Logger(LoggerConfig(log_dir=str(tmp_path), progress_bar=False), total_steps=2)
    first, second = (logger.log({f"timing/train/{phase}": 0.1 for phase in ("generation", "policy_training")}, step) for step in (1, 2))
    logger.close()
    assert [k for k in first if k != "run_start"] == [k for k in second]
    assert all(a is b for a, b in zip([k for k in first if k != "run_start"], second))


def test_a_backend_that_cannot_start_warns_and_jsonl_still_logs(tmp_path):
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    (log_dir / "tensorboard").write_text("a file where the event directory should be")
    cfg = LoggerConfig(log_dir=str(log_dir), tensorboard_enabled=True, progress_bar=False)
    with pytest.warns(RuntimeWarning, match="TensorBoard logging disabled"):
        logger = Logger(cfg, total_steps=1)
    logger.save_config({"grpo": {"seed": 1}})
    logger.log({"train/reward": 0.5}, step=1)
    logger.close()
    assert [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 1, "run_start": True, "train/reward": 0.5}
    ]


def test_tensorboard_backend_writes_scalars_and_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = LoggerConfig(log_dir=str(tmp_path), tensorboard_enabled=True, progress_bar=False)
    logger = Logger(cfg, total_steps=2)
    logger.save_config({"grpo": {"seed": 1, "val_period": None}})
    for step in (1, 2):
        logger.log({"train/reward": 0.25 * step, "note": "not a scalar"}, step=step)
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["train/reward"]
    assert [(e.step, e.value) for e in acc.Scalars("train/reward")] == [(1, 0.25), (2, 0.5)]
    assert "config/text_summary" in acc.Tags()["tensors"]
    assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")
    # A fresh run in the same log_dir: its curve alone, as metrics.jsonl's plot draws it (TensorBoard showed the earlier
    # run's steps 1-2 and then this run's step 1 again, one curve going back).
    again = Logger(cfg, total_steps=1)
    again.log({"train/reward": 0.75}, step=1)
    again.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/reward")] == [(1, 0.75)]


def test_a_failed_run_is_recorded_as_failed_by_the_dashboards_that_record_an_outcome(tmp_path, monkeypatch):
    """A run that ended with an error (exit status 1) closed its W&B run with exit code 0 ("finished") and wrote
    TensorBoard's HParams session end as a success: ``Logger.close(failed=True)`` records the failure."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.api_pb2 import Status
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    def session_status(log_dir: Path) -> str:
        acc = EventAccumulator(str(log_dir / "tensorboard"))
        acc.Reload()
        content = acc.PluginTagToContent("hparams")["_hparams_/session_end_info"]
        return Status.Name(HParamsPluginData.FromString(content).session_end_info.status)

    for failed, status in ((False, "STATUS_SUCCESS"), (True, "STATUS_FAILURE")):
        log_dir = tmp_path / status
        logger = Logger(LoggerConfig(log_dir=str(log_dir), tensorboard_enabled=True, progress_bar=False), total_steps=2)
        logger.save_config({"grpo": {"seed": 1}})
        logger.log({"train/reward": 0.5}, step=1)
        logger.close(failed=failed)
        assert session_status(log_dir) == status
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for failed in (False, True):
        log_dir = tmp_path / f"wandb-{failed}"
        logger = Logger(LoggerConfig(log_dir=str(log_dir), wandb_enabled=True, progress_bar=False), total_steps=2)
        logger.log({"train/reward": 0.5}, step=1)
        logger.close(failed=failed)
        (debug_log,) = log_dir.glob("wandb/offline-run-*/logs/debug.log")
        assert f"got exitcode: {int(failed)}" in debug_log.read_text()  # wandb's record of run.finish(exit_code=...)


def test_a_torn_last_line_is_cut_before_appending_and_the_plot_reads_the_last_run(tmp_path) -> None:
    """A process killed mid-write left '{"step": 2, "train/lo' without its newline: the next run's first record was
    written onto it (one invalid line), and `nemo-like plot` failed on it. A fresh run in the same directory starts its
    steps again: the plot shows it alone, not its steps merged with an earlier run's."""
    from nemo_like.utils.log_backends import JsonlBackend
    from nemo_like.utils.plot import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "validation/accuracy": 0.2}\n{"step": 1, "train/reward": 0.5}\n{"step": 2, "train/lo')
    assert [r["step"] for r in read_metrics(path)] == [0, 1]  # the torn line is skipped
    backend = JsonlBackend(path)  # a fresh run: validation at step 0, then step 1
    backend.log_metrics({"validation/accuracy": 0.3}, step=0)
    backend.log_metrics({"train/reward": 0.25}, step=1)
    backend.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 0, 1]  # every line JSON; the torn bytes are gone
    assert read_metrics(path) == [{"step": 0, "validation/accuracy": 0.3}, {"step": 1, "train/reward": 0.25}]  # this run
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not JSON"):
        read_metrics(path)


def test_the_async_panels_right_axis_lines_have_their_own_colours() -> None:
    """Both idle lines of the async panel were drawn in tab:red: the legend could not tell them apart."""
    from matplotlib.colors import to_hex

    from nemo_like.utils.plot import ASYNC_PANEL, _grid, _line_panel

    title, left, right = ASYNC_PANEL
    records = [{"step": s, **{m: float(s + i) for i, m in enumerate([*left, *right])}} for s in (1, 2, 3)]
    fig, (ax,) = _grid(1)
    _line_panel(ax, records, title, left, right)
    twin = [a for a in fig.axes if a is not ax]
    colours = [to_hex(line.get_color()) for a in (ax, *twin) for line in a.get_lines()]
    assert len(colours) == len(left) + len(right) == len(set(colours))


def test_the_timing_panel_stacks_every_phase_a_step_logs() -> None:
    """The plot listed its own phases and left out async's waiting_for_refit, which the shares and the console count."""
    from matplotlib.figure import Figure

    from nemo_like.utils.plot import _timing_panel
    from nemo_like.utils.throughput import STEP_PHASES

    record = {"step": 1, "timing/train/total_step_time": float(len(STEP_PHASES))}
    record.update({f"timing/train/{phase}": 1.0 for phase in STEP_PHASES})
    assert {"waiting_for_data", "waiting_for_refit", "validation", "policy_training"} <= set(STEP_PHASES)
    ax = Figure().add_subplot()
    _timing_panel(ax, [record])
    assert [text.get_text() for text in ax.get_legend().get_texts()] == list(STEP_PHASES)


WANDB_ON_A_TERMINAL = r"""
import sys, tempfile, warnings
from pathlib import Path
from nemo_like.config.schema import LoggerConfig
from nemo_like.utils.logger import Logger
assert sys.stdin.isatty()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    logger = Logger(LoggerConfig(log_dir=tempfile.mkdtemp(), wandb_enabled=True, progress_bar=False), 3)
logger.close()
print("BACKENDS", [b.name for b in logger.backends], [str(w.message) for w in caught])
"""


def _logger_on_a_terminal(home: Path, cwd: Path) -> tuple[int | None, str]:
    """Run :data:`WANDB_ON_A_TERMINAL` on a pseudo-terminal nobody types into, in ``cwd`` with ``home`` as HOME and no
    W&B variables; returns its exit status (None: still waiting after 120 s, killed) and its output."""
    import os
    import pty
    import select
    import signal
    import sys
    import time

    root = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    env.update(HOME=str(home), WANDB_CONFIG_DIR=str(home / "wandb-config"), PYTHONPATH=str(root))
    pid, fd = pty.fork()
    if pid == 0:  # the child: a terminal nobody types into
        os.chdir(cwd)
        os.execve(sys.executable, [sys.executable, "-c", WANDB_ON_A_TERMINAL], env)
    out, deadline, status = b"", time.monotonic() + 120, None
    try:
        while status is None and time.monotonic() < deadline:
            if select.select([fd], [], [], 0.5)[0]:
                try:
                    out += os.read(fd, 4096)
                except OSError:
                    pass
            finished, code = os.waitpid(pid, os.WNOHANG)
            status = code if finished else None
    finally:
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return status, out.decode(errors="replace")


def test_wandb_not_logged_in_on_a_terminal_warns_instead_of_waiting_at_its_login_prompt(tmp_path):
    """On a terminal (an interactive shell, tmux) wandb.init asked for a key and waited forever with the run's log_dir
    locked (at end of input: KeyboardInterrupt, exit 130); logging.md promises a warning and a run that goes on."""
    pytest.importorskip("wandb")
    status, text = _logger_on_a_terminal(tmp_path, tmp_path)
    assert status == 0, f"the logger did not return (waiting at wandb's prompt?): {text[-2000:]}"
    assert "BACKENDS ['jsonl']" in text and "Weights & Biases logging disabled" in text and "not logged in to W&B" in text


def test_wandb_offline_set_by_the_wandb_offline_command_starts_on_a_terminal(tmp_path):
    """``wandb offline`` writes ``mode = offline`` to ./wandb/settings, not to the environment: the terminal check had
    read only the environment and netrc, so such a user got the not-logged-in warning and no W&B run."""
    pytest.importorskip("wandb")
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "settings").write_text("[default]\nmode = offline\n")
    status, text = _logger_on_a_terminal(tmp_path, tmp_path)
    assert status == 0, f"the logger did not return: {text[-2000:]}"
    assert "BACKENDS ['jsonl', 'wandb']" in text and "not logged in to W&B" not in text, text[-2000:]


def test_a_replayed_non_finite_value_reaches_tensorboard_as_the_run_logged_it(tmp_path):
    """A resume after another run replays its checkpoint run's records from metrics.jsonl, where NaN is the string
    'nan': the replay handed the string on and TensorBoard dropped the point (the run had shown it)."""
    pytest.importorskip("tensorboard")
    import math

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nemo_like.algorithms.checkpointing import trim_metrics_after

    cfg = LoggerConfig(log_dir=str(tmp_path), tensorboard_enabled=True, progress_bar=False)
    first = Logger(cfg, 5)
    for step, loss in ((1, 0.5), (2, float("nan")), (3, 0.4)):
        first.log({"train/loss": loss}, step)
    first.close()
    # Each run in a later second, as real ones are: TensorBoard orders event files by name, whose per-process counter
    # compares as text within one second ('10' before '9')
    time.sleep(1.05 - time.time() % 1)
    other = Logger(cfg, 5)  # a short fresh run in the same log_dir
    other.log({"train/loss": 9.0}, 1)
    other.close()
    replay = trim_metrics_after(tmp_path / "metrics.jsonl", 2)  # the first run resumes from its step-2 checkpoint
    time.sleep(1.05 - time.time() % 1)
    resumed = Logger(cfg, 5, resumed_step=2, replayed=replay.records)
    resumed.log({"train/loss": 0.3}, 3)
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    points = {e.step: e.value for e in events.Scalars("train/loss")}
    assert sorted(points) == [1, 2, 3] and points[1] == 0.5 and math.isnan(points[2]) and points[3] == pytest.approx(0.3)


def test_the_plot_refuses_an_empty_file_a_binary_one_and_a_metric_only_an_earlier_run_logged(tmp_path):
    """An empty metrics.jsonl gave a PNG of empty panels and exit 0; a non-UTF-8 byte a message naming no file; and a
    metric an earlier run appended to the file was said to be 'not in' it."""
    from nemo_like.utils.plot import plot_metrics

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty.jsonl holds no metrics records"):
        plot_metrics(empty)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"step": 1, "train/reward": 0.5}\n\xff\n')
    with pytest.raises(ValueError, match=r"binary.jsonl: not UTF-8 text"):
        plot_metrics(binary)
    two_runs = tmp_path / "two.jsonl"
    two_runs.write_text('{"step": 1, "train/kl_penalty": 0.1}\n{"step": 2, "train/kl_penalty": 0.2}\n{"step": 1, "train/reward": 0.5}\n')
    with pytest.raises(ValueError, match=r"\['train/kl_penalty'\] not logged by the last run in .*two.jsonl \(the plot reads"):
        plot_metrics(two_runs, metrics=["train/kl_penalty"])


def test_the_plot_marks_finite_points_between_nans_and_calls_an_all_nan_metric_no_data():
    """train/loss is NaN on steps without an optimizer step: past 29 points nothing was marked, so a finite value
    between two NaNs drew nothing, and a metric NaN everywhere drew an empty legend instead of 'no data'."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from nemo_like.utils.plot import _line_panel

    nan = float("nan")
    records = [{"step": s, "train/loss": 0.5 if s in (10, 25) else nan, "x/all_nan": nan, "x/dense": float(s)} for s in range(40)]
    fig = Figure()
    FigureCanvasAgg(fig)
    ax, empty = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    _line_panel(ax, records, "losses", ["train/loss", "x/dense"])
    loss, dense = ax.get_lines()
    assert loss.get_marker() == "." and loss.get_markevery() == [10, 25] and dense.get_marker() in ("None", None, "")
    _line_panel(empty, records, "nothing", ["x/all_nan"])
    assert not empty.get_lines() and [t.get_text() for t in empty.texts] == ["no data"]


def test_a_fresh_run_that_starts_past_the_last_step_of_the_one_before_is_its_own_run(tmp_path):
    """Runs in one log_dir were told apart by a step going down: a 1-step smoke test (steps 0, 1) then a run without
    step-0 validation (steps 1, 2, 3) read as one run, the plot mixing them (TensorBoard hides the first). A fresh
    run's first record now says it begins a run; a resumed run's continues its own."""
    from nemo_like.algorithms.checkpointing import last_run_start
    from nemo_like.utils.plot import read_metrics

    cfg = LoggerConfig(log_dir=str(tmp_path), progress_bar=False)

    def run(steps, resumed_step=None, **metrics):
        logger = Logger(cfg, total_steps=3, resumed_step=resumed_step)
        for step in steps:
            logger.log(dict(metrics), step)
        logger.close()

    run([0, 1], **{"train/smoke_only": 1.0})
    size = (tmp_path / "metrics.jsonl").stat().st_size
    run([1, 2], **{"train/reward": 0.5})
    assert [(r["step"], sorted(r)) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        (1, ["step", "train/reward"]),
        (2, ["step", "train/reward"]),
    ]
    assert last_run_start((tmp_path / "metrics.jsonl").read_bytes()) == size
    run([3], resumed_step=2, **{"train/reward": 0.7})  # a resume goes on with its run
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
