"""Logger fan-out without Ray: metrics.jsonl, TensorBoard, and a backend that really fails to start."""

import json

import pytest

from nemo_like.config.schema import LoggerConfig
from nemo_like.utils.log_backends import flatten_config, jsonable, numeric_metrics
from nemo_like.utils.logger import Logger


def test_flatten_config_makes_dotted_scalar_hparams():
    flat = flatten_config({"a": {"b": 1, "c": {"d": None}}, "e": [1, 2], "f": "x", "g": True})
    assert flat == {"a.b": 1, "a.c.d": "None", "e": "[1, 2]", "f": "x", "g": True}


def test_numeric_metrics_and_jsonable():
    assert numeric_metrics({"a": 1, "b": 2.5, "c": "text", "d": True}) == {"a": 1, "b": 2.5}
    assert jsonable(float("nan")) == "nan" and jsonable(1.5) == 1.5


def test_a_backend_that_cannot_start_warns_and_jsonl_still_logs(tmp_path):
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    (log_dir / "tensorboard").write_text("a file where the event directory should be")
    cfg = LoggerConfig(log_dir=str(log_dir), tensorboard_enabled=True, progress_bar=False)
    with pytest.warns(RuntimeWarning, match="TensorBoard logging disabled"):
        logger = Logger(cfg, total_steps=1)
    logger.save_config({"grpo": {"seed": 1}})
    logger.log({"train/reward": 0.5}, step=1)
    logger.close()
    assert [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()] == [{"step": 1, "train/reward": 0.5}]


def test_tensorboard_backend_writes_scalars_and_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = LoggerConfig(log_dir=str(tmp_path), tensorboard_enabled=True, progress_bar=False)
    logger = Logger(cfg, total_steps=2)
    logger.save_config({"grpo": {"seed": 1, "val_period": None}})
    for step in (1, 2):
        logger.log({"train/reward": 0.25 * step, "note": "not a scalar"}, step=step)
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["train/reward"]
    assert [(e.step, e.value) for e in acc.Scalars("train/reward")] == [(1, 0.25), (2, 0.5)]
    assert "config/text_summary" in acc.Tags()["tensors"]
    assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")
