"""The policy worker's checkpoints: ``policy/`` (HF weights, or a PEFT adapter directory with LoRA) and
``optimizer.pt`` (optimizer and scheduler state keyed by parameter name, independent of the sharding), plus the RNG.

A mixin of :class:`~nemo_like.models.policy.worker.PolicyWorker`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from nemo_like.models import lora as lora_lib
from nemo_like.models.dropout import config_rates_restored
from nemo_like.models.loading import save_generation_config
from nemo_like.models.policy import sharding
from nemo_like.models.refit.checkpoint_format import checkpoint_tensors, held_tensor_batches

#: Where :meth:`Checkpoints.save_checkpoint` puts the weights (``policy/``) and the optimizer state, in a step directory.
POLICY_DIR = "policy"
OPTIMIZER_FILE = "optimizer.pt"


def checkpoint_files(lora: bool) -> tuple[str, ...]:
    """The files a complete policy save writes, relative to the step directory: the weights (the adapters with LoRA),
    their config and the optimizer state. The driver checks them before the step becomes ``step_N``."""
    if lora:
        weights = (lora_lib.ADAPTER_WEIGHTS, lora_lib.ADAPTER_CONFIG)
    else:
        weights = ("model.safetensors", "config.json")
    return (*(f"{POLICY_DIR}/{name}" for name in weights), OPTIMIZER_FILE)


class Checkpoints:
    """Save and load everything a resumed run needs; collectives on a sharded model (call them on every rank)."""

    model: Any
    lora_cfg: Any
    rank: int
    weight_version: int
    optimizer: torch.optim.Optimizer
    scheduler: Any

    def save_checkpoint(self, directory: str) -> dict[str, Any]:
        """Rank 0 writes ``policy/`` (HF format, gathered from the shards) and ``optimizer.pt`` (optimizer state
        keyed by parameter name, independent of the sharding); every rank returns its RNG state.
        A collective: call it on every rank."""
        from safetensors.torch import save_file

        if self.lora_cfg is not None:
            return self._save_adapter_checkpoint(Path(directory))
        weights = sharding.gather_model_state(self.model)
        optim = sharding.gather_optimizer_state(self.model, self.optimizer)
        if self.rank == 0:
            path = Path(directory) / POLICY_DIR
            path.mkdir(parents=True, exist_ok=True)
            if getattr(self.model.config, "tie_word_embeddings", False):
                weights.pop("lm_head.weight", None)  # HF convention: the tied head is not stored
            # In the layout the model's own files have (fused experts split back), as save_pretrained writes: vLLM and
            # other loaders read it (transformers 5's held layout failed to load in vLLM)
            files = checkpoint_tensors(self.model, ((name, weights.pop(name)) for name in list(weights)))  # each freed once converted
            save_file({k: v.contiguous() for k, v in files}, str(path / "model.safetensors"), metadata={"format": "pt"})
            with config_rates_restored(self.dropout_rates):
                if not getattr(self.model.config, "architectures", None):  # a text sub-config (Qwen3.5's): vLLM reads the class here
                    self.model.config.architectures = [type(self.model).__name__.removeprefix("FSDP")]
                self.model.config.save_pretrained(path)
            if getattr(self.model, "generation_config", None) is not None:
                save_generation_config(self.model.generation_config, path)
            self._save_optimizer(Path(directory), optim)
        return self._rng_state()

    def _save_optimizer(self, directory: Any, optim: dict[str, Any]) -> None:
        torch.save(
            {"optimizer": optim, "scheduler": self.scheduler.state_dict(), "weight_version": self.weight_version},
            directory / OPTIMIZER_FILE,
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
            lora_lib.write_adapter(directory / POLICY_DIR, adapters, lora_lib.adapter_config_dict(self.model))
            self._save_optimizer(directory, optim)
        return self._rng_state()

    def load_checkpoint(self, directory: str, rng_state: dict[str, Any] | None) -> int:
        """Load weights, optimizer, scheduler and RNG state saved by :meth:`save_checkpoint` (every rank reads the
        files and keeps its own shard)."""
        from safetensors.torch import load_file

        path = Path(directory)
        if self.lora_cfg is not None:
            saved = {lora_lib.model_name(k): v for k, v in load_file(str(path / "policy" / lora_lib.ADAPTER_WEIGHTS)).items()}
            if untrained := lora_lib.untrained_extra_adapters(self.model, saved):  # a vision tower's, from an older run
                for name in untrained:
                    del saved[name]
                if self.rank == 0:
                    print(
                        f"[checkpoint] {len(untrained)} adapter tensors of modules this run does not adapt (a multimodal "
                        "model's vision tower, adapted by runs before 2026-12-08) are left out: their lora_B is zero",
                        file=sys.stderr,
                        flush=True,
                    )
            missing, unexpected = sharding.load_model_state(self.model, saved)
            missing = [k for k in missing if lora_lib.is_adapter(k)]  # the frozen base comes from policy.model_name
        else:
            tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
            expected, loaded, unexpected = set(self.model.state_dict()) - tied, set(), []
            for batch in held_tensor_batches(self.model, load_file(str(path / "policy" / "model.safetensors"))):
                loaded |= batch.keys()  # first: a sharded load fills the dict it is given with every key of the model
                unexpected += sharding.load_model_state(self.model, batch)[1]  # a collective: the same batches on every rank
            missing = sorted(expected - loaded)
        if unexpected or missing:
            raise RuntimeError(f"checkpoint {path} does not match the model: missing={missing} unexpected={unexpected}")
        state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)
        sharding.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.apply_optimizer_settings()  # the saved lr, weight decay, betas and eps came back with the state: this run's
        self.weight_version = state["weight_version"]
        if rng_state is not None:
            torch.set_rng_state(rng_state["torch"])
            if rng_state.get("cuda") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng_state["cuda"])
        return self.weight_version
