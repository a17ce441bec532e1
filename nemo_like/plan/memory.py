"""Memory and step time of a run before anything starts: per role and per device, from the config, the run plan and
the model's parameter shapes (pure; ``nemo-like plan`` gathers the inputs with :mod:`nemo_like.models.footprint`).

What is exact and what is estimated:

* **parameters, gradients, AdamW state** per rank are exact: tensor parallelism (``tensor_parallel_size`` t) splits
  the decoder layers' projections into t pieces (column-wise along dim 0, row-wise along dim 1,
  :data:`~nemo_like.models.policy.sharding.TENSOR_PARALLEL_STYLES`), then FSDP2 shards every parameter (a projection's
  piece, any other parameter whole: embeddings, norms, the output head) along dim 0 into ``dp_size`` pieces of
  ``ceil(dim0 / dp_size)`` rows (rank 0 holds the largest); masters in float32, a LoRA base in the compute dtype with
  float32 adapters, gradients and two AdamW moments for trainable parameters only. Tests compare them with
  :meth:`PolicyWorker.memory_footprint` (dp 1 and 2, tp 2).
* **activations** are an estimate of the peak of one training micro-batch (tokens x layers x what a Llama-family
  layer saves for backward: ``8H + 4 K D + 4I`` values per token, the attention kernel keeping no score matrix; a
  mixture of experts' block in place of ``4I`` where larger, ``k (4 I_e + 3H) + E + 4 I_shared``
  (:func:`~nemo_like.utils.experts.expert_block_values_per_token`);
  ``5H + (3H + 4 K D + 4I) / t`` on a rank of ``t`` tensor-parallel ranks),
  plus the float32 logits, their log-softmax and its gradient (``tokens x vocab x 12`` bytes, or ``chunk x vocab x 12``
  with ``policy.logprob_chunk_size``); with activation checkpointing each layer's input plus the larger of the logits'
  share and one layer's recomputed activations (the backward recomputes a layer after the output head's backward has
  freed the logits: the two never coexist). Values at the compute dtype, except under autocast (``bfloat16`` on one
  unsharded rank, :func:`runs_autocast`): the ``8H`` values (residual stream, norms) and the layer inputs at float32
  (on a CPU attention's too, :func:`cpu_float32_attention`),
  plus the bf16 copy autocast keeps of every trainable matmul weight (:func:`autocast_weight_copies`). Packed or
  token-budget micro-batches are at least ``policy.max_total_sequence_length`` tokens (:func:`micro_batch_tokens`);
  packing adds its dense block-causal mask (:func:`packed_mask_bytes`). A top-k / top-p truncated distribution
  adds :data:`TRUNCATION_BYTES_PER_LOGIT` to each logit's 12 bytes, LoRA dropout its copies
  (:func:`lora_dropout_bytes_per_token`).
* **FSDP2's unsharded root** (``dp_size > 1``): every rank all-gathers the parameters outside the decoder layers
  (embeddings, final norm, an untied output head) into full-size buffers at the start of each forward and, the root
  not being resharded after its forward, holds them until its backward ends (a logprob pass: until the pass ends), at
  the compute dtype. The decoder layers are unsharded one at a time and resharded after use; at the step's peak (the
  output head's backward) none is. Counted with the activations (``unsharded root`` in the line).
  ``python benchmarks/plan_memory.py`` compares both with measured training steps on a CPU, at dp 1 and dp 2.
* **inline sampling** (the inline backend: the one policy worker samples): the KV cache of
  ``min(rollout batch, INLINE_GENERATION_BATCH)`` full-length sequences in the parameters' dtype plus their next
  token's float32 logits and the sampler's weight copies (fused and oneDNN-packed projections), held beside the
  parameters, gradients and AdamW state; the worker's activations are the larger of that and the training / logprob
  passes' (:func:`with_inline_sampling`).
* **CPU offload** (``policy.dtensor_cfg.cpu_offload`` where it runs: ``MasterConfig.offloads_to_cpu``): parameters,
  gradients and AdamW state in host RAM; the device holds the activations, the unsharded root and the largest
  decoder layer, unsharded while it computes.
* **KV cache** of a generation engine: ``2 x layers x kv_heads x head_dim x bytes`` per token at ``policy.precision``
  (latent attention: ``layers x (kv_lora_rank + qk_rope_head_dim) x bytes``, :attr:`ModelShape.latent_kv_width`)
  (the engines load the model at that dtype); vLLM's budget is ``gpu_memory_utilization x device`` minus the weights
  (GPU), or ``kv_cache_space_gib`` (CPU); the HF engine holds the sequences it samples at once.
* **step time**: FLOPs (``2N`` per generated or scored token, ``6N`` per trained token, ``4N + 6 N_lora`` with LoRA,
  N the matmul parameters of the model that runs the phase: a teacher's own) at a stated peak per device and MFU, each phase spread over the devices
  that run it (:func:`step_estimate`); an upper bound on tokens (every sequence at ``policy.max_total_sequence_length``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from nemo_like.config.errors import ConfigError
from nemo_like.plan.backend import GENERATION_ENGINES, HF_MAX_BATCH_SIZE, INLINE_GENERATION_BATCH, PLAIN_MODEL, PolicyModel, resolve_backend
from nemo_like.plan.threads import PACKING_STRATEGIES, bundles_per_node, per_node

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class ParameterSpec:
    """One parameter of the model: its shape, whether it trains, and its bytes per element as the worker holds it."""

    shape: tuple[int, ...]
    trainable: bool
    bytes_per_element: int
    root: bool = False  # outside the decoder layers (embeddings, final norm, output head): FSDP2's root unit
    tp_dim: int | None = None  # the dim tensor parallelism splits (a projection's); None: whole on every tp rank
    layer: int | None = None  # the decoder layer it belongs to (None: the root unit's)

    def tp_shape(self, tp: int) -> tuple[int, ...]:
        """Its shape on tp rank 0: ``ceil(dim / tp)`` along :attr:`tp_dim` (the whole shape when not split)."""
        if tp <= 1 or self.tp_dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.tp_dim] = math.ceil(shape[self.tp_dim] / tp)
        return tuple(shape)

    def shard_bytes(self, dp: int, tp: int = 1) -> int:
        """Bytes rank 0 holds: its tensor-parallel piece (:meth:`tp_shape`) sharded by FSDP2 over the ``dp`` ranks
        (dim 0, ``ceil(dim0 / dp)`` rows). A parameter tensor parallelism does not split is sharded over dp only."""
        shape = self.tp_shape(tp)
        if not shape:
            return self.bytes_per_element
        rows = math.ceil(shape[0] / dp) if dp > 1 else shape[0]
        return rows * math.prod(shape[1:]) * self.bytes_per_element

    def as_held(self, trainable: bool, bytes_per_element: int) -> ParameterSpec:
        """The same parameter held otherwise (a frozen float32 copy, a float32 gradient)."""
        return replace(self, trainable=trainable, bytes_per_element=bytes_per_element)


#: The model types whose latent attention vLLM caches as one latent per layer (vLLM 0.32's ``is_deepseek_mla``); vLLM
#: builds other configs with ``kv_lora_rank`` (MiniCPM3) with per-head keys and values.
VLLM_LATENT_MODEL_TYPES = frozenset({
    "axk1", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "deepseek_v41", "dots3_note", "deepseek_mtp", "k3_dspark",
    "glm5_next", "glm5_next_text", "glm_moe_dsa", "glm4_moe_lite", "glm4_moe_lite_mtp", "kimi_k2", "kimi_linear", "longcat_flash",
    "pangu_ultra_moe", "pangu_ultra_moe_mtp", "bailing_hybrid", "bailing_hybrid_mtp", "bailing_hybrid_v3_mtp", "hy_v4", "hy_v4_mtp",
})  # fmt: skip


def _largest(size: int | list[int] | None) -> int | None:
    """A config's size, or the largest of its per-layer sizes (Gemma-3n's ``intermediate_size``)."""
    return max(size) if isinstance(size, list) and size else size  # type: ignore[return-value]


def layer_values(config: Any, key: str) -> list[Any]:
    """``config``'s ``key`` as a list: its one value (none where it has no such key), or each layer's where transformers
    keeps one per layer (a heterogeneous config, Gemma 4's ``head_dim`` and ``num_key_value_heads``: reading the whole
    raises a RuntimeError)."""
    try:
        return [getattr(config, key)] if hasattr(config, key) else []
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return [getattr(layer, key, None) for layer in config.per_layer_config]


def config_value(config: Any, key: str) -> Any:
    """``config``'s ``key`` (:func:`layer_values`), or where its layers differ in it the largest of its layers' (an
    upper bound); ``None`` where it has none."""
    return max((v for v in layer_values(config, key) if v is not None), default=None)


@dataclass(frozen=True)
class ModelShape:
    """What activations and the KV cache depend on (a Llama-family decoder's HF config)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    packed_masks: int = 1  # a packed row's [T, T] masks: 2 where some layers slide (one per layer type)
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, MiniCPM3, ...: a config with kv_lora_rank): the values a
    # layer caches per token, one compressed latent (kv_lora_rank) and the shared rotary key (qk_rope_head_dim), which
    # transformers caches in place of per-head keys and values; 0 for the usual attention
    latent_kv_width: int = 0
    # vLLM caches the latent too (its MLA models: VLLM_LATENT_MODEL_TYPES); else per-head keys and values (MiniCPM3)
    vllm_caches_latent: bool = False
    # A mixture of experts: the most values one of its blocks saves for backward per token
    # (:func:`~nemo_like.utils.experts.expert_block_values_per_token`), in place of a dense MLP's 4I where larger
    expert_block_values: int = 0
    # Tensor parallelism splits every layer's MLP projections (the Llama layout's mlp.*_proj); else the MLP runs whole
    # on every tp rank (a mixture of experts, Falcon-H1's feed_forward)
    mlp_splits: bool = True
    # What a layer's norms beyond a Llama layer's two save per token (:func:`~nemo_like.models.footprint.extra_norm_values`):
    # Gemma's pre/post-feedforward norms, Qwen3's and Gemma 3's per-head query/key norms, each its input and output
    norm_values: int = 0
    # The lean decoder's fused step samples the model (the Llama family: ``llama_family.supported``) and copies its
    # weights for a call; any other model samples with its own forward, copying nothing
    fused_sampler: bool = True
    # What each layer caches (:mod:`~nemo_like.models.layer_kinds`): ``cached_layers`` of the ``layers`` keep keys and
    # values per token (None: every one), ``window_layers`` of those the last ``window - 1`` tokens at most (sliding-window
    # attention, as transformers' cache keeps them); ``state_layers`` (linear attention, state space) a fixed state
    # whatever the length, of ``state_values`` values in the model's dtype and ``state_float32_values`` values that
    # transformers keeps in float32 (a gated delta net's recurrent state; vLLM in the model's dtype); both 0: not known
    cached_layers: int | None = None
    window_layers: int = 0
    window: int = 0
    state_layers: int = 0
    state_values: int = 0
    state_float32_values: int = 0

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelShape:
        """From a ``transformers`` text config (its class's defaults and attribute names resolved: the model built from
        it has these sizes; a ``config.json``'s own dict lacked the defaults). Latent attention expands the latent into
        keys of ``qk_nope_head_dim + qk_rope_head_dim`` for every head (its config's ``head_dim`` is the rotary part)."""
        hidden, heads = config.hidden_size, config_value(config, "num_attention_heads") or 0  # 0: no attention (Mamba)
        kv_heads = config_value(config, "num_key_value_heads") or heads
        head_dim = config_value(config, "head_dim") or (hidden // heads if heads else 0)
        latent = getattr(config, "kv_lora_rank", None) or 0
        if latent:  # its keys: qk_nope_head_dim + qk_rope_head_dim wide, for every head
            kv_heads, head_dim = heads, config.qk_nope_head_dim + config.qk_rope_head_dim
            latent += config.qk_rope_head_dim
        return cls(
            layers=config.num_hidden_layers,
            hidden=hidden,
            intermediate=_largest(config_value(config, "intermediate_size")) or 4 * hidden,  # per layer: the largest
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            vocab=config.vocab_size,
            latent_kv_width=latent,
            vllm_caches_latent=bool(latent) and getattr(config, "model_type", None) in VLLM_LATENT_MODEL_TYPES,
        )

    def layer_values_per_token(self) -> int:
        """Values one layer saves for backward per token (see the module docstring)."""
        return 8 * self.hidden + self.norm_values + 4 * self.kv_heads * self.head_dim + self.mlp_values_per_token()

    def mlp_values_per_token(self) -> int:
        """Values a layer's MLP saves per token: a dense one's ``4I`` (gate, up, the activation, their product), or a
        mixture-of-experts block's (``expert_block_values``) where larger."""
        return max(4 * self.intermediate, self.expert_block_values)

    def layer_bytes_per_token(self, value_bytes: int, hidden_bytes: int | None = None, tp: int = 1, float32_attention: bool = False) -> int:
        """Bytes one layer saves for backward per token: :meth:`layer_values_per_token` at ``value_bytes``, its ``8H``
        hidden-sized values (the residual stream, the norms' inputs and outputs) at ``hidden_bytes`` (default: the
        same), which :func:`activation_bytes` sets to 4 under autocast. On a rank of ``tp`` tensor-parallel ranks the
        values of the split projections are ``1/tp`` wide: of the ``8H``, the query, the rotated query and the
        attention output (``3H``), and the keys' and values' ``4KD`` and a dense MLP's ``4I`` where the plan splits it
        (``mlp_splits``; a mixture of experts' block runs whole on every rank); the residual stream and the norms
        (``5H``) stay whole (no sequence parallelism). Measured on a (dp 1, tp 2) gloo rank in
        ``tests/unit/models/test_sharding.py``. ``float32_attention``: attention runs in float32 under a lower
        ``value_bytes`` (CPU autocast, :func:`cpu_float32_attention`): its ``3H`` values at 4 bytes, and float32 copies
        of the keys and values (``2KD``), measured in ``tests/unit/plan/test_memory_plan.py``."""
        hidden_bytes = value_bytes if hidden_bytes is None else hidden_bytes
        mlp = self.mlp_values_per_token()
        norms = self.norm_values * hidden_bytes  # (a model with per-head query/key norms takes no tensor parallelism)
        if tp <= 1:
            attention = (3 * self.hidden + 2 * self.kv_heads * self.head_dim) * (4 - value_bytes) if float32_attention else 0
            return 8 * self.hidden * hidden_bytes + norms + (4 * self.kv_heads * self.head_dim + mlp) * value_bytes + attention
        whole = mlp if self.expert_block_values or not self.mlp_splits else 0  # experts, another layout: whole on a tp rank
        split = 3 * self.hidden + 4 * self.kv_heads * self.head_dim + mlp - whole
        return 5 * self.hidden * hidden_bytes + norms + whole * value_bytes + math.ceil(split / tp) * value_bytes

    def kv_bytes_per_sequence(self, bytes_per_value: int, tokens: int, engine: str = "hf") -> int:
        """KV-cache bytes of one sequence of ``tokens`` tokens in ``engine``'s cache (``hf``: transformers', as the inline
        backend's; ``vllm``): each attention layer's keys and values, or its latent (``latent_kv_width``) where the engine
        caches it, per token (a sliding-window layer's for its last ``window - 1`` tokens at most; vLLM also holds the
        tokens of the chunk in flight there, not counted), and each linear-attention / state-space layer's fixed state."""
        latent = self.latent_kv_width if engine != "vllm" or self.vllm_caches_latent else 0
        width = latent or 2 * self.kv_heads * self.head_dim
        full = (self.layers if self.cached_layers is None else self.cached_layers) - self.window_layers
        cached_tokens = full * tokens + self.window_layers * min(tokens, max(self.window - 1, 0))
        float32_state = self.state_float32_values * (bytes_per_value if engine == "vllm" else 4)
        return (cached_tokens * width + self.state_layers * self.state_values) * bytes_per_value + self.state_layers * float32_state

    @property
    def state_known(self) -> bool:
        """Whether the plan knows what every layer caches: no layer keeps a state, or the state's size is known."""
        return not self.state_layers or bool(self.state_values or self.state_float32_values)

    def unplanned(self, activations: bool = True) -> list[str]:
        """``not planned`` lines for what this shape leaves out of the estimate; ``activations=False``: a role that
        only samples (a judge), whose plan holds no training or logprob activations."""
        if not self.state_layers:
            return []
        lines = []
        if activations:
            lines.append(
                f"not planned: what the model's {self.state_layers} linear-attention / state-space layers keep for backward "
                "beyond an attention layer's (a gated delta net keeps more: wider projections, its convolution's inputs): the "
                "training and logprob activations above are a lower bound"
            )
        if not self.state_known:
            lines.append(f"not planned: the fixed state each of the model's {self.state_layers} stateful layers caches per sequence")
        return lines


#: The role of the refit's copy of the weights in a CPU node's RAM (:func:`refit_buffer_memory`): no actor, no bundle.
REFIT_BUFFER = "refit buffer"


@dataclass(frozen=True)
class RoleMemory:
    """Bytes one worker of a role holds, by kind (``workers``: how many such workers the role starts)."""

    role: str
    workers: int
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    kv_cache: int = 0
    note: str = ""
    unsharded_root: int = 0  # FSDP2 (dp > 1): the root unit's full parameters, held through the forward and backward
    kv_sequences: int | None = None  # vLLM: full-length sequences its KV budget holds (None: not known)
    kv_sequence_bytes: int = 0  # vLLM: the KV cache of one full-length sequence
    offloaded: bool = False  # FSDP2's CPU offload: params, grads and AdamW state in host RAM, not on the device
    on_host: bool = False  # a CPU actor's: in its node's RAM, on no GPU (a reward model with num_gpus 0)
    device: str = ""  # the GPU it is on when not one of its own ("<role> GPU"): reward models a composite actor shares
    per_device: int = 1  # its workers one GPU may hold (fractional GPUs: Ray may pack that many on one)
    unsharded_layer: int = 0  # with CPU offload: the largest decoder layer, unsharded on the GPU while it computes
    fit_hint: str = ""  # an environment's model: what to change when its GPU is over (the advice after "fits: NO")
    problem: str = ""  # an environment's model that cannot start whatever the devices hold (a vLLM judge without KV room)
    samples_at_peak: bool = False  # the inline backend's policy: sampling's KV cache, not training, is its activation peak

    @property
    def gpu(self) -> str:
        """The GPU it is planned on: :attr:`device`, else one of its own (``<role> GPU``)."""
        return self.device or f"{self.role} GPU"

    @property
    def held(self) -> int:
        """Parameters, gradients and AdamW state: on the device, or in host RAM when :attr:`offloaded`."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        """What the worker's device holds at its peak."""
        on_device = self.activations + self.unsharded_root + self.unsharded_layer + self.kv_cache
        return on_device if self.offloaded else on_device + self.held

    def line(self) -> str:
        """One ``[plan]`` line."""
        if self.role == REFIT_BUFFER:  # bytes in a node's RAM, no worker
            return f"memory {self.role}: {self.total / GIB:.3f} GiB in its node's RAM ({self.note})"
        held = [f"{k} {v / GIB:.3f}" for k, v in (("params", self.params), ("grads", self.grads), ("optimizer", self.optimizer))]
        parts = ([] if self.offloaded else held) + [f"activations ~{self.activations / GIB:.3f}"]
        if self.unsharded_root:
            parts.append(f"unsharded root {self.unsharded_root / GIB:.3f}")
        if self.unsharded_layer:
            parts.append(f"largest layer unsharded {self.unsharded_layer / GIB:.3f}")
        if self.kv_cache:
            parts.append(f"kv cache {self.kv_cache / GIB:.3f}")
        host = f"; host RAM (cpu_offload): {self.held / GIB:.3f} GiB = " + " + ".join(held) if self.offloaded else ""
        note = f" ({self.note})" if self.note else ""
        where = "per worker on its device" if self.offloaded else "per worker in its node's RAM" if self.on_host else "per worker"
        return f"memory {self.role} x{self.workers}: {self.total / GIB:.3f} GiB {where} = " + " + ".join(parts) + f" GiB{host}{note}"


def _devices(count: int) -> str:
    return f"{count} device" if count == 1 else f"{count} devices"


@dataclass(frozen=True)
class StepEstimate:
    """FLOPs of one step by phase, the devices each phase's FLOPs are spread over (``devices``: 1 where a phase is not
    listed), and the seconds they take at ``peak_flops x mfu`` per device (an upper bound on tokens; the phases one after
    another, the logprob passes too, though they run concurrently on their own ranks)."""

    flops: dict[str, float]
    peak_flops: float
    mfu: float
    devices: dict[str, int] = field(default_factory=dict)
    left_out: str = ""  # what a step runs that no phase counts (the environments' judges and reward models)

    def phase_seconds(self, phase: str) -> float:
        """Seconds of ``phase``: its FLOPs over its devices at ``peak_flops x mfu`` each."""
        return self.flops[phase] / (self.devices.get(phase, 1) * self.peak_flops * self.mfu)

    @property
    def seconds(self) -> float:
        return sum(self.phase_seconds(phase) for phase in self.flops)

    def line(self) -> str:
        phases = ", ".join(f"{k} {self.phase_seconds(k):.2f}s on {_devices(self.devices.get(k, 1))}" for k in self.flops)
        left_out = f"; not counted: {self.left_out}" if self.left_out else ""
        return f"step time at most ~{self.seconds:.2f}s at {self.peak_flops:.3g} FLOP/s per device x MFU {self.mfu}: {phases}{left_out}"


@dataclass(frozen=True)
class MemoryPlan:
    """Every role's memory, what each device holds, and whether it fits ``device_bytes`` (None: not checked):
    ``problems`` says what does not fit (a device over by how much, an engine that holds no sequence), ``advice`` what
    to change; ``device_notes``: how a device's figure was reached (a colocated engine's GPU)."""

    roles: list[RoleMemory]
    per_device: dict[str, int]
    device_bytes: float | None
    advice: list[str] = field(default_factory=list)
    step: StepEstimate | None = None
    problems: list[str] = field(default_factory=list)
    device_notes: dict[str, str] = field(default_factory=dict)

    @property
    def fits(self) -> bool | None:
        if self.problems:
            return False
        return None if self.device_bytes is None else True

    def lines(self) -> list[str]:
        """The planner's lines (also printed as ``[plan]`` lines by ``nemo-like plan``)."""
        out = [r.line() for r in self.roles]
        for device, used in self.per_device.items():
            budget = "" if self.device_bytes is None else f" of {self.device_bytes / GIB:.3g} GiB"
            note = f" ({self.device_notes[device]})" if device in self.device_notes else ""
            out.append(f"memory on {device}: {used / GIB:.3f} GiB{budget}{note}")
        if self.fits is not None:
            out.append("fits: yes" if self.fits else "fits: NO: " + "; ".join(self.problems + self.advice))
        if self.step is not None:
            out.append(self.step.line())
        return out


def runs_autocast(cfg: Any) -> bool:
    """Whether the policy computes under ``torch.autocast`` over its float32 masters: a lower precision on one
    unsharded rank (``dp_size x tensor_parallel_size`` 1, :func:`nemo_like.models.precision.compute_context`); sharded
    ranks compute with FSDP2's mixed-precision policy instead (parameters gathered in the compute dtype)."""
    pc = cfg.policy
    return DTYPE_BYTES[pc.precision] != 4 and pc.dp_size * pc.dtensor_cfg.tensor_parallel_size == 1


def cpu_float32_attention(cfg: Any) -> bool:
    """Whether the policy's attention runs in float32 under a lower compute precision: under autocast
    (:func:`runs_autocast`) on a CPU (``nemo_like.models.attention``)."""
    return runs_autocast(cfg) and not cfg.cluster.gpus_per_node


def activation_bytes(cfg: Any) -> tuple[int, int]:
    """Bytes of a value a layer saves for backward and of its hidden-sized values (the ``8H`` of
    :meth:`ModelShape.layer_values_per_token`): both the compute dtype's, except under autocast (:func:`runs_autocast`),
    where the residual stream starts from the float32 embeddings and the norms compute in float32, so those stay 4."""
    value_bytes = DTYPE_BYTES[cfg.policy.precision]
    return value_bytes, 4 if runs_autocast(cfg) else value_bytes


def autocast_weight_copies(cfg: Any, params: list[ParameterSpec]) -> int:
    """Bytes of the compute-dtype copies autocast makes of the policy's matmul weights (:func:`runs_autocast`; 0
    otherwise): it caches the cast of every float32 weight that requires a gradient until the forward ends, and the
    backward keeps them, so every decoder layer's trainable matrices (a LoRA run's adapters: its base is already in
    the compute dtype) and the output head's (an input embedding is looked up, not cast) at once."""
    if not runs_autocast(cfg):
        return 0
    cast = [p for p in params if p.trainable and p.bytes_per_element == 4 and len(p.shape) == 2]
    layers = sum(math.prod(p.shape) for p in cast if p.layer is not None)
    head = max((math.prod(p.shape) for p in cast if p.root), default=0)  # tied or not, one head is cast
    return (layers + head) * DTYPE_BYTES[cfg.policy.precision]


#: Bytes the trainer's truncation (``policy.generation.top_k`` / ``top_p``) saves for backward per logit: a masked
#: float32 copy of the logits and its bool mask (``token_logprobs_from_logits``; measured 5 on a CPU).
TRUNCATION_BYTES_PER_LOGIT = 5

#: Bytes per output-head weight a CPU worker with a chunked head holds in MKL's buffers: MKL packs the head for a
#: matmul and its memory manager keeps the buffer (measured 24 MiB for a 31 MiB float32 head with 2 threads, one more
#: for a matmul of another shape; ``MKL_DISABLE_FAST_MM=1`` gives it back, at a cost in speed). An unchunked head keeps
#: it too, inside its 12 bytes a logit (measured 9.6-11.2 with it): not added there (docs/guides/planning.md).
MKL_PACKED_HEAD_BYTES = 4

#: Bytes per logit of a chunked training head (``policy.logprob_chunk_size``) at its peak: the backward recomputes
#: each chunk's logits and holds them, their log-softmax pieces and their gradient at once (measured on a CPU).
CHUNK_RECOMPUTE_BYTES_PER_LOGIT = 16


def truncates(cfg: Any) -> bool:
    """Whether the trainer scores tokens under a top-k / top-p truncated distribution (as
    :attr:`~nemo_like.models.processed_logprobs.SamplingDistribution.truncates`)."""
    g = cfg.policy.generation
    return bool(g.top_k) or g.top_p < 1.0


def lora_dropout_bytes_per_token(cfg: Any, params: list[ParameterSpec], shape: ModelShape) -> int:
    """Bytes one decoder layer's LoRA dropout saves for backward per token (0 without LoRA or at ``dropout`` 0): PEFT
    drops out each adapted projection's input before its adapter, and the dropped-out copy feeds ``lora_A``. Counted as
    6 bytes per input value in float32 and 4 in bfloat16 (measured on a CPU: 5.3 and 3.7, the copy, its mask and
    views), over the inputs of the adapted projections (the ``in`` of each ``lora_A`` of shape ``(dim, in)``)."""
    lora = cfg.policy.lora_cfg
    if not lora.enabled or not lora.dropout:
        return 0
    # an adapter's B is (out, dim): it matches only where a projection's output width equals the rank (none in practice)
    inputs = sum(p.shape[1] for p in params if p.trainable and p.layer is not None and len(p.shape) == 2 and p.shape[0] == lora.dim)
    per_value = 6 if DTYPE_BYTES[cfg.policy.precision] == 4 else 4
    return inputs * per_value // max(1, shape.layers)


def _training_activations(
    cfg: Any, shape: ModelShape, value_bytes: int, hidden_bytes: int | None = None, dropout_bytes: int = 0, head_trains: bool = True
) -> int:
    """The training micro-batch's peak (module docstring); ``dropout_bytes``: a layer's LoRA dropout copies per token
    (:func:`lora_dropout_bytes_per_token`); ``head_trains``: the output head has a gradient (not under LoRA)."""
    pc = cfg.policy
    hidden_bytes = value_bytes if hidden_bytes is None else hidden_bytes
    tokens = micro_batch_tokens(cfg, training=True)
    tp = pc.dtensor_cfg.tensor_parallel_size
    per_layer = tokens * (shape.layer_bytes_per_token(value_bytes, hidden_bytes, tp, cpu_float32_attention(cfg)) + dropout_bytes)
    logit_rows = min(tokens, pc.logprob_chunk_size) if pc.logprob_chunk_size else tokens
    # float32 logits, log-softmax, gradient; a chunk's recompute in the backward holds one more float32 copy (the scaled
    # logits logsumexp saves, the gather's dense gradient, exp(x - lse), the logits' gradient: 16 measured on a CPU)
    per_logit = (CHUNK_RECOMPUTE_BYTES_PER_LOGIT if pc.logprob_chunk_size else 12) + (TRUNCATION_BYTES_PER_LOGIT if truncates(cfg) else 0)
    logits = logit_rows * shape.vocab * per_logit
    if pc.logprob_chunk_size and head_trains:
        # The chunked head adds the chunks' weight gradients up in float32 (rounded once): a float32 head-sized sum and
        # one chunk's head gradient in the weight's dtype (float32 but for a sharded bf16 run's compute copy), held with
        # every layer's activations at the start of the backward
        head_bytes = value_bytes if value_bytes < 4 and not runs_autocast(cfg) else 4
        logits += shape.vocab * shape.hidden * (4 + head_bytes)
    logits += mkl_packed_head(cfg, shape)
    if pc.dtensor_cfg.activation_checkpointing:  # each layer's input; a layer is recomputed after the logits are freed
        return with_packed_mask(cfg, tokens * shape.hidden * hidden_bytes * shape.layers + max(per_layer, logits), True, shape.packed_masks)
    return with_packed_mask(cfg, per_layer * shape.layers + logits, True, shape.packed_masks)


def _logprob_activations(cfg: Any, shape: ModelShape, value_bytes: int, hidden_bytes: int | None = None) -> int:
    tokens = micro_batch_tokens(cfg, training=False)
    chunk = cfg.policy.logprob_chunk_size
    logit_rows = min(tokens, chunk) if chunk else tokens
    tp = cfg.policy.dtensor_cfg.tensor_parallel_size
    per_layer = tokens * shape.layer_bytes_per_token(value_bytes, hidden_bytes, tp, cpu_float32_attention(cfg))
    logits = logit_rows * shape.vocab * 8 + mkl_packed_head(cfg, shape)  # logits + log-softmax
    return with_packed_mask(cfg, per_layer + logits, False, shape.packed_masks)


def mkl_packed_head(cfg: Any, shape: ModelShape) -> int:
    """The bytes of MKL's packed copy of the output head a CPU worker with a chunked head keeps
    (:data:`MKL_PACKED_HEAD_BYTES`); 0 on a GPU or unchunked."""
    if not cfg.policy.logprob_chunk_size or cfg.cluster.gpus_per_node:
        return 0
    return shape.vocab * shape.hidden * MKL_PACKED_HEAD_BYTES


def micro_batch_tokens(cfg: Any, training: bool) -> int:
    """Tokens of the largest micro-batch of a training (or logprob) pass: with sequence packing or dynamic batching
    the token budget, or ``policy.max_total_sequence_length`` when larger (a sample longer than the budget gets a
    micro-batch of its own: :mod:`nemo_like.models.policy.batching`), else rows x ``policy.max_total_sequence_length``:
    a logprob pass's rows at most the largest of the ``dp_size`` row blocks the rollout batch is split into
    (:func:`~nemo_like.models.policy.rows.split_rows_unevenly`: ``ceil(rollout / dp_size)``)."""
    pc = cfg.policy
    for mode in (pc.sequence_packing, pc.dynamic_batching):
        if mode.enabled:
            budget = mode.train_mb_tokens if training else mode.logprob_mb_tokens
            return max(budget, pc.max_total_sequence_length)
    if training:
        rows = min(pc.train_micro_batch_size, pc.train_global_batch_size // pc.dp_size)
    else:
        rows = min(pc.logprob_batch_size, math.ceil(cfg.rollout_batch_size / pc.dp_size))
    return rows * pc.max_total_sequence_length


def packed_mask_bytes(cfg: Any, training: bool, masks: int = 1) -> tuple[int, int]:
    """Sequence packing's dense ``[T, T]`` block-causal mask of the largest packed micro-batch
    (:func:`~nemo_like.models.policy.batching.block_causal_mask`, ``T`` its :func:`micro_batch_tokens`): the bytes it
    holds through the pass (additive, in the compute dtype; attention saves it for backward), and the peak of building
    it, before the forward (that mask, the ``zeros`` it is filled from and two bool ``[T, T]`` temporaries). ``masks``
    2: a sliding-window model's second, windowed mask (:func:`~nemo_like.models.policy.batching.packed_model_mask`),
    built from the first with one bool temporary. ``(0, 0)`` without packing."""
    if not cfg.policy.sequence_packing.enabled:
        return 0, 0
    entries = micro_batch_tokens(cfg, training) ** 2
    value_bytes = DTYPE_BYTES[cfg.policy.precision]
    building = entries * (2 * value_bytes + 2)
    if masks > 1:
        building = max(building, entries * (2 * value_bytes + 1))
    return masks * entries * value_bytes, building


def with_packed_mask(cfg: Any, activations: int, training: bool, masks: int = 1) -> int:
    """A pass's ``activations`` with its packed masks (:func:`packed_mask_bytes`): held beside them, or the peak of
    building them when larger."""
    held, building = packed_mask_bytes(cfg, training, masks)
    return max(activations + held, building)


def unsharded_root_bytes(cfg: Any, params: list[ParameterSpec]) -> int:
    """What FSDP2 all-gathers on every rank for the root unit (the parameters outside the decoder layers) and holds from
    the start of a forward to the end of its backward: their full size at the compute dtype (FSDP2's mixed-precision
    policy gathers bf16 copies under ``precision: bfloat16``). Nothing at ``dp_size`` 1, where the model is not sharded."""
    if cfg.policy.dp_size <= 1:
        return 0
    return sum(math.prod(p.shape) for p in params if p.root) * DTYPE_BYTES[cfg.policy.precision]


def largest_layer_bytes(cfg: Any, params: list[ParameterSpec]) -> int:
    """The largest decoder layer's parameters as FSDP2 unshards them on a rank while the layer computes: its
    tensor-parallel piece at full size, at the compute dtype."""
    tp = cfg.policy.dtensor_cfg.tensor_parallel_size
    layers: dict[int, int] = {}
    for p in params:
        if p.layer is not None:
            layers[p.layer] = layers.get(p.layer, 0) + math.prod(p.tp_shape(tp))
    return max(layers.values(), default=0) * DTYPE_BYTES[cfg.policy.precision]


def policy_memory(
    cfg: Any, params: list[ParameterSpec], shape: ModelShape, role: str = "policy", policy_logprob_pass: bool = True
) -> RoleMemory:
    """One rank of the trainable policy (``role="policy"``) or of a frozen copy (``"reference"``, ``"teacher"``).
    ``policy_logprob_pass``: whether the policy also runs a logprob pass (the run plan's prev pass, or LoRA's reference
    with the adapters disabled), whose micro-batch of ``policy.logprob_batch_size`` rows may hold more than training's.
    With FSDP2's CPU offload (:meth:`~nemo_like.config.schema.MasterConfig.offloads_to_cpu`) its parameters,
    gradients and AdamW state are in host RAM and the device holds the activations, the unsharded root and the
    largest decoder layer, unsharded while it computes."""
    pc = cfg.policy
    dp, tp = pc.dp_size, pc.dtensor_cfg.tensor_parallel_size
    value_bytes, hidden_bytes = activation_bytes(cfg)
    root = unsharded_root_bytes(cfg, params)
    offload = {"offloaded": True, "unsharded_layer": largest_layer_bytes(cfg, params)} if cfg.offloads_to_cpu() else {}
    if role != "policy":  # frozen copies load float32 weights whatever the precision
        held = frozen_copy_bytes(cfg, params)
        activations = _logprob_activations(cfg, shape, value_bytes, hidden_bytes)
        return RoleMemory(role, dp * tp, params=held, activations=activations, unsharded_root=root, note="logprobs only", **offload)
    held = sum(p.shard_bytes(dp, tp) for p in params)
    grads = sum(p.as_held(True, 4).shard_bytes(dp, tp) for p in params if p.trainable)
    dropout = lora_dropout_bytes_per_token(cfg, params, shape)  # training only: the logprob passes run in eval mode
    head_trains = any(p.trainable and p.shape == (shape.vocab, shape.hidden) for p in params)  # tied or not; not LoRA's
    training = _training_activations(cfg, shape, value_bytes, hidden_bytes, dropout, head_trains)
    passes = max(training, _logprob_activations(cfg, shape, value_bytes, hidden_bytes) if policy_logprob_pass else 0)
    copies = autocast_weight_copies(cfg, params)  # cached by the logprob passes' forwards too (no_grad caches them)
    note = f"with {copies / GIB:.3f} GiB of autocast's {pc.precision} weight copies" if copies else ""
    return RoleMemory(
        role, dp * tp, params=held, grads=grads, optimizer=2 * grads, activations=passes + copies, unsharded_root=root, note=note, **offload
    )


def frozen_copy_bytes(cfg: Any, params: list[ParameterSpec]) -> int:
    """Bytes one rank holds of a frozen copy of a model (reference, teacher): float32 weights (whatever the
    precision) sharded like the policy's."""
    pc = cfg.policy
    return sum(p.as_held(False, 4).shard_bytes(pc.dp_size, pc.dtensor_cfg.tensor_parallel_size) for p in params)


def with_teacher_copy(cfg: Any, policy: RoleMemory, params: list[ParameterSpec], shape: ModelShape) -> RoleMemory:
    """A policy rank with the KL loss term's frozen teacher copy (``distillation.kl_weight > 0``): the teacher's float32
    weights sharded like the policy's, and per training micro-batch its last hidden states (chunked) or full float32
    logits (unchunked), plus the KL's per-chunk float32 temporaries (both models' logits, probabilities, gradient); with
    packing its own packed masks (:func:`packed_mask_bytes`, in its dtype)."""
    pc = cfg.policy
    tokens = micro_batch_tokens(cfg, training=True)
    held = frozen_copy_bytes(cfg, params)
    rows = min(tokens, pc.logprob_chunk_size) if pc.logprob_chunk_size else tokens
    teacher_bytes = DTYPE_BYTES[cfg.teacher.precision or pc.precision]  # the copy computes at the teacher's precision
    kept = tokens * shape.hidden * teacher_bytes if pc.logprob_chunk_size else tokens * shape.vocab * 4
    activations = kept + rows * shape.vocab * 4 * 6
    if pc.sequence_packing.enabled:  # the teacher's own packed masks (its dtype; the student's first when they agree)
        shared = 1 if teacher_bytes == DTYPE_BYTES[pc.precision] else 0
        activations += (shape.packed_masks - shared) * tokens * tokens * teacher_bytes
    note = f"{policy.note}; " if policy.note else ""
    return replace(
        policy,
        params=policy.params + held,
        activations=policy.activations + activations,
        note=f"{note}with the teacher copy of the KL term: {held / GIB:.3f} GiB of weights",
    )


def with_inline_sampling(cfg: Any, policy: RoleMemory, shape: ModelShape, weight_copies: int = 0) -> RoleMemory:
    """The one policy worker of the inline backend, which also samples: holding its parameters, gradients (kept
    between steps) and AdamW state, it samples up to :data:`~nemo_like.plan.backend.INLINE_GENERATION_BATCH` sequences
    at once (a rollout batch at most), with their KV cache in the parameters' dtype (float32 masters: the lean decoder
    allocates it like the residual stream), the float32 logits of their next token and ``weight_copies`` bytes of weights the
    sampler copies for the call (fused projections, oneDNN-packed ones: :func:`inline_sampling_rows` rows, see
    ``fused_step_copy_elements`` in :mod:`nemo_like.models.generation.lean_decoder`). Its activation-time peak is the
    larger of that and the training / logprob passes' activations."""
    batch = inline_sampling_rows(cfg)
    kv = batch * shape.kv_bytes_per_sequence(DTYPE_BYTES["float32"], cfg.policy.max_total_sequence_length)
    logits = batch * shape.vocab * 4
    sampling = kv + logits + weight_copies
    note = (
        f"activations: the larger of training / logprob passes {policy.activations / GIB:.3f} and inline sampling {sampling / GIB:.3f} "
        f"(kv cache of {batch} sequences {kv / GIB:.3f} + logits {logits / GIB:.3f} + weight copies {weight_copies / GIB:.3f})"
    )
    return replace(
        policy,
        activations=max(policy.activations, sampling),
        samples_at_peak=sampling > policy.activations,
        note=f"{policy.note}; {note}" if policy.note else note,
    )


def inline_sampling_rows(cfg: Any) -> int:
    """Sequences the inline backend samples at once (:func:`sampling_rows`, at most
    :data:`~nemo_like.plan.backend.INLINE_GENERATION_BATCH`)."""
    return sampling_rows(cfg, INLINE_GENERATION_BATCH)


def hf_sampling_rows(cfg: Any) -> int:
    """Sequences the HF engine samples at once (:func:`sampling_rows`, at most
    :data:`~nemo_like.plan.backend.HF_MAX_BATCH_SIZE`)."""
    return sampling_rows(cfg, HF_MAX_BATCH_SIZE)


def sampling_rows(cfg: Any, cap: int) -> int:
    """Sequences one sampling call holds at once, at most ``cap`` (the engine's chunk): the larger of a rollout batch
    and, when validation runs, the validation samples (one call: sizing the KV cache for the rollout batch alone had
    planned 8 rows for a worker that validates 256)."""
    return min(max(cfg.rollout_batch_size, validation_rows(cfg)), cap)


def validation_rows(cfg: Any) -> int:
    """Sequences a validation round samples in one call (0 when validation never runs)."""
    g = cfg.grpo
    if not g.validates:
        return 0
    prompts = g.max_val_samples
    if cfg.data.validation.num_problems is not None:
        prompts = min(prompts, cfg.data.validation.num_problems)
    return prompts * g.val_num_generations_per_prompt


#: What vLLM counts besides the weights and the activations when it sizes its KV cache on a GPU (the CUDA context and
#: other non-torch allocations, ``determine_available_memory``): an estimate, not measured here (no GPU).
VLLM_NON_TORCH_BYTES = GIB // 2


def vllm_kv_budget(
    shape: ModelShape, value_bytes: int, weights: int, share: float, gpu_bytes: float | None, cpu_space_gib: float
) -> tuple[int, int]:
    """``(KV budget, vLLM's own memory)`` of a vLLM engine: on a GPU of ``gpu_bytes``, its ``share`` less the weights and
    :func:`vllm_overhead_bytes` (negative when they exceed the share); on the CPU (``gpu_bytes`` None),
    ``cpu_space_gib`` and nothing of its own."""
    if gpu_bytes is None:
        return int(cpu_space_gib * GIB), 0
    overhead = vllm_overhead_bytes(shape, value_bytes, gpu_bytes)
    return int(share * gpu_bytes) - weights - overhead, overhead


def vllm_overhead_bytes(shape: ModelShape, value_bytes: int, device_bytes: float) -> int:
    """What a vLLM engine on a GPU takes from its ``gpu_memory_utilization`` share besides the weights, before its KV
    cache (vLLM 0.32's ``determine_available_memory``): :data:`VLLM_NON_TORCH_BYTES` and the activation peak of its
    profile run at the LLM class's default batch limits (vLLM's ``arg_utils``: 16,384 batched tokens and 1,024 sequences
    on a GPU of 70 GiB or more, else 8,192 and 256): per batched token the MLP's gate/up output and its activation (3 x
    intermediate) and two hidden states, per sequence a float32 logits row and its softmax. An estimate from vLLM's
    source, not measured on a GPU here."""
    tokens, sequences = (16384, 1024) if device_bytes >= 70 * GIB else (8192, 256)
    activations = tokens * (3 * shape.intermediate + 2 * shape.hidden) * value_bytes
    return VLLM_NON_TORCH_BYTES + activations + sequences * shape.vocab * 4 * 2


def generation_memory(
    cfg: Any, backend: str, parameters: int, shape: ModelShape, device_bytes: float | None, weight_copies: int = 0
) -> RoleMemory:
    """The generation engine's worker: nothing of its own for ``inline`` (the policy samples), the HF engine's weights
    and the KV cache of the sequences it samples at once (a rollout batch, in batches of at most
    :data:`~nemo_like.plan.backend.HF_MAX_BATCH_SIZE`), with its sampler's ``weight_copies`` and their next token's
    float32 logits (the HF engine samples with the lean decoder), or vLLM's weights and KV-cache budget (and how many
    full-length sequences fit). Both engines load the model, and keep its keys and values, at ``policy.precision``."""
    pc, g = cfg.policy, cfg.policy.generation
    on_gpu = bool(cfg.cluster.gpus_per_node)
    if backend == "inline":
        return RoleMemory("generation", 0, note="inline: the policy worker samples")
    value_bytes = DTYPE_BYTES[pc.precision]
    weights = parameters * value_bytes
    per_sequence = shape.kv_bytes_per_sequence(value_bytes, pc.max_total_sequence_length, backend)
    if backend == "hf":
        batch = hf_sampling_rows(cfg)
        logits = batch * shape.vocab * 4
        note = f"hf engine, KV of {batch} sequences at once; sampler weight copies {weight_copies / GIB:.3f} + logits {logits / GIB:.3f}"
        return RoleMemory(
            "generation", GENERATION_ENGINES, params=weights, kv_cache=batch * per_sequence, activations=weight_copies + logits, note=note
        )
    share = g.vllm_cfg.gpu_memory_utilization
    if on_gpu and device_bytes is None:
        note = f"vLLM, KV budget {share:g} x the device's memory - the weights: the device's size is not given"
        return RoleMemory("generation", GENERATION_ENGINES, params=weights, note=note)
    budget, overhead = vllm_kv_budget(shape, value_bytes, weights, share, device_bytes if on_gpu else None, g.vllm_cfg.kv_cache_space_gib)
    budget = max(0, budget)
    sequences = sequences_held(budget, per_sequence if shape.state_known else 0)
    note = f"vLLM, KV budget holds {sequences_text(sequences)} sequences of {pc.max_total_sequence_length} tokens"
    if on_gpu:
        note += f"; vLLM's own {overhead / GIB:.3f} GiB (profile-run activations and non-torch memory, estimated) in activations"
    return RoleMemory(
        "generation",
        GENERATION_ENGINES,
        params=weights,
        kv_cache=budget,
        activations=overhead,
        note=note,
        kv_sequences=sequences,
        kv_sequence_bytes=per_sequence,
    )


def step_estimate(
    cfg: Any,
    run_plan: Any,
    matmul_parameters: int,
    peak_flops: float,
    mfu: float,
    teacher_parameters: Mapping[str, int] | None = None,
    *,
    trained_token_flops: float,
) -> StepEstimate:
    """FLOPs of one step by phase (every sequence at its maximum length: an upper bound), each on the devices that run
    it: generation on the :data:`~nemo_like.plan.backend.GENERATION_ENGINES` engines (the inline backend: the one
    policy worker), the prev pass and training on the policy's ``dp_size x tensor_parallel_size`` ranks, the reference
    pass on as many reference ranks (the policy's own with LoRA), a teacher pass on each teacher's as many ranks.
    ``matmul_parameters``: the policy's N; ``trained_token_flops``: the FLOPs of one trained token (the run's own
    formula, :func:`~nemo_like.utils.flops.training_flops_per_token`: 6N, with LoRA 4N + 6 N_lora);
    ``teacher_parameters``: each teacher model's N (by name). The teachers score
    disjoint rows (``teacher.by_task``) at the same time, so their pass is bounded by the largest scoring every row;
    the KL loss term's teacher copy (``distillation.kl_weight``) runs a forward of ``teacher.model_name`` per trained
    token on the policy ranks.

    On a CPU cluster a device is a node (all its cores: what the peak is measured on), so a phase of ranks runs on the
    nodes they span as the run plan's thread split places them (``run_plan.policy_nodes``; PACK fills a node first),
    however many ranks share a node. With ``grpo.use_dynamic_sampling`` a step may generate
    up to ``dynamic_sampling_max_gen_batches`` batches; activation checkpointing runs each training forward twice (2N
    more per trained token)."""
    pc, logprobs = cfg.policy, run_plan.logprobs
    tokens = cfg.rollout_batch_size * pc.max_total_sequence_length
    ranks = pc.dp_size * pc.dtensor_cfg.tensor_parallel_size
    engines = GENERATION_ENGINES
    if not cfg.cluster.gpus_per_node:  # the ranks of a node share its cores
        ranks, engines = run_plan.policy_nodes, min(engines, run_plan.nodes)
    teachers = teacher_parameters or {}
    n = matmul_parameters
    batches = cfg.grpo.dynamic_sampling_max_gen_batches if cfg.grpo.use_dynamic_sampling else 1
    # prefill and decode both cost 2N per token: the generation phase touches every token once
    phases: dict[str, tuple[float, int]] = {"generation": (2.0 * n * tokens * batches, engines)}
    if logprobs.compute_prev:
        phases["prev logprobs"] = (2.0 * n * tokens, ranks)
    if logprobs.compute_reference:
        phases["reference logprobs"] = (2.0 * n * tokens, ranks)
    if logprobs.compute_teacher:
        phases["teacher logprobs"] = (2.0 * max(teachers[m] for m in cfg.teacher.models()) * tokens, ranks)
    recompute = 2.0 * n if pc.dtensor_cfg.activation_checkpointing else 0.0  # the forward again, in the backward
    phases["training"] = ((trained_token_flops + recompute) * tokens, ranks)
    if cfg.distillation.kl_weight > 0 and cfg.teacher.model_name is not None:
        phases["teacher copy (KL term)"] = (2.0 * teachers[cfg.teacher.model_name] * tokens, ranks)
    flops = {phase: f for phase, (f, _) in phases.items()}
    return StepEstimate(flops, peak_flops, mfu, {phase: d for phase, (_, d) in phases.items()})


@dataclass(frozen=True)
class ScorerSpec:
    """A reward model an environment loads in its actors (``env.<task>``, or a composite's source): its planned
    ``role`` (``reward_model:<task>[.<source>]``), model, dtype, actors (``workers``, each holding the model), GPUs per
    actor (0: the CPU) and the padded tokens of one forward (``max_tokens_per_batch``)."""

    role: str
    model_name: str
    precision: str
    workers: int
    num_gpus: float
    max_tokens_per_batch: int
    shared_device: str | None = None  # a composite actor's GPU its reward-model sources share (``<task> cuda:<i>``)
    actor_gpus: float = 0.0  # with ``shared_device``: the GPUs the composite actor reserves (its sources' placement)


def scorer_memory(spec: ScorerSpec, parameters: int, hidden: int, intermediate: int) -> RoleMemory:
    """One reward-model actor: its weights at ``spec.precision`` (exact: the model's ``parameters``) and one no-grad
    forward of ``max_tokens_per_batch`` padded tokens, estimated as ``tokens x (4 hidden + 2 intermediate) x bytes``
    (a layer's input and output, its attention's projections and its MLP's widest values; nothing is kept across
    layers without a backward; the attention's score matrices are not counted)."""
    value_bytes = DTYPE_BYTES[spec.precision]
    activations = spec.max_tokens_per_batch * (4 * hidden + 2 * intermediate) * value_bytes
    note = f"a reward model: weights at {spec.precision}, one forward of {spec.max_tokens_per_batch} tokens (estimated)"
    device = f"reward_model:{spec.shared_device} GPU" if spec.shared_device else ""
    # a composite actor reserves its sources' placement: less than one GPU when they share one, and its actors pack so
    fraction = spec.actor_gpus if spec.shared_device else spec.num_gpus
    return RoleMemory(
        spec.role, spec.workers, params=parameters * value_bytes, activations=activations, note=note, on_host=not spec.num_gpus,
        device=device, per_device=_packed_per_gpu(fraction, spec.workers),
        fit_hint="lower its environment's max_tokens_per_batch, or set its precision: bfloat16",
    )  # fmt: skip


def _packed_per_gpu(fraction: float, workers: int) -> int:
    """Actors of ``fraction`` of a GPU each one GPU may hold: Ray may put up to 1 / fraction of them on one."""
    return max(1, min(workers, math.floor(1 / fraction + 1e-9))) if 0 < fraction < 1 else 1


@dataclass(frozen=True)
class JudgeSpec:
    """An LLM judge an environment starts (``env.<task>``, or a composite's source): its planned ``role``
    (``judge:<task>[.<source>]``), model, dtype, generation actors (``workers``: the environment's actors x its
    ``num_engine_workers``), GPUs per actor (0: the CPU), engine (``hf`` or ``vllm``), prompts per engine call
    (``max_batch_size``), the longest judge sequence in tokens (``context``: ``engine_max_model_len``, else estimated,
    ``context_note`` says how) and vLLM's KV settings."""

    role: str
    model_name: str
    precision: str
    workers: int
    num_gpus: float
    backend: str
    max_batch_size: int
    context: int
    context_note: str
    kv_cache_space_gib: int
    gpu_memory_utilization: float


def sequences_held(budget: int, per_sequence: int) -> int | None:
    """Full-length sequences a vLLM KV ``budget`` holds at ``per_sequence`` bytes each; ``None`` where the size of a
    sequence's cache is not known (0: no layer's is, or a state's is not: :attr:`ModelShape.state_known`), unless no
    budget is left at all (0: the weights leave none)."""
    if per_sequence:
        return max(0, budget) // per_sequence
    return 0 if budget <= 0 else None


def sequences_text(sequences: int | None) -> str:
    """:func:`sequences_held` as a plan line says it."""
    return "an unknown number of" if sequences is None else str(sequences)


def judge_memory(spec: JudgeSpec, parameters: int, shape: ModelShape, device_bytes: float | None, weight_copies: int = 0) -> RoleMemory:
    """One judge generation actor: its weights at ``spec.precision`` (exact: the model's ``parameters``) and, with the
    ``hf`` engine, the KV cache of ``max_batch_size`` sequences of ``context`` tokens, the lean decoder's
    ``weight_copies`` and their next token's float32 logits (as :func:`generation_memory` plans the policy's HF engine);
    with ``vllm``, its share of the GPU (weights, vLLM's own memory and the KV budget) or, on the CPU, the weights and
    ``kv_cache_space_gib``. A vLLM budget that holds no sequence of ``context`` tokens is a :attr:`RoleMemory.problem`."""
    value_bytes = DTYPE_BYTES[spec.precision]
    weights = parameters * value_bytes
    per_sequence = shape.kv_bytes_per_sequence(value_bytes, spec.context, spec.backend)
    on_gpu = spec.num_gpus > 0
    common = dict(on_host=not on_gpu, per_device=_packed_per_gpu(spec.num_gpus, spec.workers))
    if spec.backend == "hf":
        logits = spec.max_batch_size * shape.vocab * 4
        note = (
            f"an LLM judge, hf engine: KV of {spec.max_batch_size} sequences of {spec.context} tokens ({spec.context_note}); "
            f"sampler weight copies {weight_copies / GIB:.3f} + logits {logits / GIB:.3f}"
        )
        hint = "lower its environment's max_batch_size or engine_max_model_len, or set its precision: bfloat16"
        return RoleMemory(
            spec.role, spec.workers, params=weights, kv_cache=spec.max_batch_size * per_sequence, activations=weight_copies + logits,
            note=note, fit_hint=hint, **common,
        )  # fmt: skip
    hint = "lower its environment's engine_gpu_memory_utilization, or set its precision: bfloat16"
    if on_gpu and device_bytes is None:
        note = f"an LLM judge, vLLM: KV budget {spec.gpu_memory_utilization:g} x the device's memory - the weights: the device's size is not given"
        return RoleMemory(spec.role, spec.workers, params=weights, note=note, fit_hint=hint, **common)
    budget, overhead = vllm_kv_budget(
        shape, value_bytes, weights, spec.gpu_memory_utilization, device_bytes if on_gpu else None, spec.kv_cache_space_gib
    )
    how = "engine_gpu_memory_utilization x device - weights - vLLM's own" if on_gpu else "engine_kv_cache_space_gib"
    sequences = sequences_held(budget, per_sequence if shape.state_known else 0)
    note = f"an LLM judge, vLLM: KV budget holds {sequences_text(sequences)} sequences of {spec.context} tokens ({spec.context_note})"
    each = f"{_size(per_sequence)} each" if per_sequence else "its weights and vLLM's own memory leave none"
    problem = (
        f"{spec.role}'s vLLM KV budget ({_size(max(0, budget))} = {how}) holds no sequence of {spec.context} tokens ({each})"
        if sequences == 0
        else ""
    )
    return RoleMemory(
        spec.role, spec.workers, params=weights, kv_cache=max(0, budget), activations=overhead, note=note, fit_hint=hint,
        problem=problem, **common,
    )  # fmt: skip


def plan_memory(
    cfg: Any,
    run_plan: Any,
    params: list[ParameterSpec],
    shape: ModelShape,
    device_bytes: float | None = None,
    teachers: Mapping[str, tuple[list[ParameterSpec], ModelShape]] | None = None,
    step: StepEstimate | None = None,
    sampler_weight_copies: int = 0,
    cluster_problem: Callable[[Any], str | None] | None = None,
    scorers: Sequence[RoleMemory] = (),
) -> MemoryPlan:
    """Every role of the run ``run_plan`` describes, what each device (GPU) or node (CPU) holds, and whether it fits
    ``device_bytes``; ``teachers``: each teacher model's parameters and shape (by name, every one of
    ``teacher.models()``) when the run distils; ``sampler_weight_copies``: bytes of weights the lean decoder copies for a
    call, in the inline backend's policy worker (:func:`with_inline_sampling`) or the HF engine
    (:func:`generation_memory`): :func:`~nemo_like.models.footprint.sampler_copy_bytes`; ``cluster_problem(config)``: what
    keeps the run off the declared cluster whatever the memory (the caller's: more GPUs reserved than declared);
    ``scorers``: the reward models and LLM judges the environments load (:func:`scorer_memory`, :func:`judge_memory`),
    each actor on a GPU of its own, as many as Ray may pack of fractional ones (or in its node's RAM)."""
    teachers = teachers or {}
    if not cfg.cluster.gpus_per_node and run_plan.nodes != cfg.cluster.num_nodes:
        cfg = _with(cfg, "cluster", num_nodes=run_plan.nodes)  # a CPU run plans its cluster's own nodes (plan_on_cluster)
    roles, per_device, colocated = _plan_devices(cfg, run_plan, params, shape, device_bytes, teachers, sampler_weight_copies, scorers)
    notes = {"policy GPU": colocated_note(cfg, roles)} if colocated and "policy GPU" in per_device else {}
    if (node := node_note(cfg, run_plan.threads.cpus)) and NODE_RAM in per_device:
        notes[NODE_RAM] = node
    over = over_budget(per_device, device_bytes)
    engine = engine_problems(cfg, roles, device_bytes)
    advice = []
    if over:

        def shrinks(changed: Any) -> bool:  # every device that is over holds no more, one of them less
            again = _plan_devices(changed, run_plan, params, shape, device_bytes, teachers, sampler_weight_copies, scorers)[1]
            return all(again.get(d, 0) <= per_device[d] for d in over) and any(again.get(d, 0) < per_device[d] for d in over)

        # A smaller engine share helps only where the engine's share is what is over (not the training peak) and the
        # engine still holds a sequence (lowering it while the KV budget is short contradicts raising it).
        share_may_help = colocated and "policy GPU" in over and not engine
        scorer_devices = {r.gpu for r in scorers}
        policy_over = any(d != "generation GPU" and d not in scorer_devices for d in over)
        backend = run_plan.backend.value  # where the KV cache of the sequences sampled at once lies: is it over?
        inline_kv = backend == "inline" and policy_over and roles[0].samples_at_peak  # sampling, not training, is its peak
        kv_over = "generation GPU" in over or inline_kv or (backend == "hf" and not cfg.cluster.gpus_per_node)
        advice = fit_advice(cfg, shrinks, share_may_help, policy_over, kv_over, cluster_problem, backend, run_plan.model)
        hints = {r.gpu: r.fit_hint for r in scorers}
        advice += [f"{device}: {hints[device]}" for device in sorted(scorer_devices & set(over))]
    advice += kv_advice(cfg, roles, device_bytes, shape) if engine else []
    tp_problems = tensor_parallel_problems(cfg, shape.heads, shape.kv_heads)  # teachers take the policy's degree too
    tp_problems += [f"teacher {name}: {p}" for name, (_, t) in teachers.items() for p in tensor_parallel_problems(cfg, t.heads, t.kv_heads)]
    cluster_problems = [p for p in [cluster_problem(cfg) if cluster_problem is not None else None] if p]
    problems = [*cluster_problems, *tp_problems, *over.values(), *engine, *(r.problem for r in scorers if r.problem)]
    return MemoryPlan(roles, per_device, device_bytes, advice, step, problems, notes)


def tensor_parallel_problems(cfg: Any, heads: int, kv_heads: int) -> list[str]:
    """The tensor-parallel degree must divide the attention and KV heads (the policy's sharding splits heads across the
    ranks): refused here, as the run's workers would refuse it after they started."""
    tp = cfg.policy.dtensor_cfg.tensor_parallel_size
    if heads % tp or kv_heads % tp:
        return [
            f"policy.dtensor_cfg.tensor_parallel_size={tp} must divide num_attention_heads={heads} and "
            f"num_key_value_heads={kv_heads} (the heads are split across the tensor-parallel ranks)"
        ]
    return []


def _with_engine_share(cfg: Any, utilization: float) -> Any:
    """``cfg`` with ``policy.generation.vllm_cfg.gpu_memory_utilization`` set to ``utilization`` (a what-if plan)."""
    generation = cfg.policy.generation
    vllm_cfg = generation.vllm_cfg.model_copy(update={"gpu_memory_utilization": utilization})
    return _with(cfg, "policy", generation=generation.model_copy(update={"vllm_cfg": vllm_cfg}))


def _with(cfg: Any, section: str, **changes: Any) -> Any:
    """``cfg`` with ``changes`` to one of its sections (``policy``, ``cluster``), for a what-if plan."""
    return cfg.model_copy(update={section: getattr(cfg, section).model_copy(update=changes)})


def _plan_devices(
    cfg: Any,
    run_plan: Any,
    params: list[ParameterSpec],
    shape: ModelShape,
    device_bytes: float | None,
    teachers: Mapping[str, tuple[list[ParameterSpec], ModelShape]],
    sampler_weight_copies: int,
    scorers: Sequence[RoleMemory] = (),
) -> tuple[list[RoleMemory], dict[str, int], bool]:
    """Every role's memory, what each device holds, and whether a vLLM engine is colocated (:func:`plan_memory`)."""
    passes = run_plan.logprobs
    roles = [policy_memory(cfg, params, shape, policy_logprob_pass=passes.compute_prev or passes.reference_from_policy)]
    if cfg.distillation.kl_weight > 0 and teachers:  # the KL term's copy: teacher.model_name, first of the models
        roles[0] = with_teacher_copy(cfg, roles[0], *teachers[cfg.teacher.models()[0]])
    if run_plan.backend.value == "inline":
        roles[0] = with_inline_sampling(cfg, roles[0], shape, sampler_weight_copies)
    if run_plan.logprobs.load_reference_model:
        roles.append(policy_memory(cfg, params, shape, "reference"))
    if run_plan.logprobs.compute_teacher and teachers:
        roles += [policy_memory(cfg.teacher_config(name), *teachers[name], role) for name, role in teacher_roles(cfg).items()]
    merged = cfg.policy.lora_cfg.enabled and run_plan.refit.value != "adapter"  # the engine holds base-shaped weights
    parameters = sum(math.prod(p.shape) for p in params if not (merged and p.trainable))
    hf_copies = sampler_weight_copies if run_plan.backend.value == "hf" else 0
    roles.append(generation_memory(cfg, run_plan.backend.value, parameters, shape, device_bytes, hf_copies))
    roles += scorers
    if buffer := refit_buffer_memory(cfg, run_plan, parameters, DTYPE_BYTES[cfg.policy.precision]):
        roles.append(buffer)
    colocated = run_plan.backend.value == "vllm" and cfg.policy.generation.colocated.enabled
    return roles, devices(cfg, roles, colocated, run_plan.threads.cpus), colocated


def refit_buffer_memory(cfg: Any, run_plan: Any, parameters: int, bytes_per_element: int) -> RoleMemory | None:
    """The copy of the weights a full-weight refit puts in a CPU node's RAM beside the policy's and the engine's: on one
    node the shared-memory buffer (``/dev/shm``) kept for the whole run
    (:func:`~nemo_like.models.refit.transport.shared_memory_refit_possible`), on several the object store's copy during
    each refit (LoRA's merged refits too); the policy's weights in the engine's dtype (``bytes_per_element``:
    ``policy.precision``'s). None where no such copy is made on a CPU node (inline sampling, LoRA's adapter refits,
    GPUs)."""
    if cfg.cluster.gpus_per_node or run_plan.backend.value == "inline" or run_plan.refit.value == "adapter":
        return None
    one_node = cfg.cluster.num_nodes == 1 and run_plan.refit.value == "full"
    note = "the policy's weights for the engine's refits: " + (
        "in /dev/shm, kept between refits" if one_node else "in the object store during each refit"
    )
    return RoleMemory(REFIT_BUFFER, 1, params=parameters * bytes_per_element, on_host=True, note=note)


def teacher_roles(cfg: Any) -> dict[str, str]:
    """The planned role of each teacher model (``teacher.models()`` order): the run starts one group of frozen workers
    per model (``algorithms.roles.role_requests``); ``teacher`` when there is one, ``teacher:<model>`` each otherwise."""
    models = cfg.teacher.models()
    return {name: "teacher" if len(models) == 1 else f"teacher:{name}" for name in models}


def kept_while_generating(cfg: Any, policy: RoleMemory) -> int:
    """What a policy rank keeps on its GPU while a colocated engine generates: before the engine wakes it frees its
    gradients and activations and, with ``policy.generation.colocated.offload_optimizer``, moves its AdamW state to
    CPU memory (``TrainingStep.release_memory``): its parameters (and the optimizer state when kept)."""
    if policy.offloaded:  # FSDP2's CPU offload: nothing of the policy's stays on the GPU
        return 0
    kept_optimizer = 0 if cfg.policy.generation.colocated.offload_optimizer else policy.optimizer
    return policy.params + kept_optimizer


def colocated_peak(cfg: Any, policy: RoleMemory, generation: RoleMemory) -> int:
    """Policy rank 0's GPU with a colocated vLLM engine: the larger of its training peak plus what the sleeping engine
    keeps (``sleep(level=1)`` frees its weights and KV cache, not its process's CUDA context and other non-torch memory:
    :data:`VLLM_NON_TORCH_BYTES`) and, while the engine generates, what the rank keeps plus the engine's whole share
    (weights and KV budget)."""
    return max(policy.total + VLLM_NON_TORCH_BYTES, kept_while_generating(cfg, policy) + generation.total)


def colocated_note(cfg: Any, roles: list[RoleMemory]) -> str:
    """How the colocated GPU's figure was reached (the ``memory on policy GPU`` line)."""
    by_role = {r.role: r for r in roles}
    kept, engine = kept_while_generating(cfg, by_role["policy"]), by_role["generation"].total
    return (
        f"colocated vLLM engine: the larger of training {by_role['policy'].total / GIB:.3f} + the sleeping engine's "
        f"{VLLM_NON_TORCH_BYTES / GIB:.3f} and generating "
        f"{kept / GIB:.3f} kept by the policy + {engine / GIB:.3f} for the engine"
    )


#: The device of a CPU cluster: a node's RAM, which its workers share.
NODE_RAM = "each node (RAM)"


def devices(cfg: Any, roles: list[RoleMemory], colocated: bool = False, node_cpus: int | None = None) -> dict[str, int]:
    """What each device holds: on GPUs every worker has its own (a ``colocated`` vLLM engine shares policy rank 0's:
    :func:`colocated_peak`; a composite actor's reward models placed on one GPU share it, and actors of a fraction of
    a GPU count as many as one GPU may hold: :attr:`RoleMemory.device`, :attr:`RoleMemory.per_device`); on a CPU cluster
    every worker of a node shares the node's memory: under ``cluster.placement_strategy`` PACK / STRICT_PACK on several
    nodes the heaviest workers one node of ``node_cpus`` CPUs may hold (Ray fills a node before the next), never less
    than an even spread; with SPREAD (or without ``node_cpus``), an even spread."""
    by_role = {r.role: r for r in roles}
    if cfg.cluster.gpus_per_node:
        out: dict[str, int] = {}
        for r in (r for r in roles if r.workers and not r.on_host):
            out[r.gpu] = out.get(r.gpu, 0) + r.total * r.per_device
        if colocated and "generation GPU" in out and "policy" in by_role:
            out.pop("generation GPU")
            out["policy GPU"] = colocated_peak(cfg, by_role["policy"], by_role["generation"])
        return out
    nodes = cfg.cluster.num_nodes
    total = sum(r.total * per_node(r.workers, nodes) for r in by_role.values())  # an even spread
    if node_cpus and nodes > 1 and cfg.cluster.placement_strategy in PACKING_STRATEGIES:
        # Ray fills a node before the next: one may hold as many workers as its bundles (policy-sized), of any role,
        # the heaviest first (each role has its own placement group); never less than the even spread
        fit = bundles_per_node(cfg, node_cpus)
        workers = sorted((r.total for r in by_role.values() if r.role != REFIT_BUFFER for _ in range(r.workers)), reverse=True)
        buffer = sum(r.total for r in by_role.values() if r.role == REFIT_BUFFER)
        total = max(total, sum(workers[:fit]) + buffer)
    return {NODE_RAM: total}


def node_note(cfg: Any, node_cpus: int | None) -> str | None:
    """The node size a CPU cluster's PACK bound assumed (:func:`devices`): ``None`` where no node size entered it."""
    if not node_cpus or cfg.cluster.num_nodes == 1 or cfg.cluster.placement_strategy not in PACKING_STRATEGIES:
        return None
    return (
        f"{cfg.cluster.placement_strategy}: up to {bundles_per_node(cfg, node_cpus)} workers on one node of {node_cpus} CPUs; "
        "a run reads the cluster's nodes, a plan before it takes cluster.num_cpus, else this machine's cores"
    )


def over_budget(per_device: dict[str, int], device_bytes: float | None) -> dict[str, str]:
    """Each device over ``device_bytes``, and by how much."""
    if device_bytes is None:
        return {}
    return {
        device: f"{device} over by {(used - device_bytes) / GIB:.3f} GiB ({used / GIB:.3f} of {device_bytes / GIB:.3g} GiB)"
        for device, used in per_device.items()
        if used > device_bytes
    }


def weights_over_share(cfg: Any, engine: RoleMemory, device_bytes: float | None) -> float:
    """Bytes by which a vLLM engine's weights and its own memory (:func:`vllm_overhead_bytes`, in ``activations``)
    exceed its share of a GPU (``gpu_memory_utilization x device``): no KV budget is left at all (0: they fit, or not on
    a GPU cluster, where the budget is ``kv_cache_space_gib``)."""
    if not cfg.cluster.gpus_per_node or device_bytes is None:
        return 0.0
    return max(0.0, engine.params + engine.activations - cfg.policy.generation.vllm_cfg.gpu_memory_utilization * device_bytes)


def _size(n: float) -> str:
    """Bytes in GiB, or in MiB when under 0.01 GiB (a small model's KV cache)."""
    return f"{n / GIB:.3f} GiB" if n >= 0.01 * GIB else f"{n / 1024**2:.3f} MiB"


def _round_up(x: float, digits: int = 3) -> float:
    """``x`` rounded up to ``digits`` significant digits (a setting that is at least ``x``)."""
    step = 10 ** (math.floor(math.log10(x)) - digits + 1)
    return round(math.ceil(round(x / step, 9)) * step, 12)


def engine_device(cfg: Any) -> str:
    """Where a vLLM engine's KV budget lies: the GPU named as in the ``memory on`` lines, or its node's RAM."""
    if not cfg.cluster.gpus_per_node:
        return "in its node's RAM"
    return "on the policy GPU (colocated)" if cfg.policy.generation.colocated.enabled else "on the generation GPU"


def engine_problems(cfg: Any, roles: list[RoleMemory], device_bytes: float | None) -> list[str]:
    """A vLLM engine whose KV budget cannot hold one full-length sequence: it could not serve a single request (its
    weights alone over its share of the GPU, by how much, when that is why; else the device, what one sequence needs
    and the shortfall)."""
    out = []
    for r in roles:
        if r.kv_sequences != 0:
            continue
        short = weights_over_share(cfg, r, device_bytes)
        share = cfg.policy.generation.vllm_cfg.gpu_memory_utilization
        if short:
            out.append(
                f"the vLLM engine's weights ({r.params / GIB:.3f} GiB) and its own memory ({r.activations / GIB:.3f} GiB) exceed "
                f"policy.generation.vllm_cfg.gpu_memory_utilization x device = {share * device_bytes / GIB:.3f} GiB "
                f"{engine_device(cfg)} (short {short / GIB:.3f} GiB)"
            )
            continue
        if cfg.cluster.gpus_per_node:
            how = (
                f" = {share:g} x {device_bytes / GIB:.3g} GiB - weights {r.params / GIB:.3f} GiB - vLLM's own {r.activations / GIB:.3f} GiB"
            )
        else:
            how = ": policy.generation.vllm_cfg.kv_cache_space_gib"
        out.append(
            f"the vLLM engine's KV budget ({_size(r.kv_cache)}{how}) {engine_device(cfg)} holds no full-length sequence: "
            f"one of {cfg.policy.max_total_sequence_length} tokens needs {_size(r.kv_sequence_bytes)} "
            f"(short {_size(r.kv_sequence_bytes - r.kv_cache)})"
        )
    return out


def kv_advice(cfg: Any, roles: list[RoleMemory], device_bytes: float | None, shape: ModelShape) -> list[str]:
    """What to change when the vLLM engine's KV budget holds no full-length sequence: the share of the GPU (or the CPU
    KV space) that holds one, or a shorter sequence; when its weights alone exceed its share of the GPU a shorter
    sequence cannot help: only a larger share or device."""
    pc, vllm = cfg.policy, cfg.policy.generation.vllm_cfg
    engine = next(r for r in roles if r.kv_sequences == 0)
    bf16_own = engine.params // 2 + vllm_overhead_bytes(shape, 2, device_bytes) if device_bytes else None  # weights + own
    if weights_over_share(cfg, engine, device_bytes):
        needed = (engine.params + engine.activations) / device_bytes
        if needed >= 1:  # the setting is a share of the device, at most 1
            what = "the weights and vLLM's own memory"
            return [whole_device_advice(cfg, engine.params + engine.activations, device_bytes, what, bf16_own)]
        return [
            f"raise policy.generation.vllm_cfg.gpu_memory_utilization (now {vllm.gpu_memory_utilization:g}) above {needed:.3g} "
            "(the share of the device the weights and vLLM's own memory take) or use a device with more memory"
        ]
    if cfg.cluster.gpus_per_node:
        needed = _round_up((engine.params + engine.activations + engine.kv_sequence_bytes) / device_bytes)
        if needed > 1:
            what = "the weights, vLLM's own memory and one full-length sequence"
            total, bf16 = engine.params + engine.activations + engine.kv_sequence_bytes, bf16_own + engine.kv_sequence_bytes // 2
            return [
                f"{whole_device_advice(cfg, total, device_bytes, what, bf16)}, "
                f"or lower policy.max_total_sequence_length (now {pc.max_total_sequence_length})"
            ]
        budget = (
            f"raise policy.generation.vllm_cfg.gpu_memory_utilization (now {vllm.gpu_memory_utilization:g}) to at least "
            f"{needed:g} (weights, vLLM's own memory and one full-length sequence)"
        )
    else:
        needed = math.ceil(engine.kv_sequence_bytes / GIB)  # the setting is whole GiB
        budget = (
            f"raise policy.generation.vllm_cfg.kv_cache_space_gib (now {vllm.kv_cache_space_gib}) to at least {needed:g} "
            "(one full-length sequence)"
        )
    return [f"{budget} or lower policy.max_total_sequence_length (now {pc.max_total_sequence_length})"]


def whole_device_advice(cfg: Any, needed_bytes: float, device_bytes: float, what: str, bf16_bytes: float) -> str:
    """Advice when ``what`` (``needed_bytes``) exceeds the whole device: no ``gpu_memory_utilization`` (a share, at
    most 1) holds it; a float32 run is pointed at bfloat16 where that (``bf16_bytes``) fits the device (vLLM's own
    non-torch memory does not shrink with it)."""
    fits_bf16 = cfg.policy.precision == "float32" and bf16_bytes <= device_bytes
    smaller = f" or policy.precision=bfloat16 ({bf16_bytes / GIB:.3g} GiB)" if fits_bf16 else ""
    return (
        f"{what} take {needed_bytes / GIB:.3g} GiB, more than the whole device ({device_bytes / GIB:.3g} GiB): no "
        f"policy.generation.vllm_cfg.gpu_memory_utilization (at most 1) holds them; use a device with more memory{smaller}"
    )


def _more_gpus(dp_size: int, short: str | None) -> str:
    """The advice's note that ``dp_size`` policy ranks need more GPUs than declared (``short``: the cluster check's line)."""
    return f", on more GPUs than declared (at policy.dp_size={dp_size} {short})" if short else ""


def lora_advice(cfg: Any, backend: str, kv_space: str, model: PolicyModel = PLAIN_MODEL) -> str:
    """Train LoRA adapters: on a CPU with the engine the run has, where LoRA would change it (auto picks vLLM for a LoRA
    run, whose KV space would take more of the node than LoRA saves; inline generation does not serve LoRA)."""
    lora = _with(cfg, "policy", lora_cfg=cfg.policy.lora_cfg.model_copy(update={"enabled": True}))
    try:
        with_lora = resolve_backend(lora, model=model)[0]
    except ConfigError:  # the requested backend (inline) cannot serve adapters
        engine = "hf" if not cfg.cluster.gpus_per_node else "auto"
        return (
            f"train LoRA adapters (policy.lora_cfg.enabled=true) with policy.generation.backend={engine}: no full "
            "gradients or AdamW state (inline generation does not serve adapters)"
        )
    if not cfg.cluster.gpus_per_node and backend != "vllm" and with_lora == "vllm":
        return (
            "train LoRA adapters (policy.lora_cfg.enabled=true) with policy.generation.backend=hf: no full gradients or "
            f"AdamW state (auto would pick vLLM, whose KV space, {kv_space}, is held in the node's RAM)"
        )
    return "train LoRA adapters (policy.lora_cfg.enabled=true): no full gradients or AdamW state"


def fit_advice(
    cfg: Any,
    shrinks: Callable[[Any], bool],
    share_may_help: bool = False,
    policy_over: bool = True,
    kv_over: bool = False,
    cluster_problem: Callable[[Any], str | None] | None = None,
    backend: str = "",
    model: PolicyModel = PLAIN_MODEL,
) -> list[str]:
    """What to change when a device is over its memory, the cheapest first: only changes that ``shrinks`` (a plan of
    the changed config holds no more on every device that is over, and less on one) says help. ``share_may_help``: the
    GPU a colocated vLLM engine shares is over and the engine holds a sequence; ``policy_over``: a device that holds
    policy ranks is over (LoRA, whose shrinking the plan cannot re-derive without the model, shrinks only those);
    ``kv_over``: a device that holds the KV cache of the sequences sampled at once (the HF engine's, the inline
    backend's) is over; ``cluster_problem(config)``: why ``config`` does not fit the declared GPUs (a larger dp's ranks
    may not), ``None`` if it does; ``backend``: the run's generation backend (on a CPU, vLLM's KV space is in the node's
    RAM: a plan of another backend cannot be re-derived here, so that advice is given whole); ``experts``: the policy is a
    mixture of experts (the run plan's: where LoRA would take the engine)."""
    pc, cluster = cfg.policy, cfg.cluster
    advice = []
    util = pc.generation.vllm_cfg.gpu_memory_utilization
    if share_may_help and shrinks(_with_engine_share(cfg, util / 2)):
        advice.append(
            f"lower policy.generation.vllm_cfg.gpu_memory_utilization (now {util:g}): "
            "the colocated engine takes that share of policy rank 0's GPU while it generates"
        )
        colocated = pc.generation.colocated
        offloaded = colocated.model_copy(update={"offload_optimizer": True})
        if not colocated.offload_optimizer and shrinks(
            _with(cfg, "policy", generation=pc.generation.model_copy(update={"colocated": offloaded}))
        ):
            advice.append("set policy.generation.colocated.offload_optimizer=true so AdamW state leaves the GPU while the engine generates")
    offload = pc.dtensor_cfg.model_copy(update={"cpu_offload": True})
    offloaded = _with(cfg, "policy", dtensor_cfg=offload, dp_size=max(2, pc.dp_size))
    if cluster.gpus_per_node and not pc.dtensor_cfg.cpu_offload and shrinks(offloaded):
        short = cluster_problem(offloaded) if cluster_problem is not None and pc.dp_size < 2 else None
        gpus = _more_gpus(2, short)
        advice.append(
            "set policy.dtensor_cfg.cpu_offload=true (with more than one policy worker) to keep parameters, gradients and "
            f"AdamW state in host RAM{gpus}"
        )
    checkpointed = pc.dtensor_cfg.model_copy(update={"activation_checkpointing": True})
    if not pc.dtensor_cfg.activation_checkpointing and shrinks(_with(cfg, "policy", dtensor_cfg=checkpointed)):
        advice.append("set policy.dtensor_cfg.activation_checkpointing=true")
    if not pc.logprob_chunk_size and shrinks(_with(cfg, "policy", logprob_chunk_size=1024)):
        advice.append("set policy.logprob_chunk_size (e.g. 1024) so logits are never materialised for every token")
    more_dp = 2 * pc.dp_size  # a larger dp that leaves no rank without a sample is not one to advise
    more = _with(cfg, "policy", dp_size=more_dp)
    dp_shrinks = pc.train_global_batch_size // more_dp >= 1 and shrinks(more)
    dp_short = cluster_problem(more) if dp_shrinks and cluster_problem is not None else None
    dp_helps = dp_shrinks and dp_short is None  # on the declared GPUs: else the cheaper changes below are advised too
    if dp_shrinks:
        gpus = _more_gpus(more_dp, dp_short)
        advice.append(f"raise policy.dp_size (now {pc.dp_size}) to shard parameters, gradients and AdamW state over more devices{gpus}")
    if not cluster.gpus_per_node and shrinks(_with(cfg, "cluster", num_nodes=2 * cluster.num_nodes)):
        advice.append(f"raise cluster.num_nodes (now {cluster.num_nodes}): the workers of a node share its RAM")
    elif not cluster.gpus_per_node and shrinks(_with(cfg, "cluster", num_nodes=2 * cluster.num_nodes, placement_strategy="SPREAD")):
        advice.append(
            f"raise cluster.num_nodes (now {cluster.num_nodes}) with cluster.placement_strategy=SPREAD: the workers of a node "
            f"share its RAM, and {cluster.placement_strategy} may place a role's workers on one node"
        )
    kv_space = f"policy.generation.vllm_cfg.kv_cache_space_gib, now {pc.generation.vllm_cfg.kv_cache_space_gib} GiB"
    if not pc.lora_cfg.enabled and policy_over:
        advice.append(lora_advice(cfg, backend, kv_space, model))
    if not cluster.gpus_per_node and backend == "vllm":  # a CPU node is over, and vLLM's KV space is in its RAM
        advice.append(f"set policy.generation.backend=hf: vLLM's KV space ({kv_space}) is held in the node's RAM")
    if not dp_helps:
        budgets = next((m for m in ("sequence_packing", "dynamic_batching") if getattr(pc, m).enabled), None)
        if budgets is not None:  # micro-batches are token budgets there, not row counts
            mode = getattr(pc, budgets)
            sizes = [
                (f"{budgets}.{k}", getattr(mode, k))
                for k in ("train_mb_tokens", "logprob_mb_tokens")
                if shrinks(_with(cfg, "policy", **{budgets: mode.model_copy(update={k: max(1, getattr(mode, k) // 2)})}))
            ]
        else:
            sizes = [
                (k, getattr(pc, k))
                for k in ("train_micro_batch_size", "logprob_batch_size")
                if getattr(pc, k) > 1 and shrinks(_with(cfg, "policy", **{k: 1}))
            ]
        if shrinks(_with(cfg, "policy", max_total_sequence_length=max(1, pc.max_total_sequence_length // 2))):
            sizes.append(("max_total_sequence_length", pc.max_total_sequence_length))
        lower = "lower " + " or ".join(f"policy.{k} (now {v})" for k, v in sizes)
        if sizes and dp_short:
            advice.append(f"{lower}: these need no more GPUs")
        elif sizes:
            why = "every rank shares the node's RAM" if not cluster.gpus_per_node else "the devices over would hold no less"
            advice.append(f"{lower}: a larger policy.dp_size (now {pc.dp_size}) would not help ({why})")
    prompts, per_prompt = cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt
    at_once = min(prompts, max(1, HF_MAX_BATCH_SIZE // per_prompt))  # the HF engine's batches hold at most 256 sequences
    if kv_over and at_once > 1 and shrinks(_with(cfg, "grpo", num_prompts_per_step=at_once // 2)):
        advice.append(
            f"lower grpo.num_prompts_per_step (now {prompts}){f' under {at_once}' if at_once < prompts else ''}: the "
            "generation engine holds the KV cache of "
            f"the sequences it samples at once ({at_once} prompts x {per_prompt})"
        )
    g, val_rows = cfg.grpo, validation_rows(cfg)
    if kv_over and val_rows > 1 and shrinks(_with(cfg, "grpo", max_val_samples=max(1, g.max_val_samples // 2))):
        advice.append(
            f"lower grpo.max_val_samples (now {g.max_val_samples}): a validation round samples its "
            f"{val_rows} sequences in one call, whose KV cache the engine holds at once"
        )
    return advice
