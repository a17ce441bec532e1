"""Turn generated samples into the ``[B, S]`` training batch.

Layout per row: prompt tokens then response tokens, right-padded. ``token_mask`` is 1 on response
tokens the policy sampled (the stop token of every turn included) and 0 on the prompt, on multi-turn
observation tokens (``GeneratedSample.response_mask``), padding and position 0; per-token tensors
(``generation_logprobs``, ``advantages``, ...) hold at column t the value for token t.
"""

from __future__ import annotations

import torch

from nemo_like.models.generation.interface import GeneratedSample


def collate_samples(samples: list[GeneratedSample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Build ``input_ids``, ``attention_mask``, ``token_mask``, ``generation_logprobs``, ``sample_mask``."""
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    b = len(samples)
    input_ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((b, width), dtype=torch.long)
    token_mask = torch.zeros((b, width), dtype=torch.float32)
    generation_logprobs = torch.zeros((b, width), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, : p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        attention_mask[i, : p + r] = 1
        token_mask[i, p : p + r] = 1.0 if s.response_mask is None else torch.tensor(s.response_mask, dtype=torch.float32)
        generation_logprobs[i, p : p + r] = torch.tensor(s.response_logprobs)
    token_mask[:, 0] = 0.0
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "token_mask": token_mask,
        "generation_logprobs": generation_logprobs,
        "sample_mask": torch.ones(b, dtype=torch.float32),
    }
