"""Start or join Ray.

Which cluster a run uses, first match wins:

1. ``cluster.ray_address`` in the recipe (``auto`` means the cluster already running on this node);
2. ``$RAY_ADDRESS``;
3. the job's own cluster when the driver runs as a ``ray job submit`` entrypoint;
4. otherwise a private local cluster with ``cluster.num_cpus`` CPUs (default: the CPUs this process may use, its
   cgroup CPU quota included: :func:`~nemo_like.utils.cpus.local_cores`) and this machine's real GPUs.

A plain local run never attaches to some other cluster that happens to run on the machine, and its
private cluster listens on 127.0.0.1 only, whatever was imported first (:func:`local_init_kwargs`).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from nemo_like.config.errors import ConfigError
from nemo_like.config.schema import ClusterConfig
from nemo_like.config.sections.base import changed_from_defaults
from nemo_like.distributed.ray_env import address_from_env, apply_driver_defaults, in_ray_job, job_submission_id
from nemo_like.utils.cpus import local_cores

log = logging.getLogger(__name__)


def cluster_address(cluster: ClusterConfig) -> tuple[str | None, str]:
    """The address to join (None: start a private cluster) and where that decision came from."""
    if cluster.ray_address:
        return cluster.ray_address, "cluster.ray_address"
    address = address_from_env()
    if address is None:
        return None, "no cluster address: private local cluster"
    return address, f"Ray job {job_submission_id()}" if in_ray_job() else "$RAY_ADDRESS"


def joins_existing_cluster(cluster: ClusterConfig) -> bool:
    """Whether :func:`init_ray` joins a running cluster (Ray is already initialised, or :func:`cluster_address` names
    one) rather than starting a private one. Ray is not imported here: :func:`init_ray` sets the driver's
    environment before Ray loads."""
    ray = sys.modules.get("ray")
    return (ray is not None and ray.is_initialized()) or cluster_address(cluster)[0] is not None


def init_ray(cluster: ClusterConfig) -> str:
    """Join the cluster named by :func:`cluster_address`, or start a private one.

    Returns ``"joined"`` or ``"local"``. When Ray is already initialised in this process (a second run of a sweep or a
    notebook) it connects nothing and returns what the first call did, but a run naming another cluster than the one
    this process is connected to is an error (it would silently run on the first run's cluster).
    No job-level ``runtime_env`` is ever passed: inside a submitted job it would replace the
    job's own (working dir included) instead of merging with it.
    """
    global _CONNECTED, _LOCAL_SIZES
    address, source = cluster_address(cluster)
    apply_driver_defaults(joining=address is not None)
    import ray

    if ray.is_initialized():
        if _CONNECTED is None or _CONNECTED[2] != _gcs_address():  # the caller's own ray.init: it is joined
            gcs = _gcs_address()
            if address is not None and gcs is not None and "://" not in address and not same_cluster(address, gcs):
                raise ConfigError(
                    f"{source} names the Ray cluster at {address!r}, but this process is already connected to the Ray "
                    f"cluster at {gcs!r} (its own ray.init); name that one, or call ray.shutdown() first"
                )
            _warn_ignored_sizes(cluster, "this process was already connected to Ray (its own ray.init)")
            return "joined"
        mode, connected, gcs = _CONNECTED
        if address is not None and (mode == "local" or (address != connected and not same_cluster(address, gcs or connected))):
            now = "its private local cluster" if mode == "local" else f"the Ray cluster at {connected!r}"
            raise ConfigError(
                f"{source} names the Ray cluster at {address!r}, but this process is already connected to {now} by an "
                "earlier run; call ray.shutdown() between the runs, or run this one in a new process"
            )
        if address is None and mode == "joined":  # it asks for a private local cluster: it would run on the joined one
            raise ConfigError(
                f"this run names no Ray cluster (a private local one), but this process is already connected to the Ray "
                f"cluster at {connected!r} by an earlier run; set cluster.ray_address={connected} to run there, call "
                "ray.shutdown() between the runs, or run this one in a new process"
            )
        if mode == "local" and _LOCAL_SIZES is not None and _sizes(cluster) != _LOCAL_SIZES:
            _warn_ignored_sizes(cluster, "an earlier run in this process started the private local cluster this one uses")
        elif mode == "joined":
            _warn_ignored_sizes(cluster, f"this run uses the Ray cluster at {connected!r}")
        return mode
    if address is not None:
        if source != "cluster.ray_address":  # (that key's own config warning said so already)
            _warn_ignored_sizes(cluster, f"this run joins the Ray cluster at {address!r} (from {source})")
        _join(address, source)
        _CONNECTED = ("joined", address, _gcs_address())
        return "joined"
    _start_local(cluster)
    _CONNECTED = ("local", None, _gcs_address())
    _LOCAL_SIZES = _sizes(cluster)
    return "local"


def _sizes(cluster: ClusterConfig) -> tuple[int | None, int]:
    return cluster.num_cpus, cluster.object_store_memory_mb


def _warn_ignored_sizes(cluster: ClusterConfig, why: str) -> None:
    """A warning per private-cluster size key the run changed that the cluster it uses does not read."""
    for key in changed_from_defaults(cluster, ["num_cpus", "object_store_memory_mb"]):
        warnings.warn(
            f"cluster.{key} has no effect: {why}; only a private local cluster started by the run reads it", RuntimeWarning, stacklevel=3
        )


# What init_ray connected this process to: (mode, the address it was given, the GCS address Ray reports).
_CONNECTED: tuple[str, str | None, str | None] | None = None
_LOCAL_SIZES: tuple[int | None, int] | None = None  # the private cluster's (num_cpus, object store MiB) as started


def _gcs_address() -> str | None:
    import ray

    return ray.get_runtime_context().gcs_address if ray.is_initialized() else None


def same_cluster(address: str, gcs: str) -> bool:
    """Whether a cluster address as a user names it (``auto``, a host name, ``127.0.0.1`` or this machine's own IP)
    names the cluster whose GCS answers at ``gcs`` (``host:port``): the strings differed for one cluster named two ways
    (``$RAY_ADDRESS``, then ``cluster.ray_address=auto``). A ``ray://`` client address names no GCS here: callers compare
    it with the address the process connected with."""
    if "://" in address:
        return address == gcs
    if address == "auto":
        from ray._private.services import get_ray_address_from_environment

        address = get_ray_address_from_environment("auto", None) or address
    (host_a, _, port_a), (host_b, _, port_b) = address.rpartition(":"), gcs.rpartition(":")
    if port_a != port_b:
        return False
    ip_a, ip_b = _ip(host_a), _ip(host_b)
    return ip_a == ip_b or (_is_this_machine(ip_a) and _is_this_machine(ip_b))


def _ip(host: str) -> str:
    try:
        return socket.gethostbyname(host.strip("[]"))
    except OSError:
        return host


def _is_this_machine(ip: str) -> bool:
    """An address of this machine (a socket can bind to it): the loopback one or one of its interfaces'."""
    try:
        with socket.socket() as probe:
            probe.bind((ip, 0))
        return True
    except OSError:
        return False


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


LOOPBACK = "127.0.0.1"  # Ray's processes bind their servers to 127.0.0.1 when the node IP is this address, else to 0.0.0.0


def local_init_kwargs(cluster: ClusterConfig) -> dict[str, Any]:
    """The ``ray.init`` arguments of a private local cluster: this machine's real GPUs, on the loopback address only.

    The node IP is what Ray's processes (GCS, raylet, agents, every worker) bind their servers to, and the dashboard
    host is where the dashboard process listens: both are 127.0.0.1, so nothing of a private cluster listens on the
    network. The GPUs are detected, never declared from the recipe: a GPU recipe on a machine without them then fails
    the capacity check before any actor starts (declaring them let the actors start and die later)."""
    return {
        "address": "local",
        "num_cpus": cluster.num_cpus or local_cores(),  # affinity and cgroup quota, as the thread split counts them
        "num_gpus": None if cluster.gpus_per_node else 0,  # None: Ray counts the visible GPUs
        "object_store_memory": cluster.object_store_memory_mb * 1024 * 1024,
        "include_dashboard": False,
        "dashboard_host": LOOPBACK,
        "_node_ip_address": LOOPBACK,
        "log_to_driver": True,
    }


@contextlib.contextmanager
def loopback_honoured() -> Iterator[None]:
    """While held, ``ray.init`` keeps a loopback ``_node_ip_address`` as given.

    Ray 2.60's ``ray.init`` rewrites ``127.0.0.1`` to the machine's network address
    (``services.resolve_ip_for_localhost``) unless its switch ``ray_constants.ENABLE_RAY_CLUSTER`` is off, and Ray
    computes that switch once, from ``$RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``, when ``ray`` is first imported: a process
    that imported ``ray`` before that variable was set (our CLI through ``worker_group``, a notebook) has it on. The
    switch is held off for the start and restored after; :func:`_start_local` checks the node's address in any case.
    """
    from ray._private import ray_constants

    missing = object()
    saved = getattr(ray_constants, "ENABLE_RAY_CLUSTER", missing)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if saved is missing:
            del ray_constants.ENABLE_RAY_CLUSTER
        else:
            ray_constants.ENABLE_RAY_CLUSTER = saved


def _start_local(cluster: ClusterConfig) -> None:
    """A private single-machine cluster (:func:`local_init_kwargs`); one that would not be loopback-only is shut down."""
    import ray

    with loopback_honoured():
        ray.init(**local_init_kwargs(cluster))
    node_ip = ray.util.get_node_ip_address()
    if node_ip != LOOPBACK:
        ray.shutdown()
        raise RuntimeError(
            f"The private local Ray cluster started on {node_ip}, not on the loopback address: it was shut down so that "
            "it does not listen on the network. This Ray version no longer honours the loopback node address; start a "
            "cluster with `ray start --head --node-ip-address=127.0.0.1` and join it with cluster.ray_address"
        )
    log.info("Started a private local Ray cluster on %s: %s", node_ip, ray.cluster_resources())
