"""A real GRPO run through the public entry point: actors, generation, reward, training, logging."""

import json
from pathlib import Path

import pytest
from functional.helpers import REPO, read_metrics, record_model_starts, tiny_config

from nemo_like.algorithms import setup as grpo_setup
from nemo_like.distributed.planning import plan_on_cluster
from nemo_like.models.footprint import planned_memory_lines
from nemo_like.models.loading import load_causal_lm
from nemo_like.plan.backend import resolve_backend
from nemo_like.train import train

pytestmark = pytest.mark.slow
MATH_TINY = REPO / "nemo_like" / "assets" / "math-tiny"

REQUIRED_STEP_KEYS = [
    "train/reward",
    "train/loss",
    "train/kl_penalty",
    "train/gen_kl",
    "train/token_mult_prob_error",
    "train/advantages/mean",
    *[
        f"timing/train/{p}"
        for p in ("generation", "reward", "prev_logprobs", "reference_logprobs", "policy_training", "refit", "total_step_time")
    ],
]


# Sampling from a top-k / top-p truncated distribution: every pass scores the same processed distribution.
TRUNCATED_SAMPLING = ("policy.generation.top_p=0.8", "policy.generation.top_k=20", "policy.generation.temperature=0.8")


# The scaled policy: two FSDP2 ranks (policy and reference), packed micro-batches, chunked logprobs and a
# refit gathered from the shards (on this one-node cluster into the shared-memory buffer; the 1 MB object-store
# buckets serve multi-node clusters, test_actors.py checks them); the other tests of this file run the default
# (one plain rank, fixed micro-batches).
SCALED = (
    "policy.dp_size=2",
    "policy.sequence_packing.enabled=true",
    "policy.sequence_packing.train_mb_tokens=256",
    "policy.sequence_packing.logprob_mb_tokens=512",
    "policy.logprob_chunk_size=32",
    "policy.refit_buffer_size_mb=1",
)


def test_two_step_run_writes_metrics_config_and_validation(ray_cluster, tmp_path, capfd, monkeypatch):
    # The scaled policy (dp 2 FSDP2, packing, chunked logprobs, refit gathered from shards) with HF generation sampling
    # under top-k, top-p and a temperature (vLLM: test_vllm_backend.py's GRPO run).
    cfg = tiny_config(
        tmp_path,
        *SCALED,
        "policy.generation.backend=hf",
        "grpo.val_num_generations_per_prompt=2",
        *TRUNCATED_SAMPLING,
        "logger.progress_bar=true",
    )
    waited = record_model_starts(monkeypatch, grpo_setup)  # setup starts every role's workers before it waits for any
    history = train(cfg)
    everything = ["policy", "reference", "environments"]
    assert waited[:2] == [("policy", everything), ("reference", everything)]
    # The run prints the memory planner's lines, the numbers `nemo-like plan` gives for the same recipe and cluster.
    err = capfd.readouterr().err.splitlines()
    printed = [line.removeprefix("[plan] ") for line in err if line.startswith("[plan] memory")]
    # Each validation pass is announced before it runs (minutes of silence on a large validation set), then reported
    announced = [line for line in err if "validating" in line]
    assert announced == [f"[step {s}] validating: 32 prompts x 2 responses" for s in (0, 2)], announced
    assert err.index(announced[0]) < err.index("[step 0] validation/accuracy=" + f"{history[0]['validation/accuracy']:.3f}")
    assert printed and printed == planned_memory_lines(cfg, plan_on_cluster(cfg)), printed
    assert any(line.startswith("memory policy x2:") for line in printed)  # dp 2: two policy workers
    log_dir = tmp_path / "logs"
    records = read_metrics(log_dir)
    assert [r["step"] for r in records] == [0, 1, 2] == [h["step"] for h in history]
    assert 0.0 <= records[0]["validation/accuracy"] <= 1.0 and records[0]["validation/num_samples"] == 64  # 32 prompts x 2
    for record in (records[0], records[-1]):
        # pass@1 is the mean correctness when every prompt has the same n; pass@2 >= pass@1 (binary rewards)
        assert record["validation/pass@1"] == pytest.approx(record["validation/accuracy"])
        assert record["validation/pass@1"] <= record["validation/pass@2"] <= 1.0
        assert record["validation/env/arithmetic/num_samples"] == 64
        assert record["validation/env/arithmetic/reward"] == pytest.approx(record["validation/reward"])
    for record in records[1:]:
        # one task: its per-environment metrics are the step's (16 samples = 4 prompts x 4)
        assert record["env/arithmetic/reward"] == pytest.approx(record["train/reward"]) and record["env/arithmetic/num_samples"] == 16
        missing = [k for k in REQUIRED_STEP_KEYS if k not in record]
        assert not missing, missing
        assert record["train/kl_penalty"] >= 0
        # On-policy: the generation weights are the trained weights (refit each step), and generation and
        # training score tokens under the same truncated, renormalised distribution.
        assert record["train/gen_kl"] < 1e-4 and record["train/token_mult_prob_error"] < 1.001
        assert 0 <= record["train/outside_sampling_set_frac"] < 0.01
        # Sharded ranks run the model's own forward over every token (packed rows: no padding, no sharing).
        assert record["performance/training_forward_tokens_per_token"] >= 1.0
    assert "validation/accuracy" in records[-1]  # validated at the end
    assert records[2]["train/weight_version"] == 2 and records[2]["timing/train/refit"] > 0
    # Step 2 refits twice, before its generation and before the validation at the end (timed in step 2): its record
    # holds both refits' bytes (the validation's used to land in the next record, or nowhere after the last step).
    full_bytes = 4 * sum(p.numel() for p in load_causal_lm(cfg.policy.model_name).parameters())  # tied: sent once
    assert [r.get("performance/refit_bytes") for r in records[1:]] == [0.0, 2.0 * full_bytes]
    assert (log_dir / "config.yaml").read_text().startswith("grpo:")


def test_prev_logprob_pass_is_skipped_with_one_optimizer_step_and_the_loss_is_unchanged(ray_cluster, tmp_path):
    common = ("grpo.max_num_steps=1", "grpo.val_at_start=false", "grpo.val_at_end=false")
    skipped = train(tiny_config(tmp_path / "a", *common, "grpo.skip_prev_logprobs=auto"))
    # The driver-side masks ride along on the computed run: on-policy they must remove nothing.
    masks = (
        "grpo.seq_logprob_error_threshold=1.5",
        "grpo.rollout_rejection.level=token",
        "grpo.rollout_rejection.lower=0.5",
        "grpo.rollout_rejection.upper=2.0",
    )
    computed = train(tiny_config(tmp_path / "b", *common, "grpo.skip_prev_logprobs=false", *masks))
    s, c = skipped[-1], computed[-1]
    assert c["train/rollout_rejection/masked_token_fraction"] == 0 and c["train/seq_logprob_error/masked_fraction"] == 0
    assert 0.9 < c["train/rollout_rejection/token_ratio_min"] <= c["train/rollout_rejection/token_ratio_max"] < 1.1
    assert 1.0 <= c["train/seq_logprob_error/max"] < 1.1
    assert s["performance/forward_passes/prev_logprobs"] == 0 and s["timing/train/prev_logprobs"] == 0
    assert c["performance/forward_passes/prev_logprobs"] > 0
    assert s["performance/forward_passes/reference_logprobs"] > 0  # KL penalty on: reference runs
    for key in ("train/loss", "train/kl_penalty", "train/gen_kl", "train/token_mult_prob_error", "train/probs_ratio"):
        assert abs(s[key] - c[key]) < 1e-6, key


def test_scoring_while_the_logprob_passes_run_gives_the_same_update(ray_cluster, tmp_path, monkeypatch):
    """grpo.overlap_scoring (the default): the environments score while the prev and reference passes run, then the
    rewards are shaped (overlong shaping on, so a deferred reward that skipped it would show); three steps equal the
    score-first run bitwise."""
    from nemo_like.algorithms import grpo

    scores_pending = []  # per step: whether the rollout came back with its scores still to gather (the overlap)
    collect = grpo.collect_rollout

    def recorded(*args, **kwargs):
        rollout = collect(*args, **kwargs)
        scores_pending.append(rollout.pending_scores is not None)
        return rollout

    monkeypatch.setattr(grpo, "collect_rollout", recorded)
    common = (
        "grpo.max_num_steps=3",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "grpo.skip_prev_logprobs=false",
        "grpo.reward_shaping.enabled=true",
        "grpo.reward_shaping.overlong_buffer_length=4",
    )
    overlapped = train(tiny_config(tmp_path / "overlap", *common))
    first = train(tiny_config(tmp_path / "first", *common, "grpo.overlap_scoring=false"))
    assert scores_pending == [True] * 3 + [False] * 3  # the runs took the two paths (equal results prove nothing else)
    assert [r["step"] for r in overlapped] == [r["step"] for r in first] == [1, 2, 3]
    for a, b in zip(overlapped, first):
        for key in ("train/reward", "train/loss", "train/kl_penalty", "train/grad_norm", "train/advantages/mean", "train/gen_kl"):
            assert a[key] == b[key], (a["step"], key)
    assert all(
        r["performance/forward_passes/prev_logprobs"] > 0 and r["performance/forward_passes/reference_logprobs"] > 0 for r in overlapped
    )
    # The two passes ran concurrently: timed as waits one after the other, the shares add up to at most 1 (timing both
    # from one start counted the overlap twice: 1.05-1.07).
    for r in (*overlapped, *first):
        assert sum(v for k, v in r.items() if k.startswith("timing/train/share/")) <= 1.0 + 1e-9, r["step"]


def mixed_task_files(tmp_path: Path) -> tuple[Path, Path]:
    """The shipped math-tiny rows split between two tasks: plain integer answers -> "arithmetic" (exact match),
    LaTeX / decimal forms -> "math" (math-verify). Only the math environment can score "\\frac{38}{2}" right."""
    paths = []
    for split in ("train", "validation"):
        rows = [json.loads(line) for line in (MATH_TINY / f"{split}.jsonl").read_text().splitlines()]
        for row in rows:
            row["task"] = "arithmetic" if row["answer"].isdigit() else "math"
        paths.append(tmp_path / f"{split}.jsonl")
        paths[-1].write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths[0], paths[1]


def test_zero_kl_penalty_loads_no_reference_model_and_a_two_task_run_routes_each_sample(ray_cluster, tmp_path):
    # Folded in: a teacher for one task only (teacher.by_task): its pass scores the math rows alone.
    train_file, val_file = mixed_task_files(tmp_path)
    data = (
        "data.dataset_name=null",
        f"data.train.data_path={train_file}",
        f"data.validation.data_path={val_file}",
        "data.prompt_key=problem",
        "data.answer_key=answer",
        "data.task_key=task",
        "+env.math.num_workers=1",
    )
    teacher = ("+teacher.by_task.math=embedded:tiny-arith-teacher",)
    history = train(tiny_config(tmp_path, "grpo.max_num_steps=1", "loss_fn.reference_policy_kl_penalty=0", *data, *teacher))
    last = history[-1]
    assert last["performance/forward_passes/reference_logprobs"] == 0
    assert last["timing/train/reference_logprobs"] == 0
    # Every sample went to its own task's environment: the per-task counts add up to the batch and to the data's split.
    assert last["env/arithmetic/num_samples"] > 0 and last["env/math/num_samples"] > 0
    assert last["env/arithmetic/num_samples"] + last["env/math/num_samples"] == last["performance/num_samples"]
    val = history[0]
    assert val["validation/env/arithmetic/num_samples"] + val["validation/env/math/num_samples"] == val["validation/num_samples"]
    assert last["env/math/timeouts"] == 0
    # The teacher scored only the math rows: some of the batch's tokens, not all; its signal is a negative-logprob mean.
    assert 0 < last["performance/num_teacher_tokens/0"] < last["performance/num_batch_tokens"]
    assert last["distillation/teacher_logprob_mean"] < 0 and last["timing/train/teacher_logprobs"] > 0


def test_the_default_cpu_backend_samples_in_the_policy_worker_on_policy_and_never_refits(ray_cluster, tmp_path):
    # auto -> inline here (sync, CPU, one policy worker): the policy worker samples with the weights it trains, so
    # there is nothing to refit, and the prev pass (computed here) scores exactly what generation sampled.
    cfg = tiny_config(tmp_path, "grpo.max_num_steps=3", "grpo.val_at_start=false", "grpo.skip_prev_logprobs=false", *TRUNCATED_SAMPLING)
    assert resolve_backend(cfg)[0] == "inline"
    history = train(cfg)
    steps = [r for r in history if "train/loss" in r]
    assert [r["train/weight_version"] for r in steps] == [1, 2, 3]
    for record in steps:
        assert record["timing/train/refit"] == 0 and record["performance/refit_bytes"] == 0
        # KV-cached decode vs one full forward of the same weights: equal up to float rounding
        assert record["train/gen_kl"] < 1e-6 and abs(record["train/token_mult_prob_error"] - 1) < 1e-4
        assert record["train/outside_sampling_set_frac"] == 0
        # The prev pass and the update ran the shared-prompt forward (each group's prompt once): the gen_kl bound
        # above holds between it and the KV-cached sampler.
        assert record["performance/training_forward_tokens_per_token"] < 0.9
    assert 0.0 <= history[-1]["validation/accuracy"] <= 1.0  # validation generates inline too
