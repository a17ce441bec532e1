"""A model's tensors as its checkpoint files hold them (what vLLM's ``load_weights`` reads, what a run's checkpoint
writes) and back.

transformers 5 holds some models' weights otherwise than it saves them: a mixture of experts' experts fused into
``[experts, out, in]`` parameters under other names (Mixtral's ``mlp.experts.gate_up_proj`` for the checkpoint's
``block_sparse_moe.experts.<e>.w1.weight`` and ``w3``), and ``save_pretrained`` reverts that. The policy sends the weights
it holds; the vLLM engine reverts them the same way, a tensor at a time, before loading them (transformers'
``revert_weight_conversion``; nothing to do for a model it holds as saved: the Llama family, Qwen2, Gemma).
A run's checkpoint (``policy/model.safetensors``) is written in that layout too, so that vLLM and any loader of the
original layout load it, and :func:`held_tensor_batches` converts it back on resume.
``tests/unit/models/test_refit_checkpoint_format.py`` checks the result against ``save_pretrained``'s files.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterable, Iterator
from typing import Any

import torch


@functools.cache
def skeleton(model_path: str) -> torch.nn.Module:
    """The HF model of ``model_path`` on the meta device (its conversions are read from it; no weights), once per
    engine process. Its conversions are those ``from_pretrained`` keeps for the model's own files, read from their
    tensor names where the directory has safetensors files: a model built from a config drops every ``PrefixChange``,
    while Qwen3.5's multimodal-layout files (``model.language_model.*``) need theirs (vLLM refused the text names)."""
    from nemo_like.models.loading import meta_skeleton

    model = meta_skeleton(model_path)
    names = file_tensor_names(model_path)
    if names:
        model._weight_conversions = conversions_used_by(model, names)
    return model


def file_tensor_names(model_path: str) -> list[str] | None:
    """The tensor names of a model's safetensors files (the shard index's, or the single file's header), found beside
    its ``config.json`` (a directory, a shipped model, a hub id's snapshot in the local cache); ``None`` where there are
    none to read (``.bin`` weights, nothing on this machine)."""
    from nemo_like.models.loading import local_config_file

    config = local_config_file(model_path)
    if config is None:
        return None
    directory = config.parent
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    single = directory / "model.safetensors"
    if not single.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(single), "pt") as handle:
        return list(handle.keys())


def conversions_used_by(model: torch.nn.Module, names: Iterable[str]) -> list[Any]:
    """``model``'s conversions that apply to checkpoint tensors named ``names``, as ``from_pretrained`` keeps them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import rename_source_key

    conversions = get_model_conversion_mapping(model, add_legacy=False)
    renamings, converters = _split(conversions)
    for name in names:
        rename_source_key(name, renamings, converters)  # marks each transform that matches as used
    return [c for c in conversions if c.was_used()]


def _split(conversions: list[Any]) -> tuple[list[Any], list[Any]]:
    """``conversions`` as ``rename_source_key`` takes them: the renamings, then the converters (each in order)."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    return [c for c in conversions if isinstance(c, WeightRenaming)], [c for c in conversions if isinstance(c, WeightConverter)]


def _conversions(model: torch.nn.Module) -> list[Any]:
    """transformers' conversions from ``model``'s checkpoint layout to the one it holds (as ``revert_weight_conversion``
    reads them)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:  # built from a config
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    return list(conversions)


@functools.cache
def converts(model: torch.nn.Module) -> bool:
    """Whether transformers holds ``model``'s weights otherwise than its checkpoint does."""
    return bool(_conversions(model))


def checkpoint_tensors(model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` (``model``'s state-dict names and layout) as its checkpoint holds them, a tensor at a time (a
    streamed refit stays bucket by bucket), except where one file tensor is built of several held ones (HRM's
    ``gate_up_proj``, held as ``gate_proj`` and ``up_proj``): those wait for their parts (reverted one at a time, each
    part was written under the file's name in turn, the last one left). Unchanged for a model held as saved."""
    if not converts(model):
        yield from tensors
        return
    from transformers.core_model_loading import rename_source_key, revert_weight_conversion

    reverse = [c.reverse_transform() for c in _conversions(model)[::-1]]  # as revert_weight_conversion orders them
    renamings, converters = _split(reverse)
    parts_of = {pattern: len(c.source_patterns) for c in converters for pattern in c.source_patterns}
    waiting: dict[str, dict[str, torch.Tensor]] = {}  # a file tensor of several held ones -> its parts so far
    for name, tensor in tensors:
        file_name, pattern = rename_source_key(name, renamings, converters, reverse=True)
        parts = parts_of.get(pattern, 1) if pattern is not None else 1
        if parts == 1:
            yield from revert_weight_conversion(model, {name: tensor}).items()
            continue
        group = waiting.setdefault(file_name, {})
        group[name] = tensor
        if len(group) == parts:
            yield from revert_weight_conversion(model, waiting.pop(file_name)).items()
    if waiting:
        raise ValueError(
            f"tensors {sorted(waiting)} are built from several of the model's tensors; only some came: {sorted(n for g in waiting.values() for n in g)}"
        )


#: The most bytes of converted tensors :func:`held_tensor_batches` holds at once: every rank of a resume converts the
#: whole file (a batch is loaded and freed before the next), so a mixture of experts' stacked copies stay bounded per
#: rank instead of doubling the model in each rank's private memory (the file itself is memory-mapped, shared).
HELD_BATCH_BYTES = 1 << 30


def held_tensor_batches(
    model: torch.nn.Module, tensors: dict[str, torch.Tensor], max_bytes: int = HELD_BATCH_BYTES
) -> Iterator[dict[str, torch.Tensor]]:
    """The inverse of :func:`checkpoint_tensors`: a whole checkpoint's ``tensors`` under ``model``'s state-dict names and
    layout (transformers' forward conversions, as ``from_pretrained`` applies them: Mixtral's per-expert ``w1``/``w3``
    stacked into ``gate_up_proj``), in batches of about ``max_bytes`` to load one after the other. A name the model
    holds passes unchanged (a checkpoint written in the held layout still loads). One batch, ``tensors`` itself, for a
    model held as saved."""
    if not converts(model):
        yield tensors
        return
    from transformers.core_model_loading import WeightRenaming, dot_natural_key, rename_source_key

    conversions = _conversions(model)
    renamings, converters = _split(conversions)
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    held_shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    model_names = set(held_shapes)
    targets: dict[str, Any] = {}  # held name -> the transform collecting its checkpoint tensors
    sources: dict[str, list[str]] = {}  # held name -> the checkpoint's names it is made of
    for name, tensor in sorted(tensors.items(), key=lambda item: dot_natural_key(item[0])):
        held, pattern = rename_source_key(name, renamings, converters)
        if held not in model_names and name in model_names:  # a renaming caught a name the model holds (as from_pretrained)
            held, pattern = name, None
        if pattern is None:
            target, pattern = targets.setdefault(held, WeightRenaming(name, held)), name
        else:
            target = targets.setdefault(held, copy.deepcopy(by_pattern[pattern]))
        target.add_tensor(held, name, pattern, tensor)
        sources.setdefault(held, []).append(name)
    batch: dict[str, torch.Tensor] = {}
    size = 0
    for first, target in targets.items():
        try:
            converted = target.convert(first, model=model, config=model.config)
        except (RuntimeError, ValueError, IndexError) as exc:  # torch's "Sizes of tensors must match ..." of a stack
            raise ValueError(_unconverted(first, sources[first], str(exc))) from exc
        for held, value in converted.items():
            batch[held] = value = value[0] if isinstance(value, list) else value
            if held in held_shapes and tuple(value.shape) != held_shapes[held]:  # e.g. 3 of 4 experts' down_proj stacked
                raise ValueError(_unconverted(held, sources[first], f"shape {tuple(value.shape)}, the model's {held_shapes[held]}"))
            size += value.numel() * value.element_size()
        if size >= max_bytes:
            yield batch
            batch, size = {}, 0
    if batch:
        yield batch


def _unconverted(held: str, names: list[str], why: str) -> str:
    """The error of checkpoint tensors that do not make the model's tensor ``held``."""
    shown = ", ".join(names) if len(names) <= 4 else f"{names[0]}, ..., {names[-1]}"
    return (
        f"the checkpoint's {len(names)} tensor(s) for the model's {held} ({shown}) do not make it: {why.rstrip('.')}. "
        "A tensor is missing from the checkpoint, or one has another shape (a checkpoint of another model?)"
    )
