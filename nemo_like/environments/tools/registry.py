"""Which tools a :class:`~nemo_like.environments.tools.environment.ToolEnvironment` offers, and how a call runs.

A tool is a Python callable taking keyword arguments (the call's JSON ``arguments``) and returning the
observation text (a number is turned into text). Built-ins by name: ``calculator``
(:mod:`.calculator`) and ``python`` (:mod:`.python_sandbox`). Custom tools by import path,
``"package.module:function"`` or ``"path/to/file.py:function"``, registered under the function's name
(or the name given in the ``tools`` mapping). Custom tools run inside the environment's process: they are
trusted code; a tool that raises becomes an error observation, but a tool that hangs blocks the environment.

:meth:`ToolRegistry.call` never raises: every failure (unknown tool, arguments that do not fit the
signature, the tool raising, a sandbox limit) is returned as a :class:`ToolResult` with ``ok=False``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nemo_like.config.errors import ConfigError, did_you_mean
from nemo_like.environments.tools.errors import ToolError  # user tools import it from here (docs/guides/tools.md)
from nemo_like.environments.tools.parsing import echoed
from nemo_like.environments.tools.schemas import tool_schema
from nemo_like.utils.registry import PluginNameError, Registry

Tool = Callable[..., Any]
#: Longest observation text kept from a tool's result (characters; at least the python tool's own output limit): a
#: longer one is cut, with a line saying so, and counted (``tool_outputs_cut``).
MAX_RESULT_CHARS = 4096


@dataclass(frozen=True)
class ToolResult:
    """Outcome of one call: the observation text, and the error kind when it failed (``"output_cut"`` on a call that
    succeeded: its text was cut to the registry's limit)."""

    ok: bool
    text: str
    error_kind: str | None = None
    cut: bool = False  # the text (a result's or a failure's) was cut to the registry's limit


def _calculator(**_sandbox: Any) -> Tool:
    from nemo_like.environments.tools.calculator import calculator

    return calculator


def _python(python_timeout_s: float = 5.0, python_memory_mb: int = 256, python_max_output_bytes: int = 4096) -> Tool:
    from nemo_like.environments.tools.python_sandbox import PythonSandbox

    sandbox = PythonSandbox(python_timeout_s, python_memory_mb, python_max_output_bytes)

    def python(code: str) -> str:
        """Run Python code in a sandbox and return what it prints, then the value of its last expression.

        Args:
            code: The Python code to run
        """
        return sandbox.run(code)

    return python


def _check_tool(fn: object, spec: str, where: str) -> None:
    if not callable(fn):
        raise PluginNameError(where, f"{where}: {spec!r} is a {type(fn).__name__}, not a function taking the call's arguments as keywords")


def _unknown_tool(spec: str, where: str, names: list[str]) -> str:
    return (
        f"{where}: {spec!r} is not a built-in tool ({', '.join(BUILTIN_TOOLS)}) nor 'module:function' / 'file.py:function'."
        f"{did_you_mean(spec, BUILTIN_TOOLS)}"
    )


#: Tools: a built-in name maps to a factory taking the python tool's sandbox limits; an import path
#: names the tool function itself.
TOOLS: Registry[Callable[..., Tool]] = Registry("tool", "tools", validate=_check_tool, unknown=_unknown_tool)
TOOLS.add("calculator", _calculator)
TOOLS.add("python", _python)
BUILTIN_TOOLS = tuple(TOOLS)


def resolve_tool(spec: str, where: str, **sandbox: Any) -> tuple[str, Tool]:
    """``(name, callable)`` for a built-in name or an import path; :class:`ConfigError` naming ``where`` otherwise."""
    if spec in TOOLS:
        return spec, TOOLS.get(spec, where)(**sandbox)
    fn = TOOLS.get(spec, where)
    return getattr(fn, "__name__", spec.rpartition(":")[2].rsplit(".", 1)[-1]), fn


class ToolRegistry:
    """The tools of one environment, by the name the model calls them with."""

    def __init__(self, tools: Mapping[str, Tool], max_result_chars: int = MAX_RESULT_CHARS) -> None:
        self.tools = dict(tools)
        self.max_result_chars = max_result_chars

    @classmethod
    def from_config(cls, tools: list[str] | Mapping[str, str], where: str = "tools", **sandbox: Any) -> ToolRegistry:
        """Build from a list of specs (named by the built-in / function name) or a ``{name: spec}`` mapping."""
        items = tools.items() if isinstance(tools, Mapping) else [(None, spec) for spec in tools]
        resolved: dict[str, Tool] = {}
        for given, spec in items:
            name, fn = resolve_tool(spec, f"{where}.{given}" if given else where, **sandbox)
            name = given or name
            if name in resolved:
                raise ConfigError(f"{where}: two tools are named {name!r}; give them distinct names with a mapping {{name: spec}}")
            resolved[name] = fn
        # The python tool refuses output over python_max_output_bytes itself: never cut what it let through (other
        # tools' results are cut at MAX_RESULT_CHARS, whatever that key says).
        offers_python = any(spec == "python" for _, spec in items)
        return cls(resolved, max(MAX_RESULT_CHARS, int(sandbox.get("python_max_output_bytes", 0))) if offers_python else MAX_RESULT_CHARS)

    def schemas(self) -> list[dict[str, Any]]:
        """Each tool's JSON schema under its name, in order (what a prompt's chat template lists: :func:`tool_schema`)."""
        return [tool_schema(name, tool) for name, tool in self.tools.items()]

    def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """Run one call; never raises (see the module docstring)."""
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(False, f"unknown tool {echoed(name)}; available: {', '.join(sorted(self.tools))}", "unknown_tool")
        try:
            inspect.signature(tool).bind(**arguments)
        except TypeError as exc:
            return self._bounded(ToolResult(False, f"bad arguments for {name!r}: {exc}", "bad_arguments"))
        except ValueError:
            pass  # builtins without a signature: let the call decide
        try:
            value = tool(**arguments)
            if value is None:  # a tool that forgot its return: the model was shown "None" as a successful call
                return self._bounded(ToolResult(False, f"{name}: returned None, not the observation text", "bad_return"))
            text = value if isinstance(value, str) else str(value)  # str() raises too: an int past 4300 digits
        except ToolError as exc:
            return self._bounded(ToolResult(False, f"{name}: {exc}", exc.kind))
        # a tool's own bug or a bad value, sys.exit / argparse on bad arguments too (SystemExit ended the environment
        # actor, and every retry of the batch): an observation, never a failed run
        except (Exception, SystemExit) as exc:
            return self._bounded(ToolResult(False, f"{name}: {type(exc).__name__}: {exc}", "exception"))
        return self._bounded(ToolResult(True, text))

    def _bounded(self, result: ToolResult) -> ToolResult:
        """``result`` with its text cut to ``max_result_chars`` (a failure's too: an exception quoting a whole page was
        an observation of any size), the cut said in its last line."""
        if len(result.text) <= self.max_result_chars:
            return result
        cut = len(result.text) - self.max_result_chars
        text = f"{result.text[: self.max_result_chars]}\n[... {cut} more characters cut]"
        return ToolResult(result.ok, text, "output_cut" if result.ok else result.error_kind, cut=True)
