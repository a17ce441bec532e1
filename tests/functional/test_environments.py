"""Environments in Ray actors: several tasks routed in one batch, the math checker's time limit inside an
actor, and `nemo-like eval` end to end (pass@k recomputed from its results.jsonl)."""

from __future__ import annotations

import json
import shutil
import traceback

import pytest
import yaml
from functional.helpers import TINY_RECIPE

from nemo_like.data.prompts import PromptRecord
from nemo_like.environments.arithmetic_reward import score_response
from nemo_like.environments.registry import resolve_environments
from nemo_like.environments.worker import Environments
from nemo_like.evaluation.pass_at_k import pass_at_k
from nemo_like.experience.rollouts import score_with_environment

pytestmark = pytest.mark.slow


def record(i: int, task: str, answer) -> PromptRecord:
    return PromptRecord(f"p{i}", [], [1], {"answer": answer, "task_name": task})


def test_each_sample_is_scored_by_the_environment_of_its_task(ray_cluster):
    from nemo_like.config.schema import MasterConfig

    cfg = MasterConfig.model_validate(
        {
            "env": {
                "arithmetic": {"num_workers": 1},
                "parity": {"class": "custom_envs:LengthParityEnv", "num_workers": 2, "bonus": 0.25},
                "math": {"num_workers": 1, "timeout_s": 2.0},
                "buggy": {"class": "custom_envs:BuggyScorer", "num_workers": 1},
            }
        }
    )
    environments = Environments(resolve_environments(cfg.env_sections))
    try:
        texts, prompts = [], []
        for i in range(12):  # interleaved tasks; arithmetic answers "7", parity texts of both parities
            task = ("arithmetic", "parity", "math")[i % 3]
            if task == "arithmetic":
                texts.append("7" if i % 2 else "8")
                prompts.append(record(i, task, 7))
            elif task == "parity":
                texts.append("x" * i)
                prompts.append(record(i, task, None))
            else:
                texts.append("\\boxed{9^{9^{9^{9}}}}" if i == 2 else "\\boxed{\\frac{1}{2}}")
                prompts.append(record(i, task, "0.5"))
        scores = score_with_environment(environments.handles, texts, prompts)
        # an environment's own error reaches the driver as its type, its note printed once (Ray's message holds the
        # actor's traceback, note included, and the note came along too: printed twice)
        with pytest.raises(KeyError) as raised:
            score_with_environment(environments.handles, ["7"], [PromptRecord("p", [], [1], {"task_name": "buggy"})])
        printed = "".join(traceback.format_exception(raised.value))
        assert printed.count("raised by environment 'buggy' score") == 1, printed
    finally:
        environments.shutdown()
    for text, prompt, reward in zip(texts, prompts, scores.rewards.tolist()):
        task = prompt.metadata["task_name"]
        if task == "arithmetic":
            assert reward == score_response(text, 7)
        elif task == "parity":  # values the other environments never give
            assert reward == (0.25 if len(text) % 2 == 0 else -1.0)
        else:
            assert reward == (0.0 if "9^" in text else 1.0)
    assert scores.metrics["env/parity/seen"] == 4  # summed over the parity environment's 2 actors
    assert scores.metrics["env/math/timeouts"] == 1 and scores.metrics["env/math/correct"] == 3  # hung one cut off in the actor
    assert not any(k.startswith("env/arithmetic/") for k in scores.metrics)  # arithmetic reports no counters


def test_eval_of_a_checkpoint_reports_exact_pass_at_k(ray_cluster, tmp_path, capsys):
    """A checkpoint step directory (policy/ without tokenizer files), 8 prompts x 4 samples, scored by an
    environment that marks exactly 1 of each prompt's 4 samples correct: pass@1 = 0.25, pass@4 = 1.0. The summary
    records what the numbers depend on: the seed, the sampling settings and the checkpoint directory evaluated (none
    of them was recorded), and config.yaml the resolved config."""
    from nemo_like.cli import main
    from nemo_like.models.assets import default_model_path

    policy_dir = tmp_path / "ckpt" / "step_3" / "policy"
    policy_dir.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(f"{default_model_path()}/{name}", policy_dir / name)
    out = tmp_path / "eval"
    out.mkdir()
    (out / "results.partial.jsonl").write_text('{"a stopped eval\'s row": 1}\n')  # kept aside: they were lost silently
    kept_warning = pytest.warns(RuntimeWarning, match=r"holds a stopped eval's rows: kept as results\.partial\.\d{8}-\d{6}\.jsonl")
    with kept_warning:
        rc = main(
            [
                "eval",
                "--config",
                str(TINY_RECIPE),
                f"eval.model_path={tmp_path / 'ckpt' / 'step_3'}",
                "eval.num_samples_per_prompt=4",
                "eval.pass_k=[1,2,4]",
                f"eval.output_dir={out}",
                "grpo.max_val_samples=8",
                "eval.seed=5",
                "policy.generation.temperature=0.7",
                "policy.generation.top_k=5",
                "+env.arithmetic.class=custom_envs:FirstOfFour",
                "policy.generation.backend=hf",
                "policy.num_cpus_per_worker=0.25",
                "eval.samples_per_chunk=12",  # chunks of 3, 3 and 2 prompts, each one call, with its progress line
            ]
        )
    assert rc == 0
    err = capsys.readouterr().err
    assert [line.split(" | ")[0] for line in err.splitlines() if line.startswith("[eval] ")] == [
        "[eval] 3/8 prompts (12 rows)",
        "[eval] 6/8 prompts (24 rows)",
        "[eval] 8/8 prompts (32 rows)",
    ]
    assert not (out / "results.partial.jsonl").exists()  # results.jsonl holds them now
    (kept,) = out.glob("results.partial.*.jsonl")
    assert kept.read_text() == '{"a stopped eval\'s row": 1}\n'
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert summary["model_dir"] == str(policy_dir) and (out / "model" / "tokenizer_config.json").is_file()
    assert summary["checkpoint_dir"] == str(policy_dir) and summary["seed"] == 5
    sampling = {k: summary["sampling"][k] for k in ("max_new_tokens", "temperature", "top_p", "top_k", "greedy")}
    assert sampling == {"max_new_tokens": 8, "temperature": 0.7, "top_p": 1.0, "top_k": 5, "greedy": False}
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["eval"]["seed"] == 5 and config["eval"]["model_path"] == str(tmp_path / "ckpt" / "step_3")
    assert config["policy"]["generation"]["top_k"] == 5 and config["env"]["arithmetic"]["class"] == "custom_envs:FirstOfFour"
    assert len(rows) == 32 and {r["sample_index"] for r in rows} == {0, 1, 2, 3} and {r["prompt_index"] for r in rows} == set(range(8))
    by_prompt: dict[str, list[bool]] = {}
    for row in rows:
        by_prompt.setdefault(row["prompt_id"], []).append(row["correct"])
    assert len(by_prompt) == 8 and all(sum(v) == 1 and len(v) == 4 for v in by_prompt.values())
    for k in (1, 2, 4):  # recomputed from the per-sample rows with the exact estimator
        expected = sum(pass_at_k(len(v), sum(v), k) for v in by_prompt.values()) / len(by_prompt)
        assert summary[f"pass@{k}"] == pytest.approx(expected)
    assert summary["pass@1"] == pytest.approx(0.25) and summary["pass@2"] == pytest.approx(0.5) and summary["pass@4"] == 1.0
    assert summary["accuracy"] == pytest.approx(sum(r["correct"] for r in rows) / 32) == pytest.approx(0.25)
    assert "pass@4" in err  # the console table
