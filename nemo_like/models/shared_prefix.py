"""Token logprobs of a Llama-family model with no padding tokens and each group's prompt computed once.

A GRPO micro-batch holds G completions of each prompt. Under causal attention a prompt's hidden states
do not depend on what follows it, so the G copies of the prompt compute the same thing G times, forward
and backward. :func:`shared_prefix_token_logprobs` runs the transformer on a flat list of tokens instead
of a padded ``[B, S]`` block:

* every distinct prompt (the tokens before a row's first trained token) once, and every row's own tokens
  after it; padding tokens are never computed;
* attention per layer: each prompt causally over itself; each row's own tokens over its prompt's keys and
  values (gathered to the row: the backward sums the G rows' gradients into the shared prompt) and
  causally over themselves;
* the output head on the positions that have a target: inside a prompt once per prompt (the targets are
  shared too), then per row.

The result is the ``[B, S]`` logprobs (and outside-kept-set flags) of
:func:`~nemo_like.models.logprobs.sequence_logprobs_with_outside` on the same batch, with the same
gradients, up to float summation order (``tests/unit/models/test_shared_prefix.py`` checks values and
gradients against the model's own forward). The matmul work drops by the prompt share of the tokens times
``1 - 1/G``, plus the padding.

The transformer is written out on the model's own parameters (:mod:`.llama_family`: RMSNorm as the model
computes it, the model's rotary module), so it applies where :func:`~.llama_family.supported` says it computes
exactly what the model computes, and only to a plain, unsharded module: FSDP2 gathers its parameters in the
modules' own forward hooks, and LoRA lives in wrapped modules, both of which this bypasses (:func:`blockers`;
``PolicyWorker`` chooses per ``policy.shared_prompt_forward``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from nemo_like.models.attention import attention
from nemo_like.models.llama_family import rms_norm, rotary_tables, supported
from nemo_like.models.processed_logprobs import SamplingDistribution, processed_token_logprobs_with_outside
from nemo_like.utils.cpu_linear import linear


@dataclass
class FlatLayout:
    """Where each computed token lives: flat order is the prompts' tokens (group-major), then the rows' own tokens.

    ``prompt_len[g]`` / ``own_len[i]``: tokens of group g's prompt / of row i after its prompt;
    ``group[i]``: row i's prompt group; ``token_ids`` / ``positions``: ``[N]`` of the flat tokens;
    ``prompt_slot`` / ``own_slot``: each flat prompt / own token's index in the padded ``[U * P, ...]`` /
    ``[B * T, ...]`` attention blocks (``P``, ``T``: the longest prompt / own part);
    ``head_index`` / ``head_target``: the flat tokens whose next token is scored, and that token;
    ``out_source``: ``[B * S]`` index into ``[0, shared prompt logprobs, per-row logprobs]`` for every output cell."""

    prompt_len: list[int]
    own_len: list[int]
    group: torch.Tensor
    token_ids: torch.Tensor
    positions: torch.Tensor
    prompt_slot: torch.Tensor
    own_slot: torch.Tensor
    head_index: torch.Tensor
    head_target: torch.Tensor
    shared_heads: int
    out_source: torch.Tensor

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_len)

    @property
    def prompt_width(self) -> int:
        return max(self.prompt_len, default=0)

    @property
    def own_width(self) -> int:
        return max(self.own_len, default=0)


def prompt_lengths(token_mask: torch.Tensor | None, lengths: list[int]) -> list[int]:
    """Each row's shareable prompt: the tokens before its first trained token (``token_mask > 0``), at least one
    token short of the row (so every row keeps a token of its own); 0 where nothing is trained or no mask is given."""
    if token_mask is None:
        return [0] * len(lengths)
    length = torch.tensor(lengths, dtype=torch.long)
    trained = (token_mask.cpu() > 0) & (torch.arange(token_mask.shape[1])[None, :] < length[:, None])
    first = trained.long().argmax(dim=-1)  # the first maximum: the first trained column
    return torch.where(trained.any(dim=-1), torch.minimum(first, length - 1), 0).tolist()


def prompt_groups(ids: torch.Tensor, prompt_len: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """``(group of each row, first row of each group)``: rows with the same prompt length and prompt tokens share a
    group; groups are numbered in order of their first row."""
    keys = torch.where(torch.arange(ids.shape[1])[None, :] < prompt_len[:, None], ids, -1)
    _, inverse = torch.unique(torch.cat([prompt_len[:, None], keys], dim=1), dim=0, return_inverse=True)
    rows = torch.arange(len(ids))
    first = torch.full((int(inverse.max()) + 1 if len(ids) else 0,), len(ids), dtype=torch.long).scatter_reduce(0, inverse, rows, "amin")
    order = torch.argsort(first)
    renumber = torch.empty_like(order)
    renumber[order] = torch.arange(len(order))
    return renumber[inverse], first[order].tolist()


def flat_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: list[int], share: bool = True) -> FlatLayout:
    """The :class:`FlatLayout` of right-padded ``input_ids`` whose row i has ``prompt_len[i]`` prompt tokens; rows
    with equal prompts share one group when ``share`` (else every row is its own group)."""
    ids = input_ids.cpu()
    rows, seq = ids.shape
    lengths = attention_mask.cpu().long().sum(-1)
    row_prompt = torch.tensor(prompt_len, dtype=torch.long)
    if share:
        group, first_row = prompt_groups(ids, row_prompt)
    else:
        group, first_row = torch.arange(rows), list(range(rows))
    g_len = row_prompt[first_row]  # [U]
    own_len = lengths - row_prompt
    width_p, width_t = int(g_len.max()) if len(first_row) else 0, int(own_len.max()) if rows else 0
    column = torch.arange(seq)

    # Flat tokens: every group's prompt (its first row's tokens), then every row's own tokens.
    in_prompt = column[None, :] < g_len[:, None]  # [U, S]
    own = (column[None, :] >= row_prompt[:, None]) & (column[None, :] < lengths[:, None])  # [B, S]
    n_prompt = int(g_len.sum())
    token_ids = torch.cat([ids[first_row][in_prompt], ids[own]])
    positions = torch.cat([column.expand(len(first_row), -1)[in_prompt], column.expand(rows, -1)[own]])
    prompt_slot = (torch.arange(len(first_row))[:, None] * width_p + column[None, :])[in_prompt]
    own_slot = (torch.arange(rows)[:, None] * width_t + column[None, :] - row_prompt[:, None])[own]
    prompt_offset = torch.cumsum(g_len, 0) - g_len
    own_offset = n_prompt + torch.cumsum(own_len, 0) - own_len

    # Scored cells (b, t): the token at t given the tokens before it. Inside a prompt (1 <= t < P) once per group,
    # from the prompt's token t-1; after it per row, from the row's token t-1 (its last prompt token or own token).
    shared = column[None, 1:] < g_len[:, None]  # [U, S-1]: targets t = 1..P-1 of each group
    shared_index = (prompt_offset[:, None] + column[None, :-1])[shared]
    shared_target = ids[first_row][:, 1:][shared]
    first_scored = row_prompt.clamp(min=1)
    per_row = (column[None, :] >= first_scored[:, None]) & (column[None, :] < lengths[:, None])  # [B, S]
    before = column[None, :] - 1
    from_prompt = before < row_prompt[:, None]
    row_index = torch.where(from_prompt, prompt_offset[group][:, None] + before, own_offset[:, None] + before - row_prompt[:, None])[
        per_row
    ]
    shared_heads = int(shared.sum())
    out_source = torch.zeros(rows, seq, dtype=torch.long)
    shared_cells = (column[None, :] >= 1) & (column[None, :] < row_prompt[:, None])
    shared_rank = torch.cumsum(shared.long().view(-1), 0).view(shared.shape)  # 1-based source of (g, t - 1)
    out_source[:, 1:] = torch.where(shared_cells[:, 1:], shared_rank[group], 0)
    out_source[per_row] = 1 + shared_heads + torch.arange(int(per_row.sum()))
    return FlatLayout(
        prompt_len=g_len.tolist(),
        own_len=own_len.tolist(),
        group=group,
        token_ids=token_ids,
        positions=positions,
        prompt_slot=prompt_slot,
        own_slot=own_slot,
        head_index=torch.cat([shared_index, row_index]),
        head_target=torch.cat([shared_target, ids[per_row]]),
        shared_heads=shared_heads,
        out_source=out_source.view(-1),
    )


def _masks(layout: FlatLayout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean attention masks (True: may attend): prompts ``[U, 1, P, P]`` causal over their own tokens; own parts
    ``[B, 1, T, P + T]``: the row's prompt, then causal over its own tokens. Every query also sees itself (padding
    queries are never read, but must not be all-masked)."""
    width_p, width_t = layout.prompt_width, layout.own_width
    prompt_valid = torch.arange(width_p)[None, :] < torch.tensor(layout.prompt_len)[:, None]  # [U, P]
    eye_p = torch.eye(width_p, dtype=torch.bool)
    prompt_mask = (torch.ones(width_p, width_p, dtype=torch.bool).tril() & prompt_valid[:, None, :]) | eye_p
    own_valid = torch.arange(width_t)[None, :] < torch.tensor(layout.own_len)[:, None]  # [B, T]
    causal = torch.ones(width_t, width_t, dtype=torch.bool).tril()
    own_self = (causal & own_valid[:, None, :]) | torch.eye(width_t, dtype=torch.bool)
    sees_prompt = prompt_valid[layout.group][:, None, :].expand(-1, width_t, -1)
    own_mask = torch.cat([sees_prompt, own_self], dim=-1)
    return prompt_mask[:, None].to(device), own_mask[:, None].to(device)


def _to_blocks(flat: torch.Tensor, slot: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``[n, heads, d]`` flat tokens -> ``[rows, heads, width, d]`` (zeros where no token)."""
    block = flat.new_zeros((rows * width, *flat.shape[1:])).index_copy(0, slot, flat)
    return block.view(rows, width, *flat.shape[1:]).transpose(1, 2)


def _from_blocks(block: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """``[rows, heads, width, d]`` -> ``[n, heads * d]`` at ``slot``."""
    rows, heads, width, dim = block.shape
    return block.transpose(1, 2).reshape(rows * width, heads * dim).index_select(0, slot)


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: FlatLayout, masks: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Flat ``[N, heads, d]`` rotated queries, ``[N, kv_heads, d]`` rotated keys and values -> ``[N, heads * d]``."""
    n_prompt, groups, rows = layout.prompt_tokens, len(layout.prompt_len), len(layout.own_len)
    gqa = q.shape[1] != k.shape[1]
    own_q, own_k, own_v = (_to_blocks(x[n_prompt:], layout.own_slot, rows, layout.own_width) for x in (q, k, v))
    if not n_prompt:
        attn = attention(own_q, own_k, own_v, masks[1], gqa)
        return _from_blocks(attn, layout.own_slot)
    p_q, p_k, p_v = (_to_blocks(x[:n_prompt], layout.prompt_slot, groups, layout.prompt_width) for x in (q, k, v))
    prompt_attn = attention(p_q, p_k, p_v, masks[0], gqa)
    keys = torch.cat([p_k.index_select(0, layout.group), own_k], dim=2)
    values = torch.cat([p_v.index_select(0, layout.group), own_v], dim=2)
    own_attn = attention(own_q, keys, values, masks[1], gqa)
    return torch.cat([_from_blocks(prompt_attn, layout.prompt_slot), _from_blocks(own_attn, layout.own_slot)])


def hidden_states(model: torch.nn.Module, layout: FlatLayout) -> torch.Tensor:
    """``[N, H]`` final (normed) hidden states of the flat tokens. The projections run one matmul per weight, as the
    model's own modules do (concatenated query/key/value and gate/up weights measured no faster here, interleaved
    in one process: at 10M parameters within noise, at 1M on one thread gate/up fused 9 % slower)."""
    cfg, inner = model.config, model.model
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    device = inner.embed_tokens.weight.device
    layout_device = {name: getattr(layout, name).to(device) for name in ("group", "prompt_slot", "own_slot")}
    layout = replace(layout, **layout_device)
    h = inner.embed_tokens(layout.token_ids.to(device))
    cos, signed_sin = rotary_tables(inner.rotary_emb, layout.positions.to(device)[None], h.dtype, head_dim)
    cos, signed_sin = cos[0, :, None], signed_sin[0, :, None]  # [N, 1, d]
    masks = _masks(layout, device)
    half = head_dim // 2
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        x = rms_norm(h, layer.input_layernorm)
        q = linear(x, attn.q_proj.weight, attn.q_proj.bias).view(-1, heads, head_dim)
        k = linear(x, attn.k_proj.weight, attn.k_proj.bias).view(-1, kv_heads, head_dim)
        v = linear(x, attn.v_proj.weight, attn.v_proj.bias).view(-1, kv_heads, head_dim)
        q = q * cos + q.roll(half, dims=-1) * signed_sin
        k = k * cos + k.roll(half, dims=-1) * signed_sin
        h = h + linear(_attention(q, k, v, layout, masks), attn.o_proj.weight, attn.o_proj.bias)
        x = rms_norm(h, layer.post_attention_layernorm)
        h = h + linear(F.silu(linear(x, mlp.gate_proj.weight)) * linear(x, mlp.up_proj.weight), mlp.down_proj.weight)
    return rms_norm(h, inner.norm)


def shared_prefix_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    token_mask: torch.Tensor | None,
    dist: SamplingDistribution,
    chunk_size: int | None = None,
    share: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``[B, S]`` token logprobs and outside-kept-set flags of right-padded ``input_ids`` (0 at padding and column 0),
    as :func:`~nemo_like.models.logprobs.sequence_logprobs_with_outside` computes them, and the number of tokens the
    transformer ran on; prompts shared per the module docstring (``token_mask`` marks the trained tokens; ``None``
    or ``share=False``: nothing shared)."""
    from nemo_like.models.chunked_logprobs import ChunkedTokenLogprobs

    if bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):  # a real token after padding: not right-padded
        raise ValueError("shared_prefix_token_logprobs needs right-padded rows (a real token follows padding in a row)")
    lengths = attention_mask.long().sum(-1).tolist()
    layout = flat_layout(input_ids, attention_mask, prompt_lengths(token_mask, lengths), share)
    device = input_ids.device
    hidden = hidden_states(model, layout)
    scored = hidden.index_select(0, layout.head_index.to(device))
    targets = layout.head_target.to(device)
    head = model.get_output_embeddings()
    if chunk_size is None:
        logits = linear(scored, head.weight, head.bias)
        lp, outside = processed_token_logprobs_with_outside(logits[None], targets[None], dist)
        lp, outside = lp[0], outside[0]
    else:
        lp, outside = ChunkedTokenLogprobs.apply(scored, head.weight, head.bias, targets, dist, chunk_size)
    source = layout.out_source.to(device)
    shape = input_ids.shape
    lp = torch.cat([lp.new_zeros(1), lp]).index_select(0, source).view(shape)
    outside = torch.cat([outside.new_zeros(1), outside]).index_select(0, source).view(shape)
    return lp, outside, len(layout.token_ids)


def blockers(model: torch.nn.Module, world_size: int, lora: bool, activation_checkpointing: bool, training: bool) -> list[str]:
    """Why :func:`shared_prefix_token_logprobs` cannot stand in for ``model``'s own forward here (empty: it can)."""
    reasons = []
    if not supported(model):
        reasons.append(f"{type(model).__name__} is not a supported Llama-family model (llama, qwen2, mistral without sliding window)")
    if world_size > 1:
        reasons.append("the policy is sharded over several workers (FSDP2 gathers parameters in the modules' own forward)")
    if lora:
        reasons.append("LoRA adapters live in wrapped modules that this forward would bypass")
    if activation_checkpointing and training:
        reasons.append("policy.dtensor_cfg.activation_checkpointing recomputes the model's own layers")
    if training and float(getattr(getattr(model, "config", None), "attention_dropout", 0.0) or 0.0) > 0:
        reasons.append("the model's attention dropout is not 0 (this forward has no dropout)")
    return reasons
