"""Whether a run's directory can be written, checked on this machine before any cluster or actor starts.

:func:`nemo_like.train.check_run_inputs` runs it for every run directory, beside the model-source check
(:func:`nemo_like.models.loading.check_model_source`). A failure is a :class:`~nemo_like.config.errors.ConfigError`
naming the key.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from nemo_like.config.errors import ConfigError


def ensure_writable_dir(directory: Path, key: str) -> None:
    """Create ``directory`` if needed and write a byte to a scratch file in it; a failure names ``key``. The byte
    matters: creating an empty file succeeds on a full device, and the run then died in its lock's first write."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write_check_", buffering=0) as probe:
            probe.write(b"x")
    except OSError as exc:
        reason = exc.strerror or str(exc)
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(directory) else ""
        raise ConfigError(
            f"{key}={str(directory)!r} is not a writable directory: {reason}{where}. Point {key} at a directory this user can create and write."
        ) from None


def refuse_overwriting(target: Path, protected: Path, key: str, what: str) -> None:
    """A :class:`ConfigError` naming ``key`` when writing ``target`` (a directory a command replaces or fills) would
    overwrite ``protected`` (``what``: e.g. "the model it evaluates"): the same directory, one inside the other."""
    written, kept = target.resolve(), protected.resolve()
    if written == kept or kept.is_relative_to(written) or written.is_relative_to(kept):
        raise ConfigError(f"{key}: writing {target} would overwrite {what} ({protected}); choose a directory outside it")


def directories_to_create(directories: Iterable[Path]) -> list[Path]:
    """The outermost missing directory on the way to each of ``directories`` (none where it exists): what a run that
    creates them adds to the filesystem."""
    created = []
    for directory in directories:
        missing = None
        for path in (directory, *directory.parents):
            if path.exists():
                break
            missing = path
        if missing is not None and missing not in created:
            created.append(missing)
    return created


def remove_refused_run_dirs(created: Iterable[Path]) -> None:
    """Remove the directories a refused run created (``created``: :func:`directories_to_create` before it started)
    while they hold no step's record or checkpoint: a run refused at set-up left ``config.yaml``, an empty
    ``metrics.jsonl`` and lock files in new directories, which read as a run that had started."""
    for directory in created:
        if any(path.stat().st_size for path in directory.rglob("metrics.jsonl")) or any(directory.rglob("step_*")):
            continue
        shutil.rmtree(directory, ignore_errors=True)
