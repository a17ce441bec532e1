"""The policy worker's forward passes: logprobs of a batch (policy, or the LoRA base as reference) and inline sampling.

A mixin of :class:`~nemo_like.models.policy.worker.PolicyWorker`; it reads the model and settings the worker built.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from nemo_like.distributed.threads import use_threads
from nemo_like.models import precision as precision_lib
from nemo_like.models import shared_prefix
from nemo_like.models.chunked_logprobs import model_token_logprobs_and_teacher_kl, model_token_logprobs_with_outside, teacher_head_inputs
from nemo_like.models.logprobs import SamplingDistribution, sequence_logprobs_with_outside
from nemo_like.models.policy import sharding
from nemo_like.models.policy.batching import MicroBatchPlan, pack_rows, packed_model_mask, take_rows, unpack_logprobs
from nemo_like.models.policy.rows import Batch
from nemo_like.plan.backend import INLINE_GENERATION_BATCH


class ForwardPasses:
    """Logprob passes over micro-batches, kept in step across the ranks of a sharded model, and inline sampling."""

    model: Any
    device: torch.device
    precision: str
    sampling: SamplingDistribution
    plan: MicroBatchPlan
    chunk_size: int | None
    shared_forward: bool
    lora_cfg: Any
    teacher_model: Any  # the KL term's frozen teacher copy (None: no KL term)
    teacher_kl: Any  # its TeacherKLSettings
    rank: int
    world_size: int
    weight_version: int
    forward_passes: dict[str, int]
    _dist_ready: bool

    def _agree_on_count(self, count: int) -> int:
        """The largest ``count`` over the ranks: sharded forwards/backwards are collectives, so every rank runs as many."""
        if self.world_size == 1:
            return count
        import torch.distributed as dist

        t = torch.tensor([count], dtype=torch.long, device=self.device)  # NCCL serves only device tensors
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    @staticmethod
    def _filler(batch: Batch) -> Batch:
        """A one-row micro-batch run by a rank that has fewer micro-batches than the others (its result is discarded)."""
        if batch["input_ids"].shape[0]:
            return take_rows(batch, [0])
        return {"input_ids": torch.zeros(1, 2, dtype=torch.long), "attention_mask": torch.ones(1, 2, dtype=torch.long)}

    def _token_logprobs(self, mb: Batch) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``[n, S]`` logprobs of a micro-batch, the ``[n, S]`` flags of tokens outside the sampler's kept set, and the
        tokens the forward ran through the transformer: the shared-prompt forward's flat tokens, else padded rows, or
        rows packed into one row and unpacked back."""
        with precision_lib.compute_context(self.device, self.precision, sharding.is_sharded(self.model)):
            return self._forward(mb)

    def _forward(self, mb: Batch) -> tuple[torch.Tensor, torch.Tensor, int]:
        ids, mask = mb["input_ids"].to(self.device), mb["attention_mask"].to(self.device)
        if self.shared_forward:
            return shared_prefix.shared_prefix_token_logprobs(self.model, ids, mask, mb.get("token_mask"), self.sampling, self.chunk_size)
        if self.plan.mode != "packed":
            lp, outside = sequence_logprobs_with_outside(self.model, ids, mask, self.sampling, self.chunk_size)
            return lp, outside, ids.numel()
        packed = pack_rows({"input_ids": ids, "attention_mask": mask}, dtype=precision_lib.compute_dtype(self.precision))
        lp, outside = model_token_logprobs_with_outside(
            self.model, packed.input_ids, packed_model_mask(packed, self.model.config, self.device), packed.position_ids, self.sampling,
            self.chunk_size,
        )  # fmt: skip
        computed = packed.input_ids.numel()
        return unpack_logprobs(lp, packed, ids.shape), unpack_logprobs(outside.float(), packed, ids.shape).bool(), computed

    def _token_logprobs_and_teacher_kl(self, mb: Batch) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """:meth:`_token_logprobs` and the ``[n, S]`` per-token KL to the teacher copy (the KL loss term), both from one
        student forward; the teacher runs first, without gradient, on the same (padded or packed) inputs."""
        ids, mask = mb["input_ids"].to(self.device), mb["attention_mask"].to(self.device)
        if self.plan.mode == "packed":
            packed = pack_rows({"input_ids": ids, "attention_mask": mask}, dtype=precision_lib.compute_dtype(self.precision))
            inputs = (packed.input_ids, packed_model_mask(packed, self.model.config, self.device), packed.position_ids)
        else:
            inputs = (ids, mask, (mask.long().cumsum(-1) - 1).clamp(min=0))
        teacher_inputs = inputs
        if self.plan.mode == "packed":  # the packed mask in the teacher's own compute dtype (SDPA refuses a mismatch)
            teacher_dtype = precision_lib.compute_dtype(self.teacher_kl.precision)
            teacher_row = replace(packed, attention_mask=packed.attention_mask.to(self.device, teacher_dtype))
            teacher_inputs = (packed.input_ids, packed_model_mask(teacher_row, self.teacher_model.config), packed.position_ids)
        teacher_sharded = sharding.is_sharded(self.teacher_model)
        with precision_lib.compute_context(self.device, self.teacher_kl.precision, teacher_sharded):
            teacher = teacher_head_inputs(self.teacher_model, *teacher_inputs, self.chunk_size, copy_head=teacher_sharded)
        with precision_lib.compute_context(self.device, self.precision, sharding.is_sharded(self.model)):
            lp, outside, kl = model_token_logprobs_and_teacher_kl(
                self.model, teacher, self.teacher_kl.term, *inputs, self.sampling, self.chunk_size
            )
        if self.plan.mode != "packed":
            valid = mask.bool()
            return lp * valid, outside & valid, ids.numel(), kl * valid
        shape = ids.shape
        unpacked = unpack_logprobs(lp, packed, shape), unpack_logprobs(outside.float(), packed, shape).bool()
        return *unpacked, packed.input_ids.numel(), unpack_logprobs(kl, packed, shape)

    # -- logprobs ----------------------------------------------------------------------------
    @torch.no_grad()
    def get_logprobs(self, batch: Batch, reference: bool = False) -> torch.Tensor:
        """``[B, S]`` logprobs of ``batch['input_ids']`` under the current weights; ``reference=True`` (LoRA only):
        under the base model, adapters disabled (the reference policy without a second copy of the weights)."""
        assert self._dist_ready
        use_threads(self.spec.logprob_threads or self.spec.num_threads)  # the phase may share the node with the reference
        if not reference:
            return self._logprobs(batch, "logprobs")
        if self.lora_cfg is None:
            raise RuntimeError("reference logprobs from the policy need policy.lora_cfg.enabled (the base model is the reference)")
        with self.model.disable_adapter():
            return self._logprobs(batch, "reference_logprobs")

    def _logprobs(self, batch: Batch, counter: str) -> torch.Tensor:
        self.model.eval()
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        groups = self.plan.groups(batch, training=False)
        for k in range(self._agree_on_count(len(groups))):
            if k >= len(groups):
                self._token_logprobs(self._filler(batch))
                continue
            mb = take_rows(batch, groups[k])
            lp, _, _ = self._token_logprobs(mb)
            out[torch.tensor(groups[k])[:, None], torch.arange(lp.shape[1])[None, :]] = lp.float().cpu()
            self.forward_passes[counter] += 1
        return out

    # -- inline generation --------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        params: dict,
        seed: int | list[int],
        pad_token_id: int,
        eos_token_ids: list[int],
        tokenizer_name: str | None = None,
    ) -> list[dict]:
        """Sample one response per prompt with this worker's own weights (the inline backend,
        :mod:`nemo_like.models.policy.inline`); returns :class:`GeneratedSample` fields as dicts. ``seed``: one for the
        batch, or one per prompt (:func:`~nemo_like.models.generation.interface.chunk_seeds`); ``tokenizer_name``: rows
        stop sampling at ``params``' stop strings (loaded once)."""
        use_threads(self.spec.num_threads)  # the worker's own count: it samples alone (after a shared logprob phase)
        from nemo_like.models.generation.interface import SamplingParams, chunk_seeds
        from nemo_like.models.generation.lean_decoder import sample_with_params
        from nemo_like.models.loading import exact_decoder

        if self.world_size != 1 or self.lora_cfg is not None:
            raise RuntimeError("inline generation needs a single, unsharded policy worker without LoRA")
        sp = SamplingParams(**params)
        decode = exact_decoder(tokenizer_name) if sp.stop_strings and tokenizer_name else None
        self.model.eval()
        out: list[dict] = []
        for start in range(0, len(prompts), INLINE_GENERATION_BATCH):
            chunk = prompts[start : start + INLINE_GENERATION_BATCH]
            with precision_lib.compute_context(self.device, self.precision, sharded=False):  # as the logprob passes
                seeds = chunk_seeds(seed, start, start + len(chunk))
                drawn = sample_with_params(self.model, chunk, sp, eos_token_ids, pad_token_id, seeds, decode=decode)
            out.extend(drawn.sample_dicts(chunk, self.weight_version))
        return out
