"""Random-weight models and synthetic batches for the GPU checks: offline, from a config.

The model is a Qwen2 of the Qwen2.5-0.5B shape (hidden 896, 24 layers, 14 query / 2 key-value heads, MLP 4864, tied
output head) with the shipped tiny model's tokenizer, built the way ``benchmarks/vs_trl.py`` builds its models: the
stop token's logit is pushed down (every input embedding gets ``+2`` in dimension 0, the stop token's ``-2``), so
sampled completions do not end early: in the 0.5B shape (fp32, on a CPU) the stop token's logprob averages -19.4
where a uniform one would be -5.9, and the next-token entropy is 5.69 nats (uniform: 5.88). The checks still count the
tokens actually generated.

The vocabulary is the tokenizer's (359) wherever text is decoded or logprobs are compared; the throughput check uses
Qwen2.5's 151936 (the output head dominates a 0.5B model's decode step).

Imports at module level: standard library only (tier A must start without Ray or vLLM).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

EMBEDDED = "embedded:tiny-arith-qwen2"
QWEN25_VOCAB = 151936
SHAPES: dict[str, dict[str, int]] = {
    # Qwen2.5-0.5B (config.json of Qwen/Qwen2.5-0.5B-Instruct): 494M parameters with its vocabulary, ~358M with 359 tokens.
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2),
    # A small one for the checks that exercise code paths, not numerics or speed.
    "small": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
}
FIRST_ORDINARY_TOKEN = 3  # the tiny tokenizer: 0 pad, 1 bos-like, 2 eos; ordinary tokens from 3 on


def build_model(directory: str | Path, shape: str = "0.5B", vocab_size: int | None = None, save_dtype: str = "float32",
                seed: int = 0, device: str | None = None) -> str:  # fmt: skip
    """Write a random Qwen2 of ``shape`` with the tiny tokenizer into ``directory`` (HF format); returns its path.
    ``vocab_size``: default the tokenizer's; ``device``: where to initialise (``cuda`` is much faster than a CPU)."""
    import torch
    from transformers import AutoConfig, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    from nemo_like.models.loading import load_tokenizer, resolve_model_path

    hf_logging.disable_progress_bar()
    tiny = resolve_model_path(EMBEDDED)
    base = AutoConfig.from_pretrained(tiny)
    tok = load_tokenizer(tiny)
    config = Qwen2Config(
        vocab_size=vocab_size or base.vocab_size,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 1_000_000.0, "rope_type": "default"},
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
        **SHAPES[shape],
    )
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[:, 0] = 2.0
        emb[tok.eos_token_id, 0] = -2.0
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.to({"float32": torch.float32, "bfloat16": torch.bfloat16}[save_dtype]).save_pretrained(directory)
    tok.save_pretrained(directory)
    del model
    return str(directory)


def tokenizer_vocab() -> int:
    """The tiny tokenizer's vocabulary size (the default model vocabulary)."""
    from transformers import AutoConfig

    from nemo_like.models.loading import resolve_model_path

    return int(AutoConfig.from_pretrained(resolve_model_path(EMBEDDED)).vocab_size)


def grpo_batch(vocab: int, prompts: int = 4, group: int = 8, prompt_len: int = 256, response_len: int = 256,
               min_response: int | None = None, seed: int = 0, pad_id: int = 0) -> dict[str, Any]:  # fmt: skip
    """A right-padded GRPO-like batch on the CPU: ``prompts`` random prompts of ``prompt_len`` tokens, each with ``group``
    random responses of ``min_response..response_len`` tokens (all ``response_len`` when ``min_response`` is None).

    Keys: ``input_ids``, ``attention_mask``, ``token_mask`` (the responses), ``sample_mask``, ``advantages`` (one
    N(0, 1) value per row over its response), ``global_valid_toks``, ``global_valid_seqs``. ``generation_logprobs``
    is left to the caller (the policy's own logprobs make the ratio 1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = prompts * group
    lengths = [response_len] * rows
    if min_response is not None:
        lengths = torch.randint(min_response, response_len + 1, (rows,), generator=g).tolist()
    width = prompt_len + max(lengths)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention = torch.zeros(rows, width, dtype=torch.long)
    token_mask = torch.zeros(rows, width)
    for p in range(prompts):
        prompt = torch.randint(FIRST_ORDINARY_TOKEN, vocab, (prompt_len,), generator=g)
        for k in range(group):
            i, n = p * group + k, lengths[p * group + k]
            ids[i, :prompt_len] = prompt
            ids[i, prompt_len : prompt_len + n] = torch.randint(FIRST_ORDINARY_TOKEN, vocab, (n,), generator=g)
            attention[i, : prompt_len + n] = 1
            token_mask[i, prompt_len : prompt_len + n] = 1.0
    advantages = torch.randn(rows, 1, generator=g).expand(rows, width) * token_mask
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "token_mask": token_mask,
        "sample_mask": torch.ones(rows),
        "advantages": advantages.contiguous(),
        "global_valid_toks": token_mask.sum(),
        "global_valid_seqs": torch.tensor(float(rows)),
    }


def cached_model(ctx: Any, shape: str = "0.5B", vocab_size: int | None = None, save_dtype: str = "float32") -> str:
    """:func:`build_model` once per run (on the GPU when there is one), in the run's scratch directory."""
    import time

    import torch

    cache = ctx.state.setdefault("_models", {})
    key = (shape, vocab_size, save_dtype)
    if key not in cache:
        path = Path(ctx.workdir) / f"qwen2-{shape}-vocab{vocab_size or 'tok'}-{save_dtype}"
        start = time.perf_counter()
        build_model(path, shape, vocab_size, save_dtype, device="cuda" if torch.cuda.is_available() else "cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the caller (tier B's driver) holds no GPU memory but its CUDA context
        ctx.log(f"built {path.name} in {time.perf_counter() - start:.1f} s")
        cache[key] = str(path)
    return cache[key]
