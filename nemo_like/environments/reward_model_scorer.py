"""A Hugging Face sequence-classification reward model scoring token sequences in batches under a token budget.

Batches: the sequences sorted by length (longest first, ties by position), packed greedily so that each batch's
padded size (rows x longest row) stays within ``max_tokens_per_batch`` (a longer sequence goes alone). Rows are
right-padded: a real token attends only to the real tokens before it and keeps its own position, so each score is
the score of an unpadded forward of that sequence alone (up to float rounding, below 1e-5 in fp32), whatever the
batch, its split and its order. The score is the model's pooled logit ``label_index``: a decoder model pools its last
non-pad token, as ``AutoModelForSequenceClassification`` does for a single sequence; an encoder pools its first token.

A model whose config names no pad token pools the last token of a single sequence. Batched, it must be told which
positions are padding, so each call pads with an id that none of its sequences contains: a sequence that ends with the
tokenizer's pad or eos (a template whose turns end with eos, on a tokenizer whose pad is eos) is still pooled at its
own last token, not the one before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nemo_like.environments.scored_text import chat_ids_of_untrusted_text

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


#: Hugging Face's ``model_max_length`` when a tokenizer does not state one (``VERY_LARGE_INTEGER``, 1e30).
UNSET_TOKENIZER_LIMIT = 10**18


def model_max_length(config: object, tokenizer: object) -> int | None:
    """The longest input the model takes: ``max_position_embeddings``, capped by the tokenizer's ``model_max_length``
    where it states one (RoBERTa has 514 positions for 512 tokens: its positions start after the padding index)."""
    limits = [int(getattr(config, "max_position_embeddings", 0) or 0)]
    stated = getattr(tokenizer, "model_max_length", None)
    if isinstance(stated, int) and 0 < stated < UNSET_TOKENIZER_LIMIT:
        limits.append(stated)
    return min((n for n in limits if n > 0), default=None)


@dataclass
class EncodedPair:
    """The model's input of one (prompt, response): token ids, and the token type ids of a text pair (0 on the prompt's
    segment, 1 on the response's) where the tokenizer gives them (None: the model reads none)."""

    ids: list[int]
    token_type_ids: list[int] | None = None


class RewardModelScorer:
    """A loaded reward model (``AutoModelForSequenceClassification``) and its tokenizer; :meth:`score` maps token
    sequences to raw scores. ``path``: a resolved local directory or hub id."""

    def __init__(self, path: str, precision: str = "float32", label_index: int = 0, device: str | None = None) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        model, loading = AutoModelForSequenceClassification.from_pretrained(path, dtype=DTYPES[precision], output_loading_info=True)
        if loading["missing_keys"]:  # transformers drew them at random and only printed a report to the actor's log
            raise ValueError(
                f"the reward model {path} is not a trained sequence-classification model: its checkpoint has no "
                f"{', '.join(sorted(loading['missing_keys']))} (a causal LM or a base model?), so its scores would come from "
                "weights drawn at random; model_name must name a reward model (a *ForSequenceClassification checkpoint)"
            )
        self.model = model.to(self.device).eval()
        num_labels = self.model.config.num_labels
        if not 0 <= label_index < num_labels:
            raise ValueError(f"label_index={label_index} but the reward model {path} has {num_labels} label(s)")
        self.label_index = label_index
        self.pads_by_config = self.model.config.pad_token_id is not None  # else: a pad id no sequence of the call holds
        pad = self.model.config.pad_token_id
        if pad is None:
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
            if pad is None:
                raise ValueError(f"the reward model {path} has no pad token (config.pad_token_id, tokenizer pad/eos): cannot batch")
        self.pad_token_id = int(pad)  # fills an empty input
        self.vocab_rows = int(self.model.get_input_embeddings().num_embeddings)
        self.max_length = model_max_length(self.model.config, self.tokenizer)
        self.batches_run = 0  # forward passes of the latest score() call

    def encode(self, prompt: str, response: str, use_chat_template: bool) -> list[int]:
        """Token ids of one (prompt, response) pair: the chat template over a user and an assistant turn (no
        generation prompt), or (no template asked for, or the tokenizer has none) the plain concatenation with the
        tokenizer's special tokens."""
        tok = self.tokenizer
        if use_chat_template and tok.chat_template:  # the policy's text stays text (scored_text)
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            return chat_ids_of_untrusted_text(tok, messages, add_generation_prompt=False)
        return list(tok(prompt + response, split_special_tokens=True)["input_ids"])

    def encode_text_pair(self, prompt: str, response: str) -> EncodedPair:
        """The tokenizer's text pair, ``tokenizer(prompt, response)`` (BERT-like: ``[CLS] prompt [SEP] response [SEP]``,
        token type ids 0 then 1), as an encoder trained on pairs reads them (OpenAssistant's DeBERTa reward models).
        Special-token strings inside the texts stay text (``split_special_tokens``)."""
        encoded = self.tokenizer(prompt, response, split_special_tokens=True)
        types = encoded.get("token_type_ids") if "token_type_ids" in self.tokenizer.model_input_names else None
        return EncodedPair(list(encoded["input_ids"]), None if types is None else list(types))

    def batch_pad_id(self, sequences: Sequence[Sequence[int]]) -> int:
        """The id this call pads with: the config's pad, or (none configured) the highest id no sequence holds."""
        if self.pads_by_config:
            return self.pad_token_id
        used = set().union(*map(set, sequences))
        free = next((i for i in range(self.vocab_rows - 1, -1, -1) if i not in used), None)
        if free is None:
            raise ValueError("every token id occurs in this batch: no id is left to pad with (set the model's config.pad_token_id)")
        self.model.config.pad_token_id = free  # the classification head pools the last position not holding it
        return free

    @torch.no_grad()
    def score(
        self, sequences: Sequence[Sequence[int]], max_tokens_per_batch: int, token_type_ids: Sequence[Sequence[int]] | None = None
    ) -> list[float]:
        """Raw score of each sequence (non-empty token id lists), batched under the token budget; ``token_type_ids``:
        one list per sequence (text pairs), else the model's default (all 0)."""
        scores = [0.0] * len(sequences)
        batches = token_budget_batches([len(s) for s in sequences], max_tokens_per_batch)
        self.batches_run = len(batches)
        pad = self.batch_pad_id(sequences)
        for batch in batches:
            longest = len(sequences[batch[0]])
            ids = torch.full((len(batch), longest), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), longest), dtype=torch.long)
            types = None if token_type_ids is None else torch.zeros((len(batch), longest), dtype=torch.long)
            for row, index in enumerate(batch):
                seq = sequences[index]
                ids[row, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
                mask[row, : len(seq)] = 1
                if types is not None:
                    types[row, : len(seq)] = torch.tensor(list(token_type_ids[index]), dtype=torch.long)
            extra = {} if types is None else {"token_type_ids": types.to(self.device)}
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **extra).logits
            values = logits[:, self.label_index].float().cpu().tolist()
            for index, value in zip(batch, values):
                scores[index] = float(value)
        return scores
