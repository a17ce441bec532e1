"""Loading models and tokenizers from a hub id, a local directory or the shipped tiny model."""

from __future__ import annotations

import torch

from nemo_like.config.schema import EMBEDDED_MODEL

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_model_path(model_name: str) -> str:
    """Map the embedded-model sentinel to the shipped directory; anything else is passed through."""
    if model_name == EMBEDDED_MODEL:
        from nemo_like.data.assets import default_model_path

        return default_model_path()
    return model_name


def load_causal_lm(model_name: str, precision: str = "float32"):
    """Load a causal LM for training or inference (eager attention: exact and fine on CPU)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per actor per load is noise in the driver's log
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(model_name), dtype=DTYPES[precision])
    model.config.use_cache = False
    return model


def load_tokenizer(name: str):
    """Load a tokenizer; prompts are left-padded for generation."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path(name))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copy of every parameter and buffer, tied weights included under each name.

    ``state_dict()`` keeps tied weights (``lm_head.weight``) under both names; ``save_pretrained``
    drops them, which leaves inference engines with a stale output head.
    """
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
