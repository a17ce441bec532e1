"""The run sections: ``logger``, ``checkpointing``, ``cluster``, ``eval``."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Literal

from pydantic import Field, field_validator, model_validator

from nemo_like.config.sections.base import Section, check_pass_k, default_pass_k
from nemo_like.config.types import Float, Int, OptStr


class WandbConfig(Section):
    project: str = Field("nemo-like", description="Weights & Biases project.")
    name: OptStr = Field(None, description="Run name (default: W&B picks one).")


class LoggerConfig(Section):
    log_dir: str = Field(
        "logs/grpo", min_length=1, description="Directory for metrics.jsonl, the resolved config, sample dumps and the plot."
    )
    progress_bar: bool = Field(True, description="Live progress bar on the console.")
    plot_at_end: bool = Field(
        True, description="Render log_dir/metrics.png when the run ends (about 2 s on a CPU; `nemo-like plot LOG_DIR` draws it later)."
    )
    tensorboard_enabled: bool = Field(False, description="Also write TensorBoard event files under log_dir/tensorboard.")
    wandb_enabled: bool = Field(
        False, description="Also log to Weights & Biases (WANDB_MODE=offline works with no network; a failed start only warns)."
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases run settings.")
    console_timing_period: Int = Field(10, ge=0, description="Print the per-phase timing breakdown every N steps (0: never).")
    dump_train_data: bool = Field(
        False, description="Write every sample of each step (and of each validation) to log_dir/{train,val}_data_step{N}.jsonl."
    )
    num_val_samples_to_print: Int = Field(
        0, ge=0, description="Print this many validation samples (prompt, response, reward) to the console."
    )


class CheckpointingConfig(Section):
    enabled: bool = Field(False, description="Save checkpoints and resume from them.")
    checkpoint_dir: str = Field(
        "results/grpo", min_length=1, description="Where step_N/ directories are written (shared storage on a cluster)."
    )
    save_period: Int = Field(10, gt=0, description="Save every this many steps (and after the last step).")
    keep_top_k: Int | None = Field(
        3, gt=0, description="Checkpoints kept, best first by metric_name (the latest is always kept); null keeps all."
    )
    metric_name: OptStr = Field(
        "val:accuracy", description="Ranking metric: 'val:<name>' (validation/<name>) or 'train:<name>' (train/<name>); null ranks by step."
    )
    higher_is_better: bool = Field(True, description="Direction of metric_name.")
    resume: bool = Field(True, description="Resume automatically from the latest valid checkpoint in checkpoint_dir.")
    save_before: OptStr = Field(
        None,
        description="Save and stop (exit status 75) before this deadline, early enough for the slowest recent step plus save: "
        "seconds from the start (e.g. 3600), an ISO time (2026-12-02T18:00:00, local time without a zone), or 'auto' "
        "($SLURM_JOB_END_TIME when set, else none). null: no deadline (docs/guides/fault-tolerance.md).",
    )

    @field_validator("save_before", mode="before")
    @classmethod
    def _seconds_as_text(cls, value: object) -> object:
        if isinstance(value, bool):
            raise ValueError(f"checkpointing.save_before: expected seconds, an ISO time or 'auto', not a boolean (got {value})")
        return str(value) if isinstance(value, (int, float)) else value

    @model_validator(mode="after")
    def _save_before_form(self) -> CheckpointingConfig:
        check_save_before(self.save_before)
        # 'auto' may have no deadline (no scheduler): it is checked when it resolves, at the run's start (resolve_run_deadline).
        if self.save_before is not None and str(self.save_before).strip().lower() != "auto" and not self.enabled:
            raise ValueError("checkpointing.save_before needs checkpointing.enabled=true (the run saves before the deadline)")
        return self

    @model_validator(mode="after")
    def _metric_name_form(self) -> CheckpointingConfig:
        if self.metric_name is not None:
            prefix, _, name = self.metric_name.partition(":")
            if prefix not in ("val", "train") or not name:
                raise ValueError(f"checkpointing.metric_name must be 'val:<metric>' or 'train:<metric>', got {self.metric_name!r}")
        return self


#: Seconds from the start a ``save_before`` may name (about 30 years; more is no deadline a run could meet).
MAX_SAVE_BEFORE_S = 1e9


def check_save_before(spec: str | float | None) -> None:
    """``checkpointing.save_before``'s forms: 'auto', seconds from the start, or an ISO time (``ValueError`` otherwise)."""
    if spec is None or str(spec).strip().lower() == "auto":
        return
    try:
        seconds = float(spec)
    except ValueError:
        pass
    else:
        # nan never stops a run; inf cannot be a time; 0 or less is a deadline already past at the start
        if not math.isfinite(seconds) or seconds <= 0 or seconds >= MAX_SAVE_BEFORE_S:
            raise ValueError(f"checkpointing.save_before: {spec!r} seconds from the start is not a time a run can stop at")
        return
    try:
        datetime.fromisoformat(str(spec).strip())
    except ValueError:
        raise ValueError(
            f"checkpointing.save_before must be 'auto', seconds from the start (e.g. 3600) or an ISO time "
            f"(e.g. 2026-12-02T18:00:00), got {spec!r}"
        ) from None


class FaultToleranceConfig(Section):
    """What the run does about a dead or hung actor (docs/guides/fault-tolerance.md)."""

    max_actor_restarts: Int = Field(
        3,
        ge=0,
        description="Dead generation or environment actors replaced in place over the run, per role (the lost calls are re-sent with "
        "the same seeds, so the step's results are unchanged); one more death stops the run listing every cause. 0: stop at the first.",
    )
    max_retries_per_batch: Int = Field(
        2, ge=0, description="Times one batch's calls are re-sent after an actor death or a call_timeout_s before the run stops."
    )
    call_timeout_s: Float | None = Field(
        None,
        gt=0,
        description="Per-call deadline of generation and environment calls: a call still running after it counts as a death (the "
        "actor is restarted and the call re-sent). null: no deadline (the stall watchdog still reports hangs).",
    )
    max_restarts: Int = Field(
        2,
        ge=0,
        description="A dead policy, reference or teacher worker (not recoverable in place: a policy rank's optimizer shard is gone): the run stops its "
        "actors, starts them again and resumes from the last checkpoint in the same process, at most this many times. Needs "
        "checkpointing.enabled; 0: stop at the first such death.",
    )

    stall_timeout_s: Float | None = Field(
        None,
        gt=0,
        description="Stall watchdog: when no step starts or ends for this many seconds, print every actor's current call and "
        "Python stack (py-spy), then act per on_stall. null: off. Set it well above the slowest step plus a save.",
    )
    setup_timeout_s: Float | None = Field(
        None,
        gt=0,
        description="Stall watchdog for the actors' start (set-up: Ray's start, each role's workers ready, a restart's too): "
        "when one stage takes longer than this, the same report, then on_stall. null: not watched. Set it well above the "
        "slowest stage (a model's load).",
    )
    on_stall: Literal["warn", "abort"] = Field(
        "warn",
        description="After a stall report: 'warn' keeps waiting (reporting again each stall_timeout_s), 'abort' exits with status 70.",
    )


class FaultInjectionConfig(Section):
    """A deterministic fault for tests (docs/guides/fault-tolerance.md); also ``$NEMO_LIKE_FAULT_INJECTION`` as JSON."""

    role: Literal["generation", "environment", "policy", "reference"] = Field(
        "generation",
        description="Whose call fails: 'generation' (an engine, or the policy worker when it samples inline), 'environment' (an "
        "environment actor), 'policy' (a policy worker), 'reference' (a reference policy worker).",
    )
    step: Int = Field(1, ge=0, description="The training step whose call fails (0: the first start of the actors, phase 'setup' only).")
    phase: Literal["generate", "score", "train", "setup", "logprobs"] = Field(
        "generate",
        description="Which call: 'generate' (the step's rollout generation; role generation), 'score' (the rewards, and multi-turn "
        "environment steps; role environment), 'train' (the optimizer step; role policy), 'setup' (the policy workers' first "
        "call once built, at the first start of the run's actors with step 0, else at a restart's from that step; role policy), 'logprobs' (the reference "
        "logprob pass; role reference: in an async run the trajectory collector makes it, for its batch's step).",
    )
    action: Literal["hang", "kill", "raise"] | None = Field(
        None,
        description="null: no fault (the default). 'hang': the actor sleeps forever before the call; 'kill': its process exits "
        "(os._exit); 'raise': it raises.",
    )
    times: Int = Field(1, gt=0, description="How many calls of that role and phase fail, from the step on (2: the retry fails too).")

    @model_validator(mode="after")
    def _phase_of_role(self) -> FaultInjectionConfig:
        phases = {"generation": ("generate",), "environment": ("score",), "policy": ("train", "setup"), "reference": ("logprobs",)}
        if self.phase not in phases[self.role]:
            expected = " or ".join(repr(p) for p in phases[self.role])
            raise ValueError(f"cluster.fault_injection.phase of role {self.role!r} is {expected}, got {self.phase!r}")
        if self.step == 0 and self.phase != "setup":
            raise ValueError(f"cluster.fault_injection.step=0 (before the first step) is for phase 'setup' only, got {self.phase!r}")
        return self


class ClusterConfig(Section):
    num_nodes: Int = Field(
        1, gt=0, description="Nodes of the cluster (a CPU run splits threads over the nodes Ray has, and warns when they differ)."
    )
    gpus_per_node: Int = Field(0, ge=0, description="GPUs per node; 0 runs on CPU bundles.")
    num_cpus: Int | None = Field(
        None,
        gt=0,
        description="CPUs for a private local Ray cluster (default: those this process may use, a cgroup CPU quota included); "
        "with several nodes, each node's CPUs as `nemo-like plan` assumes them (a run reads the cluster's).",
    )
    object_store_memory_mb: Int = Field(512, gt=0, description="Object store size for a private local cluster.")
    ray_address: OptStr = Field(None, description="Join this Ray cluster (default: $RAY_ADDRESS, else start a private local one).")
    placement_timeout_s: Float = Field(60.0, gt=0, description="Fail if the actors' resources are not granted within this time.")
    peak_flops_per_device: Float | None = Field(
        None,
        gt=0,
        description="Peak FLOP/s of one device for performance/mfu (a GPU; on CPU a whole node). Default: a table of known GPUs "
        "for the run's precision, or on CPU a matmul probe measured once and cached (docs/guides/logging.md, Performance).",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK",
        description="How each actor group's bundles land on nodes (Ray placement strategy): PACK fills a node first, SPREAD "
        "spreads when it can, STRICT_PACK one node only, STRICT_SPREAD one bundle per node (see docs/guides/cluster.md).",
    )
    fault_tolerance: FaultToleranceConfig = Field(
        default_factory=FaultToleranceConfig,
        description="Dead and hung actors: replacement budgets and the call deadline, run restarts, the stall watchdog.",
    )
    fault_injection: FaultInjectionConfig = Field(
        default_factory=FaultInjectionConfig,
        description="Tests only: make one actor call hang, die or raise at a given step (action null: none; no cost when unset).",
    )


class EvalConfig(Section):
    """``nemo-like eval``: sample the validation prompts and report accuracy and pass@k (docs/guides/data-and-environments.md)."""

    model_path: OptStr = Field(
        None,
        description="Model to evaluate: an HF model directory or hub id, a checkpoint step directory (its policy/ subdir is "
        "loaded), or the embedded model; default: policy.model_name. The tokenizer stays policy.tokenizer_name.",
    )
    num_samples_per_prompt: Int = Field(1, gt=0, description="Samples per prompt (n of the pass@k estimator).")
    greedy: bool = Field(
        False, description="Greedy decoding (every sample of a prompt is then the same); false samples with policy.generation settings."
    )
    pass_k: list[Int] | None = Field(
        None,
        description="Report pass@k for each k (1 <= k <= num_samples_per_prompt); default: 1, 2, 4, ... up to num_samples_per_prompt, "
        "and num_samples_per_prompt itself (n = 6: [1, 2, 4, 6]).",
    )
    output_dir: str = Field("results/eval", description="Where summary.json and results.jsonl are written.")
    seed: Int | None = Field(None, ge=0, lt=2**32, description="Sampling seed (0 <= seed < 2**32); default grpo.seed.")
    samples_per_chunk: Int = Field(
        4096,
        gt=0,
        description="Samples generated and scored per call (whole prompts: at least one prompt's num_samples_per_prompt): "
        "after each chunk the eval prints its progress and appends the chunk's rows to results.partial.jsonl, which an "
        "eval that stops keeps. Larger chunks keep a GPU engine's batch fuller at a chunk's end.",
    )

    @model_validator(mode="after")
    def _k_within_n(self) -> EvalConfig:
        if self.pass_k is not None:
            check_pass_k(self.pass_k, self.num_samples_per_prompt, "eval.pass_k", "eval.num_samples_per_prompt")
        return self

    @property
    def resolved_pass_k(self) -> list[int]:
        """The ks of eval's pass@k: ``pass_k``, else :func:`default_pass_k` of ``num_samples_per_prompt``."""
        if self.pass_k is not None:
            return list(self.pass_k)
        return default_pass_k(self.num_samples_per_prompt)
