"""Which transport a refit takes: decided here, in one place, for the refit and for whether the policy exports.

* :func:`refit_transport` (vLLM): the object store, CUDA-IPC handles or an NCCL broadcast;
* :func:`shared_memory_refit_possible` (the policy, full-weight refits on CPU): a ``/dev/shm`` buffer
  instead of the object store.

Both are pure functions of what the caller knows (the caller queries Ray or the engine).
"""

from __future__ import annotations

from typing import Literal

RefitTransport = Literal["object_store", "cuda_ipc", "nccl"]


def refit_transport(on_gpu: bool, colocated: bool, policy_ranks: int, lora: bool) -> RefitTransport:
    """How a refit reaches the engine. ``policy_ranks``: workers of the attached policy (0: none attached).

    The object store (the policy's exported buckets) on CPU, without a policy, with several policy ranks (no
    rank holds every tensor) and with LoRA (adapters or merged weights); on GPU with one policy rank CUDA-IPC
    handles when colocated, else an NCCL broadcast. Only ``"object_store"`` uses an export."""
    if not on_gpu or policy_ranks != 1 or lora:
        return "object_store"
    return "cuda_ipc" if colocated else "nccl"


def shared_memory_refit_possible(gpus_per_node: int, shared_memory: bool, alive_nodes: int) -> bool:
    """Refit through ``/dev/shm`` (:mod:`nemo_like.models.refit.shared_memory`): a CPU cluster of one node, so the
    policy and every generation worker share its memory. ``shared_memory``: ``/dev/shm`` is writable here
    (:func:`~nemo_like.models.refit.shared_memory.shared_memory_available`); ``alive_nodes``: Ray's live nodes."""
    if gpus_per_node or not shared_memory:
        return False
    return alive_nodes == 1
