"""The `nemo-like` command line itself: the top-level help lists every command, `--version`, and the
invocations that mean `train` keep working. The help and version run the installed console script."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path

import pytest

from nemo_like.cli import COMMANDS, build_parser, main, package_version, pyproject_version

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "nemo-like"


DISTILL = Path(__file__).resolve().parents[2] / "examples" / "configs" / "distill_tiny_cpu.yaml"
TINY_CONFIG = REPO / "nemo_like" / "assets" / "tiny-arith-qwen2" / "config.json"
REWARD_CONFIG = REPO / "nemo_like" / "assets" / "tiny-reward-qwen2" / "config.json"


def nemo_like(*args: str) -> subprocess.CompletedProcess[str]:
    command = [str(SCRIPT)] if SCRIPT.is_file() else [sys.executable, "-m", "nemo_like.cli"]
    return subprocess.run([*command, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_every_command_is_in_commands() -> None:
    """The help's list is COMMANDS; the parser must have no command outside it."""
    sub = next(action for action in build_parser()._actions if action.dest == "command")
    assert sorted(sub.choices) == sorted(COMMANDS) == ["eval", "merge", "plan", "plot", "serve", "train"]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_top_level_help_lists_every_command_on_one_line(flag: str) -> None:
    result = nemo_like(flag)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("usage: nemo-like [-h] [--version] COMMAND [ARGS ...]\n"), out
    for name, summary in COMMANDS.items():
        lines = [line for line in out.splitlines() if re.match(rf"  {name} +\S", line)]
        assert lines == [f"  {name:<7}{summary}"], out  # one line, the whole summary on it
    assert "`nemo-like train --help`" in out
    assert "--config" not in out  # train's options are not the top-level help any more


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_has_its_own_help(name: str) -> None:
    result = nemo_like(name, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: nemo-like {name} [-h]"), result.stdout
    assert COMMANDS[name] in " ".join(result.stdout.split())  # its description (wrapped to the terminal)


def test_version_prints_the_package_version() -> None:
    result = nemo_like("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"nemo-like {version('nemo-like')}\n"
    assert package_version() == version("nemo-like")


def test_pyproject_version_is_the_fallback(tmp_path) -> None:
    checkout = pyproject_version(REPO / "pyproject.toml")
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", checkout), checkout
    assert checkout == version("nemo-like")  # the installed package is this checkout
    assert pyproject_version(tmp_path / "missing.toml") == "unknown"
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert pyproject_version(tmp_path / "pyproject.toml") == "unknown"


def test_unknown_command_is_a_usage_error() -> None:
    result = nemo_like("bogus")
    assert result.returncode == 2
    assert "invalid choice: 'bogus'" in result.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["--dry-run", "grpo.max_num_steps=3"],  # train's options without the word train
        ["grpo.max_num_steps=3", "--dry-run"],  # overrides first
        ["train", "--dry-run", "grpo.max_num_steps=3"],
        ["train", "grpo.seed=5", "--dry-run", "grpo.max_num_steps=3"],  # overrides on both sides of a flag
        ["grpo.max_num_steps=9", "--dry-run", "grpo.max_num_steps=3"],  # the later one wins
    ],
)
def test_implicit_train_still_works(argv: list[str], capsys) -> None:
    assert main(argv) == 0
    assert "  max_num_steps: 3\n" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv", [["train", "--dry-run", "--bogus=1"], ["train", "grpo.seed=1", "--dry-run", "bogus"], ["plot", "x.jsonl", "a=1"]]
)
def test_what_is_not_an_override_after_a_flag_is_still_refused(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_bad_arguments_of_plot_plan_merge_and_eval_exit_2_with_one_line(tmp_path, capsys) -> None:
    """Each gave a traceback (exit 1), or exit 0 having done nothing: an unknown metric plotted an empty panel, --mfu 0
    divided by zero, --out naming a file 'merged' into nothing, a missing checkpoint path went to the Hub as a repo id."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "train/reward": 0.5}\n')
    generation_config = tmp_path / "generation_config.json"  # each a traceback before (TypeError, JSONDecodeError, ...)
    generation_config.write_text('{"bos_token_id": 1, "eos_token_id": 2}')
    bert = tmp_path / "t5.json"
    bert.write_text('{"model_type": "t5", "d_model": 64, "num_layers": 2, "num_heads": 2, "d_ff": 128}')  # an encoder-decoder
    falcon = tmp_path / "falcon.json"  # a causal LM, laid out as transformer.h: it was called "not a causal language model"
    falcon.write_text('{"model_type": "falcon", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1, "vocab_size": 100}')
    for name, field, value in (("negative", "hidden_size", -896), ("no_layers", "num_hidden_layers", 0), ("fractional", "vocab_size", 1.5)):
        (tmp_path / f"{name}.json").write_text(json.dumps({**json.loads(Path(TINY_CONFIG).read_text()), field: value}))
    utf16 = tmp_path / "recipe.yaml"
    utf16.write_text("grpo:\n  seed: 1\n", encoding="utf-16")
    results = tmp_path / "results.jsonl"  # eval's per-sample file, plotted by mistake
    results.write_text('{"prompt_id": "0", "reward": 1.0}\n')
    (tmp_path / "afile").write_text("")
    mamba2 = tmp_path / "mamba2.json"  # as save_pretrained writes it: time_step_limit's infinity as {"__float__": "Infinity"}
    mamba2.write_text(
        '{"model_type": "mamba2", "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 4, "head_dim": 16, "time_step_limit": [0.0, {"__float__": "Infinity"}]}'
    )
    adapters = tmp_path / "my runs" / "step_2" / "policy"  # the merge command it prints must paste as one path
    adapters.mkdir(parents=True)
    (adapters / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    full = tmp_path / "step_3" / "policy"  # a full checkpoint's policy/: a plain HF model
    full.mkdir(parents=True)
    (full / "config.json").write_text("{}")
    (full / "model.safetensors").write_text("")
    cases = [
        (["plot", str(metrics), "--metrics", "train/rewrd"], "--metrics: ['train/rewrd'] not logged by the last run in"),
        (["plot", str(results)], "line 1 is not a metrics record (a JSON object with an integer 'step')"),  # KeyError
        (["plan", "--mfu", "0", "--peak-tflops", "100"], "--mfu must be in (0, 1], got 0"),
        (["plan", "--device-memory-gib", "-5"], "--device-memory-gib must be a finite number above 0"),
        # nan and inf passed (a plan that "fits" in nan GiB; a GPU recipe's traceback converting them to bytes)
        *[
            (["plan", flag, value], f"{flag} must be ")
            for flag in ("--device-memory-gib", "--peak-tflops", "--mfu")
            for value in ("nan", "inf")
        ],
        # plan said "fits: yes" (exit 0) for what train refuses before any actor starts (policy.model_name is here)
        (["plan", "policy.max_total_sequence_length=4096"], "is longer than embedded:tiny-arith-qwen2's context (256 positions"),
        (["plan", "policy.generation.stop_token_ids=[5000]"], "[5000] are outside embedded:tiny-arith-qwen2's vocabulary"),
        (["plan", "--model-config", str(generation_config)], "not a causal language model's config.json (it has no 'model_type')"),
        (["plan", "--model-config", str(tmp_path / "afile")], "not a causal language model's config.json (Expecting value"),
        (["plan", "--model-config", str(bert)], "not a causal language model's config.json (Unrecognized configuration class"),
        # a size that is not a positive integer: a torch traceback (negative), a plan of "short -38489 MiB" (0 layers)
        *[
            (["plan", "--model-config", str(shaped)], f"error: {shaped}: {field} must be a positive integer, got {value!r}")
            for shaped, field, value in (
                (tmp_path / "negative.json", "hidden_size", -896),
                (tmp_path / "no_layers.json", "num_hidden_layers", 0),
                (tmp_path / "fractional.json", "vocab_size", 1.5),
            )
        ],
        (["train", "--dry-run", "--config", str(utf16)], "is not UTF-8 text"),
        # plan ran train's checks of the models only on a config.json it found itself: with --model-config (the model
        # not here) or for a teacher it said "fits: yes" to what train refuses at once
        *[
            (["plan", "policy.model_name=acme/absent", "--model-config", str(config), *overrides], message)
            for config, overrides, message in (
                (TINY_CONFIG, ["policy.max_total_sequence_length=4096"], "is longer than acme/absent's context (256 positions"),
                (TINY_CONFIG, ["policy.generation.stop_token_ids=[5000]"], "[5000] are outside acme/absent's vocabulary"),
                (REWARD_CONFIG, [], "policy.model_name=acme/absent is not a causal language model (Qwen2ForSequenceClassification"),
            )
        ],
        (  # the student's tokenizer here but not its model: the teacher check read the model's config from the hub
            ["plan", "--config", str(DISTILL), "policy.model_name=acme/absent", "policy.tokenizer_name=embedded:tiny-arith-qwen2"],
            "policy.model_name='acme/absent': its config.json is not on this machine",
        ),
        (
            ["plan", "--config", str(DISTILL), "teacher.model_name=embedded:tiny-reward-qwen2"],
            "teacher.model_name=embedded:tiny-reward-qwen2 is not a causal language model",
        ),
        (
            ["plan", "--config", str(DISTILL), "teacher.model_name=acme/teacher", "--teacher-config", f"acme/teacher={REWARD_CONFIG}"],
            "teacher.model_name=acme/teacher is not a causal language model",
        ),
        # plan printed a plan (exit 0) for recipes train refuses at once, and ignored a --teacher-config of no teacher
        (["plan", "--teacher-config", f"nosuch={tmp_path / 'afile'}"], "--teacher-config nosuch=...: not a teacher model of this run"),
        (["merge", str(tmp_path), "--out", str(tmp_path / "afile")], "is a file; the merged model is a directory"),
        (
            ["merge", str(full.parent), "--out", str(tmp_path / "merged")],
            "holds no LoRA adapter (adapter_config.json is missing): it is a full model already",
        ),
        (["eval", "eval.model_path=results/grpo/step_50"], "eval.model_path='results/grpo/step_50'"),
        (["eval", f"eval.output_dir={tmp_path / 'afile'}"], "eval.output_dir="),  # a file there: FileExistsError
        (["serve", "eval.model_path=results/grpo/step_50"], "does not exist"),
        # serve and eval loaded a bad model or tokenizer path straight away: a transformers traceback (exit 1); eval named
        # eval.model_path for a bad policy.model_name it had not been given
        (["serve", f"policy.model_name={tmp_path / 'gone'}"], "policy.model_name="),
        (["serve", f"policy.tokenizer_name={tmp_path / 'gone'}"], "policy.tokenizer_name="),
        (["eval", f"policy.tokenizer_name={tmp_path / 'gone'}"], "policy.tokenizer_name="),
        (["eval", f"policy.model_name={tmp_path / 'gone'}"], "policy.model_name="),
        (["plot", str(metrics), "--out", "/proc/x.png"], "cannot write the plot /proc/x.png: "),  # savefig's OSError: a traceback
        # a LoRA checkpoint's policy/ (adapters only) as the model to train loaded frozen ("optimizer got an empty
        # parameter list") and vLLM refused it, after the actors started; plan said its config.json was not here
        *[
            (
                [command, f"policy.model_name={adapters}", f"logger.log_dir={tmp_path}"],
                f"is a LoRA checkpoint (adapters only, adapter_config.json): merge it into a whole model first (`nemo-like merge '{adapters}' --out DIR`)",
            )
            for command in ("train", "plan")
        ],
        # a teacher.by_task model was never checked early: an unknown embedded: name was a traceback, a bad path blamed
        # teacher.model_name
        (
            [
                "train",
                "--config",
                str(DISTILL),
                "+teacher.by_task.arithmetic=embedded:nope",
                "teacher.model_name=null",
                f"logger.log_dir={tmp_path}",
            ],
            "teacher.by_task.arithmetic: 'embedded:nope' is not a shipped model",
        ),
        (
            [
                "train",
                "--config",
                str(DISTILL),
                f"+teacher.by_task.arithmetic={tmp_path / 'gone'}",
                "teacher.model_name=null",
                f"logger.log_dir={tmp_path}",
            ],
            "teacher.by_task.arithmetic=",
        ),
    ]
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    # A port in use (or privileged) raised OSError after the model had loaded: a traceback.
    cases.append((["serve", "--port", str(port)], f"--port {port}: cannot listen on 127.0.0.1:{port} (Address already in use)"))
    try:
        for args, message in cases:
            assert main(args) == 2, args
            err = capsys.readouterr().err
            assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (args, err)
    finally:
        taken.close()
    # a causal LM laid out as transformer.h (it was called "not a causal language model"), and a Mamba-2 config as
    # save_pretrained writes it (read as plain JSON it was refused: "Validation error ... time_step_limit"): planned
    assert main(["plan", "--model-config", str(falcon)]) == 0
    assert "not planned: the memory of every role and the fit (" in (out := capsys.readouterr().out) and "FalconForCausalLM" in out
    assert main(["plan", "--model-config", str(mamba2)]) == 0 and "[plan] memory policy x1:" in capsys.readouterr().out
    for key in ("logger.log_dir", "checkpointing.checkpoint_dir"):  # empty: the run wrote its logs, lock, steps into cwd
        assert main(["train", "--dry-run", f"{key}="]) == 2
        assert f"{key}: String should have at least 1 character" in capsys.readouterr().err
    assert main(["plan", "grpo.adv_estimator.name=grpoo"]) == 2  # plan printed a plan, exit 0, for what train refuses
    assert "unknown advantage estimator 'grpoo'" in capsys.readouterr().err
    assert main(["plan", "--mfu", "0.5"]) == 0  # no step time without --peak-tflops: --mfu did nothing, silently
    assert "--mfu has no effect without --peak-tflops" in capsys.readouterr().err
    with pytest.raises(SystemExit) as out_of_range:  # argparse's own error (OverflowError from bind() before)
        main(["serve", "--port", "70000"])
    assert out_of_range.value.code == 2 and "expected a port number 0..65535, got 70000" in capsys.readouterr().err


def test_plot_out_is_the_file_it_writes(tmp_path, capsys, monkeypatch) -> None:
    """``--out figs`` printed ``figs`` and wrote ``figs.png`` (beside the directory ``figs`` when it was one); ``--out=~/x``
    (a ~ the shell leaves alone) wrote ``./~/x.png``."""
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("HOME", str(tmp_path))
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(f'{{"step": {s}, "train/reward": {s / 4}}}\n' for s in (1, 2)))
    (tmp_path / "figs").mkdir()
    cases = [
        (str(tmp_path / "figs"), tmp_path / "figs" / "metrics.png"),
        (str(tmp_path / "panel"), tmp_path / "panel.png"),
        (f"{tmp_path / 'new'}/", tmp_path / "new" / "metrics.png"),  # a new directory, named as one: was new.png
        ("~/tilde", tmp_path / "tilde.png"),
    ]
    for out, written in cases:
        assert main(["plot", str(metrics), "--out", out]) == 0
        assert str(written) in capsys.readouterr().out and written.is_file()
    assert not (tmp_path / "figs.png").exists()


def test_plan_of_a_multi_turn_recipe_names_the_turns_end_ids_a_run_reads(capsys) -> None:
    """`nemo-like plan` printed `end-of-turn ids []` where the run plans the tokenizer's eos ([2] on the shipped model)."""
    from nemo_like.cli import main

    assert main(["plan", "--config", "examples/configs/grpo_multiturn_tiny_cpu.yaml"]) == 0
    assert "multi-turn: up to 2 model turns per sample, end-of-turn ids [2]" in capsys.readouterr().out


def test_plan_checks_a_cached_hub_model_and_names_an_unreadable_config(tmp_path, capsys, monkeypatch) -> None:
    """plan ran train's checks only for a directory named as such: a hub id cached on this machine (every Qwen recipe's
    model once fetched) got "fits" for a context train refuses; a model directory with a config.json transformers
    cannot read was a traceback in the check (one line naming the file before it ran)."""
    import http.server
    import json
    import os
    import shutil
    import threading

    from nemo_like.models.loading import resolve_model_path

    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "abc"
    shutil.copytree(resolve_model_path("embedded:tiny-arith-qwen2"), snapshot)
    (tmp_path / "hub" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny" / "refs" / "main").write_text("abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["plan", "policy.model_name=acme/tiny", "policy.max_total_sequence_length=4096"]) == 2
    assert "is longer than acme/tiny's context (256 positions" in capsys.readouterr().err
    # With the hub reachable (HF_HUB_OFFLINE unset) plan still reads the cached copy and asks the hub nothing: a logging
    # stand-in for the hub saw the LoRA target check's config request.
    requests: list[str] = []

    class Hub(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            requests.append(self.path)
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *args) -> None:
            pass

    hub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_ENDPOINT": f"http://127.0.0.1:{hub.server_address[1]}"}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    try:
        online = subprocess.run(
            [sys.executable, "-m", "nemo_like.cli", "plan", "policy.model_name=acme/tiny", "policy.lora_cfg.enabled=true"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        hub.shutdown()
    assert online.returncode == 0 and requests == [], (online.stderr[-2000:], requests)
    unknown = tmp_path / "unknown"
    shutil.copytree(snapshot, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "qwen9"}))
    assert main(["plan", f"policy.model_name={unknown}"]) == 2
    err = capsys.readouterr().err
    assert f"cannot read its config.json {unknown / 'config.json'}" in err and "Traceback" not in err
    # a field transformers' strict validation refuses (huggingface_hub's own error class, not a ValueError)
    (unknown / "config.json").write_text(json.dumps({**config, "num_key_value_heads": "2"}))
    assert main(["plan", f"policy.model_name={unknown}", "policy.lora_cfg.enabled=true"]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_the_projects_warnings_are_one_line_and_plan_prints_the_turns_warning(capsys) -> None:
    """Set-up's warnings came with Python's source location and code line; plan did not print the no-effect line of
    grpo.max_rollout_turns for a single-turn environment that train prints."""
    import warnings

    from nemo_like.cli import PACKAGE_DIR, format_warning

    assert format_warning("the env is idle", RuntimeWarning, str(PACKAGE_DIR / "train.py"), 281) == "warning: the env is idle\n"
    assert format_warning("old", DeprecationWarning, warnings.__file__, 3).startswith(f"{warnings.__file__}:3: DeprecationWarning: old")
    assert main(["plan", "grpo.max_rollout_turns=2"]) == 0
    assert warnings.formatwarning is not format_warning  # restored for in-process callers (pytest's summary uses it)
    err = capsys.readouterr().err
    assert "[plan] warning: grpo.max_rollout_turns=2 has no effect for env.arithmetic: it is single-turn" in err
    assert "(it still turns grpo.overlap_scoring off" in err
    # the engine keys the chosen backend ignores: train warned when it built the engine, plan said nothing
    assert main(["plan", "policy.generation.num_threads_per_worker=1", "policy.generation.vllm_cfg.kv_cache_space_gib=2"]) == 0
    err = capsys.readouterr().err
    assert "[plan] warning: policy.generation.num_threads_per_worker=1 has no effect with inline generation" in err
    assert "[plan] warning: policy.generation.vllm_cfg.kv_cache_space_gib has no effect with inline generation" in err
    # a split without a prompt source: train refuses it when it loads the data, plan (which loads none) had passed it
    assert main(["plan", "data.dataset_name=null", "data.validation.data_path=val.jsonl"]) == 2
    assert "data.train: no prompt source. Set data.train.data_path" in capsys.readouterr().err


def test_plan_warns_when_model_config_describes_another_model_than_the_one_here(tmp_path, capsys) -> None:
    """--model-config for a model whose own config.json is here replaced it without a word: the plan described another
    model than the run trains. Now a warning names the fields that differ, or says the flag changes nothing."""
    import json

    from nemo_like.models.loading import local_config_file

    own = json.loads(local_config_file("embedded:tiny-arith-qwen2").read_text())
    same, wider = tmp_path / "same.json", tmp_path / "wider.json"
    same.write_text(json.dumps(own))
    wider.write_text(json.dumps({**own, "hidden_size": 4 * own["hidden_size"]}))
    assert main(["plan", "--model-config", str(wider)]) == 0
    err = capsys.readouterr().err
    assert f"--model-config {wider} describes another model than policy.model_name='embedded:tiny-arith-qwen2'" in err
    assert f"hidden_size {4 * own['hidden_size']} (the model's: {own['hidden_size']})" in err
    assert main(["plan", "--model-config", str(same)]) == 0
    assert f"--model-config {same} has no effect" in capsys.readouterr().err
    explicit = tmp_path / "explicit.json"  # a default written out is the same model (compared as transformers reads it)
    explicit.write_text(json.dumps({**own, "head_dim": own["hidden_size"] // own["num_attention_heads"]}))
    assert main(["plan", "--model-config", str(explicit)]) == 0
    assert f"--model-config {explicit} has no effect" in capsys.readouterr().err


def test_a_judge_whose_layout_the_plan_cannot_lay_out_is_not_said_unread(tmp_path) -> None:
    from transformers import FalconConfig

    from nemo_like.models.footprint import scorer_roles
    from nemo_like.plan.memory import JudgeSpec

    FalconConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, vocab_size=100).save_pretrained(tmp_path / "falcon")
    spec = JudgeSpec("judge:t", str(tmp_path / "falcon"), "float32", 1, 0.0, "hf", 8, 64, "", 1, 0.5)
    roles, (line,) = scorer_roles([spec])
    assert not roles and "the memory plan cannot lay out FalconForCausalLM" in line and "was not read" not in line
    assert "was not read" in scorer_roles([replace(spec, model_name=str(tmp_path / "nothing"))])[1][0]


def test_plan_counts_the_reward_models_and_the_judges(capsys) -> None:
    """`nemo-like plan` printed the same memory for a recipe that loads a reward model and a judge as for one that
    loads neither, without a word; a reward model and a judge (a task's own, or a composite's source) are now roles of
    the plan, in the node's RAM with the others."""
    from nemo_like.cli import main

    assert main(["plan", "--config", "examples/configs/grpo_tiny_rewards_cpu.yaml"]) == 0
    out = capsys.readouterr().out
    assert "[plan] memory reward_model:arithmetic.rm x1: " in out and "not planned" not in out
    (judge,) = [line for line in out.splitlines() if line.startswith("[plan] memory judge:arithmetic.judge x1: ")]
    (node,) = [line for line in out.splitlines() if line.startswith("[plan] memory on each node (RAM): ")]
    per_worker = [
        float(line.split(": ")[1].split(" GiB")[0]) for line in out.splitlines() if line.startswith("[plan] memory ") and " x" in line
    ]
    assert float(node.split(": ")[1].split(" GiB")[0]) == pytest.approx(sum(per_worker), abs=3e-3)  # the judge's included
    own = ["+env.arithmetic.class=reward_model"]  # its default model
    assert main(["plan", *own]) == 0
    out = capsys.readouterr().out
    assert "[plan] memory reward_model:arithmetic x1: " in out and "not planned" not in out
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "not planned" not in out and "reward_model" not in out


def test_a_second_config_a_positional_recipe_and_a_tilde_null_are_read_as_meant(capsys) -> None:
    """A second --config silently replaced the first recipe; a recipe path without --config was a Hydra lexer error;
    `key=~` (the docs' null) was one too."""
    from nemo_like.config import ConfigError, load_config

    for command in ("train", "eval", "serve", "plan"):
        with pytest.raises(SystemExit) as exited:
            main([command, "--config", "examples/configs/grpo_tiny_cpu.yaml", "--config", "examples/configs/grpo_tiny_cpu_async.yaml"])
        assert exited.value.code == 2 and "--config given twice" in capsys.readouterr().err
    assert main(["train", "examples/configs/grpo_tiny_cpu_lora.yaml", "--dry-run"]) == 2
    assert "is not an override (key=value); to use it as the recipe write --config" in capsys.readouterr().err
    assert load_config(None, []).policy.max_grad_norm == 1.0
    assert load_config(None, ["policy.max_grad_norm=~"], warn=False).policy.max_grad_norm is None
    with pytest.raises(ConfigError, match=r"'@foo' \(a Hydra package\) means nothing here; write grpo.seed=..."):
        load_config(None, ["grpo.seed@foo=3"])  # the package had been dropped silently


def test_the_exit_status_is_written_where_the_launcher_asks(tmp_path, monkeypatch, capsys) -> None:
    """The Slurm launcher stops a job with `ray job stop`, after which Ray records no driver status: every walltime stop
    read as "stopped and saved" (143), a failed save included. The CLI writes its own status for the launcher to read."""
    status_file = tmp_path / "exit_status"
    monkeypatch.setenv("NEMO_LIKE_EXIT_STATUS_FILE", str(status_file))
    assert main(["plan", "--mfu", "0", "--peak-tflops", "100"]) == 2
    assert status_file.read_text() == "2\n"
    status_file.write_text("stale\n")  # the call above wrote 2: the usage error must write its own
    with pytest.raises(SystemExit):
        main(["plan", "--no-such-flag"])  # argparse's usage error: SystemExit(2)
    assert status_file.read_text() == "2\n"
    assert main(["plan", "--config", str(REPO / "examples" / "configs" / "grpo_tiny_cpu.yaml")]) == 0
    assert status_file.read_text() == "0\n"


def test_a_mistyped_flag_gets_its_subcommands_usage_and_the_flag_it_meant(capsys) -> None:
    """``train --dryrun`` printed the top-level usage, naming no flag of train's."""
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--dryrun"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "usage: nemo-like train" in err and "(did you mean --dry-run?)" in err


def test_a_recipe_directory_lists_its_recipes(tmp_path, capsys) -> None:
    (tmp_path / "a.yaml").write_text("grpo: {}\n")
    assert main(["train", "--config", str(tmp_path), "--dry-run"]) == 2
    assert "is a directory, not a recipe file; pick one of its files: a.yaml" in capsys.readouterr().err
