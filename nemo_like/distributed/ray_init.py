"""Start or join Ray.

Which cluster a run uses, first match wins:

1. ``cluster.ray_address`` in the recipe (``auto`` means the cluster already running on this node);
2. ``$RAY_ADDRESS``;
3. the job's own cluster when the driver runs as a ``ray job submit`` entrypoint;
4. otherwise a private local cluster with ``cluster.num_cpus`` CPUs and this machine's real GPUs.

A plain local run never attaches to some other cluster that happens to run on the machine.
"""

from __future__ import annotations

import logging
import os
import socket

from nemo_like.config.schema import ClusterConfig
from nemo_like.distributed.ray_env import address_from_env, apply_driver_defaults, in_ray_job, job_submission_id

log = logging.getLogger(__name__)


def cluster_address(cluster: ClusterConfig) -> tuple[str | None, str]:
    """The address to join (None: start a private cluster) and where that decision came from."""
    if cluster.ray_address:
        return cluster.ray_address, "cluster.ray_address"
    address = address_from_env()
    if address is None:
        return None, "no cluster address: private local cluster"
    return address, f"Ray job {job_submission_id()}" if in_ray_job() else "$RAY_ADDRESS"


def init_ray(cluster: ClusterConfig) -> str:
    """Join the cluster named by :func:`cluster_address`, or start a private one.

    Returns ``"joined"`` or ``"local"``. Calling it when Ray is already initialised is a no-op.
    No job-level ``runtime_env`` is ever passed: inside a submitted job it would replace the
    job's own (working dir included) instead of merging with it.
    """
    address, source = cluster_address(cluster)
    apply_driver_defaults(joining=address is not None)
    import ray

    if ray.is_initialized():
        return "joined"
    if address is not None:
        _join(address, source)
        return "joined"
    _start_local(cluster)
    return "local"


def _join(address: str, source: str) -> None:
    """Connect this driver to an existing cluster; a wrong address fails here, with its source named."""
    import ray

    _check_reachable(address, source)
    try:
        ray.init(address=address, log_to_driver=True)
    except (ConnectionError, ValueError) as exc:
        raise ConnectionError(f"Could not join the Ray cluster at {address!r} (from {source}): {exc}") from exc
    log.info("Joined Ray cluster at %s (from %s): %s", address, source, ray.cluster_resources())


def _check_reachable(address: str, source: str, timeout_s: float = 10.0) -> None:
    """Probe a ``host:port`` GCS address: Ray 2.60's ``ray.init`` keeps retrying an unreachable one (minutes, measured)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # "auto", "ray://...": Ray resolves and reports these itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(
            f"No Ray cluster answers at {address!r} (from {source}): {exc}. Start one with `ray start --head`, "
            "fix the address, or unset it to run on a private local cluster"
        ) from exc


def _start_local(cluster: ClusterConfig) -> None:
    """A private single-machine cluster with this machine's real GPUs (none for a CPU recipe).

    The GPUs are detected, never declared from the recipe: a GPU recipe on a machine without them then
    fails the capacity check before any actor starts (declaring them let the actors start and die later)."""
    import ray

    _warn_if_ray_imported_too_early()
    ray.init(
        address="local",
        num_cpus=cluster.num_cpus or os.cpu_count(),
        num_gpus=None if cluster.gpus_per_node else 0,  # None: Ray counts the visible GPUs
        object_store_memory=cluster.object_store_memory_mb * 1024 * 1024,
        include_dashboard=False,
        log_to_driver=True,
    )
    log.info("Started a private local Ray cluster: %s", ray.cluster_resources())


def _warn_if_ray_imported_too_early() -> None:
    """Ray reads the loopback switch at import; say so when it was imported before our defaults."""
    from ray._private import ray_constants

    wants_loopback = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "").lower() in ("0", "false")
    if wants_loopback and getattr(ray_constants, "ENABLE_RAY_CLUSTER", False):
        log.warning(
            "ray was imported before nemo_like.distributed, so RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is ignored and the "
            "local cluster binds to the machine's network address; import nemo_like first or export the variable"
        )
