"""FSDP2 sharding of a policy model, and the state that has to cross the shards: gradient norms,
checkpoints and refit buckets.

Each decoder layer is its own FSDP2 unit (its parameters are all-gathered just before its forward and
backward and freed after), the root holds the embeddings, final norm and output head. Gradients are
reduce-scattered, so every rank keeps 1/dp of the parameters, gradients and AdamW moments.

Every function here that touches sharded tensors is a collective: all ranks of the group must call it,
in the same order. A model that was never sharded (dp 1, tp 1) takes the plain paths and needs no
process group.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from nemo_like.plan.memory import layer_values


def is_sharded(model: torch.nn.Module) -> bool:
    """True when ``model`` holds DTensor (sharded) parameters."""
    return any(isinstance(p, DTensor) for p in model.parameters())


#: Where a Hugging Face causal LM keeps its decoder blocks under its base model (transformers' ``base_model_prefix``
#: module): Llama's ``model.layers``, Mamba's ``backbone.layers``, a vision-language model's ``language_model.layers``,
#: GPT-2's and Falcon's ``transformer.h``, OPT's ``model.decoder.layers``.
DECODER_LAYER_PATHS = ("layers", "language_model.layers", "h", "decoder.layers")


def decoder_layers(model: torch.nn.Module, paths: tuple[str, ...] = DECODER_LAYER_PATHS) -> list[torch.nn.Module]:
    """The decoder blocks of a Hugging Face causal LM: the first of ``paths`` that is a module list under its ``model``
    (Llama 4's text class names ``language_model`` its base model but keeps ``model``) or its base model."""
    if hasattr(model, "get_base_model"):  # a PEFT model (LoRA): the layers are the wrapped model's
        model = model.get_base_model()
    bases = [base for base in (getattr(model, "model", None), getattr(model, "base_model", None)) if isinstance(base, torch.nn.Module)]
    for base in bases:
        for path in paths:
            try:
                layers = base.get_submodule(path)
            except AttributeError:
                continue
            if isinstance(layers, torch.nn.ModuleList):
                return list(layers)
    where = " or ".join(f"<base model>.{path}" for path in paths)
    raise ValueError(f"{type(model).__name__}: cannot find the decoder layers (expected {where})")


def build_mesh(dp_size: int, tp_size: int, device_type: str):
    """A ``(dp, tp)`` device mesh over the default process group (``dp`` only when ``tp_size`` is 1)."""
    from torch.distributed.device_mesh import init_device_mesh

    if tp_size == 1:
        return init_device_mesh(device_type, (dp_size,), mesh_dim_names=("dp",))
    return init_device_mesh(device_type, (dp_size, tp_size), mesh_dim_names=("dp", "tp"))


#: Megatron-style tensor parallelism of a decoder layer (Qwen2/Llama layout): each projection split column-wise (its
#: output features) or row-wise (its input features). Everything else (embeddings, norms, the output head) is whole on
#: every tp rank and sharded by FSDP2 over the dp ranks only.
TENSOR_PARALLEL_STYLES = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def tensor_parallel_problem(model: torch.nn.Module) -> str | None:
    """Why :data:`TENSOR_PARALLEL_STYLES` cannot split ``model``'s decoder layers exactly, or ``None``. Each layer needs
    the attention's four projections and no other parameter in its attention module (a per-head query/key norm or
    sink stays whole on every tp rank while each rank trains its copy on its own heads: Qwen3's copies drifted apart
    silently), no head count of its own to reshape with (StableLM's), and in its MLP ``down_proj`` with ``gate_proj``
    and/or ``up_proj`` and nothing else, or none of them (experts, or another layout, then run whole on every rank:
    Phi-3's fused gate_up_proj beside a row-wise down_proj crashed)."""
    groups = {group: [k for k in TENSOR_PARALLEL_STYLES if k.startswith(group + ".")] for group in ("self_attn", "mlp")}
    for index, layer in enumerate(decoder_layers(model)):
        for group, keys in groups.items():
            found = [k for k in keys if _has_submodule(layer, k)]
            if group == "mlp" and not found:
                continue
            # an MLP without a gate (Arcee, Nemotron: up_proj, down_proj) splits exactly as a gated one
            needed = keys if group == "self_attn" else ["mlp.down_proj"] if set(found) & {"mlp.gate_proj", "mlp.up_proj"} else keys
            if missing := [k for k in needed if k not in found]:
                return f"layer {index} has no {', '.join(missing)} (the plan splits Llama-layout projections: {', '.join(keys)})"
            split = {f"{k.split('.', 1)[1]}.{name}" for k in found for name, _ in layer.get_submodule(k).named_parameters()}
            others = [name for name, _ in layer.get_submodule(group).named_parameters() if name not in split]
            if others:
                return f"layer {index}'s {group} holds parameters the plan does not split ({', '.join(others)})"
        attention = layer.get_submodule("self_attn")
        if "self.num_heads" in inspect.getsource(type(attention).forward):
            return f"layer {index}'s attention reshapes with a head count of its own (num_heads), which the split does not change"
    return None


def _has_submodule(module: torch.nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def tensor_parallel_dims(model: torch.nn.Module) -> dict[int, int]:
    """``{id(parameter): dim}`` of every parameter tensor parallelism splits, along that dim: a column-wise
    projection's weight and bias along dim 0, a row-wise one's weight along dim 1 (its bias stays whole); parameters not
    listed (and those of a layer without such a projection) are whole on every tp rank."""
    dims: dict[int, int] = {}
    for layer in decoder_layers(model):
        for module_name, style in TENSOR_PARALLEL_STYLES.items():
            try:
                module = layer.get_submodule(module_name)
            except AttributeError:
                continue
            for name, param in module.named_parameters(recurse=False):
                if style == "colwise":
                    dims[id(param)] = 0
                elif name == "weight":
                    dims[id(param)] = 1
    return dims


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh) -> None:
    """GPU only, untested on GPU here: Megatron-style column/row sharding of attention and MLP projections
    (:data:`TENSOR_PARALLEL_STYLES`). Heads are split across the tp ranks, so num_attention_heads and
    num_key_value_heads must be divisible by the tp degree."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    text = model.config.get_text_config()
    tp = tp_mesh.size()
    heads = text.num_attention_heads
    for kv_heads in layer_values(text, "num_key_value_heads") or [heads]:  # Gemma 4's differ per layer
        if heads % tp or (kv_heads or heads) % tp:
            raise ValueError(
                f"policy.dtensor_cfg.tensor_parallel_size={tp} must divide num_attention_heads={heads} and num_key_value_heads={kv_heads or heads}"
            )
    if problem := tensor_parallel_problem(model):
        raise ValueError(f"policy.dtensor_cfg.tensor_parallel_size={tp}: {type(model).__name__}: {problem}")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name: styles[style]() for name, style in TENSOR_PARALLEL_STYLES.items()}
    for layer in decoder_layers(model):
        parallelize_module(layer, tp_mesh, plan)


def shard_model(
    model: torch.nn.Module,
    mesh,
    *,
    cpu_offload: bool = False,
    activation_checkpointing: bool = False,
    mp_policy: Any = None,
) -> torch.nn.Module:
    """Shard ``model`` in place with FSDP2 over ``mesh['dp']`` (after tensor parallelism over ``mesh['tp']`` if present);
    ``mp_policy``: FSDP2's ``MixedPrecisionPolicy`` (:func:`~nemo_like.models.precision.fsdp_mixed_precision`)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    names = mesh.mesh_dim_names or ()
    if "tp" in names:
        apply_tensor_parallel(model, mesh["tp"])
    dp_mesh = mesh["dp"] if "tp" in names else mesh
    kwargs: dict[str, Any] = {"mesh": dp_mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if cpu_offload:
        if mesh.device_type == "cpu":
            warnings.warn("policy.dtensor_cfg.cpu_offload has no effect on CPU (the model is in CPU memory already)", stacklevel=2)
        else:
            kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float | None) -> float:
    """Global gradient norm over all shards (DTensor-aware); clips in place when ``max_norm`` is set.

    Returns the norm before clipping. A non-finite norm leaves the gradients untouched.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    # DTensor norms reduce within one mesh; with tensor parallelism some parameters live on the (dp, tp)
    # mesh and others (norms, embeddings) on dp only, so combine the per-mesh norms by hand.
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    squares = []
    for group in by_mesh.values():
        part = torch.nn.utils.get_total_norm(group, norm_type=2.0)
        if isinstance(part, DTensor):
            part = part.full_tensor()  # the partial per-shard norms reduced across the mesh
        squares.append(part.float().cpu() ** 2)
    total = torch.stack(squares).sum().sqrt()
    norm = float(total)
    if max_norm is not None and torch.isfinite(total):
        coef = min(1.0, max_norm / (norm + 1e-6))  # the same rule as torch.nn.utils.clip_grad_norm_
        if coef < 1.0:
            with torch.no_grad():
                for group in by_mesh.values():
                    torch._foreach_mul_(group, coef)  # one kernel launch per mesh, not one per tensor
    return norm


def _options(model: torch.nn.Module, **extra: Any) -> StateDictOptions:
    sharded = is_sharded(model)
    return StateDictOptions(full_state_dict=True, cpu_offload=sharded, **extra)


def gather_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU state dict on rank 0 of a sharded model (empty on the other ranks); a CPU copy for a plain one."""
    if not is_sharded(model):
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return get_model_state_dict(model, options=_options(model))


def _grads(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Every optimizer parameter with its ``.grad`` as it is now (the tensor itself, or ``None``)."""
    return [(p, p.grad) for group in optimizer.param_groups for p in group["params"]]


def _undo_state_init(optimizer: torch.optim.Optimizer, grads: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    """Undo torch's ``_init_optim_state`` on an optimizer that had no state: ``get_optimizer_state_dict`` and
    ``set_optimizer_state_dict`` run a fake ``step()`` (zero gradients, lr 0) when the optimizer has no state and no
    parameter has a gradient, leaving AdamW a step count of 1 and zero moments (the next real update was bias-corrected
    as a second one, ~0.74x its size) and every ``.grad`` set to None. The lr-0 step leaves the weights as they were."""
    optimizer.state.clear()
    for param, grad in grads:
        param.grad = grad


def gather_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Full optimizer state keyed by parameter names (rank 0 of a sharded model; empty elsewhere).

    The name-keyed layout does not depend on how the parameters are sharded. An optimizer that has not stepped yet (every
    step so far skipped: empty or non-finite) saves an empty state with its param groups and is left as it was: no state,
    its gradients untouched (see :func:`_undo_state_init`)."""
    if optimizer.state:
        return get_optimizer_state_dict(model, optimizer, options=_options(model))
    grads = _grads(optimizer)
    state = get_optimizer_state_dict(model, optimizer, options=_options(model))
    _undo_state_init(optimizer, grads)
    if "state" in state:  # rank 0 (every rank of a plain model): the fake step's state is not one to save
        state["state"] = {}
    return state


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Load a full state dict (every rank passes the same one); returns ``(missing, unexpected)`` keys."""
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if not is_sharded(model):
        model.load_state_dict(state, strict=False)
    else:
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    return missing, unexpected


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a name-keyed full optimizer state (as :func:`gather_optimizer_state` wrote it) into the shards.

    An empty saved state (the optimizer had not stepped yet) leaves the optimizer with no state, as a fresh one: its param
    groups load, and neither the fake step torch runs to initialise the state nor a state this optimizer held before
    stays (see :func:`_undo_state_init`). A trainable parameter the saved groups list without a state never had a
    gradient (a multimodal model's vision tower in a text run): it loads without one, as it was saved (torch's strict
    load refused every such checkpoint); one the saved groups do not list is another model's checkpoint."""
    saved = set(state.get("state") or {}) | {name for group in state.get("param_groups", []) for name in group.get("params", [])}
    if state.get("state") and (unknown := [n for n, p in model.named_parameters() if p.requires_grad and n not in saved]):
        raise RuntimeError(f"the saved optimizer state does not list {len(unknown)} trainable parameters, e.g. {unknown[:3]}")
    grads = _grads(optimizer)
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True, strict=False))
    if not state.get("state"):
        _undo_state_init(optimizer, grads)
        return
    for name, param in model.named_parameters():  # the fake step's state (step 1, zero moments) of those saved without
        if name not in state["state"]:
            optimizer.state.pop(param, None)


def iter_full_tensors(
    model: torch.nn.Module, keep: bool, include: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full CPU tensor)`` of every state-dict entry (tied weights under each name), or of those whose
    name passes ``include``; ranks with ``keep=False`` get empty tensors.

    Every rank must iterate to the end with the same ``include`` (each gather is a collective) and never holds
    more than one gathered tensor (tied ones are gathered once and kept until their last name)."""
    entries = [(n, t) for n, t in model.state_dict(keep_vars=True).items() if include is None or include(n)]
    # A tied tensor's names next to each other (the embedding first, the LM head last in a state dict): one bucket
    # holds both, so the tensor is sent and counted once (split over two buckets it was pickled into each); the
    # receivers match names as sets, and every rank orders them alike.
    by_tensor: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in entries:
        by_tensor.setdefault(id(tensor), []).append((name, tensor))
    entries = [entry for names in by_tensor.values() for entry in names]
    uses: dict[int, int] = {}
    for _, tensor in entries:
        uses[id(tensor)] = uses.get(id(tensor), 0) + 1
    tied: dict[int, torch.Tensor] = {}
    for name, tensor in entries:
        key = id(tensor)
        full = tied.get(key)
        if full is None:
            with torch.no_grad():
                local = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                full = local.detach().to("cpu", copy=True) if keep else torch.empty(0)
        uses[key] -= 1
        if uses[key]:
            tied[key] = full
        else:
            tied.pop(key, None)
        yield name, full


def bucketize(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Group ``(name, tensor)`` pairs into dicts of at most ``bucket_bytes`` (a single larger tensor is a bucket
    of its own); empty tensors (ranks that keep nothing) count zero bytes."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    held: set[int] = set()  # tensors in the bucket: a tied one's second name adds no bytes (pickled once)
    for name, tensor in named:
        nbytes = 0 if id(tensor) in held else tensor.numel() * tensor.element_size()
        if bucket and nbytes and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size, held = {}, 0, set()
        bucket[name] = tensor
        held.add(id(tensor))
        size += nbytes
    if bucket:
        yield bucket


def iter_weight_buckets(model: torch.nn.Module, bucket_bytes: int, keep: bool) -> Iterator[dict[str, torch.Tensor]]:
    """Full CPU tensors of the state dict (tied weights under each name), ``bucket_bytes`` at most per bucket.

    Every rank must iterate (each tensor's gather is a collective); ranks with ``keep=False`` get buckets of
    empty tensors and never hold more than one gathered tensor."""
    yield from bucketize(iter_full_tensors(model, keep), bucket_bytes)
