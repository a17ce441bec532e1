"""The distillation advantage against hand-computed values, its config rules, the plan and the tokenizer check."""

from __future__ import annotations

import pytest
import torch

from nemo_like.algorithms.distillation import apply_distillation, check_teacher_tokenizer
from nemo_like.config import DEFAULT_RECIPE, load_config
from nemo_like.config.errors import ConfigError
from nemo_like.models.assets import default_model_path, embedded_model_path
from nemo_like.models.loading import load_tokenizer
from nemo_like.plan.run_plan import decide_run_plan

TEACHER = "teacher.model_name=embedded:tiny-arith-teacher"


def recipe(*overrides: str):
    return load_config(DEFAULT_RECIPE, list(overrides), warn=False)


def fixed_batch() -> dict[str, torch.Tensor]:
    # Two samples, four positions: the prompt (position 0) and padding are masked out; sample 1 is masked as a whole.
    token_mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.float32)
    return {
        "token_mask": token_mask,
        "sample_mask": torch.tensor([1.0, 0.0]),
        "advantages": torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, -1.0, -1.0, -1.0]]) * token_mask,
        "prev_logprobs": torch.tensor([[0.0, -1.0, -2.0, -9.0], [0.0, -0.5, -0.5, -0.5]]),
        "teacher_logprobs": torch.tensor([[0.0, -0.25, -3.0, -1.0], [0.0, -1.5, -0.5, -2.5]]),
    }


def test_the_advantage_is_the_weighted_task_advantage_plus_the_teacher_gap_on_sampled_tokens() -> None:
    batch = fixed_batch()
    metrics = apply_distillation(recipe(TEACHER, "distillation.advantage_weight=2", "distillation.task_advantage_weight=0.5"), batch)
    # Sample 0, token 1: 0.5 * 0.5 + 2 * (-0.25 - -1) = 1.75; token 2: 0.25 + 2 * (-3 - -2) = -1.75; masked: 0.
    expected = torch.tensor([[0.0, 1.75, -1.75, 0.0], [0.0, -0.5, -0.5, -0.5]])
    torch.testing.assert_close(batch["advantages"], expected, rtol=0, atol=0)
    # Over sample 0's two sampled tokens: log pi_S - log pi_T = (-1 + 0.25, -2 + 3) -> mean 0.125.
    assert metrics["distillation/teacher_kl"] == pytest.approx(0.125)
    assert metrics["distillation/teacher_logprob_mean"] == pytest.approx(-1.625)
    assert metrics["distillation/student_logprob_mean"] == pytest.approx(-1.5)
    assert metrics["distillation/advantage_mean"] == pytest.approx(-0.25)


def test_rows_without_a_teacher_keep_only_the_weighted_task_advantage() -> None:
    batch = fixed_batch()
    batch["sample_mask"] = torch.tensor([1.0, 1.0])
    batch["teacher_mask"] = torch.tensor([0.0, 1.0])  # teacher.by_task: no teacher for sample 0's task
    apply_distillation(recipe(TEACHER, "distillation.task_advantage_weight=0.5"), batch)
    # Sample 0: 0.5 * task; sample 1: 0.5 * task + (teacher - student) on its three sampled tokens.
    expected = torch.tensor([[0.0, 0.25, 0.25, 0.0], [0.0, -0.5 - 1.0, -0.5 + 0.0, -0.5 - 2.0]])
    torch.testing.assert_close(batch["advantages"], expected, rtol=0, atol=0)


def test_a_step_where_no_row_has_a_teacher_logs_no_value_not_a_perfect_match() -> None:
    # teacher.by_task: this step drew only prompts of tasks without a teacher (teacher_mask 0 everywhere). A mean over
    # no token is NaN (logged as "nan"), not the 0 KL / probability-1 logprobs of a student matching its teacher.
    import math

    batch = fixed_batch()
    batch["sample_mask"] = torch.tensor([1.0, 1.0])
    batch["teacher_mask"] = torch.tensor([0.0, 0.0])
    batch["generation_logprobs"] = batch["prev_logprobs"].clone()
    metrics = apply_distillation(recipe(TEACHER, "distillation.task_advantage_weight=0.5"), batch)
    assert sorted(metrics) == [
        "distillation/advantage_mean",
        "distillation/student_logprob_mean",
        "distillation/teacher_kl",
        "distillation/teacher_logprob_mean",
    ]
    assert all(math.isnan(value) for value in metrics.values()), metrics
    torch.testing.assert_close(batch["advantages"], 0.5 * fixed_batch()["advantages"], rtol=0, atol=0)  # the task term only
    batch = fixed_batch()  # one row scored: its tokens' means again
    batch["teacher_mask"] = torch.tensor([1.0, 0.0])
    assert apply_distillation(recipe(TEACHER), batch)["distillation/teacher_kl"] == pytest.approx(0.125)


def test_teachers_by_task_route_each_task_and_each_model_gets_its_own_workers() -> None:
    from nemo_like.algorithms.roles import role_requests

    math = "+env.math.num_workers=1"
    cfg = recipe("+teacher.by_task.math=embedded:tiny-arith-teacher", "+teacher.by_task.arithmetic=embedded:tiny-arith-qwen2", math)
    assert cfg.teacher.enabled and cfg.teacher.models() == ["embedded:tiny-arith-teacher", "embedded:tiny-arith-qwen2"]
    assert cfg.teacher.model_for("math") == "embedded:tiny-arith-teacher" and cfg.teacher.model_for("other") is None
    plan = decide_run_plan(cfg, (), 2)
    assert plan.actors.teacher == 2 and [r.role for r in role_requests(cfg, plan)].count("teacher") == 2
    with pytest.raises(ValueError, match="teacher.tokenizer_name applies to teacher.model_name only"):
        recipe("+teacher.by_task.math=x", "teacher.tokenizer_name=y", math)
    with pytest.raises(ValueError, match=r"leaves the samples of \['arithmetic', 'math'\] with no training signal"):
        recipe("+teacher.by_task.math=null", "distillation.task_advantage_weight=0", math)
    # A teacher.model_name every task's by_task entry overrides starts no workers (it had been loaded, and scored nothing);
    # by_task giving the only task none leaves no teacher at all (its workers and the prev pass had run for nothing).
    overridden = recipe(TEACHER, "+teacher.by_task.arithmetic=embedded:tiny-arith-qwen2")
    assert overridden.teacher.models() == ["embedded:tiny-arith-qwen2"]
    assert any(line.startswith(f"teacher.model_name={TEACHER.split('=')[1]} has no effect") for line in overridden.no_effect_warnings())
    untaught = recipe(TEACHER, "+teacher.by_task.arithmetic=null")
    assert not untaught.teacher.enabled and untaught.teacher.models() == []
    assert decide_run_plan(untaught, (), 2).actors.teacher == 0
    # One task taught, the other not, and no task reward: the untaught task's rows would train on advantages of 0.
    with pytest.raises(ValueError, match=r"task_advantage_weight=0 leaves the samples of \['arithmetic'\] with no training signal"):
        recipe("+teacher.by_task.math=embedded:tiny-arith-teacher", "distillation.task_advantage_weight=0", math)
    recipe(
        "+teacher.by_task.math=embedded:tiny-arith-teacher",
        "teacher.model_name=embedded:tiny-arith-qwen2",
        "distillation.task_advantage_weight=0",
        math,
    )  # every task has a teacher: allowed
    # A task the run does not have (a typo) would never be scored: distillation silently off, teacher_kl reading 0.
    with pytest.raises(ValueError, match=r"teacher.by_task.arithmetc: no task of that name; the run's tasks \(env.<task>\) are "
                       r"\['arithmetic'\]. Did you mean 'arithmetic'\?"):  # fmt: skip
        recipe("+teacher.by_task.arithmetc=embedded:tiny-arith-teacher")


def test_each_teacher_models_scored_tokens_are_counted_for_the_mfu() -> None:
    from nemo_like.algorithms.distillation import teacher_token_counts

    attention = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    models = ["embedded:tiny-arith-teacher", "embedded:tiny-arith-qwen2"]
    started = ((3, 4), [("embedded:tiny-arith-qwen2", [0, 2], None)])  # row 1's task has no teacher, the first scored none
    assert teacher_token_counts(models, started, attention) == {"performance/num_teacher_tokens/1": 7.0}


def test_a_teacher_equal_to_the_student_adds_exactly_nothing() -> None:
    batch = fixed_batch()
    batch["teacher_logprobs"] = batch["prev_logprobs"].clone()
    task = batch["advantages"].clone()
    metrics = apply_distillation(recipe(TEACHER), batch)
    assert torch.equal(batch["advantages"], task) and metrics["distillation/teacher_kl"] == 0.0


def test_the_k1_estimate_matches_the_exact_reverse_kl_over_the_full_vocabulary() -> None:
    # One position, a 6-token vocabulary: sampling many tokens from pi_S and averaging log pi_S - log pi_T (what
    # distillation/teacher_kl reports) converges to sum_v pi_S(v) (log pi_S(v) - log pi_T(v)).
    gen = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(6, generator=gen).log_softmax(-1), torch.randn(6, generator=gen).log_softmax(-1)
    exact = float((student.exp() * (student - teacher)).sum())
    tokens = torch.multinomial(student.exp(), 200_000, replacement=True, generator=gen)
    batch = sampled_batch(tokens, student, teacher)
    assert apply_distillation(recipe(TEACHER), batch)["distillation/teacher_kl"] == pytest.approx(exact, abs=5e-3)


def sampled_batch(tokens: torch.Tensor, student: torch.Tensor, teacher: torch.Tensor, sampler: torch.Tensor | None = None) -> dict:
    """One row of sampled ``tokens`` with their student, teacher (and sampler's) logprobs from full distributions."""
    n = tokens.numel()
    batch = {
        "token_mask": torch.ones(1, n),
        "advantages": torch.zeros(1, n),
        "prev_logprobs": student[tokens].unsqueeze(0),
        "teacher_logprobs": teacher[tokens].unsqueeze(0),
    }
    if sampler is not None:
        batch["generation_logprobs"] = sampler[tokens].unsqueeze(0)
    return batch


def test_tokens_of_older_weights_are_importance_weighted_to_the_exact_reverse_kl() -> None:
    # An async batch: tokens drawn from pi_gen (older weights), not from the student. The plain k1 mean estimates
    # sum_v pi_gen(v) (log pi_S(v) - log pi_T(v)), the wrong distribution's average; weighted by pi_S / pi_gen it is the
    # exact reverse KL of the student again.
    gen = torch.Generator().manual_seed(0)
    student, teacher = (torch.randn(6, generator=gen).log_softmax(-1) for _ in range(2))
    sampler = (2 * torch.randn(6, generator=gen)).log_softmax(-1)  # far from the student: weights up to ~e^2
    exact = float((student.exp() * (student - teacher)).sum())
    tokens = torch.multinomial(sampler.exp(), 200_000, replacement=True, generator=gen)
    batch = sampled_batch(tokens, student, teacher, sampler)
    plain = float((student[tokens] - teacher[tokens]).mean())
    assert abs(plain - exact) > 1.0  # the unweighted mean is far off (-1.11 against 0.53): the test tells them apart
    # The estimator's standard error here is 0.011 (200k tokens): 0.06 is five of them.
    assert apply_distillation(recipe(TEACHER), batch)["distillation/teacher_kl"] == pytest.approx(exact, abs=0.06)


def test_task_weight_zero_without_a_teacher_is_an_error_and_unused_options_warn() -> None:
    with pytest.raises(ValueError, match="distillation.task_advantage_weight=0 leaves no training signal without a teacher"):
        recipe("distillation.task_advantage_weight=0")
    assert (
        "distillation.advantage_weight has no effect with teacher.model_name=null (no teacher)"
        in recipe("distillation.advantage_weight=2").no_effect_warnings()
    )
    assert any("its signal unused" in line for line in recipe(TEACHER, "distillation.advantage_weight=0").no_effect_warnings())


def test_the_teachers_signal_counts_in_the_checks_of_group_baselines_and_dynamic_sampling() -> None:
    """One sample per prompt warned that nothing trains, though the teacher's per-token advantage does (the warning
    told users to double their sampling for nothing); dynamic sampling dropped groups the teacher's signal trains on,
    silently, even with the task reward unweighted; a mistyped teacher.precision passed and crashed the planner with a
    bare KeyError."""
    one = ("grpo.num_generations_per_prompt=1",)
    assert not any("generations_per_prompt=1" in line for line in recipe(TEACHER, *one).no_effect_warnings())
    assert any("every advantage is 0" in line for line in recipe(*one).no_effect_warnings())
    assert any(
        line.startswith("distillation.task_advantage_weight=0.5 has no effect with grpo.num_generations_per_prompt=1")
        for line in recipe(TEACHER, *one, "distillation.task_advantage_weight=0.5").no_effect_warnings()
    )
    dynamic = "grpo.use_dynamic_sampling=true"
    with pytest.raises(ConfigError, match="grpo.use_dynamic_sampling=true keeps the groups whose task rewards differ, but"):
        recipe(TEACHER, dynamic, "distillation.task_advantage_weight=0")
    assert any("drops the groups whose task rewards" in line for line in recipe(TEACHER, dynamic).no_effect_warnings())
    assert not any("drops the groups" in line for line in recipe(dynamic).no_effect_warnings())
    with pytest.raises(ConfigError, match=r"teacher.precision: Input should be 'float32' or 'bfloat16'"):
        recipe(TEACHER, "teacher.precision=bf16")


def test_the_plan_runs_the_prev_and_teacher_passes_and_reserves_teacher_ranks() -> None:
    from nemo_like.algorithms.roles import role_requests

    cfg = recipe(TEACHER, "loss_fn.reference_policy_kl_penalty=0")
    plan = decide_run_plan(cfg, (), 2)
    assert plan.logprobs.compute_teacher and plan.logprobs.compute_prev
    assert any("needed by the distillation advantage" in r for r in plan.logprobs.reasons)
    assert plan.threads.teacher == 1 and "teacher 1 (auto)" in plan.threads.describe()
    assert [r.role for r in role_requests(cfg, plan)].count("teacher") == 1
    assert decide_run_plan(recipe(), (), 2).threads.teacher == 0  # no teacher: the split and its line are unchanged
    assert "teacher" not in decide_run_plan(recipe(), (), 2).threads.describe()


def test_the_teacher_runs_with_its_own_model_and_the_students_other_settings() -> None:
    cfg = recipe(TEACHER, "teacher.precision=bfloat16", "policy.lora_cfg.enabled=true")
    t = cfg.teacher_config()
    assert t.policy.model_name == "embedded:tiny-arith-teacher" and t.policy.precision == "bfloat16"
    assert not t.policy.lora_cfg.enabled and t.policy.dp_size == cfg.policy.dp_size
    assert cfg.policy.model_name != t.policy.model_name  # the student's config is untouched


def test_a_truncating_students_teacher_scores_under_its_full_distribution_so_the_kl_is_one() -> None:
    """Scored under the student's top-p, a token outside the teacher's own nucleus was scored over that nucleus plus
    the token: the teacher's scores summed to 1.2 here, and the exact expectation of distillation/teacher_kl under the
    student's samples came out negative (-0.116): not a KL, and the signal favoured a student unlike the teacher."""
    from nemo_like.models.processed_logprobs import SamplingDistribution, processed_token_logprobs, sampling_keep_mask

    cfg = recipe(TEACHER, "policy.generation.top_p=0.8", "policy.generation.temperature=0.9")
    g = cfg.teacher_config().policy.generation
    assert (g.top_p, g.top_k, g.temperature) == (1.0, None, 0.9)  # the student's temperature, no truncation
    student, teacher = SamplingDistribution(1.0, None, 0.8), SamplingDistribution(1.0, g.top_k, g.top_p)
    zs = torch.tensor([-1.37, 2.47, 0.68, -0.41, 0.48, -5.37])  # the student's nucleus is {1, 2}, the teacher's {1} at p 0.8
    zt = torch.tensor([1.14, 4.57, 2.65, 0.31, 0.96, -0.75])

    def scores(logits: torch.Tensor, dist: SamplingDistribution) -> torch.Tensor:
        return processed_token_logprobs(logits.expand(1, 6, 6).clone(), torch.arange(6)[None], dist)[0].double()

    s, t = scores(zs, student), scores(zt, teacher)
    assert float(t.exp().sum()) == pytest.approx(1.0)  # a distribution
    kept = sampling_keep_mask(zs[None], None, 0.8)[0]
    p = torch.where(kept, s.exp(), 0.0)
    estimate = float((p * torch.where(kept, s - t, 0.0)).sum())  # E_{x ~ S}[log S(x) - log T(x)], as apply_distillation
    exact = float((p[kept] * (p[kept].log() - torch.log_softmax(zt.double(), -1)[kept])).sum())
    assert estimate == pytest.approx(exact, rel=1e-5) and exact > 0  # float32 scores


def test_a_teacher_with_another_tokenizer_is_an_error_naming_both() -> None:
    student = load_tokenizer(default_model_path())
    check_teacher_tokenizer(student, "embedded:tiny-arith-qwen2", load_tokenizer(embedded_model_path("embedded:tiny-arith-teacher")), "t")
    other = load_tokenizer(embedded_model_path("embedded:tiny-tool-qwen2"))
    with pytest.raises(ConfigError, match="teacher.model_name='embedded:tiny-tool-qwen2' has a tokenizer .* cross-tokenizer"):
        check_teacher_tokenizer(student, "embedded:tiny-arith-qwen2", other, "embedded:tiny-tool-qwen2")


def test_the_kl_term_keys_contradictions_are_errors_and_unused_keys_warn() -> None:
    from nemo_like.models.policy.spec import PolicyWorkerSpec

    with pytest.raises(ValueError, match="distillation.kl_weight=0.5 needs a teacher"):
        recipe("distillation.kl_weight=0.5")
    with pytest.raises(ValueError, match="distillation.kl_support=teacher_top_k needs distillation.kl_top_k"):
        recipe(TEACHER, "distillation.kl_weight=1", "distillation.kl_support=teacher_top_k")
    with pytest.raises(ValueError, match="teacher.by_task is not supported"):
        recipe("+teacher.by_task.math=embedded:tiny-arith-teacher", "distillation.kl_weight=1", "+env.math.num_workers=1")
    # Refused at load (and so by `nemo-like plan`), not in each policy worker after the actors start.
    with pytest.raises(ValueError, match=r"kl_weight=1.0 with policy.dtensor_cfg.tensor_parallel_size=2 is not supported"):
        recipe(TEACHER, "distillation.kl_weight=1", "policy.dtensor_cfg.tensor_parallel_size=2", "policy.dp_size=2")
    assert "distillation.kl_top_k=8 has no effect with distillation.kl_support=full" in (
        recipe(TEACHER, "distillation.kl_weight=1", "distillation.kl_top_k=8").no_effect_warnings()
    )
    for key in ("kl_direction=reverse", "kl_support=teacher_top_k"):  # the support's k is needed only where the term is on
        assert any(
            f"distillation.{key} has no effect with distillation.kl_weight=0" in line
            for line in recipe(TEACHER, f"distillation.{key}").no_effect_warnings()
        )
    # The KL term alone is a training signal: no advantage weights needed.
    cfg = recipe(TEACHER, "distillation.kl_weight=1", "distillation.advantage_weight=0", "distillation.task_advantage_weight=0")
    assert cfg.no_effect_warnings() == recipe().no_effect_warnings()
    plan = decide_run_plan(cfg, (), 2)  # no advantage: no teacher actors (the term's teacher copy is in the policy workers)
    assert not plan.logprobs.compute_teacher and plan.threads.teacher == 0
    assert "teacher actors not started: distillation.advantage_weight=0 (no distillation advantage)" in plan.logprobs.reasons
    spec = PolicyWorkerSpec.from_config(cfg, True, object(), 1)  # type: ignore[arg-type]
    assert spec.teacher_kl is not None and spec.teacher_kl.model_name == "embedded:tiny-arith-teacher"
    assert PolicyWorkerSpec.from_config(recipe(TEACHER), True, object(), 1).teacher_kl is None  # off by default  # type: ignore[arg-type]
    assert cfg.teacher_config().policy.shared_prompt_forward is False  # the teacher runs the student's forward


class ScoredRows:
    """Stands for a teacher's worker group in :func:`gather_teacher_pass`: it hands back the logprobs its pass
    computed (here given), as ``Policy.gather_logprobs`` returns them for the rows it was sent."""

    def __init__(self, logprobs: torch.Tensor) -> None:
        self.logprobs = logprobs

    def gather_logprobs(self, refs, what: str) -> torch.Tensor:
        return self.logprobs


def test_a_by_task_teacher_scores_and_masks_only_its_tasks_rows() -> None:
    """teacher.by_task.math: the teacher's pass takes the math rows only, and only they get teacher logprobs and a
    teacher mask (a mask of every row gave rows without a teacher a distillation advantage of -log pi_S)."""
    from nemo_like.algorithms.distillation import Teachers, gather_teacher_pass

    cfg = recipe("+env.math.num_workers=1", "+teacher.by_task.math=embedded:tiny-arith-teacher")
    teachers = Teachers.__new__(Teachers)
    teachers.cfg = cfg
    tasks = ["arithmetic", "math", "arithmetic", "math"]
    assert teachers.rows_by_model(tasks) == {"embedded:tiny-arith-teacher": [1, 3]}
    scored = torch.tensor([[0.0, -0.5, -1.5], [0.0, -2.0, 0.0]])  # the two math rows, without the batch's last column
    teachers.models = {"embedded:tiny-arith-teacher": ScoredRows(scored)}
    out = gather_teacher_pass(teachers, ((4, 4), [("embedded:tiny-arith-teacher", [1, 3], None)]))
    torch.testing.assert_close(out["teacher_mask"], torch.tensor([0.0, 1.0, 0.0, 1.0]))
    expected = torch.zeros(4, 4)
    expected[[1, 3], :3] = scored
    torch.testing.assert_close(out["teacher_logprobs"], expected)


def test_reward_to_go_is_the_exact_gradient_of_the_sequence_kl_and_the_default_is_the_per_token_surrogate() -> None:
    # A two-token student over a three-token vocabulary (row 0: the first token's logits, row 1 + x1: the second's),
    # every one of its nine sequences enumerated: the exact gradient of KL(pi_S || pi_T) over whole sequences against
    # E_x[sum_t A_t grad log pi_S(x_t)] with A_t from apply_distillation, each sequence weighed by its probability.
    import itertools

    torch.manual_seed(0)
    vocab = 3
    student = torch.randn(1 + vocab, vocab, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(1 + vocab, vocab, dtype=torch.float64)

    def token_logprobs(logits: torch.Tensor, x: tuple[int, int]) -> torch.Tensor:
        table = logits.log_softmax(-1)
        return torch.stack([table[0, x[0]], table[1 + x[0], x[1]]])

    sequences = list(itertools.product(range(vocab), repeat=2))
    kl = sum(token_logprobs(student, x).sum().exp() * (token_logprobs(student, x) - token_logprobs(teacher, x)).sum() for x in sequences)
    (exact,) = torch.autograd.grad(kl, student)

    def expected_policy_gradient(*overrides: str) -> torch.Tensor:
        student_lp = torch.stack([token_logprobs(student, x) for x in sequences])  # [9, 2]
        batch = {
            "token_mask": torch.ones(len(sequences), 2),
            "advantages": torch.zeros(len(sequences), 2, dtype=torch.float64),
            "prev_logprobs": student_lp.detach(),
            "teacher_logprobs": torch.stack([token_logprobs(teacher, x) for x in sequences]),
        }
        apply_distillation(recipe(TEACHER, "distillation.task_advantage_weight=0", *overrides), batch)
        weights = student_lp.sum(-1).exp().detach()
        surrogate = -(weights[:, None] * batch["advantages"] * student_lp).sum()  # minimised: the gradient of -(-KL)
        return torch.autograd.grad(surrogate, student)[0]

    torch.testing.assert_close(expected_policy_gradient("distillation.reward_to_go=true"), exact, rtol=0, atol=1e-12)
    per_token = expected_policy_gradient()
    assert (per_token - exact).abs().max() > 0.05  # the first token's row: it ignores the first token's effect on the second
    torch.testing.assert_close(per_token[1:], exact[1:], rtol=0, atol=1e-12)  # the last token has nothing after it
    assert "distillation.reward_to_go has no effect with distillation.advantage_weight=0 (no teacher advantage)" in (
        recipe(
            TEACHER, "distillation.reward_to_go=true", "distillation.advantage_weight=0", "distillation.kl_weight=1"
        ).no_effect_warnings()
    )
    assert "distillation.reward_to_go has no effect with teacher.model_name=null (no teacher)" in (
        recipe("distillation.reward_to_go=true").no_effect_warnings()
    )
