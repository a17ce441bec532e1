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
    """Every missing directory on the way to each of ``directories``, deepest first: what a run that creates them adds
    to the filesystem."""
    created: list[Path] = []
    for directory in directories:
        for path in (directory, *directory.parents):
            if path.exists():
                break
            if path not in created:
                created.append(path)
    return sorted(created, key=lambda path: len(path.parts), reverse=True)


def clear_refused_run(directories: Iterable[Path]) -> None:
    """Empty the run directories a refused run created and still locks (``directories``) while they hold no step's
    record or checkpoint: a run refused at set-up left ``config.yaml``, an empty ``metrics.jsonl`` and its lock file
    there, which read as a run that had started. Only under the run's lock: no other run writes there."""
    for directory in directories:
        if not directory.is_dir() or directory.is_symlink():
            continue
        if any(path.stat().st_size for path in directory.rglob("metrics.jsonl")) or any(directory.rglob("step_*")):
            continue
        for entry in directory.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def remove_empty_dirs(directories: Iterable[Path]) -> None:
    """Remove each of ``directories`` (deepest first) that is empty: what a refused run created and left empty, never a
    directory someone else has written into since."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:  # not empty (another run's files), or gone
            pass
