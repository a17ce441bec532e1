"""The inputs of the memory planner (:mod:`nemo_like.plan.memory`) for a model, read without loading any weight: its
parameter shapes on the meta device (with LoRA adapters when enabled), what each holds per element, which belong to
FSDP2's root unit (outside the decoder layers), which dim tensor parallelism splits, and its shape."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from nemo_like.config.errors import ConfigError
from nemo_like.models.layer_kinds import (
    caches_per_token,
    holds_state,
    layer_kinds,
    sliding_window,
    state_values,
    text_config,
)
from nemo_like.models.loading import (
    ADAPTER_CONFIG,
    adapter_base_model,
    local_config_file,
    read_model_config,
    resolve_model_path,
)
from nemo_like.plan.memory import (
    DTYPE_BYTES,
    JudgeSpec,
    ModelShape,
    ParameterSpec,
    RoleMemory,
    ScorerSpec,
    config_value,
    judge_memory,
    scorer_memory,
)
from nemo_like.utils.text_path import freeze_outside_text_path


def model_config_path(
    model_name: str, config_path: str | Path | None = None, key: str = "policy.model_name", flag: str = "--model-config PATH"
) -> Path:
    """The ``config.json`` describing ``model_name``: ``config_path`` (a file or a directory holding one) when given,
    else the model's own (a local directory, a shipped or cached model). A model whose config is not on this machine
    is a ConfigError naming the config ``key`` that names it and the ``flag`` that passes one."""
    if config_path is not None:
        path = Path(config_path).expanduser()  # --model-config=~/x: no shell expands it after '='
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ConfigError(f"{flag.split()[0]} {config_path}: no config.json there")
        return path
    try:
        path = local_config_file(model_name)  # a hub id's cached copy too (the docstring promised it; it was not looked for)
        reason = "no such file"
    except (OSError, ValueError) as exc:
        path, reason = None, str(exc).splitlines()[0]
    if path is None:
        raise ConfigError(
            f"{key}={model_name!r}: its config.json is not on this machine ({reason}); pass {flag} "
            "(the model's config.json, e.g. one of examples/cluster/model_configs/) to plan without the model"
        )
    return path


#: The config.json fields the memory planner's figures depend on (compared by :func:`model_config_warning`).
SHAPE_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings")  # fmt: skip


def model_config_here(model_name: str) -> Path | None:
    """``model_name``'s config.json on this machine (a LoRA checkpoint: its base model's), ``None`` when it is not
    here or the name is no valid hub id."""
    try:
        path = Path(resolve_model_path(model_name)).expanduser()
        if (path / ADAPTER_CONFIG).is_file():
            return model_config_here(adapter_base_model(path))
        return local_config_file(model_name)
    except (OSError, ValueError):
        return None


def model_config_warning(model_name: str, config_path: str | Path) -> str | None:
    """``--model-config`` given for a model whose own config.json is on this machine (what the run reads): the fields
    of :data:`SHAPE_FIELDS` where the two differ (the plan describes another model), or that the flag changes nothing.
    Compared as transformers reads them (defaults filled in, a multimodal config's text part)."""
    own = model_config_here(model_name)
    if own is None:
        return None
    given = model_config_path(model_name, config_path)
    mine, theirs = (read_model_config(path)[1].get_text_config() for path in (own, given))
    differ = [f"{k} {_shape_value(theirs, k)} (the model's: {_shape_value(mine, k)})" for k in SHAPE_FIELDS
              if _shape_value(mine, k) != _shape_value(theirs, k)]  # fmt: skip
    if not differ:
        return f"--model-config {config_path} has no effect: {model_name}'s own config.json ({own}) has the same shape"
    return (
        f"--model-config {config_path} describes another model than policy.model_name={model_name!r}, whose config.json is "
        f"on this machine ({own}; a run reads that one): {', '.join(differ)}; the figures that follow are the given config's"
    )


def _shape_value(config: Any, key: str) -> Any:
    """``config``'s ``key`` as the model uses it: ``head_dim`` defaults to ``hidden_size // num_attention_heads``
    (Qwen2's and Llama's configs may leave it out or write it)."""
    value = config_value(config, key)
    if key == "head_dim" and value is None and getattr(config, "num_attention_heads", None):
        return config.hidden_size // config.num_attention_heads
    return value


class UnplannableLayout(ConfigError):
    """A causal LM whose layers the memory plan cannot find (its config was read)."""


def model_footprint(
    model_name: str, precision: str, lora_cfg: Any = None, config_path: str | Path | None = None
) -> tuple[list[ParameterSpec], ModelShape]:
    """Every parameter of ``model_name`` as a policy worker holds it: float32 masters; with ``lora_cfg`` enabled the
    base in the compute dtype (``precision``) and float32 adapters, only the adapters trainable. ``config_path``: a
    ``config.json`` to use instead of the model's (:func:`model_config_path`; a teacher's: :func:`teacher_config_paths`)."""
    from transformers import AutoModelForCausalLM

    from nemo_like.models.policy.sharding import decoder_layers, tensor_parallel_dims

    path = model_config_path(model_name, config_path)
    raw, config = read_model_config(path)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as exc:  # an encoder (bert): no causal-LM class
        raise ConfigError(f"{path}: not a causal language model's config.json ({str(exc).splitlines()[0]})") from None
    try:
        layers = decoder_layers(model, ("layers", "language_model.layers"))  # the same modules once LoRA wraps them
    except ValueError as exc:  # a causal LM laid out otherwise (Falcon: transformer.h)
        raise UnplannableLayout(
            f"{path}: the memory plan cannot lay out {type(model).__name__} ({str(exc).splitlines()[0]}); it plans models "
            "whose decoder layers are model.model.layers (Llama, Qwen, Mistral, Gemma, ...)"
        ) from None
    from nemo_like.models.llama_family import supported as fused_sampler

    fused = fused_sampler(model)  # the base model the engines sample with (the inline backend takes no LoRA)
    freeze_outside_text_path(model)  # as the policy workers do
    lora = lora_cfg is not None and lora_cfg.enabled
    if lora:
        from nemo_like.models.lora import apply_lora

        with torch.device("meta"):
            model = apply_lora(model, lora_cfg)
    base_bytes = DTYPE_BYTES[precision] if lora else 4
    layer_of = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
    tp_dims = tensor_parallel_dims(model)
    specs = [
        ParameterSpec(
            tuple(p.shape),
            p.requires_grad,
            4 if p.requires_grad else base_bytes,
            root=id(p) not in layer_of,
            tp_dim=tp_dims.get(id(p)),
            layer=layer_of.get(id(p)),
        )
        for p in model.parameters()
    ]
    from nemo_like.utils.experts import expert_block_values_per_token, top_k

    text = config.get_text_config()
    shape = replace(
        ModelShape.from_hf_config(text),
        packed_masks=2 if sliding_window(config) is not None else 1,
        expert_block_values=expert_block_values_per_token(model, text.hidden_size, top_k(config)),
        fused_sampler=fused,
        mlp_splits=all(any(id(p) in tp_dims for p in getattr(layer, "mlp", torch.nn.Module()).parameters()) for layer in layers),
        norm_values=max(extra_norm_values(layer, text) for layer in layers),
        **cache_layout(config),
    )
    return specs, shape


#: The hidden-sized norms of a Llama layer (its input and post-attention norms), whose values the plan's ``8H`` holds.
LLAMA_LAYER_NORMS = 2


def extra_norm_values(layer: torch.nn.Module, config: Any) -> int:
    """Values per token the norms of decoder ``layer`` save beyond its first two hidden-sized ones (the plan's ``8H``
    holds a Llama layer's two, :data:`LLAMA_LAYER_NORMS`): an RMS norm its input and output, ``2 x`` the width it
    normalises, a ``torch.nn.LayerNorm`` its input; the width ``hidden_size``, a per-head query/key norm's heads x its
    size (``q_norm``, ``query_layernorm``, ...; a ``[heads, head size]`` weight, Cohere's, or one norm per head,
    StableLM's, as it is). Gemma 2/3's pre/post-feedforward norms, the query/key norms of Qwen3, OLMo 2, Gemma 3, Cohere
    and StableLM: measured against the bytes a layer saves in ``tests/unit/plan/test_memory_plan.py``."""
    heads = config_value(config, "num_attention_heads") or 0
    kv_heads = config_value(config, "num_key_value_heads") or heads
    head_dim = _shape_value(config, "head_dim")
    values, hidden_norms = 0, 0
    for name, module in layer.named_modules():
        weight = getattr(module, "weight", None)
        if not name or "norm" not in type(module).__name__.lower() or not isinstance(weight, torch.Tensor) or not weight.dim():
            continue
        width, leaf = weight.numel(), name.rsplit(".", 1)[-1]
        if weight.dim() == 1 and width == config.hidden_size and hidden_norms < LLAMA_LAYER_NORMS:  # one of the 8H's two
            hidden_norms += 1
            continue
        if weight.dim() == 1 and width == head_dim != config.hidden_size and heads:  # applied to each head
            width *= kv_heads if leaf.startswith(("k_", "key")) else heads if leaf.startswith(("q_", "query")) else 1
        values += width * (1 if isinstance(module, torch.nn.LayerNorm) else 2)
    return values


def cache_layout(config: Any) -> dict[str, int | None]:
    """:class:`~nemo_like.plan.memory.ModelShape`'s cache fields of ``config``'s layers (:mod:`~nemo_like.models.layer_kinds`):
    the attention layers (all, when the config lists no kinds), the sliding ones and their window, the stateful ones
    and the state a gated delta net or a Mamba block keeps (:func:`~nemo_like.models.layer_kinds.state_values`)."""
    kinds, window = layer_kinds(config), sliding_window(config)
    stateful = sum(map(holds_state, kinds))
    windowed = kinds.count("sliding_attention") + kinds.count("hybrid_sliding") if kinds else text_config(config).num_hidden_layers
    convolution, recurrent = state_values(config) if stateful else (0, 0)
    return {
        "cached_layers": sum(map(caches_per_token, kinds)) if kinds else None,
        "window_layers": windowed if window else 0,
        "window": window or 0,
        "state_layers": stateful,
        "state_values": convolution,
        "state_float32_values": recurrent,
    }


def matmul_parameters(model_name: str, config_path: str | Path | None = None) -> int:
    """N of :func:`~nemo_like.utils.flops.matmul_params` for ``model_name`` (its ``config.json``:
    :func:`model_config_path`; nothing loaded)."""
    from nemo_like.utils.flops import matmul_params

    return matmul_params(read_model_config(model_config_path(model_name, config_path))[1])


def teacher_key(cfg: Any, name: str) -> str:
    """The config key that names teacher model ``name``: ``teacher.model_name`` or ``teacher.by_task.<task>``."""
    if name == cfg.teacher.model_name:
        return "teacher.model_name"
    return f"teacher.by_task.{next(task for task, model in cfg.teacher.by_task.items() if model == name)}"


def check_teacher_config_names(cfg: Any, configs: Mapping[str, str]) -> None:
    """A ConfigError for a ``--teacher-config`` name that is no teacher model of the run."""
    models = cfg.teacher.models()
    if unknown := sorted(set(configs) - set(models)):
        raise ConfigError(f"--teacher-config {unknown[0]}=...: not a teacher model of this run (its teachers: {models})")


def teacher_config_paths(cfg: Any, configs: Mapping[str, str] | None = None) -> dict[str, Path]:
    """The ``config.json`` of each teacher model (``teacher.models()`` order): ``configs[name]`` when given
    (``--teacher-config NAME=PATH``), else the model's own; a name in ``configs`` that is no teacher model is a
    ConfigError."""
    configs = configs or {}
    check_teacher_config_names(cfg, configs)
    return {name: teacher_config_path(cfg, name, configs.get(name)) for name in cfg.teacher.models()}


def teacher_config_path(cfg: Any, name: str, config_path: str | Path | None = None) -> Path:
    """Teacher model ``name``'s ``config.json``: :func:`model_config_path` with the teacher's key and flag."""
    return model_config_path(name, config_path, teacher_key(cfg, name), f"--teacher-config {name}=PATH")


def teacher_footprints(cfg: Any, paths: Mapping[str, Path]) -> dict[str, tuple[list[ParameterSpec], ModelShape]]:
    """Each teacher model's parameters and shape (by name, from its ``config.json`` in ``paths``), at the teachers'
    precision."""
    precision = cfg.teacher.precision or cfg.policy.precision
    return {name: model_footprint(name, precision, config_path=path) for name, path in paths.items()}


def needs_teachers(cfg: Any, run_plan: Any) -> bool:
    """Whether the run holds teacher models: teacher workers (the teacher pass), or the KL term's copy."""
    return run_plan.logprobs.compute_teacher or cfg.distillation.kl_weight > 0


def sampler_copy_bytes(cfg: Any, run_plan: Any, shape: Any) -> int:
    """Bytes of weights the lean decoder's sampler copies for a call (:func:`~nemo_like.models.generation.lean_decoder.
    fused_step_copy_elements`: fused projections, and oneDNN-packed ones on a CPU), for the backend that samples with
    it: the inline backend (copies of the policy's float32 masters in ``policy.precision``: a bfloat16 run samples
    under autocast, with every projection cast to bf16 once per call and nothing packed for oneDNN) or the HF engine
    (copies of its weights, loaded at ``policy.precision``, for the rows it samples at once); 0 for vLLM. A model the
    fused step does not serve (``shape.fused_sampler``) samples with its own forward: it copies nothing, but under the
    inline backend's autocast, which casts every projection and the head once per call as the fused step does."""
    backend = run_plan.backend.value
    if backend not in ("inline", "hf"):
        return 0
    from nemo_like.models.precision import MASTER_DTYPE, compute_dtype
    from nemo_like.plan.memory import hf_sampling_rows, inline_sampling_rows

    products, on_cpu = compute_dtype(cfg.policy.precision), not cfg.cluster.gpus_per_node
    cast = backend == "inline" and products != MASTER_DTYPE
    if not shape.fused_sampler and not cast:
        return 0
    rows = inline_sampling_rows(cfg) if backend == "inline" else hf_sampling_rows(cfg)
    return lean_decoder_copy_bytes(shape, rows, products, on_cpu, cast=cast)


def lean_decoder_copy_bytes(shape: Any, rows: int, products: torch.dtype, on_cpu: bool, cast: bool = False) -> int:
    """Bytes of the weight copies the lean decoder holds for a call of ``rows`` rows
    (:func:`~nemo_like.models.generation.lean_decoder.fused_step_copy_elements`), each in ``products``, the dtype its
    matmuls run in; ``cast``: every projection cast to it (float32 weights sampled under autocast)."""
    from nemo_like.models.generation.lean_decoder import fused_step_copy_elements

    q_width, kv_width = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    elements = fused_step_copy_elements(
        shape.layers, shape.hidden, shape.intermediate, q_width, kv_width, shape.vocab, rows, products, on_cpu, cast
    )
    return elements * products.itemsize


def scorer_roles(specs: Sequence[ScorerSpec | JudgeSpec], device_bytes: float | None = None) -> tuple[list[RoleMemory], list[str]]:
    """The memory of each reward model and LLM judge ``specs`` names (:func:`~nemo_like.plan.memory.scorer_memory`,
    :func:`~nemo_like.plan.memory.judge_memory`: its parameters counted exactly on the meta device), and a ``not planned``
    line for each whose ``config.json`` is not on this machine. ``device_bytes``: a GPU's (a vLLM judge takes a share)."""
    from transformers import AutoModelForSequenceClassification

    roles, lines = [], []
    for spec in specs:
        if isinstance(spec, JudgeSpec):
            try:
                footprint = model_footprint(spec.model_name, spec.precision)
                roles.append(judge_role(spec, device_bytes, footprint))
                lines += role_unplanned(spec.role, footprint[1], activations=False)
            except UnplannableLayout as exc:
                lines.append(f"not planned: {spec.role} loads {spec.model_name!r} ({exc})")
            except (OSError, ConfigError, ValueError) as exc:
                lines.append(f"not planned: {spec.role} loads {spec.model_name!r}, whose config was not read ({str(exc).splitlines()[0]})")
            continue
        try:
            config_file = local_config_file(spec.model_name) or Path(resolve_model_path(spec.model_name)) / "config.json"
            _, config = read_model_config(config_file)  # the fallback's absence raises: "not planned" below
            with torch.device("meta"):
                model = AutoModelForSequenceClassification.from_config(config)
        except (OSError, ConfigError, ValueError) as exc:  # not on this machine, or not a model's config
            lines.append(f"not planned: {spec.role} loads {spec.model_name!r}, whose config was not read ({str(exc).splitlines()[0]})")
            continue
        parameters = sum(p.numel() for p in model.parameters())
        hidden = int(getattr(config, "hidden_size", 0) or 0)
        intermediate = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
        roles.append(scorer_memory(spec, parameters, hidden, intermediate))
    return roles, lines


def judge_role(spec: JudgeSpec, device_bytes: float | None, footprint: tuple[list[ParameterSpec], ModelShape] | None = None) -> RoleMemory:
    """One judge's memory (:func:`~nemo_like.plan.memory.judge_memory`): its model's parameters and shape as loaded at
    ``spec.precision`` (``footprint``: :func:`model_footprint`'s, when read already), and with the HF engine the
    weights its lean decoder copies for up to ``max_batch_size`` rows."""
    from nemo_like.models.precision import compute_dtype

    params, shape = footprint or model_footprint(spec.model_name, spec.precision)
    parameters = sum(math.prod(p.shape) for p in params)
    copies = 0
    if spec.backend == "hf" and shape.fused_sampler:  # another family samples with its own forward: it copies nothing
        copies = lean_decoder_copy_bytes(shape, spec.max_batch_size, compute_dtype(spec.precision), on_cpu=not spec.num_gpus)
    return judge_memory(spec, parameters, shape, device_bytes, copies)


def planned_memory_lines(cfg: Any, run_plan: Any, scorers: Sequence[ScorerSpec] = ()) -> list[str]:
    """The memory planner's lines for a run that is starting (per role and device, as ``nemo-like plan`` prints them,
    without a device budget or a step time); a model whose shape cannot be read gives one line saying why (the plan
    never stops a run). ``scorers``: the reward models the environments load."""
    from nemo_like.plan.memory import plan_memory

    try:
        params, shape = model_footprint(cfg.policy.model_name, cfg.policy.precision, cfg.policy.lora_cfg)
        teachers = teacher_footprints(cfg, teacher_config_paths(cfg)) if needs_teachers(cfg, run_plan) else {}
        scorer_memories, unplanned = scorer_roles(scorers)
    except Exception as exc:  # noqa: BLE001 - an estimate, never a reason to stop
        return [f"memory: not estimated ({type(exc).__name__}: {exc})"]
    copies = sampler_copy_bytes(cfg, run_plan, shape)
    memory = plan_memory(cfg, run_plan, params, shape, None, teachers, None, copies, scorers=scorer_memories)
    return [*memory.lines(), *unplanned_lines(shape, teachers), *unplanned]


def memory_report(
    cfg: Any,
    run_plan: Any,
    device_gib: float | None,
    peak_flops: float | None,
    mfu: float,
    config_path: str | None = None,
    teacher_configs: Mapping[str, str] | None = None,
    cluster_problem: Callable[[Any], str | None] | None = None,
    scorers: Sequence[ScorerSpec] = (),
) -> tuple[list[str], bool | None]:
    """``nemo-like plan``'s lines (the run plan's decisions, then memory per role and device, the fit, the step time)
    and whether the run fits ``device_gib`` per device (per node on a CPU cluster; ``None``: not checked); nothing
    starts. ``run_plan``: the run's :class:`~nemo_like.plan.run_plan.RunPlan`; ``config_path``: the policy model's
    ``config.json`` (``--model-config``), ``teacher_configs``: a teacher model's by name (``--teacher-config``);
    ``cluster_problem(config)``: what keeps ``config`` off the declared cluster whatever the memory (more GPUs reserved than
    declared), ``None`` if nothing;
    ``scorers``: the reward models the environments load (:func:`scorer_roles`)."""
    from nemo_like.plan.memory import GIB, plan_memory, step_estimate

    check_teacher_config_names(cfg, teacher_configs or {})  # also where the run holds no teacher (the flag did nothing)
    paths = teacher_config_paths(cfg, teacher_configs) if needs_teachers(cfg, run_plan) else {}
    try:
        params, shape = model_footprint(cfg.policy.model_name, cfg.policy.precision, cfg.policy.lora_cfg, config_path)
        teachers = teacher_footprints(cfg, paths)
    except UnplannableLayout as exc:  # a layout train runs but the plan cannot lay out (GPT-2's transformer.h): no figures
        lines = [*run_plan.lines(this_machine=True), f"not planned: the memory of every role and the fit ({exc})"]
        if (problem := cluster_problem(cfg) if cluster_problem is not None else None) is not None:  # whatever the memory
            return [*lines, f"fits: NO: {problem}"], False
        return lines, None
    step = None
    if peak_flops:
        from nemo_like.utils.flops import training_flops_per_token

        n = matmul_parameters(cfg.policy.model_name, config_path)
        teacher_n = {name: matmul_parameters(name, config_path=path) for name, path in paths.items()}
        lora = sum(math.prod(p.shape) for p in params if p.trainable) if cfg.policy.lora_cfg.enabled else None
        step = step_estimate(cfg, run_plan, n, peak_flops, mfu, teacher_n, trained_token_flops=training_flops_per_token(n, lora))
        if scorers:
            step = replace(step, left_out=f"the scoring of {', '.join(spec.role for spec in scorers)}")
    copies = sampler_copy_bytes(cfg, run_plan, shape)
    device_bytes = device_gib * GIB if device_gib else None
    scorer_memories, unplanned = scorer_roles(scorers, device_bytes)
    memory = plan_memory(cfg, run_plan, params, shape, device_bytes, teachers, step, copies, cluster_problem, scorer_memories)
    return [*run_plan.lines(this_machine=True), *memory.lines(), *unplanned_lines(shape, teachers), *unplanned], memory.fits


def unplanned_lines(shape: ModelShape, teachers: Mapping[str, tuple[list[ParameterSpec], ModelShape]]) -> list[str]:
    """The ``not planned`` lines of the policy model's shape and each teacher model's (named)."""
    return [*shape.unplanned(), *(line for name, (_, t) in teachers.items() for line in role_unplanned(f"teacher {name}", t))]


def role_unplanned(role: str, shape: ModelShape, activations: bool = True) -> list[str]:
    """``shape``'s ``not planned`` lines (:meth:`~nemo_like.plan.memory.ModelShape.unplanned`), naming ``role``."""
    return [line.replace("not planned: ", f"not planned: {role}: ", 1) for line in shape.unplanned(activations)]
