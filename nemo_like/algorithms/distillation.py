"""On-policy distillation: the student samples, a teacher scores the student's tokens, and each sampled token's
advantage gets the teacher's per-token signal.

For a response x sampled from the student pi_S, the reverse KL to the teacher is
``KL(pi_S || pi_T) = E_{x ~ pi_S} sum_t [log pi_S(x_t | x_<t) - log pi_T(x_t | x_<t)]``. With the per-token reward
``r_t = log pi_T(x_t) - log pi_S(x_t)`` held fixed (stop-gradient), REINFORCE with the reward-to-go
``sum_{t' >= t} r_t'`` as token t's advantage is exactly the gradient of ``-KL`` (a token also changes the prefixes of
the later ones); with ``r_t`` alone (discount 0, the default, as on-policy distillation usually runs) it is the
per-token surrogate, which ignores that effect. Either advantage goes through the usual clipped policy-gradient loss
(GRPO's clipping and IS corrections unchanged). With ``distillation.task_advantage_weight`` the task reward's
advantage is kept beside it:

    A_t = task_advantage_weight * A_task + advantage_weight * G_t,   G_t = r_t  or  sum_{t' >= t} r_t' (reward_to_go)

``log pi_S`` is the prev-logprob pass (the policy's own logprob forward, the same computation as the teacher's), so a
teacher identical to the student gives exactly 0 where the student samples untruncated (the teacher scores under its
full distribution, so under top-k/top-p the two differ by the truncation). ``distillation/teacher_kl`` is the per-token mean of
``log pi_S - log pi_T`` over sampled tokens: the k1 estimator, unbiased for the per-token reverse KL under the
student's samples.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nemo_like.config.errors import ConfigError
from nemo_like.config.schema import MasterConfig
from nemo_like.utils.flops import TEACHER_TOKENS


class Teachers:
    """The run's teacher models, each a frozen :class:`~nemo_like.models.policy.policy.Policy` of its own workers, and
    which one scores each sample (by its prompt's task: ``teacher.by_task``, else ``teacher.model_name``)."""

    def __init__(self, cfg: MasterConfig, plan: Any, *, wait: bool = True) -> None:
        """``wait=False``: return once every teacher's workers are spawned; :meth:`wait_ready` waits for them."""
        from nemo_like.models.policy.policy import Policy

        self.cfg = cfg
        self.models: dict[str, Any] = {}
        try:
            for i, name in enumerate(cfg.teacher.models()):
                group = "teacher" if i == 0 else f"teacher{i}"
                self.models[name] = Policy(cfg.teacher_config(name), group, trainable=False, plan=plan, wait=False, role="teacher")
        except BaseException:
            self.shutdown()
            raise
        if wait:
            self.wait_ready()

    def wait_ready(self) -> Teachers:
        """Wait for every teacher's workers (their starts overlap); a failure releases every teacher."""
        try:
            for model in self.models.values():
                model.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        return self

    def rows_by_model(self, tasks: list[str]) -> dict[str, list[int]]:
        """The batch rows each teacher scores (rows whose task has no teacher are in none)."""
        rows: dict[str, list[int]] = {}
        for row, task in enumerate(tasks):
            model = self.cfg.teacher.model_for(task)
            if model is not None:
                rows.setdefault(model, []).append(row)
        return rows

    def shutdown(self) -> None:
        """Release every teacher's workers."""
        for policy in self.models.values():
            policy.shutdown()


def check_teacher_tokenizer(
    student_tokenizer: Any,
    student_name: str,
    teacher_tokenizer: Any,
    teacher_name: str,
    *,
    student_key: str = "policy.model_name",
    teacher_key: str = "teacher.model_name",
) -> None:
    """The teacher must score the student's token ids as the same strings: equal vocabularies, or a ConfigError naming
    both keys (``teacher_key``: the key that names the teacher's tokenizer, ``teacher.model_name``,
    ``teacher.by_task.<task>`` or ``teacher.tokenizer_name``; ``student_key``: ``policy.model_name``, or
    ``policy.tokenizer_name`` when set) with their values (cross-tokenizer distillation is not supported)."""
    if student_tokenizer.get_vocab() != teacher_tokenizer.get_vocab():
        s, t = len(student_tokenizer.get_vocab()), len(teacher_tokenizer.get_vocab())
        raise ConfigError(
            f"{teacher_key}={teacher_name!r} has a tokenizer ({t} tokens) different from the student's "
            f"{student_key}={student_name!r} ({s} tokens): the teacher scores the student's token ids, so both need the same "
            "tokenizer; cross-tokenizer distillation is not supported"
        )


def check_teacher_vocab(
    teacher_rows: int | None, teacher_name: str, teacher_key: str, student_ids: int, student_name: str, student_key: str
) -> None:
    """The teacher model's own vocabulary (``teacher_rows``: its embedding and output head rows, ``vocab_size`` in its
    config.json) must cover every id of the student's tokenizer (``0..student_ids-1``): its pass indexes its embedding
    with the student's sampled ids (an id past its rows failed mid-step with an IndexError). A ConfigError naming the
    key, the model, its rows and the student's id range; ``None`` rows (a config that states none): not checked."""
    if teacher_rows is not None and teacher_rows < student_ids:
        raise ConfigError(
            f"{teacher_key}={teacher_name!r} has {teacher_rows} vocabulary rows (vocab_size in its config.json, ids "
            f"0..{teacher_rows - 1}) but the student's tokenizer ({student_key}={student_name!r}) has token ids "
            f"0..{student_ids - 1}: the teacher cannot score the student's tokens; it needs the student's tokenizer "
            "and a vocabulary covering it (cross-tokenizer distillation is not supported)"
        )


def start_teacher_pass(teachers: Teachers, batch: dict[str, torch.Tensor], tasks: list[str]) -> Any:
    """Start each teacher's pass over the rows it scores (``tasks``: each row's task), concurrently on their workers;
    :func:`gather_teacher_pass` waits for them."""
    from nemo_like.models.policy.batching import take_rows

    pending = []
    for model, rows in teachers.rows_by_model(tasks).items():
        part = batch if len(rows) == len(tasks) else take_rows(batch, rows)
        pending.append((model, rows, teachers.models[model].get_logprobs_async(part)))
    return batch["input_ids"].shape, pending


def gather_teacher_pass(teachers: Teachers, started: Any) -> dict[str, torch.Tensor]:
    """The batch entries the teachers' passes add: ``teacher_logprobs`` ([B, S], each token's logprob under its row's
    teacher; 0 where none) and ``teacher_mask`` ([B], 1 for rows a teacher scored)."""
    shape, pending = started
    logprobs = torch.zeros(shape, dtype=torch.float32)
    mask = torch.zeros(shape[0], dtype=torch.float32)
    for model, rows, refs in pending:
        scored = teachers.models[model].gather_logprobs(refs, f"teacher logprobs ({model})")
        index = torch.tensor(rows)
        logprobs[index, : scored.shape[1]] = scored  # a subset of rows comes back without its trailing padding
        mask[index] = 1.0
    return {"teacher_logprobs": logprobs, "teacher_mask": mask}


def teacher_token_counts(models: list[str], started: Any, attention_mask: torch.Tensor) -> dict[str, float]:
    """``performance/num_teacher_tokens/<i>``: the tokens (prompt + response) the ``i``-th of ``models`` (the run's
    teacher models, ``teacher.models()`` order) scored in the pass ``started`` (:func:`start_teacher_pass`); what the
    step's MFU counts at each teacher's own parameter count (:func:`~nemo_like.utils.flops.step_flops`)."""
    _, pending = started
    return {f"{TEACHER_TOKENS}/{models.index(model)}": float(attention_mask[torch.tensor(rows)].sum()) for model, rows, _ in pending}


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """The mean of ``values`` over the tokens of ``mask``; NaN when the mask holds none (no value, not a 0 that reads
    as a teacher matching the student)."""
    count = mask.sum()
    return float((values * mask).sum() / count) if count > 0 else math.nan


def teacher_kl_estimate(student: torch.Tensor, teacher: torch.Tensor, sampler: torch.Tensor | None, mask: torch.Tensor) -> float:
    """The per-token reverse KL(pi_S || pi_T) at the sampled prefixes: the mean over sampled tokens of
    ``w (log pi_S - log pi_T)`` with ``w = pi_S(x) / pi_gen(x)``, unbiased when the tokens were drawn from ``pi_gen``
    (``sampler``: its logprobs). ``w`` is 1 for on-policy samples (sync, one update per rollout: prev == generation up
    to float rounding) and corrects samples of older weights (async runs), whose plain k1 mean is the KL under the
    wrong distribution (``tests/unit/algorithms/test_distillation_advantage.py``)."""
    weight = torch.exp(student - sampler) * mask if sampler is not None else mask
    return _masked_mean(weight * (student - teacher), mask)


def weigh_task_advantages(cfg: MasterConfig, batch: dict[str, torch.Tensor]) -> None:
    """Scale ``batch["advantages"]`` (the task reward's) by ``distillation.task_advantage_weight`` in place. A run with a
    teacher calls it whether or not the teacher's actors scored the batch: with ``advantage_weight: 0`` they are not
    started, and a task weight of 0 must still leave the KL loss term as the only signal."""
    batch["advantages"] = cfg.distillation.task_advantage_weight * batch["advantages"]


def apply_distillation(cfg: MasterConfig, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """Add the teacher's per-token signal to ``batch["advantages"]`` (in place, see the module docstring) and return
    the ``distillation/*`` metrics. ``batch`` holds ``teacher_logprobs`` and ``prev_logprobs`` ([B, S], aligned with
    ``input_ids``), ``token_mask`` (1 on sampled tokens) and optionally ``teacher_mask`` ([B], 0 for rows without a
    teacher: their advantage keeps only the weighted task term). The metrics are means over teacher-scored sampled
    tokens: NaN on a step with none (``teacher.by_task``: only tasks without a teacher drew prompts)."""
    mask = batch["token_mask"].float()
    for rows in ("sample_mask", "teacher_mask"):  # rows masked out, rows no teacher scored (teacher.by_task)
        if rows in batch:
            mask = mask * batch[rows].float().unsqueeze(-1)
    teacher, student = batch["teacher_logprobs"], batch["prev_logprobs"]
    gap = (teacher - student) * mask
    d = cfg.distillation
    if d.reward_to_go:  # each token's gap plus every later sampled token's in its row
        gap = gap.flip(-1).cumsum(-1).flip(-1) * mask
    weigh_task_advantages(cfg, batch)
    batch["advantages"] = batch["advantages"] + d.advantage_weight * gap
    return {
        "distillation/teacher_kl": teacher_kl_estimate(student, teacher, batch.get("generation_logprobs"), mask),
        "distillation/teacher_logprob_mean": _masked_mean(teacher, mask),
        "distillation/student_logprob_mean": _masked_mean(student, mask),
        "distillation/advantage_mean": _masked_mean(d.advantage_weight * gap, mask),
    }
