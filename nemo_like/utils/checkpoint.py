"""Atomic, resumable checkpoints: ``<checkpoint_dir>/step_N/``.

A save writes everything into a hidden temporary directory, fsyncs every file and the directory,
then renames it to ``step_N`` and fsyncs the parent. A crash at any point leaves either the old set
of checkpoints or the old set plus a complete new one; temporary directories are never read and are
removed at the next start (except a re-saved ``step_N`` caught between its two renames: its complete copy is renamed
back to ``step_N`` first, see :meth:`CheckpointManager.remove_partial_saves`). Layout of ``step_N/``:

* ``policy/``            model weights (safetensors) + config + the run's tokenizer: ``AutoModelForCausalLM`` /
                         ``AutoTokenizer.from_pretrained`` load it
* ``optimizer.pt``       optimizer and LR-scheduler state (rank 0; data-parallel replicas are identical)
* ``worker_rng.pt``      the policy workers' torch RNG states
* ``trainer_state.json`` step, weight version, data-loader position, consumed samples, driver RNG, metrics
* ``config.yaml``        the resolved config of the run that wrote it
"""

from __future__ import annotations

import errno
import json
import math
import os
import random
import re
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nemo_like.config.errors import did_you_mean
from nemo_like.config.loader import recipe_yaml
from nemo_like.utils.files import fsync_dir

STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp_step_"
#: A ``step_N`` set aside by a re-save of step N (``_set_aside``): ``.tmp_step_<N>_<pid>_replaced``.
REPLACED_DIR = re.compile(r"^\.tmp_step_(\d+)_(\d+)_replaced$")
STATE_FILE = "trainer_state.json"
#: In a checkpoint's metrics: the step whose weights its ``validation/*`` values measured (they carry on into the
#: checkpoints saved until the next validation, so that best-k by a validation metric can rank them).
VALIDATED_AT_STEP = "validation/measured_at_step"

# Keys whose change makes a checkpoint unusable: the model, the batch geometry, the data stream.
INCOMPATIBLE_KEYS = (
    "policy.model_name",
    "policy.precision",
    "grpo.num_prompts_per_step",
    "grpo.num_generations_per_prompt",
    "policy.train_global_batch_size",
    "grpo.seed",
    # The training stream (data.validation may change: its size and source only shape the validation passes; its
    # split_fraction carves the training rows, so it stays). The loader's fingerprint also checks the prompts.
    *(f"data.{key}" for key in ("dataset_name", "dataset_config", "prompt_key", "answer_key", "task_key", "default_task_name")),
    *(f"data.{key}" for key in ("prompt_file", "system_prompt_file", "system_prompt", "drop_long_prompts", "train", "shuffle")),
    "data.validation.split_fraction",
    "loss_fn.reference_policy_kl_penalty",
    "grpo.async_grpo.enabled",  # an async checkpoint holds a replay buffer and a data position ahead of training
    "policy.lora_cfg.enabled",  # a LoRA checkpoint holds adapters, a full one every weight
)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or cannot be resumed from; the message says why."""


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    state: dict[str, Any]


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (and ``root`` itself)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))


def _select(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


# Keys an async checkpoint's replay buffer depends on: it was paced for the staleness bound, and its samples were drawn
# under these sampling settings (their logprobs, pi_gen, would no longer be those the trainer scores against); a sync
# checkpoint holds no samples.
ASYNC_INCOMPATIBLE_KEYS = (
    "grpo.async_grpo.max_trajectory_age_steps",
    *(f"policy.generation.{key}" for key in ("temperature", "top_p", "top_k")),
)


# Keys a LoRA checkpoint depends on: it holds adapters of this shape on these modules. Without LoRA (then on both
# sides: ``policy.lora_cfg.enabled`` is pinned) they have no effect, and the config loader says so.
LORA_INCOMPATIBLE_KEYS = tuple(f"policy.lora_cfg.{key}" for key in ("dim", "alpha", "target_modules", "exclude_modules"))
# Keys holding a set of module names written as a list: the same names in another order are the same modules.
MODULE_SET_KEYS = ("policy.lora_cfg.target_modules", "policy.lora_cfg.exclude_modules")


def _same(key: str, a: Any, b: Any) -> bool:
    if key == "policy.lora_cfg.exclude_modules":  # null excludes nothing, as [] does
        a, b = a or [], b or []
    if key in MODULE_SET_KEYS and isinstance(a, list) and isinstance(b, list):
        return set(a) == set(b)
    return a == b


def incompatible_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key: saved -> current`` for each incompatible key that differs (learning rate, step limit
    and logging changes are allowed); an async checkpoint also holds its replay buffer's samples
    (:data:`ASYNC_INCOMPATIBLE_KEYS`), a LoRA one its adapters (:data:`LORA_INCOMPATIBLE_KEYS`)."""
    diffs = []
    async_saved = bool(_select(saved, "grpo.async_grpo.enabled"))
    lora_saved = bool(_select(saved, "policy.lora_cfg.enabled"))
    keys = (*INCOMPATIBLE_KEYS, *(ASYNC_INCOMPATIBLE_KEYS if async_saved else ()), *(LORA_INCOMPATIBLE_KEYS if lora_saved else ()))
    for key in keys:
        a, b = _select(saved, key), _select(current, key)
        if not _same(key, a, b):
            diffs.append(f"{key}: {a!r} -> {b!r}")
    return diffs


def driver_rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states of the driver process (JSON-serialisable)."""
    py = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }


def restore_driver_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def is_complete(path: Path) -> bool:
    """A checkpoint directory is complete when its ``trainer_state.json`` (written last) reads as JSON, as
    :meth:`CheckpointManager.valid_checkpoints` decides."""
    try:
        json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return True


class CheckpointManager:
    """Saves, ranks, prunes and finds checkpoints under one directory."""

    def __init__(
        self,
        checkpoint_dir: str | Path,
        keep_top_k: int | None = None,
        metric_name: str | None = None,
        higher_is_better: bool = True,
    ) -> None:
        self.root = Path(checkpoint_dir)
        self.keep_top_k = keep_top_k
        self.metric_name = metric_name
        self.higher_is_better = higher_is_better
        self._metric_reported = False

    # -- discovery -----------------------------------------------------------------------------
    def valid_checkpoints(self) -> list[CheckpointInfo]:
        """Complete checkpoints, oldest first. Temporary directories are ignored; an unreadable ``step_N`` (its
        state file damaged) is skipped with a warning naming it."""
        found = []
        if not self.root.is_dir():
            return found
        for child in self.root.iterdir():
            match = STEP_DIR.match(child.name)
            if not match or not child.is_dir():
                continue
            try:
                state = json.loads((child / STATE_FILE).read_text())
            except (OSError, ValueError) as exc:
                warnings.warn(f"[checkpoint] skipping {child}: its {STATE_FILE} cannot be read ({exc})", UserWarning, stacklevel=2)
                continue
            found.append(CheckpointInfo(int(match.group(1)), child, state))
        return sorted(found, key=lambda c: c.step)

    def latest(self) -> CheckpointInfo | None:
        checkpoints = self.valid_checkpoints()
        return checkpoints[-1] if checkpoints else None

    def remove_partial_saves(self) -> list[Path]:
        """Delete temporary directories left by interrupted saves; returns what was removed.

        A re-save of ``step_N`` killed between its two renames (the old copy set aside as ``.tmp_step_N_<pid>_replaced``,
        the new one not yet renamed in) leaves no ``step_N``: it is restored first, from the new copy when it is complete
        (it was fsynced before the old one was set aside), else from the old one, and the restore is printed."""
        if not self.root.is_dir():
            return []
        self._restore_interrupted_resaves()
        removed = []
        for child in self.root.iterdir():
            if child.name.startswith(TMP_PREFIX):
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
        return removed

    def _restore_interrupted_resaves(self) -> None:
        """Rename back to ``step_N`` a complete copy of each step whose re-save was interrupted between its renames."""
        for aside in sorted(self.root.glob(f"{TMP_PREFIX}*_replaced")):
            match = REPLACED_DIR.match(aside.name)
            if not match:
                continue
            final = self.root / f"step_{match.group(1)}"
            if final.exists():  # the new copy made it in: the old one is only waiting to be deleted
                continue
            new = self.root / f"{TMP_PREFIX}{match.group(1)}_{match.group(2)}"
            source = next((copy for copy in (new, aside) if is_complete(copy)), None)
            if source is None:
                continue
            os.rename(source, final)
            fsync_dir(self.root)
            which = "the new copy" if source == new else "the previous copy (the new one is incomplete)"
            print(f"[checkpoint] restored {final} from {which} of an interrupted re-save: {source.name}", file=sys.stderr, flush=True)

    # -- saving --------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        write_contents: Callable[[Path], None],
        state: dict[str, Any],
        config: dict[str, Any],
        expected_files: Sequence[str] = (),
    ) -> Path:
        """Atomically create ``step_<step>/``: ``write_contents(tmp_dir)`` writes the heavy parts.

        ``expected_files``: paths relative to the step directory that ``write_contents`` must have written (the policy
        weights, the optimizer state); the step is refused when one is missing. On any failure (a full disk included,
        a missing expected file) the temporary directory is removed, the previous checkpoints are untouched, and a
        :class:`CheckpointError` says what happened.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{TMP_PREFIX}{step}_{os.getpid()}"
        final = self.root / f"step_{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        old: Path | None = None  # a re-saved step's earlier copy, set aside until the new one is in place
        try:
            tmp.mkdir()
            write_contents(tmp)
            check_written(tmp, expected_files)
            (tmp / "config.yaml").write_text(recipe_yaml(config), encoding="utf-8")
            (tmp / STATE_FILE).write_text(json.dumps({"step": step, **state}))
            fsync_tree(tmp)
            _pause_for_crash_tests(step)
            # Re-saving a step (e.g. after resume): the old copy leaves by one rename to a temporary name, so a crash
            # never leaves a half-deleted step_N that reads as complete (the next start removes temporary names, after
            # restoring step_N should the crash fall between this rename and the next).
            old = self._set_aside(final, "replaced") if final.exists() else None
            os.rename(tmp, final)
            fsync_dir(self.root)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except Exception as exc:  # noqa: BLE001 - the workers' writers fail as RayTaskError(RuntimeError), not OSError
            reason = save_failure_reason(exc, self.root)  # before the removal frees the space
            shutil.rmtree(tmp, ignore_errors=True)
            if old is not None and old.exists() and not final.exists():  # the new copy never arrived: the old one returns
                os.rename(old, final)
                fsync_dir(self.root)
            previous = self.latest()
            kept = f"the previous checkpoint {previous.path} is kept" if previous else "no earlier checkpoint exists"
            raise CheckpointError(f"Saving checkpoint step_{step} in {self.root} failed: {reason}; {kept}") from exc
        self._report_missing_metric(state.get("metrics", {}), step)
        self.prune(keep_also=final)
        return final

    def _report_missing_metric(self, metrics: dict[str, Any], step: int) -> None:
        """Warn once when the ranking metric is absent from a save whose metrics hold others of its namespace (a typo
        such as ``val:acc``: every checkpoint would rank below the metric's and the top-k would keep the latest ones)."""
        if self._metric_reported or self.keep_top_k is None or self.metric_name is None:
            return
        key = metric_key(self.metric_name)
        namespace = key.split("/")[0] + "/"
        present = sorted(k for k in metrics if k.startswith(namespace))
        if key in metrics or not present:  # not logged yet (no validation before this save): nothing to say
            return
        self._metric_reported = True
        prefix = self.metric_name.split(":")[0]
        names = [f"{prefix}:{k.removeprefix(namespace)}" for k in present]
        warnings.warn(
            f"checkpointing.metric_name={self.metric_name!r}: step_{step}'s metrics have no {key!r}, so checkpoints are "
            f"kept by step, not by that metric.{did_you_mean(self.metric_name, names)} (logged: {', '.join(names[:8])}"
            f"{', ...' if len(names) > 8 else ''})",
            UserWarning,
            stacklevel=3,
        )

    def prune(self, keep_also: Path | None = None) -> list[Path]:
        """Keep the ``keep_top_k`` best checkpoints by ``metric_name`` (or the most recent); the latest one and
        ``keep_also`` (the one just written: a fresh run's step_10 beside another run's step_100) are always kept.
        Each removed checkpoint is first renamed to a temporary name, so a crash mid-delete leaves no half of it."""
        checkpoints = self.valid_checkpoints()
        if self.keep_top_k is None or len(checkpoints) <= self.keep_top_k:
            return []
        latest = checkpoints[-1]
        ranked = sorted(checkpoints, key=self._rank_key, reverse=True)
        keep = {c.path for c in ranked[: self.keep_top_k]} | {latest.path} | ({keep_also} if keep_also else set())
        removed = [c.path for c in checkpoints if c.path not in keep]
        for path in removed:
            shutil.rmtree(self._set_aside(path, "pruned"), ignore_errors=True)
        return removed

    def _set_aside(self, checkpoint: Path, why: str) -> Path:
        """Rename ``step_N`` to a temporary name (never read, removed at the next start) before it is deleted, so a
        crash mid-delete leaves no half checkpoint that reads as complete; returns the new path."""
        aside = self.root / f"{TMP_PREFIX}{checkpoint.name.removeprefix('step_')}_{os.getpid()}_{why}"
        os.rename(checkpoint, aside)
        return aside

    def _rank_key(self, checkpoint: CheckpointInfo) -> tuple[float, bool, int]:
        """Higher is better; checkpoints without the metric rank below those with it; on a tie the checkpoint whose
        own weights the validation measured (it carries on into later saves until the next one), then the later."""
        if self.metric_name is None:
            return (0.0, False, checkpoint.step)
        metrics = checkpoint.state.get("metrics", {})
        value = metrics.get(metric_key(self.metric_name))
        if value is None or not math.isfinite(value):  # a NaN (a skipped non-finite step's loss) sorted anywhere
            return (float("-inf"), False, checkpoint.step)
        measured_here = metrics.get(VALIDATED_AT_STEP) == checkpoint.step
        return (value if self.higher_is_better else -value, measured_here, checkpoint.step)


class MissingCheckpointFiles(CheckpointError):
    """The writers of a checkpoint returned without error but left out files it must hold."""


def check_written(directory: Path, expected_files: Sequence[str]) -> None:
    """Raise :class:`MissingCheckpointFiles` naming each of ``expected_files`` (relative to ``directory``) that is not
    there. A writer on another node, or with another working directory, writes its files somewhere else and returns
    without error: the step must not become a ``step_N`` that reads as complete without its weights."""
    missing = [name for name in expected_files if not (directory / name).exists()]
    if missing:
        raise MissingCheckpointFiles(
            f"the workers wrote no {', '.join(missing)} into {directory} (they wrote them elsewhere: a worker on another "
            "node or in another working directory); set checkpointing.checkpoint_dir to an absolute path on storage "
            "every node sees"
        )


#: Free bytes below which a failed save is reported as a full disk (the writers' errors do not always say so:
#: ``torch.save`` raises a RuntimeError such as "unexpected pos" on a full device).
NEARLY_FULL_BYTES = 1 << 20


def save_failure_reason(exc: BaseException, root: Path) -> str:
    """Why a checkpoint save failed, for its error message: "no space left on device" when an ENOSPC is anywhere in
    the exception's chain or the checkpoint directory's device is (nearly) full, else the exception's first line."""
    if isinstance(exc, MissingCheckpointFiles):
        return str(exc)
    seen: BaseException | None = exc
    while seen is not None:
        if (isinstance(seen, OSError) and seen.errno == errno.ENOSPC) or "No space left on device" in str(seen):
            return "no space left on device"
        seen = seen.__cause__ or seen.__context__
    try:
        if shutil.disk_usage(root).free < NEARLY_FULL_BYTES:
            return "no space left on device"
    except OSError:
        pass
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def metric_key(metric_name: str) -> str:
    """``val:accuracy`` -> ``validation/accuracy``; ``train:reward`` -> ``train/reward``."""
    prefix, _, name = metric_name.partition(":")
    namespaces = {"val": "validation", "train": "train"}
    if prefix not in namespaces or not name:
        raise ValueError(f"checkpointing.metric_name must look like 'val:<metric>' or 'train:<metric>', got {metric_name!r}")
    return f"{namespaces[prefix]}/{name}"


def _pause_for_crash_tests(step: int) -> None:
    """Crash tests set NEMO_LIKE_CHECKPOINT_PAUSE_S (and _STEP) to hold one save open between its
    write and its rename, so that a real SIGKILL lands mid-save deterministically."""
    pause = float(os.environ.get("NEMO_LIKE_CHECKPOINT_PAUSE_S", "0") or 0)
    pause_step = os.environ.get("NEMO_LIKE_CHECKPOINT_PAUSE_STEP")
    if pause > 0 and (pause_step is None or int(pause_step) == step):
        marker = os.environ.get("NEMO_LIKE_CHECKPOINT_PAUSE_MARKER")
        if marker:
            Path(marker).write_text("saving")
        time.sleep(pause)
