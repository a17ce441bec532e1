"""An in-process generation engine (no Ray): the HF model sampled by the same loop as the ``hf`` backend.

For serving a model without a training run (tests, a laptop, a future ``nemo-like serve``): it satisfies
:class:`~nemo_like.models.generation.interface.GenerationInterface` and returns the same samples, logprobs included,
as :class:`~nemo_like.models.generation.hf_worker.HFGenerationWorker` (both call
:func:`~nemo_like.models.generation.lean_decoder.sample_with_params`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nemo_like.models.generation.interface import GeneratedSample, SamplingParams, Seeds, WeightSource, export_weights
from nemo_like.models.generation.lean_decoder import sample_with_params
from nemo_like.models.loading import decode_exact, load_causal_lm
from nemo_like.models.refit.manifest import check_manifest, served_weight_names


@dataclass
class LocalGeneration:
    """One model replica in this process; call it from one thread at a time (the server's queue does)."""

    model: torch.nn.Module
    pad_token_id: int
    eos_token_ids: list[int]
    weight_version: int = 0
    decode: Callable[[Sequence[int]], str] | None = None  # the tokenizer's: rows stop at a request's stop strings

    PER_PROMPT_SEEDS = True  # generate takes one seed per prompt (lean_decoder.sample)

    @classmethod
    def load(
        cls, model_name: str, pad_token_id: int, eos_token_ids: list[int], precision: str = "float32", tokenizer: Any = None
    ) -> LocalGeneration:
        """Load ``model_name`` (a path, a hub id or ``embedded:<name>``) for sampling; with its ``tokenizer``, a row stops
        sampling at a request's stop strings (without it, it samples on to its token limit and the server cuts)."""
        decode = functools.partial(decode_exact, tokenizer) if tokenizer is not None else None
        return cls(load_causal_lm(model_name, precision).eval(), pad_token_id, list(eos_token_ids), decode=decode)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: Seeds) -> list[GeneratedSample]:
        """One sample per prompt, with the logprobs of the distribution each token was drawn from; ``seed``: the
        batch's, or one per prompt."""
        drawn = sample_with_params(self.model, prompts, params, self.eos_token_ids, self.pad_token_id, seed, decode=self.decode)
        return [GeneratedSample(**d) for d in drawn.sample_dicts(prompts, self.weight_version)]

    @torch.no_grad()
    def refit(self, weights: WeightSource, version: int) -> float:
        """Load a full state dict (or an exporter returning one) as weight version ``version``: this in-process engine
        takes plain state dicts only, not the buckets or shared-memory descriptors an engine actor is sent."""
        start = time.perf_counter()
        state = export_weights(weights)
        # The names first (as the HF worker does): strict=False loaded nothing for renamed weights and still took the version
        check_manifest(served_weight_names(self.model), state, "the local engine")
        self.model.load_state_dict(state, strict=False)
        self.weight_version = version
        return time.perf_counter() - start

    def shutdown(self) -> None:
        """Nothing to release."""
