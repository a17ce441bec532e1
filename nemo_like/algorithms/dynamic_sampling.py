"""DAPO helpers: dynamic sampling (keep only prompt groups with a learning signal) and overlong shaping.

A prompt group whose rewards are all equal has all-zero GRPO advantages and contributes nothing but
noise and compute; dynamic sampling drops such groups and keeps generating until enough groups with
signal are collected. See ``docs/guides/advantages.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nemo_like.algorithms.utils import _prompt_group_index, calculate_baseline_and_std_per_prompt

Payload = Mapping[str, Any]
"""Per-sample batch: every value is a ``torch.Tensor`` with first dim ``B`` or a ``list``/``tuple`` of length ``B``."""

MAX_GEN_BATCHES_KEY = "grpo.dynamic_sampling_max_gen_batches"


class DynamicSamplingExhausted(RuntimeError):
    """Too few prompt groups with a learning signal within ``grpo.dynamic_sampling_max_gen_batches``.

    A run error with a clear cause: the CLI prints its message (key and fixes) without a traceback."""


def select_groups_with_signal(rewards: torch.Tensor, prompt_ids: torch.Tensor, valid_mask: torch.Tensor) -> torch.Tensor:
    """Bool ``[B]``: True for every sample (valid or not) of a prompt group whose valid rewards differ.

    A group with fewer than 2 valid samples, or with equal rewards, has zero std and is not selected.
    """
    _, std = calculate_baseline_and_std_per_prompt(prompt_ids, rewards, valid_mask, leave_one_out_baseline=False)
    return std > 0


class DynamicSamplingAccumulator:
    """Collects whole prompt groups with signal across generation batches until ``num_prompts_needed``.

    Payload: ``add`` takes a dict of per-sample values (tensors sliced on dim 0, lists/tuples indexed),
    e.g. the whole rollout batch, or just ``{"index": torch.arange(B)}`` to select rows yourself.
    ``take`` returns a dict with the same keys holding exactly ``num_prompts_needed`` groups: groups in
    FIFO order (generation batch, then first appearance in the batch), each group's rows contiguous and
    in their original order. Tensors are concatenated on dim 0; tensors whose dim 1 differs between
    batches (sequence lengths) are right-padded with ``pad_values[key]`` when given, else it is an error.
    Lists become lists. Surplus groups of the last batch are dropped.

    Usage::

        acc = DynamicSamplingAccumulator(num_prompts_per_step, max_gen_batches)
        while not acc.is_full:
            batch = generate_and_score()                     # raises RuntimeError past the max
            keep = select_groups_with_signal(batch["rewards"], batch["prompt_ids"], batch["valid"])
            acc.add(batch, keep)                             # groups from batch["prompt_ids"]
        train_batch, ds_metrics = acc.take()
    """

    def __init__(
        self,
        num_prompts_needed: int,
        max_gen_batches: int | None = None,
        pad_values: Mapping[str, int | float] | None = None,
    ) -> None:
        """
        Args:
            num_prompts_needed: groups to collect (``num_prompts_per_step``).
            max_gen_batches: ``grpo.dynamic_sampling_max_gen_batches``; ``None`` means unlimited.
            pad_values: per-key right-padding value for tensors whose dim 1 differs between batches.
        """
        if num_prompts_needed < 1:
            raise ValueError(f"num_prompts_needed must be >= 1, got {num_prompts_needed}")
        if max_gen_batches is not None and max_gen_batches < 1:
            raise ValueError(f"{MAX_GEN_BATCHES_KEY} must be >= 1 (or null), got {max_gen_batches}")
        self.num_prompts_needed = num_prompts_needed
        self.max_gen_batches = max_gen_batches
        self.pad_values = dict(pad_values or {})
        self._reset()

    def _reset(self) -> None:
        self._chunks: list[tuple[dict[str, Any], list[int]]] = []  # (kept rows, kept group sizes)
        self.num_gen_batches = 0
        self.num_discarded_groups = 0
        self.num_kept_groups = 0

    @property
    def is_full(self) -> bool:
        """Whether ``num_prompts_needed`` groups have been collected."""
        return self.num_kept_groups >= self.num_prompts_needed

    def metrics(self) -> dict[str, float]:
        """Counters of the current round (since construction or the last ``take``)."""
        return {
            "dynamic_sampling/num_gen_batches": float(self.num_gen_batches),
            "dynamic_sampling/num_discarded_groups": float(self.num_discarded_groups),
            "dynamic_sampling/num_kept_groups": float(self.num_kept_groups),
        }

    def add(self, payload: Payload, keep_mask: torch.Tensor, prompt_ids: torch.Tensor | None = None) -> None:
        """Add one generation batch, keeping the groups where ``keep_mask`` is True.

        Args:
            payload: per-sample dict (see the class docstring); every value has length ``B``.
            keep_mask: bool ``[B]``, constant within each group (e.g. ``select_groups_with_signal``).
            prompt_ids: ``[B]`` group ids or ``[B, L]`` prompt rows defining the groups; defaults to
                ``payload["prompt_ids"]``.

        Raises:
            ValueError: lengths differ from ``B`` or ``keep_mask`` splits a group.
            DynamicSamplingExhausted: this batch reached ``max_gen_batches`` and the batch is still not full.
        """
        if prompt_ids is None:
            if "prompt_ids" not in payload:
                raise ValueError("Pass prompt_ids, or include a 'prompt_ids' key in the payload")
            prompt_ids = payload["prompt_ids"]
        keep = keep_mask.to(torch.bool)
        num_samples = keep.numel()
        _check_lengths(payload, num_samples, prompt_ids)
        group = _prompt_group_index(prompt_ids) if num_samples else torch.zeros(0, dtype=torch.long)
        perm, kept_sizes, num_groups = _kept_rows_in_group_order(group, keep)

        self.num_gen_batches += 1
        self.num_kept_groups += len(kept_sizes)
        self.num_discarded_groups += num_groups - len(kept_sizes)
        if kept_sizes:
            self._chunks.append(({k: _index_rows(v, perm) for k, v in payload.items()}, kept_sizes))
        if not self.is_full and self.max_gen_batches is not None and self.num_gen_batches >= self.max_gen_batches:
            raise DynamicSamplingExhausted(
                f"Dynamic sampling collected only {self.num_kept_groups}/{self.num_prompts_needed} prompt groups "
                f"with non-zero reward std after {self.num_gen_batches} generation batch(es) "
                f"({MAX_GEN_BATCHES_KEY}={self.max_gen_batches}); {self.num_discarded_groups} groups were "
                "discarded because all their raw rewards were equal (every response right, or every one wrong). "
                f"Raise {MAX_GEN_BATCHES_KEY}, make the data easier or harder for this model (or check that the "
                "reward function can tell responses apart), or disable dynamic sampling (grpo.use_dynamic_sampling=false)."
            )

    def take(self) -> tuple[dict[str, Any], dict[str, float]]:
        """Return ``(batch, metrics)`` with exactly ``num_prompts_needed`` groups, and start a new round.

        ``metrics`` holds the round's counters plus ``dynamic_sampling/num_surplus_groups`` (kept groups
        dropped because the batch was already full).

        Raises:
            RuntimeError: called before ``is_full``.
        """
        if not self.is_full:
            raise RuntimeError(f"take() called with {self.num_kept_groups}/{self.num_prompts_needed} prompt groups collected")
        parts: list[dict[str, Any]] = []
        groups_left = self.num_prompts_needed
        for rows, sizes in self._chunks:
            if groups_left == 0:
                break
            n_groups = min(groups_left, len(sizes))
            n_rows = sum(sizes[:n_groups])
            parts.append({k: v[:n_rows] for k, v in rows.items()})
            groups_left -= n_groups
        metrics = self.metrics()
        metrics["dynamic_sampling/num_surplus_groups"] = float(self.num_kept_groups - self.num_prompts_needed)
        batch = {key: self._concat(key, [p[key] for p in parts]) for key in parts[0]}
        self._reset()
        return batch, metrics

    def _concat(self, key: str, values: list[Any]) -> Any:
        if not isinstance(values[0], torch.Tensor):
            return [item for v in values for item in v]
        if values[0].dim() >= 2 and len({v.shape[1] for v in values}) > 1:
            if key not in self.pad_values:
                raise ValueError(
                    f"Payload key {key!r} has dim-1 sizes {[v.shape[1] for v in values]} across generation "
                    "batches; pass pad_values={key: pad} to DynamicSamplingAccumulator to right-pad them."
                )
            width = max(v.shape[1] for v in values)
            values = [_right_pad(v, width, self.pad_values[key]) for v in values]
        return torch.cat(values, dim=0)


def _check_lengths(payload: Payload, num_samples: int, prompt_ids: torch.Tensor) -> None:
    if prompt_ids.shape[0] != num_samples:
        raise ValueError(f"prompt_ids has {prompt_ids.shape[0]} rows, keep_mask has {num_samples}")
    for key, value in payload.items():
        if not isinstance(value, (torch.Tensor, list, tuple)):
            raise ValueError(f"Payload key {key!r}: expected a tensor, list or tuple, got {type(value).__name__}")
        if len(value) != num_samples:
            raise ValueError(f"Payload key {key!r} has {len(value)} rows, keep_mask has {num_samples}")


def _kept_rows_in_group_order(group: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, list[int], int]:
    """Row order of the kept groups (by first appearance, rows in order), their sizes, and the group count."""
    num_samples = group.numel()
    if num_samples == 0:
        return torch.zeros(0, dtype=torch.long), [], 0
    num_groups = int(group.max()) + 1
    rows = torch.arange(num_samples)
    first_row = torch.full((num_groups,), num_samples, dtype=torch.long).scatter_reduce_(0, group, rows, "amin")
    keep_count = torch.zeros(num_groups, dtype=torch.long).index_add_(0, group, keep.long())
    size = torch.bincount(group, minlength=num_groups)
    split = (keep_count > 0) & (keep_count < size)
    if bool(split.any()):
        raise ValueError("keep_mask must keep or drop whole prompt groups; it splits some groups")
    order = torch.argsort(first_row)  # groups by first appearance
    rank = torch.empty(num_groups, dtype=torch.long)
    rank[order] = torch.arange(num_groups)
    perm = torch.argsort(rank[group] * num_samples + rows)
    perm = perm[keep[perm]]
    kept_group_sizes = size[order][keep_count[order] > 0]
    return perm, kept_group_sizes.tolist(), num_groups


def _index_rows(value: Any, perm: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor):
        return value[perm.to(value.device)]
    return [value[i] for i in perm.tolist()]


def _right_pad(t: torch.Tensor, width: int, pad_value: int | float) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    pad = torch.full((t.shape[0], width - t.shape[1], *t.shape[2:]), pad_value, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=1)


def apply_overlong_reward_shaping(
    rewards: torch.Tensor,
    response_lengths: torch.Tensor,
    max_response_length: int,
    overlong_buffer_length: int,
    overlong_buffer_penalty: float,
) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the rewards.

    With ``L_max = max_response_length``, ``L_buf = overlong_buffer_length``, ``p = overlong_buffer_penalty``
    and response length ``|y|``::

        penalty(|y|) = clamp(-(|y| - (L_max - L_buf)) / L_buf * p, min=-p, max=0)

    i.e. 0 up to ``L_max - L_buf`` tokens, then linear down to ``-p`` at ``L_max`` (lengths past
    ``L_max`` stay at ``-p``; DAPO leaves them unclamped, but generation cannot exceed ``L_max``).

    Returns:
        ``rewards + penalty``, float, shaped like ``rewards``.
    """
    if not 0 < overlong_buffer_length <= max_response_length:
        raise ValueError(
            f"grpo.reward_shaping.overlong_buffer_length must be in (0, max_response_length={max_response_length}], "
            f"got {overlong_buffer_length}"
        )
    if overlong_buffer_penalty < 0:
        raise ValueError(f"grpo.reward_shaping.overlong_buffer_penalty must be >= 0, got {overlong_buffer_penalty}")
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    excess = response_lengths.to(dtype) - (max_response_length - overlong_buffer_length)
    penalty = (-excess / overlong_buffer_length * overlong_buffer_penalty).clamp(min=-overlong_buffer_penalty, max=0.0)
    return rewards.to(dtype) + penalty
