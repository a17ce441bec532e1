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
  layer saves for backward: ``8H + 4 K D + 4I`` values per token, the attention kernel keeping no score matrix),
  plus the float32 logits, their log-softmax and its gradient (``tokens x vocab x 12`` bytes, or ``chunk x vocab x 12``
  with ``policy.logprob_chunk_size``); with activation checkpointing each layer's input plus the larger of the logits'
  share and one layer's recomputed activations (the backward recomputes a layer after the output head's backward has
  freed the logits: the two never coexist).
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
  (the engines load the model at that dtype); vLLM's budget is ``gpu_memory_utilization x device`` minus the weights
  (GPU), or ``kv_cache_space_gib`` (CPU); the HF engine holds the sequences it samples at once.
* **step time**: FLOPs (``2N`` per generated or scored token, ``6N`` per trained token, ``4N + 6 N_lora`` with LoRA,
  N the matmul parameters of the model that runs the phase: a teacher's own) at a stated peak per device and MFU, each phase spread over the devices
  that run it (:func:`step_estimate`); an upper bound on tokens (every sequence at ``policy.max_total_sequence_length``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from nemo_like.plan.backend import GENERATION_ENGINES, HF_MAX_BATCH_SIZE, INLINE_GENERATION_BATCH

if TYPE_CHECKING:
    from nemo_like.plan.logprob_passes import LogprobPlan

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

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelShape:
        """From a ``config.json``'s fields."""
        heads = config["num_attention_heads"]
        return cls(
            layers=config["num_hidden_layers"],
            hidden=config["hidden_size"],
            intermediate=config.get("intermediate_size", 4 * config["hidden_size"]),
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab=config["vocab_size"],
        )

    def layer_values_per_token(self) -> int:
        """Values one layer saves for backward per token (see the module docstring)."""
        return 8 * self.hidden + 4 * self.kv_heads * self.head_dim + 4 * self.intermediate

    def kv_bytes_per_token(self, bytes_per_value: int) -> int:
        """KV-cache bytes per token of one sequence."""
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_value


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
    offloaded: bool = False  # FSDP2's CPU offload: params, grads and AdamW state in host RAM, not on the device
    unsharded_layer: int = 0  # with CPU offload: the largest decoder layer, unsharded on the GPU while it computes

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
        where = "per worker on its device" if self.offloaded else "per worker"
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

    def phase_seconds(self, phase: str) -> float:
        """Seconds of ``phase``: its FLOPs over its devices at ``peak_flops x mfu`` each."""
        return self.flops[phase] / (self.devices.get(phase, 1) * self.peak_flops * self.mfu)

    @property
    def seconds(self) -> float:
        return sum(self.phase_seconds(phase) for phase in self.flops)

    def line(self) -> str:
        phases = ", ".join(f"{k} {self.phase_seconds(k):.2f}s on {_devices(self.devices.get(k, 1))}" for k in self.flops)
        return f"step time at most ~{self.seconds:.2f}s at {self.peak_flops:.3g} FLOP/s per device x MFU {self.mfu}: {phases}"


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


def _training_activations(cfg: Any, shape: ModelShape, value_bytes: int) -> int:
    pc = cfg.policy
    tokens = micro_batch_tokens(cfg, training=True)
    per_layer = tokens * shape.layer_values_per_token() * value_bytes
    logit_rows = min(tokens, pc.logprob_chunk_size) if pc.logprob_chunk_size else tokens
    logits = logit_rows * shape.vocab * 12  # float32 logits, their log-softmax and its gradient
    if pc.dtensor_cfg.activation_checkpointing:  # each layer's input; a layer is recomputed after the logits are freed
        return tokens * shape.hidden * value_bytes * shape.layers + max(per_layer, logits)
    return per_layer * shape.layers + logits


def _logprob_activations(cfg: Any, shape: ModelShape, value_bytes: int) -> int:
    tokens = micro_batch_tokens(cfg, training=False)
    chunk = cfg.policy.logprob_chunk_size
    logit_rows = min(tokens, chunk) if chunk else tokens
    return tokens * shape.layer_values_per_token() * value_bytes + logit_rows * shape.vocab * 8  # logits + log-softmax


def micro_batch_tokens(cfg: Any, training: bool) -> int:
    """Tokens of the largest micro-batch of a training (or logprob) pass: packed / token-budget sizes, else rows x
    ``policy.max_total_sequence_length``."""
    pc = cfg.policy
    if pc.sequence_packing.enabled:
        return pc.sequence_packing.train_mb_tokens if training else pc.sequence_packing.logprob_mb_tokens
    if pc.dynamic_batching.enabled:
        return pc.dynamic_batching.train_mb_tokens if training else pc.dynamic_batching.logprob_mb_tokens
    rows = min(pc.train_micro_batch_size, pc.train_global_batch_size // pc.dp_size) if training else pc.logprob_batch_size
    return rows * pc.max_total_sequence_length


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


def policy_memory(cfg: Any, params: list[ParameterSpec], shape: ModelShape, role: str = "policy") -> RoleMemory:
    """One rank of the trainable policy (``role="policy"``) or of a frozen copy (``"reference"``, ``"teacher"``).
    With FSDP2's CPU offload (:meth:`~nemo_like.config.schema.MasterConfig.offloads_to_cpu`) its parameters,
    gradients and AdamW state are in host RAM and the device holds the activations, the unsharded root and the
    largest decoder layer, unsharded while it computes."""
    pc = cfg.policy
    dp, tp = pc.dp_size, pc.dtensor_cfg.tensor_parallel_size
    value_bytes = DTYPE_BYTES[pc.precision]
    root = unsharded_root_bytes(cfg, params)
    offload = {"offloaded": True, "unsharded_layer": largest_layer_bytes(cfg, params)} if cfg.offloads_to_cpu() else {}
    if role != "policy":  # frozen copies load float32 weights whatever the precision
        held = frozen_copy_bytes(cfg, params)
        activations = _logprob_activations(cfg, shape, value_bytes)
        return RoleMemory(role, dp * tp, params=held, activations=activations, unsharded_root=root, note="logprobs only", **offload)
    held = sum(p.shard_bytes(dp, tp) for p in params)
    grads = sum(p.as_held(True, 4).shard_bytes(dp, tp) for p in params if p.trainable)
    activations = max(_training_activations(cfg, shape, value_bytes), _logprob_activations(cfg, shape, value_bytes))
    return RoleMemory(role, dp * tp, params=held, grads=grads, optimizer=2 * grads, activations=activations, unsharded_root=root, **offload)


def frozen_copy_bytes(cfg: Any, params: list[ParameterSpec]) -> int:
    """Bytes one rank holds of a frozen copy of a model (reference, teacher): float32 weights (whatever the
    precision) sharded like the policy's."""
    pc = cfg.policy
    return sum(p.as_held(False, 4).shard_bytes(pc.dp_size, pc.dtensor_cfg.tensor_parallel_size) for p in params)


def with_teacher_copy(cfg: Any, policy: RoleMemory, params: list[ParameterSpec], shape: ModelShape) -> RoleMemory:
    """A policy rank with the KL loss term's frozen teacher copy (``distillation.kl_weight > 0``): the teacher's float32
    weights sharded like the policy's, and per training micro-batch its last hidden states (chunked) or full float32
    logits (unchunked), plus the KL's per-chunk float32 temporaries (both models' logits, probabilities, gradient)."""
    pc = cfg.policy
    tokens = micro_batch_tokens(cfg, training=True)
    held = frozen_copy_bytes(cfg, params)
    rows = min(tokens, pc.logprob_chunk_size) if pc.logprob_chunk_size else tokens
    kept = tokens * shape.hidden * DTYPE_BYTES[pc.precision] if pc.logprob_chunk_size else tokens * shape.vocab * 4
    activations = kept + rows * shape.vocab * 4 * 6
    note = f"{policy.note}; " if policy.note else ""
    return replace(
        policy,
        params=policy.params + held,
        activations=policy.activations + activations,
        note=f"{note}with the teacher copy of the KL term: {held / GIB:.3f} GiB of weights",
    )


def with_inline_sampling(
    cfg: Any, policy: RoleMemory, params: list[ParameterSpec], shape: ModelShape, weight_copies: int = 0
) -> RoleMemory:
    """The one policy worker of the inline backend, which also samples: holding its parameters, gradients (kept
    between steps) and AdamW state, it samples up to :data:`~nemo_like.plan.backend.INLINE_GENERATION_BATCH` sequences
    at once (a rollout batch at most), with their KV cache in the parameters' dtype (the lean decoder allocates it like
    the model's first parameter), the float32 logits of their next token and ``weight_copies`` bytes of weights the
    sampler copies for the call (fused projections, oneDNN-packed ones: :func:`inline_sampling_rows` rows, see
    ``fused_step_copy_elements`` in :mod:`nemo_like.models.generation.lean_decoder`). Its activation-time peak is the
    larger of that and the training / logprob passes' activations."""
    batch = inline_sampling_rows(cfg)
    kv = batch * shape.kv_bytes_per_token(params[0].bytes_per_element) * cfg.policy.max_total_sequence_length
    logits = batch * shape.vocab * 4
    sampling = kv + logits + weight_copies
    note = (
        f"activations: the larger of training {policy.activations / GIB:.3f} and inline sampling {sampling / GIB:.3f} "
        f"(kv cache of {batch} sequences {kv / GIB:.3f} + logits {logits / GIB:.3f} + weight copies {weight_copies / GIB:.3f})"
    )
    return replace(policy, activations=max(policy.activations, sampling), note=f"{policy.note}; {note}" if policy.note else note)


def inline_sampling_rows(cfg: Any) -> int:
    """Sequences the inline backend samples at once: a rollout batch, at most
    :data:`~nemo_like.plan.backend.INLINE_GENERATION_BATCH`."""
    return min(cfg.rollout_batch_size, INLINE_GENERATION_BATCH)


def generation_memory(cfg: Any, backend: str, parameters: int, shape: ModelShape, device_bytes: float | None) -> RoleMemory:
    """The generation engine's worker: nothing of its own for ``inline`` (the policy samples), the HF engine's weights
    and the KV cache of the sequences it samples at once (a rollout batch, in batches of at most
    :data:`~nemo_like.plan.backend.HF_MAX_BATCH_SIZE`), or vLLM's weights and KV-cache budget (and how many full-length
    sequences fit). Both engines load the model, and keep its keys and values, at ``policy.precision``."""
    pc, g = cfg.policy, cfg.policy.generation
    on_gpu = bool(cfg.cluster.gpus_per_node)
    if backend == "inline":
        return RoleMemory("generation", 0, note="inline: the policy worker samples")
    value_bytes = DTYPE_BYTES[pc.precision]
    weights = parameters * value_bytes
    per_sequence = shape.kv_bytes_per_token(value_bytes) * pc.max_total_sequence_length
    if backend == "hf":
        batch = min(cfg.rollout_batch_size, HF_MAX_BATCH_SIZE)
        note = f"hf engine, KV of {batch} sequences at once"
        return RoleMemory("generation", GENERATION_ENGINES, params=weights, kv_cache=batch * per_sequence, note=note)
    share = g.vllm_cfg.gpu_memory_utilization
    if on_gpu and device_bytes is None:
        note = f"vLLM, KV budget {share:g} x the device's memory - the weights: the device's size is not given"
        return RoleMemory("generation", GENERATION_ENGINES, params=weights, note=note)
    budget = max(0, int(share * device_bytes) - weights) if on_gpu else int(g.vllm_cfg.kv_cache_space_gib * GIB)
    sequences = budget // per_sequence if per_sequence else 0
    note = f"vLLM, KV budget holds {sequences} sequences of {pc.max_total_sequence_length} tokens"
    return RoleMemory("generation", GENERATION_ENGINES, params=weights, kv_cache=budget, note=note, kv_sequences=sequences)


def step_estimate(
    cfg: Any,
    logprobs: LogprobPlan,
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
    token on the policy ranks."""
    pc = cfg.policy
    tokens = cfg.rollout_batch_size * pc.max_total_sequence_length
    ranks = pc.dp_size * pc.dtensor_cfg.tensor_parallel_size
    teachers = teacher_parameters or {}
    n = matmul_parameters
    # prefill and decode both cost 2N per token: the generation phase touches every token once
    phases: dict[str, tuple[float, int]] = {"generation": (2.0 * n * tokens, GENERATION_ENGINES)}
    if logprobs.compute_prev:
        phases["prev logprobs"] = (2.0 * n * tokens, ranks)
    if logprobs.compute_reference:
        phases["reference logprobs"] = (2.0 * n * tokens, ranks)
    if logprobs.compute_teacher:
        phases["teacher logprobs"] = (2.0 * max(teachers[m] for m in cfg.teacher.models()) * tokens, ranks)
    phases["training"] = (trained_token_flops * tokens, ranks)
    if cfg.distillation.kl_weight > 0 and cfg.teacher.model_name is not None:
        phases["teacher copy (KL term)"] = (2.0 * teachers[cfg.teacher.model_name] * tokens, ranks)
    flops = {phase: f for phase, (f, _) in phases.items()}
    return StepEstimate(flops, peak_flops, mfu, {phase: d for phase, (_, d) in phases.items()})


def plan_memory(
    cfg: Any,
    run_plan: Any,
    params: list[ParameterSpec],
    shape: ModelShape,
    device_bytes: float | None = None,
    teachers: Mapping[str, tuple[list[ParameterSpec], ModelShape]] | None = None,
    step: StepEstimate | None = None,
    inline_weight_copies: int = 0,
) -> MemoryPlan:
    """Every role of the run ``run_plan`` describes, what each device (GPU) or node (CPU) holds, and whether it fits
    ``device_bytes``; ``teachers``: each teacher model's parameters and shape (by name, every one of
    ``teacher.models()``) when the run distils; ``inline_weight_copies``: bytes of weights the inline backend's sampler
    copies for a call (:func:`with_inline_sampling`)."""
    teachers = teachers or {}
    roles = [policy_memory(cfg, params, shape)]
    if cfg.distillation.kl_weight > 0 and teachers:  # the KL term's copy: teacher.model_name, first of the models
        roles[0] = with_teacher_copy(cfg, roles[0], *teachers[cfg.teacher.models()[0]])
    if run_plan.backend.value == "inline":
        roles[0] = with_inline_sampling(cfg, roles[0], params, shape, inline_weight_copies)
    if run_plan.logprobs.load_reference_model:
        roles.append(policy_memory(cfg, params, shape, "reference"))
    if run_plan.logprobs.compute_teacher and teachers:
        roles += [policy_memory(cfg, *teachers[name], role) for name, role in teacher_roles(cfg).items()]
    parameters = sum(math.prod(p.shape) for p in params)
    roles.append(generation_memory(cfg, run_plan.backend.value, parameters, shape, device_bytes))
    colocated = run_plan.backend.value == "vllm" and cfg.policy.generation.colocated.enabled
    per_device = devices(cfg, roles, colocated)
    notes = {"policy GPU": colocated_note(cfg, roles)} if colocated and "policy GPU" in per_device else {}
    over = over_budget(per_device, device_bytes)
    engine = engine_problems(cfg, roles, device_bytes)
    advice = fit_advice(cfg, colocated and "policy GPU" in over, "policy GPU" in over) if over else []
    advice += kv_advice(cfg, roles, device_bytes) if engine else []
    return MemoryPlan(roles, per_device, device_bytes, advice, step, [*over.values(), *engine], notes)


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
    """Policy rank 0's GPU with a colocated vLLM engine: the larger of its training peak and, while the engine
    generates, what the rank keeps plus the engine's whole share (weights and KV budget). The two never coexist."""
    return max(policy.total, kept_while_generating(cfg, policy) + generation.total)


def colocated_note(cfg: Any, roles: list[RoleMemory]) -> str:
    """How the colocated GPU's figure was reached (the ``memory on policy GPU`` line)."""
    by_role = {r.role: r for r in roles}
    kept, engine = kept_while_generating(cfg, by_role["policy"]), by_role["generation"].total
    return (
        f"colocated vLLM engine: the larger of training {by_role['policy'].total / GIB:.3f} and generating "
        f"{kept / GIB:.3f} kept by the policy + {engine / GIB:.3f} for the engine"
    )


def devices(cfg: Any, roles: list[RoleMemory], colocated: bool = False) -> dict[str, int]:
    """What each device holds: on GPUs every worker has its own (a ``colocated`` vLLM engine shares policy rank 0's:
    :func:`colocated_peak`); on a CPU cluster every worker of a node shares the node's memory (workers spread evenly
    over ``cluster.num_nodes``)."""
    by_role = {r.role: r for r in roles}
    if cfg.cluster.gpus_per_node:
        out = {f"{r.role} GPU": r.total for r in roles if r.workers}
        if colocated and "generation GPU" in out and "policy" in by_role:
            out.pop("generation GPU")
            out["policy GPU"] = colocated_peak(cfg, by_role["policy"], by_role["generation"])
        return out
    nodes = max(1, cfg.cluster.num_nodes)
    total = sum(r.total * math.ceil(r.workers / nodes) for r in by_role.values())
    return {"each node (RAM)": total}


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
    """Bytes by which a vLLM engine's weights exceed its share of a GPU (``gpu_memory_utilization x device``): no KV
    budget is left at all (0: they fit, or not on a GPU cluster, where the budget is ``kv_cache_space_gib``)."""
    if not cfg.cluster.gpus_per_node or device_bytes is None:
        return 0.0
    return max(0.0, engine.params - cfg.policy.generation.vllm_cfg.gpu_memory_utilization * device_bytes)


def engine_problems(cfg: Any, roles: list[RoleMemory], device_bytes: float | None) -> list[str]:
    """A vLLM engine whose KV budget cannot hold one full-length sequence: it could not serve a single request (its
    weights alone over its share of the GPU, by how much, when that is why)."""
    out = []
    for r in roles:
        if r.kv_sequences != 0:
            continue
        short = weights_over_share(cfg, r, device_bytes)
        if short:
            share = cfg.policy.generation.vllm_cfg.gpu_memory_utilization
            out.append(
                f"the vLLM engine's weights ({r.params / GIB:.3f} GiB) exceed policy.generation.vllm_cfg.gpu_memory_utilization "
                f"x device = {share * device_bytes / GIB:.3f} GiB (short {short / GIB:.3f} GiB)"
            )
        else:
            out.append(f"the vLLM engine's KV budget ({r.kv_cache / GIB:.3f} GiB) holds no full-length sequence")
    return out


def kv_advice(cfg: Any, roles: list[RoleMemory], device_bytes: float | None) -> list[str]:
    """What to change when the vLLM engine's KV budget holds no full-length sequence; when its weights alone exceed
    its share of the GPU a shorter sequence cannot help: only a larger share or device."""
    pc, vllm = cfg.policy, cfg.policy.generation.vllm_cfg
    engine = next(r for r in roles if r.kv_sequences == 0)
    if weights_over_share(cfg, engine, device_bytes):
        needed = engine.params / device_bytes
        return [
            f"raise policy.generation.vllm_cfg.gpu_memory_utilization (now {vllm.gpu_memory_utilization:g}) above {needed:.3g} "
            "(the weights' share of the device) or use a device with more memory"
        ]
    budget = (
        f"raise policy.generation.vllm_cfg.gpu_memory_utilization (now {vllm.gpu_memory_utilization:g})"
        if cfg.cluster.gpus_per_node
        else f"raise policy.generation.vllm_cfg.kv_cache_space_gib (now {vllm.kv_cache_space_gib})"
    )
    return [f"{budget} or lower policy.max_total_sequence_length (now {pc.max_total_sequence_length})"]


def fit_advice(cfg: Any, colocated_over: bool = False, policy_gpu_over: bool = False) -> list[str]:
    """What to change when a device is over its memory, the cheapest first; ``colocated_over``: the GPU a colocated
    vLLM engine shares is among them; ``policy_gpu_over``: a policy GPU is."""
    pc = cfg.policy
    advice = []
    if colocated_over:
        colocated = pc.generation.colocated
        advice.append(
            f"lower policy.generation.vllm_cfg.gpu_memory_utilization (now {pc.generation.vllm_cfg.gpu_memory_utilization:g}): "
            "the colocated engine takes that share of policy rank 0's GPU while it generates"
        )
        if not colocated.offload_optimizer:
            advice.append("set policy.generation.colocated.offload_optimizer=true so AdamW state leaves the GPU while the engine generates")
    if policy_gpu_over and cfg.cluster.gpus_per_node and not pc.dtensor_cfg.cpu_offload:
        advice.append(
            "set policy.dtensor_cfg.cpu_offload=true (with more than one policy worker) to keep parameters, gradients and "
            "AdamW state in host RAM"
        )
    if not pc.dtensor_cfg.activation_checkpointing:
        advice.append("set policy.dtensor_cfg.activation_checkpointing=true")
    if not pc.logprob_chunk_size:
        advice.append("set policy.logprob_chunk_size (e.g. 1024) so logits are never materialised for every token")
    advice.append(f"raise policy.dp_size (now {pc.dp_size}) to shard parameters, gradients and AdamW state over more devices")
    if not pc.lora_cfg.enabled:
        advice.append("train LoRA adapters (policy.lora_cfg.enabled=true): no full gradients or AdamW state")
    return advice
