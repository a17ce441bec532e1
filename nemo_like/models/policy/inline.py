"""Inline generation: the policy worker samples with its own training weights (no engine actor, no refit).

For a small model on a CPU, a step's fixed costs decide its speed: a separate engine needs a weight
refit before every step's generation and pays its own per-step overheads (see docs/guides/performance.md).
Here the sync loop asks the policy's worker to sample with :func:`~nemo_like.models.generation.lean_decoder.sample`;
the weights that generate are, by construction, the weights that train, so the generation weight version is always
the policy's and the loop's refit is a no-op. :mod:`nemo_like.models.engines` builds it.

Where it applies (:func:`~nemo_like.models.generation.choice.inline_blocker`): a training run (``nemo-like eval``
has no policy), the sync loop (async generates while the policy trains), one policy worker (a sharded policy would
have to gather its weights for every decode step), no LoRA (not built yet). ``policy.generation.backend=auto`` picks it on CPU
clusters when nothing blocks it; GPUs keep vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nemo_like.distributed.faults import inject
from nemo_like.distributed.worker_group import RoleResources, WorkerResources, get_with_context
from nemo_like.models.generation.interface import GeneratedSample, SamplingParams, Seeds

if TYPE_CHECKING:
    from nemo_like.models.policy.policy import Policy


def inline_generation_resources() -> RoleResources:
    """Inline generation reserves nothing: it runs in the policy's worker."""
    return RoleResources("generation", 0, WorkerResources(num_cpus=0, num_gpus=0.0, num_threads=1))


class InlineGeneration:
    """:class:`~nemo_like.models.generation.interface.GenerationInterface` over the policy's own worker."""

    PER_PROMPT_SEEDS = True  # the worker's sampler takes one seed per prompt (lean_decoder.sample)

    def __init__(self, policy: Policy, pad_token_id: int, eos_token_ids: list[int], tokenizer_name: str | None = None) -> None:
        if policy is None or len(policy.group) != 1:
            raise ValueError("inline generation needs the trainable policy, with exactly one worker")
        self.policy = policy
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.tokenizer_name = tokenizer_name  # the worker stops a row's sampling at a stop string with it

    @property
    def weight_version(self) -> int:
        """Always the policy's: the weights that generate are the weights that train."""
        return self.policy.weight_version

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: Seeds) -> list[GeneratedSample]:
        from dataclasses import asdict

        inject("generation", "generate", self.policy.group.workers)  # tests only (cluster.fault_injection); a no-op when unset
        args = (prompts, asdict(params), seed, self.pad_token_id, self.eos_token_ids, self.tokenizer_name)
        ref = self.policy.group.run_rank0("generate", *args)
        return [GeneratedSample(**s) for s in get_with_context([ref], "policy: inline generation")[0]]

    def refit(self, weights: Any, version: int) -> float:
        """Nothing to load (never called by the loops: the versions always match)."""
        if version != self.policy.weight_version:
            raise RuntimeError(
                f"inline generation serves the policy's weights (version {self.policy.weight_version}), not version {version}"
            )
        return 0.0

    def mid_generation_updates(self) -> int:
        """Always 0: weights change only between generate calls."""
        return 0

    def mid_generation_seconds(self) -> float:
        """Always 0: weights change only between generate calls."""
        return 0.0

    def wait_ready(self) -> None:
        """Nothing to wait for: the policy's workers sample, and the policy waits for them."""

    def shutdown(self) -> None:
        """Nothing to release: the policy owns the worker."""
