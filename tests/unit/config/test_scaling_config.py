"""Scaling keys: contradictory or CPU-impossible combinations fail at load time, naming the keys."""

from pathlib import Path

import pytest

from nemo_like.config import ConfigError, load_config
from nemo_like.models.policy.policy import batching_plan

TINY = Path(__file__).resolve().parents[3] / "examples" / "configs" / "grpo_tiny_cpu.yaml"


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["policy.sequence_packing.enabled=true", "policy.dynamic_batching.enabled=true"], ["sequence_packing", "dynamic_batching"]),
        (["policy.dp_size=2", "policy.dtensor_cfg.enabled=false"], ["policy.dp_size", "dtensor_cfg.enabled"]),
        (
            ["policy.dtensor_cfg.tensor_parallel_size=2", "policy.dtensor_cfg.enabled=false"],
            ["tensor_parallel_size", "dtensor_cfg.enabled"],
        ),
        (["cluster.placement_strategy=SPREADS"], ["placement_strategy"]),
    ],
)
def test_contradictions_are_config_errors(overrides, names):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    assert all(name in str(err.value) for name in names), str(err.value)


def test_tensor_parallel_is_accepted_and_batching_plans_follow_the_keys():
    cfg = load_config(TINY, ["policy.dtensor_cfg.tensor_parallel_size=2"])
    assert cfg.policy.dtensor_cfg.tensor_parallel_size == 2
    packed = load_config(TINY, ["policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=256"]).policy
    assert batching_plan(packed, 4) == {"mode": "packed", "train_size": 256, "logprob_size": 1024}
    budget = load_config(TINY, ["policy.dynamic_batching.enabled=true"]).policy
    assert batching_plan(budget, 4)["mode"] == "token_budget"
    assert batching_plan(load_config(TINY, []).policy, 4) == {"mode": "fixed", "train_size": 4, "logprob_size": 64}
