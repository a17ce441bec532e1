"""Checkpoints on real runs: exact resume (across runs, and through a run restart after a killed policy worker), a SIGKILL
mid-save, a non-finite guard."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from functional.helpers import TINY_RECIPE, ckpt_overrides, read_metrics, tensorboard_session_status, tiny_config
from safetensors.torch import load_file

from nemo_like.algorithms.grpo import NonFiniteTrainingError
from nemo_like.train import train
from nemo_like.utils.run_lock import LOCK_FILE

pytestmark = pytest.mark.slow

NO_VALIDATION = ("grpo.val_at_start=false", "grpo.val_at_end=false", "grpo.val_period=0")


def run(tmp_path, *overrides):
    cfg = tiny_config(tmp_path, *overrides)
    return train(cfg)


def test_six_steps_equal_three_steps_then_three_resumed_through_a_killed_policy_worker(ray_cluster, tmp_path, capfd, monkeypatch):
    """Resume across runs, and a run restart in process: the resumed run's policy worker dies (injected kill, its
    process exits) in step 6, after it saved step 4 and logged step 5; the restarted attempt's new worker dies too, while
    it starts (its first call); the second restart resumes from step_4 again, redoes 5 and 6, and every step equals the
    straight run's bitwise, each logged once."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    run(straight, "grpo.max_num_steps=6", *NO_VALIDATION, *ckpt_overrides(straight / "ckpt"))
    first = run(split, "grpo.max_num_steps=3", *NO_VALIDATION, *ckpt_overrides(split / "ckpt"))
    capfd.readouterr()
    kill = ("cluster.fault_injection.role=policy", "cluster.fault_injection.phase=train", "cluster.fault_injection.step=6")
    monkeypatch.setenv("NEMO_LIKE_FAULT_INJECTION", json.dumps({"role": "policy", "phase": "setup", "step": 6, "action": "kill"}))
    resumed = run(
        split, "grpo.max_num_steps=6", *NO_VALIDATION, *ckpt_overrides(split / "ckpt", 2), *kill, "cluster.fault_injection.action=kill"
    )
    err = capfd.readouterr().err
    print("\n".join(line for line in err.splitlines() if line.startswith(("[restart]", "[setup] actors ready"))))
    assert re.search(
        r"\[restart\] the policy worker died in step 6: Ray actor \w+ died during 'policy: training'.*restart 1 of "
        r"cluster.fault_tolerance.max_restarts=2\), resuming from \S+step_4 \(step 4\)",
        err,
    ), err
    assert re.search(  # the restarted attempt's worker, killed while it started: a death within the budget too
        r"\[restart\] the policy worker died in step 6: Ray actor \w+ died during 'policy: parameter counts'.*restart 2 of "
        r"cluster.fault_tolerance.max_restarts=2\), resuming from \S+step_4 \(step 4\)",
        err,
    ), err
    assert [h["step"] for h in first] == [1, 2, 3] and [h["step"] for h in resumed] == [4, 5, 6]
    a, b = read_metrics(straight / "logs"), read_metrics(split / "logs")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]  # step 5 of the killed attempt was dropped, redone once
    assert [r.get("faults/run_restarts") for r in b] == [None, None, None, None, 2.0, 2.0]
    assert [h.get("faults/run_restarts") for h in resumed] == [None, 2.0, 2.0]
    compared = 0
    for ra, rb in zip(a, b):
        keys = sorted(k for k in ra if k.startswith("train/"))
        assert {"train/reward", "train/loss", "train/gen_kl", "train/grad_norm"} <= set(keys)
        for key in keys:
            assert ra[key] == rb[key], (ra["step"], key)  # bitwise: CPU fp32 is deterministic here
            compared += 1
    print(f"bitwise equal: {compared} train/ values over 6 steps")
    wa = load_file(str(straight / "ckpt" / "step_6" / "policy" / "model.safetensors"))
    wb = load_file(str(split / "ckpt" / "step_6" / "policy" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nemo_like.models.loading import load_tokenizer

    # A plain HF copy of the trained weights: transformers fills a missing tensor with a random one and only logs it
    copy, info = AutoModelForCausalLM.from_pretrained(straight / "ckpt" / "step_6" / "policy", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    loaded = copy.state_dict()
    assert all(torch.equal(loaded[k], wa[k]) for k in wa) and copy.generation_config.eos_token_id == 2
    # ... with the run's tokenizer beside it (AutoTokenizer made an empty one of the folder: every text encoded as []).
    saved, run_tokenizer = (
        AutoTokenizer.from_pretrained(straight / "ckpt" / "step_6" / "policy"),
        load_tokenizer("embedded:tiny-arith-qwen2"),
    )
    text = [{"role": "user", "content": "What is 12 plus 7?"}]
    assert saved.apply_chat_template(text, tokenize=False) == run_tokenizer.apply_chat_template(text, tokenize=False)
    assert saved("What is 12 plus 7?")["input_ids"] == run_tokenizer("What is 12 plus 7?")["input_ids"] != []


def test_incompatible_checkpoint_is_refused_naming_the_keys(ray_cluster, tmp_path):
    from nemo_like.utils.checkpoint import VALIDATED_AT_STEP, CheckpointError, CheckpointManager

    validate_at_start = ("grpo.val_at_start=true", "grpo.val_at_end=false", "grpo.val_period=0", "grpo.max_val_samples=16")
    (start, _) = run(tmp_path, "grpo.max_num_steps=1", *validate_at_start, *ckpt_overrides(tmp_path / "ckpt", 1))
    # step 0's validation measured the initial weights, which no checkpoint holds: not carried into step 1's (best-k
    # would rank a never-validated checkpoint by the untrained model's score)
    saved = CheckpointManager(tmp_path / "ckpt").latest().state["metrics"]
    assert 0.0 <= start["validation/accuracy"] <= 1.0 and not any(k.startswith("validation/") for k in saved)

    with pytest.raises(CheckpointError, match="grpo.num_generations_per_prompt: 4 -> 2"):
        run(tmp_path, "grpo.max_num_steps=2", "grpo.num_generations_per_prompt=2", *NO_VALIDATION, *ckpt_overrides(tmp_path / "ckpt", 1))
    # Validation settings may change (the recipe ties data.validation.num_problems to grpo.max_val_samples: it was refused)
    resumed = run(tmp_path, "grpo.max_num_steps=2", "grpo.max_val_samples=16", *NO_VALIDATION, *ckpt_overrides(tmp_path / "ckpt", 1))
    assert [r["step"] for r in resumed] == [2]
    # At its last step without its end-of-run validation, a rerun that asks for one validates and saves (it started every
    # actor and did nothing); then the run is complete, and a rerun starts nothing
    validating = ("grpo.max_num_steps=2", "grpo.max_val_samples=16", "grpo.val_at_start=false", "grpo.val_period=0")
    (validated,) = run(tmp_path, *validating, *ckpt_overrides(tmp_path / "ckpt", 1))
    assert validated["step"] == 2 and 0.0 <= validated["validation/accuracy"] <= 1.0 and "train/loss" not in validated
    assert CheckpointManager(tmp_path / "ckpt").latest().state["metrics"][VALIDATED_AT_STEP] == 2.0
    assert run(tmp_path, *validating, *ckpt_overrides(tmp_path / "ckpt", 1)) == []


def short_ray_tmp() -> Path:
    """Ray's socket paths must stay under 107 bytes: pytest's tmp_path is too deep."""
    return Path(tempfile.mkdtemp(prefix="nlray", dir="/tmp"))


# The runs killed below test checkpoints and failure reports, not the engine: they run the CPU default (inline
# generation in the policy worker: no engine actor to start) without a KL penalty (no reference actor to start).
NO_REFERENCE = "loss_fn.reference_policy_kl_penalty=0"


def start_cli(tmp_path: Path, ray_tmp: Path, env_extra: dict, *overrides: str) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "nemo_like.cli",
        "train",
        "--config",
        str(TINY_RECIPE),
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        "grpo.max_val_samples=32",
        "policy.train_micro_batch_size=8",
        "policy.num_cpus_per_worker=0.25",
        "data.train.num_problems=256",
        f"logger.log_dir={tmp_path / 'logs'}",
        "logger.progress_bar=false",
        "logger.plot_at_end=false",
        NO_REFERENCE,
        *overrides,
    ]
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp), **env_extra}
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, text=True)


def wait_for(predicate, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"process exited early:\n{proc.stdout.read()}")
        time.sleep(0.2)
    raise AssertionError("timed out")


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def test_sigkill_during_a_save_resumes_from_the_previous_checkpoint(ray_cluster, tmp_path):
    ckpt = tmp_path / "ckpt"
    marker = tmp_path / "saving"
    ray_tmp = short_ray_tmp()
    proc = start_cli(
        tmp_path,
        ray_tmp,
        {"NEMO_LIKE_CHECKPOINT_PAUSE_S": "60", "NEMO_LIKE_CHECKPOINT_PAUSE_STEP": "2", "NEMO_LIKE_CHECKPOINT_PAUSE_MARKER": str(marker)},
        "grpo.max_num_steps=3",
        *NO_VALIDATION,
        *ckpt_overrides(ckpt, 1),
    )
    try:
        wait_for(marker.exists, 180, proc)
        assert any(p.name.startswith(".tmp_step_2") for p in ckpt.iterdir())  # the save is in flight
    finally:
        kill_group(proc)
        kill_cluster(ray_tmp)
    assert (ckpt / "step_1" / "trainer_state.json").exists() and not (ckpt / "step_2").exists()
    # The killed driver's run lock is stale: taken over with a warning naming it (see test_run_lock.py).
    with pytest.warns(RuntimeWarning, match=rf"taking over the lock of a run that is gone \(pid {proc.pid} on host"):
        history = run(tmp_path, "grpo.max_num_steps=3", NO_REFERENCE, *NO_VALIDATION, *ckpt_overrides(ckpt, 1))
    assert [h["step"] for h in history] == [2, 3]  # resumed after step 1
    assert sorted(p.name for p in ckpt.iterdir() if p.name != LOCK_FILE) == ["step_1", "step_2", "step_3"]  # partial save removed


def cluster_pids(ray_tmp: Path, title_prefix: bytes = b"") -> list[int]:
    """PIDs of the processes of the Ray cluster whose temp dir is ``ray_tmp`` (unique per test)."""
    pids = []
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit() or int(proc_dir.name) == os.getpid():
            continue
        try:
            cmdline = (proc_dir / "cmdline").read_bytes()
            environ = (proc_dir / "environ").read_bytes()
        except OSError:
            continue
        mine = str(ray_tmp).encode() in cmdline or str(ray_tmp).encode() in environ
        if mine and cmdline.startswith(title_prefix):
            pids.append(int(proc_dir.name))
    return pids


def kill_cluster(ray_tmp: Path) -> None:
    """SIGKILL whatever a killed driver's private cluster left behind, and remove its temp dir."""
    for pid in cluster_pids(ray_tmp):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(ray_tmp, ignore_errors=True)


def test_nonfinite_updates_are_skipped_and_the_run_stops_after_the_limit_across_a_resume(ray_cluster, tmp_path):
    """A huge learning rate makes the weights overflow after the first step: every later gradient is NaN. The run is
    split after step 2 (one skipped step): the resumed run carries the count (train/nonfinite_streak, saved with the
    checkpoint) and stops at step 3, as the whole run would; it used to restart the count and stop at step 4 (a
    requeued run reset it every time)."""
    nan = ("policy.optimizer.lr=1e30", "policy.max_grad_norm=null", "grpo.max_consecutive_nonfinite_steps=2", *NO_VALIDATION)
    run(tmp_path, "grpo.max_num_steps=2", *nan, *ckpt_overrides(tmp_path / "ckpt", 1))
    with pytest.raises(NonFiniteTrainingError, match="stopping at step 3 .*grpo.max_consecutive_nonfinite_steps=2"):
        run(tmp_path, "grpo.max_num_steps=8", *nan, *ckpt_overrides(tmp_path / "ckpt", 1), "logger.tensorboard_enabled=true")
    # The failed run is recorded as failed where a dashboard records an outcome (TensorBoard's HParams view said success)
    assert tensorboard_session_status(tmp_path / "logs") == "STATUS_FAILURE"
    logged = read_metrics(tmp_path / "logs")
    assert [r["step"] for r in logged] == [1, 2, 3]
    assert [r["train/nonfinite_steps_skipped"] for r in logged] == [0.0, 1.0, 1.0]
    assert [r["train/nonfinite_streak"] for r in logged] == [0.0, 1.0, 2.0]
