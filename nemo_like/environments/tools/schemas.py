"""A tool's JSON schema, as chat templates take it (``apply_chat_template(..., tools=[...])``, the OpenAI form
``{"type": "function", "function": {"name", "description", "parameters"}}``): what the model reads in its prompt about
a tool it may call (``env.<task>.tools_in_prompt``, docs/guides/tools.md).

A tool documented in the Google style (type hints, and an ``Args:`` section describing every argument) gets the schema
transformers builds from it (``transformers.utils.get_json_schema``: types, descriptions, enums); any other callable
gets one from its signature alone: the first paragraph of its docstring as the description, each argument's JSON type
from its annotation where it has one, and the arguments without a default as required.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from typing import Any

#: JSON Schema types of the annotations a signature-only schema understands (others: an argument of any type).
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", tuple: "array", dict: "object"}


def tool_schema(name: str, tool: Any) -> dict[str, Any]:
    """The schema of ``tool`` under the name the model calls it by (a ``{name: spec}`` mapping's key may rename it)."""
    from transformers.utils import get_json_schema

    try:
        function = dict(get_json_schema(tool)["function"])
        function.pop("return", None)  # not part of the OpenAI form templates render
    except Exception:  # noqa: BLE001 - no Google-style docstring, not a plain function (a partial), a hint that does not resolve
        function = _signature_schema(tool)
    return {"type": "function", "function": {"name": name, **{k: v for k, v in function.items() if k != "name"}}}


def _signature_schema(tool: Any) -> dict[str, Any]:
    """``description`` and ``parameters`` from ``tool``'s docstring and signature (no per-argument descriptions)."""
    try:
        signature = inspect.signature(tool)
    except (TypeError, ValueError):  # a builtin without a signature: arguments unknown
        signature = None
    function = _function_of(tool)
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: typed as any
        hints = {}
    properties: dict[str, Any] = {}
    required = []
    for arg in signature.parameters.values() if signature is not None else ():
        if arg.kind in (arg.VAR_POSITIONAL, arg.VAR_KEYWORD):
            continue
        properties[arg.name] = _json_type(hints.get(arg.name))
        if arg.default is arg.empty:
            required.append(arg.name)
    doc = inspect.getdoc(function) or ""
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    return {"description": doc.split("\n\n")[0].replace("\n", " ").strip(), "parameters": parameters}


def _function_of(tool: Any) -> Any:
    """The function whose docstring and annotations describe ``tool``: a ``functools.partial``'s function, a callable
    instance's ``__call__`` (their own docstrings are functools' and the class's)."""
    while isinstance(tool, functools.partial):
        tool = tool.func
    if inspect.isroutine(tool) or inspect.isclass(tool):
        return tool
    return type(tool).__call__


def _json_type(hint: Any) -> dict[str, Any]:
    """``{"type": ...}`` of an annotation (``X | None`` and ``Optional[X]`` as X's, nullable), ``{}`` for any other."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        inner = _json_type(args[0])
        return {"type": [inner["type"], "null"]} if inner else {}
    hint = typing.get_origin(hint) or hint
    return {"type": JSON_TYPES[hint]} if hint in JSON_TYPES else {}
