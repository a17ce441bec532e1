"""Which directory `nemo-like eval` loads for eval.model_path."""

from __future__ import annotations

import json

import pytest

from nemo_like.config import ConfigError, load_config
from nemo_like.evaluation.run import resolve_eval_model


def test_model_dir_checkpoint_step_and_checkpoint_root(tmp_path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert resolve_eval_model(str(model)) == str(model)
    for step in (2, 10):
        (tmp_path / "ckpt" / f"step_{step}" / "policy").mkdir(parents=True)
        (tmp_path / "ckpt" / f"step_{step}" / "policy" / "config.json").write_text("{}")
        (tmp_path / "ckpt" / f"step_{step}" / "trainer_state.json").write_text(json.dumps({"metrics": {}}))
    assert resolve_eval_model(str(tmp_path / "ckpt" / "step_2")) == str(tmp_path / "ckpt" / "step_2" / "policy")
    assert resolve_eval_model(str(tmp_path / "ckpt")) == str(tmp_path / "ckpt" / "step_10" / "policy")  # the latest
    assert resolve_eval_model("embedded:tiny-arith-qwen2") == "embedded:tiny-arith-qwen2"


def test_bad_paths_are_config_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_eval_model(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="neither a model directory"):
        resolve_eval_model(str(tmp_path))


def test_k_above_n_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"eval.pass_k: k must be between 1 and eval.num_samples_per_prompt = 4.*\[8\]"):
        load_config(None, ["eval.num_samples_per_prompt=4", "eval.pass_k=[1,8]"])
    with pytest.raises(ConfigError, match=r"grpo.val_pass_k: k must be between 1 and grpo.val_num_generations_per_prompt = 2"):
        load_config(None, ["grpo.val_num_generations_per_prompt=2", "grpo.val_pass_k=[4]"])
    assert load_config(None, ["grpo.val_num_generations_per_prompt=4"]).grpo.resolved_val_pass_k == [1, 4]
