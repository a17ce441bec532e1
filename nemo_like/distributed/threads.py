"""Threads on this cluster: how many CPUs a node has (read from Ray once, for the run plan's split,
:mod:`nemo_like.plan.threads`) and applying an actor's thread count to its process."""

from __future__ import annotations

import os
from typing import Any

from nemo_like.utils.cpus import local_cores  # also importable from here

__all__ = ["apply_thread_count", "cpu_node_count", "local_cores", "node_cpus"]


def node_cpus(cluster: Any = None) -> int:
    """CPUs of the smallest alive node of the running Ray cluster, capped on this process's own node by the CPUs it
    may use (:func:`local_cores`: its affinity and cgroup CPU quota; a local cluster started with more logical CPUs than
    that does not get more threads). Before
    Ray starts: what the private cluster ``cluster`` (the ``cluster`` config section) will have, else this machine's
    cores (``nemo-like plan`` of several nodes: :func:`declared_node_cpus`)."""
    import ray

    if not ray.is_initialized():  # a run's private cluster is this machine, whatever cluster.num_nodes says
        return _private_cluster_cpus(cluster)
    here = ray.get_runtime_context().get_node_id()
    counts = []
    for node in _alive_cpu_nodes():
        cpus = int(node["Resources"]["CPU"])
        counts.append(min(cpus, local_cores()) if node.get("NodeID") == here else cpus)
    return max(1, min(counts, default=local_cores()))


def _alive_cpu_nodes() -> list[dict[str, Any]]:
    """The running Ray cluster's alive nodes with CPUs (a head started with ``--num-cpus=0`` holds no actor)."""
    import ray

    return [node for node in ray.nodes() if node.get("Alive") and node.get("Resources", {}).get("CPU")]


def cpu_node_count() -> int:
    """Alive nodes with CPUs in the running Ray cluster (:func:`_alive_cpu_nodes`); before Ray starts 1: a run's private
    cluster is this machine, whatever ``cluster.num_nodes`` says."""
    import ray

    return max(1, len(_alive_cpu_nodes())) if ray.is_initialized() else 1


def declared_node_cpus(cluster: Any = None) -> int:
    """A node's CPUs as ``nemo-like plan`` takes them, with no cluster reached: for several nodes ``cluster.num_cpus``
    as declared (the nodes are not this machine: a plan of them had changed with the cores of the machine that made
    it), else :func:`node_cpus` before Ray starts (the private cluster on this machine)."""
    declared = getattr(cluster, "num_cpus", None)
    if declared and getattr(cluster, "num_nodes", 1) > 1:
        return declared
    return _private_cluster_cpus(cluster)


def _private_cluster_cpus(cluster: Any) -> int:
    """The CPUs of a private local cluster: ``cluster.num_cpus``, at most this machine's cores."""
    return max(1, min(getattr(cluster, "num_cpus", None) or local_cores(), local_cores()))


def use_threads(num_threads: int) -> None:
    """Run the calls that follow on ``num_threads`` torch threads (a policy worker whose logprob phase shares the node
    with the reference's workers runs it on fewer than its training). Cheap when nothing changes."""
    import torch

    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)


def apply_thread_count(num_threads: int) -> None:
    """Run this process's torch (intra-op OpenMP/MKL) work on ``num_threads`` threads, and say so in
    ``OMP_NUM_THREADS`` for anything it starts later. Called by actors at every (re-)initialisation: a kept actor
    (``reuse_actors``) may serve a run with another split."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    torch.set_num_threads(num_threads)
