"""Typed, validated configuration (pydantic). Key names follow NeMo-RL so recipes carry over.

Every field has a description: this file is the reference for what each recipe key means.
Sections we own forbid unknown keys, so a typo fails at start-up instead of being ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_like.config.loss import ClippedPGLossConfig

EMBEDDED_MODEL = "embedded:tiny-arith-qwen2"


class Section(BaseModel):
    """Base for config sections: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class AdvEstimatorConfig(Section):
    name: Literal["grpo", "rloo", "dr_grpo"] = Field("grpo", description="Advantage estimator (see docs/guides/advantages.md).")


class RewardShapingConfig(Section):
    enabled: bool = Field(False, description="DAPO soft overlong punishment on the reward.")
    overlong_buffer_length: int = Field(0, ge=0, description="Tokens before max_response_length where the penalty ramps up.")
    overlong_buffer_penalty: float = Field(1.0, ge=0, description="Penalty reached at max_response_length.")
    max_response_length: int | None = Field(None, gt=0, description="Response length the penalty is measured against; defaults to policy.generation.max_new_tokens.")


class GRPOConfig(Section):
    num_prompts_per_step: int = Field(8, gt=0, description="Distinct prompts per step.")
    num_generations_per_prompt: int = Field(8, gt=0, description="Samples per prompt (the group size G).")
    max_num_steps: int = Field(50, ge=0, description="Training steps to run.")
    max_num_epochs: int = Field(100, gt=0, description="Passes over the training prompts before stopping.")
    val_period: int = Field(10, ge=0, description="Validate every this many steps (0: only at start/end).")
    val_at_start: bool = Field(True, description="Validate before the first step (the step-0 value).")
    val_at_end: bool = Field(True, description="Validate after the last step.")
    val_greedy: bool = Field(False, description="Greedy decoding for validation; false samples with policy.generation settings.")
    max_val_samples: int = Field(256, gt=0, description="Validation prompts used (one response each).")
    seed: int = Field(42, description="Seed for data order, sampling and model init.")
    normalize_rewards: bool = Field(True, description="Divide advantages by the per-prompt reward std (+epsilon where std > 0).")
    use_leave_one_out_baseline: bool = Field(False, description="Baseline = mean of the other samples of the prompt.")
    adv_estimator: AdvEstimatorConfig = Field(default_factory=AdvEstimatorConfig)
    use_dynamic_sampling: bool = Field(False, description="DAPO: drop prompt groups with zero reward std and generate more.")
    dynamic_sampling_max_gen_batches: int = Field(10, gt=0, description="Generation batches allowed per step with dynamic sampling.")
    reward_shaping: RewardShapingConfig = Field(default_factory=RewardShapingConfig)
    skip_prev_logprobs: Literal["auto", True, False] = Field(
        "auto", description="Skip the prev-logprob pass: auto = when the rollout is trained in one optimizer step and nothing else needs it."
    )
    skip_reference_policy_logprobs_calculation: bool = Field(
        False, description="Explicitly skip the reference pass; only valid with loss_fn.reference_policy_kl_penalty == 0 (where it is skipped anyway)."
    )
    max_consecutive_nonfinite_steps: int = Field(
        3, gt=0, description="Stop the run after this many consecutive steps whose loss or gradient norm was NaN/inf (each such optimizer step is skipped)."
    )
    seq_logprob_error_threshold: float | None = Field(
        None,
        gt=1.0,
        description="Mask samples whose exp(mean |log pi_prev - log pi_gen|) over the response exceeds this (needs the prev-logprob pass).",
    )


class OptimizerConfig(Section):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(1e-5, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)


class SchedulerConfig(Section):
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up (optimizer steps) to optimizer.lr, then constant.")


class ColocatedConfig(Section):
    enabled: bool = Field(True, description="Generation shares the training devices (GPU only; ignored on CPU).")


class VllmConfig(Section):
    """vLLM engine settings (used when policy.generation.backend resolves to 'vllm')."""

    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="GPU only: fraction of the GPU vLLM may use (weights + KV cache); leave room for the colocated policy."
    )
    kv_cache_space_gib: int = Field(1, gt=0, description="CPU only: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE).")
    enforce_eager: bool = Field(True, description="Run eagerly (no CUDA graphs / torch.compile): fast start-up, required on CPU here.")


class GenerationConfig(Section):
    backend: Literal["auto", "hf", "vllm"] = Field(
        "auto",
        description="Generation engine: 'vllm' (vLLM, in-process in a Ray actor), 'hf' (transformers generate), "
        "'auto' = vllm when the vllm package is importable, else hf (see docs/guides/generation.md).",
    )
    max_new_tokens: int = Field(16, gt=0, description="Maximum response tokens.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature; the policy scales its logits by it too.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling (logprobs stay those of the temperature-scaled distribution).")
    top_k: int | None = Field(None, gt=0, description="Top-k sampling; null disables it.")
    stop_token_ids: list[int] | None = Field(None, description="Extra stop tokens besides the tokenizer's eos.")
    colocated: ColocatedConfig = Field(default_factory=ColocatedConfig)
    vllm_cfg: VllmConfig = Field(default_factory=VllmConfig, description="vLLM engine settings.")


class PolicyConfig(Section):
    model_name: str = Field(EMBEDDED_MODEL, description=f"HF model id or local directory; '{EMBEDDED_MODEL}' is the shipped tiny model.")
    tokenizer_name: str | None = Field(None, description="Tokenizer id or directory; defaults to model_name.")
    train_global_batch_size: int = Field(64, gt=0, description="Samples per optimizer step (all data-parallel ranks).")
    train_micro_batch_size: int = Field(16, gt=0, description="Samples per forward/backward on one rank.")
    logprob_batch_size: int = Field(64, gt=0, description="Samples per forward in logprob passes.")
    max_total_sequence_length: int = Field(128, gt=0, description="Prompt + response tokens; longer prompts are an error.")
    precision: Literal["float32", "bfloat16"] = Field("float32", description="Parameter and compute dtype.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping by global norm; null disables it.")
    dp_size: int = Field(1, gt=0, description="Data-parallel policy workers (torch.distributed, gloo on CPU, nccl on GPU).")
    num_cpus_per_worker: float = Field(0.5, gt=0, description="Ray CPU reservation per policy/reference worker.")
    num_threads_per_worker: int = Field(2, gt=0, description="torch intra-op threads in each worker.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)

    @model_validator(mode="after")
    def _micro_divides_global(self) -> "PolicyConfig":
        per_rank = self.train_global_batch_size / self.dp_size
        if per_rank != int(per_rank):
            raise ValueError(
                f"policy.train_global_batch_size ({self.train_global_batch_size}) must be divisible by policy.dp_size ({self.dp_size})"
            )
        return self


class DatasetSplitConfig(Section):
    num_problems: int = Field(gt=0, description="Problems generated for this split.")
    seed: int = Field(description="Generator seed for this split.")


class DataConfig(Section):
    dataset_name: Literal["arithmetic"] = Field("arithmetic", description="Prompt source: 'arithmetic' (seeded synthetic, checked integer answers).")
    train: DatasetSplitConfig = Field(default_factory=lambda: DatasetSplitConfig(num_problems=20000, seed=1))
    validation: DatasetSplitConfig = Field(default_factory=lambda: DatasetSplitConfig(num_problems=256, seed=2))
    shuffle: bool = Field(True, description="Shuffle the training prompts each epoch (seeded by grpo.seed).")
    system_prompt: str | None = Field(None, description="Optional system message prepended to every prompt.")


class EnvConfig(Section):
    name: Literal["arithmetic"] = Field("arithmetic", description="Reward environment.")
    num_workers: int = Field(1, gt=0, description="Reward actors; responses are sharded across them.")
    custom_reward_fn: str | None = Field(
        None, description="Optional 'module:function' with signature (response_text, answer) -> float replacing the built-in reward."
    )


class WandbConfig(Section):
    project: str = Field("nemo-like", description="Weights & Biases project.")
    name: str | None = Field(None, description="Run name (default: W&B picks one).")


class LoggerConfig(Section):
    log_dir: str = Field("logs/grpo", description="Directory for metrics.jsonl, the resolved config, sample dumps and the plot.")
    progress_bar: bool = Field(True, description="Live progress bar on the console.")
    tensorboard_enabled: bool = Field(False, description="Also write TensorBoard event files under log_dir/tensorboard.")
    wandb_enabled: bool = Field(
        False, description="Also log to Weights & Biases (WANDB_MODE=offline works with no network; a failed start only warns)."
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases run settings.")
    console_timing_period: int = Field(10, ge=0, description="Print the per-phase timing breakdown every N steps (0: never).")
    dump_train_data: bool = Field(
        False, description="Write every sample of each step (and of each validation) to log_dir/{train,val}_data_step{N}.jsonl."
    )
    num_val_samples_to_print: int = Field(0, ge=0, description="Print this many validation samples (prompt, response, reward) to the console.")


class CheckpointingConfig(Section):
    enabled: bool = Field(False, description="Save checkpoints and resume from them.")
    checkpoint_dir: str = Field("results/grpo", description="Where step_N/ directories are written (shared storage on a cluster).")
    save_period: int = Field(10, gt=0, description="Save every this many steps (and after the last step).")
    keep_top_k: int | None = Field(3, gt=0, description="Checkpoints kept, best first by metric_name (the latest is always kept); null keeps all.")
    metric_name: str | None = Field(
        "val:accuracy", description="Ranking metric: 'val:<name>' (validation/<name>) or 'train:<name>' (train/<name>); null ranks by step."
    )
    higher_is_better: bool = Field(True, description="Direction of metric_name.")
    resume: bool = Field(True, description="Resume automatically from the latest valid checkpoint in checkpoint_dir.")

    @model_validator(mode="after")
    def _metric_name_form(self) -> "CheckpointingConfig":
        if self.metric_name is not None:
            prefix, _, name = self.metric_name.partition(":")
            if prefix not in ("val", "train") or not name:
                raise ValueError(f"checkpointing.metric_name must be 'val:<metric>' or 'train:<metric>', got {self.metric_name!r}")
        return self


class ClusterConfig(Section):
    num_nodes: int = Field(1, gt=0, description="Nodes to use.")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node; 0 runs on CPU bundles.")
    num_cpus: int | None = Field(None, gt=0, description="CPUs for a private local Ray cluster (default: all of this machine).")
    object_store_memory_mb: int = Field(512, gt=0, description="Object store size for a private local cluster.")
    ray_address: str | None = Field(None, description="Join this Ray cluster (default: $RAY_ADDRESS, else start a private local one).")
    placement_timeout_s: float = Field(60.0, gt=0, description="Fail if the actors' resources are not granted within this time.")


class MasterConfig(BaseModel):
    """The whole recipe after inheritance, overrides and interpolation."""

    model_config = ConfigDict(extra="forbid")

    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    loss_fn: ClippedPGLossConfig = Field(default_factory=ClippedPGLossConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @property
    def rollout_batch_size(self) -> int:
        """Samples generated per step: prompts x generations."""
        return self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt

    @model_validator(mode="after")
    def _cross_section_checks(self) -> "MasterConfig":
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
        if self.grpo.skip_reference_policy_logprobs_calculation and self.loss_fn.reference_policy_kl_penalty != 0:
            raise ValueError(
                "grpo.skip_reference_policy_logprobs_calculation=true needs loss_fn.reference_policy_kl_penalty == 0, "
                f"got {self.loss_fn.reference_policy_kl_penalty}: the KL penalty is computed from the reference logprobs"
            )
        if self.grpo.skip_prev_logprobs is True and gbs != rollout:
            raise ValueError(
                "grpo.skip_prev_logprobs=true requires one optimizer step per rollout (policy.train_global_batch_size == "
                f"grpo.num_prompts_per_step * grpo.num_generations_per_prompt); got {gbs} != {rollout}. Use 'auto'."
            )
        return self
