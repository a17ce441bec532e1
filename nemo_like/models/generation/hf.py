"""Driver-side facade over HF generation workers."""

from __future__ import annotations

import time

from nemo_like.config.schema import MasterConfig
from nemo_like.distributed.supervision import Replaceable
from nemo_like.distributed.worker_group import RayWorkerGroup, RoleResources, WorkerResources, summed_over_workers
from nemo_like.models.generation.hf_worker import HFGenerationWorker
from nemo_like.models.generation.interface import (
    GeneratedSample,
    SamplingParams,
    Seeds,
    ServedWeights,
    WeightSource,
    actor_concurrency,
    generate_on_group,
)
from nemo_like.models.loading import actor_model_source, tokenizer_source


def hf_generation_resources(cfg: MasterConfig, num_threads: int, num_workers: int = 1) -> RoleResources:
    """HF generation workers: CPUs each, ``num_threads`` torch threads each (the run plan's split), and a GPU of their
    own on GPU clusters."""
    pc = cfg.policy
    resources = WorkerResources(
        num_cpus=pc.num_cpus_per_worker, num_gpus=1.0 if cfg.cluster.gpus_per_node else 0.0, num_threads=num_threads
    )
    return RoleResources("generation", num_workers, resources)


class HFGeneration:
    """Shards prompts across ``num_workers`` HF generation actors."""

    PER_PROMPT_SEEDS = True  # the workers' sampler takes one seed per prompt (lean_decoder.sample)

    def __init__(self, cfg: MasterConfig, pad_token_id: int, eos_token_ids: list[int], num_threads: int, num_workers: int = 1) -> None:
        """``num_threads``: torch threads per worker (the run plan's ``threads.generation``)."""
        pc = cfg.policy
        resources = hf_generation_resources(cfg, num_threads, num_workers).resources
        init = dict(
            model_name=actor_model_source(pc.model_name),
            precision=pc.precision,
            num_threads=resources.num_threads,
            pad_token_id=pad_token_id,
            eos_token_ids=eos_token_ids,
            tokenizer_name=tokenizer_source(pc),
        )
        self.group = RayWorkerGroup(
            "generation",
            HFGenerationWorker,
            num_workers,
            resources,
            init,
            cfg.cluster.placement_timeout_s,
            max_concurrency=actor_concurrency(cfg),
        )
        self.weight_version = 0
        # A dead worker is replaced in place and loads the weights the others serve (distributed/supervision.py).
        self.served = ServedWeights()
        self.replaceable = Replaceable("generation", self.group, self.served.load_into)

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: Seeds) -> list[GeneratedSample]:
        return generate_on_group(self.group, prompts, params, seed, self.replaceable)

    def refit(self, weights: WeightSource, version: int) -> float:
        """Load the policy's weights into every worker (one object-store copy shared by all). ``weights``: the exported
        weights, or a zero-argument exporter, always called here (every HF refit goes through the export)."""
        start = time.perf_counter()
        self.served.refit(self.replaceable, weights, version)
        self.weight_version = version
        return time.perf_counter() - start

    def mid_generation_updates(self) -> int:
        """Refits applied in the middle of a generate call, summed over the workers (in-flight weight updates)."""
        return summed_over_workers(self.group.workers, "mid_generation_updates", "generation: counters")

    def mid_generation_seconds(self) -> float:
        """Seconds the workers' generate calls spent loading those refits, summed over the workers."""
        return summed_over_workers(self.group.workers, "mid_generation_seconds", "generation: counters")

    def wait_ready(self) -> None:
        """Wait until every engine actor is built (its start-up never counts against a call's deadline)."""
        self.group.wait_started()

    def shutdown(self) -> None:
        self.group.shutdown()
