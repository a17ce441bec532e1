"""Generation with Hugging Face transformers ``generate`` inside a Ray actor (the light backend)."""

from __future__ import annotations

from dataclasses import asdict

import torch

from nemo_like.distributed.worker_group import Reinitializable
from nemo_like.models.generation.interface import GeneratedSample, SamplingParams
from nemo_like.models.generation.lean_decoder import left_padded
from nemo_like.models.generation.weight_gate import WeightUpdateGate
from nemo_like.models.loading import load_causal_lm
from nemo_like.models.logprobs import SamplingDistribution, processed_token_logprobs
from nemo_like.models.weight_buckets import WeightBuckets


def first_stop_index(tokens: list[int], stop_ids: set[int]) -> int | None:
    """Index of the first stop token in ``tokens``, or ``None``."""
    for i, tok in enumerate(tokens):
        if tok in stop_ids:
            return i
    return None


def sampling_distribution(sp: SamplingParams) -> SamplingDistribution:
    """The distribution ``generate`` samples from under ``sp`` (greedy: the plain softmax of the logits)."""
    if sp.greedy:
        return SamplingDistribution()
    return SamplingDistribution(sp.temperature, sp.top_k, sp.top_p)


class WeightSwapPoint:
    """A logits processor that does not change the scores: it is HF ``generate``'s per-step hook, where
    an in-flight refit is applied. The scores of this step (and so the token sampled now) come from
    the old weights; the next forward pass uses the new ones."""

    def __init__(self, worker: HFGenerationWorker, prompt_width: int) -> None:
        self.worker, self.prompt_width = worker, prompt_width
        self.swaps: list[tuple[int, int]] = []  # (first response position produced by the new weights, version)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.worker.gate.apply_pending():
            self.swaps.append((input_ids.shape[1] - self.prompt_width + 1, self.worker.weight_version))
        return scores

    def version_of_position(self, position: int, start_version: int) -> int:
        version = start_version
        for first_position, swapped_to in self.swaps:
            if position >= first_position:
                version = swapped_to
        return version


class HFGenerationWorker(Reinitializable):
    """One replica of the model used for sampling; weights are replaced by :meth:`update_weights`
    (mid-generation when the actor runs with ``max_concurrency=2``, see :mod:`.weight_gate`)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        model_name: str,
        precision: str,
        num_threads: int,
        pad_token_id: int,
        eos_token_ids: list[int],
        max_batch_size: int = 256,
    ) -> None:
        torch.set_num_threads(num_threads)
        self.rank = rank
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.model = load_causal_lm(model_name, precision).to(self.device).eval()
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.max_batch_size = max_batch_size
        self.weight_version = 0
        self.gate = WeightUpdateGate()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: dict, seed: int) -> list[dict]:
        """Sample one response per prompt; returns :class:`GeneratedSample` fields as dicts."""
        sp = SamplingParams(**params)
        out: list[dict] = []
        with self.gate.generating_scope():
            for start in range(0, len(prompts), self.max_batch_size):
                torch.manual_seed(seed + start)
                out.extend(self._generate_chunk(prompts[start : start + self.max_batch_size], sp))
        return out

    def _generate_chunk(self, prompts: list[list[int]], sp: SamplingParams) -> list[dict]:
        from transformers import GenerationConfig, LogitsProcessorList

        start_version = self.weight_version
        input_ids, prompt_mask = left_padded(prompts, self.pad_token_id)  # every prompt ends at the same column
        width, attention = input_ids.shape[1], prompt_mask.long()
        stop_ids = [*self.eos_token_ids, *sp.stop_token_ids]
        gen_cfg = GenerationConfig(
            do_sample=not sp.greedy,
            temperature=None if sp.greedy else sp.temperature,
            top_p=None if sp.greedy else sp.top_p,
            top_k=None if sp.greedy else (sp.top_k or 0),
            max_new_tokens=sp.max_new_tokens,
            eos_token_id=stop_ids,
            pad_token_id=self.pad_token_id,
            use_cache=True,
            output_logits=True,
            return_dict_in_generate=True,
        )
        swap_point = WeightSwapPoint(self, width)
        result = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention.to(self.device),
            generation_config=gen_cfg,
            logits_processor=LogitsProcessorList([swap_point]),
        )
        new_tokens = result.sequences[:, width:].cpu()
        # Raw logits per step -> logprobs of the sampled tokens under the distribution generate sampled
        # from (temperature, top-k, top-p, renormalised), computed as the policy computes them.
        logits = torch.stack(result.logits, dim=1).cpu()
        token_lp = processed_token_logprobs(logits, new_tokens, sampling_distribution(sp))
        samples = []
        stop_set = set(stop_ids)
        for i, prompt in enumerate(prompts):
            tokens = new_tokens[i].tolist()
            stop = first_stop_index(tokens, stop_set)
            length = len(tokens) if stop is None else stop + 1
            sample = GeneratedSample(
                prompt_ids=list(prompt),
                response_ids=tokens[:length],
                response_logprobs=token_lp[i, :length].tolist(),
                truncated=stop is None,
                weight_version=start_version,
                final_weight_version=swap_point.version_of_position(length - 1, start_version),
            )
            samples.append(asdict(sample))
        return samples

    def update_weights(self, versioned_state: tuple[int, dict[str, torch.Tensor]] | WeightBuckets) -> int:
        """Load the policy's weights (a full state dict with tied weights, or :class:`WeightBuckets` streamed one
        bucket at a time), mid-generation if one is running; returns the new version."""
        return self.gate.submit(lambda: self._load_weights(versioned_state))

    def mid_generation_updates(self) -> int:
        """How many refits were applied in the middle of a generate call."""
        return self.gate.mid_generation_updates

    @torch.no_grad()
    def _load_weights(self, versioned_state: tuple[int, dict[str, torch.Tensor]] | WeightBuckets) -> int:
        if isinstance(versioned_state, WeightBuckets) and versioned_state.kind != "full":
            raise RuntimeError(f"HF generation serves plain weights; got a {versioned_state.kind!r} refit (LoRA refits are merged for it)")
        if isinstance(versioned_state, WeightBuckets):
            version, buckets = versioned_state.version, versioned_state.iter_buckets()
        else:
            version, buckets = versioned_state[0], iter([versioned_state[1]])
        expected = set(self.model.state_dict())
        received: set[str] = set()
        for bucket in buckets:
            unexpected = set(bucket) - expected
            if unexpected:
                raise RuntimeError(f"Refit manifest mismatch: unexpected={sorted(unexpected)}")
            self.model.load_state_dict(bucket, strict=False)
            received.update(bucket)
        missing = [k for k in expected - received if not k.endswith("rotary_emb.inv_freq")]
        if missing:
            raise RuntimeError(f"Refit manifest mismatch: missing={sorted(missing)} unexpected=[]")
        self.weight_version = version
        return version
