"""The benchmarks import what they name from the package: a function renamed or moved broke ``refit.py`` and
``generation.py`` (``eos_token_ids``) and nothing noticed until a reader ran a command the docs print. Every
``from nemo_like... import name`` in ``benchmarks/*.py`` (at any depth of the code) must resolve to an attribute or a
submodule. Nothing is run: the benchmarks themselves take minutes."""

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
