"""Import user code named in a recipe by ``"package.module:object"`` or ``"path/to/file.py:object"``.

One helper for every such key (advantage estimators, loss plug-ins, environments, reward functions);
callers turn its ``ValueError`` into a config error naming their key.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from pathlib import Path

from nemo_like.config.errors import did_you_mean


def is_import_path(name: str) -> bool:
    """Whether ``name`` looks like ``module:object`` rather than a registered name."""
    return ":" in name


def import_object(path: str) -> object:
    """Import ``'package.module:attr'`` or ``'some/file.py:attr'`` (``attr`` may be dotted).

    Raises:
        ValueError: malformed path, module not importable, or no such attribute.
    """
    module_name, _, attr = path.rpartition(":")
    if not module_name or not attr:
        raise ValueError(f"import path must look like 'package.module:object', got {path!r}")
    try:
        if module_name.endswith(".py"):
            module = _import_file(Path(module_name))
        else:
            module = importlib.import_module(module_name)
    except (ImportError, OSError) as exc:
        raise ValueError(f"cannot import {module_name!r} (from {path!r}): {exc}{_not_on_path_hint(exc)}") from None
    obj: object = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise ValueError(f"{module_name!r} has no attribute {attr!r}.{did_you_mean(part, names)}")
        obj = getattr(obj, part)
    return obj


def _not_on_path_hint(exc: BaseException) -> str:
    """A hint when a module that is not found sits in the working directory, which is not on ``sys.path`` under the
    ``nemo-like`` command (``python -m`` puts it there)."""
    top = (getattr(exc, "name", None) or "").split(".")[0]
    if not isinstance(exc, ModuleNotFoundError) or not top:
        return ""
    try:
        if top in sys.modules or importlib.util.find_spec(top) is not None:
            return ""  # the package imports (a submodule is missing): not a path problem
        here = Path.cwd()  # not on sys.path, or find_spec would have found it there
        if not ((here / top).is_dir() or (here / f"{top}.py").is_file()):
            return ""
    except (ImportError, ValueError, OSError):  # a deleted working directory, an unreadable one: the plain error
        return ""
    return (
        f"; {top!r} is in the working directory {here}, which is not on the import path of the nemo-like command: run "
        "with PYTHONPATH=$PWD (the actors inherit it), or name the file (path/to/module.py:object)"
    )


#: Held while a file module executes: agent sessions run on threads and import their helpers by file path at the
#: same moment, and a module is in ``sys.modules`` before its body has run (re-entrant: a file may import another).
_FILE_IMPORT_LOCK = threading.RLock()


#: The prefix of a file imported by path's module name (its name differs from process to process: :func:`_import_file`).
FILE_MODULE_PREFIX = "_nemo_like_user_"


def _import_file(file: Path) -> object:
    resolved = file.resolve()
    name = f"{FILE_MODULE_PREFIX}{abs(hash(str(resolved)))}"
    with _FILE_IMPORT_LOCK:
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, resolved)
        if spec is None or spec.loader is None or not resolved.is_file():
            relative = (
                ""
                if file.is_absolute()
                else f" (relative to the working directory {Path.cwd()}: give an absolute path, or run from the directory it is relative to)"
            )
            raise ImportError(f"no Python file at {file}{relative}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]  # a failed import is retried next time, not served half-run
            raise
        return module
