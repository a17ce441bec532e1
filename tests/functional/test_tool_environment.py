"""The tool environment in a real multi-turn GRPO run (the demo recipe, shrunk to 2 steps): the shipped tiny
tool model calls the calculator through the Ray-hosted ToolEnvironment, the tool's result comes back as an
observation turn, and the trained sequences and counters say so."""

from __future__ import annotations

import pytest
from functional.helpers import REPO, read_jsonl

from nemo_like.config import load_config
from nemo_like.environments.tools.calculator import calculator
from nemo_like.environments.tools.parsing import ToolCall, parse_tool_calls
from nemo_like.train import train

pytestmark = pytest.mark.slow
RECIPE = REPO / "examples" / "configs" / "grpo_multiturn_tiny_cpu.yaml"


def test_tool_calls_round_trip_in_a_real_run(ray_cluster, tmp_path):
    cfg = load_config(
        RECIPE,
        [
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=8",
            "grpo.max_num_steps=2",
            "grpo.val_period=0",
            "grpo.val_at_start=false",
            "policy.num_cpus_per_worker=0.25",
            "policy.generation.backend=hf",
            "data.train.num_problems=64",
            "logger.progress_bar=false",
            "logger.plot_at_end=false",
            "logger.dump_train_data=true",
            f"logger.log_dir={tmp_path / 'logs'}",
        ],
    )
    history = train(cfg)
    steps = [r for r in history if "train/reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    calls = sum(r["env/tool/tool_calls"] for r in steps)
    assert calls > 0 and sum(r["env/tool/samples"] for r in steps) == 64
    rows = read_jsonl(tmp_path / "logs" / "train_data_step1.jsonl")
    with_tool = [row for row in rows if row["num_turns"] == 2]
    assert with_tool, "the warm-started model calls the tool on about a quarter of the samples"
    round_trips = 0
    for row in with_tool:
        call, observation = row["turns"][0], row["turns"][1]
        assert observation["role"] == "tool"
        parsed = parse_tool_calls(call["content"])
        if len(parsed) == 1 and isinstance(parsed[0], ToolCall) and parsed[0].name == "calculator":
            try:
                expected = calculator(**parsed[0].arguments)
            except Exception as exc:  # a bad expression: the observation is the error text
                expected = f"error: calculator: {exc}"
            assert observation["content"] == expected
            round_trips += 1
        else:  # a malformed call, several, or another tool's: the observation says what was wrong
            assert observation["content"].startswith("error: "), observation["content"]
        # observation tokens are never trained: the mask has as many ones as the two turns' sampled tokens
        assert sum(row["response_mask"]) < len(row["response_token_ids"])
    assert round_trips > 0  # the calculator's answers were checked on some rows (all 10 on this machine)
