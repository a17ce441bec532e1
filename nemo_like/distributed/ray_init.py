"""Start or join Ray."""

from __future__ import annotations

import logging
import os

from nemo_like.config.schema import ClusterConfig
from nemo_like.distributed.ray_env import apply_driver_defaults

log = logging.getLogger(__name__)


def init_ray(cluster: ClusterConfig) -> str:
    """Join the configured cluster (``cluster.ray_address`` or ``$RAY_ADDRESS``) or start a private one.

    Returns ``"joined"`` or ``"local"``. Calling it when Ray is already initialised is a no-op.
    """
    apply_driver_defaults()
    import ray

    if ray.is_initialized():
        return "joined"
    address = cluster.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        log.info("Joined Ray cluster at %s", address)
        return "joined"
    ray.init(
        address="local",
        num_cpus=cluster.num_cpus or os.cpu_count(),
        num_gpus=cluster.gpus_per_node * cluster.num_nodes if cluster.gpus_per_node else 0,
        object_store_memory=cluster.object_store_memory_mb * 1024 * 1024,
        include_dashboard=False,
        log_to_driver=True,
    )
    log.info("Started a private local Ray cluster: %s", ray.cluster_resources())
    return "local"
