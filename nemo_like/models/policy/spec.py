"""Everything a policy (or reference) worker is built from: one frozen, picklable :class:`PolicyWorkerSpec`.

The driver builds it once from the run's config (:meth:`PolicyWorkerSpec.from_config`) and every rank gets the same
spec (``RayWorkerGroup`` passes it as the ``spec`` keyword, to ``__init__`` and to ``reinit`` of a kept actor).
In-process callers (tests, benchmarks) may build it from keywords instead (:meth:`PolicyWorkerSpec.from_kwargs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nemo_like.models.loading import actor_model_source
from nemo_like.models.policy.batching import MicroBatchPlan
from nemo_like.models.policy.loss_protocol import LossFunction
from nemo_like.models.teacher_kl import KLTerm

if TYPE_CHECKING:
    from nemo_like.config.schema import LoraConfig, MasterConfig, OptimizerConfig


@dataclass(frozen=True)
class ShardingSettings:
    """The ``policy.dtensor_cfg`` keys the worker uses (FSDP2 / tensor parallelism, see :mod:`.sharding`)."""

    enabled: bool = True
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class TeacherKLSettings:
    """The token-level KL loss term to a teacher (``distillation.kl_*``): a frozen copy of ``model_name`` loaded in every
    policy worker (sharded like the policy), run on each training micro-batch; the loss gains ``weight x`` the global
    token mean of :func:`~nemo_like.models.teacher_kl.token_kl` under ``term``."""

    model_name: str
    precision: str
    weight: float
    term: KLTerm


@dataclass(frozen=True)
class PolicyWorkerSpec:
    """One rank's build instructions; ``rank`` and ``world_size`` come separately (they differ per actor).

    ``trainable=False``: a reference worker (frozen initial weights, logprobs only; needs no loss or optimizer).
    ``loss_fn``: the run's loss, built once by the driver; ``optimizer``: the validated ``policy.optimizer`` section;
    ``lora``: the ``policy.lora_cfg`` section when enabled, else ``None`` (only adapters train, see :mod:`.lora`);
    ``shared_prompt_forward``: ``policy.shared_prompt_forward`` (``"auto"``, ``True`` or ``False``); ``teacher_kl``: the
    KL loss term to a teacher (``None``: off, no teacher copy)."""

    model_name: str
    precision: str
    temperature: float
    num_threads: int
    seed: int
    trainable: bool = True
    loss_fn: LossFunction | None = None
    optimizer: OptimizerConfig | None = None
    warmup_steps: int = 0
    max_grad_norm: float | None = None
    batching: MicroBatchPlan = field(default_factory=MicroBatchPlan)
    sharding: ShardingSettings = field(default_factory=ShardingSettings)
    logprob_chunk_size: int | None = None
    top_k: int | None = None
    top_p: float = 1.0
    lora: LoraConfig | None = None
    shared_prompt_forward: str | bool = "auto"
    teacher_kl: TeacherKLSettings | None = None
    logprob_threads: int | None = None  # threads of the logprob passes when fewer than num_threads (training, sampling)

    def __post_init__(self) -> None:
        if self.trainable and (self.loss_fn is None or self.optimizer is None):
            raise ValueError("a trainable PolicyWorker needs the run's loss_fn and optimizer config")
        if self.teacher_kl is not None and not self.trainable:
            raise ValueError("the teacher KL term is a training loss: a frozen worker takes no teacher_kl")

    @classmethod
    def from_kwargs(
        cls,
        *,
        train_micro_batch_size: int = 1,
        logprob_batch_size: int = 64,
        dtensor_cfg: dict[str, Any] | None = None,
        batching: dict[str, Any] | None = None,
        lora_cfg: Any = None,
        **fields: Any,
    ) -> PolicyWorkerSpec:
        """The spec from ``PolicyWorker``'s keyword arguments: the :class:`PolicyWorkerSpec` fields, and in place of
        ``batching`` / ``sharding`` / ``lora`` the dict-typed sections of the config: ``batching`` (the
        :class:`MicroBatchPlan` fields; default: fixed micro-batches of ``train_micro_batch_size`` /
        ``logprob_batch_size`` samples), ``dtensor_cfg`` (``policy.dtensor_cfg`` keys) and ``lora_cfg`` (any
        ``policy.lora_cfg``: a disabled one means no LoRA)."""
        plan = batching or {"mode": "fixed", "train_size": train_micro_batch_size, "logprob_size": logprob_batch_size}
        return cls(
            batching=MicroBatchPlan(**plan),
            sharding=ShardingSettings(**(dtensor_cfg or {})),
            lora=lora_cfg if lora_cfg is not None and lora_cfg.enabled else None,
            **fields,
        )

    @classmethod
    def from_config(
        cls, cfg: MasterConfig, trainable: bool, loss_fn: LossFunction | None, num_threads: int, logprob_threads: int | None = None
    ) -> PolicyWorkerSpec:
        """The policy's (``trainable``) or the reference's workers of run config ``cfg``; ``logprob_threads``: the
        thread split's count for the logprob phase, when it differs from ``num_threads``."""
        pc = cfg.policy
        micro = min(pc.train_micro_batch_size, pc.rank_step_samples)
        return cls.from_kwargs(
            model_name=actor_model_source(pc.model_name),
            precision=pc.precision,
            temperature=pc.generation.temperature,
            top_k=pc.generation.top_k,
            top_p=pc.generation.top_p,
            num_threads=num_threads,
            logprob_threads=logprob_threads,
            seed=cfg.grpo.seed,
            trainable=trainable,
            loss_fn=loss_fn,
            optimizer=pc.optimizer,
            warmup_steps=pc.scheduler.warmup_steps,
            max_grad_norm=pc.max_grad_norm,
            dtensor_cfg=pc.dtensor_cfg.model_dump(),
            batching=batching_plan(pc, micro),
            logprob_chunk_size=pc.logprob_chunk_size,
            lora_cfg=pc.lora_cfg if trainable else None,
            shared_prompt_forward=pc.shared_prompt_forward,
            teacher_kl=teacher_kl_settings(cfg) if trainable else None,
        )


def teacher_kl_settings(cfg: MasterConfig) -> TeacherKLSettings | None:
    """The KL term of run config ``cfg`` (``None`` with ``distillation.kl_weight=0``)."""
    d, t = cfg.distillation, cfg.teacher
    if d.kl_weight == 0 or t.model_name is None:
        return None
    term = KLTerm(d.kl_direction, d.kl_support, d.kl_top_k if d.kl_support != "full" else None)
    return TeacherKLSettings(actor_model_source(t.model_name), t.precision or cfg.policy.precision, float(d.kl_weight), term)


def batching_plan(pc: Any, micro_batch_size: int) -> dict[str, Any]:
    """The :class:`~nemo_like.models.policy.batching.MicroBatchPlan` fields of ``policy`` config ``pc``."""
    if pc.sequence_packing.enabled:
        return {"mode": "packed", "train_size": pc.sequence_packing.train_mb_tokens, "logprob_size": pc.sequence_packing.logprob_mb_tokens}
    if pc.dynamic_batching.enabled:
        return {
            "mode": "token_budget",
            "train_size": pc.dynamic_batching.train_mb_tokens,
            "logprob_size": pc.dynamic_batching.logprob_mb_tokens,
        }
    return {"mode": "fixed", "train_size": micro_batch_size, "logprob_size": pc.logprob_batch_size}
