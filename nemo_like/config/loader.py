"""Load a recipe YAML with ``defaults:`` inheritance and OmegaConf interpolation.

Inheritance rules:
* ``defaults:`` is a string or a list of parent files, relative to the child file; parents are
  merged in order and the child last ("later wins").
* A mapping that contains ``_override_: true`` replaces the parent's mapping instead of merging.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from pydantic import BaseModel

from nemo_like.config.errors import ConfigError

_OVERRIDE_MARKER = "_override_"


class RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, fixed for recipes: ``1e-4`` is a float (YAML 1.2, as OmegaConf and command-line overrides
    read it; YAML 1.1 wants a dot, so ``lr: 1e-4`` was the string '1e-4'); ISO times and base-60 numbers stay text (the
    implicit resolvers below); and a key given twice in one mapping is an error naming both lines (YAML 1.1 lets the
    later one win silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<' merge keys may be overridden by later keys
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (first at line {seen[key]})", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


# Implicit types: YAML 1.1's, less two that surprise in a recipe. A timestamp ('save_before: 2026-12-02T18:00:00')
# became a datetime OmegaConf cannot hold (a traceback); it stays the text the key's own parser reads. Base-60 numbers
# ('18:00:00' = 64800) go too: such a value stays text, which the key then refuses.
_DROPPED_TAGS = {"tag:yaml.org,2002:timestamp", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"}
RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _DROPPED_TAGS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^[-+]?(?:0b[0-1_]+|0o[0-7_]+|0x[0-9a-fA-F_]+|[0-9][0-9_]*)$"),
    list("-+0123456789"),
)


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """An int as overrides read it: ``010`` is ten (YAML 1.1 read a leading 0 as octal: ``seed: 0042`` was 34);
    ``0b``/``0o``/``0x`` keep their bases."""
    text = str(loader.construct_scalar(node)).replace("_", "")
    sign, digits = (-1, text[1:]) if text.startswith("-") else (1, text.lstrip("+"))
    return sign * int(digits, 0 if digits[:2].lower() in ("0b", "0o", "0x") else 10)


RecipeLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)[eE][-+]?[0-9]+
        |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),  # YAML 1.1's forms (less base 60), and 1e-4 / 5E3 / 2.5e2: exponents need no dot or sign (YAML 1.2)
    list("-+0123456789."),
)


def register_resolvers() -> None:
    """Register the ``mul``, ``add``, ``div`` and ``max`` interpolation resolvers (idempotent). Their arguments are
    numbers: a quoted one (``num_prompts_per_step: "4"``) is read as its number (``mul`` repeated the text: 8 x '4' was
    '44444444'); other text is an error naming it; a boolean is left to the schema (an error naming its key)."""
    resolvers = {
        "mul": lambda *xs: _fold(lambda a, b: a * b, _numbers("mul", xs)),
        "add": lambda *xs: _fold(lambda a, b: a + b, _numbers("add", xs)),
        "div": lambda a, b: _numbers("div", (a,))[0] / _numbers("div", (b,))[0],
        "max": lambda *xs: max(_numbers("max", xs)),
    }
    for name, fn in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def _numbers(resolver: str, values: tuple[Any, ...]) -> list[int | float]:
    numbers: list[int | float] = []
    for value in values:
        if isinstance(value, str):  # anything else is left to the schema (a boolean: an error naming its key)
            try:
                value = int(value.strip().replace("_", ""))
            except ValueError:
                try:
                    value = float(value.strip())
                except ValueError:
                    raise ValueError(f"${{{resolver}:...}} takes numbers, got the text {value!r}") from None
        numbers.append(value)
    return numbers


def _fold(op, xs):
    result = xs[0]
    for x in xs[1:]:
        result = op(result, x)
    return result


def recipe_yaml(resolved: dict[str, Any]) -> str:
    """A resolved recipe as YAML, in its keys' order and with non-ASCII text as written (a path or a prompt in French
    or Chinese read ``"/Users/Jos\\xE9"`` in ``config.yaml`` and ``--dry-run``); write it as UTF-8."""
    return yaml.safe_dump(resolved, sort_keys=False, allow_unicode=True)


def read_yaml_file(path: Path) -> dict[str, Any]:
    """Parse one YAML file into a dict; errors name the file and the line."""
    if path.is_dir():
        recipes = sorted(p.name for p in path.glob("*.yaml"))
        listed = f": {', '.join(recipes[:12])}{', ...' if len(recipes) > 12 else ''}" if recipes else " (it holds no *.yaml)"
        raise ConfigError(f"Recipe {path} is a directory, not a recipe file; pick one of its files{listed}")
    if not path.is_file():
        raise ConfigError(f"Recipe file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"Recipe {path} is not UTF-8 text (byte {exc.start}: {exc.reason}); save it as UTF-8") from None
    except OSError as exc:  # not readable by this user
        raise ConfigError(f"Cannot read recipe {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.load(text, Loader=RecipeLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"Invalid YAML in {path}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"Recipe {path} must be a YAML mapping at the top level, got {type(data).__name__}")
    return data


def merge_dicts(
    base: dict[str, Any], child: dict[str, Any], source: str = "the recipe", sections: frozenset[str] = frozenset(), prefix: str = ""
) -> dict[str, Any]:
    """Deep-merge ``child`` (from ``source``, named in errors) into ``base`` (child wins); honour ``_override_: true``
    sections. A value that is neither a mapping nor an interpolation for one of ``sections`` (dotted keys: the
    schema's, :func:`schema_sections`) is a ConfigError: a section left empty (``grpo:`` with its keys commented out,
    YAML's null) had dropped every key before it, and the error came later, from an interpolation elsewhere or a
    default environment."""
    merged = dict(base)
    for key, value in child.items():
        if isinstance(value, dict):
            value = dict(value)
            replace = value.pop(_OVERRIDE_MARKER, False)
            if not isinstance(replace, bool):  # bool("false") is True: the parent's section was dropped
                raise ConfigError(f"'{key}.{_OVERRIDE_MARKER}' must be true or false, got {replace!r}")
            if not replace and isinstance(merged.get(key), dict):
                merged[key] = merge_dicts(merged[key], value, source, sections, f"{prefix}{key}.")
            else:
                merged[key] = _strip_markers(value)
        else:
            if f"{prefix}{key}" in sections and not is_interpolation(value):
                written = "is empty (null)" if value is None else f"is {value!r}, not a mapping"
                raise ConfigError(
                    f"{source}: '{prefix}{key}' {written}, which would drop the whole section the recipes before it "
                    f"give (its defaults included): give it keys, remove the line, or write '{key}: {{}}' to keep them"
                )
            merged[key] = value
    return merged


def is_interpolation(value: Any) -> bool:
    """Whether ``value`` is an OmegaConf interpolation (``${data.train}``), resolved later."""
    return isinstance(value, str) and value.lstrip().startswith("${")


def schema_sections(model: type[BaseModel], prefix: str = "") -> frozenset[str]:
    """The dotted keys of ``model`` that hold a mapping of keys: at the top level every field (``env`` too, a mapping of
    environments), below it the fields that are models themselves."""
    found: set[str] = set()
    for name, field in model.model_fields.items():
        nested = isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        if nested or not prefix:
            found.add(prefix + name)
        if nested:
            found |= schema_sections(field.annotation, f"{prefix}{name}.")
    return frozenset(found)


def _strip_markers(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_markers(v) for k, v in value.items() if k != _OVERRIDE_MARKER}
    return value


def load_recipe_dict(path: str | Path, sections: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Load ``path`` and its ``defaults:`` parents into one plain dict (interpolations unresolved): every file of the
    chain once, parents before the files that name them (depth first, in the order listed), each merged over what
    came before. Two parents sharing a base apply it once: loaded with each parent, the second copy of the base had
    undone the first parent's keys (a LoRA recipe's lr reverted by an async recipe that never set it)."""
    merged: dict[str, Any] = {}
    for source, data in _linearized(Path(path).resolve(), (), set()):
        merged = merge_dicts(merged, data, str(source), sections)
    return merged


def _linearized(path: Path, chain: tuple[Path, ...], seen: set[Path]) -> list[tuple[Path, dict[str, Any]]]:
    """The own keys of ``path`` and of every parent it names (not already in ``seen``), each with its file, parents
    first."""
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise ConfigError(f"Cyclic 'defaults:' inheritance: {cycle}")
    data = read_yaml_file(path)
    parents = data.pop("defaults", None)
    if parents is None:
        parents = []
    elif isinstance(parents, str):
        parents = [parents]
    elif not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ConfigError(f"{path}: 'defaults' must be a file name or a list of file names, got {parents!r}")
    ordered: list[tuple[Path, dict[str, Any]]] = []
    for parent in parents:
        parent_path = (path.parent / parent).resolve()
        if not parent_path.is_file():
            raise ConfigError(
                f"{path}: defaults names {parent!r}, which is not a file ({parent_path}); a parent is relative to the recipe naming it"
            )
        ordered += _linearized(parent_path, (*chain, path), seen)
    if path in seen:
        return ordered
    seen.add(path)
    return [*ordered, (path, data)]
