"""The policy worker: one Ray actor per rank, built from a :class:`~nemo_like.models.policy.spec.PolicyWorkerSpec`.

Ranks of a group shard the model with FSDP2 (:mod:`.sharding`); micro-batches are fixed, token-budget
or packed (:mod:`.batching`). A reference worker is the same class with ``trainable=False``: frozen
initial weights, logprobs only.

The class is assembled from one mixin per job; this module builds the model and joins the process group:

- :mod:`.forward`: logprob passes (and inline sampling with the worker's own weights), and with the KL loss term to a
  teacher (``spec.teacher_kl``) the frozen teacher copy's forward beside the training forward;
- :mod:`.training`: the optimizer, ``train`` and ``release_memory``;
- :mod:`.weight_export`: what a refit sends and how (object store, shared memory, CUDA IPC, NCCL);
- :mod:`.checkpoints`: ``save_checkpoint`` / ``load_checkpoint``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from nemo_like.distributed.reinit import Reinitializable
from nemo_like.distributed.threads import apply_thread_count
from nemo_like.models import lora as lora_lib
from nemo_like.models import precision as precision_lib
from nemo_like.models import shared_prefix
from nemo_like.models.dropout import disable_dropout
from nemo_like.models.loading import load_causal_lm
from nemo_like.models.logprobs import SamplingDistribution
from nemo_like.models.policy import sharding
from nemo_like.models.policy.checkpoints import Checkpoints
from nemo_like.models.policy.forward import INLINE_GENERATION_BATCH, Batch, ForwardPasses
from nemo_like.models.policy.spec import PolicyWorkerSpec
from nemo_like.models.policy.training import TrainingStep, local_bytes
from nemo_like.models.policy.weight_export import WeightExport
from nemo_like.utils.seeds import worker_seed
from nemo_like.utils.text_path import freeze_outside_text_path

__all__ = ["INLINE_GENERATION_BATCH", "Batch", "PolicyWorker", "PolicyWorkerSpec"]


class PolicyWorker(ForwardPasses, TrainingStep, WeightExport, Checkpoints, Reinitializable):
    """One rank of the policy (or reference); with ``world_size > 1`` the model is sharded across the group
    once :meth:`setup_distributed` ran."""

    SETS_THREADS_ON_INIT = True  # a kept actor takes the next run's thread count (worker_group.Reinitializable)

    def __init__(self, rank: int, world_size: int, spec: PolicyWorkerSpec | None = None, **kwargs: Any) -> None:
        """Build rank ``rank`` of ``world_size`` from ``spec``, or (in-process callers) from the keywords of
        :meth:`PolicyWorkerSpec.from_kwargs`, which builds the spec."""
        if spec is None:
            spec = PolicyWorkerSpec.from_kwargs(**kwargs)
        elif kwargs:
            raise TypeError(f"PolicyWorker takes a spec or its keywords, not both: {sorted(kwargs)}")
        apply_thread_count(spec.num_threads)
        torch.manual_seed(spec.seed)
        self.release_shared_weights()  # a reused actor (reinit) drops its previous run's refit buffer
        self.spec = spec
        self.rank, self.world_size = rank, world_size
        # Every pass (prev, reference, training) scores tokens under the sampler's processed
        # distribution: temperature, then top-k / top-p truncation, renormalised (models/logprobs.py).
        self.sampling = SamplingDistribution(spec.temperature, spec.top_k, spec.top_p)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.tp_size = spec.sharding.tensor_parallel_size
        if world_size % self.tp_size:
            raise ValueError(f"{world_size} workers cannot form groups of tensor_parallel_size={self.tp_size}")
        self.dp_size = world_size // self.tp_size
        if spec.teacher_kl is not None and self.tp_size > 1:
            raise ValueError("the teacher KL term (distillation.kl_weight>0) does not support tensor_parallel_size>1 yet")
        self.precision = spec.precision
        self.lora_cfg = spec.lora
        self.trainable = spec.trainable
        self.model = self._load_model()
        # The model and its adapters are built from the one seed, the same on every rank; then each data-parallel rank
        # draws its own training randomness (dropout: LoRA's, a model's own), the ranks of a tensor-parallel group,
        # which see the same rows, one stream. Seeded alike, every rank's k-th micro-batch drew the same masks. (The first
        # data-parallel rank goes on with the stream it has: a one-rank run draws what it drew.)
        if rank // self.tp_size:
            torch.manual_seed(worker_seed(spec.seed, rank // self.tp_size))
        self.teacher_kl = spec.teacher_kl
        self.teacher_model = self._load_teacher() if spec.teacher_kl is not None else None
        self.plan = spec.batching
        self.chunk_size = spec.logprob_chunk_size
        self.shared_forward = self._choose_forward(spec.shared_prompt_forward)
        self.max_grad_norm = spec.max_grad_norm
        self.weight_version = 0
        self.forward_passes = {"logprobs": 0, "train": 0, "reference_logprobs": 0}
        if self.trainable:
            self.loss_fn = spec.loss_fn
        else:
            self.model.requires_grad_(False)
        self._dist_ready = world_size == 1
        if self._dist_ready:
            self._build_optimizer()

    def _load_model(self) -> Any:
        """The model on this worker's device: fp32 master weights, activation checkpointing and LoRA adapters as the
        spec asks."""
        spec = self.spec
        # Master weights: fp32 whatever the compute precision (models/precision.py). A LoRA base never trains, so it
        # stays in the compute dtype (the adapters PEFT adds to it are fp32).
        weights_dtype = "float32" if self.lora_cfg is None else spec.precision
        model = load_causal_lm(spec.model_name, weights_dtype).to(self.device)
        freeze_outside_text_path(model)  # a multimodal model's towers: a text run never reaches them
        self.dropout_rates = disable_dropout(model) if spec.trainable else []  # before LoRA (PEFT's is the recipe's)
        if self.dropout_rates and self.rank == 0:
            rates = ", ".join(map(str, self.dropout_rates))
            print(
                f"[policy] the model's own dropout is off for training ({rates}): generation samples without it",
                file=sys.stderr,
                flush=True,
            )
        if spec.sharding.activation_checkpointing and spec.trainable:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora_cfg is not None:
            torch.manual_seed(spec.seed)  # the same adapters on every rank (and in every run with this seed)
            model = lora_lib.apply_lora(model, self.lora_cfg)
        return model

    def _load_teacher(self) -> Any:
        """The KL term's frozen teacher copy (fp32 weights, as a teacher's own workers load it; computed in
        ``teacher_kl.precision``), in eval mode, no gradients."""
        teacher = load_causal_lm(self.spec.teacher_kl.model_name, "float32").to(self.device)
        teacher.requires_grad_(False)
        return teacher.eval()

    def _choose_forward(self, setting: str | bool) -> bool:
        """Whether logprobs and training run :func:`~nemo_like.models.shared_prefix.shared_prefix_token_logprobs`
        (each group's prompt computed once, no padding) instead of the model's own forward. ``auto``: where it applies,
        on CPU (on GPU it is untested; ``true`` turns it on there); ``true`` where it does not apply is an error."""
        if setting is False:
            self.forward_description = "the model's own (policy.shared_prompt_forward=false)"
            return False
        reasons = shared_prefix.blockers(
            self.model,
            self.world_size,
            self.lora_cfg is not None,
            self.spec.sharding.activation_checkpointing,
            self.trainable,
        )
        if self.teacher_model is not None:
            reasons.append("the teacher KL term (distillation.kl_weight>0) needs the student's logits at every position")
        if setting is True and reasons:
            raise ValueError(f"policy.shared_prompt_forward=true cannot apply: {'; '.join(reasons)} (use auto or false)")
        if not reasons and setting is not True and self.device.type != "cpu":
            reasons = ["auto keeps it off on GPU, where it is untested (policy.shared_prompt_forward=true turns it on)"]
        self.forward_description = (
            f"the model's own ({'; '.join(reasons)})"
            if reasons
            else f"shared-prompt: each group's prompt once, no padding (policy.shared_prompt_forward={setting})"
        )
        return not reasons

    def describe_forward(self) -> str:
        """How this worker's logprob and training passes run, and why (the run's ``[plan]`` lines)."""
        return self.forward_description

    # -- distributed -------------------------------------------------------------------------
    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0's reachable address and a free port for the process group."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup_distributed(self, address: str, port: int) -> None:
        """Join the process group (gloo on CPU; NCCL for CUDA tensors and gloo for CPU ones on GPU, see
        :func:`~nemo_like.models.precision.process_group_backend`) and shard the model over it (FSDP2, bf16 compute
        over fp32 shards when ``precision`` is bfloat16)."""
        import torch.distributed as dist

        backend = precision_lib.process_group_backend(self.device.type)
        if dist.is_initialized():  # a re-initialised actor (reuse_actors) joins its new group
            dist.destroy_process_group()
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=self.rank, world_size=self.world_size)
        mesh = sharding.build_mesh(self.dp_size, self.tp_size, self.device.type)
        sharding.shard_model(
            self.model,
            mesh,
            cpu_offload=self.spec.sharding.cpu_offload,
            mp_policy=precision_lib.fsdp_mixed_precision(self.precision),
        )
        if self.teacher_model is not None:  # the KL term's teacher copy, sharded like the policy
            sharding.shard_model(
                self.teacher_model,
                mesh,
                cpu_offload=self.spec.sharding.cpu_offload,
                mp_policy=precision_lib.fsdp_mixed_precision(self.teacher_kl.precision),
            )
        self._build_optimizer()
        self._dist_ready = True

    # -- introspection -----------------------------------------------------------------------
    def parameter_checksum(self) -> float:
        """Sum of all parameters of the full model (a collective when sharded: each DTensor's sum is reduced over its
        own mesh by its placements, so a parameter whole on every tensor-parallel rank counts once, not once a rank)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # NCCL serves only device tensors
        for p in self.model.parameters():
            local_sum = p.detach().double().sum()
            total += (local_sum.full_tensor() if hasattr(local_sum, "full_tensor") else local_sum).to(self.device)
        return float(total)

    def memory_footprint(self) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients and optimizer state (its shards only)."""

        params = sum(local_bytes(p) for p in self.model.parameters())
        grads = sum(local_bytes(p.grad) for p in self.model.parameters() if p.grad is not None)
        optim = 0
        if self.trainable:
            for st in self.optimizer.state.values():
                optim += sum(local_bytes(v) for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
        return {"params": params, "grads": grads, "optimizer": optim}

    def parameter_counts(self) -> dict[str, int]:
        """Trainable and total parameters of the full model (see :func:`.lora.parameter_counts`)."""
        return lora_lib.parameter_counts(self.model)

    def get_forward_pass_counts(self) -> dict[str, int]:
        """Forward passes run by this worker so far, by kind."""
        return dict(self.forward_passes)
