"""Refit a vLLM CPU engine in place without vLLM's layer-wise reload.

vLLM's ``reload_weights`` restores every layer onto the meta device, re-materialises it, loads the
checkpoint tensors through the model's loaders, re-runs each layer's post-processing and copies the
result back, counting loaded elements under a dispatch mode as it goes. On CPU the post-processing
that matters is one call per linear layer: the unquantized linear method packs the weight into a
oneDNN (or packed-GEMM) handle and drops the plain weight, so a plain ``copy_`` into the parameter
would leave the engine computing with the old, packed copy.

This module does only the necessary part: it fuses the checkpoint tensors the way the model stores
them (``packed_modules_mapping``: ``q/k/v_proj`` -> ``qkv_proj``, ``gate/up_proj`` -> ``gate_up_proj``,
tensor parallel 1), copies plain parameters (norms, embeddings, biases) in place, gives each linear
layer its fused weight back and re-runs that layer's ``process_weights_after_loading`` (which builds
the new handle). A model it does not fully understand (a vLLM class whose loader may rearrange tensors, a name it
cannot place, a shape that differs, a quantized layer) is left untouched and the caller falls back to vLLM's own
reload.

What remains is mostly building the oneDNN handles themselves (``benchmarks/refit.py`` measures a refit).
``tests/functional/test_vllm_backend.py`` checks that this loader and vLLM's reload give bit-identical
generations.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

PLAIN_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
#: vLLM model classes whose ``load_weights`` only renames the checkpoint's tensors and stacks them by
#: ``packed_modules_mapping``, what this loader does (checked against vLLM's reload on a real engine). Another's may
#: rearrange a tensor within its shape, which no shape check sees: Falcon's reorders its fused ``query_key_value`` rows
#: (copied as they come, its refits sampled from scrambled attention weights, train/gen_kl ~4e-3 instead of ~1e-13).
IN_PLACE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
STAGING = "_nemo_like_refit_staging"  # a linear layer's fused weight as last written, kept on the module


class InPlaceReloadUnsupported(ValueError):
    """The model has something this loader does not handle; use vLLM's own reload."""


@dataclass
class ParamUpdate:
    """One parameter's new value: copied in place, or (a linear weight its layer dropped after packing) set anew."""

    module: torch.nn.Module
    name: str
    parts: list[torch.Tensor]  # stacked along dim 0 (q, k, v / gate, up; one part for an unfused parameter)
    replace: bool

    @property
    def shape(self) -> tuple[int, ...]:
        return (sum(p.shape[0] for p in self.parts), *self.parts[0].shape[1:])


def write_rows(destination: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """Copy ``parts`` one after another into the leading rows of ``destination`` (no concatenated temporary)."""
    row = 0
    for part in parts:
        destination[row : row + part.shape[0]].copy_(part)
        row += part.shape[0]


def fused_target(name: str, packed: dict[str, list[str]]) -> tuple[str, str, int, int]:
    """``(module path, parameter name, part index, number of parts)`` of checkpoint tensor ``name`` in the vLLM
    model: ``model.layers.0.self_attn.k_proj.weight`` -> ``("model.layers.0.self_attn.qkv_proj", "weight", 1, 3)``."""
    module, _, param = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    for fused, parts in packed.items():
        if leaf in parts:
            return (f"{parent}.{fused}" if parent else fused), param, parts.index(leaf), len(parts)
    return module, param, 0, 1


def plan_in_place_reload(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> list[ParamUpdate]:
    """Every parameter update a refit with ``weights`` (checkpoint names) needs; raises
    :class:`InPlaceReloadUnsupported` (before anything is changed) when the model is not fully covered."""
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    parts: dict[tuple[str, str], list[torch.Tensor | None]] = {}
    for name, tensor in weights:
        module, param, index, count = fused_target(name, packed)
        slots = parts.setdefault((module, param), [None] * count)
        slots[index] = tensor
    modules = dict(model.named_modules())
    updates: list[ParamUpdate] = []
    covered: set[int] = set()
    for (module_name, param), slots in parts.items():
        module = modules.get(module_name)
        current = getattr(module, param, None) if module is not None else None
        if not isinstance(current, torch.Tensor):
            raise InPlaceReloadUnsupported(f"no parameter {module_name}.{param} in the vLLM model")
        if any(s is None for s in slots):
            raise InPlaceReloadUnsupported(f"{module_name}.{param}: only some of its packed parts were sent")
        shape = (sum(s.shape[0] for s in slots), *slots[0].shape[1:])
        dtypes = {s.dtype for s in slots}
        method = getattr(module, "quant_method", None)
        if method is not None and type(method).__name__ not in PLAIN_METHODS:
            raise InPlaceReloadUnsupported(f"{module_name} uses {type(method).__name__}")
        replace = current.numel() == 0 and param == "weight" and hasattr(module, "cpu_linear")
        expected = (module.output_size_per_partition, module.input_size_per_partition) if replace else tuple(current.shape)
        if padded_vocab_rows(module, shape, current):
            expected = (shape[0], *current.shape[1:])  # the rows past the vocabulary stay as loaded (zero)
        if shape != expected or dtypes != {current.dtype}:
            raise InPlaceReloadUnsupported(
                f"{module_name}.{param}: got {shape} {sorted(map(str, dtypes))}, the engine holds {expected} {current.dtype}"
            )
        updates.append(ParamUpdate(module, param, slots, replace))
        covered.add(id(current))
    missing = [n for n, p in model.named_parameters() if id(p) not in covered]
    if missing:
        raise InPlaceReloadUnsupported(f"the refit does not cover {missing[:3]}")
    return updates


def padded_vocab_rows(module: torch.nn.Module, shape: tuple[int, ...], current: torch.Tensor) -> bool:
    """An embedding or LM head whose vocabulary the engine padded (``org_vocab_size`` rows of the checkpoint's)."""
    rows = getattr(module, "org_vocab_size", None)
    return rows is not None and len(shape) == current.ndim == 2 and shape[0] == rows < current.shape[0]


@torch.no_grad()
def apply_in_place_reload(updates: list[ParamUpdate]) -> None:
    """Write the planned values, then re-run the post-processing (packing) of every layer that packs its weight."""
    repack: dict[int, torch.nn.Module] = {}
    for update in updates:
        if update.replace:
            # The layer's own staging tensor, kept between refits (no fresh allocation and page faults each time):
            # the handle packs a copy of it, and a layer that fell back to a plain linear computes with it.
            staging = getattr(update.module, STAGING, None)
            if staging is None or tuple(staging.shape) != update.shape:
                staging = torch.empty(update.shape, dtype=update.parts[0].dtype)
                setattr(update.module, STAGING, staging)
            write_rows(staging, update.parts)
            setattr(update.module, update.name, torch.nn.Parameter(staging, requires_grad=False))
        else:
            write_rows(getattr(update.module, update.name), update.parts)
        if hasattr(update.module, "cpu_linear"):
            repack[id(update.module)] = update.module
    for module in repack.values():
        module.quant_method.process_weights_after_loading(module)


def check_in_place_architecture(model: torch.nn.Module) -> None:
    """:class:`InPlaceReloadUnsupported` unless ``model``'s vLLM class is one of :data:`IN_PLACE_ARCHITECTURES`."""
    name = type(model).__name__
    if name not in IN_PLACE_ARCHITECTURES:
        raise InPlaceReloadUnsupported(
            f"vLLM's {name} may rearrange checkpoint tensors as it loads them; the in-place loader follows "
            f"{', '.join(IN_PLACE_ARCHITECTURES)} only"
        )


def reload_in_place(worker, weights: list[tuple[str, torch.Tensor]]) -> str | None:
    """Run inside the engine (``collective_rpc``): load ``weights`` in place. Returns None when done, or why
    not (nothing was changed), so the caller uses vLLM's ``reload_weights`` instead."""
    try:
        model = worker.model_runner.get_model()
        check_in_place_architecture(model)
        updates = plan_in_place_reload(model, weights)
    except InPlaceReloadUnsupported as exc:
        return str(exc)
    apply_in_place_reload(updates)
    return None
