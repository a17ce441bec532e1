"""Checks of a run's inputs on this machine, before any cluster or actor starts.

What the schema cannot know: whether the model can be loaded here and whether the run's directories
can be written. Each failure is a :class:`~nemo_like.config.errors.ConfigError` naming the key.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from nemo_like.config.errors import ConfigError
from nemo_like.config.schema import MasterConfig
from nemo_like.models.loading import check_model_source
from nemo_like.utils.run_lock import run_directories


def ensure_writable_dir(directory: Path, key: str) -> None:
    """Create ``directory`` if needed and write a scratch file in it; a failure names ``key``."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write_check_"):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc)
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(directory) else ""
        raise ConfigError(
            f"{key}={str(directory)!r} is not a writable directory: {reason}{where}. Point {key} at a directory this user can create and write."
        ) from None


def check_run_inputs(cfg: MasterConfig) -> None:
    """Model and tokenizer sources loadable here, run directories writable."""
    check_model_source(cfg.policy.model_name, "policy.model_name")
    if cfg.policy.tokenizer_name and cfg.policy.tokenizer_name != cfg.policy.model_name:
        check_model_source(cfg.policy.tokenizer_name, "policy.tokenizer_name")
    for key, directory in run_directories(cfg).items():
        ensure_writable_dir(directory, key)
