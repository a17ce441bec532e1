"""Small tensor helpers shared by the loss, the advantage estimators and the metrics.

Per-token tensors follow the project convention: ``[B, S]`` aligned with ``input_ids``; entry ``t``
holds a value for token ``x_t`` (e.g. ``log pi(x_t | x_<t)``), and masks are 1 on the response
tokens that count and 0 on prompt, padding and position 0.
"""

from __future__ import annotations

import torch


def masked_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    dim: int | None = None,
    global_normalization_factor: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Mean of ``values`` over the entries where ``mask`` is 1.

    Args:
        values: any tensor.
        mask: same shape as ``values`` (broadcastable), 0/1 (bool or float). Values where the mask
            is 0 are never read, so NaN/inf there cannot leak into the result.
        dim: reduce over this dimension only; ``None`` reduces over everything.
        global_normalization_factor: divide the masked sum by this instead of the local mask count.
            Pass the global number of valid tokens (or sequences) so that summing the results over
            microbatches and data-parallel ranks yields the full-batch mean.

    Returns:
        The masked mean; 0 (not NaN) where the mask is empty.
    """
    mask = mask.to(values.dtype)
    # torch.where, not values * mask: NaN * 0 and inf * 0 are NaN, so garbage at masked positions
    # (padding logprobs, -inf) would otherwise poison the whole mean.
    weighted = torch.where(mask != 0, values * mask, torch.zeros((), dtype=values.dtype, device=values.device))
    masked_sum = weighted.sum() if dim is None else weighted.sum(dim=dim)
    if global_normalization_factor is not None:
        denom = torch.as_tensor(global_normalization_factor, dtype=values.dtype, device=values.device)
    else:
        denom = mask.sum() if dim is None else mask.sum(dim=dim)
    # An empty mask gives 0, never NaN: clamp the denominator, the numerator is already 0.
    return masked_sum / denom.clamp(min=1e-12) if torch.is_tensor(denom) else masked_sum / denom


def _prompt_group_index(prompt_ids: torch.Tensor) -> torch.Tensor:
    """Dense group index ``[B]`` (0..G-1): samples with equal ids (``[B]``) or equal rows (``[B, L]``) share it."""
    if prompt_ids.dim() == 1:
        return torch.unique(prompt_ids, return_inverse=True)[1]
    if prompt_ids.dim() == 2:
        return torch.unique(prompt_ids, dim=0, return_inverse=True)[1]
    raise ValueError(f"prompt_ids must be [B] group ids or [B, L] prompt rows, got shape {tuple(prompt_ids.shape)}")


def _raise_on_non_finite_rewards(rewards: torch.Tensor, prompt_ids: torch.Tensor, group: torch.Tensor) -> None:
    bad = (~torch.isfinite(rewards)).nonzero().flatten()
    if bad.numel() == 0:
        return
    shown = bad[:10].tolist()
    # Name the caller's prompt id when there is one; for [B, L] rows the dense group index is all we have.
    groups = (prompt_ids if prompt_ids.dim() == 1 else group)[bad[:10]].tolist()
    values = rewards[bad[:10]].tolist()
    more = f" (and {bad.numel() - len(shown)} more)" if bad.numel() > len(shown) else ""
    raise ValueError(
        f"Non-finite reward(s) at sample index(es) {shown}{more}, prompt group(s) {groups}, values {values}. "
        "A NaN/inf reward would silently turn every advantage of its prompt group into NaN; fix the reward function."
    )


def _check_baseline_shapes(prompt_ids: torch.Tensor, rewards: torch.Tensor, valid_mask: torch.Tensor) -> None:
    if rewards.dim() != 1 or valid_mask.shape != rewards.shape or prompt_ids.shape[:1] != rewards.shape:
        raise ValueError(
            "Expected rewards [B], valid_mask [B] and prompt_ids [B] or [B, L]; got "
            f"{tuple(rewards.shape)}, {tuple(valid_mask.shape)}, {tuple(prompt_ids.shape)}"
        )


def _group_reduce(x: torch.Tensor, group: torch.Tensor, num_groups: int, op: str, fill: float) -> torch.Tensor:
    """Per group, ``op`` (``sum``, ``amin``, ``amax``) of the float64 values ``x`` whose group index is ``group``."""
    init = torch.full((num_groups,), fill, dtype=torch.float64, device=x.device)
    if op == "sum":
        return init.index_add_(0, group, x)
    return init.scatter_reduce_(0, group, x, reduce=op, include_self=True)


def calculate_baseline_and_std_per_prompt(
    prompt_ids: torch.Tensor,
    rewards: torch.Tensor,
    valid_mask: torch.Tensor,
    leave_one_out_baseline: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample reward baseline and std over the samples of the same prompt.

    Each sample ``i`` gets a *reference set*: the valid samples of its prompt group, minus ``i`` itself
    when ``leave_one_out_baseline`` is set and ``i`` is valid. Then

    * ``baseline[i]`` = mean reward of the reference set, or ``rewards[i]`` when the set is empty
      (a group with a single valid sample under leave-one-out), so that its advantage is 0;
    * ``std[i]`` = Bessel-corrected (``n - 1``) std of the reference set, 0 when it has fewer than 2
      samples (single valid sample; leave-one-out with 2 valid samples) and **exactly** 0 when all its
      rewards are equal (checked on the values, not on a rounded variance, so that a later division by
      ``std + eps`` cannot blow up on a ``1e-17`` rounding residue).

    Without leave-one-out this is the group mean and Bessel std of the valid samples (a group with one
    valid sample gets baseline = its reward and std 0). Invalid samples (``valid_mask == 0``) never enter
    any reference set; their own reference set is all valid samples of their group (nothing to leave
    out), or empty (baseline = own reward, std 0) if the group has none. Callers must still mask them.

    Args:
        prompt_ids: ``[B]`` integer prompt/group ids, or ``[B, L]`` prompt token rows (identical rows are
            the same prompt).
        rewards: ``[B]`` rewards.
        valid_mask: ``[B]`` 0/1 (bool or number).
        leave_one_out_baseline: exclude each valid sample from its own baseline and std.

    Returns:
        ``(baseline, std)``, both ``[B]`` with the dtype of ``rewards`` (float32 if it is an integer type).

    Raises:
        ValueError: on shape mismatch, or when a reward is NaN/inf (names the sample indices and groups;
            checked for invalid samples too, since ``NaN * 0`` is still NaN downstream).
    """
    _check_baseline_shapes(prompt_ids, rewards, valid_mask)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    if rewards.numel() == 0:
        empty = torch.zeros(0, dtype=out_dtype, device=rewards.device)
        return empty, empty.clone()

    group = _prompt_group_index(prompt_ids)
    _raise_on_non_finite_rewards(rewards, prompt_ids, group)
    num_groups = int(group.max()) + 1
    # float64 throughout: the leave-one-out terms subtract one sample from group sums.
    r = rewards.to(torch.float64)
    valid = valid_mask.to(torch.bool)
    v = valid.to(torch.float64)

    def group_sum(x: torch.Tensor) -> torch.Tensor:
        return _group_reduce(x, group, num_groups, "sum", 0.0)

    def group_reduce(x: torch.Tensor, op: str, fill: float) -> torch.Tensor:
        return _group_reduce(x, group, num_groups, op, fill)

    # Shift by the group's smallest valid reward: the sums below then cancel less, and a group of equal
    # rewards sums exact zeros.
    g_min = group_reduce(torch.where(valid, r, torch.inf), "amin", torch.inf)
    g_max = group_reduce(torch.where(valid, r, -torch.inf), "amax", -torch.inf)
    g_min_s = torch.where(torch.isfinite(g_min), g_min, 0.0)[group]
    d = (r - g_min_s) * v
    count, sum_d, sum_d2 = group_sum(v)[group], group_sum(d)[group], group_sum(d * d)[group]

    leave_out = v if leave_one_out_baseline else torch.zeros_like(v)
    k = count - leave_out
    ref_sum = sum_d - leave_out * d
    ref_sum2 = sum_d2 - leave_out * d * d
    k_safe = k.clamp(min=1.0)
    baseline = torch.where(k > 0, g_min_s + ref_sum / k_safe, r)
    var = ((ref_sum2 - ref_sum * ref_sum / k_safe) / (k - 1.0).clamp(min=1.0)).clamp(min=0.0)
    std = torch.where(k >= 2, var.sqrt(), torch.zeros_like(var))

    # Exact "all rewards in the reference set are equal" test, on values: either the whole valid group
    # is constant, or (leave-one-out) the left-out sample is the group's only min or only max.
    ref_constant, common_value = _constant_reference_sets(r, valid, group, g_min, g_max, leave_out.bool())
    baseline = torch.where(ref_constant & (k > 0), common_value, baseline)
    std = torch.where(ref_constant, torch.zeros_like(std), std)
    return baseline.to(out_dtype), std.to(out_dtype)


def _constant_reference_sets(
    r: torch.Tensor,
    valid: torch.Tensor,
    group: torch.Tensor,
    g_min: torch.Tensor,
    g_max: torch.Tensor,
    left_out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which reference sets hold a single distinct reward value, and that value (see the caller)."""
    num_groups = g_min.numel()
    lo, hi = g_min[group], g_max[group]
    count_lo = torch.zeros(num_groups, dtype=torch.long, device=r.device).index_add_(0, group, (valid & (r == lo)).long())[group]
    count_hi = torch.zeros(num_groups, dtype=torch.long, device=r.device).index_add_(0, group, (valid & (r == hi)).long())[group]
    group_constant = lo == hi
    count_valid = torch.zeros(num_groups, dtype=torch.long, device=r.device).index_add_(0, group, valid.long())[group]
    # Two distinct values overall and the left-out sample is the only one of its value.
    two_values = (count_lo + count_hi) == count_valid
    only_lo = left_out & (r == lo) & (count_lo == 1)
    only_hi = left_out & (r == hi) & (count_hi == 1)
    leave_out_constant = ~group_constant & two_values & (only_lo | only_hi)
    common = torch.where(only_lo & leave_out_constant, hi, lo)
    return group_constant | leave_out_constant, common


def normalize_advantages_with_epsilon(advantages: torch.Tensor, std: torch.Tensor, epsilon: float = 1e-6) -> torch.Tensor:
    """Divide advantages by ``std + epsilon`` where ``std > 0``; leave them unchanged where ``std == 0``.

    With a leave-one-out baseline a sample can have a non-zero advantage and a zero std (reward 1 among
    peers that all got 0): dividing by ``0 + epsilon`` would multiply its advantage by ``1 / epsilon``
    (a million). Such samples keep their raw advantage.

    Args:
        advantages: ``[B]`` or ``[B, ...]`` (e.g. ``[B, S]`` per token).
        std: ``[B]`` per-sample std, broadcast over the trailing dims of ``advantages``.
        epsilon: added to positive stds, for stability with tiny stds.

    Returns:
        A new tensor shaped like ``advantages``.
    """
    std = std.to(advantages.dtype).reshape(std.shape + (1,) * (advantages.dim() - std.dim()))
    return torch.where(std > 0, advantages / (std + epsilon), advantages)
