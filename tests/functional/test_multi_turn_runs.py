"""Multi-turn GRPO end to end (real actors, model, tokenizer; the Countdown test environment, whose
episodes last 1-3 turns): the sync loop trains on exactly the sampled tokens of every turn (the policy's
own logprobs of the dumped tokens match the generation logprobs), dumps one row per sample with its
turns, validates multi-turn; the async loop, with a chat template that drops earlier turns (its episodes branch into
rows), keeps the staleness bound counted from the first turn and checkpoints only whole samples, their rows together."""

import shutil
from pathlib import Path

import pytest
import torch
from functional.helpers import ckpt_overrides, read_jsonl, tiny_config

from nemo_like.config.schema import EMBEDDED_MODEL
from nemo_like.experience.async_rollouts import BUFFER_FILE
from nemo_like.experience.trajectory_collector import AgentTrajectoryGroup
from nemo_like.models.loading import resolve_model_path
from nemo_like.train import train

# Like Qwen3's and DeepSeek-R1's templates, which drop earlier turns' reasoning: earlier assistant turns render empty.
DROPPING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}{{ '<|im_start|>assistant\n<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MULTI_TURN = (
    "policy.generation.backend=hf",
    "grpo.max_rollout_turns=3",
    "policy.max_total_sequence_length=96",
    "+env.arithmetic.class=custom_envs:CountdownEnv",
    "grpo.max_val_samples=8",
)


def steps_of(history: list[dict]) -> list[dict]:
    return [r for r in history if "train/reward" in r]


def test_sync_multi_turn_trains_on_the_sampled_tokens_and_dumps_the_turns(ray_cluster, tmp_path):
    history = train(tiny_config(tmp_path, *MULTI_TURN, "logger.dump_train_data=true"))
    steps = steps_of(history)
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert 1.0 < r["multi_turn/turns_per_sample_mean"] <= r["multi_turn/turns_per_sample_max"] <= 3.0
        assert r["env/arithmetic/steps"] == r["multi_turn/turns_per_sample_mean"] * 16  # one env step per model turn
        assert 0.0 <= r["multi_turn/truncated_by_length_fraction"] <= 1.0 and r["multi_turn/env_seconds"] > 0
    assert "validation/multi_turn/turns_per_sample_mean" in history[0]
    rows = read_jsonl(tmp_path / "logs" / "train_data_step1.jsonl")
    assert len(rows) == 16
    for row in rows:
        mask = row["response_mask"]
        assert len(mask) == len(row["response_token_ids"]) and len(row["turns"]) == 2 * row["num_turns"] - 1
        assert [m["role"] for m in row["turns"]] == ["assistant", "tool"] * (row["num_turns"] - 1) + ["assistant"]
        # The end-of-turn token of every finished assistant turn is trained.
        ends = [i for i, t in enumerate(row["response_token_ids"]) if t == 2 and mask[i]]
        assert len(ends) == row["num_turns"] - row["truncated"]
        # The training pass scored exactly the sampled tokens: its pre-update logprobs (same weights as
        # generation, sync) equal the generation logprobs token for token.
        gen, prev = torch.tensor(row["generation_logprobs"]), torch.tensor(row["prev_logprobs"])
        assert len(gen) == sum(mask) and torch.allclose(gen, prev, atol=1e-3), row["prompt_id"]


def test_async_multi_turn_keeps_the_staleness_bound_and_checkpoints_whole_samples(ray_cluster, tmp_path):
    ckpt, tokenizer = tmp_path / "ckpt", tmp_path / "dropping_tokenizer"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(resolve_model_path(EMBEDDED_MODEL)) / name, tokenizer / name)
    (tokenizer / "chat_template.jinja").write_text(DROPPING_TEMPLATE)
    history = train(
        tiny_config(
            tmp_path,
            *MULTI_TURN,
            f"policy.tokenizer_name={tokenizer}",
            "grpo.async_grpo.enabled=true",
            "loss_fn.use_importance_sampling_correction=true",
            "grpo.async_grpo.max_trajectory_age_steps=1",
            "grpo.async_grpo.in_flight_weight_updates=true",
            "grpo.max_num_steps=3",
            "grpo.val_at_start=false",
            "grpo.val_at_end=false",
            *ckpt_overrides(ckpt, 2),
        )
    )
    steps = steps_of(history)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["train/max_trajectory_age"] <= 1.0 for r in steps)  # ages from the first turn's weights
    assert all(r["multi_turn/turns_per_sample_mean"] > 1.0 for r in steps)
    # Every turn the environment answered branched its episode (an empty turn renders as it was): one row more each.
    causes = ("template_rewrite", "template_whitespace_rewrite", "foreign_end_of_turn")  # all but the first here
    for r in steps:
        branches = sum(r.get(f"multi_turn/{cause}_per_sample", 0.0) for cause in causes)
        assert 0 < branches == pytest.approx(r["multi_turn/rows_per_sample"] - 1) and r["multi_turn/template_rewrite_per_sample"] > 0
        assert r["performance/num_samples"] == pytest.approx(16 * r["multi_turn/rows_per_sample"])
    buffer = torch.load(ckpt / "step_2" / BUFFER_FILE, weights_only=False)
    samples = [s for g in buffer["groups"] for s in g.samples]
    assert samples  # generated ahead for step 3; each one finished (its last token sampled, no turn pending)
    assert all(s.messages[-1]["role"] == "assistant" and s.response_mask[-1] == 1 for s in samples)
    assert all(isinstance(g, AgentTrajectoryGroup) and len(set(g.session_of_row)) == 4 for g in buffer["groups"])
