"""Stopping and stalling on real runs (docs/guides/fault-tolerance.md): real CLI subprocesses, real signals, real actors.

* SIGTERM at a random moment: a checkpoint of the last logged step, exit status 143, one resume line; resuming
  reproduces the uninterrupted run bitwise (the approach of test_checkpoint_resume.py).
* ``checkpointing.save_before=auto`` with ``$SLURM_JOB_END_TIME`` (in this process): saved before the deadline,
  ``RunInterrupted`` with status 75.
* A generation call, and a policy worker's start, made to hang (``cluster.fault_injection``; in this process): the
  watchdog reports the driver's call, the actor and its stack within ``stall_timeout_s + 10 s``, and with
  ``on_stall=abort`` the run stops with exit status 70 (``RunStalled``) and the report; its hung actors are not kept.
* The HF engine and an environment actor killed in one run (in this process): both replaced, every step bitwise equal
  to a straight run's; past ``max_actor_restarts`` (a hang past ``call_timeout_s``, then a kill) the run stops
  listing both deaths.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from functional.helpers import (
    OLD_WARNING,
    TINY_OVERRIDES,
    TINY_RECIPE,
    ckpt_overrides,
    cli_command,
    is_loopback,
    listeners,
    read_metrics,
    tensorboard_session_status,
    tiny_config,
    tree,
)  # fmt: skip

from nemo_like.distributed import faults
from nemo_like.distributed.supervision import ActorRestartsExhausted
from nemo_like.distributed.watchdog import RunStalled
from nemo_like.train import train
from nemo_like.utils.machine_runs import registered_run
from nemo_like.utils.run_control import RunInterrupted

pytestmark = pytest.mark.slow

# Tiny, fast runs: no validation (its cost is not under test), no reference actor, inline generation in the policy.
FAST = ("grpo.val_at_start=false", "grpo.val_at_end=false", "grpo.val_period=0", "loss_fn.reference_policy_kl_penalty=0")
COMPARED = ("train/reward", "train/loss", "train/grad_norm", "train/gen_kl")


class Run:
    """``nemo-like train`` in its own session and its own Ray temp dir; output lines collected with arrival times."""

    def __init__(
        self, tmp_path: Path, *overrides: str, env: dict[str, str] | None = None, as_a_user: bool = False, command: str = "train"
    ) -> None:
        """``as_a_user``: the installed ``nemo-like`` script with only PATH and HOME set (none of the Makefile's exports),
        as the README's "Running your own recipe" runs it; else ``python -m nemo_like.cli`` with this process's env.
        ``command``: another than ``train`` gets only the recipe and ``overrides``."""
        self.ray_tmp = Path(tempfile.mkdtemp(prefix="nlft", dir="/tmp"))  # Ray's socket paths must stay short
        cli = cli_command() if as_a_user else [sys.executable, "-m", "nemo_like.cli"]
        self.args = [*cli, command, "--config", str(TINY_RECIPE), *TINY_OVERRIDES]
        self.args += [f"logger.log_dir={tmp_path / 'logs'}", *FAST, *overrides] if command == "train" else list(overrides)
        base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", str(tmp_path)), "HF_HUB_OFFLINE": "1"}
        full_env = {**(base if as_a_user else os.environ), "RAY_TMPDIR": str(self.ray_tmp), **(env or {})}
        self.proc = subprocess.Popen(
            self.args, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.lines: list[tuple[float, str]] = []
        self.ended_at: float | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
        self.proc.wait()
        self.ended_at = time.monotonic()

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for_line(self, pattern: str, timeout_s: float, after: float = 0.0) -> float:
        """When the first line matching ``pattern`` (printed after ``after``) arrived; fails if the run ends or the time
        runs out first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for at, line in list(self.lines):
                if at >= after and re.search(pattern, line):
                    return at
            if self.ended_at is not None:
                raise AssertionError(f"run ended (status {self.proc.returncode}) before {pattern!r}:\n{self.output}")
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} within {timeout_s}s:\n{self.output}")

    def wait_for(self, predicate, timeout_s: float, every=None) -> None:
        """Wait until ``predicate()``; ``every()`` (if given) runs at each poll."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if self.ended_at is not None or time.monotonic() > deadline:
                raise AssertionError(f"condition not met (status {self.proc.returncode}):\n{self.output}")
            if every is not None:
                every()
            time.sleep(0.05 if every is None else 0.5)

    def signal(self, signum: int) -> float:
        os.kill(self.proc.pid, signum)  # the driver only, as Slurm's --signal=B: or a plain kill sends it
        return time.monotonic()

    def finish(self, timeout_s: float) -> int:
        self._reader.join(timeout=timeout_s)
        assert self.ended_at is not None, f"still running after {timeout_s}s:\n{self.output}"
        return self.proc.returncode

    def cleanup(self) -> None:
        """SIGKILL whatever is left: the driver's session and its private cluster's processes."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for proc_dir in Path("/proc").iterdir():
            if proc_dir.name.isdigit():
                try:
                    if str(self.ray_tmp).encode() in (proc_dir / "environ").read_bytes() + (proc_dir / "cmdline").read_bytes():
                        os.kill(int(proc_dir.name), signal.SIGKILL)
                except OSError:
                    pass
        shutil.rmtree(self.ray_tmp, ignore_errors=True)  # its Ray session (~300 KB each run) stayed in /tmp


def checkpoint_steps(ckpt: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in ckpt.glob("step_*") if (p / "trainer_state.json").exists())


def test_sigterm_at_a_random_moment_saves_exits_143_and_resumes_bitwise(ray_cluster, tmp_path):
    """Run as a user runs it (the installed script, no Makefile exports), which also checks that every socket of its
    private cluster listens on the loopback address only (tests/functional/test_local_cluster_address.py has why), and
    that it warns of another run alive on the machine (this process registers one) with each run's share of the cores."""
    ckpt = tmp_path / "ckpt"
    with registered_run(tmp_path / "other-logs"):  # held until the run has started (it looks while it sets up)
        tmp = {"TMPDIR": tempfile.gettempdir()}  # where runs register
        run = Run(tmp_path, "grpo.max_num_steps=200", *ckpt_overrides(ckpt, 100), env=tmp, as_a_user=True)  # only the stop saves
        found: dict[tuple[int, str, int], str] = {}  # (pid, ip, port) -> process name, while the run was polled

        def record_listeners() -> None:
            found.update(listeners(tree(run.proc.pid)))

        try:
            metrics = tmp_path / "logs" / "metrics.jsonl"
            run.wait_for(lambda: metrics.exists() and metrics.read_text().strip() != "", 240, every=record_listeners)
            record_listeners()
            delay = random.Random().uniform(0.0, 1.0)
            print(f"SIGTERM {delay:.2f}s after the first step")
            time.sleep(delay)
            sent = run.signal(signal.SIGTERM)
            status = run.finish(120)
        finally:
            run.cleanup()
    seconds = run.ended_at - sent
    print(f"SIGTERM -> exit: {seconds:.1f}s, status {status}")
    assert status == 143, run.output
    assert "Traceback" not in run.output and "SIGABRT" not in run.output
    names = set(found.values())  # the GCS, the raylet and at least one worker listened while polled
    assert {"gcs_server", "raylet"} <= names and any(n.startswith("ray::") for n in names), found
    exposed = sorted((name, ip, port, pid) for (pid, ip, port), name in found.items() if not is_loopback(ip))
    assert not exposed, f"listening beyond the loopback address: {exposed}"
    assert OLD_WARNING not in run.output
    shared = re.search(rf"nemo-like runs? (is|are) alive on this machine \(.*pid {os.getpid()}, started .*", run.output)
    assert shared and shared.group(0).endswith("give each run its share: policy.num_threads_per_worker=1"), run.output
    logged = [r["step"] for r in read_metrics(tmp_path / "logs")]
    stopped = logged[-1]
    assert checkpoint_steps(ckpt) == [stopped]  # the step in progress was finished, then saved
    match = re.search(r"\[stop\] resume with: (.+)", run.output)
    assert match and f"checkpointing.checkpoint_dir={ckpt}" in match.group(1), run.output
    # Resume in this process (the session cluster): the same recipe, two more steps.
    total = stopped + 2
    resumed = train(tiny_config(tmp_path, f"grpo.max_num_steps={total}", *FAST, *ckpt_overrides(ckpt, 100)))
    assert [h["step"] for h in resumed] == [stopped + 1, stopped + 2]
    straight_dir = tmp_path / "straight"
    train(tiny_config(straight_dir, f"grpo.max_num_steps={total}", *FAST))
    a, b = read_metrics(straight_dir / "logs"), read_metrics(tmp_path / "logs")
    assert [r["step"] for r in b] == list(range(1, total + 1))
    for ra, rb in zip(a, b, strict=True):
        for key in COMPARED:
            assert ra[key] == rb[key], (ra["step"], key)  # bitwise


def test_save_before_auto_reads_slurm_end_time_and_stops_in_time(ray_cluster, tmp_path, monkeypatch):
    # In this process on the session cluster (setup takes seconds): the run stops itself, no signal involved.
    ckpt = tmp_path / "ckpt"
    end = time.time() + 30  # setup takes 1-20 s here (a cold session cluster on a shared machine); then steps until the deadline nears
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(end)))
    cfg = tiny_config(
        tmp_path, "grpo.max_num_steps=100000", *FAST, "checkpointing.save_before=auto", *ckpt_overrides(ckpt, 100000),
        "logger.tensorboard_enabled=true",
    )  # fmt: skip
    with pytest.raises(RunInterrupted) as stopped:
        train(cfg)
    assert stopped.value.code == 75 and "checkpointing.save_before" in stopped.value.reason.what
    # A stop that saved is no failure in the dashboards that record an outcome (a failed run's is: test_checkpoint_resume)
    assert tensorboard_session_status(tmp_path / "logs") == "STATUS_SUCCESS"
    steps = checkpoint_steps(ckpt)
    # Two saves: after the first step (to measure a save) and the deadline's, of the last logged step.
    # (On a slow machine the deadline may already be near after step 1: then both saves are step 1's.)
    assert steps == sorted({1, read_metrics(tmp_path / "logs")[-1]["step"]}) and steps[-1] == stopped.value.step
    margin = int(end) - (ckpt / f"step_{steps[-1]}").stat().st_mtime
    print(f"save_before: step_{steps[-1]} saved {margin:.1f}s before the deadline")
    assert margin > 0  # saved before the deadline

    # A stop with checkpointing off saves nothing, so nothing can resume: the dashboards record a failure. (A deadline
    # without checkpoints is refused at start; a signal is what stops such a run: asked here as its handler asks.)
    from nemo_like.utils import run_control

    started = run_control.RunControl.step_started

    def signalled_in_step_2(self, step: int) -> None:
        started(self, step)
        if step == 2:
            self.requested = run_control.StopReason("SIGTERM", 143)

    monkeypatch.delenv("SLURM_JOB_END_TIME")
    monkeypatch.setattr(run_control.RunControl, "step_started", signalled_in_step_2)
    unsaved = tiny_config(tmp_path / "unsaved", "grpo.max_num_steps=5", *FAST, "logger.tensorboard_enabled=true")
    with pytest.raises(RunInterrupted) as stopped:
        train(unsaved)
    assert (stopped.value.code, stopped.value.step, stopped.value.checkpoint) == (143, 2, None)
    assert [r["step"] for r in read_metrics(tmp_path / "unsaved" / "logs")] == [1, 2]  # the step in progress finished
    assert tensorboard_session_status(tmp_path / "unsaved" / "logs") == "STATUS_FAILURE"

    # A stop asked during step 0's validation (or the set-up) stops there: it said "finishing step 0", then trained and
    # saved a whole step 1 (past a Slurm grace period, or for nothing with checkpointing off).
    def signalled_in_validation(self, seconds: float) -> None:
        self.requested = run_control.StopReason("SIGTERM", 143)

    monkeypatch.setattr(run_control.RunControl, "validation_finished", signalled_in_validation)
    at_zero = tmp_path / "at_zero"
    validated = tiny_config(at_zero, "grpo.max_num_steps=5", *FAST, "grpo.val_at_start=true", *ckpt_overrides(at_zero / "ckpt", 1))
    with pytest.raises(RunInterrupted) as stopped:
        train(validated)
    assert (stopped.value.code, stopped.value.step, stopped.value.checkpoint) == (143, 0, None)
    assert [r["step"] for r in read_metrics(at_zero / "logs")] == [0] and checkpoint_steps(at_zero / "ckpt") == []
    # ... and one asked while the actors start stops before step 0's validation (it ran it first: minutes on a real set)
    setup_done = run_control.RunControl.setup_finished

    def signalled_in_setup(self, seconds: float) -> None:
        setup_done(self, seconds)
        self.requested = run_control.StopReason("SIGINT", 130)

    monkeypatch.setattr(run_control.RunControl, "setup_finished", signalled_in_setup)
    in_setup = tmp_path / "in_setup"
    with pytest.raises(RunInterrupted) as stopped:
        train(tiny_config(in_setup, "grpo.max_num_steps=5", *FAST, "grpo.val_at_start=true"))
    assert (stopped.value.code, stopped.value.step) == (130, 0) and read_metrics(in_setup / "logs") == []


STALL = "cluster.fault_tolerance.stall_timeout_s=4"
ABORTED = "nemo-like: error: the run stalled and was aborted (cluster.fault_tolerance.on_stall=abort)"


def no_hung_actor_kept() -> None:
    """Every actor group kept for the next run answers at once and is idle (an aborted run's hung actors were kept: the
    next run's group waited placement_timeout_s on them, holding their bundles)."""
    import ray

    from nemo_like.distributed.worker_group import _POOL

    for group in _POOL.idle:
        busy = ray.get([w.busy_with.remote() for w in group.workers], timeout=10)
        assert not any(busy), (group.name, busy)


# The two stall tests run in this process on the session cluster (the watchdog's abort raises RunStalled, SystemExit
# 70, in the main thread; the CLI lets it through): a run of their own started a private Ray cluster each, ~25 s of CPU.
def test_a_hung_generation_is_reported_with_its_stack_and_abort_exits_70(ray_cluster, tmp_path, capfd):
    # Step 1 hangs: nothing runs between the watchdog's start and the hang, so a slow step on a loaded machine cannot be
    # reported (and aborted) first. (A second signal exiting at once is tested on the handler itself:
    # tests/unit/utils/test_run_control.py; a dead policy worker: test_checkpoint_resume.py.)
    hang = ("grpo.max_num_steps=5", "cluster.fault_injection.action=hang", STALL, "cluster.fault_tolerance.on_stall=abort")
    with pytest.raises(RunStalled) as stalled:
        train(tiny_config(tmp_path, *FAST, *hang))
    out, err = capfd.readouterr()
    assert stalled.value.code == 70 and "[fault] injecting 'hang' into generation (generate) at step 1" in out, out
    report = stalled.value.report
    assert report in err and f"{ABORTED}; " in err and "Traceback" not in err
    assert report.startswith("[stall] no progress for ") and "(cluster.fault_tolerance.stall_timeout_s=4) during step 1" in report
    waited = re.search(r"\[stall\] driver \(pid \d+\): waiting on 'policy: inline generation' for ([\d.]+)s", report)
    assert waited and float(waited.group(1)) <= 4 + 10, report  # the hang (the call's start) reported within 10 s of the timeout
    assert re.search(r"\[stall\] actor PolicyWorker \w+ \(pid \d+.*\): in PolicyWorker.__ray_call__, at _hang_forever", report), report
    assert "_hang_forever (nemo_like/distributed/faults.py" in report  # the py-spy stack
    no_hung_actor_kept()


STARTS_FOREVER = """
import time

from nemo_like.environments.interface import ActorNeeds, EnvironmentInterface


class StartsForever(EnvironmentInterface):
    @classmethod
    def actor_needs(cls, settings):
        return ActorNeeds(num_cpus=0.07)  # a shape of its own: a fresh actor, never a kept one re-initialised

    def __init__(self):
        time.sleep(3600)

    def score(self, responses, metadata):
        return [0.0] * len(responses)
"""


def test_a_start_that_hangs_is_reported_and_abort_exits_70(ray_cluster, tmp_path, capfd, monkeypatch):
    """No watchdog ran during set-up: a policy worker that hung while the actors started (a rendezvous, a restart's
    worker) hung the run forever with no report, on_stall=abort included. Step 0: the first start of the actors;
    setup_timeout_s watches the start (a start is far longer than a tiny step: stall_timeout_s is for the steps).
    An environment whose actor never finishes starting runs beside it: the aborted start keeps none of its actors (the
    environment's group was kept for the next run, hung)."""
    (tmp_path / "stuck_env.py").write_text(STARTS_FOREVER)
    monkeypatch.syspath_prepend(str(tmp_path))
    stuck = ("+env.stuck.class=stuck_env:StartsForever",)
    hang_at_start = ("cluster.fault_injection.role=policy", "cluster.fault_injection.phase=setup", "cluster.fault_injection.step=0")
    # 20 s: each stage of the start is watched on its own; here Ray is up, and the hung worker's start (a fresh actor
    # on a loaded machine: up to ~15 s) must be done for its stack to show the hang
    watch_start = ("cluster.fault_tolerance.setup_timeout_s=20", "cluster.fault_tolerance.on_stall=abort")
    with pytest.raises(RunStalled) as stalled:
        train(
            tiny_config(
                tmp_path, *FAST, "grpo.max_num_steps=2", *hang_at_start, "cluster.fault_injection.action=hang", *watch_start, *stuck
            )
        )
    out, err = capfd.readouterr()
    assert stalled.value.code == 70 and "[fault] injecting 'hang' into policy (setup) at step 0" in out, out
    report = stalled.value.report
    assert re.match(r"\[stall\] no progress for \d+s \(cluster.fault_tolerance.setup_timeout_s=20\) during set-up", report), report
    assert "_hang_forever (nemo_like/distributed/faults.py" in report  # the hung worker's py-spy stack
    assert f"{ABORTED}; " in err and "[setup] actors ready" not in out + err and "Traceback" not in err
    no_hung_actor_kept()


# The HF engine is an actor of its own (the default CPU run samples inside the policy worker, whose death restarts the
# run instead: test_checkpoint_resume.py). Three steps: the engine dies after step 2's refit (its replacement reloads
# those weights) and the replacement takes step 3's refit.
REPLACED = (*FAST, "policy.generation.backend=hf", "grpo.max_num_steps=3")


def test_killed_generation_and_environment_actors_are_replaced_and_every_step_is_unchanged(ray_cluster, tmp_path, monkeypatch):
    from nemo_like.models.generation.hf import HFGeneration
    from nemo_like.utils.run_control import RunControl

    waited: list[bool] = []  # set-up waits for the engine's start (its first call's deadline counted it: killed as hung)
    wait_ready = HFGeneration.wait_ready
    monkeypatch.setattr(HFGeneration, "wait_ready", lambda self: (waited.append(True), wait_ready(self))[1])
    progress: list[int] = []  # what the stall watchdog reads: a replacement is progress (its recovery was aborted as a stall)
    stage_finished = RunControl.stage_finished
    monkeypatch.setattr(RunControl, "stage_finished", lambda self: (progress.append(self.step), stage_finished(self))[1])
    straight = train(tiny_config(tmp_path / "straight", *REPLACED))
    assert waited == [True]
    setup_stages, progress[:] = len(progress), []
    # Two faults in one run: an environment actor dies under step 1's scoring ($NEMO_LIKE_FAULT_INJECTION), the HF
    # engine under step 2's generation (cluster.fault_injection).
    monkeypatch.setenv(faults.ENV_VAR, json.dumps({"role": "environment", "phase": "score", "step": 1, "action": "kill"}))
    kill_generation = ("cluster.fault_injection.step=2", "cluster.fault_injection.action=kill")
    started = time.monotonic()
    replaced = train(tiny_config(tmp_path / "replaced", *REPLACED, *kill_generation))
    print(f"faulted run: {time.monotonic() - started:.1f}s, {replaced[-1]['faults/seconds_lost']:.2f}s lost to 2 replacements")
    assert [r["step"] for r in replaced] == [1, 2, 3]  # step 3: the replaced engine takes the next refit too
    assert len(progress) == setup_stages + 2 and progress[setup_stages:] == [1, 2]  # one mark per replacement
    first, last = replaced[0], replaced[-1]
    assert first["faults/actor_restarts/environment"] == 1 and "faults/actor_restarts/generation" not in first
    assert (last["faults/actor_restarts/environment"], last["faults/actor_restarts/generation"]) == (1, 1)
    assert last["faults/retried_batches"] == 2 and last["faults/seconds_lost"] > 0
    assert not any(k.startswith("faults/") for r in straight for k in r)  # no death: no counters
    compared = [k for k in straight[0] if k.startswith("train/")]
    assert set(COMPARED) - {"train/gen_kl"} <= set(compared)
    for a, b in zip(straight, replaced, strict=True):
        for key in compared:
            assert a[key] == b[key], (a["step"], key)  # bitwise


def test_a_death_past_max_actor_restarts_stops_the_run_listing_every_cause(ray_cluster, tmp_path, monkeypatch):
    # Step 1's scoring hangs (cluster.fault_injection): past call_timeout_s the actor is killed and replaced; the
    # re-sent call's actor is then killed ($NEMO_LIKE_FAULT_INJECTION): with one replacement allowed, the run stops.
    monkeypatch.setenv(faults.ENV_VAR, json.dumps({"role": "environment", "phase": "score", "action": "kill"}))
    hang = ("role=environment", "phase=score", "action=hang")
    budget = ("max_actor_restarts=1", "call_timeout_s=3")
    cfg = tiny_config(
        tmp_path,
        *FAST,
        "grpo.max_num_steps=1",
        *(f"cluster.fault_tolerance.{k}" for k in budget),
        *(f"cluster.fault_injection.{k}" for k in hang),
    )
    with pytest.raises(ActorRestartsExhausted) as stopped:
        train(cfg)
    message = str(stopped.value)
    print(message)
    assert message.startswith("an actor died past cluster.fault_tolerance.max_actor_restarts=1 for role 'environment'")
    deaths = re.findall(
        r"^  (\d)\. step 1, environment:arithmetic rank 0 \(actor \w+\) during 'reward'(, re-send 1)?: (.+)$", message, re.M
    )
    assert [(n, retry) for n, retry, _ in deaths] == [("1", ""), ("2", ", re-send 1")], message
    assert deaths[0][2] == "no answer within cluster.fault_tolerance.call_timeout_s=3s (killed as hung)"
    assert "died" in deaths[1][2], message


def test_sigterm_and_ctrl_c_stop_an_eval_with_one_line_and_their_status(ray_cluster, tmp_path):
    """SIGTERM to `nemo-like eval` met Ray's native handler (an abort: a stack dump, status 134); Ctrl-C printed a
    traceback through ray.get, status 1. Its own private cluster, in a process of its own. It warns of another run alive
    on the machine (this process registers one), as a training run does."""
    for name, signum in (("SIGTERM", signal.SIGTERM), ("SIGINT", signal.SIGINT)):
        out = tmp_path / name
        with registered_run(tmp_path / "other-logs"):
            run = Run(tmp_path, f"eval.output_dir={out}", "eval.num_samples_per_prompt=16", command="eval")
            try:
                run.wait_for_line(r"^\[setup\] generation backend", 120)  # its cluster is up; sampling begins
                time.sleep(2.0)  # inside ray.get, which re-raises the handler's exception as a plain KeyboardInterrupt
                run.signal(signum)
                status = run.finish(60)
            finally:
                run.cleanup()
        shared = re.search(rf"nemo-like runs? (is|are) alive on this machine \(.*pid {os.getpid()}, started .*", run.output)
        assert shared and shared.group(0).endswith("give each run its share: policy.generation.num_threads_per_worker=1"), run.output
        assert status == 128 + signum, run.output
        assert run.output.splitlines()[-1] == f"nemo-like: stopped by {name} (exit status {128 + signum})", run.output
        assert "Traceback" not in run.output and "received at time" not in run.output
        assert not (out / "summary.json").exists() and not (out / "results.jsonl").exists()
