"""Training batches for the policy worker's unit tests: right-padded random rows with a 4-token prompt."""

from __future__ import annotations

import torch


def random_step_batch(seed: int, rows: int, seq: int, vocab: int) -> dict[str, torch.Tensor]:
    """One optimizer step's rows of very different lengths (right-padded, a 4-token prompt), global counts attached."""
    return with_global_counts(random_rows(seed, rows, seq, vocab))


def random_rows(seed: int, rows: int, seq: int, vocab: int) -> dict[str, torch.Tensor]:
    """Right-padded random rows of lengths 6..seq with a 4-token prompt and a response after it (no global counts)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (rows, seq), generator=g)
    lengths = torch.randint(6, seq + 1, (rows,), generator=g)
    return padded_rows(input_ids, lengths, 4, g)


def padded_rows(input_ids: torch.Tensor, lengths: torch.Tensor, prompt_len: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """``input_ids`` ([rows, seq]) cut to ``lengths`` (right padding, id 0), the tokens after ``prompt_len`` trained,
    random generation logprobs and per-row advantages drawn from ``g``."""
    rows, seq = input_ids.shape
    cols = torch.arange(seq)
    attention = (cols[None, :] < lengths[:, None]).long()
    token_mask = ((cols[None, :] >= prompt_len) & (attention == 1)).float()
    return {
        "input_ids": input_ids * attention,
        "attention_mask": attention,
        "token_mask": token_mask,
        "sample_mask": torch.ones(rows),
        "generation_logprobs": -torch.rand(rows, seq, generator=g) * token_mask,
        "advantages": torch.randn(rows, 1, generator=g).expand(rows, seq) * token_mask,
    }


def with_global_counts(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``batch`` with the whole step's valid token and sequence counts (one rank: its own)."""
    batch = dict(batch)
    batch["global_valid_toks"] = (batch["token_mask"] * batch["sample_mask"][:, None]).sum()
    batch["global_valid_seqs"] = batch["sample_mask"].sum()
    return batch
