"""Micro-batches of a rank's shard: fixed sample counts, token budgets, or packed rows.

Whatever the grouping, the loss is computed on the original per-sample ``[n, S]`` rows (packed
logprobs are unpacked first), and it is normalised by the global token / sequence counts that come
with the batch, so the sum over micro-batches is the same global-batch loss for every grouping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from nemo_like.models.layer_kinds import layer_kinds, sliding_window, stateful_kinds, text_config, unknown_kinds

Batch = dict[str, torch.Tensor]
Mode = Literal["fixed", "token_budget", "packed"]


def sample_lengths(batch: Batch) -> list[int]:
    """Real (unpadded) tokens of each row."""
    return [int(n) for n in batch["attention_mask"].sum(-1).tolist()]


def fixed_groups(num_samples: int, size: int) -> list[list[int]]:
    """``[0..size), [size..2 size), ...``: the classic micro-batches of ``size`` samples."""
    return [list(range(s, min(s + size, num_samples))) for s in range(0, num_samples, size)]


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of sample indices whose lengths sum to at most ``capacity`` (first-fit decreasing).

    A sample longer than ``capacity`` gets a bin of its own. Bins are returned in creation order,
    each listing its samples longest first.
    """
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def token_budget_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Padded micro-batches of at most ``budget`` tokens (rows x longest row), samples sorted by length
    so that each group pads little. A sample longer than ``budget`` is a group of its own."""
    groups: list[list[int]] = []
    current: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        # Longest first: a group's width is the length of its first sample.
        if current and (len(current) + 1) * lengths[current[0]] > budget:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


@dataclass(frozen=True)
class MicroBatchPlan:
    """How a worker groups samples: ``mode`` and its size (samples for ``fixed``, tokens otherwise)."""

    mode: Mode = "fixed"
    train_size: int = 1
    logprob_size: int = 64

    def groups(self, batch: Batch, training: bool) -> list[list[int]]:
        """Sample indices of each micro-batch of ``batch``."""
        n = batch["input_ids"].shape[0]
        size = self.train_size if training else self.logprob_size
        if self.mode == "fixed":
            return fixed_groups(n, size)
        lengths = sample_lengths(batch)
        if self.mode == "packed":
            return first_fit_decreasing(lengths, size)
        return token_budget_groups(lengths, size)


def take_rows(batch: Batch, indices: list[int]) -> Batch:
    """Rows ``indices`` of every per-sample tensor, trailing all-padding columns dropped (scalars kept): the columns up
    to the last that holds a real token in any row (a left-padded row's last tokens are past its count of tokens)."""
    idx = torch.tensor(indices, dtype=torch.long)
    rows = {k: (v.index_select(0, idx) if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in batch.items()}
    real = rows["attention_mask"].bool().any(0) if indices else torch.zeros(1, dtype=torch.bool)
    width = int(real.nonzero().max()) + 1 if bool(real.any()) else 1
    return {k: (v[:, :width] if torch.is_tensor(v) and v.dim() == 2 else v) for k, v in rows.items()}


@dataclass
class PackedRow:
    """Several samples in one row: ``input_ids``/``position_ids`` are ``[1, T]``, ``attention_mask`` is
    a ``[1, 1, T, T]`` additive mask (0 where a token may attend, dtype-min elsewhere) that is causal
    inside each sample and blocks every pair of tokens from different samples."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    rows: torch.Tensor  # [T] which sample (row of the micro-batch) each packed token came from
    cols: torch.Tensor  # [T] its column in that row


def block_causal_mask(segment: torch.Tensor, dtype: torch.dtype, block_diagonal: bool = True) -> torch.Tensor:
    """``[1, 1, T, T]`` additive mask: token i sees token j iff j <= i and (with ``block_diagonal``) both
    belong to the same segment."""
    t = segment.shape[0]
    allowed = torch.ones(t, t, dtype=torch.bool, device=segment.device).tril()  # on the segments' device (a GPU's)
    if block_diagonal:
        allowed &= segment[:, None] == segment[None, :]
    mask = torch.zeros(t, t, dtype=dtype, device=segment.device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def pack_rows(batch: Batch, dtype: torch.dtype = torch.float32, block_diagonal: bool = True) -> PackedRow:
    """Concatenate the real tokens of every row of ``batch`` into one packed row.

    Each sample restarts its position ids at 0; ``block_diagonal=False`` exists only to show in a test
    that a plain causal mask leaks attention across samples.
    """
    mask = batch["attention_mask"].bool()
    rows, cols = mask.nonzero(as_tuple=True)  # row-major: each sample's tokens in order, samples in order
    positions = mask.long().cumsum(-1)[rows, cols] - 1
    return PackedRow(
        input_ids=batch["input_ids"][rows, cols][None],
        position_ids=positions[None],
        attention_mask=block_causal_mask(rows, dtype, block_diagonal),
        rows=rows,
        cols=cols,
    )


def packing_problem(config: Any, longest: int) -> str | None:
    """Why a packed row cannot score ``config``'s model exactly with samples of up to ``longest`` tokens (``None``: it
    can): layers that carry a state along the row (:func:`~nemo_like.models.layer_kinds.stateful_kinds`: from one
    sample into the next, every sample after a row's first scored wrong, silently), or Llama 4's chunked attention on
    samples longer than its chunk (the mask keeps a sample whole, the model attends within chunks)."""
    if stateful := stateful_kinds(config):
        return (
            f"this model's {stateful} layers carry a state along a packed row, from one sample into the next (a mask "
            "keeps only attention to a sample's tokens); use policy.dynamic_batching instead"
        )
    if unknown := unknown_kinds(config):
        return f"this model's {unknown} layers may attend in ways a packed row's mask does not express; use policy.dynamic_batching instead"
    chunk = getattr(text_config(config), "attention_chunk_size", None)
    if "chunked_attention" in layer_kinds(config) and chunk and longest > chunk:
        return (
            f"this model's chunked-attention layers attend within chunks of {chunk} tokens, which a packed row's mask "
            f"cannot express for samples of up to {longest} tokens; use policy.dynamic_batching instead"
        )
    return None


def packed_model_mask(packed: PackedRow, config: Any, device: torch.device | str | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
    """The packed row's mask as ``config``'s model takes it (on ``device``). transformers hands a ready 4D mask to every
    layer as it is, so a layer that attends within a sliding window (Gemma 2/3, gpt-oss, Mistral v0.1, Qwen2 with
    ``use_sliding_window``) saw each whole sample: a model whose ``layer_types`` list ``sliding_attention`` gets a mask
    per layer type, the sliding one also blocking keys ``sliding_window`` or more positions back (positions restart in
    each sample); one without ``layer_types`` but with a ``sliding_window`` (Mistral) applies it to every layer."""
    # the longest sample only where chunked attention needs it: reading it syncs a GPU at every micro-batch
    chunked = "chunked_attention" in layer_kinds(config) and packed.position_ids.numel()
    longest = int(packed.position_ids.max()) + 1 if chunked else 0
    if problem := packing_problem(config, longest):  # the driver refuses it first (check_policy_model, check_teachers)
        raise ValueError(f"policy.sequence_packing.enabled=true: {problem}")
    mask = packed.attention_mask.to(device) if device is not None else packed.attention_mask
    window = sliding_window(config)
    if window is None:
        return mask
    positions = packed.position_ids[0].to(mask.device)
    far = positions[:, None] >= positions[None, :] + window  # bool from the start: an int64 [T, T] difference was 8 bytes an entry
    windowed = mask.masked_fill(far, torch.finfo(mask.dtype).min)
    if getattr(text_config(config), "layer_types", None) is None:
        return windowed
    return {"full_attention": mask, "sliding_attention": windowed}


def unpack_logprobs(packed_lp: torch.Tensor, packed: PackedRow, shape: torch.Size) -> torch.Tensor:
    """Scatter ``[1, T]`` packed token logprobs back into the ``[n, S]`` layout of the rows they came from.

    A sample's first token is scored from the previous sample's last token in the packed row; that
    value is meaningless and set to 0, as column 0 is in the unpacked layout. Differentiable.
    """
    values = packed_lp[0] * (packed.position_ids[0] > 0)
    out = packed_lp.new_zeros(shape)
    return out.index_put((packed.rows, packed.cols), values)
