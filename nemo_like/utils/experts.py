"""A mixture-of-experts model's routed experts, read from its modules (the meta device will do): what a token runs
through, for the FLOPs of :mod:`nemo_like.utils.flops` and the activations of the memory planner.

A module named ``experts`` holds a block's routed experts, fused (each parameter ``[experts, ...]``: transformers'
Mixtral, Qwen-MoE, DeepSeek, gpt-oss) or one submodule per expert (a ``ModuleList``); its parent, the block, also holds
the router and any shared experts, which every token runs through. A token runs through ``top_k`` of a block's experts
(its config's ``num_experts_per_tok``).
"""

from __future__ import annotations

from typing import Any

import torch


def experts_of(module: torch.nn.Module) -> tuple[int, int]:
    """``(parameters, experts)`` of the routed experts in ``module`` (a model or one block), ``experts`` the most a
    block routes among; ``(0, 0)`` where there are none, or where a fused module's parameters share no leading
    experts' dimension (nothing to read: counted as dense, an upper bound)."""
    routed, experts = 0, 0
    for name, child in module.named_modules():
        if name.rsplit(".", 1)[-1] != "experts":
            continue
        params = list(child.parameters())
        if isinstance(child, torch.nn.ModuleList):
            count = len(child)
        elif params and len({p.shape[0] for p in params}) == 1:
            count = params[0].shape[0]
        else:
            continue
        routed += sum(p.numel() for p in params)
        experts = max(experts, count)
    return routed, experts


def top_k(config: Any) -> int | None:
    """How many experts a token runs through (``num_experts_per_tok`` of the text config); ``None`` when not said."""
    k = getattr(config.get_text_config(), "num_experts_per_tok", None)
    return int(k) if k else None


def active_share(routed: int, experts: int, k: int | None) -> int:
    """The parameters of ``routed`` (among ``experts``) a token runs through: ``k / experts`` of them (all where ``k``
    is not known)."""
    if not routed or not k:
        return routed
    return routed * min(k, experts) // experts


def expert_block_values_per_token(model: torch.nn.Module, hidden: int, k: int | None) -> int:
    """The most values a mixture-of-experts block saves for backward per token (0 for a dense model): per expert a
    token runs through ``4 I_e + 3 H`` (its gathered input, the gate/up output, the activation and its product, the
    weighted output; ``I_e`` an expert's width, its parameters over ``3 H``: gate, up, down), the router's ``E``
    logits, and a shared expert's ``4 I_s`` (the rest of the block over ``3 H``). Measured on a CPU with transformers'
    eager experts: 1.006-1.019 of this on Mixtral-shaped blocks (``tests/unit/plan/test_memory_plan.py``)."""
    widest = 0
    for _, block in model.named_modules():
        experts_module = getattr(block, "experts", None)
        if not isinstance(experts_module, torch.nn.Module):
            continue
        routed, count = experts_of(block)
        if not count:
            continue
        expert_width = routed // (count * 3 * hidden)
        shared_width = max(0, sum(p.numel() for p in block.parameters()) - routed - count * hidden) // (3 * hidden)
        runs = min(k, count) if k else count
        widest = max(widest, runs * (4 * expert_width + 3 * hidden) + count + 4 * shared_width)
    return widest
