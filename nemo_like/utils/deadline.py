"""``checkpointing.save_before``: when a run must have saved and stopped (docs/guides/fault-tolerance.md).

Accepted forms: ``auto`` (the scheduler's job end: ``SLURM_JOB_END_TIME``, Unix seconds, when set; else no
deadline), a number of seconds from the run's start (``3600``, ``"5400.5"``), or an ISO 8601 time
(``2026-12-02T18:00:00``; without a zone it is this machine's local time).
"""

from __future__ import annotations

import math
import os
from datetime import datetime

from nemo_like.config.errors import ConfigError
from nemo_like.config.sections.run import CheckpointingConfig, check_save_before

#: Unix seconds a scheduler's end time may name (the year 5138: beyond, no datetime can show it).
MAX_UNIX_SECONDS = 1e11

SCHEDULER_END_VARIABLES = ("SLURM_JOB_END_TIME",)


def resolve_deadline(spec: str | float | None, started_at: float, environ: dict[str, str] | None = None) -> tuple[float | None, str]:
    """The deadline as ``time.time()`` seconds (``None``: none) and where it came from, for the ``[stop]`` line."""
    if spec is None:
        return None, "no deadline"
    env = os.environ if environ is None else environ
    text = str(spec).strip()
    if text.lower() == "auto":
        for name in SCHEDULER_END_VARIABLES:
            value = env.get(name, "").strip()
            if value:
                try:
                    end = float(value)
                except ValueError:
                    end = math.nan
                if not 0 < end < MAX_UNIX_SECONDS:  # nan, inf, 1e400, garbage: not a time
                    raise ConfigError(f"checkpointing.save_before=auto: ${name}={value!r} is not Unix seconds") from None
                return end, f"${name}={value}"
        return None, "checkpointing.save_before=auto: no scheduler end time in the environment"
    try:
        return started_at + float(text), f"checkpointing.save_before={text}s after the start"
    except ValueError:
        pass
    check_save_before(text)
    return datetime.fromisoformat(text).timestamp(), f"checkpointing.save_before={text}"


def resolve_run_deadline(
    checkpointing: CheckpointingConfig, started_at: float, environ: dict[str, str] | None = None
) -> tuple[float | None, str]:
    """:func:`resolve_deadline` for a run about to start: a deadline with checkpointing off is a :class:`ConfigError`.

    The config check lets ``auto`` through with checkpointing off (a shared recipe outside a scheduler has no deadline
    and nothing to save); only here, once ``auto`` has found the scheduler's end time, is it known that the run would
    stop with 75 ("requeue me") having saved nothing, so that a requeued job would restart from step 0 every time."""
    deadline, source = resolve_deadline(checkpointing.save_before, started_at, environ)
    if deadline is not None and not checkpointing.enabled:
        raise ConfigError(
            f"checkpointing.save_before={checkpointing.save_before} found a deadline ({source}) but checkpointing.enabled=false: "
            "the run would stop before it (exit 75) having saved nothing, and a requeued job would restart from step 0 "
            "every time. Set checkpointing.enabled=true, or checkpointing.save_before=null"
        )
    return deadline, source
