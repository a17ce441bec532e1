"""The light generation backend: a Hugging Face transformers model inside a Ray actor, sampled with our own loop
(:mod:`.lean_decoder`; HF ``generate`` was slower on every model measured, ``benchmarks/lean_generation.py``)."""

from __future__ import annotations

import torch

from nemo_like.distributed.reinit import Reinitializable
from nemo_like.distributed.threads import apply_thread_count, use_threads
from nemo_like.models.generation.interface import SamplingParams, Seeds, chunk_seeds
from nemo_like.models.generation.lean_decoder import sample_with_params
from nemo_like.models.loading import exact_decoder, load_causal_lm
from nemo_like.models.refit.buckets import WeightBuckets
from nemo_like.models.refit.gate import WeightUpdateGate
from nemo_like.models.refit.manifest import check_manifest, served_weight_names
from nemo_like.models.refit.shared_memory import forget_mappings
from nemo_like.plan.backend import HF_MAX_BATCH_SIZE


class SwapLog:
    """The in-flight refits applied during one sampling call: the worker's hook between two decode steps
    (``lean_decoder.sample(between_steps=...)``). The token sampled at the step of a swap still comes from the old
    weights; the next forward pass uses the new ones."""

    def __init__(self, worker: HFGenerationWorker) -> None:
        self.worker = worker
        self.swaps: list[tuple[int, int]] = []  # (first response position produced by the new weights, version)

    def __call__(self, step: int) -> bool:
        """Apply the pending refits; returns whether any ran (the fused step then re-reads the model's weights). Only a
        refit that succeeded (a new weight version) is a swap of this call's record."""
        version = self.worker.weight_version
        if not self.worker.gate.apply_pending():
            return False
        self.worker.gate.check_usable()  # a refit that failed partway: the call must not go on sampling from the mix
        if self.worker.weight_version != version:
            self.swaps.append((step + 1, self.worker.weight_version))
        return True


class HFGenerationWorker(Reinitializable):
    """One replica of the model used for sampling; weights are replaced by :meth:`update_weights`
    (mid-generation when the actor runs with ``max_concurrency=2``, see :mod:`nemo_like.models.refit.gate`)."""

    SETS_THREADS_ON_INIT = True  # a kept actor takes the next run's thread count (worker_group.Reinitializable)
    PER_PROMPT_SEEDS = True  # generate takes one seed per prompt (lean_decoder.sample)

    def __init__(
        self,
        rank: int,
        world_size: int,
        model_name: str,
        precision: str,
        num_threads: int,
        pad_token_id: int,
        eos_token_ids: list[int],
        max_batch_size: int = HF_MAX_BATCH_SIZE,
        tokenizer_name: str | None = None,
    ) -> None:
        apply_thread_count(num_threads)
        self.num_threads = num_threads  # set again in each call's own thread (a threaded actor's: max_concurrency 2)
        forget_mappings()  # a kept actor's (reinit runs this again): the last run's refit buffer
        self.rank = rank
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.model = load_causal_lm(model_name, precision).to(self.device).eval()
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.max_batch_size = max_batch_size
        self.tokenizer_name = tokenizer_name  # loaded for a call with stop strings (their rows stop sampling there)
        self.weight_version = 0
        self.gate = WeightUpdateGate()
        self.expected_names = served_weight_names(self.model)  # what a refit must name

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: dict, seed: Seeds) -> list[dict]:
        """Sample one response per prompt; returns :class:`GeneratedSample` fields as dicts. ``seed``: the batch's, or
        one per prompt (``interface.Seeds``)."""
        with self.gate.generating_scope():
            self.gate.check_usable()
            use_threads(self.num_threads)  # torch's thread count is per calling thread: a kept actor's other thread kept its own
            sp = SamplingParams(**params)
            out: list[dict] = []
            for start in range(0, len(prompts), self.max_batch_size):
                stop = start + self.max_batch_size
                out.extend(self._generate_chunk(prompts[start:stop], sp, chunk_seeds(seed, start, stop)))
        return out

    def _generate_chunk(self, prompts: list[list[int]], sp: SamplingParams, seed: Seeds) -> list[dict]:
        """One batch through our sampling loop (:func:`~.lean_decoder.sample`: the fused step for the Llama family,
        the model's own forward otherwise); the logprobs are those of the distribution sampled from, computed as
        the policy computes them; an in-flight refit lands between two decode steps."""
        start_version = self.weight_version
        swap_log = SwapLog(self)
        decode = exact_decoder(self.tokenizer_name) if sp.stop_strings and self.tokenizer_name else None
        drawn = sample_with_params(
            self.model, prompts, sp, self.eos_token_ids, self.pad_token_id, seed, between_steps=swap_log, decode=decode
        )
        return drawn.sample_dicts(prompts, start_version, swap_log.swaps)

    def update_weights(self, versioned_state: tuple[int, dict[str, torch.Tensor]] | WeightBuckets) -> int:
        """Load the policy's weights (a full state dict with tied weights, or :class:`WeightBuckets` streamed one
        bucket at a time), mid-generation if one is running; returns the new version. The names are checked against
        the model's first (:func:`~nemo_like.models.refit.manifest.check_manifest`), so a misnamed refit loads nothing; one
        that fails partway (a tensor of another shape) leaves the engine refusing to sample (:mod:`~..refit.gate`)."""
        names = versioned_state.all_names() if isinstance(versioned_state, WeightBuckets) else list(versioned_state[1])
        check_manifest(self.expected_names, names, "the HF engine")
        version = versioned_state.version if isinstance(versioned_state, WeightBuckets) else versioned_state[0]
        return self.gate.submit(lambda: self._load_weights(versioned_state), version)

    def busy_with(self) -> str | None:
        """A generate call of the last run still running (a kept actor is re-initialised only once it ended)."""
        return self.gate.busy_with()

    def mid_generation_updates(self) -> int:
        """How many refits were applied in the middle of a generate call."""
        return self.gate.mid_generation_updates

    def mid_generation_seconds(self) -> float:
        """Seconds a generate call spent loading those refits (inside the call's time, not decoding)."""
        return self.gate.mid_generation_seconds

    @torch.no_grad()
    def _load_weights(self, versioned_state: tuple[int, dict[str, torch.Tensor]] | WeightBuckets) -> int:
        use_threads(self.num_threads)
        if isinstance(versioned_state, WeightBuckets) and versioned_state.kind != "full":
            raise RuntimeError(f"HF generation serves plain weights; got a {versioned_state.kind!r} refit (LoRA refits are merged for it)")
        if isinstance(versioned_state, WeightBuckets):
            version, buckets, check_intact = versioned_state.version, versioned_state.iter_buckets(), versioned_state.check_intact
        else:
            version, buckets, check_intact = versioned_state[0], iter([versioned_state[1]]), lambda: None
        for bucket in buckets:  # their names were checked by update_weights
            self.model.load_state_dict(bucket, strict=False)
        check_intact()  # a shared-memory buffer rewritten while it was copied: a mix, raised (load_served_weights says so)
        self.weight_version = version
        return version
