"""On-policy distillation: the student samples, a teacher scores the student's tokens, and each sampled token's
advantage gets the teacher's per-token signal.

For a response x sampled from the student pi_S, the reverse KL to the teacher is
``KL(pi_S || pi_T) = E_{x ~ pi_S} sum_t [log pi_S(x_t | x_<t) - log pi_T(x_t | x_<t)]``. Its policy gradient, with the
per-token reward ``r_t = log pi_T(x_t) - log pi_S(x_t)`` held fixed (stop-gradient), is the REINFORCE gradient of
``-KL``: giving every sampled token the advantage ``r_t`` and running the usual clipped policy-gradient loss moves the
student toward the teacher on the student's own samples (GRPO's clipping and IS corrections unchanged). With
``distillation.task_advantage_weight`` the task reward's advantage is kept beside it:

    A_t = task_advantage_weight * A_task + advantage_weight * (log pi_T(x_t) - log pi_S(x_t))

``log pi_S`` is the prev-logprob pass (the policy's own logprob forward, the same computation as the teacher's), so a
teacher identical to the student gives exactly 0. ``distillation/teacher_kl`` is the per-token mean of
``log pi_S - log pi_T`` over sampled tokens: the k1 estimator, unbiased for the per-token reverse KL under the
student's samples.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_like.config.errors import ConfigError
from nemo_like.config.schema import MasterConfig


def teacher_config(cfg: MasterConfig) -> MasterConfig:
    """The run config whose ``policy`` section describes the teacher's workers: its model, tokenizer and precision, no
    LoRA; everything else (sharding, batching, temperature: it scores under the student's sampling distribution) as
    the student's."""
    t = cfg.teacher
    if t.model_name is None:
        raise ValueError("teacher_config needs teacher.model_name")
    policy = cfg.policy.model_copy(
        update={
            "model_name": t.model_name,
            "tokenizer_name": t.tokenizer_name,
            "precision": t.precision or cfg.policy.precision,
            "lora_cfg": cfg.policy.lora_cfg.model_copy(update={"enabled": False}),
        }
    )
    return cfg.model_copy(update={"policy": policy})


def check_teacher_tokenizer(student_tokenizer: Any, student_name: str, teacher_tokenizer: Any, teacher_name: str) -> None:
    """The teacher must score the student's token ids as the same strings: equal vocabularies, or a ConfigError naming
    both (cross-tokenizer distillation is not supported)."""
    if student_tokenizer.get_vocab() != teacher_tokenizer.get_vocab():
        s, t = len(student_tokenizer.get_vocab()), len(teacher_tokenizer.get_vocab())
        raise ConfigError(
            f"teacher.model_name={teacher_name!r} has a tokenizer ({t} tokens) different from the student's "
            f"policy.model_name={student_name!r} ({s} tokens): the teacher scores the student's token ids, so both need the same "
            "tokenizer; cross-tokenizer distillation is not supported"
        )


def start_teacher_pass(teacher: Any, batch: dict[str, torch.Tensor]) -> Any:
    """Start the teacher's pass over ``batch`` on its workers (a frozen :class:`~nemo_like.models.policy.policy.Policy`
    of the teacher's model); :func:`gather_teacher_pass` waits for it."""
    return teacher.get_logprobs_async(batch)


def gather_teacher_pass(teacher: Any, pending: Any) -> dict[str, torch.Tensor]:
    """The batch entries the teacher's pass adds: ``teacher_logprobs`` ([B, S], the teacher's logprob of each token)."""
    return {"teacher_logprobs": teacher.gather_logprobs(pending, "teacher logprobs")}


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((values * mask).sum() / mask.sum().clamp(min=1))


def apply_distillation(cfg: MasterConfig, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """Add the teacher's per-token signal to ``batch["advantages"]`` (in place, see the module docstring) and return
    the ``distillation/*`` metrics. ``batch`` holds ``teacher_logprobs`` and ``prev_logprobs`` ([B, S], aligned with
    ``input_ids``) and ``token_mask`` (1 on sampled tokens)."""
    mask = batch["token_mask"].float()
    if "sample_mask" in batch:
        mask = mask * batch["sample_mask"].float().unsqueeze(-1)
    teacher, student = batch["teacher_logprobs"], batch["prev_logprobs"]
    gap = (teacher - student) * mask
    d = cfg.distillation
    batch["advantages"] = d.task_advantage_weight * batch["advantages"] + d.advantage_weight * gap
    return {
        "distillation/teacher_kl": _masked_mean(student - teacher, mask),
        "distillation/teacher_logprob_mean": _masked_mean(teacher, mask),
        "distillation/student_logprob_mean": _masked_mean(student, mask),
        "distillation/advantage_mean": _masked_mean(d.advantage_weight * gap, mask),
    }
