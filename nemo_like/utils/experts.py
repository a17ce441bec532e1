"""A mixture-of-experts model's routed experts, read from its modules (the meta device will do): what a token runs
through, for the FLOPs of :mod:`nemo_like.utils.flops` and the activations of the memory planner.

A module named ``experts`` holds a block's routed experts, fused (each parameter ``[experts, ...]``: transformers'
Mixtral, Qwen-MoE, DeepSeek, gpt-oss) or one submodule per expert (a ``ModuleList``); its parent, the block, also holds
the router and any shared experts, which every token runs through. A token runs through ``top_k`` of a block's experts
(its config's ``num_experts_per_tok`` or another of :data:`TOP_K_KEYS`).
"""

from __future__ import annotations

from typing import Any

import torch


def experts_of(module: torch.nn.Module) -> tuple[int, int]:
    """``(parameters, experts)`` of the routed experts in ``module`` (a model or one block), ``experts`` the most a
    block routes among; ``(0, 0)`` where there are none."""
    routed, experts = 0, 0
    for name, child in module.named_modules():
        if name.rsplit(".", 1)[-1] == "experts":
            params, count = routed_experts(child)
            routed, experts = routed + params, max(experts, count)
    return routed, experts


def routed_experts(experts: torch.nn.Module) -> tuple[int, int]:
    """``(parameters, experts)`` of one ``experts`` module: one submodule per expert (a ``ModuleList``) or fused
    parameters sharing a leading experts' dimension (weights ``[experts, out, in]``); ``(0, 0)`` where none is to be
    read (counted as dense, an upper bound: DBRX's experts stacked into ``[experts x width, hidden]`` matrices)."""
    params = list(experts.parameters())
    if isinstance(experts, torch.nn.ModuleList):
        count = len(experts)
    elif any(p.dim() >= 3 for p in params) and len({p.shape[0] for p in params}) == 1:
        count = params[0].shape[0]
    else:
        return 0, 0
    return sum(p.numel() for p in params), count


#: The config keys that say how many experts a token runs through: most models', Gemma 4's, DBRX's (in its
#: ``ffn_config``), Aria's and Hunyuan's.
TOP_K_KEYS = ("num_experts_per_tok", "top_k_experts", "moe_top_k", "moe_topk")


def top_k(config: Any) -> int | None:
    """How many experts a token runs through (:data:`TOP_K_KEYS` of the text config or its ``ffn_config``; a per-layer
    list: its largest); ``None`` when not said."""
    text = config.get_text_config()
    for where in (text, getattr(text, "ffn_config", None)):
        for key in TOP_K_KEYS:
            k = getattr(where, key, None)
            k = max(k) if isinstance(k, (list, tuple)) and k else k
            if isinstance(k, int) and k > 0:
                return k
    return None


def active_share(routed: int, experts: int, k: int | None) -> int:
    """The parameters of ``routed`` (among ``experts``) a token runs through: ``k / experts`` of them (all where ``k``
    is not known)."""
    if not routed or not k:
        return routed
    return routed * min(k, experts) // experts


def expert_block_values_per_token(model: torch.nn.Module, hidden: int, k: int | None) -> int:
    """The most values a mixture-of-experts block saves for backward per token (0 for a dense model, or where ``k`` is
    not known: the planner's dense MLP then): per expert a token runs through ``4 I_e + 3 H`` (its gathered input, the
    gate/up output, the activation and its product, the weighted output; ``I_e`` an expert's width, its parameters over
    ``3 H``: gate, up, down), the router's ``E`` logits, and ``4 I_s`` for the MLPs beside the experts that every token
    runs through (a child named ``shared...`` or ``mlp``: shared experts, Gemma 4's dense MLP; ``I_s`` their parameters
    over ``3 H``). Checked on a CPU with transformers' eager experts against what Mixtral- and Qwen2-MoE-shaped layers
    save (``tests/unit/plan/test_memory_plan.py``)."""
    if not k:
        return 0
    widest = 0
    for _, block in model.named_modules():
        experts_module = getattr(block, "experts", None)
        if not isinstance(experts_module, torch.nn.Module):
            continue
        routed, count = routed_experts(experts_module)
        if not count:
            continue
        expert_width = routed // (count * 3 * hidden)
        beside = [child for name, child in block.named_children() if name.startswith("shared") or name == "mlp"]
        shared_width = sum(p.numel() for child in beside for p in child.parameters()) // (3 * hidden)
        widest = max(widest, min(k, count) * (4 * expert_width + 3 * hidden) + count + 4 * shared_width)
    return widest
