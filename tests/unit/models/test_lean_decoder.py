"""The lean sampling loop (inline generation) against the model's own forward pass and the sampler's math."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from nemo_like.models.generation.lean_decoder import INVERSE_CDF_BLOCK, fused_step_supported, inverse_cdf_tokens, left_padded, sample
from nemo_like.models.logprobs import SamplingDistribution, processed_token_logprobs, sampling_keep_mask

VOCAB = 97
PROMPTS = [[3, 5, 7, 11, 13, 17], [4, 8], [9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28]]


def qwen2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    return Qwen2ForCausalLM(cfg).eval()


def llama() -> torch.nn.Module:
    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=6,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


def gpt2() -> torch.nn.Module:
    torch.manual_seed(2)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)).eval()


def qwen3_5() -> torch.nn.Module:
    """A hybrid: a linear-attention layer (a recurrent state, not keys and values) and a full-attention one. The model's
    own forward needs the cache its config describes (a bare DynamicCache failed: IndexError)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(3)
    cfg = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8,
    )  # fmt: skip
    return Qwen3_5ForCausalLM(cfg).eval()


def mistral_sliding() -> torch.nn.Module:
    """A sliding window shorter than the rows: with its config the cache keeps the window (as generate()'s does)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(4)
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, sliding_window=5)  # fmt: skip
    return MistralForCausalLM(cfg).eval()


def mamba2() -> torch.nn.Module:
    """A state-space model: its forward takes ``cache_params``, not ``past_key_values`` (handed the cache under that
    name, the model built a fresh one each call: every token after the first was drawn with an empty state)."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(5)
    cfg = Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=8, n_groups=1)
    return Mamba2ForCausalLM(cfg).eval()


def mamba() -> torch.nn.Module:
    """Mamba v1 also masks by the current tokens' columns only (the whole key mask put decoding off from its 2nd step)."""
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(6)
    return MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8)).eval()


MODELS = {
    "qwen2": qwen2, "llama": llama, "gpt2": gpt2, "qwen3_5": qwen3_5, "mistral_sliding": mistral_sliding, "mamba2": mamba2,
    "mamba": mamba,
}  # fmt: skip


def full_forward_logprobs(
    model: torch.nn.Module, prompts: list[list[int]], tokens: torch.Tensor, dist: SamplingDistribution
) -> torch.Tensor:
    """What the trainer computes: one forward over prompt + response, processed logprobs of the response tokens."""
    ids, mask = left_padded(prompts, 0)
    full = torch.cat([ids, tokens], dim=1)
    full_mask = torch.cat([mask.long(), torch.ones_like(tokens)], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=full_mask, position_ids=positions).logits
    return processed_token_logprobs(logits[:, ids.shape[1] - 1 : -1], tokens, dist)


def test_the_fused_step_serves_the_llama_family_and_nothing_else() -> None:
    assert fused_step_supported(qwen2()) and fused_step_supported(llama())
    assert not fused_step_supported(gpt2())
    # RoPE whose frequencies follow the longest position of a forward: tables for every position a call can reach were
    # not the trainer's (a tiny Llama's logprobs 0.1 nats apart); the model's own forward samples those.
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    for rope, served in [
        ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, True),
        ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}, False),
        (
            {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
             "short_factor": [1.0] * 4, "long_factor": [8.0] * 4},
            False,
        ),
    ]:  # fmt: skip
        model = LlamaForCausalLM(LlamaConfig(**base, max_position_embeddings=64, rope_parameters=rope))
        assert fused_step_supported(model) is served, rope["rope_type"]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("dist", [SamplingDistribution(), SamplingDistribution(0.7, 20, 0.9)], ids=["plain", "truncated"])
def test_sampled_logprobs_are_the_full_forward_processed_logprobs(name: str, dist: SamplingDistribution) -> None:
    """Left-padded prompts of four lengths, two of them repeated (a GRPO group: the fused step prefills a prompt once
    and copies its cache), KV-cached decode: each sampled token's logprob equals the trainer's processed logprob of
    that token from one full forward pass (so gen_kl starts at ~0)."""
    model = MODELS[name]()
    prompts = [*PROMPTS, PROMPTS[1], PROMPTS[0], PROMPTS[1]]
    drawn = sample(model, prompts, 12, dist, stop_token_ids=[], pad_token_id=0, seed=3)
    assert drawn.tokens.shape == (len(prompts), 12) and drawn.lengths == [12] * len(prompts) and not any(drawn.stopped)
    assert not torch.equal(drawn.tokens[1], drawn.tokens[4])  # a repeated prompt's rows sample independently
    expected = full_forward_logprobs(model, prompts, drawn.tokens, dist)
    torch.testing.assert_close(drawn.logprobs, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_the_fused_step_picks_the_same_greedy_tokens_as_the_models_own_forward(name: str) -> None:
    model = MODELS[name]()
    fused = sample(model, PROMPTS, 10, SamplingDistribution(), [], 0, seed=0, greedy=True)
    plain = sample(model, PROMPTS, 10, SamplingDistribution(), [], 0, seed=0, greedy=True, fused=False)
    assert torch.equal(fused.tokens, plain.tokens)
    torch.testing.assert_close(fused.logprobs, plain.logprobs, atol=2e-5, rtol=1e-5)
    # greedy = the argmax of the model's own next-token distribution, token by token
    ids, mask = left_padded(PROMPTS, 0)
    full = torch.cat([ids, fused.tokens], dim=1)
    full_mask = torch.cat([mask.long(), torch.ones_like(fused.tokens)], dim=1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=full_mask, position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0)).logits
    assert torch.equal(logits[:, ids.shape[1] - 1 : -1].argmax(-1), fused.tokens)


def test_rows_stop_at_their_first_stop_token_and_are_padded_after_it() -> None:
    model = qwen2()
    stops = list(range(0, VOCAB, 3))  # a third of the vocabulary: rows stop at different steps
    prompts = PROMPTS * 4
    drawn = sample(model, prompts, 20, SamplingDistribution(), stops, pad_token_id=1, seed=5)
    assert any(drawn.stopped) and len(set(drawn.lengths)) > 1
    for row, (n, stopped) in enumerate(zip(drawn.lengths, drawn.stopped)):
        tokens = drawn.tokens[row].tolist()
        assert all(t not in stops for t in tokens[: n - 1])
        assert (tokens[n - 1] in stops) == stopped
        assert all(t == 1 for t in tokens[n:]) and drawn.logprobs[row, n:].abs().sum() == 0
    if all(drawn.stopped):
        assert drawn.tokens.shape[1] == max(drawn.lengths)  # stopped early: no step after the last row ended


def test_truncated_sampling_never_draws_outside_the_kept_set_and_seeds_reproduce() -> None:
    model = qwen2()
    dist = SamplingDistribution(1.0, 3, 1.0)
    prompts = [PROMPTS[0]] * 64
    first = sample(model, prompts, 1, dist, [], 0, seed=11)
    again = sample(model, prompts, 1, dist, [], 0, seed=11)
    other = sample(model, prompts, 1, dist, [], 0, seed=12)
    assert torch.equal(first.tokens, again.tokens) and not torch.equal(first.tokens, other.tokens)
    ids, mask = left_padded(prompts[:1], 0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask.long()).logits[0, -1]
    kept = sampling_keep_mask(logits[None], 3, 1.0)[0].nonzero().flatten().tolist()
    assert set(first.tokens.flatten().tolist()) <= set(kept) and len(set(first.tokens.flatten().tolist())) > 1


def test_non_finite_weights_sample_uniformly_with_nan_logprobs_instead_of_crashing() -> None:
    # A diverged update (the trainer's non-finite handling takes it from there, see test_checkpoint_resume.py).
    model = qwen2()
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    drawn = sample(model, PROMPTS, 3, SamplingDistribution(), [], 0, seed=0)
    assert drawn.tokens.shape == (len(PROMPTS), 3) and bool(((drawn.tokens >= 0) & (drawn.tokens < VOCAB)).all())
    assert bool(drawn.logprobs.isnan().all())


def test_the_inverse_cdf_draw_picks_the_token_whose_mass_holds_u_and_never_one_of_zero_mass() -> None:
    probs = torch.tensor([[0.0, 0.125, 0.0, 0.375, 0.0625, 0.4375, 0.0]])  # binary fractions; cumulative: 0 .125 .125 .5 .5625 1 1
    below_one = torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))
    cases = [(0.0, 1), (0.1, 1), (0.125, 3), (0.3, 3), (0.5, 4), (0.55, 4), (0.5625, 5), (0.99, 5), (below_one.item(), 5)]
    cases.append((1.0, 5))  # outside U[0, 1), as a rounded position within a block can be: still the last token of mass
    for u, token in cases:
        assert inverse_cdf_tokens(probs, torch.tensor([[u]], dtype=torch.float64)).item() == token, u
    # Unnormalised weights (the sampler's uniform fallback for a non-finite row sets every weight to 1) draw the same.
    assert inverse_cdf_tokens(3 * probs, torch.tensor([[0.55]], dtype=torch.float64)).item() == 4


def test_the_inverse_cdf_draw_samples_the_distribution() -> None:
    probs = torch.tensor([0.0, 0.1, 0.0, 0.35, 0.05, 0.5, 0.0])
    n = 200_000
    u = torch.rand(n, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    counts = torch.bincount(inverse_cdf_tokens(probs.expand(n, -1), u), minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0
    kept = probs > 0
    expected = n * probs[kept].double()
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < 16.3, chi2  # 3 degrees of freedom: P(chi2 > 16.3) = 0.001


def test_a_large_vocabulary_is_drawn_in_two_levels_as_the_float64_cumulative_sum_draws_it() -> None:
    vocab = 3 * INVERSE_CDF_BLOCK + 200  # three whole blocks and a short last one
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(vocab, generator=gen) ** 8  # uneven mass
    probs[INVERSE_CDF_BLOCK : 2 * INVERSE_CDF_BLOCK] = 0  # a whole block of zero mass
    probs[-150:-1] = 0  # most of the short block's tail; its last token keeps some mass
    probs[:5] = 0
    probs /= probs.sum()
    n = 20_000
    u = torch.rand(n, 1, generator=gen, dtype=torch.float64)
    tokens = inverse_cdf_tokens(probs.expand(n, -1), u)
    cdf = probs.double().cumsum(0)  # one level, float64 over the whole vocabulary
    exact = torch.searchsorted(cdf, (u * cdf[-1]).squeeze(-1), right=True)
    assert int((tokens != exact).sum()) <= 2  # they may differ where u is within float32 rounding of a block boundary
    assert bool((probs[tokens] > 0).all())
    edges = inverse_cdf_tokens(probs[None].expand(2, -1), torch.tensor([[0.0], [1 - 2**-53]], dtype=torch.float64))
    nonzero = probs.nonzero().flatten()
    assert edges.tolist() == [nonzero[0].item(), nonzero[-1].item()]


def test_in_bfloat16_the_fused_step_is_the_models_own_forward() -> None:
    """A bf16 engine (``policy.precision: bfloat16``): the fused step normalised with ``F.rms_norm(h, weight)``, which
    rounds differently from the model's RMSNorm (float32, cast back, then the weight): on the shipped model its logits
    were off by 0.125 and greedy rows left the model's path within 8 tokens. It must pick the model's tokens."""
    from nemo_like.config.schema import EMBEDDED_MODEL
    from nemo_like.models.loading import load_causal_lm

    model = load_causal_lm(EMBEDDED_MODEL, "bfloat16").eval()
    assert next(model.parameters()).dtype == torch.bfloat16
    prompts = [[5, 17, 30, 12, 9], [40, 41], [7, 8, 9, 10, 11, 12, 13], [60, 3, 61], [22, 23, 24, 25]]
    fused = sample(model, prompts, 48, SamplingDistribution(), [], 0, seed=0, greedy=True)
    plain = sample(model, prompts, 48, SamplingDistribution(), [], 0, seed=0, greedy=True, fused=False)
    assert torch.equal(fused.tokens, plain.tokens)
    torch.testing.assert_close(fused.logprobs, plain.logprobs, atol=0, rtol=0)


def test_no_token_to_draw_or_none_to_condition_on_is_a_clear_error() -> None:
    """``max_new_tokens=0`` failed inside torch.stack ('expects a non-empty TensorList') and an empty prompt with a shape
    error; both are caller errors the message should name."""
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1, got 0"):
        sample(qwen2(), PROMPTS, 0, SamplingDistribution(), [], 0, seed=0)
    with pytest.raises(ValueError, match=r"prompts \[1\] are empty"):
        sample(qwen2(), [[3, 4], [], [5]], 4, SamplingDistribution(), [], 0, seed=0)


@pytest.mark.parametrize("rows", [8, 256])
def test_the_planners_count_of_the_fused_steps_weight_copies_is_what_a_step_holds(rows: int) -> None:
    """The memory planner charges the inline backend's sampling with ``fused_step_copy_elements``: the tensors a
    FusedLlamaStep holds beside the model's own parameters (fused projections, oneDNN-packed weights), counted here."""
    from nemo_like.models.generation.lean_decoder import FusedLlamaStep, fused_step_copy_elements

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=359, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    model = Qwen2ForCausalLM(config).eval()
    own = {p.data_ptr() for p in model.parameters()}
    step = FusedLlamaStep(model, rows, 8, rows)
    held = [t for layer in step.layers for t in layer if t is not None] + [t for t in (step.head or ()) if t is not None]
    copies = sum(t.numel() for t in held if t.dim() == 2 and (t.is_mkldnn or t.data_ptr() not in own))  # weights, not biases
    assert copies == fused_step_copy_elements(2, 128, 512, 128, 64, 359, rows, torch.float32)
    fused_only = 2 * ((128 + 2 * 64) * 128 + 2 * 512 * 128)
    assert copies >= fused_only  # q|k|v and gate|up are always new tensors
    if rows == 8:
        assert copies == fused_only  # products of 8 rows are too small to pack
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a bfloat16 run samples its float32 masters under autocast
        mixed = FusedLlamaStep(model, rows, 8, rows)
    held = [t for layer in mixed.layers for t in layer if t is not None and t.dim() == 2] + [mixed.head[0]]
    assert not any(t.data_ptr() in own for t in held)  # every projection cast to bf16 once per call, not at every step
    elements = fused_step_copy_elements(2, 128, 512, 128, 64, 359, rows, torch.bfloat16, cast=True)
    assert sum(t.numel() for t in held) == elements == sum(p.numel() for p in model.parameters() if p.dim() == 2) - 359 * 128
    assert {t.dtype for t in held} == {torch.bfloat16} and not any(t.is_mkldnn for t in held)  # 2-byte copies, none packed
    assert {c.dtype for c in mixed.k_cache + mixed.v_cache} == {torch.float32}  # as the residual stream (the planner's)


def test_rows_stop_sampling_at_a_stop_string_and_keep_what_the_exact_cut_keeps() -> None:
    """Stop strings were applied after generation only: every row sampled on to max_new_tokens (a ReAct agent's
    ``stop=["Observation:"]`` sampled to the end of the context, all of it cut away). With the tokenizer's decode a row
    stops at the token that completes a stop string: the same tokens and logprobs as the exact cut of a full draw."""
    from nemo_like.config.schema import EMBEDDED_MODEL
    from nemo_like.models.generation.interface import SamplingParams, stop_string_prefix
    from nemo_like.models.generation.lean_decoder import sample_with_params
    from nemo_like.models.loading import exact_decoder, load_causal_lm, load_tokenizer

    tokenizer, model = load_tokenizer(EMBEDDED_MODEL), load_causal_lm(EMBEDDED_MODEL, "float32").eval()
    texts = ["<|im_start|>user\nWhat is 47 plus 38?<|im_end|>\n<|im_start|>assistant\n", "<|im_start|>user\nHi<|im_end|>\n"]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts] * 8
    decode, stops = exact_decoder(EMBEDDED_MODEL), ("8", "<|im_start|>assistant")
    sp = SamplingParams(max_new_tokens=24, temperature=1.5, stop_strings=stops)
    eos = [tokenizer.eos_token_id]
    seeds = list(range(len(prompts)))
    full = sample_with_params(model, prompts, SamplingParams(max_new_tokens=24, temperature=1.5), eos, 0, seeds)
    watched = sample_with_params(model, prompts, sp, eos, 0, seeds, decode=decode)
    cut_early = 0
    for row in range(len(prompts)):
        ids = full.tokens[row, : full.lengths[row]].tolist()
        cut = stop_string_prefix(ids, decode, stops)
        kept = len(ids) if cut is None else cut
        assert watched.tokens[row, : watched.lengths[row]].tolist() == ids[:kept], row
        torch.testing.assert_close(watched.logprobs[row, :kept], full.logprobs[row, :kept], rtol=0, atol=0)
        assert watched.stopped[row] == (cut is not None or full.stopped[row]), row
        cut_early += cut is not None and cut < full.lengths[row]
    assert cut_early >= 3  # rows that stopped sampling early
    assert sum(watched.lengths) < sum(full.lengths)


def test_models_whose_state_the_sampler_cannot_keep_per_row_are_refused_in_the_actor_and_on_the_driver(tmp_path) -> None:
    """MiniMax's forward refuses a DynamicCache (the first generate call died inside the actor with transformers' words),
    and its lightning attention lets a left-padded row's padding into its state; RecurrentGemma's recurrent blocks let it
    in silently (a padded row's logprobs 0.48 off the trainer's); RWKV's forward ignores the mask and took no cache under
    our name (every step started afresh: gen_kl 0.18 at step 1); xLSTM needs a cache class of its own (an
    AttributeError). The driver refuses them before any actor starts, naming the backend; vLLM's engine is not judged."""
    from transformers import (
        MiniMaxConfig,
        MiniMaxForCausalLM,
        RecurrentGemmaConfig,
        RecurrentGemmaForCausalLM,
        RwkvConfig,
        RwkvForCausalLM,
        xLSTMForCausalLM,
    )

    from nemo_like.algorithms.setup import check_sampled_model
    from nemo_like.config import ConfigError, load_config
    from nemo_like.models.generation.lean_decoder import sampling_problem

    minimax = MiniMaxConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=16, layer_types=["linear_attention", "full_attention"],
                            num_local_experts=2, num_experts_per_tok=1, block_size=16)  # fmt: skip
    gemma = RecurrentGemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=1, head_dim=16, lru_width=32, attention_window_size=8)  # fmt: skip
    rwkv = RwkvConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64)
    for model, why in (
        (MiniMaxForCausalLM(minimax), r"its lightning-attention layers keep a cache of their own"),
        (RecurrentGemmaForCausalLM(gemma), r"its recurrent blocks let a left-padded row's padding into their state"),
        (RwkvForCausalLM(rwkv), r"its forward ignores the attention mask"),
    ):
        with pytest.raises(ValueError, match=rf"{type(model).__name__}: this sampler cannot sample it: {why}"):
            sample(model.eval(), PROMPTS, 4, SamplingDistribution(), [], 0, seed=0)
    assert sampling_problem("xlstm", xLSTMForCausalLM.forward) == "it keeps its state in a cache class of its own"
    assert sampling_problem("llama", lambda input_ids, attention_mask: None).startswith("its forward takes no cache")
    assert sampling_problem("llama", lambda *args, **kwargs: None) is None  # a wrapper (PEFT's) delegates
    rwkv.save_pretrained(tmp_path)
    cfg = load_config(None, [f"policy.model_name={tmp_path}"])
    with pytest.raises(
        ConfigError,
        match=rf"policy.model_name='{tmp_path}' with policy.generation.backend=auto chose hf: the HF sampler cannot sample RwkvForCausalLM: its forward ignores",
    ):
        check_sampled_model(cfg, "hf")
    check_sampled_model(cfg, "vllm")  # vLLM's engine samples with its own kernels
    minimax.save_pretrained(tmp_path / "minimax")  # a mixture of experts: no vLLM trains it on a CPU cluster either
    moe = load_config(None, [f"policy.model_name={tmp_path / 'minimax'}"])
    with pytest.raises(ConfigError, match=r"cannot sample MiniMaxForCausalLM: .*; nor can vLLM train it on a CPU cluster .*"):
        check_sampled_model(moe, "hf", experts=True)
