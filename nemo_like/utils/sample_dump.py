"""Per-step sample dumps: one JSON object per sample in ``<log_dir>/{train,val}_data_step{N}.jsonl``.

Pure helpers: they take tensors and lists and write JSONL; the loop decides what to pass.
Per-token columns hold one value per **response** token (``response_mask`` selects them out of the
``[B, S]`` batch layout, where entry ``t`` is the value for token ``t``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from nemo_like.utils.files import replace_file
from nemo_like.utils.log_backends import jsonable


def dump_path(log_dir: str | Path, kind: str, step: int) -> Path:
    """``<log_dir>/<kind>_data_step<step>.jsonl`` (``kind`` is ``train`` or ``val``)."""
    return Path(log_dir) / f"{kind}_data_step{step}.jsonl"


def response_token_values(values: torch.Tensor, response_mask: torch.Tensor) -> list[list[float]]:
    """Rows of ``values`` ``[B, S]`` restricted to the positions where ``response_mask`` is non-zero."""
    keep = response_mask.bool()
    return [values[i][keep[i]].tolist() for i in range(values.shape[0])]


def per_sample_mean(values: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """Mean of each row of ``values`` over its masked positions (0.0 for a row with none)."""
    mask = mask.float()
    return ((values * mask).sum(-1) / mask.sum(-1).clamp(min=1)).tolist()


def sample_records(step: int, columns: Mapping[str, Sequence[Any] | torch.Tensor]) -> list[dict[str, Any]]:
    """One dict per sample: ``{"step", "index", <column>: column[i], ...}``; all columns have length B."""
    sizes = {name: len(col) for name, col in columns.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"sample dump columns differ in length: {sizes}")
    count = next(iter(sizes.values()), 0)
    return [{"step": step, "index": i, **{name: jsonable(col[i]) for name, col in columns.items()}} for i in range(count)]


def write_sample_dump(path: str | Path, step: int, columns: Mapping[str, Sequence[Any] | torch.Tensor]) -> Path:
    """Write :func:`sample_records` of ``columns`` to ``path`` (replacing it); returns the path."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return replace_file(path, "".join(json.dumps(record) + "\n" for record in sample_records(step, columns)))


def format_samples(prompts: Sequence[str], responses: Sequence[str], rewards: Sequence[float], limit: int) -> str:
    """A console block with the first ``limit`` samples: prompt, response and reward of each."""
    blocks = []
    for i, (prompt, response, reward) in enumerate(zip(prompts[:limit], responses[:limit], rewards[:limit])):
        blocks.append(f"--- sample {i} (reward {float(reward):.3f})\n[prompt] {prompt}\n[response] {response}")
    return "\n".join(blocks)
