"""Build everything a GRPO run needs from a validated config, as one named object."""

from __future__ import annotations

from dataclasses import dataclass

from nemo_like.algorithms.logprob_plan import LogprobPlan, decide_logprob_passes
from nemo_like.config.errors import ConfigError
from nemo_like.config.schema import MasterConfig
from nemo_like.data.prompts import PromptDataLoader, PromptRecord, build_prompt_dataset
from nemo_like.distributed.capacity import ensure_cluster_capacity
from nemo_like.distributed.ray_init import init_ray
from nemo_like.distributed.worker_group import RayWorkerGroup, WorkerResources
from nemo_like.environments.arithmetic import ArithmeticEnvironment, import_reward_fn
from nemo_like.models.generation.hf import HFGeneration
from nemo_like.models.generation import make_generation
from nemo_like.models.loading import load_tokenizer
from nemo_like.models.policy.policy import Policy


@dataclass
class GRPOComponents:
    """The actors, data and decisions of one run."""

    cfg: MasterConfig
    tokenizer: object
    policy: Policy
    reference: Policy | None
    generation: HFGeneration
    environment: RayWorkerGroup
    train_loader: PromptDataLoader
    val_prompts: list[PromptRecord]
    plan: LogprobPlan

    def shutdown(self) -> None:
        """Kill every actor of the run (the Ray cluster itself stays up)."""
        for part in (self.generation, self.policy, self.reference, self.environment):
            if part is not None:
                part.shutdown()


def eos_token_ids(tokenizer) -> list[int]:
    ids = tokenizer.eos_token_id
    return list(ids) if isinstance(ids, (list, tuple)) else [ids]


def _driver_tokenizer(cfg: MasterConfig):
    """The run's tokenizer; an id that cannot be loaded (offline, typo) is a ConfigError naming the key."""
    name = cfg.policy.tokenizer_name or cfg.policy.model_name
    try:
        return load_tokenizer(name)
    except OSError as exc:
        key = "policy.tokenizer_name" if cfg.policy.tokenizer_name else "policy.model_name"
        raise ConfigError(f"cannot load the tokenizer of {key}={name!r} ({str(exc).splitlines()[0]}); on an offline machine "
                          "point policy.model_name at a local model directory") from None


def setup_grpo(cfg: MasterConfig) -> GRPOComponents:
    """Start Ray (or join it), load data, start the policy, reference, generation and reward actors."""
    if cfg.env.custom_reward_fn:
        import_reward_fn(cfg.env.custom_reward_fn)  # fail fast in the driver, not inside an actor
    # Data first: a bad file, column or prompt length fails in seconds, before Ray or any actor starts.
    tokenizer = _driver_tokenizer(cfg)
    max_prompt = cfg.policy.max_total_sequence_length - cfg.policy.generation.max_new_tokens
    train = build_prompt_dataset(cfg.data, tokenizer, "train", max_prompt)
    val = build_prompt_dataset(cfg.data, tokenizer, "validation", max_prompt)[: cfg.grpo.max_val_samples]
    loader = PromptDataLoader(train, cfg.grpo.num_prompts_per_step, cfg.grpo.seed, cfg.data.shuffle)
    init_ray(cfg.cluster)
    ensure_cluster_capacity(cfg)  # fail fast, before any actor waits on a placement group
    plan = decide_logprob_passes(cfg)
    policy = Policy(cfg, "policy", trainable=True)
    reference = Policy(cfg, "reference", trainable=False) if plan.load_reference_model else None
    generation = make_generation(cfg, tokenizer.pad_token_id, eos_token_ids(tokenizer), policy)
    environment = RayWorkerGroup(
        "environment",
        ArithmeticEnvironment,
        cfg.env.num_workers,
        WorkerResources(num_cpus=0.1),
        {"custom_reward_fn": cfg.env.custom_reward_fn},
        cfg.cluster.placement_timeout_s,
    )
    return GRPOComponents(cfg, tokenizer, policy, reference, generation, environment, loader, val, plan)
