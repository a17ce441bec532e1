"""The catalogue of user errors: each ends with one message naming the key and the fix, no traceback,
a non-zero exit, before any actor starts. Every case runs the real CLI (``nemo_like.cli.main``, or a
subprocess where the case starts Ray) on real files and directories."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest

from nemo_like.cli import main
from nemo_like.config import load_config

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "configs" / "grpo_tiny_cpu.yaml"


def run_cli(capsys, tmp_path: Path, *overrides: str) -> tuple[int, str]:
    """``nemo-like train`` on the tiny recipe, logging under ``tmp_path`` unless overridden."""
    code = main(
        [
            "train",
            "--config",
            str(TINY),
            f"logger.log_dir={tmp_path / 'logs'}",
            "logger.progress_bar=false",
            "logger.plot_at_end=false",
            *overrides,
        ]
    )
    return code, capsys.readouterr().err


def assert_clean(code: int, err: str, expected_code: int, *named: str) -> None:
    assert code == expected_code, err
    assert "Traceback" not in err, err
    assert err.count("nemo-like: error:") == 1, err
    for text in named:
        assert text in err, f"{text!r} not in: {err}"


# -- config time ----------------------------------------------------------------------------------


def test_multi_turn_contradictions_are_config_errors(capsys, tmp_path):
    from nemo_like.config import ConfigError, load_config

    code, err = run_cli(capsys, tmp_path, "grpo.max_rollout_turns=3", "policy.max_total_sequence_length=8")
    assert_clean(code, err, 2, "grpo.max_rollout_turns=3", "policy.max_total_sequence_length (8)")
    shaping = ("grpo.reward_shaping.enabled=true", "grpo.reward_shaping.overlong_buffer_length=4")
    with pytest.raises(ConfigError, match="grpo.reward_shaping.max_response_length"):
        load_config(TINY, ["grpo.max_rollout_turns=3", "policy.max_total_sequence_length=96", *shaping])
    with pytest.raises(ConfigError, match="grpo.max_rollout_turns"):
        load_config(TINY, ["grpo.max_rollout_turns=0"])


def test_unknown_plugin_names_fail_in_the_cli_before_anything_starts(capsys, tmp_path):
    # The schema keeps plain names; the CLI checks them after loading (check_plugin_names), --dry-run too.
    code, err = run_cli(capsys, tmp_path, "grpo.adv_estimator.name=rlo", "loss_fn.surrogate=cipso")
    assert_clean(code, err, 2, "grpo.adv_estimator.name: unknown advantage estimator 'rlo'. Did you mean 'rloo'?", "Did you mean 'cispo'?")
    assert not (tmp_path / "logs").exists()  # nothing started
    code = main(["train", "--dry-run", "--config", str(TINY), "loss_fn.reference_policy_kl_type=k33"])
    err = capsys.readouterr().err
    assert_clean(code, err, 2, "loss_fn.reference_policy_kl_type: unknown KL estimator 'k33'. Did you mean 'k3'?")


def test_reward_shaping_without_a_buffer_is_a_config_error(capsys, tmp_path):
    code, err = run_cli(capsys, tmp_path, "grpo.reward_shaping.enabled=true")
    assert_clean(code, err, 2, "grpo.reward_shaping.overlong_buffer_length", "policy.generation.max_new_tokens=8")
    assert not (tmp_path / "logs").exists()  # nothing started


def test_a_buffer_longer_than_the_response_budget_is_a_config_error(capsys, tmp_path):
    code, err = run_cli(capsys, tmp_path, "grpo.reward_shaping.enabled=true", "grpo.reward_shaping.overlong_buffer_length=9")
    assert_clean(code, err, 2, "grpo.reward_shaping.overlong_buffer_length=9", "policy.generation.max_new_tokens=8", "at most 8")
    code, err = run_cli(
        capsys,
        tmp_path,
        "grpo.reward_shaping.enabled=true",
        "grpo.reward_shaping.overlong_buffer_length=9",
        "grpo.reward_shaping.max_response_length=6",
    )
    assert_clean(code, err, 2, "grpo.reward_shaping.max_response_length=6", "at most 6")


# -- before anything starts: the model and the directories -----------------------------------------


def test_a_missing_model_directory_names_the_key_and_the_path(capsys, tmp_path):
    code, err = run_cli(capsys, tmp_path, "policy.model_name=/nonexistent/dir")
    assert_clean(code, err, 2, "policy.model_name='/nonexistent/dir'", "does not exist", "local model directory")
    assert len(err.strip().splitlines()) == 1


def test_a_run_refused_at_set_up_removes_the_directories_it_created_and_keeps_existing_ones(capsys, tmp_path):
    """The tokenizer is loaded after logging starts: the refused run left config.yaml, an empty metrics.jsonl and lock
    files in directories it had created, which read as a run that had started."""
    import shutil

    model = tmp_path / "model"  # a model's config and weights, no tokenizer
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(REPO / "nemo_like" / "assets" / "tiny-arith-qwen2" / name, model)
    new = tmp_path / "new" / "logs"
    code, err = run_cli(capsys, tmp_path, f"policy.model_name={model}", f"logger.log_dir={new}", f"checkpointing.checkpoint_dir={new}/ckpt")
    assert_clean(code, err, 2, f"policy.tokenizer_name={str(model)!r}", "holds no tokenizer")  # the recipe's ${policy.model_name}
    assert "logging to" in err and not (tmp_path / "new").exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    code, err = run_cli(
        capsys, tmp_path, f"policy.model_name={model}", f"logger.log_dir={existing}", f"checkpointing.checkpoint_dir={existing}/ckpt"
    )
    assert code == 2 and (existing / "notes.txt").read_text() == "mine" and not (existing / "ckpt").exists()
    # a directory it created above its own, which another run (a sweep's sibling) has written into since, stays
    from nemo_like.utils.preflight import clear_refused_run, directories_to_create, remove_empty_dirs

    sweep = tmp_path / "sweep"
    created = directories_to_create([sweep / "run_b" / "logs", sweep / "run_b" / "ckpt"])
    assert created[-1] == sweep and set(created) == {sweep, sweep / "run_b", sweep / "run_b" / "logs", sweep / "run_b" / "ckpt"}
    for directory in created:
        directory.mkdir(parents=True, exist_ok=True)
    (sweep / "run_a").mkdir()
    (sweep / "run_a" / "config.yaml").write_text("a sibling's")
    (sweep / "run_b" / "logs" / "config.yaml").write_text("b's")
    clear_refused_run([sweep / "run_b" / "logs"])
    remove_empty_dirs(created)
    assert not (sweep / "run_b").exists() and (sweep / "run_a" / "config.yaml").read_text() == "a sibling's"


def test_a_hub_id_offline_and_not_cached_says_how_to_use_a_local_copy(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    code, err = run_cli(capsys, tmp_path, "policy.model_name=Qwen/Qwen2.5-0.5B")
    assert_clean(
        code,
        err,
        2,
        "policy.model_name='Qwen/Qwen2.5-0.5B'",
        "offline (HF_HUB_OFFLINE=1)",
        "not in the local cache",
        "set policy.model_name=DIR (a local directory path)",
    )


def test_a_hub_id_with_no_network_fails_at_once_instead_of_hanging(capsys, tmp_path, unreachable_hub):
    code, err = run_cli(capsys, tmp_path, "policy.model_name=Qwen/Qwen2.5-0.5B")
    assert_clean(code, err, 2, "policy.model_name='Qwen/Qwen2.5-0.5B'", f"{unreachable_hub} is unreachable", "local directory path")


@pytest.mark.parametrize("key", ["logger.log_dir", "checkpointing.checkpoint_dir"])
def test_an_unwritable_run_directory_names_the_key(capsys, tmp_path, key):
    extra = ["checkpointing.enabled=true", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}"]
    code, err = run_cli(capsys, tmp_path, *extra, f"{key}=/proc/x")
    assert_clean(code, err, 2, f"{key}='/proc/x' is not a writable directory")
    (tmp_path / "a_file").write_text("")
    code, err = run_cli(capsys, tmp_path, *extra, f"{key}={tmp_path / 'a_file' / 'sub'}")
    assert_clean(code, err, 2, f"{key}=", "is not a writable directory", "Not a directory")


def test_a_run_directory_on_a_full_device_names_the_key(capsys, tmp_path):
    """An empty scratch file can be created on a full device: the check passed and a resume died in the run lock's
    first write (an OSError traceback). A 64 KiB tmpfs filled to the last block stands in for the full disk."""
    device = tmp_path / "full"
    device.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(device)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        with contextlib.suppress(OSError), open(device / "filler", "wb") as filler:
            filler.write(b"\0" * 128 * 1024)  # more than fits: the device is full
        code, err = run_cli(capsys, tmp_path, f"logger.log_dir={device / 'logs'}")
        assert_clean(code, err, 2, f"logger.log_dir='{device / 'logs'}' is not a writable directory", "No space left on device")
    finally:
        subprocess.run(["umount", "--lazy", str(device)], check=True)  # lazy: a failed run may still hold a file open there


# -- run errors that need a cluster (the session cluster: 4 logical CPUs, no GPU) ------------------------------


@pytest.mark.slow
def test_a_gpu_recipe_on_a_machine_without_gpus_fails_before_any_actor_starts(ray_cluster, capsys, tmp_path):
    """On the session cluster (it started a private one in a subprocess: 20 s of a suite run for this one refusal)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    code, err = run_cli(capsys, tmp_path, "cluster.gpus_per_node=8")
    assert_clean(code, err, 1, "short by GPU 8", "cluster.gpus_per_node", "0 GPUs found")
    assert "actors ready" not in err


@pytest.mark.slow
def test_dynamic_sampling_that_finds_no_signal_stops_with_the_key_and_the_fixes(ray_cluster, capsys, tmp_path):
    code, err = run_cli(
        capsys,
        tmp_path,
        "grpo.use_dynamic_sampling=true",
        "grpo.dynamic_sampling_max_gen_batches=1",
        # operator.is_(response, answer) is always False: every reward is 0, so no group has signal.
        "+env.arithmetic.custom_reward_fn=operator:is_",
        "grpo.val_at_start=false",
        "grpo.num_prompts_per_step=2",
        "grpo.num_generations_per_prompt=2",
        "loss_fn.reference_policy_kl_penalty=0",
        "policy.num_cpus_per_worker=0.25",
        "data.train.num_problems=16",
        "grpo.max_val_samples=4",
    )
    assert_clean(
        code,
        err,
        1,
        "grpo.dynamic_sampling_max_gen_batches=1",
        "Raise grpo.dynamic_sampling_max_gen_batches",
        "grpo.use_dynamic_sampling=false",
        "0/2 prompt groups",
    )


def test_recipe_and_override_mistakes_name_the_file_the_key_and_the_fix(capsys, tmp_path, monkeypatch):
    """A recipe this user cannot read was a PermissionError traceback; a section left empty in a child recipe
    (``grpo:`` with its keys commented out) or set to null on the command line dropped every key the recipes before it
    gave, and the error blamed an interpolation of another key (or an empty ``env:`` became the default arithmetic
    one); a value Hydra reads only quoted (``You're``, ``~/runs``) got its lexer's caret under the wrong character and
    no word about quoting; ``--config=~/r.yaml`` (no shell expands ``~`` after ``=``) was looked for under ``./~``."""

    def train(*args: str) -> tuple[int, str]:
        return main(["train", "--dry-run", *args]), capsys.readouterr().err

    child = tmp_path / "child.yaml"
    child.write_text(f"defaults: {TINY}\ngrpo:\n  # max_num_steps: 10\n")
    code, err = train("--config", str(child))
    assert_clean(code, err, 2, f"{child}: 'grpo' is empty (null), which would drop the whole section", "write 'grpo: {}'")
    child.write_text(f"defaults: {TINY}\npolicy:\n  generation: 5\n")
    code, err = train("--config", str(child))
    assert_clean(code, err, 2, f"{child}: 'policy.generation' is 5, not a mapping")
    code, err = run_cli(capsys, tmp_path, "env=null")
    assert_clean(code, err, 2, "Override 'env=null': 'env' is a section (arithmetic), which null would replace whole")
    code, err = run_cli(capsys, tmp_path, "policy.optimizer=adamw")
    assert_clean(code, err, 2, "Override 'policy.optimizer=adamw': 'policy.optimizer' is a section (")
    parent = tmp_path / "parent.yaml"  # the file that holds the null is named, not the recipe given
    parent.write_text(f"defaults: {TINY}\nlogger:\n")
    child.write_text("defaults: parent.yaml\n")
    code, err = train("--config", str(child))
    assert_clean(code, err, 2, f"{parent}: 'logger' is empty (null)")
    # what still sets a section or a key below one without a mapping: {} (keeps it), an interpolation of another
    # section, a free-form environment key (a tool list over a parent's tool mapping)
    parent.write_text(f"defaults: {TINY}\nenv:\n  arithmetic:\n    tools: {{calc: calculator}}\n")
    child.write_text("defaults: parent.yaml\ngrpo: {}\ndata:\n  validation: ${data.train}\nenv:\n  arithmetic:\n    tools: [calculator]\n")
    config = load_config(child, ["data.validation=${data.train}"])
    assert config.grpo.max_num_steps == 100 and config.data.validation.seed == config.data.train.seed
    assert config.env["arithmetic"].model_dump()["tools"] == ["calculator"]
    code, err = run_cli(capsys, tmp_path, "data.system_prompt=You're a calculator")
    assert_clean(code, err, 2, """quote the value: data.system_prompt="You're a calculator" (in a shell: """)
    code, err = run_cli(capsys, tmp_path, "logger.log_dir=/Users/José/ML (old)/runs")  # a laptop's path: no hint before
    assert_clean(code, err, 2, """quote the value: logger.log_dir='/Users/José/ML (old)/runs' (in a shell: "logger""")
    assert main(["train", "--dry-run", "data.system_prompt='Réponds en français, 中文.'"]) == 0
    assert "system_prompt: Réponds en français, 中文." in capsys.readouterr().out  # it read "R\xE9ponds en fran\xE7ais"
    for typo in ("grpo.max_num_steps=int(3", "logger.log_dir=${oc.env:HOME"):  # a typo in a call: quoting makes it text
        code, err = run_cli(capsys, tmp_path, typo)
        assert_clean(code, err, 2, f"Cannot parse override '{typo}'\n")
    code, err = run_cli(capsys, tmp_path, "logger.log_dir=~/runs/x")
    assert_clean(code, err, 2, "no shell expands '~' after '=': write logger.log_dir=$HOME/runs/x")
    caret = err.splitlines()[1:3]  # Hydra's own line, the caret under its '~'
    assert caret[0].startswith("LexerNoViableAltException: ") and caret[0][caret[1].index("^")] == "~", caret
    code, err = train("--config", "/proc/self/mem")  # a regular file no read() can take
    assert_clean(code, err, 2, f"Cannot read recipe /proc/{os.getpid()}/mem: ")  # resolved: self is this process
    assert main(["plot", "/proc/self/mem"]) == 2
    assert "cannot read /proc/self/mem: " in capsys.readouterr().err  # it said "cannot write the plot"
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "mine.yaml").write_text(f"defaults: {TINY}\ngrpo:\n  max_num_steps: 7\n")
    assert main(["train", "--dry-run", "--config=~/mine.yaml"]) == 0
    assert "max_num_steps: 7" in capsys.readouterr().out
