"""Driver-side facade over vLLM generation workers (same API as :class:`~nemo_like.models.generation.hf.HFGeneration`).

Refit transports, decided by :func:`~nemo_like.models.refit.transport.refit_transport` (one place, for the refit
and for whether the policy exports anything):

* **object store** (CPU, a sharded policy, LoRA, and GPU when no policy is attached): the policy's weights,
  gathered from its shards bucket by bucket (``policy.refit_buffer_size_mb``) into one object-store copy
  shared by every worker, are loaded into the engine (bucket by bucket on GPU; the CPU in-place loader takes them all
  at once, :mod:`~nemo_like.models.refit.cpu_reload`);
* **CUDA-IPC** (GPU, ``policy.generation.colocated.enabled``, one policy rank): zero-copy handles from policy rank 0;
* **NCCL broadcast** (GPU, generation on its own GPUs, one policy rank): policy rank 0 broadcasts every tensor.

:meth:`VLLMGeneration.refit` takes the exported weights or a zero-argument exporter; only the object-store
transport calls it, so the two GPU transports never gather the weights to CPU.

A colocated engine is pinned to policy rank 0's Ray node and shown its GPU (:func:`colocated_placement`);
right after start its device UUID is checked against the policy's (:func:`check_colocated_device`).

The two GPU paths are untested on GPU in this repository (see docs/guides/generation.md).
The driver never imports vLLM; only the actors do.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import ray

from nemo_like.config.schema import MasterConfig
from nemo_like.distributed.supervision import Replaceable
from nemo_like.distributed.worker_group import (
    RayWorkerGroup,
    RoleResources,
    WorkerFailure,
    WorkerResources,
    get_with_context,
    summed_over_workers,
)
from nemo_like.models.generation.interface import (
    GeneratedSample,
    SamplingParams,
    Seeds,
    ServedWeights,
    WeightSource,
    actor_concurrency,
    generate_on_group,
)
from nemo_like.models.generation.vllm_worker import ENGINE_ENV, VLLMGenerationWorker
from nemo_like.models.loading import actor_model_source, tokenizer_source
from nemo_like.models.refit.transport import RefitTransport, refit_transport
from nemo_like.plan.backend import INSTALL_HINT, VLLM_MIN_TEMPERATURE, require_vllm, vllm_available  # noqa: F401 (importable here)


def engine_env(cfg: MasterConfig) -> dict[str, str]:
    """Environment of the run's vLLM actors (:func:`vllm_actor_env` with the run's GPUs and KV cache size)."""
    return vllm_actor_env(bool(cfg.cluster.gpus_per_node), cfg.policy.generation.vllm_cfg.kv_cache_space_gib)


def vllm_actor_env(on_gpu: bool, kv_cache_space_gib: int) -> dict[str, str]:
    """Environment of a vLLM actor: in-process engine, vLLM's log level (``$VLLM_LOGGING_LEVEL``, default
    ERROR: its INFO lines, and on CPU a harmless "RotaryEmbedding: Failed to load weights" warning at every
    refit, would flood the driver's console), and the KV cache size on CPU."""
    env = {**ENGINE_ENV, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")}
    if not on_gpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_space_gib)
    return env


def is_colocated(cfg: MasterConfig) -> bool:
    """vLLM shares policy rank 0's GPU: a GPU cluster with ``policy.generation.colocated.enabled``."""
    return bool(cfg.cluster.gpus_per_node) and cfg.policy.generation.colocated.enabled


@dataclass(frozen=True)
class ColocatedPlacement:
    """Where a colocated engine runs: pinned to policy rank 0's Ray node, shown its GPU (``env``); ``uuid``
    is that GPU's, which the engine must report back."""

    node_id: str
    node_ip: str
    uuid: str | None
    env: dict[str, str]


def colocated_placement(info: dict[str, Any]) -> ColocatedPlacement:
    """The placement of an engine colocated with the policy rank whose ``device_info()`` is ``info``
    (``{node_id, node_ip, gpu_ids, uuid}``): its node, and its first Ray GPU made visible to a 0-GPU actor
    (Ray would hide every GPU from it)."""
    if not info.get("gpu_ids"):
        raise ValueError(f"cannot colocate vLLM: policy rank 0 on node {info.get('node_ip')} ({info.get('node_id')}) holds no GPU")
    env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": str(info["gpu_ids"][0])}
    return ColocatedPlacement(node_id=info["node_id"], node_ip=info.get("node_ip", "?"), uuid=info.get("uuid"), env=env)


def check_colocated_device(placement: ColocatedPlacement, engine_uuids: list[str]) -> None:
    """Raise, naming both GPUs and the node, when a colocated engine does not run on the policy's GPU (instead of
    a CUDA-IPC failure at the first refit)."""
    where = f"node {placement.node_ip} (Ray node {placement.node_id}), CUDA_VISIBLE_DEVICES={placement.env['CUDA_VISIBLE_DEVICES']}"
    if placement.uuid is None:
        raise RuntimeError(f"cannot colocate vLLM: policy rank 0 on {where} reports no CUDA device")
    wrong = sorted({u for u in engine_uuids if u != placement.uuid})
    if wrong:
        raise RuntimeError(
            f"colocated vLLM engine is not on policy rank 0's GPU: the engine runs on GPU {', '.join(wrong)}, the policy on GPU "
            f"{placement.uuid} ({where}); Ray's GPU ids and the engine's CUDA numbering disagree (check CUDA_DEVICE_ORDER), "
            "or set policy.generation.colocated.enabled=false"
        )


def vllm_generation_resources(cfg: MasterConfig, num_threads: int, num_workers: int = 1) -> RoleResources:
    """vLLM workers: CPUs each, ``num_threads`` threads each (the run plan's split); a GPU of their own on GPU
    clusters, none when colocated (the GPU is the policy's)."""
    pc = cfg.policy
    gpus = 1.0 if cfg.cluster.gpus_per_node and not is_colocated(cfg) else 0.0
    resources = WorkerResources(num_cpus=pc.num_cpus_per_worker, num_gpus=gpus, num_threads=num_threads)
    return RoleResources("generation", num_workers, resources)


class VLLMGeneration:
    """Shards prompts across ``num_workers`` vLLM actors (tensor parallel 1 each)."""

    PER_PROMPT_SEEDS = True  # vLLM seeds every request (generate takes one seed per prompt)
    MIN_TEMPERATURE = VLLM_MIN_TEMPERATURE  # vLLM raises a lower positive temperature to it (a server refuses one)

    def __init__(
        self,
        cfg: MasterConfig,
        pad_token_id: int,
        eos_token_ids: list[int],
        num_threads: int,
        num_workers: int = 1,
        policy: Any = None,
        name: str = "generation",
        refit_mode: str | None = None,
    ) -> None:
        """``num_threads``: threads per worker (the run plan's ``threads.generation``); ``policy`` (the trainable
        :class:`Policy`) enables the GPU refit paths; ``name`` must be unique per Ray cluster; ``refit_mode``: the run
        plan's (``adapter``: the engine serves LoRA adapters; ``None``: the policy's, ``full`` without one)."""
        if refit_mode is None:
            refit_mode = policy.refit_mode if policy is not None else "full"
        require_vllm()
        pc, g = cfg.policy, cfg.policy.generation
        on_gpu = bool(cfg.cluster.gpus_per_node)
        self.colocated = is_colocated(cfg)
        if self.colocated and policy is None:
            raise ValueError("colocated vLLM generation on GPU needs the policy (its rank-0 GPU hosts the engine)")
        self.policy = policy
        self.on_gpu = on_gpu
        self.lora = pc.lora_cfg.enabled  # LoRA refits (adapters or merged weights) go through the object store
        self.serves_adapters = refit_mode == "adapter"
        init = dict(
            model_name=actor_model_source(pc.model_name),
            precision=pc.precision,
            max_model_len=pc.max_total_sequence_length,
            seed=cfg.grpo.seed,
            pad_token_id=pad_token_id,
            eos_token_ids=eos_token_ids,
            enforce_eager=g.vllm_cfg.enforce_eager,
            gpu_memory_utilization=g.vllm_cfg.gpu_memory_utilization,
            colocated=self.colocated,
            lora_cfg=pc.lora_cfg if refit_mode == "adapter" else None,
            tokenizer_name=tokenizer_source(pc),
        )
        env = engine_env(cfg)
        placement = None
        if self.colocated:
            placement = colocated_placement(get_with_context(self.policy.group.run_rank0("device_info"), "generation: colocate"))
            env.update(placement.env)
        resources = vllm_generation_resources(cfg, num_threads, num_workers).resources
        self.group = RayWorkerGroup(
            name,
            VLLMGenerationWorker,
            num_workers,
            resources,
            init,
            cfg.cluster.placement_timeout_s,
            env,
            max_concurrency=actor_concurrency(cfg),
            node_id=placement.node_id if placement is not None else None,
        )
        if placement is not None:
            try:
                check_colocated_device(placement, get_with_context(self.group.run_all("device_uuid"), "generation: colocated device check"))
            except BaseException:
                self.group.kill()
                raise
        self.weight_version = 0
        self._broadcast_manifest: list | None = None
        # A dead worker is replaced in place and loads the weights the others serve (distributed/supervision.py).
        self.served = ServedWeights()
        self.replaceable = Replaceable("generation", self.group, self._prepare_replacement)

    def _prepare_replacement(self, worker: Any) -> None:
        if self.transport != "object_store" and self.weight_version != 0:
            raise WorkerFailure(f"a dead vLLM engine is replaced only with the object-store refit; this run refits over {self.transport}")
        self.served.load_into(worker)

    @property
    def transport(self) -> RefitTransport:
        """How :meth:`refit` reaches the engine (see :func:`~nemo_like.models.refit.transport.refit_transport`)."""
        return refit_transport(self.on_gpu, self.colocated, 0 if self.policy is None else len(self.policy.group), self.lora)

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: Seeds) -> list[GeneratedSample]:
        """One sample per prompt, in prompt order (the driver repeats each prompt G times for a group); ``seed``: the
        batch's, or one per prompt."""
        return generate_on_group(self.group, prompts, params, seed, self.replaceable)

    def refit(self, weights: WeightSource, version: int) -> float:
        """Load the policy's weights (version ``version``) into every worker; returns the seconds spent. ``weights``:
        the exported weights or a zero-argument exporter, called only by the object-store transport (the GPU
        transports read policy rank 0's tensors directly)."""
        start = time.perf_counter()
        transport = self.transport
        if transport == "object_store":
            self.served.refit(self.replaceable, weights, version)
            self.weight_version = version
            return time.perf_counter() - start
        if transport == "cuda_ipc":
            refs = self._refit_ipc(version)
        else:
            refs = self._refit_broadcast(version)
        try:
            versions = get_with_context(refs, "refit")
        finally:  # copied, or failed: the policy's bf16 copy behind the handles goes either way (it was a whole model)
            if transport == "cuda_ipc":
                get_with_context(self.policy.group.run_rank0("release_ipc_tensors"), "refit: release IPC tensors")
        if set(versions) != {version}:
            raise RuntimeError(f"refit delivered weight versions {versions}, expected {version}")
        self.weight_version = version
        return time.perf_counter() - start

    def _refit_ipc(self, version: int) -> list[ray.ObjectRef]:
        """Colocated GPU (untested on GPU here): CUDA-IPC handles of policy rank 0's tensors."""
        names, handles = get_with_context(self.policy.group.run_rank0("ipc_handles"), "refit: IPC handles")
        return self.group.run_all("update_weights_from_ipc", handles, names, version)

    def _refit_broadcast(self, version: int) -> list[ray.ObjectRef]:
        """Separate GPUs (untested on GPU here): NCCL broadcast from policy rank 0 to every vLLM worker."""
        if self._broadcast_manifest is None:
            address, port = get_with_context(self.policy.group.run_rank0("rendezvous_address"), "refit: rendezvous")
            world = 1 + len(self.group)
            joins = [self.policy.group.run_rank0("init_weight_broadcast_group", address, port, world)]
            joins += self.group.run_all("init_weight_update_group", address, port, world)
            get_with_context(joins, "refit: NCCL group")
            self._broadcast_manifest = get_with_context(self.policy.group.run_rank0("weight_manifest"), "refit: manifest")
        receivers = self.group.run_all("update_weights_from_broadcast", self._broadcast_manifest, version)
        sender = self.policy.group.run_rank0("broadcast_weights")
        get_with_context(sender, "refit: broadcast")
        return receivers

    def weight_names(self) -> list[str]:
        """The tensor names a refit must deliver."""
        return get_with_context(self.group.run_rank0("weight_names"), "generation: weight names")

    def mid_generation_updates(self) -> int:
        """Refits applied in the middle of a generate call, summed over the workers (in-flight weight updates)."""
        return summed_over_workers(self.group.workers, "mid_generation_updates", "generation: counters")

    def mid_generation_seconds(self) -> float:
        """Seconds the workers' generate calls spent loading those refits, summed over the workers."""
        return summed_over_workers(self.group.workers, "mid_generation_seconds", "generation: counters")

    def wait_ready(self) -> None:
        """Wait until every engine actor is built (its start-up never counts against a call's deadline). An engine whose
        constructor raised for the model (vLLM does not build it here: an architecture its CPU build cannot import, a LoRA
        its Mamba models refuse) says which key samples it with transformers instead, and with adapters, which key sends
        merged weights."""
        try:
            self.group.wait_started()
        except WorkerFailure as exc:
            if "its constructor raised" not in str(exc) or "memory" in str(exc):  # a death, or a budget the keys it names fix
                raise
            hint = "; if vLLM does not build this model here, policy.generation.backend=hf samples it with transformers"
            if self.serves_adapters:  # a class the plan does not know takes no adapters (VLLM_ADAPTERLESS_ARCHITECTURES)
                hint += "; if vLLM's class for it takes no LoRA adapters, policy.lora_cfg.refit=merged serves it merged weights"
            raise WorkerFailure(f"{exc}{hint}", exc.role, exc.actor_id) from exc

    def shutdown(self) -> None:
        """Release the actors."""
        self.group.shutdown()
