"""A real GRPO run through the public entry point: actors, generation, reward, training, logging."""

import json

import pytest

from functional.helpers import tiny_config
from nemo_like.train import train

pytestmark = pytest.mark.slow

REQUIRED_STEP_KEYS = [
    "train/reward",
    "train/loss",
    "train/kl_penalty",
    "train/gen_kl",
    "train/token_mult_prob_error",
    "train/advantages/mean",
    *[f"timing/train/{p}" for p in ("generation", "reward", "prev_logprobs", "reference_logprobs", "policy_training", "refit", "total_step_time")],
]


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# The scaled policy: two FSDP2 ranks (policy and reference), packed micro-batches, chunked logprobs and
# refit in 1 MB buckets; the other tests of this file run the default (one plain rank, fixed micro-batches).
SCALED = (
    "policy.dp_size=2",
    "policy.sequence_packing.enabled=true",
    "policy.sequence_packing.train_mb_tokens=256",
    "policy.sequence_packing.logprob_mb_tokens=512",
    "policy.logprob_chunk_size=32",
    "policy.refit_buffer_size_mb=1",
)


def test_two_step_run_writes_metrics_config_and_validation(ray_cluster, tmp_path):
    cfg = tiny_config(tmp_path, *SCALED)
    history = train(cfg)
    log_dir = tmp_path / "logs"
    records = read_jsonl(log_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2] == [h["step"] for h in history]
    assert 0.0 <= records[0]["validation/accuracy"] <= 1.0 and records[0]["validation/num_samples"] == 32
    for record in records[1:]:
        missing = [k for k in REQUIRED_STEP_KEYS if k not in record]
        assert not missing, missing
        assert record["train/kl_penalty"] >= 0
        # On-policy: the generation weights are the trained weights (refit each step).
        assert record["train/gen_kl"] < 1e-4 and record["train/token_mult_prob_error"] < 1.001
    assert "validation/accuracy" in records[-1]  # validated at the end
    assert records[2]["train/weight_version"] == 2 and records[2]["timing/train/refit"] > 0
    assert (log_dir / "config.yaml").read_text().startswith("grpo:")


def test_prev_logprob_pass_is_skipped_with_one_optimizer_step_and_the_loss_is_unchanged(ray_cluster, tmp_path):
    common = ("grpo.max_num_steps=1", "grpo.val_at_start=false", "grpo.val_at_end=false")
    skipped = train(tiny_config(tmp_path / "a", *common, "grpo.skip_prev_logprobs=auto"))
    computed = train(tiny_config(tmp_path / "b", *common, "grpo.skip_prev_logprobs=false"))
    s, c = skipped[-1], computed[-1]
    assert s["performance/forward_passes/prev_logprobs"] == 0 and s["timing/train/prev_logprobs"] == 0
    assert c["performance/forward_passes/prev_logprobs"] > 0
    assert s["performance/forward_passes/reference_logprobs"] > 0  # KL penalty on: reference runs
    for key in ("train/loss", "train/kl_penalty", "train/gen_kl", "train/token_mult_prob_error", "train/probs_ratio"):
        assert abs(s[key] - c[key]) < 1e-6, key


def test_zero_kl_penalty_loads_no_reference_model(ray_cluster, tmp_path):
    history = train(tiny_config(tmp_path, "grpo.max_num_steps=1", "grpo.val_at_start=false", "loss_fn.reference_policy_kl_penalty=0"))
    assert history[-1]["performance/forward_passes/reference_logprobs"] == 0
    assert history[-1]["timing/train/reference_logprobs"] == 0

