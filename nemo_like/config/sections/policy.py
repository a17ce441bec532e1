"""The ``policy`` section: model, optimizer, training backend, generation, LoRA, batching."""

from __future__ import annotations

import importlib.util
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from nemo_like.config.sections.base import EMBEDDED_MODEL, Section, set_while_off
from nemo_like.config.types import Float, Int, OptStr, ThreadCount

#: An Adam decay rate: 1 never forgets (beta2 = 1 never updates the second moment: division by ~eps), > 1 diverges.
AdamBeta = Annotated[Float, Field(ge=0, lt=1)]


class OptimizerConfig(Section):
    name: Literal["adamw"] = Field("adamw", description="Optimizer (AdamW).")
    lr: Float = Field(1e-5, gt=0, description="Peak learning rate.")
    weight_decay: Float = Field(0.0, ge=0, description="Decoupled weight decay.")
    betas: tuple[AdamBeta, AdamBeta] = Field((0.9, 0.999), description="Adam's (beta1, beta2), each in [0, 1).")
    eps: Float = Field(1e-8, gt=0, description="Adam's epsilon.")


class SchedulerConfig(Section):
    warmup_steps: Int = Field(0, ge=0, description="Linear warm-up (optimizer steps) to optimizer.lr, then constant.")


def vllm_available() -> bool:
    """True when the ``vllm`` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


class ColocatedConfig(Section):
    enabled: bool = Field(
        True,
        description="Generation shares the training devices (GPU only; ignored on CPU): the vLLM engine sleeps while the policy "
        "trains and the policy hands its memory back before the engine wakes. vLLM only (the HF engine always takes a GPU "
        "of its own); sync GRPO only (async overlaps the two).",
    )
    offload_optimizer: bool = Field(
        True,
        description="Colocated GPU: move the policy's AdamW state to CPU memory before each refit and generation (back at the "
        "next training step), so the engine's KV cache has room; false keeps it on the GPU (faster, needs the memory).",
    )


class VllmConfig(Section):
    """vLLM engine settings (used when policy.generation.backend resolves to 'vllm')."""

    gpu_memory_utilization: Float = Field(
        0.5, gt=0, le=1, description="GPU only: fraction of the GPU vLLM may use (weights + KV cache); leave room for the colocated policy."
    )
    kv_cache_space_gib: Int = Field(1, gt=0, description="CPU only: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE).")
    enforce_eager: bool = Field(
        True,
        description="Run eagerly (no CUDA graphs / torch.compile): fast start-up; false compiles the model (on CPU ~40 s more start-up).",
    )


class GenerationConfig(Section):
    backend: Literal["auto", "inline", "hf", "vllm"] = Field(
        "auto",
        description="Generation engine: 'inline' (the policy worker samples with its own weights: no engine actor, no "
        "refit; sync runs with one policy worker, no LoRA), 'vllm' (vLLM, in-process in a Ray actor), 'hf' (a transformers "
        "model in a Ray actor, sampled with our own loop); 'auto' = on CPU clusters inline where it applies, else vllm for a "
        "LoRA run whose adapters vLLM can serve when the vllm package is importable, else hf; on GPU clusters vllm when the "
        "vllm package is importable, else hf (see docs/guides/generation.md).",
    )
    max_new_tokens: Int = Field(16, gt=0, description="Maximum response tokens.")
    temperature: Float = Field(
        1.0, description="Sampling temperature (> 0); the policy and reference score tokens with logits / temperature too."
    )
    top_p: Float = Field(
        1.0,
        gt=0,
        le=1,
        description="Nucleus sampling (1.0 disables it). Generation and the policy/reference logprob and training passes "
        "all use the truncated, renormalised distribution (processed logprobs, docs/guides/generation.md).",
    )
    top_k: Int | None = Field(
        None,
        gt=0,
        description="Top-k sampling, applied before top_p; null disables it. Logprobs everywhere are those of the "
        "truncated, renormalised distribution (processed logprobs, docs/guides/generation.md).",
    )
    stop_token_ids: list[Int] | None = Field(
        None,
        description="Extra stop tokens besides the end-of-sequence ids: the tokenizer's eos and the eos_token_id(s) of the model's "
        "generation_config.json (every backend stops on both, as transformers and vLLM do). In multi-turn rollouts a turn "
        "that ends on one leaves it out of its message when the chat template writes it with an assistant turn (<|im_end|> "
        "for a base tokenizer), else keeps it in the text (</tool_call>), as a stop string is kept.",
    )
    stop_strings: list[str] | None = Field(
        None,
        description="Stop strings: a response keeps its sampled tokens up to the first token whose text completes one (whole "
        "tokens, nothing re-tokenised; applied after generation). Multi-turn environments may set their own per turn.",
    )
    num_threads_per_worker: ThreadCount = Field(
        "auto",
        description="torch/OpenMP threads of each generation engine (HF or vLLM on CPU); 'auto': the automatic split of "
        "policy.num_threads_per_worker (docs/guides/scaling.md#threads-per-worker); an integer is used as given.",
    )
    colocated: ColocatedConfig = Field(default_factory=ColocatedConfig)
    vllm_cfg: VllmConfig = Field(default_factory=VllmConfig, description="vLLM engine settings.")

    @field_validator("temperature")
    @classmethod
    def _sampling_temperature(cls, value: float) -> float:
        if value <= 0:
            raise ValueError(
                f"policy.generation.temperature must be > 0 (got {value}): GRPO learns from sampled responses; 0, greedy decoding in vLLM or TRL, is not "
                "a sampling temperature (greedy validation: grpo.val_greedy=true; greedy eval: eval.greedy=true)"
            )
        return value

    @model_validator(mode="after")
    def _stops(self) -> GenerationConfig:
        # An empty stop string is in every text: each response would be cut to its first token (and counted as stopped).
        if any(not text for text in self.stop_strings or ()):
            raise ValueError(f"policy.generation.stop_strings: every stop string must be non-empty, got {self.stop_strings}")
        negative = [i for i in self.stop_token_ids or () if i < 0]
        if negative:
            raise ValueError(f"policy.generation.stop_token_ids: token ids are >= 0, got {negative}")
        return self


class DTensorConfig(Section):
    """FSDP2 / DTensor sharding of the policy and reference workers (see docs/guides/scaling.md)."""

    enabled: bool = Field(
        True,
        description="Shard parameters, gradients and optimizer state across the policy.dp_size ranks with FSDP2 "
        "(torch.distributed.fsdp.fully_shard). With dp_size 1 and tensor_parallel_size 1 there is nothing to shard and the "
        "plain model is used. false is only valid with dp_size 1.",
    )
    cpu_offload: bool = Field(
        False, description="GPU only: keep the sharded parameters, gradients and optimizer state in CPU memory (FSDP2 CPUOffloadPolicy)."
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each decoder layer's activations in the backward pass (less memory, ~1/3 more compute)."
    )
    tensor_parallel_size: Int = Field(
        1,
        gt=0,
        description="Tensor-parallel degree (DTensor: column/row-parallel attention and MLP projections) inside each data-parallel "
        "group; the policy and the reference run dp_size x tensor_parallel_size workers. Must divide the model's attention and KV heads.",
    )


class SequencePackingConfig(Section):
    """Several samples per row, attention kept inside each sample (see docs/guides/scaling.md)."""

    enabled: bool = Field(
        False, description="Pack samples into rows of at most train_mb_tokens / logprob_mb_tokens tokens (first-fit decreasing)."
    )
    train_mb_tokens: Int = Field(512, gt=0, description="Tokens per packed training micro-batch (one row).")
    logprob_mb_tokens: Int = Field(1024, gt=0, description="Tokens per packed logprob micro-batch (one row).")


class DynamicBatchingConfig(Section):
    """Micro-batches sized by a token budget instead of a sample count (see docs/guides/scaling.md)."""

    enabled: bool = Field(
        False, description="Group samples of similar length into padded micro-batches of at most the token budget (rows x longest row)."
    )
    train_mb_tokens: Int = Field(512, gt=0, description="Padded tokens per training micro-batch.")
    logprob_mb_tokens: Int = Field(1024, gt=0, description="Padded tokens per logprob micro-batch.")


class LoraConfig(Section):
    """LoRA adapters on the policy's linear layers (PEFT; see docs/guides/lora.md). Only the adapters train;
    the reference policy is the base model with the adapters disabled."""

    enabled: bool = Field(False, description="Train LoRA adapters instead of every weight.")
    dim: Int = Field(
        8,
        gt=0,
        description="Adapter rank r (NeMo-RL's name). vLLM serves ranks up to 512 as adapters.",
    )
    alpha: Float = Field(32.0, gt=0, description="LoRA alpha: the adapter's update is scaled by alpha / dim.")
    dropout: Float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapter's input during training. Above 0 the training forward no longer scores tokens as "
        "generation and the (eval-mode) prev-logprob pass do: with the prev pass the ratio to it carries dropout noise even "
        "on-policy (train/clip_fraction > 0); with it skipped, the prev logprobs are the dropout forward's (train/gen_kl rises).",
    )
    target_modules: list[str] | None = Field(
        None,
        min_length=1,
        description="Linear modules of the decoder blocks that get adapters, by name (e.g. [q_proj, v_proj]) or full path; "
        "null: every linear layer of the decoder blocks (not the output head).",
    )
    exclude_modules: list[str] | None = Field(
        None, description="Linear modules (names or full paths, e.g. model.layers.0.mlp.down_proj) left without an adapter."
    )
    refit: Literal["auto", "adapter", "merged"] = Field(
        "auto",
        description="How generation gets new weights: 'adapter' (vLLM serves the adapters as a LoRA request, only the adapters "
        "travel), 'merged' (W + B@A*alpha/dim through the full-weight refit), 'auto' = adapter when the engine supports it, "
        "else merged (the choice and its reason are printed at start-up).",
    )

    def no_effect_warnings(self) -> list[str]:
        """Keys changed from their defaults while ``enabled`` is false do nothing: say so."""
        return [f"policy.lora_cfg.{k} has no effect with policy.lora_cfg.enabled=false" for k in sorted(set_while_off(self))]


class PolicyConfig(Section):
    model_name: str = Field(EMBEDDED_MODEL, description=f"HF model id or local directory; '{EMBEDDED_MODEL}' is the shipped tiny model.")
    tokenizer_name: OptStr = Field(None, description="Tokenizer id or directory; defaults to model_name.")
    train_global_batch_size: Int = Field(64, gt=0, description="Samples per optimizer step (all data-parallel ranks).")
    train_micro_batch_size: Int = Field(16, gt=0, description="Samples per forward/backward on one rank.")
    logprob_batch_size: Int = Field(64, gt=0, description="Samples per forward in logprob passes.")
    max_total_sequence_length: Int = Field(
        128,
        gt=0,
        description="Prompt + response tokens; longer prompts are an error. At most the model's context "
        "(max_position_embeddings, RoPE scaling included): checked before any actor starts.",
    )
    precision: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Compute dtype. bfloat16: the parameters and AdamW state stay float32 (master weights) and forwards and "
        "backwards run in bf16 (autocast on one rank, FSDP2's mixed-precision policy when sharded); generation engines hold "
        "bf16 weights and refits send bf16 (docs/guides/gpu.md).",
    )
    max_grad_norm: Float | None = Field(1.0, gt=0, description="Gradient clipping by global norm; null disables it.")
    dp_size: Int = Field(1, gt=0, description="Data-parallel policy workers (torch.distributed, gloo on CPU, nccl on GPU).")
    num_cpus_per_worker: Float = Field(0.5, gt=0, description="Ray CPU reservation per policy/reference worker.")
    num_threads_per_worker: ThreadCount = Field(
        "auto",
        description="torch/OpenMP intra-op threads in each policy and reference worker; 'auto' splits each node's CPUs among the "
        "actors that run at the same time (sync: each phase may use every core; async: generation and training share "
        "them; rule in docs/guides/scaling.md#threads-per-worker); an integer is used as given.",
    )
    dtensor_cfg: DTensorConfig = Field(default_factory=DTensorConfig, description="FSDP2 / DTensor sharding.")
    sequence_packing: SequencePackingConfig = Field(default_factory=SequencePackingConfig, description="Sequence packing.")
    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig, description="Token-budget micro-batches.")
    logprob_chunk_size: Int | None = Field(
        None,
        gt=0,
        description="Compute logprobs (and the loss's logprobs) from hidden states in chunks of this many positions, never holding "
        "the full [tokens, vocab] logits; null computes the full logits at once. Refused for a model whose forward "
        "post-processes its head's logits (Gemma 2's soft-capping, Granite, Cohere).",
    )
    shared_prompt_forward: Literal["auto", True, False] = Field(
        "auto",
        description="Logprob and training forwards run each group's prompt once and skip padding tokens (same logprobs and "
        "gradients up to float summation order; docs/guides/performance.md#shared-prompt-forward). 'auto': on CPU where it "
        "applies (a Llama/Qwen2/Mistral model without a sliding window on one unsharded worker, no LoRA, no activation "
        "checkpointing, no teacher KL term, no attention dropout in training); true: also on GPU (untested there), an error "
        "where it cannot apply; false: the model's own forward.",
    )
    refit_buffer_size_mb: Float = Field(
        512.0,
        gt=0,
        description="Refit through the object store (several nodes, GPU): the weights are gathered from the shards and sent to "
        "generation in buckets of at most this many MB. A one-node CPU cluster refits through one shared-memory buffer instead.",
    )
    lora_cfg: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters (docs/guides/lora.md).")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)

    @property
    def rank_step_samples(self) -> int:
        """A data-parallel rank's samples of one optimizer step: a larger ``train_micro_batch_size`` holds this many."""
        return self.train_global_batch_size // self.dp_size

    @model_validator(mode="after")
    def _micro_divides_global(self) -> PolicyConfig:
        per_rank = self.train_global_batch_size / self.dp_size
        if per_rank != int(per_rank):
            raise ValueError(
                f"policy.train_global_batch_size ({self.train_global_batch_size}) must be divisible by policy.dp_size ({self.dp_size})"
            )
        if self.sequence_packing.enabled and self.dynamic_batching.enabled:
            raise ValueError("policy.sequence_packing.enabled and policy.dynamic_batching.enabled are exclusive: enable one of them")
        if self.dp_size > 1 and not self.dtensor_cfg.enabled:
            raise ValueError(
                f"policy.dp_size={self.dp_size} needs policy.dtensor_cfg.enabled=true (data parallelism is FSDP2 sharding); "
                "set policy.dp_size=1 to train without it"
            )
        if self.dtensor_cfg.tensor_parallel_size > 1 and not self.dtensor_cfg.enabled:
            raise ValueError("policy.dtensor_cfg.tensor_parallel_size > 1 needs policy.dtensor_cfg.enabled=true")
        if self.shared_prompt_forward is True:
            conflicts = [
                name
                for name, on in (
                    ("policy.dp_size > 1", self.dp_size > 1),
                    ("policy.dtensor_cfg.tensor_parallel_size > 1", self.dtensor_cfg.tensor_parallel_size > 1),
                    ("policy.lora_cfg.enabled", self.lora_cfg.enabled),
                    ("policy.dtensor_cfg.activation_checkpointing", self.dtensor_cfg.activation_checkpointing),
                )
                if on
            ]
            if conflicts:
                raise ValueError(
                    f"policy.shared_prompt_forward=true cannot run with {', '.join(conflicts)} (it bypasses the model's own "
                    "modules); use auto (falls back to the model's forward) or false"
                )
        if self.lora_cfg.enabled and self.dtensor_cfg.tensor_parallel_size > 1:
            raise ValueError(
                "policy.lora_cfg.enabled=true does not support policy.dtensor_cfg.tensor_parallel_size > 1 (adapters are sharded "
                "with FSDP2 only); use policy.dp_size for more workers"
            )
        return self
