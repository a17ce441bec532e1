"""Masked reductions ignore garbage at masked positions; each loss aggregation matches a hand value
and is invariant to micro-batching and to the data-parallel split (global counts, summed losses)."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_like.algorithms.loss_functions import (
    ClippedPGLossFn,
)
from nemo_like.algorithms.utils import masked_mean
from nemo_like.config.loss import LOSS_AGGREGATIONS, ClippedPGLossConfig
from nemo_like.models.policy.batching import take_rows
from nemo_like.models.policy.policy import optimizer_step_shards
from nemo_like.models.policy.training import step_valid_counts

# ---------------------------------------------------------------- masked_mean


@pytest.mark.parametrize("garbage", [math.nan, -math.inf, math.inf])
def test_masked_mean_ignores_non_finite_values_at_masked_positions(garbage: float) -> None:
    values = torch.tensor([1.0, 2.0, garbage, 4.0])
    mask = torch.tensor([1.0, 0.0, 0.0, 1.0])
    assert masked_mean(values, mask).item() == 2.5
    assert masked_mean(values, mask.bool()).item() == 2.5
    assert masked_mean(values, mask, global_normalization_factor=4.0).item() == 1.25
    rows = torch.stack([values, values])
    assert masked_mean(rows, torch.stack([mask, mask]), dim=-1).tolist() == [2.5, 2.5]


def test_loss_and_metrics_are_finite_with_garbage_in_a_masked_sample() -> None:
    clean = _batch()
    dirty = {k: v.clone() for k, v in clean.items()}
    dirty["sample_mask"][1] = 0.0
    for key in ("generation_logprobs", "prev_logprobs", "reference_policy_logprobs", "advantages"):
        dirty[key][1] = math.nan
    dirty["generation_logprobs"][2, 0] = -math.inf  # a masked (prompt) position of a kept sample
    curr = dirty.pop("curr").clone().requires_grad_(True)
    fn = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.1, use_importance_sampling_correction=True))
    valid = dirty["token_mask"] * dirty["sample_mask"][:, None]
    loss, fragments = fn(curr, dirty, dirty["sample_mask"].sum(), valid.sum())
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(curr.grad).all()
    assert all(math.isfinite(v) or k.endswith(("_min", "_max")) for k, v in fragments.items()), fragments


# ---------------------------------------------------------------- hand-computed aggregations

# Two sequences, ratio 1 everywhere (curr = prev = gen), so the per-token loss is -A:
#   seq 0: tokens A = 1, 2, 3 (sum 6, mean 2);  seq 1: token A = 4 (sum 4, mean 4), then padding.
HAND = {
    "token-mean": -(1 + 2 + 3 + 4) / 4,  # -2.5
    "seq-mean-token-mean": -(2 + 4) / 2,  # -3
    "seq-mean-token-sum": -(6 + 4) / 2,  # -5
    "seq-mean-token-sum-norm": -(6 + 4) / (2 * 8),  # C = 8: -0.625
    "token-sum": -(1 + 2 + 3 + 4),  # -10
}


def _hand_batch() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logp = torch.full((2, 4), math.log(0.5), dtype=torch.float64)
    data = {
        "advantages": torch.tensor([[0, 1, 2, 3], [0, 4, 0, 0]], dtype=torch.float64),
        "token_mask": torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0]], dtype=torch.float64),
        "sample_mask": torch.ones(2, dtype=torch.float64),
        "generation_logprobs": logp.clone(),
        "prev_logprobs": logp.clone(),
    }
    return logp.clone().requires_grad_(True), data


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_each_aggregation_matches_the_hand_value(mode: str) -> None:
    curr, data = _hand_batch()
    fn = ClippedPGLossFn(ClippedPGLossConfig(loss_aggregation=mode, loss_aggregation_normalizer=8))
    loss, _ = fn(curr, data, global_valid_seqs=2, global_valid_toks=4)
    assert loss.item() == pytest.approx(HAND[mode], rel=1e-12)
    # d loss / d log pi_curr(t) = -A_t * (weight of t): check token 1 of seq 0 (A = 1) and seq 1 (A = 4).
    (grad,) = torch.autograd.grad(loss, curr)
    weight0, weight1 = {
        "token-mean": (1 / 4, 1 / 4),
        "seq-mean-token-mean": (1 / 6, 1 / 2),
        "seq-mean-token-sum": (1 / 2, 1 / 2),
        "seq-mean-token-sum-norm": (1 / 16, 1 / 16),
        "token-sum": (1.0, 1.0),
    }[mode]
    assert grad[0, 1].item() == pytest.approx(-1 * weight0) and grad[1, 1].item() == pytest.approx(-4 * weight1)


@pytest.mark.parametrize(("token_level_loss", "mode"), [(True, "token-mean"), (False, "seq-mean-token-mean")])
def test_token_level_loss_is_the_legacy_spelling_of_two_modes(token_level_loss: bool, mode: str) -> None:
    cfg = ClippedPGLossConfig(token_level_loss=token_level_loss)
    assert cfg.aggregation == mode
    curr, data = _hand_batch()
    loss, _ = ClippedPGLossFn(cfg)(curr, data, 2, 4)
    assert loss.item() == pytest.approx(HAND[mode])
    ClippedPGLossConfig(token_level_loss=token_level_loss, loss_aggregation=mode)  # consistent: fine


def test_sum_norm_without_a_normalizer_is_a_clear_error() -> None:
    curr, data = _hand_batch()
    with pytest.raises(ValueError, match="loss_fn.loss_aggregation_normalizer"):
        ClippedPGLossFn(ClippedPGLossConfig(loss_aggregation="seq-mean-token-sum-norm"))(curr, data, 2, 4)


def test_recipe_sum_norm_defaults_to_the_maximum_response_length() -> None:
    from nemo_like.config import load_config

    cfg = load_config(None, ["loss_fn.loss_aggregation=seq-mean-token-sum-norm", "policy.generation.max_new_tokens=24"])
    assert cfg.loss_fn.loss_aggregation_normalizer == 24.0
    cfg = load_config(None, ["loss_fn.loss_aggregation=seq-mean-token-sum-norm", "loss_fn.loss_aggregation_normalizer=100"])
    assert cfg.loss_fn.loss_aggregation_normalizer == 100.0


# ---------------------------------------------------------------- micro-batch / data-parallel invariance


def _batch(num: int = 6, width: int = 9, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random right-padded rows: prompt at position 0, 1..7 response tokens, off-policy logprobs."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width - 1, (num,), generator=g)
    positions = torch.arange(width)[None, :]
    token_mask = ((positions >= 1) & (positions <= lengths[:, None])).double()
    attention = (positions <= lengths[:, None]).long()

    def logp(scale: float) -> torch.Tensor:
        return -torch.rand(num, width, generator=g, dtype=torch.float64) * scale - 0.05

    gen = logp(2.0)
    prev = gen + 0.3 * torch.randn(num, width, generator=g, dtype=torch.float64)
    return {
        "input_ids": torch.randint(3, 50, (num, width), generator=g) * attention,
        "attention_mask": attention,
        "token_mask": token_mask,
        "sample_mask": torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.float64)[:num],
        "advantages": torch.randn(num, 1, generator=g, dtype=torch.float64).expand(num, width) * token_mask,
        "generation_logprobs": gen,
        "prev_logprobs": prev,
        "reference_policy_logprobs": prev + 0.2 * torch.randn(num, width, generator=g, dtype=torch.float64),
        "curr": prev + 0.4 * torch.randn(num, width, generator=g, dtype=torch.float64),
    }


def _loss_and_grad(cfg: ClippedPGLossConfig, batch: dict[str, torch.Tensor], shards: list[list[tuple[int, int]]]):
    """Sum of the micro-batch losses over 'ranks' (each a list of [start, stop) row ranges), the
    gradient w.r.t. the full curr tensor, and the combined metrics; global counts as policy.train makes them."""
    fn = ClippedPGLossFn(cfg)
    curr_full = batch["curr"].clone().requires_grad_(True)
    valid = batch["token_mask"] * batch["sample_mask"][:, None]
    gtoks, gseqs = valid.sum(), batch["sample_mask"].sum()
    total = torch.zeros((), dtype=torch.float64)
    fragments = []
    for rank in shards:
        for start, stop in rank:
            mb = take_rows({k: v for k, v in batch.items() if k != "curr"}, list(range(start, stop)))
            width = mb["input_ids"].shape[1]
            loss, metrics = fn(curr_full[start:stop, :width], mb, gseqs, gtoks)
            total = total + loss
            fragments.append(metrics)
    (grad,) = torch.autograd.grad(total, curr_full)
    return total.item(), grad, fn.combine_metrics(fragments)


CONFIGS = {
    mode: ClippedPGLossConfig(
        loss_aggregation=mode,
        loss_aggregation_normalizer=7,
        reference_policy_kl_penalty=0.05,
        use_importance_sampling_correction=True,
        ratio_clip_max=0.28,
        kl_tau=0.01,
    )
    for mode in LOSS_AGGREGATIONS
}


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_micro_batches_and_data_parallel_ranks_sum_to_the_full_batch(mode: str) -> None:
    batch = _batch()
    full_loss, full_grad, full_metrics = _loss_and_grad(CONFIGS[mode], batch, [[(0, 6)]])
    assert full_grad.abs().sum() > 0
    splits = {
        "3 micro-batches of 2": [[(0, 2), (2, 4), (4, 6)]],
        "6 micro-batches of 1": [[(i, i + 1) for i in range(6)]],
        "dp=2, micro 1": [[(0, 1), (1, 2), (2, 3)], [(3, 4), (4, 5), (5, 6)]],
        "dp=3, micro 2": [[(0, 2)], [(2, 4)], [(4, 6)]],
    }
    for name, shards in splits.items():
        loss, grad, metrics = _loss_and_grad(CONFIGS[mode], batch, shards)
        assert loss == pytest.approx(full_loss, rel=1e-12, abs=1e-14), name
        torch.testing.assert_close(grad, full_grad, rtol=1e-10, atol=1e-14, msg=name)
        for key in ("loss", "actor_loss", "kl_penalty", "probs_ratio", "num_valid_tokens"):
            assert metrics[key] == pytest.approx(full_metrics[key], rel=1e-10, abs=1e-14), (name, key)


def test_split_rows_matches_the_by_hand_dp_split() -> None:
    """The DP shards above are the ones the policy makes (contiguous equal row blocks, the whole batch's counts)."""
    batch = {k: v for k, v in _batch().items() if k != "curr"}
    (first,), (second,) = optimizer_step_shards(batch, 1, 2)
    torch.testing.assert_close(second["prev_logprobs"], batch["prev_logprobs"][3:6])
    valid = batch["token_mask"] * batch["sample_mask"].unsqueeze(-1)
    assert float(first["global_valid_toks"]) == float(second["global_valid_toks"]) == float(valid.sum())


def test_a_rank_without_rows_in_one_optimizer_step_averages_over_every_step() -> None:
    """3 rows, 2 optimizer steps, 2 ranks: rank 0 has no row in step 1. Its train metrics were averaged over the one
    step it had rows in, so summed over ranks every mean was inflated (an on-policy probs_ratio of 1.25)."""
    torch.manual_seed(0)
    rows, width = 3, 5
    logprobs = -torch.rand(rows, width, dtype=torch.float64)
    batch = {
        "input_ids": torch.zeros(rows, width, dtype=torch.long),
        "token_mask": torch.ones(rows, width, dtype=torch.float64),
        "sample_mask": torch.ones(rows, dtype=torch.float64),
        "advantages": torch.randn(rows, width, dtype=torch.float64),
        "generation_logprobs": logprobs.clone(),
        "prev_logprobs": logprobs.clone(),
    }
    fn = ClippedPGLossFn()

    def train_metrics(dp: int) -> dict[str, float]:
        per_rank = optimizer_step_shards(batch, 2, dp)
        results = []
        for steps in per_rank:  # as PolicyWorker.train: each step's fragments combined, then the steps
            per_step = []
            for shard in steps:
                fragments = []
                if shard["input_ids"].shape[0]:
                    fragments.append(fn(shard["prev_logprobs"], shard, shard["global_valid_seqs"], shard["global_valid_toks"])[1])
                per_step.append(fn.combine_metrics(fragments))
            results.append(fn.combine_steps(per_step, step_counts=step_valid_counts(steps)))
        return fn.combine_metrics(results)  # as Policy.train, over ranks

    assert [[s["input_ids"].shape[0] for s in steps] for steps in optimizer_step_shards(batch, 2, 2)] == [[0, 1], [1, 1]]
    one, two = train_metrics(1), train_metrics(2)
    assert two["probs_ratio"] == pytest.approx(1.0, abs=1e-12)
    for key in ("loss", "actor_loss", "probs_ratio", "approx_entropy", "num_valid_tokens"):
        assert two[key] == pytest.approx(one[key], rel=1e-12, abs=1e-14), key


@pytest.mark.parametrize("gspo", [False, True], ids=["token-ratios", "gspo-sequence-ratios"])
@pytest.mark.parametrize("dp", [1, 2])
def test_a_train_calls_metrics_are_means_over_its_tokens_not_over_its_steps(dp: int, gspo: bool) -> None:
    """Two optimizer steps, one of 1 valid token far off the generation policy and one of 9 matched ones: the call's
    gen_kl was the mean of the two steps' values (about half the outlier's), not the mean over its 10 tokens."""
    width = 10
    prev = torch.full((4, width), -1.0, dtype=torch.float64)
    gen = prev.clone()
    gen[0, 1] = -4.0  # the one token of step 1 that generation saw very differently
    token_mask = torch.zeros(4, width, dtype=torch.float64)
    token_mask[0, 1] = 1.0  # step 1: rows 0-1, 1 valid token
    token_mask[2:, 1:] = 1.0  # step 2: rows 2-3, 18 valid tokens
    batch = {
        "input_ids": torch.zeros(4, width, dtype=torch.long), "token_mask": token_mask,
        "sample_mask": torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64),
        "advantages": torch.ones(4, width, dtype=torch.float64), "generation_logprobs": gen, "prev_logprobs": prev,
    }  # fmt: skip
    fn = ClippedPGLossFn(ClippedPGLossConfig(sequence_level_importance_ratios=True, token_level_loss=False) if gspo else None)
    per_rank = optimizer_step_shards(batch, 2, dp)
    results = []
    for steps in per_rank:  # as PolicyWorker.train
        per_step = []
        for shard in steps:
            fragments = (
                [fn(shard["prev_logprobs"], shard, shard["global_valid_seqs"], shard["global_valid_toks"])[1]]
                if shard["input_ids"].shape[0]
                else []
            )
            per_step.append(fn.combine_metrics(fragments))
        results.append(fn.combine_steps(per_step, step_counts=step_valid_counts(steps)))
    call = fn.combine_metrics(results)
    valid = token_mask * batch["sample_mask"][:, None]
    whole = {**batch, "global_valid_seqs": batch["sample_mask"].sum(), "global_valid_toks": valid.sum()}
    direct = fn.combine_metrics([fn(prev, whole, whole["global_valid_seqs"], whole["global_valid_toks"])[1]])  # every token at once
    keys = ("gen_kl", "policy_kl", "token_mult_prob_error", "rollout_corr/rollout_ppl", "rollout_corr/training_ppl")
    for key in (*keys, "sampling_importance_ratio", "approx_entropy"):  # GSPO: the IS ratio is a mean over sequences
        assert call[key] == pytest.approx(direct[key], rel=1e-12), key
    first_step = optimizer_step_shards(batch, 2, 1)[0][0]  # the outlier's step alone: its gen_kl is the outlier's
    alone = fn.combine_metrics(
        [fn(first_step["prev_logprobs"], first_step, first_step["global_valid_seqs"], first_step["global_valid_toks"])[1]]
    )
    assert call["gen_kl"] < 0.1 * alone["gen_kl"]  # one token of 19; the mean over the two steps was about half of it


def test_take_rows_keeps_every_column_that_holds_a_real_token() -> None:
    """A micro-batch was cut to its rows' largest count of real tokens: right-padded rows lost only padding, but a
    left-padded row (which the logprob forward supports) lost its last tokens, scored 0 and dropped from the loss."""
    ids = torch.arange(20).view(2, 10)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, 6:] = 0  # right-padded: 6 real tokens, columns 6.. are padding
    mask[1, :4] = 0  # left-padded: 6 real tokens at columns 4..9
    batch = {"input_ids": ids, "attention_mask": mask, "sample_mask": torch.ones(2)}
    assert take_rows(batch, [0])["input_ids"].tolist() == [ids[0, :6].tolist()]  # trailing padding dropped
    left = take_rows(batch, [1])
    assert left["input_ids"].tolist() == [ids[1].tolist()] and left["attention_mask"].tolist() == [mask[1].tolist()]
    assert take_rows(batch, [0, 1])["input_ids"].shape == (2, 10) and take_rows(batch, [])["input_ids"].shape == (0, 1)
