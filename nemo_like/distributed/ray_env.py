"""The one place where environment variables for Ray and its workers are decided.

Ray's job runtime env and ``ray.init(runtime_env=...)`` do not merge, so we never pass a job-level
runtime env: driver-side defaults are set in ``os.environ`` before Ray starts, and worker-side
variables travel with each actor's own ``runtime_env`` (which Ray merges onto the job's).
"""

from __future__ import annotations

import os

# Safe defaults for a local cluster on a single machine (set only when the user has not).
DRIVER_DEFAULTS = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keep every Ray socket on 127.0.0.1 (Linux too)
    "RAY_AUTH_MODE": "disabled",  # the CLI clients fail token auth otherwise
    "RAY_USAGE_STATS_ENABLED": "0",
    "TOKENIZERS_PARALLELISM": "false",
}

# Variables forwarded from the driver to every actor when set there.
FORWARDED_TO_WORKERS = ("HF_HUB_OFFLINE", "HF_HOME", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM")


def apply_driver_defaults() -> None:
    """Set :data:`DRIVER_DEFAULTS` in this process unless already set."""
    for key, value in DRIVER_DEFAULTS.items():
        os.environ.setdefault(key, value)


def worker_env_vars(num_threads: int | None = None) -> dict[str, str]:
    """Environment for an actor process: forwarded variables plus thread limits."""
    env = {k: os.environ[k] for k in FORWARDED_TO_WORKERS if k in os.environ}
    if num_threads is not None:
        env["OMP_NUM_THREADS"] = str(num_threads)
    return env
