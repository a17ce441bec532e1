"""The policy worker's training: the optimizer, one ``train`` call (optimizer steps over micro-batches), and the
memory it hands to a colocated engine between steps (:meth:`TrainingStep.release_memory`).

A mixin of :class:`~nemo_like.models.policy.worker.PolicyWorker`; the loss comes in through the worker's spec
(:class:`~nemo_like.models.policy.loss_protocol.LossFunction`).
"""

from __future__ import annotations

import gc
import math
from typing import Any

import torch

from nemo_like.distributed.threads import use_threads
from nemo_like.models.policy import sharding
from nemo_like.models.policy.batching import MicroBatchPlan, take_rows
from nemo_like.models.policy.loss_protocol import LossFunction
from nemo_like.models.policy.spec import PolicyWorkerSpec

Batch = dict[str, torch.Tensor]


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of this rank's part of ``t`` (its local shard for a DTensor)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


class TrainingStep:
    """AdamW over this rank's parameters, globally normalised gradient accumulation, clipping and the LR schedule."""

    spec: PolicyWorkerSpec
    model: Any
    device: torch.device
    plan: MicroBatchPlan
    trainable: bool
    dp_size: int
    max_grad_norm: float | None
    loss_fn: LossFunction
    teacher_model: Any
    teacher_kl: Any
    weight_version: int
    forward_passes: dict[str, int]
    _dist_ready: bool

    def _build_optimizer(self) -> None:
        """AdamW over this rank's (possibly sharded) parameters: built after sharding, so its state is sharded too."""
        if not self.trainable:
            return
        opt = self.spec.optimizer
        # fused: one kernel over all parameters; on a CPU it is 4-6x faster than the per-tensor-list (foreach)
        # implementation (docs/guides/performance.md), and the same update up to float rounding.
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=opt.lr,
            weight_decay=opt.weight_decay,
            betas=tuple(opt.betas),
            eps=opt.eps,
            fused=True,
        )
        warmup = self.spec.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)) if warmup else 1.0
        )

    def apply_optimizer_settings(self) -> None:
        """The configured lr, weight decay, betas and eps over a restored optimizer and schedule: a resumed run may
        change them (docs/guides/checkpointing.md); the moments and the step count stay the checkpoint's."""
        opt = self.spec.optimizer
        for group in self.optimizer.param_groups:
            group.update(initial_lr=opt.lr, weight_decay=opt.weight_decay, betas=tuple(opt.betas), eps=opt.eps)
        self.scheduler.base_lrs = [opt.lr for _ in self.optimizer.param_groups]
        for group, factor in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            group["lr"] = opt.lr * factor(self.scheduler.last_epoch)
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]  # what get_last_lr() reports

    def train(self, steps: list[Batch]) -> dict[str, Any]:
        """Run one optimizer step per element of ``steps`` (this rank's shard of each global batch).

        Each shard carries ``global_valid_toks`` / ``global_valid_seqs``: the counts over the whole
        global batch on all ranks, so per-microbatch losses add up to the global-batch loss.
        Returns the combined metric fragments of this rank, the pre-clip grad norms of the steps that updated the
        weights (a skipped step, empty or non-finite, is counted in ``empty_steps_skipped`` /
        ``nonfinite_steps_skipped`` instead), and the logprobs
        computed in the first step's forward passes (pre-update weights) for logging back-fill (None when that step
        was skipped: no forward ran).

        A step with no token to train on (``global_valid_toks`` 0: the driver's masks took every row out) is skipped
        whole, on every rank alike: its zero gradient would still move AdamW's weights by their momentum and decay,
        advance the schedule, and count as a zero in the call's loss mean.
        """
        use_threads(self.spec.num_threads)  # training runs alone: all of the worker's threads (see logprob_threads)
        assert self.trainable and self._dist_ready
        self._restore_optimizer_state()
        self.model.train()
        per_step: list[dict[str, float]] = []  # each optimizer step's metrics (its fragments combined)
        grad_norms: list[float] = []
        skipped = empty = 0
        forward_tokens = 0  # tokens the training forwards ran through the transformer (padding included)
        trained_tokens = 0  # tokens of the optimizer steps that ran (an empty step's rows computed nothing)
        first_step_logprobs = torch.zeros(steps[0]["input_ids"].shape, dtype=torch.float32) if steps else None
        step_counts = [counts for counts in step_valid_counts(steps) if counts["tokens"] > 0]
        for step_idx, shard in enumerate(steps):
            if float(shard["global_valid_toks"]) == 0:
                empty += 1
                if step_idx == 0:
                    first_step_logprobs = None  # no forward ran: no pre-update logprobs to report
                continue
            self.optimizer.zero_grad(set_to_none=False)
            trained_tokens += int(shard["attention_mask"].sum())
            fragments: list[dict[str, float]] = []
            forward_tokens += self._accumulate_gradients(shard, fragments, first_step_logprobs if step_idx == 0 else None)
            per_step.append(self.loss_fn.combine_metrics(fragments))
            grad_norm = sharding.clip_grad_norm(list(self.model.parameters()), self.max_grad_norm)
            if math.isfinite(grad_norm):
                self.optimizer.step()
                self.scheduler.step()
                grad_norms.append(grad_norm)
            else:
                # a NaN/inf gradient never reaches the weights; counted in nonfinite_steps_skipped, its norm left out of
                # grad_norms (the logged train/grad_norm, their mean, was NaN for the whole call)
                skipped += 1
        self.weight_version += 1
        return {
            "metrics": self.loss_fn.combine_steps(per_step, step_counts=step_counts) if per_step else {},
            "grad_norms": grad_norms,
            "nonfinite_steps_skipped": skipped,
            "empty_steps_skipped": empty,
            "lr": self.scheduler.get_last_lr()[0],
            "first_step_logprobs": first_step_logprobs,
            "forward_passes": dict(self.forward_passes),
            "forward_tokens": forward_tokens,
            "trained_tokens": trained_tokens,
        }

    def _accumulate_gradients(self, shard: Batch, fragments: list[dict[str, float]], logprobs_out: torch.Tensor | None) -> int:
        """Forward and backward every micro-batch of one optimizer step's ``shard``, appending its metric fragments to
        ``fragments`` and (first step) its logprobs to ``logprobs_out``; returns the tokens the forwards computed."""
        # FSDP2 averages gradients over the dp ranks; the losses are globally normalised, so the sum is wanted.
        grad_scale = float(self.dp_size) if sharding.is_sharded(self.model) else 1.0
        gseqs, gtoks = shard["global_valid_seqs"], shard["global_valid_toks"]
        groups = self.plan.groups(shard, training=True)
        forward_tokens = 0
        for k in range(self._agree_on_count(len(groups))):
            if k >= len(groups):  # the teacher copy's forward, if any, is a collective too when sharded
                lp, _, _, kl = self._training_forward(self._filler(shard))
                ((lp.sum() if kl is None else lp.sum() + kl.sum()) * 0.0).backward()
                continue
            mb = take_rows(shard, groups[k])
            curr, outside, computed, kl = self._training_forward(mb)
            self.forward_passes["train"] += 1
            forward_tokens += computed
            mb = {key: (v.to(self.device) if torch.is_tensor(v) else v) for key, v in mb.items()}
            loss, metrics = self.loss_fn(curr, mb, gseqs, gtoks)
            metrics["outside_sampling_set_frac"] = self._outside_fraction(outside, mb, gtoks)
            if kl is not None:
                loss = loss + self._add_teacher_kl(kl, mb, gtoks, metrics)
            (loss * grad_scale).backward()
            fragments.append(metrics)
            if logprobs_out is not None:
                rows = torch.tensor(groups[k])[:, None]
                logprobs_out[rows, torch.arange(curr.shape[1])[None, :]] = curr.detach().float().cpu()
        return forward_tokens

    def _training_forward(self, mb: Batch) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
        """:meth:`_token_logprobs` of a training micro-batch, and its per-token KL to the teacher copy when the KL loss
        term is on (``None`` otherwise)."""
        if self.teacher_model is None:
            return (*self._token_logprobs(mb), None)
        return self._token_logprobs_and_teacher_kl(mb)

    def _add_teacher_kl(self, kl: torch.Tensor, mb: Batch, global_valid_toks: torch.Tensor, metrics: dict[str, float]) -> torch.Tensor:
        """The KL loss term's part of this micro-batch: ``kl_weight x sum(KL_t over its loss tokens) / global_valid_toks``
        (global token normalisation: the micro-batches and ranks add up to the global-batch mean, whatever the loss's
        own aggregation). Adds its fragments to ``metrics``: ``loss`` (now with the term) and ``distillation/kl_loss``
        (the unweighted token mean)."""
        mask = mb["token_mask"] * mb["sample_mask"].unsqueeze(-1)
        mean = (kl * mask).sum() / torch.as_tensor(global_valid_toks, device=kl.device).clamp(min=1)
        term = self.teacher_kl.weight * mean
        metrics["loss"] += float(term.detach())
        metrics["distillation/kl_loss"] = float(mean.detach())
        return term

    @staticmethod
    def _outside_fraction(outside: torch.Tensor, mb: Batch, global_valid_toks: torch.Tensor) -> float:
        """This micro-batch's fragment of the fraction of loss tokens outside the sampler's kept set
        (scored over kept set + token, see models/logprobs.py); sums to the global-batch fraction."""
        mask = mb["token_mask"] * mb["sample_mask"].unsqueeze(-1)
        return float((outside.float() * mask).sum()) / max(float(global_valid_toks), 1.0)

    # -- memory handed to a colocated engine -----------------------------------------------------------
    def release_memory(self, offload_optimizer: bool = True) -> dict[str, int]:
        """Hand device memory back before a colocated engine wakes (NeMo-RL's offload before refit): free the
        gradients, move the AdamW state to CPU (``offload_optimizer``; :meth:`train` brings it back) and return the
        allocator's cached blocks to the driver. Returns the bytes of gradients freed and optimizer state moved,
        and the device memory reserved before and after (0 on a CPU)."""
        reserved_before = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
        grads = sum(local_bytes(p.grad) for p in self.model.parameters() if p.grad is not None)
        moved = 0
        self._ipc_tensors = None  # a refit's bf16 copy, if one is still held
        if self.trainable:
            self.optimizer.zero_grad(set_to_none=True)
            if offload_optimizer and self.device.type != "cpu":
                moved = self._move_optimizer_state(torch.device("cpu"))
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        reserved_after = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
        return {"grads_freed": grads, "optimizer_offloaded": moved, "reserved_before": reserved_before, "reserved_after": reserved_after}

    def _move_optimizer_state(self, device: torch.device | None) -> int:
        """Move every optimizer state tensor (the moments; AdamW's step counters stay) to ``device``, or back to its
        parameter's device (``None``: where FSDP2's CPU offload keeps a shard, that is the CPU). Returns the bytes moved."""
        moved = 0
        for param, state in self.optimizer.state.items():
            target = device or (param.to_local() if hasattr(param, "to_local") else param).device
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0 and value.device != target:
                    state[key] = value.to(target)
                    moved += local_bytes(value)
        return moved

    def _restore_optimizer_state(self) -> None:
        """Bring optimizer state offloaded by :meth:`release_memory` back beside its parameters."""
        if self.device.type != "cpu":
            self._move_optimizer_state(None)


def step_valid_counts(steps: list[Batch]) -> list[dict[str, float]]:
    """Each optimizer step's global counts of valid ``tokens`` and ``sequences`` (every rank's shard of the step carries
    them): they weigh the step's metrics in the train call's, a mean over the call's tokens, not over its steps."""
    return [{"tokens": float(s["global_valid_toks"]), "sequences": float(s["global_valid_seqs"])} for s in steps]
