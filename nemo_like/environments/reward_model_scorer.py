"""A Hugging Face sequence-classification reward model scoring token sequences in batches under a token budget.

Batches: the sequences sorted by length (longest first, ties by position), packed greedily so that each batch's
padded size (rows x longest row) stays within ``max_tokens_per_batch`` (a longer sequence goes alone). Rows are
right-padded: a real token attends only to the real tokens before it and keeps its own position, so each score is
the score of an unpadded forward of that sequence alone (up to float rounding, below 1e-5 in fp32), whatever the
batch, its split and its order. The score is the model's pooled logit ``label_index``; the model pools its last
non-pad token, as ``AutoModelForSequenceClassification`` does for a single sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def token_budget_batches(lengths: Sequence[int], max_tokens_per_batch: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into batches whose padded size (rows x longest) is at most the budget
    (a sequence longer than the budget forms a batch of its own); longest first, deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for index in order:
        if batches:
            batch = batches[-1]
            longest = lengths[batch[0]]  # sorted: the batch's first row is its longest
            if (len(batch) + 1) * longest <= max_tokens_per_batch:
                batch.append(index)
                continue
        batches.append([index])
    return batches


class RewardModelScorer:
    """A loaded reward model (``AutoModelForSequenceClassification``) and its tokenizer; :meth:`score` maps token
    sequences to raw scores. ``path``: a resolved local directory or hub id."""

    def __init__(self, path: str, precision: str = "float32", label_index: int = 0, device: str | None = None) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=DTYPES[precision]).to(self.device).eval()
        num_labels = self.model.config.num_labels
        if not 0 <= label_index < num_labels:
            raise ValueError(f"label_index={label_index} but the reward model {path} has {num_labels} label(s)")
        self.label_index = label_index
        pad = self.model.config.pad_token_id
        if pad is None:
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
            if pad is None:
                raise ValueError(f"the reward model {path} has no pad token (config.pad_token_id, tokenizer pad/eos): cannot batch")
            self.model.config.pad_token_id = pad
        self.pad_token_id = int(pad)
        self.max_length = int(getattr(self.model.config, "max_position_embeddings", 0) or 0) or None
        self.batches_run = 0  # forward passes of the latest score() call

    def encode(self, prompt: str, response: str, use_chat_template: bool) -> list[int]:
        """Token ids of one (prompt, response) pair: the chat template over a user and an assistant turn (no
        generation prompt), or the plain concatenation with the tokenizer's special tokens."""
        tok = self.tokenizer
        if use_chat_template:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            text = tok.apply_chat_template(messages, tokenize=False)
            return list(tok(text, add_special_tokens=False)["input_ids"])
        return list(tok(prompt + response)["input_ids"])

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]], max_tokens_per_batch: int) -> list[float]:
        """Raw score of each sequence (non-empty token id lists), batched under the token budget."""
        scores = [0.0] * len(sequences)
        batches = token_budget_batches([len(s) for s in sequences], max_tokens_per_batch)
        self.batches_run = len(batches)
        for batch in batches:
            longest = len(sequences[batch[0]])
            ids = torch.full((len(batch), longest), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(batch), longest), dtype=torch.long)
            for row, index in enumerate(batch):
                seq = sequences[index]
                ids[row, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
                mask[row, : len(seq)] = 1
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            values = logits[:, self.label_index].float().cpu().tolist()
            for index, value in zip(batch, values):
                scores[index] = float(value)
        return scores
