"""LoRA adapters (PEFT): which modules get them, wrapping the model, what leaves the policy, the adapter format and
merging. Used by both sides: the policy trains and exports adapters, the vLLM engine loads them.

The policy model becomes a ``peft.PeftModel``: the base weights are frozen, only ``lora_A`` / ``lora_B``
train (so only they get gradients and optimizer state). Three views of the weights leave a worker:

* **adapter tensors** under PEFT's saved names (``...q_proj.lora_A.weight``, no adapter name): what a
  checkpoint stores (``adapter_model.safetensors`` + ``adapter_config.json``, loadable with
  ``PeftModel.from_pretrained``) and what an adapter refit sends to vLLM;
* **merged tensors** under the plain HF names (``W + B @ A * alpha / dim``): the merged refit and ``merge``;
* the reference policy: the same model under ``disable_adapter()``, no second copy of the weights.

How generation receives new weights (adapters as a vLLM LoRA request, or merged weights) is decided once
by :func:`nemo_like.plan.refit.refit_mode`, part of the run plan.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nemo_like.config.errors import ConfigError
from nemo_like.models.loading import (
    ADAPTER_CONFIG,
    TOKENIZER_FILES,
    adapter_base_model,
    check_adapter_dir,
    check_model_source,
    end_of_sequence_ids,
    holds_tokenizer,
    load_merged,
    load_tokenizer,
    looks_like_path,
    meta_skeleton,
    resolve_model_path,
    save_generation_config,
)
from nemo_like.models.precision import refit_dtype
from nemo_like.utils.experts import experts_of
from nemo_like.utils.preflight import refuse_overwriting
from nemo_like.utils.text_path import text_path_parameters

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_NAME",
    "ADAPTER_WEIGHTS",
    "adapter_config_dict",
    "apply_lora",
    "check_lora_targets",
    "same_adapted_modules",
    "decoder_linear_modules",
    "exclusions_without_effect",
    "expected_adapter_names",
    "is_adapter",
    "load_merged",
    "merge_checkpoint",
    "merge_weight",
    "merged_tensors",
    "model_name",
    "parameter_counts",
    "peft_config",
    "resolve_target_modules",
    "saved_name",
    "scaling",
    "write_adapter",
]

ADAPTER_NAME = "default"  # PEFT's name for the single adapter; it is dropped from saved names
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


def decoder_linear_modules(model: torch.nn.Module) -> list[str]:
    """Full names of the ``nn.Linear`` modules inside the decoder blocks (the modules adapters may go on), on the text
    path of a multimodal model (:func:`~nemo_like.utils.text_path.text_path_parameters`: a vision tower's blocks are
    ``layers`` too, and a text run gives their adapters no gradient)."""
    reached = text_path_parameters(model)
    return [
        name
        for name, mod in model.named_modules()
        if isinstance(mod, torch.nn.Linear) and ".layers." in f".{name}" and (reached is None or id(mod.weight) in reached)
    ]


def _matches(entry: str, module: str) -> bool:
    """PEFT's list matching: the full name, or a ``.``-separated suffix of it."""
    return module == entry or module.endswith("." + entry)


def resolve_target_modules(model: torch.nn.Module, lora_cfg: Any) -> list[str]:
    """The full names of the modules that get adapters under ``policy.lora_cfg``; a target or exclusion that
    names no decoder linear layer of ``model`` is a :class:`ConfigError` listing the names that exist."""
    return _resolved_targets(model, lora_cfg)[0]


def _resolved_targets(model: torch.nn.Module, lora_cfg: Any) -> tuple[list[str], dict[str, str]]:
    """:func:`resolve_target_modules`'s modules, and the ones ``target_modules: null`` left out because PEFT would not
    adapt them as named (:func:`peft_left_out`, with why: :func:`check_lora_targets` warns of them)."""
    linear = decoder_linear_modules(model)
    if not linear:  # GPT-2 (Conv1D projections), Falcon and Bloom (blocks under transformer.h): an IndexError below
        raise ConfigError(
            f"policy.lora_cfg.enabled=true: {type(model).__name__} has no torch.nn.Linear layer in decoder blocks under "
            "'.layers.' (model.layers.N, as Llama, Qwen, Mistral and Gemma lay them out), the modules LoRA adapts here"
        )
    short = sorted({name.rsplit(".", 1)[-1] for name in linear})
    for key in ("target_modules", "exclude_modules"):
        for entry in getattr(lora_cfg, key) or []:
            if not any(_matches(entry, m) for m in linear):
                raise ConfigError(
                    f"policy.lora_cfg.{key}: {entry!r} is not a linear layer of the model's decoder blocks; "
                    f"its linear layers are {short} (or full paths such as {linear[0]!r})"
                )
    targets = lora_cfg.target_modules
    chosen = [m for m in linear if targets is None or any(_matches(t, m) for t in targets)]
    chosen = [m for m in chosen if not any(_matches(e, m) for e in lora_cfg.exclude_modules or [])]
    if not chosen:
        raise ConfigError("policy.lora_cfg.exclude_modules removes every module of policy.lora_cfg.target_modules: no adapter is left")
    if left_out := peft_left_out(model, chosen):
        if targets is not None:
            name, why = next(iter(left_out.items()))
            raise ConfigError(
                f"policy.lora_cfg.target_modules: {len(left_out)} of the named layers cannot take adapters as named (e.g. "
                f"{name!r}: {why}): leave them out with policy.lora_cfg.exclude_modules"
            )
        chosen = [m for m in chosen if m not in left_out]  # the default: check_lora_targets says which are left out
        if not chosen:
            raise ConfigError(
                f"policy.lora_cfg: no linear layer of the {model.config.model_type} model's decoder can take adapters as named"
            )
    return chosen, left_out


#: Why :func:`peft_left_out` leaves a layer out.
MOVED_ONTO_EXPERTS = (
    "PEFT on transformers 5 would put its adapters on the model's fused experts instead (it maps layers named like a "
    "transformers 4 expert projection onto them)"
)
REFUSED_FOR_MAMBA = "PEFT refuses adapters on a Mamba block's out_proj and conv1d"
NOT_A_PROJECTION = (
    "a torch.nn.Linear whose forward is no projection of a row (Llama 4's router returns scores and logits; DeepSeek-V4's "
    "grouped o_a_proj projects groups of its input): PEFT's wrapper adds a row's adapter output to it, and failed"
)


def not_a_projection(module: torch.nn.Module) -> bool:
    """Whether ``module``, a ``torch.nn.Linear`` subclass with a ``forward`` of its own, returns something else than one
    tensor of ``out_features`` values per row, or cannot take one row of ``in_features`` (probed with zeros on its own
    device, without gradients: a quantised projection such as BitNet's ``AutoBitLinear`` returns one and takes adapters;
    DeepSeek-V4's grouped ``o_a_proj`` reshapes its input into groups and cannot)."""
    if type(module).forward is torch.nn.Linear.forward:
        return False
    weight = module.weight
    try:
        with torch.no_grad():
            out = module(torch.zeros(1, module.in_features, dtype=weight.dtype, device=weight.device))
    except (RuntimeError, ValueError) as exc:  # a row of in_features it cannot take (DeepSeek-V4's grouped o_a_proj)
        if isinstance(exc, torch.OutOfMemoryError) or "CUDA" in str(exc):  # the device's, not the layer's: raised
            raise
        return True
    return not isinstance(out, torch.Tensor) or out.shape != (1, module.out_features)


def peft_left_out(model: torch.nn.Module, names: list[str]) -> dict[str, str]:
    """The ``names`` PEFT would not adapt as named, each with why (:func:`check_lora_targets` warns of them):

    * on a mixture of experts PEFT converts (Qwen2/3-MoE, Qwen3-Next, DeepSeek, Mixtral, ...), a layer named like a
      transformers 4 expert projection (``gate_proj``/``up_proj``/``down_proj``, Mixtral's ``w1``/``w2``/``w3``):
      PEFT maps it onto the fused expert parameters, whatever module it names (a shared expert's, a dense layer's),
      so that layer got no adapter, the experts did, and the first refit failed;
    * on a Mamba model (Mamba, Mamba2, FalconMamba, Falcon-H1, Nemotron-H), a block's ``out_proj`` and ``conv1d``:
      PEFT refuses them (in the policy actor, after Ray had started);
    * a ``torch.nn.Linear`` whose output is not a projection's (:func:`not_a_projection`).

    PEFT's own rules decide, one name at a time; a PEFT without them leaves nothing out."""
    try:
        from peft import LoraConfig
        from peft.tuners.tuners_utils import _check_lora_target_modules_mamba
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers, get_model_conversion_mapping
    except ImportError:
        return {}
    conversions = get_model_conversion_mapping(model)
    modules = dict(model.named_modules())
    left_out = {}
    for name in names:
        if not_a_projection(modules[name]):
            left_out[name] = NOT_A_PROJECTION
            continue
        config = LoraConfig(target_modules=[name])
        try:
            _check_lora_target_modules_mamba(config, model, name.rsplit(".", 1)[-1])
        except ValueError:
            left_out[name] = REFUSED_FOR_MAMBA
            continue
        try:
            convert_peft_config_for_transformers(config, model, conversions)
        except ValueError:  # "cannot convert gate_proj without also targeting up_proj": it converts it with up_proj
            left_out[name] = MOVED_ONTO_EXPERTS
            continue
        if name not in (config.target_modules or ()):
            left_out[name] = MOVED_ONTO_EXPERTS
    return left_out


def peft_config(lora_cfg: Any, targets: list[str]):
    """The ``peft.LoraConfig`` of ``policy.lora_cfg`` over the resolved ``targets`` (full module names)."""
    from peft import LoraConfig

    return LoraConfig(r=lora_cfg.dim, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout, target_modules=targets, bias="none")


def apply_lora(model: torch.nn.Module, lora_cfg: Any) -> torch.nn.Module:
    """Wrap ``model`` in a ``PeftModel`` with fresh adapters (``lora_B`` = 0: the adapted model starts equal to
    the base); only the adapter parameters require gradients. Seed torch first for identical adapters."""
    from peft import get_peft_model

    targets = resolve_target_modules(model, lora_cfg)
    wrapped = get_peft_model(model, peft_config(lora_cfg, targets))
    adapted = sorted(
        name.removeprefix(_PEFT_PREFIX) for name, module in wrapped.named_modules() if hasattr(module, "lora_A") and module.lora_A
    )
    if adapted != sorted(targets):  # PEFT moved or added a target (resolve_target_modules keeps those out)
        raise RuntimeError(f"PEFT adapted {sorted(set(adapted) ^ set(targets))[:4]} against the resolved targets")
    return wrapped


def scaling(lora_cfg: Any) -> float:
    """``alpha / dim``: the factor of ``B @ A`` in the adapted weight."""
    return float(lora_cfg.alpha) / float(lora_cfg.dim)


def is_adapter(name: str) -> bool:
    """Whether a parameter / state-dict name is a LoRA adapter tensor."""
    return ".lora_A." in name or ".lora_B." in name


def untrained_extra_adapters(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> list[str]:
    """The names in ``saved`` (model state-dict names) of adapters on modules ``model`` does not adapt whose ``lora_B``
    is all zero (as initialised: they never had a gradient). Checkpoints written before a multimodal model's vision
    tower was left out of the targets (:func:`decoder_linear_modules`) hold such adapters: they change nothing."""
    own = set(model.state_dict())
    extra: dict[str, list[str]] = {}
    for name in saved:
        if is_adapter(name) and name not in own:
            extra.setdefault(name.split(".lora_")[0], []).append(name)
    untrained = []
    for names in extra.values():
        if all(not torch.count_nonzero(saved[n]) for n in names if ".lora_B." in n) and any(".lora_B." in n for n in names):
            untrained += names
    return sorted(untrained)


def saved_name(name: str) -> str:
    """PEFT's saved name of an adapter tensor (the adapter name removed): ``...lora_A.default.weight`` -> ``...lora_A.weight``."""
    return name.replace(f".{ADAPTER_NAME}.", ".")


def model_name(saved: str) -> str:
    """The inverse of :func:`saved_name`: the model's state-dict name of a saved adapter tensor."""
    for part in ("lora_A", "lora_B"):
        saved = saved.replace(f".{part}.weight", f".{part}.{ADAPTER_NAME}.weight")
    return saved


def adapter_config_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The adapter's ``adapter_config.json`` content (JSON-ready), for a causal LM (``task_type``: PEFT's
    ``AutoPeftModelForCausalLM`` needs it). A base model loaded from a relative local path is
    recorded absolute: read back from another directory (``nemo-like merge``, ``eval``, ``serve``) the relative path
    named another model there, or a hub id."""
    import json

    config = model.peft_config[ADAPTER_NAME]
    content = json.loads(json.dumps(config.to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)))
    content["task_type"] = content.get("task_type") or "CAUSAL_LM"  # PEFT's auto classes read it (our adapters' model)
    base = content.get("base_model_name_or_path")
    if isinstance(base, str) and looks_like_path(base) and Path(base).expanduser().exists():
        content["base_model_name_or_path"] = str(Path(base).expanduser().resolve())
    return content


def write_adapter(directory: str | Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    """Write a PEFT adapter directory (``adapter_model.safetensors`` under saved names + ``adapter_config.json``)."""
    import json

    from safetensors.torch import save_file

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    return path


@dataclass
class _Pending:
    """One adapted linear layer's tensors while its merge waits for the rest of them."""

    weight: torch.Tensor | None = None
    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None


def merged_tensors(named: Iterable[tuple[str, torch.Tensor]], scale: float) -> Iterator[tuple[str, torch.Tensor]]:
    """Turn a PeftModel's ``(name, tensor)`` stream (state-dict order) into the plain model's, under HF names:
    each adapted ``W`` becomes ``W + scale * B @ A`` (computed in float32, cast back). Streams: a layer is
    emitted as soon as its base weight and both factors have passed."""
    pending: dict[str, _Pending] = {}
    for name, tensor in named:
        name = name.removeprefix(_PEFT_PREFIX)
        if ".base_layer." in name or is_adapter(name):
            module, _, leaf = (
                name.partition(".base_layer.")
                if ".base_layer." in name
                else name.partition(".lora_A." if ".lora_A." in name else ".lora_B.")
            )
            if ".base_layer." in name and leaf != "weight":
                yield f"{module}.{leaf}", tensor  # the bias is not adapted
                continue
            part = pending.setdefault(module, _Pending())
            if ".base_layer." in name:
                part.weight = tensor
            elif ".lora_A." in name:
                part.lora_a = tensor
            else:
                part.lora_b = tensor
            if part.weight is not None and part.lora_a is not None and part.lora_b is not None:
                del pending[module]
                yield f"{module}.weight", merge_weight(part.weight, part.lora_a, part.lora_b, scale)
            continue
        yield name, tensor
    if pending:
        raise RuntimeError(f"incomplete LoRA layers in the weight stream: {sorted(pending)}")


def merge_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + scale * B @ A``; an empty ``weight`` (a rank that keeps nothing) stays empty."""
    if weight.numel() == 0:
        return weight
    return (weight.float() + scale * (lora_b.float() @ lora_a.float())).to(weight.dtype)


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """``trainable`` and ``total`` parameters of the full model (global sizes, also when sharded), and
    ``full_refit_elements``: what a full or merged refit sends, in elements (every state-dict entry but the adapters,
    tied weights once: they travel as one tensor; counted in elements because a LoRA policy's frozen base is held in
    the compute dtype, a full policy's in fp32)."""
    total = trainable = 0
    for p in model.parameters():
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    entries = {id(t): t for n, t in model.state_dict(keep_vars=True).items() if not is_adapter(n)}  # tied: one object
    sent = sum(t.numel() for t in entries.values())
    return {"trainable": trainable, "total": total, "full_refit_elements": sent}


def refit_bytes(trainable_params: int, full_refit_elements: int, precision: str) -> dict[str, int]:
    """What one refit sends (:mod:`nemo_like.models.policy.weight_export`): ``adapter``, the adapters in fp32 (as PEFT
    keeps them); ``full``, the whole (merged) model (``full_refit_elements``, as :func:`parameter_counts` counts them)
    in the engine's dtype."""
    return {"adapter": trainable_params * torch.float32.itemsize, "full": full_refit_elements * refit_dtype(precision).itemsize}


def expected_adapter_names(model_path: str, lora_cfg: Any) -> list[str]:
    """The saved adapter names a policy with ``lora_cfg`` exports for the model at ``model_path`` (from a
    meta-device skeleton: the generation side's refit manifest)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        skeleton = apply_lora(AutoModelForCausalLM.from_config(config), lora_cfg)
    return sorted(saved_name(k) for k in skeleton.state_dict() if is_adapter(k))


def check_lora_targets(model_name: str, lora_cfg: Any, local_only: bool = False) -> list[str]:
    """Resolve the targets against the model's architecture before any actor starts (a meta-device skeleton of
    :func:`~nemo_like.models.loading.model_config`'s config; ``local_only`` as there); returns the adapted module names.
    A bad key is a :class:`ConfigError`."""
    skeleton = meta_skeleton(model_name, local_only)
    chosen, left_out = _resolved_targets(skeleton, lora_cfg)
    routed, experts = experts_of(skeleton)
    adapted_experts = any(".experts." in name for name in chosen)  # one linear layer per expert (a ModuleList)
    if routed and not adapted_experts:  # transformers fuses them into [experts, out, in] parameters: no linear layer
        warnings.warn(
            f"policy.lora_cfg: {model_name}'s {experts} routed experts per layer ({routed:,} parameters in all) get no adapters "
            "(fused expert parameters, no linear layers): LoRA adapts the linear layers around them "
            f"({len(chosen)} modules, e.g. {chosen[0].rsplit('.', 2)[-2]}.{chosen[0].rsplit('.', 1)[-1]}), the experts stay frozen",
            RuntimeWarning,
            stacklevel=2,
        )
    for why in dict.fromkeys(left_out.values()):  # what the user excluded is not among them: no warning for it
        kinds = sorted({".".join(name.split(".")[-2:]) for name, reason in left_out.items() if reason == why})
        count = sum(reason == why for reason in left_out.values())
        warnings.warn(
            f"policy.lora_cfg: {count} linear layers of {model_name} get no adapters ({', '.join(kinds[:4])}"
            f"{', ...' if len(kinds) > 4 else ''}): {why}",
            RuntimeWarning,
            stacklevel=2,
        )
    for entry in exclusions_without_effect(skeleton, lora_cfg):
        warnings.warn(
            f"policy.lora_cfg.exclude_modules: {entry!r} has no effect: it names no module of policy.lora_cfg.target_modules="
            f"{lora_cfg.target_modules}",
            RuntimeWarning,
            stacklevel=2,
        )
    return chosen


def same_adapted_modules(model_name: str, lora_cfg: Any, other: Any) -> bool:
    """Whether two ``policy.lora_cfg`` resolve to the same modules of model ``model_name`` (one meta-device skeleton;
    a bad key in either is a :class:`ConfigError`)."""
    skeleton = meta_skeleton(model_name)
    return sorted(resolve_target_modules(skeleton, lora_cfg)) == sorted(resolve_target_modules(skeleton, other))


def exclusions_without_effect(model: torch.nn.Module, lora_cfg: Any) -> list[str]:
    """The ``exclude_modules`` entries that remove none of the targeted modules (an ablation that changed
    ``target_modules`` and left an exclusion behind)."""
    targets = lora_cfg.target_modules
    targeted = [m for m in decoder_linear_modules(model) if targets is None or any(_matches(t, m) for t in targets)]
    return [e for e in lora_cfg.exclude_modules or [] if not any(_matches(e, m) for m in targeted)]


def refuse_overwriting_base(target: Path, adapter_dir: str | Path, key: str, base_model: str | None = None) -> None:
    """A :class:`ConfigError` naming ``key`` when a merge into ``target`` would overwrite the base model the adapters of
    ``adapter_dir`` apply to (``base_model``, else their ``adapter_config.json``'s) when that is a local directory: every
    later merge of them applied the adapters twice. Nothing when ``adapter_dir`` holds no adapters."""
    if not (Path(adapter_dir) / ADAPTER_CONFIG).is_file():
        return
    base = Path(resolve_model_path(base_model or adapter_base_model(adapter_dir)))
    if base.is_dir():
        refuse_overwriting(target, base, key, "the base model the adapters apply to")


def merge_checkpoint(
    adapter_dir: str | Path,
    output_dir: str | Path,
    base_model: str | None = None,
    tokenizer: str | None = None,
    precision: str = "float32",
    replace: bool = False,
) -> Path:
    """Write a plain HF model directory for serving (merged weights, config, generation config, and the tokenizer
    of ``tokenizer``, else the checkpoint's own (the run's, saved beside the adapters), else the base model's) from a
    LoRA adapter directory (a checkpoint's ``policy/``); returns ``output_dir``.

    The generation config's ``eos_token_id`` lists the ids the run stopped on (the tokenizer's eos and the base's
    generation-config eos: :func:`~nemo_like.models.loading.end_of_sequence_ids`, and the run's
    ``policy.generation.stop_token_ids``: :func:`checkpoint_stop_token_ids`), so ``generate`` stops where the trained
    policy did. The tokenizer is loaded before anything is written, and everything is written into a temporary
    sibling of ``output_dir``, fsynced and renamed into place (an empty ``output_dir`` is replaced; ``replace``: a filled
    one too, as ``nemo-like eval`` rerun into one output directory replaces its ``merged_model``): a failure or an
    interrupt leaves no partial ``output_dir`` and removes the temporary directory. An empty ``output_dir`` that is a
    mount point (or on another filesystem than its parent) is written in place: no rename reaches it."""
    check_adapter_dir(adapter_dir)
    base = base_model or adapter_base_model(adapter_dir)
    own = holds_tokenizer(adapter_dir)
    tokenizer_source = tokenizer or (str(adapter_dir) if own else base)
    if tokenizer is not None or not own:  # a source not here fails in one line (it went to the hub as a repo id)
        check_model_source(tokenizer_source, "--tokenizer" if tokenizer is not None else _base_key(adapter_dir, base_model))
    _check_tokenizer_source(tokenizer_source, tokenizer is not None, adapter_dir)
    run_tokenizer = load_tokenizer(tokenizer_source)
    merged = load_merged(adapter_dir, precision, base_model)
    merged.config.use_cache = True
    stop_ids = list(dict.fromkeys([*end_of_sequence_ids(run_tokenizer, base), *checkpoint_stop_token_ids(adapter_dir)]))
    merged.generation_config.eos_token_id = stop_ids[0] if len(stop_ids) == 1 else stop_ids

    def write(directory: Path) -> None:
        from transformers import GenerationConfig

        generation, merged.generation_config = merged.generation_config, GenerationConfig()
        try:  # save_pretrained validates the generation config: a base's own that sets temperature without do_sample
            merged.save_pretrained(directory)
        finally:
            merged.generation_config = generation
        save_generation_config(generation, directory)  # written as it is, with the run's stop ids
        run_tokenizer.save_pretrained(directory)

    return _save_directory_atomically(Path(output_dir), write, replace)


def checkpoint_stop_token_ids(adapter_dir: str | Path) -> list[int]:
    """The run's ``policy.generation.stop_token_ids``, from the ``config.yaml`` of the checkpoint step holding
    ``adapter_dir`` (its ``policy/``); none for an adapter directory outside a checkpoint."""
    import yaml

    try:
        saved = yaml.safe_load((Path(adapter_dir).parent / "config.yaml").read_text(encoding="utf-8"))
        ids = saved["policy"]["generation"].get("stop_token_ids") or []
        return [int(i) for i in ids]
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError, AttributeError):
        return []


def _fill_in_place(target: Path, final: Path, write: Callable[[Path], None], replace: bool) -> Path:
    """:func:`_save_directory_atomically` for a ``final`` no rename reaches (a mount point, another filesystem than its
    parent's): ``write`` into a hidden directory inside it, move the old entries (with ``replace``) into another, the
    new ones up, and remove the old ones last. Any failure puts the old entries back and removes the new ones. A fresh
    volume's ``lost+found`` and this function's own leftovers are not the directory's contents."""
    import os
    import shutil

    from nemo_like.utils.checkpoint import fsync_tree
    from nemo_like.utils.files import fsync_dir, partial_path

    _recover_leftovers(final)
    stage, aside = partial_path(final / "merged"), partial_path(final / "replaced")
    existing = _contents(final)
    if existing and not replace:
        raise ConfigError(f"{target} is not empty; merge into a new directory (or remove this one first)")
    moved: list[Path] = []
    try:
        stage.mkdir()
        write(stage)
        fsync_tree(stage)
        aside.mkdir()
        for path in existing:
            os.rename(path, aside / path.name)
        for path in list(stage.iterdir()):
            os.rename(path, final / path.name)
            moved.append(final / path.name)
    except BaseException as exc:
        for path in moved:
            with contextlib.suppress(OSError):  # the old entries go back whatever the new ones do
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        for path in list(aside.iterdir()) if aside.is_dir() else []:
            os.rename(path, final / path.name)
        shutil.rmtree(stage, ignore_errors=True)
        shutil.rmtree(aside, ignore_errors=True)
        if problem := write_problem(exc):
            raise cannot_write(target, problem) from None
        raise
    stage.rmdir()
    shutil.rmtree(aside, ignore_errors=True)
    fsync_dir(final)
    return target


def _contents(final: Path) -> list[Path]:
    """What ``final`` holds besides a fresh volume's ``lost+found`` and :func:`_fill_in_place`'s own hidden directories."""
    from nemo_like.utils.files import partial_owner

    return [p for p in final.iterdir() if p.name != "lost+found" and all(partial_owner(p.name, k) is None for k in ("merged", "replaced"))]


def _recover_leftovers(final: Path) -> None:
    """What a killed :func:`_fill_in_place` left in ``final`` (its process gone): a new model's hidden stage is removed;
    the old entries moved aside come back when ``final`` holds nothing else (it was killed before the new ones moved
    up), else (they were replaced) they are removed."""
    import shutil

    from nemo_like.utils.files import partial_owner, process_gone

    for path in list(final.iterdir()):
        for kind in ("merged", "replaced"):
            pid = partial_owner(path.name, kind)
            if pid is None:
                continue
            if not process_gone(pid):
                break  # its process runs (another merge's): not a leftover
            if kind == "replaced" and not _contents(final):
                for entry in list(path.iterdir()):
                    entry.rename(final / entry.name)
            shutil.rmtree(path, ignore_errors=True)


def _base_key(adapter_dir: str | Path, base_model: str | None) -> str:
    """The name of the setting the base model of a merge came from, as :func:`load_merged` names it."""
    return (
        "--base-model"
        if base_model is not None
        else f"{Path(adapter_dir) / ADAPTER_CONFIG} base_model_name_or_path (override it with --base-model)"
    )


def _check_tokenizer_source(source: str, given: bool, adapter_dir: str | Path) -> None:
    """A one-line :class:`ConfigError` naming ``--tokenizer`` when the tokenizer ``source`` the merge ships is a local
    directory without one (``given``: it came from ``--tokenizer``; else it is the base model's, the checkpoint
    ``adapter_dir`` holding none), before anything is loaded or written."""
    path = Path(resolve_model_path(source)).expanduser()
    if not path.is_dir() or holds_tokenizer(path):
        return
    if given:
        raise ConfigError(f"--tokenizer {source} holds no tokenizer (none of {list(TOKENIZER_FILES)})")
    raise ConfigError(
        f"{adapter_dir} holds no tokenizer (a checkpoint written before 2026-12-04) and neither does its base model "
        f"{source} (none of {list(TOKENIZER_FILES)}): name the run's tokenizer with --tokenizer (its policy.tokenizer_name, "
        "else its policy.model_name)"
    )


def cannot_write(target: Path, problem: str) -> ConfigError:
    """The error of a merged model ``target`` the filesystem refused (:func:`write_problem`)."""
    return ConfigError(f"{target}: cannot write the merged model ({problem}); nothing of it was left")


def write_problem(exc: BaseException) -> str | None:
    """Why writing a model failed, when ``exc`` is a filesystem's refusal (a read-only or full one; safetensors reports
    its own I/O errors as ``SafetensorError``); None for anything else."""
    from safetensors import SafetensorError

    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    if isinstance(exc, SafetensorError) and "I/O error" in str(exc):
        return str(exc).split("I/O error: ", 1)[-1]
    return None


def _save_directory_atomically(target: Path, write: Callable[[Path], None], replace: bool = False) -> Path:
    """``write(tmp)`` into a temporary sibling directory of ``target`` (:func:`~nemo_like.utils.files.partial_path`),
    fsync it, rename it to ``target`` and fsync the parent; returns ``target``. ``target`` must be absent or an empty
    directory, or (``replace``) a filled one, moved aside first and removed once the new one is in place. On any
    failure, an interrupt included, the temporary directory is removed and ``target`` is left as it was. A symlinked
    ``target`` is filled at the link's target, as :func:`~nemo_like.utils.files.replace_file` does; an empty one no
    rename can reach (a mount point, another filesystem than its parent's) is written in place."""
    import os
    import shutil

    from nemo_like.utils.checkpoint import fsync_tree
    from nemo_like.utils.files import fsync_dir, partial_path, remove_dead_partial_dirs

    final = Path(os.path.realpath(target))  # the rename stays on the target's filesystem
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise cannot_write(target, write_problem(exc)) from None
    if final.is_dir() and (os.path.ismount(final) or final.stat().st_dev != final.parent.stat().st_dev):
        return _fill_in_place(target, final, write, replace)  # no rename reaches it
    tmp, old = partial_path(final), None
    try:
        tmp.mkdir()
        write(tmp)
        fsync_tree(tmp)
        if replace and final.is_dir() and any(final.iterdir()):
            old = partial_path(final)
            os.rename(final, old)
        try:
            os.rename(tmp, final)  # replaces an empty directory; refused (ENOTEMPTY / EEXIST) for a filled one
        except OSError as exc:
            raise ConfigError(f"{target}: cannot move the merged model into place ({exc.strerror}); merge into a new directory") from None
        fsync_dir(final.parent)
    except BaseException as exc:  # an interrupt between the two renames too: the old model goes back
        if old is not None and not final.exists():
            os.rename(old, final)
            old = None
        shutil.rmtree(tmp, ignore_errors=True)
        if problem := write_problem(exc):  # a read-only or full filesystem: one line, not a traceback
            raise cannot_write(target, problem) from None
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    remove_dead_partial_dirs(final)  # an earlier merge's, killed mid-write: a hidden full-size copy
    return target
