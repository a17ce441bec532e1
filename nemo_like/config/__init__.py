"""Recipe loading: YAML + defaults inheritance -> Hydra overrides -> interpolation -> validation."""

from __future__ import annotations

import re
import sys
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError

from nemo_like.config.errors import ConfigError, did_you_mean
from nemo_like.config.loader import load_recipe_dict, merge_dicts, register_resolvers, schema_sections
from nemo_like.config.overrides import apply_overrides
from nemo_like.config.schema import MasterConfig

# The embedded default recipe lives with the other recipes (the package is installed editable).
DEFAULT_RECIPE = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_tiny_cpu.yaml"

#: The recipe's sections (dotted keys that hold a mapping of keys), which only a mapping or an interpolation may set.
SECTIONS = schema_sections(MasterConfig)

__all__ = ["ConfigError", "MasterConfig", "load_config", "resolve_config_dict", "DEFAULT_RECIPE"]


def resolve_config_dict(path: str | Path | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Load ``path`` (the embedded default when ``None``), apply overrides, resolve interpolations.

    The recipe is laid over the schema's defaults first, so ``key=value`` works for every key the
    schema knows even when the recipe does not spell it out; ``+key`` is for keys outside the schema.
    """
    register_resolvers()
    given = overrides
    overrides = [] if isinstance(given, (str, bytes, Mapping)) else list(given or ())  # a generator is read once, here
    if isinstance(given, (str, bytes, Mapping)) or not all(isinstance(o, str) for o in overrides):
        raise TypeError(f"overrides must be a list of 'key=value' strings, e.g. ['grpo.max_num_steps=2']; got {given!r}")
    if path is None and not DEFAULT_RECIPE.is_file():  # a non-editable install: the recipes stay in the repository
        raise ConfigError(
            "No recipe given, and the embedded default recipe (examples/configs/grpo_tiny_cpu.yaml) is not next to this "
            f"installed package ({DEFAULT_RECIPE.parent.parent.parent}): pass --config FILE (the repository's "
            "examples/configs/ has the shipped recipes), or install nemo_like editable from a clone (make setup)"
        )
    recipe_path = Path(path).expanduser() if path is not None else DEFAULT_RECIPE
    recipe = load_recipe_dict(recipe_path, SECTIONS)
    cfg = OmegaConf.create(merge_dicts(MasterConfig().model_dump(mode="json"), recipe))
    apply_overrides(cfg, overrides, SECTIONS)
    try:
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise ConfigError(f"Cannot resolve interpolation: {exc}{interpolation_inputs(cfg, getattr(exc, 'full_key', None))}") from None


def interpolation_inputs(cfg: DictConfig, key: str | None) -> str:
    """A line naming what ``key``'s interpolation reads: the keys it references and their values as written, so a bad
    value set on another key (``grpo.num_prompts_per_step=abc`` read by ``${mul:...}``) is found by its own name."""
    if not key:
        return ""
    try:
        expression = _raw_value(cfg, key)
        refs = dict.fromkeys(re.findall(r"\$\{([A-Za-z_][\w.]*)\}", str(expression)))
        values = {ref: _raw_value(cfg, ref) for ref in refs}
    except (OmegaConfBaseException, AttributeError, KeyError):
        return ""
    if not values:
        return ""
    shown = ", ".join(f"{ref} = {value!r}" for ref, value in values.items())
    return f"\n    {key}: {expression} reads {shown}"


def _raw_value(cfg: DictConfig, dotted: str) -> Any:
    """The value of ``dotted`` as written (an interpolation stays its text); AttributeError where there is none."""
    node: Any = cfg
    for part in dotted.split("."):
        node = node._get_node(part)
    return node._value()


def load_config(path: str | Path | None, overrides: Sequence[str] = (), warn: bool = True) -> MasterConfig:
    """Return the validated :class:`MasterConfig`; user mistakes raise :class:`ConfigError`.

    Options that are set but have no effect are not errors: with ``warn`` each is printed to stderr
    as one ``[config] warning: ...`` line (``nemo-like train`` and ``--dry-run`` both load here).
    """
    raw = resolve_config_dict(path, overrides)
    try:
        cfg = MasterConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None
    if warn:
        for line in cfg.no_effect_warnings():
            print(f"[config] warning: {line}", file=sys.stderr, flush=True)
    return cfg


def _walk(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[Any, list[str]]:
    """The annotation ``loc`` leads to through ``model``'s fields, and the parts of ``loc`` walked (up to the first
    that names no field)."""
    current: Any = model
    walked: list[str] = []
    for part in loc:
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            break
        current = field.annotation
        walked.append(str(part))
    return current, walked


def _field_names(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Dotted names of the fields of the section that ``loc`` points into (for suggestions)."""
    section, prefix = _walk(model, loc[:-1])
    return [".".join([*prefix, name]) for name in getattr(section, "model_fields", {})]


def _takes_null(model: type[BaseModel], loc: tuple[Any, ...]) -> bool:
    """Whether the field ``loc`` points at accepts null (its annotation holds ``None``)."""
    annotation, walked = _walk(model, loc)
    return len(walked) == len(loc) and type(None) in typing.get_args(annotation)


def format_validation_error(exc: ValidationError) -> str:
    """One line per problem, each naming the dotted key, what was expected and what was given."""
    lines = ["Invalid configuration:"]
    for err in exc.errors():
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        if err["type"] == "extra_forbidden" and "." in str(loc[-1]) and not isinstance(loc[-1], int):
            head, rest = str(loc[-1]).split(".", 1)
            lines.append(
                f"  {key}: '{loc[-1]}' is one recipe key with dots in its name; a recipe nests its keys ({head}: then "
                f"{rest}: indented under it). Dotted keys are for command-line overrides."
            )
        elif err["type"] == "extra_forbidden":
            hint = did_you_mean(key, _field_names(MasterConfig, loc))
            lines.append(f"  {key}: unknown key.{hint}")
        elif err["type"] == "value_error":
            lines.append(f"  {err['msg'].removeprefix('Value error, ')}")
        else:
            given = err.get("input")
            # YAML and overrides spell null 'null' or '~'; 'None' is text (a nullable number said only "not a number")
            none_text = isinstance(given, str) and given.strip().lower() == "none" and err["type"] != "none_text"
            none_text = none_text and _takes_null(MasterConfig, loc)
            hint = "; write null (or ~) for no value" if none_text else ""
            lines.append(f"  {key}: {err['msg']} (got {given!r}){hint}")
    return "\n".join(lines)
