"""Apply command-line overrides written in Hydra's grammar to a recipe.

* ``a.b=1``   changes an existing key (error, with a suggestion, if it does not exist)
* ``+a.c=2``  adds a new key (error if it already exists)
* ``++a.b=3`` adds or overwrites
* ``~a.d``    deletes a key (``~a.d=value`` deletes only if the current value matches)

A sweep (``a=1,2``, ``range()``, ``choice()``) is an error: quote a value with a comma (``a='x, y'``).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from nemo_like.config.errors import ConfigError, closest_keys, did_you_mean
from nemo_like.config.loader import is_interpolation

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override

_MISSING = object()


def leaf_keys(cfg: DictConfig, prefix: str = "") -> Iterator[str]:
    """Yield every dotted key (mappings and leaves) of ``cfg`` without resolving interpolations."""
    for key in cfg.keys():
        dotted = f"{prefix}{key}"
        yield dotted
        node = cfg._get_node(key)  # noqa: SLF001 - raw node, so interpolations stay unresolved
        if isinstance(node, DictConfig):
            yield from leaf_keys(node, dotted + ".")


def _raw_node(cfg: DictConfig, key: str) -> Any:
    """The node of ``key`` in ``cfg`` (``_MISSING`` where there is none), read from the raw nodes: a value whose
    interpolation fails to resolve (an unset ``${oc.env:...}``) still exists and can be overridden."""
    node: Any = cfg
    for part in key.split("."):
        if isinstance(node, ListConfig) and part.isdigit() and int(part) < len(node):  # an element: betas.1
            node = node._get_node(int(part))  # noqa: SLF001
        elif isinstance(node, DictConfig) and part in node:
            node = node._get_node(part)  # noqa: SLF001 - the raw node: its interpolation stays unresolved
        else:
            return _MISSING
    return node


def parse_overrides(overrides: Sequence[str]) -> list[Override]:
    """Parse override strings with Hydra's parser; a syntax error names the override."""
    # Imported here: modules that only read configs (a bare GPU check, the workers) need no Hydra.
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    parsed = []
    for text in overrides:
        key, sep, value = text.partition("=")
        if sep and value.strip() == "~" and not key.startswith("~"):  # YAML's null spelling: Hydra's grammar has no '~'
            text = f"{key}=null"
        if not sep and not key.startswith("~") and key.endswith((".yaml", ".yml")):
            raise ConfigError(f"'{text}' is not an override (key=value); to use it as the recipe write --config {text}")
        try:
            parsed.extend(parser.parse_overrides([text]))
        except OverrideParseException as exc:
            hint = quoting_hint(parser, key, value) if sep else ""
            raise ConfigError(f"Cannot parse override '{text}'{': ' + hint if hint else ''}\n{exc}") from None  # the caret under its line
    return parsed


#: A value that opens a list, a mapping, a group or one of Hydra's functions (``[1,``, ``int(3``): a typo in them, not
#: text to quote.
OPENS_STRUCTURE = re.compile(r"\s*([\[{(]|(choice|range|interval|sort|shuffle|tag|glob|int|float|str|bool|json_str)\s*\()")


def quoting_hint(parser: Any, key: str, value: str) -> str:
    """What to write when ``key=value`` parses once its value is quoted (Hydra reads ``~ ' # & ; ! ^ > "``, non-ASCII
    letters and a ``(`` or ``=`` inside a value only quoted: ``/Users/José``, ``ML (old)``); ``""`` otherwise, and for
    a value that opens a list, a mapping, a function call or an interpolation (``[``, ``{``, ``(``, ``int(``,
    ``${``), a typo there rather than text. A leading ``~/`` gets ``$HOME``: no shell expands ``~`` after ``key=``, and a
    quoted one is a directory named ``~``."""
    from hydra.errors import OverrideParseException

    if value.startswith("~/"):
        return f"no shell expands '~' after '=': write {key}=$HOME/{value[2:]}"
    written = quoted_override(key, value)
    if written is None or OPENS_STRUCTURE.match(value) or "${" in value:
        return ""
    quoted, in_shell = written
    try:
        parser.parse_overrides([quoted])
    except OverrideParseException:
        return ""
    return f"quote the value: {quoted} (in a shell: {in_shell})"


def quoted_override(key: str, value: str) -> tuple[str, str] | None:
    """``key=value`` with the value quoted for Hydra's grammar, and that override as one shell word (double quotes
    where nothing in it expands there); ``None`` for a value holding both kinds of quote."""
    quoted = f"{key}='{value}'" if "'" not in value else f'{key}="{value}"' if '"' not in value else None
    if quoted is None:
        return None
    return quoted, f'"{quoted}"' if not set(quoted) & set('"$`\\!') else shlex.quote(quoted)


def apply_overrides(cfg: DictConfig, overrides: Sequence[str], sections: frozenset[str] = frozenset()) -> DictConfig:
    """Return ``cfg`` with ``overrides`` applied in order (the input is modified in place too); ``sections``: the dotted
    keys of the recipe's sections, which only a mapping (merged into it) or an interpolation may set."""
    deleted_env = False
    for override in parse_overrides(overrides):
        key = override.key_or_group
        text = override.input_line
        if override.package is not None:  # Hydra's config-group packages: nemo-like has no config groups
            raise ConfigError(f"Override '{text}': '@{override.package}' (a Hydra package) means nothing here; write {key}=...")
        if override.is_sweep_override():
            raise ConfigError(
                f"Override '{text}': a comma, range() or choice() makes a sweep, which nemo-like does not run; "
                f"quote the value ({key}='a, b') or write a list ({key}=[1,2])"
            )
        node = _raw_node(cfg, key)
        exists = node is not _MISSING
        if override.is_delete():
            if not exists:
                raise ConfigError(f"Override '{text}': cannot delete '{key}', it is not in the recipe.{did_you_mean(key, leaf_keys(cfg))}")
            if override.value() is not None and OmegaConf.select(cfg, key) != override.value():
                raise ConfigError(f"Override '{text}': '{key}' is {OmegaConf.select(cfg, key)!r}, not {override.value()!r}")
            _delete(cfg, key)
            deleted_env = deleted_env or key == "env" or key.startswith("env.")
            continue
        value = override.value()
        if key in sections and not isinstance(value, dict) and not is_interpolation(value):  # grpo=null dropped every key
            keys = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
            listed = f" ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})" if keys else ""
            raise ConfigError(
                f"Override '{text}': '{key}' is a section{listed}, which {'null' if value is None else repr(value)} would "
                f"replace whole: set its keys ({key}.KEY=...), or merge a mapping into it ({key}={{KEY: ...}})"
            )
        if override.is_add() and exists:
            raise ConfigError(f"Override '{text}': '{key}' already exists; use '{key}=...' to change it or '++{key}=...' to force.")
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key, throw_on_missing=False) if parent_key and not exists else None
        if isinstance(parent, ListConfig):  # an index past the end, or a name, in a list: no '+' adds one
            raise ConfigError(
                f"Override '{text}': '{parent_key}' is a list of {len(parent)} (indices 0-{len(parent) - 1}), it has no element "
                f"{leaf!r}; write the whole list: {parent_key}=[...]"
            )
        if not override.is_add() and not override.is_force_add() and not exists:
            if isinstance(parent, DictConfig) and not parent:  # a mapping whose keys the user names (teacher.by_task)
                raise ConfigError(f"Override '{text}': '{parent_key}' is empty: use '+{key}=...' to add the key '{leaf}' to it.")
            close = closest_keys(key, leaf_keys(cfg))
            hint = did_you_mean(key, close)
            if not close or close[0].rpartition(".")[0] != key.rpartition(".")[0]:  # nothing in its own section
                hint += f" (Use '+{key}=...' to add a key the recipe does not spell out, e.g. a section env.<task>.)"
            raise ConfigError(f"Override '{text}': '{key}' is not a key of the recipe.{hint}")
        try:
            with open_dict(cfg):  # a mapping merges into the section, as Hydra does; '~key' then '+key=...' replaces it
                OmegaConf.update(cfg, key, value, merge=True, force_add=True)
        except (OmegaConfBaseException, ValueError) as exc:  # e.g. an index past a list, a name as a list index
            raise ConfigError(f"Override '{text}': cannot set '{key}' to {value!r}: {str(exc).splitlines()[0]}") from None
    if deleted_env and not OmegaConf.select(cfg, "env", default=None):
        # An empty env means the default arithmetic environment: the one just deleted came back, silently
        raise ConfigError(
            "The overrides delete every env section: add the environment the data needs (e.g. +env.math.num_workers=1); "
            "an empty env would be the default arithmetic one"
        )
    return cfg


def _delete(cfg: DictConfig, key: str) -> None:
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    with open_dict(parent):
        del parent[int(leaf) if isinstance(parent, ListConfig) else leaf]
