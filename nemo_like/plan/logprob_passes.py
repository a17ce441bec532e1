"""The one decision of which logprob passes a step needs (shared by the sync and async loops).

* prev logprobs: with one optimizer step per rollout, the prev pass equals the training pass's own
  logprobs before the update, so it is skipped (``grpo.skip_prev_logprobs: auto``) and the loss uses
  ``curr_logprobs.detach()``; ``loss_fn.force_on_policy_ratio`` always skips it.
* reference logprobs: needed only for a non-zero ``loss_fn.reference_policy_kl_penalty``; at 0 the
  reference model is not even loaded.
* teacher logprobs: with ``teacher.model_name`` set and ``distillation.advantage_weight > 0`` (on-policy
  distillation); the distillation advantage compares them with the prev logprobs, which are then computed (the same
  forward as the teacher's, so a teacher equal to the student gives exactly 0). The KL loss term
  (``distillation.kl_weight``) needs neither: its teacher copy runs inside the policy workers. With LoRA (``policy.lora_cfg.enabled``) the reference is the
  policy's own base model with its adapters disabled: no reference actors are started.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nemo_like.config.schema import MasterConfig
from nemo_like.config.sections.base import changed_from_defaults


@dataclass(frozen=True)
class LogprobPlan:
    compute_prev: bool
    compute_reference: bool
    reasons: list[str] = field(default_factory=list)
    reference_from_policy: bool = False  # LoRA: the policy's base model (adapters disabled) is the reference
    compute_teacher: bool = False  # teacher.model_name and distillation.advantage_weight > 0: the teacher scores the sampled tokens

    @property
    def load_reference_model(self) -> bool:
        """Whether reference actors (a second copy of the weights) are started."""
        return self.compute_reference and not self.reference_from_policy


def optimizer_steps_per_rollout(cfg: MasterConfig) -> int:
    """:attr:`MasterConfig.optimizer_steps_per_rollout` (the config's own warnings read it too)."""
    return cfg.optimizer_steps_per_rollout


def decide_logprob_passes(cfg: MasterConfig) -> LogprobPlan:
    """Which passes to run; ``reasons`` says why each was kept or skipped (logged once at start)."""
    reasons = []
    steps = optimizer_steps_per_rollout(cfg)
    needed_by = cfg.prev_logprob_consumers()  # with grpo.skip_prev_logprobs=true: a config error already
    if needed_by:
        compute_prev = True
        reasons.append(f"prev logprobs computed: needed by {', '.join(needed_by)}")
        if cfg.loss_fn.force_on_policy_ratio:
            reasons.append(f"prev logprobs computed although loss_fn.force_on_policy_ratio: {', '.join(needed_by)} needs them")
    elif cfg.loss_fn.force_on_policy_ratio:
        compute_prev = False
        reasons.append("prev logprobs skipped: loss_fn.force_on_policy_ratio")
    elif cfg.grpo.skip_prev_logprobs is False:
        compute_prev = True
        reasons.append("prev logprobs computed: grpo.skip_prev_logprobs=false")
    elif steps == 1:
        compute_prev = False
        same = (
            "the training forward's (with policy.lora_cfg.dropout, not what an eval-mode pass would give)"
            if cfg.policy.lora_cfg.enabled and cfg.policy.lora_cfg.dropout > 0
            else "current logprobs before the update"
        )
        reasons.append(f"prev logprobs skipped: one optimizer step per rollout, so prev == {same}")
    else:
        compute_prev = True
        reasons.append(f"prev logprobs computed: {steps} optimizer steps per rollout")
    compute_reference = cfg.loss_fn.reference_policy_kl_penalty != 0
    from_policy = compute_reference and cfg.policy.lora_cfg.enabled
    if from_policy:
        reasons.append(
            "reference logprobs computed by the policy with its LoRA adapters disabled (policy.lora_cfg.enabled): "
            "no reference actors, no second copy of the weights"
        )
    else:
        reasons.append(
            "reference logprobs computed: loss_fn.reference_policy_kl_penalty != 0"
            if compute_reference
            else "reference model not loaded: loss_fn.reference_policy_kl_penalty == 0"
        )
    # The teacher's actors serve the distillation advantage; the KL loss term (distillation.kl_weight) runs its own
    # teacher copy inside the policy workers.
    compute_teacher = cfg.teacher.enabled and cfg.distillation.advantage_weight > 0
    if compute_teacher:
        models = ", ".join(cfg.teacher.models())
        reasons.append(f"teacher logprobs computed by {models} (on-policy distillation: teacher.model_name, teacher.by_task)")
    elif cfg.teacher.enabled:
        reasons.append("teacher actors not started: distillation.advantage_weight=0 (no distillation advantage)")
    if not (compute_prev or compute_reference or compute_teacher):
        reasons += [
            f"WARNING: {key} has no effect: no logprob pass runs (prev, reference and teacher are off)" for key in logprob_batch_keys(cfg)
        ]
    return LogprobPlan(compute_prev, compute_reference, reasons, from_policy, compute_teacher)


def logprob_batch_keys(cfg: MasterConfig) -> list[str]:
    """The keys that size logprob-pass micro-batches which this recipe changed from their defaults (read only by a
    logprob pass: the training forward and generation take their own)."""
    pc = cfg.policy
    keys = [f"policy.{k}" for k in changed_from_defaults(pc, ["logprob_batch_size"])]
    for mode in ("sequence_packing", "dynamic_batching"):
        keys += [f"policy.{mode}.{k}" for k in changed_from_defaults(getattr(pc, mode), ["logprob_mb_tokens"])]
    return keys
