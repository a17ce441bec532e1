"""On-policy distillation through real runs: a teacher equal to the student is a no-op (the advantage and the KL loss
term), and data parallelism does not change a distillation step (with the KL term on, chunked)."""

from __future__ import annotations

import pytest
import torch
from functional.helpers import ckpt_overrides, record_model_starts, tiny_config
from safetensors.torch import load_file

from nemo_like.models.assets import default_model_path, embedded_model_path
from nemo_like.train import train

pytestmark = pytest.mark.slow
DISTIL = ("distillation.task_advantage_weight=0", "loss_fn.reference_policy_kl_penalty=0")
KL_LOSS = "distillation/kl_loss"


def test_a_teacher_equal_to_the_student_gives_zero_advantages_and_changes_no_weight(ray_cluster, tmp_path, monkeypatch):
    waited = record_model_starts(monkeypatch)  # setup starts the teacher's workers before it waits for the policy's
    ckpt = tmp_path / "ckpt"
    kl = (
        "distillation.kl_weight=1",
        "distillation.kl_direction=reverse",
        "distillation.kl_support=student_top_k",
        "distillation.kl_top_k=4",
    )
    cfg = tiny_config(
        tmp_path, "grpo.max_num_steps=1", "teacher.model_name=embedded:tiny-arith-qwen2", *DISTIL, *kl, *ckpt_overrides(ckpt, 1)
    )
    (record,) = [r for r in train(cfg) if r["step"] == 1]
    assert waited[:2] == [("policy", ["policy", "teacher"]), ("teacher", ["policy", "teacher"])]  # no reference: KL 0
    assert record["distillation/teacher_kl"] == 0.0 and record["distillation/advantage_mean"] == 0.0
    assert record[KL_LOSS] == 0.0  # the KL loss term: exactly 0, and (below) its gradient too
    assert record["distillation/teacher_logprob_mean"] == record["distillation/student_logprob_mean"] < 0
    # The one teacher scored every row. The model FLOPs count its pass and the KL term's teacher forward (2N per token
    # each; the teacher is the student's architecture) beside training (6N), the prev pass (2N) and generation (2N).
    from transformers import AutoConfig

    from nemo_like.utils.flops import matmul_params

    tokens = record["performance/num_batch_tokens"]
    assert record["performance/num_teacher_tokens/0"] == tokens > 0 and record["performance/forward_passes/prev_logprobs"] > 0
    n = matmul_params(AutoConfig.from_pretrained(embedded_model_path("embedded:tiny-arith-qwen2")))
    expected = (6 + 2) * n * tokens + 2 * n * tokens + 2 * n * tokens + 2 * n * record["performance/num_generated_tokens"]
    assert record["performance/model_flops"] == pytest.approx(expected)
    before = load_file(f"{default_model_path()}/model.safetensors")
    after = load_file(f"{ckpt}/step_1/policy/model.safetensors")
    assert before.keys() == after.keys()
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert changed == []


def test_the_kl_term_alone_trains_on_no_task_reward(ray_cluster, tmp_path):
    # advantage_weight 0 starts no teacher actors (the KL term runs its own teacher copy), and task_advantage_weight 0
    # must still zero the task advantage: with a teacher equal to the student the KL term's gradient is 0, so no weight
    # may change (the task advantage had been left at weight 1 whenever the teacher's actors did not run).
    ckpt = tmp_path / "ckpt"
    only_kl = ("distillation.advantage_weight=0", "distillation.kl_weight=1")
    cfg = tiny_config(
        tmp_path, "grpo.max_num_steps=1", "teacher.model_name=embedded:tiny-arith-qwen2", *DISTIL, *only_kl, *ckpt_overrides(ckpt, 1)
    )
    (record,) = [r for r in train(cfg) if r["step"] == 1]
    assert "distillation/teacher_kl" not in record and record[KL_LOSS] == 0.0
    assert 0 < record["train/reward"] < 1  # the task reward had a signal to give
    # ... which the loss did not use: train/advantages/* are what it used, train/task_advantages/* the task's alone
    assert record["train/advantages/max"] == record["train/advantages/min"] == 0.0
    assert record["train/task_advantages/max"] > 0 > record["train/task_advantages/min"]
    before = load_file(f"{default_model_path()}/model.safetensors")
    after = load_file(f"{ckpt}/step_1/policy/model.safetensors")
    assert [name for name in before if not torch.equal(before[name], after[name])] == []


def test_two_data_parallel_ranks_distil_like_one(ray_cluster, tmp_path):
    # The HF engine samples for both runs (inline sampling needs one policy worker), and both run the model's own
    # forward (the sharded ranks do), so the two runs differ only in the sharding of the student and the teacher.
    # The KL loss term is on too (full vocabulary, forward, chunked): each rank's policy worker holds a sharded teacher copy.
    kl = ("distillation.kl_weight=0.5", "policy.logprob_chunk_size=16")
    common = ("teacher.model_name=embedded:tiny-arith-teacher", *DISTIL, *kl, "grpo.max_num_steps=3", "policy.generation.backend=hf")
    one = train(tiny_config(tmp_path / "dp1", *common, "policy.shared_prompt_forward=false"))
    two = train(tiny_config(tmp_path / "dp2", *common, "policy.dp_size=2"))
    steps = [(a, b) for a, b in zip(one, two) if a["step"] > 0]
    assert len(steps) == 3
    for a, b in steps:
        assert a[KL_LOSS] > 0
        for key in ("train/loss", "train/grad_norm", "distillation/teacher_kl", KL_LOSS):
            # fp32 sums in another order (two shards): within 1e-5, relative for the grad norm (about 11 here)
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-5), (a["step"], key)
    assert embedded_model_path("embedded:tiny-arith-teacher")  # the shipped teacher is where the recipe says
