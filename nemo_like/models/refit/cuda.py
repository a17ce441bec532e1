"""GPU weight refit for the vLLM backend: CUDA-IPC handles (colocated) and an NCCL broadcast (separate GPUs).

UNTESTED ON GPU in this repository: no accelerator was available when it was written. The module
imports cleanly on CPU (vLLM and CUDA are only touched inside the functions), and the CPU refit
path (object store + ``reload_weights``, see :mod:`nemo_like.models.generation.vllm_worker`) is
the one exercised by the tests.

Two halves:

* :class:`VllmRefitExtension` is a vLLM *worker extension* (``LLM(worker_extension_cls=...)``):
  its methods are mixed into every vLLM GPU worker and called with ``llm.collective_rpc(name, ...)``.
* the ``policy_*`` functions run inside the training (policy) worker that owns the new weights;
  ``PolicyWorker`` exposes them as actor methods (``ipc_handles``, ``init_weight_broadcast_group``,
  ``broadcast_weights``, ``weight_manifest``).

Colocated (policy and vLLM on the same GPU): the policy exports one CUDA-IPC handle per tensor
(``torch.multiprocessing.reductions.reduce_tensor``), keyed by the GPU's UUID; the vLLM worker
rebuilds zero-copy views on its own device index and reloads them. Separate GPUs: policy rank 0
(rank 0) and each vLLM worker (ranks 1..N) form a stateless NCCL group (vLLM's
``StatelessProcessGroup`` + ``PyNcclCommunicator``); rank 0 broadcasts every tensor in manifest
order and the vLLM workers reload them.
"""

from __future__ import annotations

from typing import Any

import torch

# (name, dtype name, shape) per tensor, in broadcast order.
Manifest = list[tuple[str, str, tuple[int, ...]]]
IpcHandles = dict[str, dict[str, tuple[Any, tuple]]]

EXTENSION_QUALNAME = "nemo_like.models.refit.cuda.VllmRefitExtension"
_DEVICE_ARG = 6  # position of the device index in torch's rebuild_cuda_tensor arguments


def device_uuid(index: int | None = None) -> str:
    """UUID of a CUDA device (the current one by default): the same GPU has the same UUID in every process."""
    index = torch.cuda.current_device() if index is None else index
    return str(torch.cuda.get_device_properties(index).uuid)


def build_manifest(state: dict[str, torch.Tensor]) -> Manifest:
    """``(name, dtype, shape)`` of every tensor, in the order they are sent."""
    return [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in state.items()]


def stateless_nccl_group(address: str, port: int, rank: int, world_size: int, device: torch.device | int):
    """An NCCL communicator over ``world_size`` processes that leaves torch.distributed's global group alone."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(host=address, port=port, rank=rank, world_size=world_size)
    return PyNcclCommunicator(group, device=device)


# -- policy side ---------------------------------------------------------------------------------
def policy_ipc_handles(state: dict[str, torch.Tensor]) -> IpcHandles:
    """``{device_uuid: {name: ipc_handle}}`` for CUDA tensors; keep ``state`` alive until the consumer is done."""
    from torch.multiprocessing.reductions import reduce_tensor

    return {device_uuid(): {name: reduce_tensor(t.detach().contiguous()) for name, t in state.items()}}


def policy_broadcast(group, state: dict[str, torch.Tensor]) -> int:
    """Send every tensor of ``state`` from rank 0 of ``group`` (call concurrently with the receivers)."""
    stream = torch.cuda.current_stream()
    for tensor in state.values():
        group.broadcast(tensor.detach().contiguous(), src=0, stream=stream)
    stream.synchronize()
    return len(state)


# -- vLLM side -----------------------------------------------------------------------------------
class VllmRefitExtension:
    """Mixed into vLLM's GPU worker (``self.device``, ``self.model_config``, ``self.model_runner`` and
    ``self.reload_weights`` come from it)."""

    def report_device_uuid(self) -> str:
        """UUID of the GPU this vLLM worker runs on."""
        return device_uuid(self.device.index)

    def update_weights_from_ipc_handles(self, handles: IpcHandles) -> int:
        """Rebuild the policy's tensors from CUDA-IPC handles of this GPU and reload them in place."""
        uuid = device_uuid(self.device.index)
        if uuid not in handles:
            raise RuntimeError(f"no IPC handles for GPU {uuid}: the policy exported handles for {sorted(handles)} (not colocated?)")
        weights = []
        for name, (rebuild, args) in handles[uuid].items():
            args = list(args)
            args[_DEVICE_ARG] = self.device.index  # the sender numbers devices by its own CUDA_VISIBLE_DEVICES
            weights.append((name, rebuild(*args)))
        self.reload_weights(weights_iterator=self._as_checkpoint(weights))
        torch.cuda.synchronize()
        return len(weights)

    def _as_checkpoint(self, weights: list[tuple[str, torch.Tensor]]) -> Any:
        """The policy's tensors as the model's checkpoint holds them, which vLLM's loader reads (a mixture of experts'
        experts unfused: :mod:`nemo_like.models.refit.checkpoint_format`)."""
        from nemo_like.models.refit.checkpoint_format import checkpoint_tensors, skeleton

        return checkpoint_tensors(skeleton(self.model_config.model), weights)

    def init_weight_update_group(self, address: str, port: int, rank: int, world_size: int) -> None:
        """Join the NCCL group in which policy rank 0 (rank 0) broadcasts the weights."""
        self._nemo_like_update_group = stateless_nccl_group(address, port, rank, world_size, self.device)

    def update_weight_from_broadcast(self, manifest: Manifest) -> int:
        """Receive every tensor of ``manifest`` from rank 0 and reload them in place."""
        group = self._nemo_like_update_group
        stream = torch.cuda.current_stream()
        weights = []
        for name, dtype, shape in manifest:
            buffer = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            group.broadcast(buffer, src=0, stream=stream)
            weights.append((name, buffer))
        stream.synchronize()
        self.reload_weights(weights_iterator=self._as_checkpoint(weights))
        return len(weights)
