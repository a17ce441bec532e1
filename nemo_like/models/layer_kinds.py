"""What each decoder layer of a model is, read from its transformers config: attention (full, within a sliding window,
...), a layer that carries a state along the sequence (linear attention, convolution, state space: Qwen3-Next/3.5's
gated delta nets, Mamba, LFM2), or a per-token block (an MLP-only layer). Sequence packing (which a mask keeps to
each sample only in attention layers) and the memory planner (whose KV cache grows with the sequence only in
attention layers, up to the window in sliding ones) both decide from it."""

from __future__ import annotations

from typing import Any

#: Layer kinds that attend through the attention mask transformers hands them (a packed row's 4D mask reaches them)
#: and cache keys and values per token: DeepSeek-V3.2's indexed attention applies the mask before its top-k.
ATTENTION_KINDS = frozenset({"full_attention", "sliding_attention", "attention", "indexed_attention", "chunked_attention"})
#: Layer kinds that act on each token alone (Nemotron-H's MLP-only and MoE-only layers): no mask, no cache.
PER_TOKEN_KINDS = frozenset({"mlp", "moe"})
#: Layer kinds that carry a fixed-size state along the sequence instead of caching each token: linear attention
#: (gated delta nets; transformers lists Mamba layers so too), LFM2's convolutions, RecurrentGemma's recurrent blocks.
STATE_KINDS = frozenset({"linear_attention", "conv", "recurrent", "mamba"})
#: Layer kinds that run attention and a state-space block side by side (Falcon-H1, Zamba): a state and a per-token cache.
HYBRID_KINDS = frozenset({"hybrid", "hybrid_sliding"})


def text_config(config: Any) -> Any:
    """The text model's config of ``config`` (itself for a text-only model)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_kinds(config: Any) -> list[str]:
    """Each decoder layer's kind as the config lists it (``layer_types``; RecurrentGemma's ``block_types``); a config
    that lists none and has no attention heads (RWKV, xLSTM): every layer ``recurrent``; else empty (every layer is
    then attention)."""
    text = text_config(config)
    layers = getattr(text, "num_hidden_layers", None)
    for key in ("layer_types", "block_types"):
        kinds = getattr(text, key, None)
        if isinstance(kinds, (list, tuple)) and kinds:
            return [str(kind) for kind in kinds][:layers]  # RecurrentGemma's block_types cycle past its layers
    if isinstance(layers, int) and getattr(text, "num_attention_heads", None) is None:
        return ["recurrent"] * layers
    return []


def holds_state(kind: str) -> bool:
    """Whether a layer of ``kind`` carries a state along the sequence (alone, or beside attention)."""
    return kind in STATE_KINDS or kind in HYBRID_KINDS


def stateful_kinds(config: Any) -> list[str]:
    """The kinds of ``config``'s layers that carry a state along the sequence, sorted."""
    return sorted(filter(holds_state, set(layer_kinds(config))))


def unknown_kinds(config: Any) -> list[str]:
    """The kinds of ``config``'s layers this module does not know (DeepSeek-V4's compressed attention), sorted: they
    may attend in ways a mask does not express; the memory plan counts them as full attention."""
    return sorted(set(layer_kinds(config)) - ATTENTION_KINDS - PER_TOKEN_KINDS - STATE_KINDS - HYBRID_KINDS)


def attention_free(config: Any) -> bool:
    """Whether no layer of ``config`` attends: each carries a state or acts on each token alone (Mamba, Mamba-2; a
    config that lists no kinds has attention layers)."""
    kinds = layer_kinds(config)
    return bool(kinds) and not any(map(caches_per_token, kinds))


def caches_per_token(kind: str) -> bool:
    """Whether a layer of ``kind`` caches keys and values for each token (attention, a hybrid's, an unknown kind's)."""
    return kind not in STATE_KINDS and kind not in PER_TOKEN_KINDS


def sliding_window(config: Any) -> int | None:
    """The window of ``config``'s sliding-window layers (transformers' loaded config: it clears an unused
    ``sliding_window``), ``None`` when no layer slides: those listed ``sliding_attention`` in ``layer_types``, or every
    layer of a config with a window and no ``layer_types`` (Mistral)."""
    text = text_config(config)
    window, layer_types = getattr(text, "sliding_window", None), getattr(text, "layer_types", None)
    return int(window) if window and (layer_types is None or "sliding_attention" in layer_types) else None


#: The config keys of a Mamba block's sizes, by model type, as transformers' modeling reads them: the inner width (the
#: first of its keys the config sets; an ``expand`` key is a factor of ``hidden_size``; none: heads x head size), then
#: heads, head size, state size, groups and convolution kernel. A Mamba-1 block has no heads or groups.
MAMBA_BLOCK_KEYS: dict[str, tuple[tuple[str, ...], str | None, str | None, str, str | None, str]] = {
    "mamba": (("intermediate_size",), None, None, "state_size", None, "conv_kernel"),
    "falcon_mamba": (("intermediate_size",), None, None, "state_size", None, "conv_kernel"),
    "jamba": (("mamba_expand",), None, None, "mamba_d_state", None, "mamba_d_conv"),
    "mamba2": (("expand",), "num_heads", "head_dim", "state_size", "n_groups", "conv_kernel"),
    "falcon_h1": (("mamba_d_ssm", "mamba_expand"), "mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv"),
    "bamba": (("mamba_expand",), "mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv"),
    "granitemoehybrid": (("mamba_expand",), "mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv"),
    "nemotron_h": ((), "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel"),
    "zamba2": (("mamba_expand",), "n_mamba_heads", "mamba_headdim", "mamba_d_state", "mamba_ngroups", "mamba_d_conv"),
}  # fmt: skip


def state_values(config: Any) -> tuple[int, int]:
    """Values one stateful layer of ``config`` keeps per sequence whatever its length, as transformers' cache holds them:
    ``(convolution, recurrent)``, the convolution's window (in the model's dtype) and the recurrent state (which
    transformers keeps in float32): a gated delta net's (:func:`linear_attention_state_values`) or a Mamba block's
    (:func:`mamba_state_values`); ``(0, 0)`` where neither is known here."""
    return linear_attention_state_values(config) if gated_delta_net(config) else mamba_state_values(config)


def gated_delta_net(config: Any) -> bool:
    """Whether ``config``'s linear-attention layers are gated delta nets (Qwen3-Next, Qwen3.5: ``linear_*`` sizes in
    the config; transformers lists Mamba layers as ``linear_attention`` too)."""
    return "linear_attention" in layer_kinds(config) and bool(getattr(text_config(config), "linear_conv_kernel_dim", None))


def mamba_state_values(config: Any) -> tuple[int, int]:
    """A Mamba block's ``(convolution, recurrent)`` values per sequence (:data:`MAMBA_BLOCK_KEYS`): the convolution's
    ``kernel`` columns of its channels (the inner width, and a Mamba-2 block's ``2 x groups x state`` of B and C) and
    the state, ``inner x state`` (Mamba-1) or ``heads x head size x state`` (Mamba-2); ``(0, 0)`` for another model
    type or a size the config does not set."""
    text = text_config(config)
    if (keys := MAMBA_BLOCK_KEYS.get(getattr(text, "model_type", ""))) is None:
        return 0, 0
    inner_keys, heads_key, head_key, state_key, groups_key, kernel_key = keys
    heads, head_dim, groups = (getattr(text, key, None) if key else None for key in (heads_key, head_key, groups_key))
    state, kernel = getattr(text, state_key, None), getattr(text, kernel_key, None)
    inner = (heads or 0) * (head_dim or 0)
    for key in inner_keys:
        if value := getattr(text, key, None):
            inner = int(value * text.hidden_size) if key.endswith("expand") else value
            break
    if not inner or not state or not kernel or (heads_key and not (heads and head_dim and groups)):
        return 0, 0
    if heads_key is None:  # Mamba-1
        return inner * kernel, inner * state
    return (inner + 2 * groups * state) * kernel, heads * head_dim * state


def linear_attention_state_values(config: Any) -> tuple[int, int]:
    """Values one gated-delta-net layer (Qwen3-Next, Qwen3.5: ``linear_*`` sizes in the config) keeps per sequence
    whatever its length, as transformers' cache holds them: ``(convolution, recurrent)``, the convolution's window
    over the query, key and value channels (``conv_dim x linear_conv_kernel_dim``, in the model's dtype) and the
    recurrent state (``value heads x key dim x value dim``, which transformers keeps in float32); ``(0, 0)`` for a
    config without those sizes (the state is then not known here)."""
    text = text_config(config)
    sizes = [getattr(text, f"linear_{name}", None) for name in ("num_key_heads", "key_head_dim", "num_value_heads", "value_head_dim")]
    kernel = getattr(text, "linear_conv_kernel_dim", None)
    if not all(sizes) or not kernel:
        return 0, 0
    key_heads, key_dim, value_heads, value_dim = sizes
    conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
    return conv_dim * kernel, value_heads * key_dim * value_dim
