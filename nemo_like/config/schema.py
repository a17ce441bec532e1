"""Typed, validated configuration (pydantic). Key names follow NeMo-RL so recipes carry over.

Every field has a description: the schema is the reference for what each recipe key means. The
sections live in :mod:`nemo_like.config.sections` (one module each); this module defines
:class:`MasterConfig` and re-exports every section, so ``from nemo_like.config.schema import ...``
keeps working. Sections we own forbid unknown keys, so a typo fails at start-up instead of being ignored.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nemo_like.config.errors import did_you_mean
from nemo_like.config.loss import ClippedPGLossConfig
from nemo_like.config.rejection import RolloutRejectionConfig
from nemo_like.config.sections.base import (  # noqa: F401  (re-exported)
    EMBEDDED_MODEL,
    Section,
    changed_from_defaults,
    check_pass_k,
    default_pass_k,
    set_while_off,
)
from nemo_like.config.sections.data import (  # noqa: F401  (re-exported)
    DataConfig,
    DatasetSplitConfig,
    EnvSectionConfig,
    normalize_env_sections,
)
from nemo_like.config.sections.distillation import (  # noqa: F401  (re-exported)
    DistillationConfig,
    TeacherConfig,
    distillation_errors,
    distillation_warnings,
)
from nemo_like.config.sections.grpo import (  # noqa: F401  (re-exported)
    GROUP_BASELINE_ESTIMATORS,
    AdvEstimatorConfig,
    AsyncGRPOConfig,
    GRPOConfig,
    RewardShapingConfig,
)
from nemo_like.config.sections.policy import (  # noqa: F401  (re-exported)
    ColocatedConfig,
    DTensorConfig,
    DynamicBatchingConfig,
    GenerationConfig,
    LoraConfig,
    OptimizerConfig,
    PolicyConfig,
    SchedulerConfig,
    SequencePackingConfig,
    VllmConfig,
    vllm_available,
)
from nemo_like.config.sections.run import (  # noqa: F401  (re-exported)
    CheckpointingConfig,
    ClusterConfig,
    EvalConfig,
    LoggerConfig,
    WandbConfig,
)
from nemo_like.config.types import Float, Int, ThreadCount

__all__ = [
    "EMBEDDED_MODEL",
    "Section",
    "check_pass_k",
    "default_pass_k",
    "AdvEstimatorConfig",
    "RewardShapingConfig",
    "AsyncGRPOConfig",
    "GRPOConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ColocatedConfig",
    "VllmConfig",
    "GenerationConfig",
    "DTensorConfig",
    "SequencePackingConfig",
    "DynamicBatchingConfig",
    "LoraConfig",
    "PolicyConfig",
    "DatasetSplitConfig",
    "DataConfig",
    "EnvSectionConfig",
    "normalize_env_sections",
    "WandbConfig",
    "LoggerConfig",
    "CheckpointingConfig",
    "ClusterConfig",
    "EvalConfig",
    "MasterConfig",
    "TeacherConfig",
    "DistillationConfig",
    "ClippedPGLossConfig",
    "RolloutRejectionConfig",
    "Float",
    "Int",
    "ThreadCount",
]


# grpo keys only validation reads (warned about when validation never runs).
VALIDATION_KEYS = ["val_greedy", "val_num_generations_per_prompt", "val_pass_k"]  # (max_val_samples: eval reads it too)


class MasterConfig(BaseModel):
    """The whole recipe after inheritance, overrides and interpolation."""

    model_config = ConfigDict(extra="forbid")

    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    loss_fn: ClippedPGLossConfig = Field(default_factory=ClippedPGLossConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    env: dict[str, EnvSectionConfig] = Field(
        default_factory=dict,
        description="Environments by task name: env.<task> = {class, num_workers, <env keys>}; samples are routed by "
        "metadata['task_name']. Empty: one arithmetic environment. The shorthand {name: X, num_workers: N, ...} is one section.",
    )
    eval: EvalConfig = Field(default_factory=lambda: EvalConfig(), description="`nemo-like eval` settings.")
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig, description="On-policy distillation's teacher model.")
    distillation: DistillationConfig = Field(default_factory=DistillationConfig)

    @field_validator("env", mode="before")
    @classmethod
    def _env_sections(cls, value: Any) -> Any:
        return normalize_env_sections(value)

    @property
    def env_sections(self) -> dict[str, EnvSectionConfig]:
        """The environments by task; an empty ``env`` (e.g. ``MasterConfig()``) is one default arithmetic one."""
        return self.env or {"arithmetic": EnvSectionConfig()}

    @property
    def rollout_batch_size(self) -> int:
        """Samples generated per step: prompts x generations."""
        return self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt

    def ratio_is_one(self) -> bool:
        """Whether every ratio pi/pi_prev the loss sees is exactly 1: one optimizer step per rollout, and pi_prev either the
        training forward's own (the prev pass skipped) or a forward that computes the same (no LoRA dropout: the prev
        pass runs in eval mode, the training forward with dropout)."""
        if self.optimizer_steps_per_rollout != 1:
            return False
        prev_pass = bool(self.prev_logprob_consumers()) or self.grpo.skip_prev_logprobs is False
        lora = self.policy.lora_cfg
        return not (prev_pass and lora.enabled and lora.dropout > 0)

    @property
    def optimizer_steps_per_rollout(self) -> int:
        """Optimizer steps each rollout is trained in: the rollout size over ``policy.train_global_batch_size``."""
        return self.rollout_batch_size // self.policy.train_global_batch_size

    @model_validator(mode="after")
    def _cross_section_checks(self) -> MasterConfig:
        # First: what reads teacher.enabled below (the prev pass's consumers) must see only the teachers some task uses
        for task in self.teacher.by_task:  # a misspelt task's teacher never scores a row: distillation silently off
            if task not in self.env_sections:
                raise ValueError(
                    f"teacher.by_task.{task}: no task of that name; the run's tasks (env.<task>) are "
                    f"{sorted(self.env_sections)}.{did_you_mean(task, self.env_sections)}"
                )
        self.teacher.for_tasks(self.env_sections)  # only the teachers some task uses start
        if self.policy.shared_prompt_forward is True and self.teacher.enabled and self.distillation.kl_weight > 0:
            # refused here, before any actor starts (the policy worker refused it once the cluster was up)
            raise ValueError(
                f"policy.shared_prompt_forward=true cannot run with distillation.kl_weight={self.distillation.kl_weight}: the "
                "teacher KL term needs the student's logits at every position; use auto (falls back to the model's forward) or false"
            )
        rollout = self.rollout_batch_size
        gbs = self.policy.train_global_batch_size
        if rollout % gbs != 0:
            raise ValueError(
                f"policy.train_global_batch_size ({gbs}) must divide the rollout size grpo.num_prompts_per_step x "
                f"grpo.num_generations_per_prompt = {self.grpo.num_prompts_per_step} x {self.grpo.num_generations_per_prompt} = {rollout}"
            )
        if self.loss_fn.force_on_policy_ratio and gbs != rollout:
            raise ValueError(
                "loss_fn.force_on_policy_ratio requires policy.train_global_batch_size == grpo.num_prompts_per_step * "
                f"grpo.num_generations_per_prompt (one optimizer step per rollout); got {gbs} != "
                f"{self.grpo.num_prompts_per_step} * {self.grpo.num_generations_per_prompt} = {rollout}"
            )
        if self.grpo.skip_prev_logprobs is True and gbs != rollout:
            raise ValueError(
                "grpo.skip_prev_logprobs=true requires one optimizer step per rollout (policy.train_global_batch_size == "
                f"grpo.num_prompts_per_step * grpo.num_generations_per_prompt); got {gbs} != {rollout}. Use 'auto'."
            )
        if self.grpo.skip_prev_logprobs is True and (consumers := self.prev_logprob_consumers()):
            raise ValueError(
                f"{consumers[0]} is set, which needs the prev-logprob pass, but grpo.skip_prev_logprobs=true; "
                "use skip_prev_logprobs 'auto' (or false) or turn it off"
            )
        if self.grpo.reward_shaping.enabled:
            self._check_reward_shaping()
        if self.grpo.max_rollout_turns > 1:
            self._check_multi_turn()
        agents = self.agent_task_names()
        if agents and self.grpo.reward_shaping.enabled and not self.grpo.reward_shaping.max_response_length:
            raise ValueError(
                f"grpo.reward_shaping.enabled=true with agent tasks {list(agents)}: a session's calls sample many turns, and the "
                "overlong penalty would measure them against one call's policy.generation.max_new_tokens; set "
                "grpo.reward_shaping.max_response_length to the sampled-token budget of a whole session"
            )
        if self.grpo.async_grpo.enabled:
            self._check_async()
        total, new = self.policy.max_total_sequence_length, self.policy.generation.max_new_tokens
        if total <= new and self.grpo.max_rollout_turns == 1:  # (multi-turn says it in its own terms)
            raise ValueError(
                f"policy.max_total_sequence_length ({total}) must exceed policy.generation.max_new_tokens ({new}): a prompt "
                f"gets what is left ({total - new} tokens); raise the first or lower the second"
            )
        ranks = self.policy.dp_size * self.policy.dtensor_cfg.tensor_parallel_size
        if self.cluster.placement_strategy == "STRICT_SPREAD" and ranks > self.cluster.num_nodes:
            raise ValueError(
                f"cluster.placement_strategy=STRICT_SPREAD puts each of the policy's {ranks} ranks (policy.dp_size x "
                f"tensor_parallel_size) on a node of its own, but cluster.num_nodes={self.cluster.num_nodes}; use SPREAD "
                "(spread where possible) or declare the nodes"
            )
        tp = self.policy.dtensor_cfg.tensor_parallel_size
        if error := distillation_errors(self.teacher, self.distillation, self.env_sections, tp):
            raise ValueError(error)
        if self.grpo.use_dynamic_sampling and self.teacher_signal() and self.distillation.task_advantage_weight == 0:
            raise ValueError(
                "grpo.use_dynamic_sampling=true keeps the groups whose task rewards differ, but "
                "distillation.task_advantage_weight=0 gives the task reward no weight: it would drop groups the teacher's "
                "signal trains on, by a criterion the loss does not use; turn dynamic sampling off or weight the task reward"
            )
        if self.loss_fn.aggregation == "seq-mean-token-sum-norm" and self.loss_fn.loss_aggregation_normalizer is None:
            # Dr. GRPO's constant: the maximum response length.
            self.loss_fn.loss_aggregation_normalizer = float(self.policy.generation.max_new_tokens)
        return self

    def no_effect_warnings(self) -> list[str]:
        """One line per option that is set but has no effect here (printed at start-up, never an error)."""
        per_token = self.teacher.enabled and self.distillation.advantage_weight > 0  # a teacher's per-token advantage term
        lines = [
            *self.loss_fn.no_effect_warnings(self.ratio_is_one(), per_token),
            *self.grpo.rollout_rejection.no_effect_warnings(),
        ]
        lines += self.policy.lora_cfg.no_effect_warnings()
        if self.policy.dtensor_cfg.cpu_offload and not self.cluster.gpus_per_node:
            lines.append("policy.dtensor_cfg.cpu_offload has no effect on CPU (cluster.gpus_per_node is 0)")
        elif self.policy.dtensor_cfg.cpu_offload and not self.offloads_to_cpu():
            lines.append(
                "policy.dtensor_cfg.cpu_offload has no effect with one policy worker (policy.dp_size=1, tensor_parallel_size=1: "
                "nothing is sharded, so FSDP2's CPU offload never runs)"
            )
        if not self.policy.dtensor_cfg.enabled:  # only valid with one policy worker, which never shards
            lines.append(
                "policy.dtensor_cfg.enabled=false has no effect with policy.dp_size=1 and tensor_parallel_size=1 (nothing is "
                "sharded: the plain model is used either way)"
            )
        lines += distillation_warnings(self.teacher, self.distillation)
        if not self.grpo.overlap_scoring and (blocker := self.scoring_overlap_blocker()):
            lines.append(f"grpo.overlap_scoring=false has no effect with {blocker} (scoring never overlaps there)")
        lines += self.grpo.async_grpo.no_effect_warnings()
        loss = self.loss_fn
        if self.grpo.async_grpo.enabled and loss.reference_policy_kl_penalty > 0 and not loss.use_on_policy_kl_approximation:
            lines.append(
                "loss_fn.use_on_policy_kl_approximation=false with grpo.async_grpo.enabled=true and "
                "loss_fn.reference_policy_kl_penalty > 0: async tokens come from older weights, so the KL penalty and its "
                "gradient are estimated under the sampler's distribution, not pi_curr's (biased); set it to true"
            )
        lines += self.data.no_effect_warnings()
        warmup, optimizer_steps = self.policy.scheduler.warmup_steps, self.grpo.max_num_steps * self.optimizer_steps_per_rollout
        if warmup >= optimizer_steps > 0:  # warm-up lr factor (step + 1) / (warmup + 1), 0-based steps
            lines.append(
                f"policy.scheduler.warmup_steps={warmup} is not shorter than the run's {optimizer_steps} optimizer steps "
                f"(grpo.max_num_steps x {self.optimizer_steps_per_rollout} per rollout): its last step trains at "
                f"{optimizer_steps / (warmup + 1):.3g} x policy.optimizer.lr, never at the peak"
            )
        val_rows, val_cap = self.data.validation.num_problems, self.grpo.max_val_samples
        if val_rows is not None and val_rows > val_cap:  # null (all rows): the cut, if any, is printed where it happens
            lines.append(
                f"data.validation.num_problems={val_rows} has no effect past grpo.max_val_samples={val_cap}: validation uses "
                f"the first {val_cap} prompts; raise grpo.max_val_samples to use more"
            )
        # One sample per prompt is its own group's baseline: every task advantage is 0
        lone = self.grpo.num_generations_per_prompt == 1 and self.grpo.adv_estimator.name in GROUP_BASELINE_ESTIMATORS
        if lone and not self.teacher_signal():
            lines.append(
                f"grpo.num_generations_per_prompt=1: every advantage is 0 with grpo.adv_estimator.name="
                f"'{self.grpo.adv_estimator.name}' (a sample is its own group's baseline), so the policy-gradient term never "
                "moves the policy; use 2 or more samples per prompt"
            )
        elif lone and changed_from_defaults(self.distillation, ["task_advantage_weight"]) and self.distillation.task_advantage_weight > 0:
            lines.append(
                f"distillation.task_advantage_weight={self.distillation.task_advantage_weight} has no effect with "
                f"grpo.num_generations_per_prompt=1: the task reward's advantage is 0 with grpo.adv_estimator.name="
                f"'{self.grpo.adv_estimator.name}' (a sample is its own group's baseline); the teacher's signal still trains"
            )
        if self.grpo.use_dynamic_sampling and self.teacher_signal() and self.distillation.task_advantage_weight > 0:
            lines.append(
                "grpo.use_dynamic_sampling=true drops the groups whose task rewards are all equal, though the teacher's "
                "signal (distillation.advantage_weight, kl_weight) would still train on them"
            )
        lines += self.switched_off_warnings()
        if self.grpo.val_pass_k is not None and self.grpo.val_num_generations_per_prompt == 1:
            lines.append(
                f"grpo.val_pass_k={self.grpo.val_pass_k} has no effect with grpo.val_num_generations_per_prompt=1 "
                "(validation/pass@1 is validation/accuracy then; raise the generations to log pass@k)"
            )
        return lines

    def _shaping_without_effect(self) -> list[str]:
        """DAPO overlong shaping switched on where no response can reach its penalty: it starts past ``L_max - L_buf``
        sampled tokens, and outside agent tasks a sample has at most ``max_new_tokens`` per turn."""
        shaping = self.grpo.reward_shaping
        if not shaping.enabled or self.agent_task_names():
            return []
        if shaping.overlong_buffer_penalty == 0:
            return ["grpo.reward_shaping.enabled=true has no effect with grpo.reward_shaping.overlong_buffer_penalty=0"]
        start = (shaping.max_response_length or self.policy.generation.max_new_tokens) - shaping.overlong_buffer_length
        reachable = self.policy.generation.max_new_tokens * self.grpo.max_rollout_turns
        if start < reachable:
            return []
        turns = f" x grpo.max_rollout_turns={self.grpo.max_rollout_turns}" if self.grpo.max_rollout_turns > 1 else ""
        return [
            f"grpo.reward_shaping.enabled=true has no effect: the penalty starts past max_response_length - "
            f"overlong_buffer_length = {start} sampled tokens, and a sample has at most "
            f"policy.generation.max_new_tokens={self.policy.generation.max_new_tokens}{turns} = {reachable}"
        ]

    def switched_off_warnings(self) -> list[str]:
        """Keys set (changed from their defaults) under a switch that is off, or for an estimator that ignores them."""
        lines = []
        switched = [
            (self.grpo.reward_shaping, "grpo.reward_shaping", "enabled", ()),
            (self.policy.sequence_packing, "policy.sequence_packing", "enabled", ()),
            (self.policy.dynamic_batching, "policy.dynamic_batching", "enabled", ()),
            # checkpoint_dir also names the directory the run locks; save_before='auto' is legal without checkpoints
            (self.checkpointing, "checkpointing", "enabled", ("checkpoint_dir", "save_before")),
        ]
        for section, path, switch, kept in switched:
            lines += [f"{path}.{k} has no effect with {path}.{switch}=false" for k in set_while_off(section, switch, kept)]
        if not self.logger.wandb_enabled:
            lines += [f"logger.wandb.{k} has no effect with logger.wandb_enabled=false" for k in changed_from_defaults(self.logger.wandb)]
        never_validates = not self.grpo.validates
        ck = self.checkpointing
        if ck.enabled and ck.keep_top_k is None:  # every checkpoint is kept: nothing is ranked
            lines += [
                f"checkpointing.{k} has no effect with checkpointing.keep_top_k=null"
                for k in changed_from_defaults(ck, ["metric_name", "higher_is_better"])
            ]
        elif ck.enabled and ck.metric_name is None and changed_from_defaults(ck, ["higher_is_better"]):
            lines.append("checkpointing.higher_is_better has no effect with checkpointing.metric_name=null (checkpoints are kept by step)")
        elif ck.enabled and (ck.metric_name or "").startswith("val:") and never_validates and changed_from_defaults(ck, ["metric_name"]):
            lines.append(
                f"checkpointing.metric_name={ck.metric_name!r} has no effect: validation never runs, so checkpoints are kept by step"
            )
        if never_validates:
            validation_keys = [f"grpo.{k}" for k in changed_from_defaults(self.grpo, VALIDATION_KEYS)]
            validation_keys += ["logger.num_val_samples_to_print"] if self.logger.num_val_samples_to_print else []
            lines += [
                f"{key} has no effect: validation never runs (grpo.val_period=0, grpo.val_at_start=false, grpo.val_at_end=false)"
                for key in validation_keys
            ]
        elif self.grpo.val_greedy and self.grpo.val_num_generations_per_prompt > 1:
            lines.append(
                f"grpo.val_num_generations_per_prompt={self.grpo.val_num_generations_per_prompt} with grpo.val_greedy=true: "
                "greedy decoding draws the same answer every time, so validation/pass@k equals validation/accuracy"
            )
        if self.cluster.ray_address is not None:
            lines += [
                f"cluster.{k} has no effect with cluster.ray_address set (only a private local cluster reads it)"
                for k in changed_from_defaults(self.cluster, ["num_cpus", "object_store_memory_mb"])
            ]
        lines += self._shaping_without_effect()
        if self.loss_fn.force_on_policy_ratio and self.grpo.skip_prev_logprobs is False and not self.prev_logprob_consumers():
            lines.append(
                "grpo.skip_prev_logprobs=false has no effect with loss_fn.force_on_policy_ratio=true (the ratio is 1: the pass is "
                "skipped, nothing would read it)"
            )
        ft = self.cluster.fault_tolerance
        if ft.stall_timeout_s is None and ft.setup_timeout_s is None and changed_from_defaults(ft, ["on_stall"]):
            lines.append(
                f"cluster.fault_tolerance.on_stall={ft.on_stall} has no effect with cluster.fault_tolerance.stall_timeout_s and "
                "setup_timeout_s null (no stall watchdog runs)"
            )
        if ft.stall_timeout_s is not None and ft.call_timeout_s is not None and ft.stall_timeout_s <= ft.call_timeout_s:
            lines.append(
                f"cluster.fault_tolerance.call_timeout_s={ft.call_timeout_s:g} has no effect past "
                f"cluster.fault_tolerance.stall_timeout_s={ft.stall_timeout_s:g}: the stall watchdog reports (on_stall={ft.on_stall}) "
                "a hung call before it is killed and replaced; set stall_timeout_s above call_timeout_s plus an actor's start"
            )
        if not self.checkpointing.enabled and changed_from_defaults(ft, ["max_restarts"]):
            lines.append(
                f"cluster.fault_tolerance.max_restarts={ft.max_restarts} has no effect with checkpointing.enabled=false (a restart "
                "resumes from a checkpoint: the run stops at the first policy or reference death)"
            )
        budgets = [mode for mode in ("sequence_packing", "dynamic_batching") if getattr(self.policy, mode).enabled]
        for key in changed_from_defaults(self.policy, ["train_micro_batch_size", "logprob_batch_size"]) if budgets else ():
            lines.append(
                f"policy.{key} has no effect with policy.{budgets[0]}.enabled=true (micro-batches are token budgets: "
                f"policy.{budgets[0]}.train_mb_tokens / logprob_mb_tokens)"
            )
        share = self.policy.rank_step_samples
        if not budgets and self.policy.train_micro_batch_size > share:
            lines.append(
                f"policy.train_micro_batch_size={self.policy.train_micro_batch_size} is more than a rank's share of an optimizer "
                f"step (policy.train_global_batch_size / policy.dp_size = {share}): its micro-batches hold {share} samples"
            )
        if not self.grpo.use_dynamic_sampling and changed_from_defaults(self.grpo, ["dynamic_sampling_max_gen_batches"]):
            lines.append("grpo.dynamic_sampling_max_gen_batches has no effect with grpo.use_dynamic_sampling=false")
        estimator = self.grpo.adv_estimator.name
        ignored = {"rloo": ["use_leave_one_out_baseline"], "dr_grpo": ["use_leave_one_out_baseline", "normalize_rewards"]}
        for key in changed_from_defaults(self.grpo, ignored.get(estimator, [])):
            lines.append(f"grpo.{key} has no effect with grpo.adv_estimator.name='{estimator}' (it ignores the flag)")
        if changed_from_defaults(self.grpo, ["advantage_std_epsilon"]):
            if estimator == "dr_grpo":
                lines.append(
                    "grpo.advantage_std_epsilon has no effect with grpo.adv_estimator.name='dr_grpo' (it never divides by the std)"
                )
            elif not self.grpo.normalize_rewards:
                lines.append("grpo.advantage_std_epsilon has no effect with grpo.normalize_rewards=false (nothing divides by the std)")
        return lines

    def agent_task_names(self) -> tuple[str, ...]:
        """The tasks whose environment section is ``class: agent`` (the plan checks that no other task sits beside them:
        :func:`nemo_like.plan.run_plan.agent_tasks`)."""
        return tuple(task for task, section in self.env.items() if section.env_class == "agent")

    def prev_logprob_consumers(self) -> list[str]:
        """The features other than the loss that read the prev-policy logprobs (the pass runs for them)."""
        consumers = []
        if self.grpo.seq_logprob_error_threshold is not None:
            consumers.append("grpo.seq_logprob_error_threshold")
        if self.grpo.rollout_rejection.enabled:
            consumers.append("grpo.rollout_rejection.level")
        if self.teacher.enabled and self.distillation.advantage_weight > 0:
            consumers.append("the distillation advantage (teacher.model_name)")
        return consumers

    def teacher_config(self, model_name: str | None = None) -> MasterConfig:
        """The run config whose ``policy`` section describes a teacher's workers (``model_name``, default
        ``teacher.model_name``): its model, tokenizer and precision, no LoRA, and no top-k/top-p: a teacher scores under
        its full distribution at the student's temperature (scored under the student's truncation, a token outside the
        teacher's own kept set is scored over that set plus the token, so its scores summed to more than 1: the signal
        could favour a student unlike the teacher and ``distillation/teacher_kl`` go negative); everything else
        (sharding, batching, the forward) as the student's. The run starts its teachers with it, and the memory planner
        plans them with it."""
        t = self.teacher
        name = model_name or t.model_name
        if name is None:
            raise ValueError("teacher_config needs teacher.model_name or a model of teacher.by_task")
        policy = self.policy.model_copy(
            update={
                "model_name": name,
                "tokenizer_name": t.tokenizer_name if name == t.model_name else None,
                "precision": t.precision or self.policy.precision,
                "lora_cfg": self.policy.lora_cfg.model_copy(update={"enabled": False}),
                "generation": self.policy.generation.model_copy(update={"top_k": None, "top_p": 1.0}),
                # With the KL term the student's workers run the model's own forward (it needs the logits); the teacher's
                # run it too, so the teacher and prev passes stay the same computation (a teacher equal to the student gives 0).
                "shared_prompt_forward": False if self.distillation.kl_weight > 0 else self.policy.shared_prompt_forward,
            }
        )
        return self.model_copy(update={"policy": policy})

    def teacher_signal(self) -> bool:
        """Whether a teacher's signal trains the policy (its per-token advantage or its KL term)."""
        return self.teacher.enabled and (self.distillation.advantage_weight > 0 or self.distillation.kl_weight > 0)

    def offloads_to_cpu(self) -> bool:
        """Whether FSDP2's CPU offload runs (``policy.dtensor_cfg.cpu_offload``): on a GPU cluster with more than one
        policy worker, the only case where the workers shard their models (``sharding.shard_model``) onto a GPU mesh.
        The policy and its frozen copies (reference, teachers) then keep parameters, gradients and AdamW state in host
        RAM."""
        pc = self.policy
        return pc.dtensor_cfg.cpu_offload and bool(self.cluster.gpus_per_node) and pc.dp_size * pc.dtensor_cfg.tensor_parallel_size > 1

    def scoring_overlap_blocker(self) -> str | None:
        """Why this run's scoring cannot overlap its logprob passes (the setting that prevents it), or ``None``."""
        if self.grpo.async_grpo.enabled:
            return "grpo.async_grpo.enabled=true"
        if self.grpo.use_dynamic_sampling:
            return "grpo.use_dynamic_sampling=true"
        if self.grpo.max_rollout_turns > 1:
            return f"grpo.max_rollout_turns={self.grpo.max_rollout_turns}"
        if agents := self.agent_task_names():  # scored inside their sessions, before the rollout returns
            return f"agent tasks {list(agents)}"
        return None

    def _check_reward_shaping(self) -> None:
        shaping = self.grpo.reward_shaping
        if shaping.max_response_length:
            budget, budget_key = shaping.max_response_length, "grpo.reward_shaping.max_response_length"
        else:
            budget, budget_key = self.policy.generation.max_new_tokens, "policy.generation.max_new_tokens"
        if shaping.overlong_buffer_length == 0:
            raise ValueError(
                "grpo.reward_shaping.enabled=true needs grpo.reward_shaping.overlong_buffer_length > 0 (the tokens before "
                f"{budget_key}={budget} over which the length penalty ramps up); set it, e.g. "
                f"grpo.reward_shaping.overlong_buffer_length={max(1, budget // 4)}, or set grpo.reward_shaping.enabled=false"
            )
        if shaping.overlong_buffer_length > budget:
            raise ValueError(
                f"grpo.reward_shaping.overlong_buffer_length={shaping.overlong_buffer_length} is larger than the response budget "
                f"{budget_key}={budget}; lower it to at most {budget}"
            )

    def _check_multi_turn(self) -> None:
        turns = self.grpo.max_rollout_turns
        if self.grpo.reward_shaping.enabled and not self.grpo.reward_shaping.max_response_length:
            raise ValueError(
                f"grpo.reward_shaping.enabled=true with grpo.max_rollout_turns={turns}: the overlong penalty would measure the "
                "sampled tokens of all turns against one turn's policy.generation.max_new_tokens; set "
                "grpo.reward_shaping.max_response_length to the sampled-token budget of a whole sample"
            )
        if self.policy.max_total_sequence_length <= self.policy.generation.max_new_tokens:
            raise ValueError(
                f"grpo.max_rollout_turns={turns} needs room for more than one turn: policy.max_total_sequence_length "
                f"({self.policy.max_total_sequence_length}) must exceed policy.generation.max_new_tokens "
                f"({self.policy.generation.max_new_tokens}) plus the prompt"
            )

    def _check_async(self) -> None:
        generation = self.policy.generation  # the HF engine is never colocated (a device of its own): nothing to refuse
        vllm = generation.backend == "vllm" or (generation.backend == "auto" and vllm_available())  # auto's GPU choice
        if self.cluster.gpus_per_node and generation.colocated.enabled and vllm:
            raise ValueError(
                "grpo.async_grpo.enabled=true cannot run with policy.generation.colocated.enabled=true on GPUs "
                f"(cluster.gpus_per_node={self.cluster.gpus_per_node}): async generation runs while the policy trains, and a "
                "colocated engine shares policy rank 0's GPU, so both would hold it at once. Set "
                "policy.generation.colocated.enabled=false (generation on GPUs of its own) or turn async off"
            )
        if not self.loss_fn.use_importance_sampling_correction:
            raise ValueError(
                "grpo.async_grpo.enabled=true requires loss_fn.use_importance_sampling_correction=true: async samples come from "
                "older weights, and without the pi_prev/pi_gen correction async runs are known to collapse"
            )
        if self.grpo.use_dynamic_sampling:
            raise ValueError(
                "grpo.async_grpo.enabled=true does not support grpo.use_dynamic_sampling=true (the collector paces whole "
                "prompt batches per training step); disable one of them"
            )
