"""The one plug-in registry (nemo_like.utils.registry): registered names, lazily imported built-ins,
'module:object' and 'file.py:object' user code, did-you-mean, one error type naming the config key."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_like.config.errors import ConfigError
from nemo_like.utils.registry import PluginNameError, Registry


def double(x: int) -> int:
    return 2 * x


NOT_CALLABLE = 3


def make() -> Registry:
    registry: Registry = Registry("widget", "section.widget")
    registry.add("double", double)
    registry.add_path("triple", "operator:mul")
    return registry


def test_registered_lazy_and_import_path_names_resolve(tmp_path: Path) -> None:
    registry = make()
    assert registry.get("double") is double
    assert registry.get("triple")(3, 3) == 9  # imported on first use
    assert registry.get(f"{__name__}:double") is double
    user = tmp_path / "user_widgets.py"
    user.write_text("def negate(x):\n    return -x\n")
    assert registry.get(f"{user}:negate")(2) == -2
    assert list(registry) == ["double", "triple"] and registry.names() == ["double", "triple"]
    assert "triple" in registry and registry.path_of("triple") == "operator:mul"
    assert registry.check("double") == "double"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("doubel", "section.widget: unknown widget 'doubel'. Did you mean 'double'?"),
        (f"{__name__}:NOT_CALLABLE", f"section.widget: '{__name__}:NOT_CALLABLE' is not callable"),
        (f"{__name__}:dubble", "has no attribute 'dubble'. Did you mean 'double'?"),
        ("no_such_pkg_xyz.mod:fn", "section.widget: cannot import 'no_such_pkg_xyz.mod'"),
    ],
)
def test_errors_are_config_errors_naming_the_key(name: str, message: str) -> None:
    with pytest.raises(PluginNameError) as excinfo:
        make().get(name)
    assert isinstance(excinfo.value, ConfigError) and excinfo.value.key == "section.widget"
    assert message in str(excinfo.value)


def test_a_module_in_the_working_directory_off_the_import_path_gets_the_fix(tmp_path: Path, monkeypatch) -> None:
    """The nemo-like command does not put the working directory on sys.path (``python -m`` does): the docs' own
    ``my_project.estimators:best_of_group`` failed with a bare 'No module named' from there."""
    import sys

    (tmp_path / "my_project_x").mkdir()
    (tmp_path / "my_project_x" / "widgets.py").write_text("def f(x):\n    return x\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".") and Path(p).resolve() != tmp_path.resolve()])
    with pytest.raises(PluginNameError, match=r"'my_project_x' is in the working directory .* PYTHONPATH=\$PWD"):
        make().get("my_project_x.widgets:f")
    with pytest.raises(PluginNameError) as elsewhere:  # a package that is nowhere: no hint
        make().get("no_such_pkg_xyz.mod:fn")
    assert "PYTHONPATH" not in str(elsewhere.value)
    (tmp_path / "yaml").mkdir()  # a checkout of an installed package: a missing submodule is a typo, not the path
    with pytest.raises(PluginNameError) as typo:
        make().get("yaml.no_such_submodule:f")
    assert "PYTHONPATH" not in str(typo.value)
    monkeypatch.syspath_prepend(str(tmp_path))  # on the path: it imports
    assert make().get("my_project_x.widgets:f")(4) == 4


def test_the_key_can_be_given_per_lookup_and_messages_customised() -> None:
    registry: Registry = Registry("gadget", "x", unknown=lambda name, key, names: f"{key}: no {name!r} among {names}")
    registry.add("a", double)
    with pytest.raises(PluginNameError, match=r"env.t.class: no 'b' among \['a'\]"):
        registry.get("b", "env.t.class")


def test_names_are_registered_once_and_never_look_like_import_paths() -> None:
    registry = make()
    with pytest.raises(ValueError, match="already registered"):
        registry.add("triple", double)
    with pytest.raises(ValueError, match="reserved for import paths"):
        registry.add("a:b", double)


def test_a_file_imported_from_many_threads_at_once_is_run_once_and_seen_whole(tmp_path: Path) -> None:
    """Agent sessions import their helpers by file path on concurrent threads: none may see the module half-run (the
    CI failure this pins: ``calculator_agent.py has no attribute 'CALCULATOR_SCHEMA'`` in 6 of 8 sessions)."""
    import threading

    from nemo_like.utils.imports import import_object

    runs = tmp_path / "runs.txt"
    slow = tmp_path / "slow_module.py"
    slow.write_text(f"import time\nopen({str(runs)!r}, 'a').write('x')\ntime.sleep(0.3)\nLAST = 'defined at the end'\n")
    found, start = [], threading.Barrier(8)

    def load() -> None:
        start.wait()
        found.append(import_object(f"{slow}:LAST"))

    threads = [threading.Thread(target=load) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert found == ["defined at the end"] * 8 and runs.read_text() == "x"

    broken = tmp_path / "broken_once.py"
    broken.write_text("raise ImportError('not yet')\n")
    with pytest.raises(ValueError, match="not yet"):
        import_object(f"{broken}:X")
    broken.write_text("X = 1\n")
    assert import_object(f"{broken}:X") == 1  # a failed import is retried, not served half-run
