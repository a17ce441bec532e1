"""Eager vs ``torch.compile`` for one W1-sized decode step (the fused step's math: one q|k|v and one gate|up matmul per
layer, RoPE, SDPA over a static KV cache, the head and its log-softmax), in-process: what compiling the sampler would
save where a step is per-kernel cost.

Usage: python benchmarks/compile_decode.py [--size 1m|10m] [--rows 8] [--steps 200] [--threads 2]

Builds the model of ``benchmarks/vs_trl.py`` (random init), then times ``--steps`` decode steps of ``--rows`` rows with
the eager function and with ``torch.compile`` of it (Inductor, static shapes: one compile per shape and process);
prints the compile seconds and the milliseconds per step of each (eager measured before and after the compiled run).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from vs_trl import build_model


def decode_step_fn(model: torch.nn.Module, rows: int, max_len: int):
    """A decode step over ``model``'s weights: ``step(tokens [rows, 1], position [1], mask [rows, 1, 1, max_len],
    k_cache, v_cache) -> logprobs [rows, V]``."""
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = cfg.hidden_size // heads
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv_bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
        layers.append((layer.input_layernorm.weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                       qkv_bias, attn.o_proj.weight, layer.post_attention_layernorm.weight,
                       torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight))  # fmt: skip
    intermediate = model.model.layers[0].mlp.gate_proj.weight.shape[0]
    embed, norm, head = model.model.embed_tokens.weight, model.model.norm.weight, model.lm_head.weight
    cos, sin = torch.randn(rows, 1, max_len, head_dim), torch.randn(rows, 1, max_len, head_dim)
    eps = cfg.rms_norm_eps

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def step(tokens, position, mask, k_cache, v_cache):
        h = F.embedding(tokens, embed)
        c, s = cos.index_select(2, position), sin.index_select(2, position)
        for i, (ln1, qkv_w, qkv_b, o_w, ln2, gate_up, down) in enumerate(layers):
            qkv = F.linear(rms(h, ln1), qkv_w, qkv_b).view(rows, 1, heads + 2 * kv_heads, head_dim).transpose(1, 2)
            qk = qkv[:, : heads + kv_heads]
            qk = qk * c + qk.roll(head_dim // 2, dims=-1) * s
            k_cache[i].index_copy_(2, position, qk[:, heads:])
            v_cache[i].index_copy_(2, position, qkv[:, heads + kv_heads :])
            attended = F.scaled_dot_product_attention(qk[:, :heads], k_cache[i], v_cache[i], attn_mask=mask, enable_gqa=kv_heads != heads)
            h = h + F.linear(attended.transpose(1, 2).reshape(rows, 1, heads * head_dim), o_w)
            gate, up = F.linear(rms(h, ln2), gate_up).split(intermediate, dim=-1)
            h = h + F.linear(F.silu(gate) * up, down)
        return torch.log_softmax(F.linear(rms(h[:, -1], norm), head), dim=-1)

    caches = [[torch.zeros(rows, kv_heads, max_len, head_dim) for _ in layers] for _ in range(2)]
    return step, caches


def ms_per_step(step, caches, rows: int, max_len: int, steps: int) -> float:
    tokens, mask = torch.randint(0, 100, (rows, 1)), torch.ones(rows, 1, 1, max_len, dtype=torch.bool)
    with torch.no_grad():
        for position in range(5):
            step(tokens, torch.tensor([position]), mask, *caches)
        began = time.perf_counter()
        for position in range(steps):
            step(tokens, torch.tensor([position % max_len]), mask, *caches)
    return (time.perf_counter() - began) / steps * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1m")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    max_len = 64
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import AutoModelForCausalLM

        model_dir, _ = build_model(Path(tmp), args.size)
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        step, caches = decode_step_fn(model, args.rows, max_len)
        eager_before = ms_per_step(step, caches, args.rows, max_len, args.steps)
        began = time.perf_counter()
        compiled = torch.compile(step, dynamic=False)
        with torch.no_grad():
            compiled(
                torch.zeros(args.rows, 1, dtype=torch.long),
                torch.tensor([0]),
                torch.ones(args.rows, 1, 1, max_len, dtype=torch.bool),
                *caches,
            )
        compile_s = time.perf_counter() - began
        compiled_ms = ms_per_step(compiled, caches, args.rows, max_len, args.steps)
        eager_after = ms_per_step(step, caches, args.rows, max_len, args.steps)
    print(
        f"{args.size}, {args.rows} rows: eager {eager_before:.2f} / {eager_after:.2f} ms a step, compiled {compiled_ms:.2f} ms "
        f"(compiled / eager {compiled_ms / min(eager_before, eager_after):.2f}), compile {compile_s:.1f} s"
    )


if __name__ == "__main__":
    main()
