"""The policy worker: one Ray actor per data-parallel rank. Logprobs, training, weight export.

A reference worker is the same class with ``trainable=False``: frozen initial weights, logprobs only.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nemo_like.algorithms.loss_functions import ClippedPGLossFn, combine_metric_fragments
from nemo_like.config.loss import ClippedPGLossConfig
from nemo_like.distributed.worker_group import Reinitializable
from nemo_like.models.loading import full_state_dict, load_causal_lm
from nemo_like.models.logprobs import SamplingDistribution, sequence_logprobs_with_outside

Batch = dict[str, torch.Tensor]


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    """Rows ``start:stop`` of every per-sample tensor in ``batch`` (scalars are kept as they are)."""
    return {k: (v[start:stop] if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in batch.items()}


def trim_padding(batch: Batch) -> Batch:
    """Drop trailing columns that are padding in every row (cheaper forward passes)."""
    length = int(batch["attention_mask"].sum(-1).max().item())
    return {k: (v[:, :length] if torch.is_tensor(v) and v.dim() == 2 else v) for k, v in batch.items()}


class PolicyWorker(Reinitializable):
    """Holds one replica of the model; ranks of a group share gradients through torch.distributed."""

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
        loss_config: dict[str, Any] | None = None,
        optimizer: dict[str, Any] | None = None,
        warmup_steps: int = 0,
        max_grad_norm: float | None = None,
        train_micro_batch_size: int = 1,
        logprob_batch_size: int = 64,
        top_k: int | None = None,
        top_p: float = 1.0,
    ) -> None:
        torch.set_num_threads(num_threads)
        torch.manual_seed(seed)
        self.rank, self.world_size = rank, world_size
        # Every pass (prev, reference, training) scores tokens under the sampler's processed
        # distribution: temperature, then top-k / top-p truncation, renormalised (models/logprobs.py).
        self.sampling = SamplingDistribution(temperature, top_k, top_p)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.model = load_causal_lm(model_name, precision).to(self.device)
        self.trainable = trainable
        self.micro_batch_size = train_micro_batch_size
        self.logprob_batch_size = logprob_batch_size
        self.max_grad_norm = max_grad_norm
        self.weight_version = 0
        self.forward_passes = {"logprobs": 0, "train": 0}
        if trainable:
            self.loss_fn = ClippedPGLossFn(ClippedPGLossConfig.model_validate(loss_config or {}))
            opt = optimizer or {}
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(),
                lr=opt.get("lr", 1e-5),
                weight_decay=opt.get("weight_decay", 0.0),
                betas=tuple(opt.get("betas", (0.9, 0.999))),
                eps=opt.get("eps", 1e-8),
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lambda step: min(1.0, (step + 1) / (warmup_steps + 1)) if warmup_steps else 1.0
            )
        else:
            self.model.requires_grad_(False)
        self._dist_ready = world_size == 1

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
        """Join the data-parallel process group (gloo on CPU, nccl on GPU)."""
        import torch.distributed as dist

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if dist.is_initialized():  # a re-initialised actor (reuse_actors) joins its new group
            dist.destroy_process_group()
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=self.rank, world_size=self.world_size)
        self._dist_ready = True

    def _all_reduce_gradients(self) -> None:
        import torch.distributed as dist

        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)  # losses are globally normalised: SUM is the mean
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    # -- logprobs ----------------------------------------------------------------------------
    @torch.no_grad()
    def get_logprobs(self, batch: Batch) -> torch.Tensor:
        """``[B, S]`` logprobs of ``batch['input_ids']`` under the current weights."""
        self.model.eval()
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        for start in range(0, batch["input_ids"].shape[0], self.logprob_batch_size):
            mb = trim_padding(slice_batch(batch, start, start + self.logprob_batch_size))
            ids, mask = mb["input_ids"].to(self.device), mb["attention_mask"].to(self.device)
            lp, _ = sequence_logprobs_with_outside(self.model, ids, mask, self.sampling)
            out[start : start + lp.shape[0], : lp.shape[1]] = lp.float().cpu()
            self.forward_passes["logprobs"] += 1
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
        self.model.train()
        fragments: list[dict[str, float]] = []
        grad_norms: list[float] = []
        skipped = 0
        first_step_logprobs = torch.zeros(steps[0]["input_ids"].shape, dtype=torch.float32) if steps else None
        for step_idx, shard in enumerate(steps):
            self.optimizer.zero_grad(set_to_none=False)
            gseqs, gtoks = shard["global_valid_seqs"], shard["global_valid_toks"]
            for start in range(0, shard["input_ids"].shape[0], self.micro_batch_size):
                mb = trim_padding(slice_batch(shard, start, start + self.micro_batch_size))
                mb = {k: (v.to(self.device) if torch.is_tensor(v) else v) for k, v in mb.items()}
                curr, outside = sequence_logprobs_with_outside(self.model, mb["input_ids"], mb["attention_mask"], self.sampling)
                self.forward_passes["train"] += 1
                loss, metrics = self.loss_fn(curr, mb, gseqs, gtoks)
                metrics["outside_sampling_set_frac"] = self._outside_fraction(outside, mb, gtoks)
                loss.backward()
                fragments.append(metrics)
                if step_idx == 0:
                    first_step_logprobs[start : start + curr.shape[0], : curr.shape[1]] = curr.detach().float().cpu()
            if self.world_size > 1:
                self._all_reduce_gradients()
            grad_norm = self._grad_norm()
            if math.isfinite(grad_norm):
                if self.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
                self.optimizer.step()
                self.scheduler.step()
            else:
                skipped += 1  # a NaN/inf gradient never reaches the weights
            grad_norms.append(grad_norm)
        self.weight_version += 1
        return {
            "metrics": combine_metric_fragments(fragments, self.loss_fn.metric_reduction),
            "grad_norms": grad_norms,
            "nonfinite_steps_skipped": skipped,
            "lr": self.scheduler.get_last_lr()[0],
            "first_step_logprobs": first_step_logprobs,
        }

    @staticmethod
    def _outside_fraction(outside: torch.Tensor, mb: Batch, global_valid_toks: torch.Tensor) -> float:
        """This microbatch's fragment of the fraction of loss tokens outside the sampler's kept set
        (scored over kept set + token, see models/logprobs.py); sums to the global-batch fraction."""
        mask = mb["token_mask"] * mb["sample_mask"].unsqueeze(-1)
        return float((outside.float() * mask).sum()) / max(float(global_valid_toks), 1.0)

    def _grad_norm(self) -> float:
        norms = [p.grad.detach().float().norm() for p in self.model.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

    # -- weights -----------------------------------------------------------------------------
    def get_state_dict(self) -> tuple[int, dict[str, torch.Tensor]]:
        """``(weight_version, full CPU state dict with tied weights)`` for refitting generation."""
        return self.weight_version, full_state_dict(self.model)

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, directory: str) -> dict[str, Any]:
        """Rank 0 writes ``policy/`` (HF format) and ``optimizer.pt``; every rank returns its RNG state."""
        from pathlib import Path

        if self.rank == 0:
            path = Path(directory)
            self.model.save_pretrained(path / "policy", safe_serialization=True)
            torch.save(
                {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(), "weight_version": self.weight_version},
                path / "optimizer.pt",
            )
        return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}

    def load_checkpoint(self, directory: str, rng_state: dict[str, Any] | None) -> int:
        """Load weights, optimizer, scheduler and RNG state saved by :meth:`save_checkpoint`."""
        from pathlib import Path

        from safetensors.torch import load_file

        path = Path(directory)
        weights = load_file(str(path / "policy" / "model.safetensors"))
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        if unexpected or set(missing) - tied:
            raise RuntimeError(f"checkpoint {path} does not match the model: missing={missing} unexpected={unexpected}")
        state = torch.load(path / "optimizer.pt", map_location=self.device, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.weight_version = state["weight_version"]
        if rng_state is not None:
            torch.set_rng_state(rng_state["torch"])
            if rng_state.get("cuda") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng_state["cuda"])
        return self.weight_version

    def parameter_checksum(self) -> float:
        """Sum of all parameters: a cheap check that data-parallel replicas stayed identical."""
        return float(sum(p.detach().double().sum() for p in self.model.parameters()))

    def get_forward_pass_counts(self) -> dict[str, int]:
        """Forward passes run by this worker so far, by kind."""
        return dict(self.forward_passes)

    # -- GPU weight refit into vLLM (untested on GPU in this repository; see vllm_gpu_refit.py) -----
    def device_info(self) -> dict[str, Any]:
        """This worker's node address, Ray GPU ids and CUDA device UUID (None on CPU)."""
        import ray

        from nemo_like.models.generation.vllm_gpu_refit import device_uuid

        on_gpu = self.device.type == "cuda"
        return {"node_ip": ray.util.get_node_ip_address(), "gpu_ids": ray.get_gpu_ids(), "uuid": device_uuid() if on_gpu else None}

    def ipc_handles(self) -> tuple[list[str], dict[str, Any]]:
        """``(names, {device_uuid: {name: CUDA-IPC handle}})`` of every tensor; the tensors stay referenced until the next call."""
        from nemo_like.models.generation.vllm_gpu_refit import policy_ipc_handles

        self._ipc_tensors = {k: v.detach() for k, v in self.model.state_dict().items()}
        return list(self._ipc_tensors), policy_ipc_handles(self._ipc_tensors)

    def weight_manifest(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """``(name, dtype, shape)`` of every tensor :meth:`broadcast_weights` sends, in order."""
        from nemo_like.models.generation.vllm_gpu_refit import build_manifest

        return build_manifest(self.model.state_dict())

    def init_weight_broadcast_group(self, address: str, port: int, world_size: int) -> None:
        """Create the NCCL group (this worker is rank 0) used to broadcast weights to vLLM workers."""
        from nemo_like.models.generation.vllm_gpu_refit import stateless_nccl_group

        self._weight_group = stateless_nccl_group(address, port, 0, world_size, self.device)

    def broadcast_weights(self) -> int:
        """Broadcast every tensor of :meth:`weight_manifest` to the vLLM workers; returns the count."""
        from nemo_like.models.generation.vllm_gpu_refit import policy_broadcast

        return policy_broadcast(self._weight_group, self.model.state_dict())
