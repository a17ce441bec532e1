"""The one place where environment variables for Ray and its workers are decided.

Ray's job runtime env and ``ray.init(runtime_env=...)`` do not merge, so we never pass a job-level
runtime env: driver-side defaults are set in ``os.environ`` before Ray starts, and worker-side
variables travel with each actor's own ``runtime_env`` (which Ray merges onto the job's).

Two contexts, decided from the environment alone:

* **joining** a cluster: ``$RAY_ADDRESS`` is set, or this process is the driver of a job started by
  ``ray job submit`` (Ray 2.60 sets ``RAY_JOB_CONFIG_JSON_ENV_VAR`` and ``RAY_ADDRESS=<gcs host:port>``
  there, but no ``RAY_JOB_ID``). The cluster's own settings win: we set nothing Ray-related, so the
  driver uses the node IP and the auth mode the cluster was started with.
* **local**: a private single-machine cluster. Token auth and usage stats are off
  (:data:`LOCAL_CLUSTER_DEFAULTS`), and the cluster listens on 127.0.0.1 only: ``init_ray`` passes the
  loopback address to ``ray.init`` itself (``ray_init.local_init_kwargs``), whatever was imported first.

The defaults are applied when this module is imported before ``ray`` (actor processes, where ``ray``
comes first, are left alone), and again by ``init_ray`` before Ray starts, so Ray's own processes
inherit them. Only unset variables are filled in: what the user exported wins, except that a private
cluster stays on the loopback address even under ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1`` (to use
other machines, start a cluster with ``ray start`` and join it). Ray reads that variable once, when
``ray`` is imported, so it alone could not keep the cluster local: ``nemo-like train`` imports ``ray``
before this module.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping

# Set in every driver unless already set.
DRIVER_DEFAULTS = {"TOKENIZERS_PARALLELISM": "false"}

# Set only when this process will start its own private cluster on this machine.
LOCAL_CLUSTER_DEFAULTS = {
    # Ray's processes (agents, workers) importing ray fresh resolve the node to 127.0.0.1; init_ray passes the
    # loopback address to ray.init itself, since the driver may have imported ray before this was set.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",  # the CLI clients fail token auth otherwise
    "RAY_USAGE_STATS_ENABLED": "0",
    # Ray starts worker processes at nice 15. In a private cluster the actors are the job itself: at nice 15 any
    # other process on the machine takes the CPU from them, and a multi-threaded (OpenMP) actor stalls at every
    # barrier whose partner thread lost its core (2-thread torch step: 0.10 s quiet, 0.33 s beside one busy nice-0
    # process). Actors run at the driver's priority instead.
    "RAY_worker_niceness": "0",
}

# Set by Ray's job supervisor in the environment of a submitted job's entrypoint (Ray 2.60).
JOB_CONFIG_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"
ADDRESS_VAR = "RAY_ADDRESS"

# Variables forwarded from the driver to every actor when set there. A private cluster's actors inherit the driver's
# environment anyway; a joined cluster's inherit the `ray start` shell's, where a reward or environment module that
# imports in the driver through PYTHONPATH would not import. (A job's working dir still comes first: Ray prepends it.)
FORWARDED_TO_WORKERS = ("HF_HUB_OFFLINE", "HF_HOME", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM", "PYTHONPATH")


def in_ray_job(environ: Mapping[str, str] | None = None) -> bool:
    """True inside the entrypoint of a job started with ``ray job submit`` (or the jobs SDK)."""
    return JOB_CONFIG_VAR in (os.environ if environ is None else environ)


def _job_config_field(section: str, key: str, environ: Mapping[str, str] | None) -> str | None:
    """``key`` of ``section`` (``runtime_env``, ``metadata``) in the job config Ray hands a job's entrypoint
    (:data:`JOB_CONFIG_VAR`); ``None`` outside a job, or where it is not set."""
    raw = (os.environ if environ is None else environ).get(JOB_CONFIG_VAR)
    try:
        return json.loads(raw or "{}").get(section, {}).get(key) or None
    except (ValueError, AttributeError):
        return None


def job_working_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """The working dir of the job this process runs in (its runtime env's ``working_dir``: ``gcs://_ray_pkg_...zip``
    once uploaded), unpacked into Ray's session directory as the entrypoint's current directory; ``None`` outside a
    job or for a job without one (its entrypoint runs where ``ray start`` ran)."""
    return _job_config_field("runtime_env", "working_dir", environ)


def job_submission_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The submission id of the job this process runs in (``raysubmit_...`` or ``--submission-id``)."""
    return _job_config_field("metadata", "job_submission_id", environ)


def address_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The cluster this process should join according to its environment, or None for a private one.

    ``$RAY_ADDRESS`` when set; ``"auto"`` inside a submitted job without it (``ray.init`` then finds
    the job's cluster itself).
    """
    env = os.environ if environ is None else environ
    if env.get(ADDRESS_VAR):
        return env[ADDRESS_VAR]
    if in_ray_job(env):
        return "auto"
    return None


_SET_HERE: set[str] = set()  # variables this module filled in (not the user's)


def apply_driver_defaults(joining: bool | None = None) -> None:
    """Fill in unset driver variables; the local-cluster ones only when not joining a cluster.

    ``joining=None`` decides from the environment (:func:`address_from_env`). When a run turns out
    to join a cluster (``cluster.ray_address`` in the recipe), local-cluster values filled in earlier
    by this module are taken back, so the driver uses the cluster's auth mode.
    """
    if joining is None:
        joining = address_from_env() is not None
    if joining:
        for key in sorted(_SET_HERE & LOCAL_CLUSTER_DEFAULTS.keys()):
            os.environ.pop(key, None)
            _SET_HERE.discard(key)
    defaults = DRIVER_DEFAULTS if joining else {**DRIVER_DEFAULTS, **LOCAL_CLUSTER_DEFAULTS}
    for key, value in defaults.items():
        if key not in os.environ:
            os.environ[key] = value
            _SET_HERE.add(key)


#: Appended to a forwarded PYTHONPATH: Ray expands it in the actor's process to the path the node gave it (the
#: `ray start` shell's; nothing when unset), so the driver's entries come first and the node's stay.
NODE_PYTHONPATH = "${PYTHONPATH}"


def worker_env_vars(num_threads: int | None = None) -> dict[str, str]:
    """Environment for an actor process: forwarded variables plus thread limits. A forwarded ``PYTHONPATH`` keeps the
    node's own after the driver's (Ray sets each variable whole: a joined cluster's actors had lost the node's path)."""
    env = {k: os.environ[k] for k in FORWARDED_TO_WORKERS if k in os.environ}
    if "PYTHONPATH" in env:  # an empty entry is the actor's working directory on sys.path: not forwarded
        entries = [p for p in env.pop("PYTHONPATH").split(os.pathsep) if p]
        if entries:
            env["PYTHONPATH"] = os.pathsep.join([*entries, NODE_PYTHONPATH])
    if num_threads is not None:
        env["OMP_NUM_THREADS"] = str(num_threads)
    return env


if "ray" not in sys.modules:  # a driver about to import ray; never inside Ray's own worker processes
    apply_driver_defaults()
