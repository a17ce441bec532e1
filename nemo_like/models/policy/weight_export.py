"""The policy worker's weight export for refits: object-store buckets, the shared-memory buffer (one-node CPU
clusters), and on GPU the CUDA-IPC handles and the NCCL broadcast into vLLM (untested on GPU in this repository;
see :mod:`nemo_like.models.refit.cuda`).

A mixin of :class:`~nemo_like.models.policy.worker.PolicyWorker`. Ray and the GPU helpers are imported inside the
methods: the worker module imports without Ray (the GPU checks of ``tests/gpu`` import it bare).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from nemo_like.models import lora as lora_lib
from nemo_like.models import precision as precision_lib
from nemo_like.models.policy import sharding


class WeightExport:
    """What a refit sends (full, LoRA-merged or adapter weights, in the engine's dtype) and the ways it travels."""

    model: Any
    device: torch.device
    precision: str
    lora_cfg: Any
    rank: int
    weight_version: int

    def get_state_dict(self, mode: str = "full") -> tuple[int, dict[str, torch.Tensor]]:
        """``(weight_version, full CPU state dict with tied weights)``: the whole model on rank 0, ``{}`` on the
        others (a collective: call it on every rank); ``mode`` as in :meth:`export_weight_buckets` (a LoRA policy's
        ``full`` is its PEFT state dict). Refit uses :meth:`export_weight_buckets` instead."""
        keep = self.rank == 0
        tensors = sharding.iter_full_tensors(self.model, keep) if mode == "full" else self._refit_tensors(mode, keep)
        state = dict(tensors)
        return self.weight_version, state if keep else {}

    def export_weight_buckets(self, bucket_mb: float, mode: str = "full") -> Any:
        """Gather the weights bucket by bucket (at most ``bucket_mb`` MB each) into Ray's object store;
        ``mode`` (see :func:`.lora.refit_mode`): ``full``, ``merged`` or ``adapter``.

        A collective: every rank gathers each bucket, only rank 0 keeps it (one bucket at a time:
        ``ray.put`` moves it out of this process). Rank 0 returns a
        :class:`~nemo_like.models.refit.buckets.WeightBuckets`; the other ranks ``None``."""
        import ray

        from nemo_like.models.refit.buckets import WeightBuckets

        keep = self.rank == 0
        names: list[list[str]] = []
        refs: list[Any] = []
        nbytes = 0
        for bucket in sharding.bucketize(self._refit_tensors(mode, keep), int(bucket_mb * 2**20)):
            if keep:
                names.append(list(bucket))
                nbytes += distinct_bytes(bucket.values())  # a tied weight travels once per bucket (pickled once)
                refs.append(ray.put(bucket))
                del bucket
        if not keep:
            return None
        adapter_config = lora_lib.adapter_config_dict(self.model) if mode == "adapter" else None
        return WeightBuckets(
            self.weight_version, names, refs, kind="adapter" if mode == "adapter" else "full", nbytes=nbytes, adapter_config=adapter_config
        )

    def _refit_tensors(self, mode: str, keep: bool):
        """What a refit sends: every weight (``full``), the merged weights under HF names (``merged``), or only the
        adapter tensors under PEFT's saved names (``adapter``)."""
        if self.lora_cfg is None:
            if mode != "full":
                raise ValueError(f"refit mode {mode!r} needs policy.lora_cfg.enabled")
            return self._in_engine_dtype(sharding.iter_full_tensors(self.model, keep))
        if mode == "adapter":  # adapters travel in fp32, as PEFT keeps them (the engine applies them in its dtype)
            tensors = sharding.iter_full_tensors(self.model, keep, include=lora_lib.is_adapter)
            return ((lora_lib.saved_name(n), t) for n, t in tensors)
        if mode == "merged":
            merged = lora_lib.merged_tensors(sharding.iter_full_tensors(self.model, keep), lora_lib.scaling(self.lora_cfg))
            return self._in_engine_dtype(merged)
        raise ValueError(f"a LoRA policy refits 'adapter' or 'merged' weights, not {mode!r}")

    def _in_engine_dtype(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The master weights cast to the dtype the generation engine holds (bf16 when ``precision`` is bfloat16)."""
        return cast_once(tensors, precision_lib.refit_dtype(self.precision))

    # -- shared-memory refit (one-node CPU clusters) ------------------------------------------
    def export_shared_weights(self, fresh: bool) -> Any:
        """Write the weights into this rank's shared-memory refit buffer (one-node CPU clusters, see
        :mod:`nemo_like.models.refit.shared_memory`); a new buffer file when ``fresh``. A collective when sharded:
        every rank gathers, rank 0 writes and returns the :class:`SharedWeights` (a :class:`SharedMemoryRefused` when
        ``/dev/shm`` has no room for them), the others ``None``."""
        from nemo_like.models.refit.shared_memory import SharedMemoryFull, SharedMemoryRefused, SharedWeightWriter

        if sharding.is_sharded(self.model):
            tensors = sharding.iter_full_tensors(self.model, keep=self.rank == 0)
        else:  # the parameters themselves: one copy, straight into the buffer
            tensors = self._named_state()
        tensors = list(self._in_engine_dtype(tensors))
        if self.rank != 0:
            return None
        if getattr(self, "_shared_writer", None) is None:
            self._shared_writer = SharedWeightWriter()
        try:
            return self._shared_writer.write(self.weight_version, tensors, fresh=fresh)
        except SharedMemoryFull as exc:
            self._shared_writer.close()
            return SharedMemoryRefused(str(exc))

    def release_shared_weights(self) -> None:
        """Unlink the shared-memory refit buffer (the run is over)."""
        if getattr(self, "_shared_writer", None) is not None:
            self._shared_writer.close()

    # -- GPU weight refit into vLLM (untested on GPU in this repository; see refit/cuda.py) ---------
    def device_info(self) -> dict[str, Any]:
        """This worker's Ray node id and address, Ray GPU ids and CUDA device UUID (None on CPU)."""
        import ray

        from nemo_like.models.refit.cuda import device_uuid

        on_gpu = self.device.type == "cuda"
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "gpu_ids": ray.get_gpu_ids(),
            "uuid": device_uuid() if on_gpu else None,
        }

    def ipc_handles(self) -> tuple[list[str], dict[str, Any]]:
        """``(names, {device_uuid: {name: CUDA-IPC handle}})`` of every tensor; the tensors (a bf16 copy when the
        master weights are fp32) stay referenced until :meth:`release_ipc_tensors` once the engine has copied them."""
        from nemo_like.models.refit.cuda import policy_ipc_handles

        self._ipc_tensors = self._engine_state()
        return list(self._ipc_tensors), policy_ipc_handles(self._ipc_tensors)

    def release_ipc_tensors(self) -> None:
        """Drop the tensors behind the last IPC handles (the engine has reloaded them into its own memory), so a
        bf16 copy of the weights does not sit on the GPU through generation."""
        self._ipc_tensors = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _engine_state(self) -> dict[str, torch.Tensor]:
        """Every state-dict tensor in the engine's dtype (the parameters themselves when the dtypes agree)."""
        return dict(self._in_engine_dtype(self._named_state()))

    def _named_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of the unsharded model's state dict, detached once per tensor: a tied weight (the
        embedding and the LM head) is one tensor under both names, so :func:`cast_once` casts it, and the transports
        write and count it, once (a detach per name made two tensor objects of it, which ``id()`` told apart)."""
        detached: dict[int, torch.Tensor] = {}
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            yield name, detached.setdefault(id(tensor), tensor.detach())

    def weight_manifest(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """``(name, dtype, shape)`` of every tensor :meth:`broadcast_weights` sends, in order."""
        from nemo_like.models.refit.cuda import build_manifest

        return build_manifest(self._engine_state())

    def init_weight_broadcast_group(self, address: str, port: int, world_size: int) -> None:
        """Create the NCCL group (this worker is rank 0) used to broadcast weights to vLLM workers."""
        from nemo_like.models.refit.cuda import stateless_nccl_group

        self._weight_group = stateless_nccl_group(address, port, 0, world_size, self.device)

    def broadcast_weights(self) -> int:
        """Broadcast every tensor of :meth:`weight_manifest` to the vLLM workers; returns the count."""
        from nemo_like.models.refit.cuda import policy_broadcast

        return policy_broadcast(self._weight_group, self._engine_state())


def cast_once(tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` cast to ``dtype``; a tensor that comes again under another name (tied weights: the embedding and the
    LM head) is cast once and stays one tensor, so it is sent and counted once. A cast is kept only while its source
    lives (the streamed export holds a tied tensor until its last name), so the export stays bucket by bucket."""
    casts: dict[int, torch.Tensor] = {}
    for name, tensor in tensors:
        cast = casts.get(id(tensor))
        if cast is None:
            cast = tensor.to(dtype)
            if cast is not tensor:
                casts[id(tensor)] = cast
                weakref.finalize(tensor, casts.pop, id(tensor), None)
        yield name, cast


def distinct_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors``, a tensor listed twice (tied weights under two names) counted once."""
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())
