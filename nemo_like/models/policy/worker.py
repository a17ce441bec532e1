"""The policy worker: one Ray actor per rank. Logprobs, training, weight export.

Ranks of a group shard the model with FSDP2 (:mod:`.sharding`); micro-batches are fixed, token-budget
or packed (:mod:`.batching`). A reference worker is the same class with ``trainable=False``: frozen
initial weights, logprobs only.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from nemo_like.distributed.reinit import Reinitializable
from nemo_like.distributed.threads import apply_thread_count
from nemo_like.models import precision as precision_lib
from nemo_like.models import shared_prefix
from nemo_like.models.chunked_logprobs import model_token_logprobs_with_outside
from nemo_like.models.loading import load_causal_lm
from nemo_like.models.logprobs import SamplingDistribution, sequence_logprobs_with_outside
from nemo_like.models.policy import lora as lora_lib
from nemo_like.models.policy import sharding
from nemo_like.models.policy.batching import MicroBatchPlan, pack_rows, take_rows, unpack_logprobs

if TYPE_CHECKING:
    from nemo_like.algorithms.loss_functions import ClippedPGLossFn
    from nemo_like.config.schema import OptimizerConfig

Batch = dict[str, torch.Tensor]
#: Prompts sampled together by inline generation (bounds the KV cache of a large validation batch).
INLINE_GENERATION_BATCH = 256


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    """Rows ``start:stop`` of every per-sample tensor in ``batch`` (scalars are kept as they are)."""
    return {k: (v[start:stop] if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in batch.items()}


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes of this rank's part of ``t`` (its local shard for a DTensor)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


class PolicyWorker(Reinitializable):
    """One rank of the policy (or reference); with ``world_size > 1`` the model is sharded across the group
    once :meth:`setup_distributed` ran."""

    SETS_THREADS_ON_INIT = True  # a kept actor takes the next run's thread count (worker_group.Reinitializable)

    def __init__(
        self,
        rank: int,
        world_size: int,
        model_name: str,
        precision: str,
        temperature: float,
        num_threads: int,
        seed: int,
        trainable: bool = True,
        loss_fn: ClippedPGLossFn | None = None,
        optimizer: OptimizerConfig | None = None,
        warmup_steps: int = 0,
        max_grad_norm: float | None = None,
        train_micro_batch_size: int = 1,
        logprob_batch_size: int = 64,
        dtensor_cfg: dict[str, Any] | None = None,
        batching: dict[str, Any] | None = None,
        logprob_chunk_size: int | None = None,
        top_k: int | None = None,
        top_p: float = 1.0,
        lora_cfg: Any = None,
        shared_prompt_forward: str | bool = "auto",
    ) -> None:
        """``loss_fn``: the run's loss, built once by the driver (trainable workers); ``optimizer``: the validated
        ``policy.optimizer`` section; ``batching``: :class:`MicroBatchPlan` fields (default: fixed micro-batches of
        ``train_micro_batch_size`` / ``logprob_batch_size`` samples); ``dtensor_cfg``: the ``policy.dtensor_cfg`` keys;
        ``lora_cfg``: the validated ``policy.lora_cfg`` section (enabled: only adapters train, see :mod:`.lora`);
        ``shared_prompt_forward``: ``policy.shared_prompt_forward`` (:meth:`_choose_forward`)."""
        apply_thread_count(num_threads)
        torch.manual_seed(seed)
        self.release_shared_weights()  # a reused actor (reinit) drops its previous run's refit buffer
        self.rank, self.world_size = rank, world_size
        # Every pass (prev, reference, training) scores tokens under the sampler's processed
        # distribution: temperature, then top-k / top-p truncation, renormalised (models/logprobs.py).
        self.sampling = SamplingDistribution(temperature, top_k, top_p)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.dtensor_cfg = {
            "enabled": True,
            "cpu_offload": False,
            "activation_checkpointing": False,
            "tensor_parallel_size": 1,
            **(dtensor_cfg or {}),
        }
        self.tp_size = int(self.dtensor_cfg["tensor_parallel_size"])
        if world_size % self.tp_size:
            raise ValueError(f"{world_size} workers cannot form groups of tensor_parallel_size={self.tp_size}")
        self.dp_size = world_size // self.tp_size
        self.precision = precision
        self.lora_cfg = lora_cfg if lora_cfg is not None and lora_cfg.enabled else None
        # Master weights: fp32 whatever the compute precision (models/precision.py). A LoRA base never trains, so it
        # stays in the compute dtype (the adapters PEFT adds to it are fp32).
        weights_dtype = "float32" if self.lora_cfg is None else precision
        self.model = load_causal_lm(model_name, weights_dtype).to(self.device)
        if self.dtensor_cfg["activation_checkpointing"] and trainable:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora_cfg is not None:
            torch.manual_seed(seed)  # the same adapters on every rank (and in every run with this seed)
            self.model = lora_lib.apply_lora(self.model, self.lora_cfg)
        self.trainable = trainable
        self.plan = MicroBatchPlan(
            **(batching or {"mode": "fixed", "train_size": train_micro_batch_size, "logprob_size": logprob_batch_size})
        )
        self.chunk_size = logprob_chunk_size
        self.shared_forward = self._choose_forward(shared_prompt_forward)
        self.max_grad_norm = max_grad_norm
        self.weight_version = 0
        self.forward_passes = {"logprobs": 0, "train": 0, "reference_logprobs": 0}
        self._optimizer_cfg = optimizer
        self._warmup_steps = warmup_steps
        if trainable:
            if loss_fn is None or optimizer is None:
                raise ValueError("a trainable PolicyWorker needs the run's loss_fn and optimizer config")
            self.loss_fn = loss_fn
        else:
            self.model.requires_grad_(False)
        self._dist_ready = world_size == 1
        if self._dist_ready:
            self._build_optimizer()

    def _choose_forward(self, setting: str | bool) -> bool:
        """Whether logprobs and training run :func:`~nemo_like.models.shared_prefix.shared_prefix_token_logprobs`
        (each group's prompt computed once, no padding) instead of the model's own forward. ``auto``: where it applies,
        on CPU (on GPU it is untested; ``true`` turns it on there); ``true`` where it does not apply is an error."""
        if setting is False:
            self.forward_description = "the model's own (policy.shared_prompt_forward=false)"
            return False
        reasons = shared_prefix.blockers(
            self.model,
            self.world_size,
            self.lora_cfg is not None,
            bool(self.dtensor_cfg["activation_checkpointing"]),
            self.trainable,
        )
        if setting is True and reasons:
            raise ValueError(f"policy.shared_prompt_forward=true cannot apply: {'; '.join(reasons)} (use auto or false)")
        if not reasons and setting is not True and self.device.type != "cpu":
            reasons = ["auto keeps it off on GPU, where it is untested (policy.shared_prompt_forward=true turns it on)"]
        self.forward_description = (
            f"the model's own ({'; '.join(reasons)})"
            if reasons
            else f"shared-prompt: each group's prompt once, no padding (policy.shared_prompt_forward={setting})"
        )
        return not reasons

    def describe_forward(self) -> str:
        """How this worker's logprob and training passes run, and why (the run's ``[plan]`` lines)."""
        return self.forward_description

    def _build_optimizer(self) -> None:
        """AdamW over this rank's (possibly sharded) parameters: built after sharding, so its state is sharded too."""
        if not self.trainable:
            return
        opt = self._optimizer_cfg
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
        warmup = self._warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)) if warmup else 1.0
        )

    # -- distributed -------------------------------------------------------------------------
    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0's reachable address and a free port for the process group."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup_distributed(self, address: str, port: int) -> None:
        """Join the process group (gloo on CPU; NCCL for CUDA tensors and gloo for CPU ones on GPU, see
        :func:`~nemo_like.models.precision.process_group_backend`) and shard the model over it (FSDP2, bf16 compute
        over fp32 shards when ``precision`` is bfloat16)."""
        import torch.distributed as dist

        backend = precision_lib.process_group_backend(self.device.type)
        if dist.is_initialized():  # a re-initialised actor (reuse_actors) joins its new group
            dist.destroy_process_group()
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=self.rank, world_size=self.world_size)
        mesh = sharding.build_mesh(self.dp_size, self.tp_size, self.device.type)
        sharding.shard_model(
            self.model,
            mesh,
            cpu_offload=bool(self.dtensor_cfg["cpu_offload"]),
            mp_policy=precision_lib.fsdp_mixed_precision(self.precision),
        )
        self._build_optimizer()
        self._dist_ready = True

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

    # -- forward -----------------------------------------------------------------------------
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
            self.model, packed.input_ids, packed.attention_mask.to(self.device), packed.position_ids, self.sampling, self.chunk_size
        )
        computed = packed.input_ids.numel()
        return unpack_logprobs(lp, packed, ids.shape), unpack_logprobs(outside.float(), packed, ids.shape).bool(), computed

    # -- logprobs ----------------------------------------------------------------------------
    @torch.no_grad()
    def get_logprobs(self, batch: Batch, reference: bool = False) -> torch.Tensor:
        """``[B, S]`` logprobs of ``batch['input_ids']`` under the current weights; ``reference=True`` (LoRA only):
        under the base model, adapters disabled (the reference policy without a second copy of the weights)."""
        assert self._dist_ready
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
    def generate(self, prompts: list[list[int]], params: dict, seed: int, pad_token_id: int, eos_token_ids: list[int]) -> list[dict]:
        """Sample one response per prompt with this worker's own weights (the inline backend,
        :mod:`nemo_like.models.generation.inline`); returns :class:`GeneratedSample` fields as dicts."""
        from nemo_like.models.generation.interface import SamplingParams
        from nemo_like.models.generation.lean_decoder import sample_with_params

        if self.world_size != 1 or self.lora_cfg is not None:
            raise RuntimeError("inline generation needs a single, unsharded policy worker without LoRA")
        sp = SamplingParams(**params)
        self.model.eval()
        out: list[dict] = []
        for start in range(0, len(prompts), INLINE_GENERATION_BATCH):
            chunk = prompts[start : start + INLINE_GENERATION_BATCH]
            with precision_lib.compute_context(self.device, self.precision, sharded=False):  # as the logprob passes
                drawn = sample_with_params(self.model, chunk, sp, eos_token_ids, pad_token_id, seed + start)
            out.extend(drawn.sample_dicts(chunk, self.weight_version))
        return out

    # -- training ----------------------------------------------------------------------------
    def train(self, steps: list[Batch]) -> dict[str, Any]:
        """Run one optimizer step per element of ``steps`` (this rank's shard of each global batch).

        Each shard carries ``global_valid_toks`` / ``global_valid_seqs``: the counts over the whole
        global batch on all ranks, so per-microbatch losses add up to the global-batch loss.
        Returns the combined metric fragments of this rank, per-step grad norms, and the logprobs
        computed in the first step's forward passes (pre-update weights) for logging back-fill.
        """
        assert self.trainable and self._dist_ready
        self._restore_optimizer_state()
        self.model.train()
        fragments: list[dict[str, float]] = []
        grad_norms: list[float] = []
        skipped = 0
        forward_tokens = 0  # tokens the training forwards ran through the transformer (padding included)
        # FSDP2 averages gradients over the dp ranks; the losses are globally normalised, so the sum is wanted.
        grad_scale = float(self.dp_size) if sharding.is_sharded(self.model) else 1.0
        first_step_logprobs = torch.zeros(steps[0]["input_ids"].shape, dtype=torch.float32) if steps else None
        for step_idx, shard in enumerate(steps):
            self.optimizer.zero_grad(set_to_none=False)
            gseqs, gtoks = shard["global_valid_seqs"], shard["global_valid_toks"]
            groups = self.plan.groups(shard, training=True)
            for k in range(self._agree_on_count(len(groups))):
                if k >= len(groups):
                    (self._token_logprobs(self._filler(shard))[0].sum() * 0.0).backward()
                    continue
                mb = take_rows(shard, groups[k])
                curr, outside, computed = self._token_logprobs(mb)
                self.forward_passes["train"] += 1
                forward_tokens += computed
                mb = {key: (v.to(self.device) if torch.is_tensor(v) else v) for key, v in mb.items()}
                loss, metrics = self.loss_fn(curr, mb, gseqs, gtoks)
                metrics["outside_sampling_set_frac"] = self._outside_fraction(outside, mb, gtoks)
                (loss * grad_scale).backward()
                fragments.append(metrics)
                if step_idx == 0:
                    rows = torch.tensor(groups[k])[:, None]
                    first_step_logprobs[rows, torch.arange(curr.shape[1])[None, :]] = curr.detach().float().cpu()
            grad_norm = sharding.clip_grad_norm(list(self.model.parameters()), self.max_grad_norm)
            if math.isfinite(grad_norm):
                self.optimizer.step()
                self.scheduler.step()
            else:
                skipped += 1  # a NaN/inf gradient never reaches the weights
            grad_norms.append(grad_norm)
        self.weight_version += 1
        return {
            "metrics": self.loss_fn.combine_metrics(fragments),
            "grad_norms": grad_norms,
            "nonfinite_steps_skipped": skipped,
            "lr": self.scheduler.get_last_lr()[0],
            "first_step_logprobs": first_step_logprobs,
            "forward_passes": dict(self.forward_passes),
            "forward_tokens": forward_tokens,
        }

    # -- memory handed to a colocated engine -----------------------------------------------------------
    def release_memory(self, offload_optimizer: bool = True) -> dict[str, int]:
        """Hand device memory back before a colocated engine wakes (NeMo-RL's offload before refit): free the
        gradients, move the AdamW state to CPU (``offload_optimizer``; :meth:`train` brings it back) and return the
        allocator's cached blocks to the driver. Returns the bytes of gradients freed and optimizer state moved,
        and the device memory reserved before and after (0 on a CPU)."""
        reserved_before = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
        grads = sum(_local_bytes(p.grad) for p in self.model.parameters() if p.grad is not None)
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
                    moved += _local_bytes(value)
        return moved

    def _restore_optimizer_state(self) -> None:
        """Bring optimizer state offloaded by :meth:`release_memory` back beside its parameters."""
        if self.device.type != "cpu":
            self._move_optimizer_state(None)

    @staticmethod
    def _outside_fraction(outside: torch.Tensor, mb: Batch, global_valid_toks: torch.Tensor) -> float:
        """This micro-batch's fragment of the fraction of loss tokens outside the sampler's kept set
        (scored over kept set + token, see models/logprobs.py); sums to the global-batch fraction."""
        mask = mb["token_mask"] * mb["sample_mask"].unsqueeze(-1)
        return float((outside.float() * mask).sum()) / max(float(global_valid_toks), 1.0)

    # -- weights -----------------------------------------------------------------------------
    def get_state_dict(self, mode: str = "full") -> tuple[int, dict[str, torch.Tensor]]:
        """``(weight_version, full CPU state dict with tied weights)``: the whole model on rank 0, ``{}`` on the
        others (a collective: call it on every rank); ``mode`` as in :meth:`export_weight_buckets` (a LoRA policy's
        ``full`` is its PEFT state dict). Refit uses :meth:`export_weight_buckets` instead."""
        keep = self.rank == 0
        tensors = sharding.iter_full_tensors(self.model, keep) if mode == "full" else self._refit_tensors(mode, keep)
        state = dict(tensors)
        return self.weight_version, state if keep else {}

    def export_weight_buckets(self, bucket_mb: float, mode: str = "full") -> Any:
        """Gather the weights bucket by bucket (at most ``bucket_mb`` MB each) into Ray's object store;
        ``mode`` (see :func:`.lora.refit_mode`): ``full``, ``merged`` or ``adapter``.

        A collective: every rank gathers each bucket, only rank 0 keeps it (one bucket at a time:
        ``ray.put`` moves it out of this process). Rank 0 returns a
        :class:`~nemo_like.models.weight_buckets.WeightBuckets`; the other ranks ``None``."""
        import ray

        from nemo_like.models.weight_buckets import WeightBuckets

        keep = self.rank == 0
        names: list[list[str]] = []
        refs: list[Any] = []
        nbytes = 0
        for bucket in sharding.bucketize(self._refit_tensors(mode, keep), int(bucket_mb * 2**20)):
            if keep:
                names.append(list(bucket))
                nbytes += sum(t.numel() * t.element_size() for t in bucket.values())
                refs.append(ray.put(bucket))
                del bucket
        if not keep:
            return None
        adapter_config = lora_lib.adapter_config_dict(self.model) if mode == "adapter" else None
        return WeightBuckets(
            self.weight_version, names, refs, kind="adapter" if mode == "adapter" else "full", nbytes=nbytes, adapter_config=adapter_config
        )

    def _refit_tensors(self, mode: str, keep: bool):
        """What a refit sends: every weight (``full``), the merged weights under HF names (``merged``), or only the
        adapter tensors under PEFT's saved names (``adapter``)."""
        if self.lora_cfg is None:
            if mode != "full":
                raise ValueError(f"refit mode {mode!r} needs policy.lora_cfg.enabled")
            return self._in_engine_dtype(sharding.iter_full_tensors(self.model, keep))
        if mode == "adapter":  # adapters travel in fp32, as PEFT keeps them (the engine applies them in its dtype)
            tensors = sharding.iter_full_tensors(self.model, keep, include=lora_lib.is_adapter)
            return ((lora_lib.saved_name(n), t) for n, t in tensors)
        if mode == "merged":
            merged = lora_lib.merged_tensors(sharding.iter_full_tensors(self.model, keep), lora_lib.scaling(self.lora_cfg))
            return self._in_engine_dtype(merged)
        raise ValueError(f"a LoRA policy refits 'adapter' or 'merged' weights, not {mode!r}")

    def _in_engine_dtype(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The master weights cast to the dtype the generation engine holds (bf16 when ``precision`` is bfloat16)."""
        dtype = precision_lib.refit_dtype(self.precision)
        return ((name, t.to(dtype)) for name, t in tensors)

    def export_shared_weights(self, fresh: bool) -> Any:
        """Write the weights into this rank's shared-memory refit buffer (one-node CPU clusters, see
        :mod:`nemo_like.models.shared_weights`); a new buffer file when ``fresh``. A collective when sharded:
        every rank gathers, rank 0 writes and returns the :class:`SharedWeights`, the others ``None``."""
        from nemo_like.models.shared_weights import SharedWeightWriter

        if sharding.is_sharded(self.model):
            tensors = sharding.iter_full_tensors(self.model, keep=self.rank == 0)
        else:  # the parameters themselves: one copy, straight into the buffer
            tensors = ((name, t.detach()) for name, t in self.model.state_dict(keep_vars=True).items())
        tensors = list(self._in_engine_dtype(tensors))
        if self.rank != 0:
            return None
        if getattr(self, "_shared_writer", None) is None:
            self._shared_writer = SharedWeightWriter()
        return self._shared_writer.write(self.weight_version, tensors, fresh=fresh)

    def release_shared_weights(self) -> None:
        """Unlink the shared-memory refit buffer (the run is over)."""
        if getattr(self, "_shared_writer", None) is not None:
            self._shared_writer.close()

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, directory: str) -> dict[str, Any]:
        """Rank 0 writes ``policy/`` (HF format, gathered from the shards) and ``optimizer.pt`` (optimizer state
        keyed by parameter name, independent of the sharding); every rank returns its RNG state.
        A collective: call it on every rank."""
        from pathlib import Path

        from safetensors.torch import save_file

        if self.lora_cfg is not None:
            return self._save_adapter_checkpoint(Path(directory))
        weights = sharding.gather_model_state(self.model)
        optim = sharding.gather_optimizer_state(self.model, self.optimizer)
        if self.rank == 0:
            path = Path(directory) / "policy"
            path.mkdir(parents=True, exist_ok=True)
            if getattr(self.model.config, "tie_word_embeddings", False):
                weights.pop("lm_head.weight", None)  # HF convention: the tied head is not stored
            save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
            self.model.config.save_pretrained(path)
            if getattr(self.model, "generation_config", None) is not None:
                self.model.generation_config.save_pretrained(path)
            self._save_optimizer(Path(directory), optim)
        return self._rng_state()

    def _save_optimizer(self, directory: Any, optim: dict[str, Any]) -> None:
        torch.save(
            {"optimizer": optim, "scheduler": self.scheduler.state_dict(), "weight_version": self.weight_version},
            directory / "optimizer.pt",
        )

    @staticmethod
    def _rng_state() -> dict[str, Any]:
        return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}

    def _save_adapter_checkpoint(self, directory: Any) -> dict[str, Any]:
        """LoRA: ``policy/`` is a PEFT adapter directory (``PeftModel.from_pretrained`` loads it onto the base model)
        and ``optimizer.pt`` holds the adapters' optimizer state only."""
        adapters = dict(self._refit_tensors("adapter", keep=self.rank == 0))
        optim = sharding.gather_optimizer_state(self.model, self.optimizer)
        if self.rank == 0:
            lora_lib.write_adapter(directory / "policy", adapters, lora_lib.adapter_config_dict(self.model))
            self._save_optimizer(directory, optim)
        return self._rng_state()

    def load_checkpoint(self, directory: str, rng_state: dict[str, Any] | None) -> int:
        """Load weights, optimizer, scheduler and RNG state saved by :meth:`save_checkpoint` (every rank reads the
        files and keeps its own shard)."""
        from pathlib import Path

        from safetensors.torch import load_file

        path = Path(directory)
        if self.lora_cfg is not None:
            saved = load_file(str(path / "policy" / lora_lib.ADAPTER_WEIGHTS))
            missing, unexpected = sharding.load_model_state(self.model, {lora_lib.model_name(k): v for k, v in saved.items()})
            missing = [k for k in missing if lora_lib.is_adapter(k)]  # the frozen base comes from policy.model_name
        else:
            weights = load_file(str(path / "policy" / "model.safetensors"))
            tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
            missing, unexpected = sharding.load_model_state(self.model, weights)
            missing = sorted(set(missing) - tied)
        if unexpected or missing:
            raise RuntimeError(f"checkpoint {path} does not match the model: missing={missing} unexpected={unexpected}")
        state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)
        sharding.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.weight_version = state["weight_version"]
        if rng_state is not None:
            torch.set_rng_state(rng_state["torch"])
            if rng_state.get("cuda") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng_state["cuda"])
        return self.weight_version

    def parameter_checksum(self) -> float:
        """Sum of all parameters (of the full model, summed over the shards: a collective when sharded)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # NCCL serves only device tensors
        for p in self.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.detach().double().sum().to(self.device)
        if sharding.is_sharded(self.model):
            import torch.distributed as dist

            dist.all_reduce(total)
        return float(total)

    def memory_footprint(self) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients and optimizer state (its shards only)."""

        params = sum(_local_bytes(p) for p in self.model.parameters())
        grads = sum(_local_bytes(p.grad) for p in self.model.parameters() if p.grad is not None)
        optim = 0
        if self.trainable:
            for st in self.optimizer.state.values():
                optim += sum(_local_bytes(v) for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
        return {"params": params, "grads": grads, "optimizer": optim}

    def parameter_counts(self) -> dict[str, int]:
        """Trainable and total parameters of the full model (see :func:`.lora.parameter_counts`)."""
        return lora_lib.parameter_counts(self.model)

    def get_forward_pass_counts(self) -> dict[str, int]:
        """Forward passes run by this worker so far, by kind."""
        return dict(self.forward_passes)

    # -- GPU weight refit into vLLM (untested on GPU in this repository; see vllm_gpu_refit.py) -----
    def device_info(self) -> dict[str, Any]:
        """This worker's Ray node id and address, Ray GPU ids and CUDA device UUID (None on CPU)."""
        import ray

        from nemo_like.models.generation.vllm_gpu_refit import device_uuid

        on_gpu = self.device.type == "cuda"
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "gpu_ids": ray.get_gpu_ids(),
            "uuid": device_uuid() if on_gpu else None,
        }

    def ipc_handles(self) -> tuple[list[str], dict[str, Any]]:
        """``(names, {device_uuid: {name: CUDA-IPC handle}})`` of every tensor; the tensors (a bf16 copy when the
        master weights are fp32) stay referenced until :meth:`release_ipc_tensors` once the engine has copied them."""
        from nemo_like.models.generation.vllm_gpu_refit import policy_ipc_handles

        self._ipc_tensors = self._engine_state()
        return list(self._ipc_tensors), policy_ipc_handles(self._ipc_tensors)

    def release_ipc_tensors(self) -> None:
        """Drop the tensors behind the last IPC handles (the engine has reloaded them into its own memory), so a
        bf16 copy of the weights does not sit on the GPU through generation."""
        self._ipc_tensors = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _engine_state(self) -> dict[str, torch.Tensor]:
        """Every state-dict tensor in the engine's dtype (the parameters themselves when the dtypes agree)."""
        return dict(self._in_engine_dtype((k, v.detach()) for k, v in self.model.state_dict().items()))

    def weight_manifest(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """``(name, dtype, shape)`` of every tensor :meth:`broadcast_weights` sends, in order."""
        from nemo_like.models.generation.vllm_gpu_refit import build_manifest

        return build_manifest(self._engine_state())

    def init_weight_broadcast_group(self, address: str, port: int, world_size: int) -> None:
        """Create the NCCL group (this worker is rank 0) used to broadcast weights to vLLM workers."""
        from nemo_like.models.generation.vllm_gpu_refit import stateless_nccl_group

        self._weight_group = stateless_nccl_group(address, port, 0, world_size, self.device)

    def broadcast_weights(self) -> int:
        """Broadcast every tensor of :meth:`weight_manifest` to the vLLM workers; returns the count."""
        from nemo_like.models.generation.vllm_gpu_refit import policy_broadcast

        return policy_broadcast(self._weight_group, self._engine_state())
