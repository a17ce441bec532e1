"""Driver-side masks: grpo.seq_logprob_error_threshold and grpo.rollout_rejection (hand-computed)."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from nemo_like.algorithms.grpo import trained_advantage_metrics
from nemo_like.algorithms.loss_functions import ClippedPGLossFn
from nemo_like.algorithms.rejection import (
    apply_driver_masks,
    apply_rollout_rejection,
    mask_high_mismatch_sequences,
)
from nemo_like.config import ConfigError, load_config
from nemo_like.config.loss import ClippedPGLossConfig
from nemo_like.config.rejection import RolloutRejectionConfig
from nemo_like.plan.logprob_passes import decide_logprob_passes

LOG = math.log


def _batch(log_ratios: list[list[float | None]], sample_mask: list[float] | None = None) -> dict[str, torch.Tensor]:
    """Rows of per-token log(pi_prev/pi_gen); None = not a response token. Position 0 is the prompt."""
    width = 1 + max((len(r) for r in log_ratios), default=0)
    num = len(log_ratios)
    token_mask = torch.zeros(num, width, dtype=torch.float64)
    prev = torch.full((num, width), -1.0, dtype=torch.float64)
    for i, row in enumerate(log_ratios):
        for t, value in enumerate(row, start=1):
            if value is not None:
                token_mask[i, t] = 1.0
                prev[i, t] = -1.0 + value
    gen = torch.full((num, width), -1.0, dtype=torch.float64)
    prev[:, 0] = math.nan  # garbage at the prompt position must never leak in
    return {
        "token_mask": token_mask,
        "sample_mask": torch.tensor(sample_mask if sample_mask is not None else [1.0] * num),
        "prev_logprobs": prev,
        "generation_logprobs": gen,
    }


# ---------------------------------------------------------------- seq_logprob_error_threshold


@pytest.mark.parametrize(
    "batch",
    [
        _batch([]),  # empty batch
        _batch([[0.5, 0.5], [2.0]], sample_mask=[0.0, 0.0]),  # all samples masked
        _batch([[None, None], [None]]),  # no response tokens at all
    ],
    ids=["empty", "all-masked", "no-tokens"],
)
def test_seq_logprob_error_on_an_empty_batch_reports_zeros(batch: dict[str, torch.Tensor]) -> None:
    before = batch["sample_mask"].clone()
    metrics = mask_high_mismatch_sequences(1.5, batch, torch.zeros(len(before)))
    assert metrics and all(v == 0.0 for v in metrics.values()), metrics
    assert torch.equal(batch["sample_mask"], before)


def test_seq_logprob_error_values_masking_and_metrics() -> None:
    # Per-sequence error exp(mean |dlogp|):
    #   s0: |dlogp| = 0, ln 4 -> exp(ln4 / 2) = 2      (masked at threshold 1.5, reward 1)
    #   s1: 0.1, -0.1        -> exp(0.1) = 1.10517     (kept)
    #   s2: ln 9             -> 9, but already masked  (ignored everywhere, stays masked)
    #   s3: no response tokens                          (ignored)
    #   s4: ln 3             -> 3                       (masked, reward 0)
    batch = _batch([[0.0, LOG(4)], [0.1, -0.1], [LOG(9)], [None], [-LOG(3)]], sample_mask=[1, 1, 0, 1, 1])
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])
    m = mask_high_mismatch_sequences(1.5, batch, rewards)
    assert batch["sample_mask"].tolist() == [0.0, 1.0, 0.0, 1.0, 0.0]
    e1 = math.exp(0.1)
    assert m["seq_logprob_error/max"] == pytest.approx(3.0)  # not 9 (masked sample)
    assert m["seq_logprob_error/masked_fraction"] == pytest.approx(2 / 3)  # of the 3 eligible samples
    assert m["seq_logprob_error/num_masked"] == 2.0
    assert m["seq_logprob_error/masked_correct_fraction"] == pytest.approx(0.5)
    assert (m["seq_logprob_error/mean_before"], m["seq_logprob_error/min_before"], m["seq_logprob_error/max_before"]) == (
        pytest.approx((2 + e1 + 3) / 3),
        pytest.approx(e1),
        pytest.approx(3.0),
    )
    assert (m["seq_logprob_error/mean_after"], m["seq_logprob_error/min_after"], m["seq_logprob_error/max_after"]) == (
        pytest.approx(e1),
        pytest.approx(e1),
        pytest.approx(e1),
    )


def test_our_statistic_is_below_nemo_rls_by_jensen() -> None:
    # |dlogp| = 0, 0, 0, ln 4: ours exp(mean) = 4^(1/4) = 1.414 (kept at 1.5);
    # NeMo-RL's mean(exp) = (1 + 1 + 1 + 4) / 4 = 1.75 (masked at 1.5). Documented in docs/guides/grpo.md.
    batch = _batch([[0.0, 0.0, 0.0, LOG(4)]])
    m = mask_high_mismatch_sequences(1.5, batch, torch.ones(1))
    assert m["seq_logprob_error/max"] == pytest.approx(4**0.25)
    assert batch["sample_mask"].tolist() == [1.0]


# ---------------------------------------------------------------- rollout rejection


def test_token_rejection_removes_tokens_from_the_mask_and_the_count() -> None:
    # ratios: s0 = [1, 3, 0.4], s1 = [2.5] (all rejected -> sample dropped too), s2 = [1.2, 0.9]
    batch = _batch([[0.0, LOG(3), LOG(0.4)], [LOG(2.5)], [LOG(1.2), LOG(0.9)]])
    cfg = RolloutRejectionConfig(level="token", lower=0.5, upper=2.0)
    m = apply_rollout_rejection(cfg, batch)
    assert batch["token_mask"].tolist() == [[0, 1, 0, 0], [0, 0, 0, 0], [0, 1, 1, 0]]
    assert batch["sample_mask"].tolist() == [1.0, 0.0, 1.0]
    assert (batch["token_mask"] * batch["sample_mask"][:, None]).sum() == 3  # was 6
    assert m["rollout_rejection/masked_token_fraction"] == pytest.approx(3 / 6)
    assert m["rollout_rejection/masked_seq_fraction"] == pytest.approx(1 / 3)
    assert m["rollout_rejection/token_frac_above"] == pytest.approx(2 / 6)
    assert m["rollout_rejection/token_frac_below"] == pytest.approx(1 / 6)
    ratios = torch.tensor([1, 3, 0.4, 2.5, 1.2, 0.9], dtype=torch.float64)
    assert m["rollout_rejection/token_ratio_max"] == pytest.approx(3.0)
    assert m["rollout_rejection/token_ratio_min"] == pytest.approx(0.4)
    assert m["rollout_rejection/token_ratio_std"] == pytest.approx(ratios.std(unbiased=False).item(), rel=1e-6)
    # Per-sequence diagnostics use the geometric-mean ratio at token level: s0 = (1.2)^(1/3), s1 = 2.5, s2 = sqrt(1.08).
    assert m["rollout_rejection/seq_stat_max"] == pytest.approx(2.5)
    assert m["rollout_rejection/seq_stat_min"] == pytest.approx(1.08**0.5, rel=1e-6)
    assert m["rollout_rejection/seq_frac_above"] == pytest.approx(1 / 3)


# s0: log-ratios [ln 2, ln 2]  -> sum ratio 4, geo mean 2, max token 2, min 2
# s1: [ln 3, -ln 3]            -> sum 1, mean 1, max token 3, min 1/3
# s2: [ln 0.8]                 -> 0.8 everywhere
SEQ_ROWS = [[LOG(2), LOG(2)], [LOG(3), -LOG(3)], [LOG(0.8)]]


@pytest.mark.parametrize(
    ("statistic", "lower", "upper", "kept"),
    [
        ("sum", 0.5, 3.0, [0, 1, 1]),  # 4 > 3
        ("mean", 0.5, 1.5, [0, 1, 1]),  # 2 > 1.5
        ("mean", 0.9, 2.5, [1, 1, 0]),  # 0.8 < 0.9
        ("max", 0.5, 2.5, [1, 0, 1]),  # token veto: s1 has 3 > 2.5 and 1/3 < 0.5
        ("max", 0.25, 2.9, [1, 0, 1]),  # s1: 3 > 2.9 (max), 1/3 >= 0.25
        # k3 = r - 1 - ln r, mean over tokens: s0 = 1 - ln 2 = 0.307; s1 = (2 - ln3 + (1/3 - 1 + ln 3)) / 2 = 0.667;
        # s2 = -0.2 - ln 0.8 = 0.0231
        ("k3", None, 0.5, [1, 0, 1]),
        ("k3", None, 0.1, [0, 0, 1]),
        # k1 = -ln r: s0 = -ln 2, s1 = 0, s2 = 0.223
        ("k1", -0.5, 0.2, [0, 1, 0]),
        # k2 = (ln r)^2 / 2: s0 = 0.240, s1 = 0.603, s2 = 0.0249
        ("k2", None, 0.3, [1, 0, 1]),
    ],
)
def test_sequence_rejection_by_statistic(statistic: str, lower: float | None, upper: float, kept: list[int]) -> None:
    batch = _batch(SEQ_ROWS)
    cfg = RolloutRejectionConfig(level="sequence", sequence_statistic=statistic, lower=lower, upper=upper)
    m = apply_rollout_rejection(cfg, batch)
    assert batch["sample_mask"].tolist() == [float(k) for k in kept]
    assert batch["token_mask"].sum() == 5  # sequence level leaves token_mask alone; sample_mask drops rows
    assert m["rollout_rejection/masked_seq_fraction"] == pytest.approx(kept.count(0) / 3)


def test_sequence_statistic_values_are_reported() -> None:
    batch = _batch(SEQ_ROWS)
    m = apply_rollout_rejection(RolloutRejectionConfig(level="sequence", sequence_statistic="sum", upper=3.0), batch)
    assert (m["rollout_rejection/seq_stat_max"], m["rollout_rejection/seq_stat_min"]) == (pytest.approx(4.0), pytest.approx(0.8))
    assert m["rollout_rejection/seq_frac_above"] == pytest.approx(1 / 3)
    assert m["rollout_rejection/seq_frac_below"] == 0.0
    # The rows' ratios of their summed log-ratios are 4, 1 and 0.8: their (population) std
    assert m["rollout_rejection/seq_stat_std"] == pytest.approx(torch.tensor([4.0, 1.0, 0.8]).std(correction=0).item())
    # 'max': each row's largest and smallest token ratio (2 and 2, 3 and 1/3, 0.8 and 0.8) span the summary, the std is
    # over the largest only
    m = apply_rollout_rejection(RolloutRejectionConfig(level="sequence", sequence_statistic="max", upper=3.0), _batch(SEQ_ROWS))
    assert (m["rollout_rejection/seq_stat_max"], m["rollout_rejection/seq_stat_min"]) == (pytest.approx(3.0), pytest.approx(1 / 3))
    assert m["rollout_rejection/seq_stat_std"] == pytest.approx(torch.tensor([2.0, 3.0, 0.8]).std(correction=0).item())
    # 'k3': a KL estimate is reported as it is (not as a ratio): the row means of e^x - 1 - x
    m = apply_rollout_rejection(RolloutRejectionConfig(level="sequence", sequence_statistic="k3", upper=3.0), _batch(SEQ_ROWS))
    k3 = [sum(math.exp(x) - 1 - x for x in row) / len(row) for row in SEQ_ROWS]
    assert (m["rollout_rejection/seq_stat_max"], m["rollout_rejection/seq_stat_min"]) == (pytest.approx(max(k3)), pytest.approx(min(k3)))


def test_a_long_sequences_summed_ratio_stays_finite_in_the_diagnostics() -> None:
    # 2048 tokens at +0.4 each: a summed log-ratio of 819, whose exp overflows float32 and float64 (inf, then a nan std).
    tokens = 2048
    batch = {
        "token_mask": torch.ones(2, tokens),
        "sample_mask": torch.ones(2),
        "prev_logprobs": torch.stack([torch.full((tokens,), -0.6), torch.full((tokens,), -1.0)]),
        "generation_logprobs": torch.full((2, tokens), -1.0),
    }
    m = apply_rollout_rejection(RolloutRejectionConfig(level="sequence", sequence_statistic="sum", upper=2.0), batch)
    assert batch["sample_mask"].tolist() == [0.0, 1.0]  # the masking compares logs: unaffected by the bound
    assert m["rollout_rejection/seq_stat_max"] == pytest.approx(math.exp(20.0)) and m["rollout_rejection/seq_stat_min"] == 1.0
    assert all(math.isfinite(v) for v in m.values()), m


def test_rejection_on_an_empty_batch_reports_zeros() -> None:
    for level in ("token", "sequence"):
        batch = _batch([[None]], sample_mask=[1.0])
        cfg = RolloutRejectionConfig(level=level, lower=0.5, upper=2.0)
        m = apply_rollout_rejection(cfg, batch)
        assert set(m) == set(apply_rollout_rejection(cfg, _batch(SEQ_ROWS))), m  # every metric, not none (an empty dict passed)
        assert all(v == 0.0 for v in m.values()), m


def test_rejected_tokens_leave_the_loss_normalisation_unlike_icepop_zeros() -> None:
    """Combined with TIS: icepop zeroes a token's weight but keeps it in the count; rejection removes it."""
    # One sequence, 3 tokens, A = 1, ratio pi_curr/pi_prev = 1, IS ratio pi_prev/pi_gen = [1, 1, 4].
    curr = torch.full((1, 4), LOG(0.2), dtype=torch.float64)
    prev = curr.clone()
    gen = prev - torch.tensor([[0.0, 0.0, 0.0, LOG(4)]], dtype=torch.float64)
    data = {
        "advantages": torch.tensor([[0.0, 1.0, 1.0, 1.0]], dtype=torch.float64),
        "token_mask": torch.tensor([[0.0, 1.0, 1.0, 1.0]], dtype=torch.float64),
        "sample_mask": torch.ones(1, dtype=torch.float64),
        "prev_logprobs": prev,
        "generation_logprobs": gen,
    }
    cfg = ClippedPGLossConfig(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="icepop",
        truncated_importance_sampling_ratio=2.0,
        truncated_importance_sampling_ratio_min=0.5,
    )

    def loss_of(batch: dict[str, torch.Tensor]) -> float:
        valid = batch["token_mask"] * batch["sample_mask"][:, None]
        loss, _ = ClippedPGLossFn(cfg)(curr.clone().requires_grad_(True), batch, batch["sample_mask"].sum(), valid.sum())
        return loss.item()

    assert loss_of(data) == pytest.approx(-2 / 3)  # icepop: weights [1, 1, 0], still 3 tokens
    rejected = {k: v.clone() for k, v in data.items()}
    apply_rollout_rejection(RolloutRejectionConfig(level="token", lower=0.5, upper=2.0), rejected)
    assert loss_of(rejected) == pytest.approx(-1.0)  # the token left: 2 tokens, mean of -1, -1


def test_driver_masks_follow_the_recipe() -> None:
    cfg = load_config(
        None,
        [
            "grpo.seq_logprob_error_threshold=2.5",
            "grpo.rollout_rejection.level=token",
            "grpo.rollout_rejection.upper=2.0",
        ],
        warn=False,
    )
    batch = _batch([[0.0, LOG(4)], [LOG(3), LOG(3)]])  # s1: error 3 > 2.5 -> masked; s0: token ratio 4 > 2 rejected
    metrics = apply_driver_masks(cfg, batch, torch.tensor([1.0, 0.0]))
    assert batch["sample_mask"].tolist() == [1.0, 0.0]
    assert batch["token_mask"][0].tolist() == [0.0, 1.0, 0.0]
    assert "seq_logprob_error/max" in metrics and "rollout_rejection/token_ratio_max" in metrics
    # train/advantages/* describe what the loss uses: the one token left (s0's first), not the rejected or masked ones
    batch["advantages"] = torch.tensor([[0.0, 1.0, 5.0], [0.0, -2.0, -2.0]]) * batch["token_mask"].new_tensor([[0, 1, 1], [0, 1, 1]])
    used = trained_advantage_metrics(batch, task_advantages=None)
    assert used == {"advantages/mean": 1.0, "advantages/max": 1.0, "advantages/min": 1.0}
    teacher_run = trained_advantage_metrics(batch, task_advantages=torch.full((2, 3), 3.0))
    assert teacher_run["task_advantages/mean"] == 3.0 and teacher_run["advantages/mean"] == 1.0


def test_a_failed_agent_sessions_placeholder_row_leaves_the_loss_normalisation() -> None:
    """The placeholder row of a failed session (one pad token, nothing to train on) was collated with sample_mask 1:
    with a real 4-token row beside it, seq-mean-token-mean's loss halved (-1.0 -> -0.5), num_valid_seqs was 2 and the
    per-sequence perplexities fell from e^2 towards 1 (4.19)."""
    from nemo_like.data.collate import collate_samples
    from nemo_like.data.prompts import PromptRecord
    from nemo_like.experience.agent_rollouts import placeholder_row
    from nemo_like.models.generation.interface import GeneratedSample

    real = GeneratedSample([5, 6, 7], [11, 12, 13, 2], [-2.0] * 4, False, 0, 0)
    placeholder = placeholder_row(PromptRecord("p0", [], [5, 6, 7]), pad_token_id=0, weight_version=0)
    cfg = load_config(None, [], warn=False)

    def metrics_of(samples: list[GeneratedSample]) -> dict[str, float]:
        batch = collate_samples(samples, pad_token_id=0)
        apply_driver_masks(cfg, batch, torch.zeros(len(samples)))
        curr = torch.where(batch["token_mask"] > 0, torch.tensor(-2.0), torch.tensor(0.0))  # the engine's logprobs
        batch["advantages"] = batch["token_mask"].clone()
        valid_tokens = (batch["token_mask"] * batch["sample_mask"][:, None]).sum()  # as optimizer_step_shards counts
        loss_fn = ClippedPGLossFn({"loss_aggregation": "seq-mean-token-mean"})
        return loss_fn(curr.clone().requires_grad_(True), batch, batch["sample_mask"].sum(), valid_tokens)[1]

    alone, beside = metrics_of([real]), metrics_of([real, placeholder])
    for key in ("loss", "num_valid_seqs", "rollout_corr/training_ppl", "rollout_corr/rollout_ppl"):
        assert beside[key] == pytest.approx(alone[key]), key
    assert alone["num_valid_seqs"] == 1 and alone["rollout_corr/training_ppl"] == pytest.approx(math.exp(2.0))


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"level": "token"}, "grpo.rollout_rejection.level='token' needs grpo.rollout_rejection.lower and/or"),
        (
            {"level": "token", "lower": 2.0, "upper": 0.5},
            "grpo.rollout_rejection.lower (2.0) must be below grpo.rollout_rejection.upper (0.5)",
        ),
        ({"level": "sequence", "lower": 0.0, "upper": 2.0}, "grpo.rollout_rejection.lower (0.0) must be > 0"),
        ({"level": "sequence", "sequence_statistic": "k4", "upper": 2.0}, "sequence_statistic"),
        ({"level": "token", "upper": True}, "expected a number, not a boolean"),
        # bounds that reject every on-policy sample (a ratio of 1, a KL of 0): accepted silently, the step trained on nothing
        ({"level": "token", "lower": 1.2}, "grpo.rollout_rejection.lower (1.2) must be at most 1: a sample generated by"),
        ({"level": "sequence", "upper": 0.9}, "grpo.rollout_rejection.upper (0.9) must be at least 1"),
        ({"level": "sequence", "sequence_statistic": "k3", "lower": 0.01}, "grpo.rollout_rejection.lower (0.01) must be at most 0"),
        ({"level": "sequence", "sequence_statistic": "k1", "upper": -0.01}, "grpo.rollout_rejection.upper (-0.01) must be at least 0"),
        # k2 and k3 are never negative: a lower bound alone rejected nothing, at the cost of the prev-logprob pass
        ({"level": "sequence", "sequence_statistic": "k2", "lower": -0.5}, "sequence_statistic='k2' needs grpo.rollout_rejection.upper"),
        ({"level": "sequence", "sequence_statistic": "k3", "lower": 0.0}, "sequence_statistic='k3' needs grpo.rollout_rejection.upper"),
    ],
)
def test_invalid_rejection_configs(kwargs: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RolloutRejectionConfig(**kwargs)


def test_kl_statistics_accept_non_positive_bounds() -> None:
    RolloutRejectionConfig(level="sequence", sequence_statistic="k1", lower=-0.5, upper=0.5)


def test_rejection_needs_the_prev_logprob_pass() -> None:
    on = ["grpo.rollout_rejection.level=sequence", "grpo.rollout_rejection.upper=2.0"]
    # The tiny recipe trains in one optimizer step per rollout, where the prev pass is otherwise skipped.
    assert not decide_logprob_passes(load_config(None, [], warn=False)).compute_prev
    plan = decide_logprob_passes(load_config(None, on, warn=False))
    assert plan.compute_prev and any("grpo.rollout_rejection" in r for r in plan.reasons)
    with pytest.raises(ConfigError, match="grpo.rollout_rejection.level is set, which needs the prev-logprob pass"):
        load_config(None, [*on, "grpo.skip_prev_logprobs=true"], warn=False)


def test_bounds_without_a_level_warn() -> None:
    cfg = load_config(None, ["grpo.rollout_rejection.upper=2.0"], warn=False)
    assert cfg.no_effect_warnings() == ["grpo.rollout_rejection.upper has no effect because grpo.rollout_rejection.level is null (ignored)"]
    bounded = ["grpo.rollout_rejection.level=sequence", "grpo.rollout_rejection.upper=0.1", "grpo.rollout_rejection.lower=0"]
    for statistic, warned in (("k1", False), ("k2", True), ("k3", True)):  # k1 can be negative
        cfg = load_config(None, [*bounded, f"grpo.rollout_rejection.sequence_statistic={statistic}"], warn=False)
        assert (
            f"grpo.rollout_rejection.lower has no effect with grpo.rollout_rejection.sequence_statistic='{statistic}' (the statistic "
            "is never negative) (ignored)" in cfg.no_effect_warnings()
        ) == warned


def test_the_sample_dump_keeps_a_rejected_tokens_logprobs_and_marks_it_untrained(tmp_path) -> None:
    """Token-level rejection replaced token_mask before the dump, which filtered the logprob columns by it: the lists
    came out shorter than response_token_ids and misaligned, without the drifted token one would look for."""
    import json
    from types import SimpleNamespace

    from nemo_like.algorithms.rejection import apply_driver_masks
    from nemo_like.algorithms.sample_reports import dump_train_samples
    from nemo_like.data.collate import collate_samples
    from nemo_like.data.prompts import PromptRecord
    from nemo_like.experience.rollouts import Rollout
    from nemo_like.models.generation.interface import GeneratedSample
    from nemo_like.models.loading import load_tokenizer

    cfg = load_config(
        None,
        [
            f"logger.log_dir={tmp_path}",
            "grpo.rollout_rejection.level=token",
            "grpo.rollout_rejection.lower=0.5",
            "grpo.rollout_rejection.upper=2.0",
        ],
    )
    tokenizer = load_tokenizer(cfg.policy.model_name)
    sample = GeneratedSample(
        prompt_ids=[5, 6, 7], response_ids=[20, 21, 22, 2], response_logprobs=[-0.1, -0.2, -0.3, -0.4], truncated=False, weight_version=0
    )
    rollout = Rollout([PromptRecord("p-0", [], [5, 6, 7], {})], torch.tensor([0]), [sample], ["x"], torch.tensor([1.0]))
    batch = collate_samples([sample], tokenizer.pad_token_id)
    batch["prev_logprobs"] = batch["generation_logprobs"].clone()
    batch["prev_logprobs"][0, 4] = -1.5  # token 21 drifted: ratio exp(-0.2 + 1.5) = 3.7 > 2.0
    batch["advantages"] = batch["token_mask"].clone()
    batch["advantages"][0, 5] = 0.5  # a per-token term (a teacher's): the dump keeps each token's value
    sampled = batch["token_mask"]
    apply_driver_masks(cfg, batch, rollout.rewards)
    assert batch["token_mask"].sum() == 3  # the drifted token is out of training
    dump_train_samples(SimpleNamespace(cfg=cfg, tokenizer=tokenizer), 1, rollout, batch, None, sampled)
    row = json.loads((tmp_path / "train_data_step1.jsonl").read_text().splitlines()[0])
    assert row["response_token_ids"] == [20, 21, 22, 2]
    assert row["generation_logprobs"] == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert row["prev_logprobs"] == pytest.approx([-0.1, -1.5, -0.3, -0.4]) and row["trained_token_mask"] == [1, 0, 1, 1]
    assert row["token_advantages"] == pytest.approx([1.0, 1.0, 0.5, 1.0]) and row["advantage"] == pytest.approx(0.875)
    assert row["weight_version_changes"] is None  # not recorded (vLLM, agent rows): unknown, not "no refit" ([])


def test_skipping_the_prev_pass_beside_any_of_its_consumers_is_an_error() -> None:
    """The sequence mask and the distillation advantage need the prev pass too: with grpo.skip_prev_logprobs=true the
    run only wrote a WARNING into its plan and computed the pass anyway, while the rejection mask was an error."""
    with pytest.raises(ConfigError, match="grpo.seq_logprob_error_threshold is set, which needs the prev-logprob pass"):
        load_config(None, ["grpo.seq_logprob_error_threshold=1.5", "grpo.skip_prev_logprobs=true"], warn=False)
    teacher = ["teacher.model_name=embedded:tiny-arith-teacher", "distillation.advantage_weight=1.0", "grpo.skip_prev_logprobs=true"]
    with pytest.raises(ConfigError, match=r"the distillation advantage \(teacher.model_name\) is set, which needs"):
        load_config(None, teacher, warn=False)
    # A teacher no task uses (by_task maps every task to null) is warned 'no effect': it needs no prev pass either
    unused = ["teacher.model_name=embedded:tiny-arith-teacher", "distillation.advantage_weight=1.0", "teacher.by_task={arithmetic: null}"]
    assert not load_config(None, [*unused, "grpo.skip_prev_logprobs=true"], warn=False).teacher.enabled
    forced = decide_logprob_passes(
        load_config(None, ["grpo.seq_logprob_error_threshold=1.5", "loss_fn.force_on_policy_ratio=true"], warn=False)
    )
    assert forced.compute_prev and not any("WARNING" in r for r in forced.reasons)


def test_logprob_batch_keys_warn_when_no_logprob_pass_runs() -> None:
    """With prev, reference and teacher all off, policy.logprob_batch_size and the logprob token budgets are read by
    nothing, and no warning said so."""
    none_run = ["loss_fn.reference_policy_kl_penalty=0"]  # the tiny recipe: one optimizer step per rollout, prev skipped
    plan = decide_logprob_passes(load_config(None, [*none_run, "policy.logprob_batch_size=4"], warn=False))
    assert not (plan.compute_prev or plan.compute_reference or plan.compute_teacher)
    assert "WARNING: policy.logprob_batch_size has no effect: no logprob pass runs (prev, reference and teacher are off)" in plan.reasons
    budgets = ["policy.dynamic_batching.enabled=true", "policy.dynamic_batching.logprob_mb_tokens=64"]
    assert any(
        "policy.dynamic_batching.logprob_mb_tokens has no effect" in r
        for r in decide_logprob_passes(load_config(None, [*none_run, *budgets], warn=False)).reasons
    )
    with_reference = decide_logprob_passes(load_config(None, ["policy.logprob_batch_size=4"], warn=False))  # the KL penalty on
    assert with_reference.compute_reference and not any("has no effect" in r for r in with_reference.reasons)


def test_a_nan_log_ratio_is_rejected_at_every_level_and_left_out_of_the_diagnostics() -> None:
    """No comparison holds for NaN: a NaN prev logprob passed every bound and the NaN reached the loss (the whole
    optimizer step was then skipped as non-finite); k3's expm1(inf) - inf of a -inf generation logprob likewise."""

    def batch(prev: list[list[float]], gen: list[list[float]]) -> dict[str, torch.Tensor]:
        prev_t, gen_t = torch.tensor(prev), torch.tensor(gen)
        token_mask = torch.ones_like(prev_t)
        token_mask[:, 0] = 0  # the prompt
        return {"prev_logprobs": prev_t, "generation_logprobs": gen_t, "token_mask": token_mask, "sample_mask": torch.ones(len(prev))}

    nan, inf = math.nan, math.inf
    b = batch([[0.0, -1.0, -1.0], [0.0, nan, -1.0]], [[0.0, -1.0, -1.0], [0.0, -1.0, -1.0]])
    metrics = apply_rollout_rejection(RolloutRejectionConfig(level="token", lower=0.5, upper=2.0), b)
    assert b["token_mask"].tolist() == [[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]]
    assert metrics["rollout_rejection/token_frac_nonfinite"] == 0.25 and metrics["rollout_rejection/token_ratio_max"] == 1.0
    b = batch([[0.0, -1.0, -1.0], [0.0, -inf, -1.0]], [[0.0, -1.0, -1.0], [0.0, -1.0, -1.0]])  # counted once, apart
    metrics = apply_rollout_rejection(RolloutRejectionConfig(level="token", lower=0.5, upper=2.0), b)
    assert (metrics["rollout_rejection/token_frac_below"], metrics["rollout_rejection/token_frac_nonfinite"]) == (0.0, 0.25)
    assert metrics["rollout_rejection/masked_token_fraction"] == 0.25
    b = batch([[0.0, -1.0, -1.0]], [[0.0, -inf, -1.0]])
    metrics = apply_rollout_rejection(RolloutRejectionConfig(level="sequence", sequence_statistic="k3", upper=0.1), b)
    assert b["sample_mask"].tolist() == [0.0] and metrics["rollout_rejection/seq_frac_nonfinite"] == 1.0
    b = batch([[0.0, -1.0, -1.0], [0.0, -1.0, -1.0]], [[0.0, -1.0, -1.0], [0.0, -inf, -1.0]])  # k1 of it is -inf
    metrics = apply_rollout_rejection(RolloutRejectionConfig(level="sequence", sequence_statistic="k1", upper=0.1), b)
    assert b["sample_mask"].tolist() == [1.0, 0.0] and math.isfinite(metrics["rollout_rejection/seq_stat_std"])
    b = batch([[0.0, -1.0, -1.0], [0.0, nan, -1.0]], [[0.0, -1.0, -1.0], [0.0, -1.0, -1.0]])
    metrics = mask_high_mismatch_sequences(1.5, b)
    assert b["sample_mask"].tolist() == [1.0, 0.0] and metrics["seq_logprob_error/max"] == 1.0
