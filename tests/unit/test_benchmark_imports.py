"""The benchmarks import what they name from the package: a function renamed or moved broke ``refit.py`` and
``generation.py`` (``eos_token_ids``) and nothing noticed until a reader ran a command the docs print. Every
``from nemo_like... import name`` in ``benchmarks/*.py`` (at any depth of the code) must resolve to an attribute or a
submodule, and every call to such a name (or to a sibling benchmark's function) must fit its signature. Nothing is
run: the benchmarks themselves take minutes."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py"))


def package_imports(path: Path) -> list[tuple[int, str, str]]:
    """``(line, module, name)`` of every ``from nemo_like... import name`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "nemo_like" and not node.level:
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
    return found


@pytest.mark.parametrize("path", BENCHMARKS, ids=[p.name for p in BENCHMARKS])
def test_every_name_a_benchmark_imports_from_the_package_exists(path: Path) -> None:
    missing = []
    for line, module, name in package_imports(path):
        owner = importlib.import_module(module)
        if not hasattr(owner, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"{path.name}:{line}: {module}.{name}")
    assert not missing, missing


def test_the_check_reads_nested_imports_and_would_catch_a_stale_one(tmp_path: Path) -> None:
    stale = tmp_path / "stale.py"
    stale.write_text("def main():\n    from nemo_like.algorithms.setup import eos_token_ids\n")
    assert package_imports(stale) == [(2, "nemo_like.algorithms.setup", "eos_token_ids")]
    assert not hasattr(importlib.import_module("nemo_like.algorithms.setup"), "eos_token_ids")


def called_with_wrong_arguments(path: Path) -> list[str]:
    """``file:line: call`` of every call in ``path`` to a function it imports (from the package or a sibling benchmark:
    ``from vs_trl import f``, ``import vs_trl`` then ``vs_trl.f``) whose arguments that function's signature cannot bind
    (a parameter added or removed since: ``stop_token_gap.py`` called ``vs_trl.prompt_rows`` with two of its four for
    weeks). Calls with ``*args`` or ``**kwargs`` and objects without a signature are skipped."""
    import inspect

    siblings = {p.stem for p in BENCHMARKS}
    tree = ast.parse(path.read_text())
    names: dict[str, object] = {}
    modules: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            root = node.module.split(".")[0]
            if root == "nemo_like" or node.module in siblings:
                owner = importlib.import_module(node.module)
                names.update({a.asname or a.name: getattr(owner, a.name, None) for a in node.names})
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in siblings:
                    modules[alias.asname or alias.name] = importlib.import_module(alias.name)
    wrong = []
    for node in ast.walk(tree):
        if (
            not isinstance(node, ast.Call)
            or any(isinstance(a, ast.Starred) for a in node.args)
            or any(k.arg is None for k in node.keywords)
        ):
            continue
        func = node.func
        if isinstance(func, ast.Name):
            target = names.get(func.id)
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in modules:
            target = getattr(modules[func.value.id], func.attr, None)
        else:
            continue
        if not callable(target):
            continue
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            continue
        try:
            signature.bind(*node.args, **{k.arg: k.value for k in node.keywords})
        except TypeError as exc:
            wrong.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]} ({exc})")
    return wrong


@pytest.mark.parametrize("path", BENCHMARKS, ids=[p.name for p in BENCHMARKS])
def test_every_call_a_benchmark_makes_to_an_imported_function_fits_its_signature(path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(path.parent))  # the benchmarks import each other as top-level modules
    assert not called_with_wrong_arguments(path)


def test_the_signature_check_would_catch_a_stale_call(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS[0].parent))
    stale = tmp_path / "stale.py"
    stale.write_text(
        "import vs_trl\nfrom vs_trl import prompt_rows\n\ndef main(d):\n    vs_trl.prompt_rows(d, 1)\n    prompt_rows(d, 1, 1, 1)\n"
    )
    (found,) = called_with_wrong_arguments(stale)
    assert found.startswith("stale.py:5: vs_trl.prompt_rows(d, 1) (missing a required argument")
