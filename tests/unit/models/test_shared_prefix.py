"""The shared-prompt forward against the model's own forward: same logprobs, outside flags and gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from nemo_like.algorithms.loss_functions import ClippedPGLossFn
from nemo_like.config.loss import ClippedPGLossConfig
from nemo_like.config.schema import EMBEDDED_MODEL, OptimizerConfig
from nemo_like.models.logprobs import SamplingDistribution, sequence_logprobs_with_outside
from nemo_like.models.policy.worker import PolicyWorker
from nemo_like.models.shared_prefix import blockers, flat_layout, prompt_lengths, shared_prefix_token_logprobs
from nemo_like.utils import cpu_linear

VOCAB = 61


def qwen2(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    return Qwen2ForCausalLM(cfg).to(dtype)  # q/k/v biases, grouped-query attention, tied head


def llama() -> torch.nn.Module:
    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=6, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def grpo_like_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded rows: two prompts (5 and 8 tokens) with four completions each of different lengths, a row
    whose mask trains nothing, a one-token row, and a multi-turn-like row (trained, masked feedback, trained)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (5,), generator=g), torch.randint(3, VOCAB, (8,), generator=g)]
    rows, masks = [], []
    for i in range(8):
        prompt, response = prompts[i % 2], torch.randint(3, VOCAB, (int(torch.randint(1, 9, (), generator=g)),), generator=g)
        rows.append(torch.cat([prompt, response]))
        masks.append(torch.cat([torch.zeros(len(prompt)), torch.ones(len(response))]))
    rows.append(torch.randint(3, VOCAB, (7,), generator=g))
    masks.append(torch.zeros(7))  # nothing trained: no shared prompt
    rows.append(torch.tensor([5]))
    masks.append(torch.zeros(1))
    rows.append(torch.cat([prompts[0], torch.randint(3, VOCAB, (9,), generator=g)]))
    masks.append(torch.tensor([0.0] * 5 + [1, 1, 1, 0, 0, 0, 1, 1, 1]))
    seq = max(len(r) for r in rows)
    ids, attention, token_mask = (
        torch.zeros(len(rows), seq, dtype=torch.long),
        torch.zeros(len(rows), seq, dtype=torch.long),
        torch.zeros(len(rows), seq),
    )
    for i, (row, mask) in enumerate(zip(rows, masks)):
        ids[i, : len(row)], attention[i, : len(row)], token_mask[i, : len(row)] = row, 1, mask
    return {"input_ids": ids, "attention_mask": attention, "token_mask": token_mask}


DISTRIBUTIONS = [SamplingDistribution(), SamplingDistribution(temperature=0.7, top_k=20, top_p=0.9)]


@pytest.mark.parametrize("make_model", [qwen2, llama], ids=["qwen2", "llama"])
@pytest.mark.parametrize("dist", DISTRIBUTIONS, ids=["plain", "top-k-top-p"])
@pytest.mark.parametrize("chunk", [None, 5], ids=["full-logits", "chunked"])
@pytest.mark.parametrize("share", [True, False], ids=["shared", "flat-only"])
@pytest.mark.parametrize("gemm", ["torch", "onednn"])
def test_logprobs_and_gradients_equal_the_models_own_forward(make_model, dist, chunk, share, gemm, monkeypatch):
    if gemm == "onednn":  # every product of the shared forward through OneDNNLinear (these models are below its threshold)
        if not cpu_linear.onednn_linear_available():
            pytest.skip("oneDNN's linear op is used on x86-64 only")
        monkeypatch.setattr(cpu_linear, "ONEDNN_MIN_MACS", 0)
        monkeypatch.setattr(cpu_linear, "onednn_beats_blas", lambda: True)  # as on an AMD CPU, whatever runs the suite
    model, batch = make_model(), grpo_like_batch()
    weights = torch.randn(batch["input_ids"].shape, generator=torch.Generator().manual_seed(3))
    own_lp, own_outside = sequence_logprobs_with_outside(model, batch["input_ids"], batch["attention_mask"], dist, chunk)
    (own_lp * weights).sum().backward()
    own_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    lp, outside, computed = shared_prefix_token_logprobs(
        model, batch["input_ids"], batch["attention_mask"], batch["token_mask"], dist, chunk, share=share
    )
    (lp * weights).sum().backward()
    torch.testing.assert_close(lp, own_lp, atol=2e-6, rtol=0)
    assert torch.equal(outside, own_outside)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, own_grads[name], atol=2e-5, rtol=1e-4, msg=name)
    valid = int(batch["attention_mask"].sum())
    # Sharing computes the two prompts once (5 + 8 tokens) instead of in 5 and 4 rows (the multi-turn row shares prompt 0).
    assert computed == (valid - (5 * 5 + 4 * 8) + (5 + 8) if share else valid)


def test_without_a_token_mask_nothing_is_shared_and_the_result_is_the_same():
    model, batch = qwen2(), grpo_like_batch()
    dist = SamplingDistribution()
    own, _ = sequence_logprobs_with_outside(model, batch["input_ids"], batch["attention_mask"], dist)
    lp, _, computed = shared_prefix_token_logprobs(model, batch["input_ids"], batch["attention_mask"], None, dist)
    torch.testing.assert_close(lp, own, atol=2e-6, rtol=0)
    assert computed == int(batch["attention_mask"].sum())


def test_a_left_padded_row_scores_no_token_from_padding_and_the_shared_forward_refuses_it():
    """Both forwards take right-padded rows. A left-padded row's first real token was scored from a padding position
    (a garbage logprob, kept); it is now 0, as position 0 is, and the shared-prompt forward refuses the layout."""
    model, dist = qwen2(), SamplingDistribution()
    row = torch.tensor([[7, 12, 30, 4, 9]])
    right, _ = sequence_logprobs_with_outside(
        model, torch.cat([row, torch.zeros(1, 2, dtype=torch.long)], 1), torch.tensor([[1] * 5 + [0] * 2]), dist
    )
    left_ids, left_mask = torch.cat([torch.zeros(1, 2, dtype=torch.long), row], 1), torch.tensor([[0] * 2 + [1] * 5])
    left, _ = sequence_logprobs_with_outside(model, left_ids, left_mask, dist)
    assert left[0, :3].tolist() == [0.0, 0.0, 0.0] and right[0, 0] == 0.0
    torch.testing.assert_close(left[0, 3:], right[0, 1:5], atol=1e-5, rtol=0)  # the same tokens, the same context
    with pytest.raises(ValueError, match="needs right-padded rows"):
        shared_prefix_token_logprobs(model, left_ids, left_mask, None, dist)


def test_bfloat16_follows_the_models_own_forward():
    model, batch = qwen2(torch.bfloat16), grpo_like_batch()
    dist = SamplingDistribution()
    with torch.no_grad():
        own, _ = sequence_logprobs_with_outside(model, batch["input_ids"], batch["attention_mask"], dist)
        lp, _, _ = shared_prefix_token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["token_mask"], dist)
    # bf16 rounds each matmul's output, in another order here than in the model's forward: their largest gap (~1e-3) is
    # also a float32 forward's from the bf16 one, so the mean decides (~2e-5 here, ~4e-4 for a forward run in float32)
    diff = (lp - own)[batch["attention_mask"].bool()].abs()
    assert diff.mean() < 1e-4 and diff.max() < 5e-3, (diff.mean(), diff.max())


def test_layout_by_hand():
    # Rows 0 and 1 share the prompt [7, 8, 9]; row 2 has another prompt; the last column of row 1 is padding.
    ids = torch.tensor([[7, 8, 9, 1, 2], [7, 8, 9, 3, 0], [7, 8, 4, 5, 6]])
    attention = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    token_mask = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 1, 0], [0, 0, 1, 1, 1]])
    prompt = prompt_lengths(token_mask, attention.sum(-1).tolist())
    assert prompt == [3, 3, 2]
    layout = flat_layout(ids, attention, prompt)
    assert layout.group.tolist() == [0, 0, 1] and layout.prompt_len == [3, 2] and layout.own_len == [2, 1, 3]
    assert layout.token_ids.tolist() == [7, 8, 9, 7, 8, 1, 2, 3, 4, 5, 6]
    assert layout.positions.tolist() == [0, 1, 2, 0, 1, 3, 4, 3, 2, 3, 4]
    # Scored: inside prompt 0 (targets 8, 9) and prompt 1 (target 8) once; then per row from its last prompt token on.
    assert layout.shared_heads == 3
    assert layout.head_target.tolist() == [8, 9, 8, 1, 2, 3, 4, 5, 6]
    assert layout.head_index.tolist() == [0, 1, 3, 2, 5, 2, 4, 8, 9]
    source = layout.out_source.view(3, 5).tolist()
    assert source == [[0, 1, 2, 4, 5], [0, 1, 2, 6, 0], [0, 3, 7, 8, 9]]


def test_blockers_name_what_the_forward_would_bypass():
    assert blockers(qwen2(), 1, False, False, True) == []
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=32))
    assert "not a supported Llama-family model" in blockers(gpt2, 1, False, False, True)[0]
    assert len(blockers(qwen2(), 2, True, True, True)) == 3
    assert blockers(qwen2(), 1, False, True, False) == []  # a logprob-only worker recomputes nothing
    dropout = qwen2()
    dropout.config.attention_dropout = 0.1
    assert "dropout" in blockers(dropout, 1, False, False, True)[0] and blockers(dropout, 1, False, False, False) == []


def make_worker(shared: str | bool) -> PolicyWorker:
    return PolicyWorker(
        rank=0, world_size=1, model_name=EMBEDDED_MODEL, precision="float32", temperature=1.0, num_threads=1, seed=0,
        loss_fn=ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0)), optimizer=OptimizerConfig(lr=1e-3),
        max_grad_norm=1.0, train_micro_batch_size=4, shared_prompt_forward=shared,
    )  # fmt: skip


def test_a_policy_update_with_shared_prompts_equals_the_models_own_forward():
    batch = grpo_like_batch()
    ids = batch["input_ids"] % 300 + 3  # the embedded model's vocabulary
    batch = {**batch, "input_ids": ids * batch["attention_mask"]}
    g = torch.Generator().manual_seed(1)
    rows, seq = ids.shape
    batch.update(
        sample_mask=torch.ones(rows),
        generation_logprobs=-torch.rand(rows, seq, generator=g) * batch["token_mask"],
        advantages=torch.randn(rows, 1, generator=g).expand(rows, seq) * batch["token_mask"],
        global_valid_toks=batch["token_mask"].sum(),
        global_valid_seqs=torch.tensor(float(rows)),
    )
    shared, own = make_worker("auto"), make_worker(False)
    assert shared.shared_forward and not own.shared_forward
    assert shared.describe_forward().startswith("shared-prompt: each group's prompt once")
    assert own.describe_forward() == "the model's own (policy.shared_prompt_forward=false)"
    r_shared, r_own = shared.train([batch]), own.train([batch])
    assert abs(r_shared["metrics"]["loss"] - r_own["metrics"]["loss"]) < 1e-6
    assert r_shared["forward_tokens"] < int(batch["attention_mask"].sum()) < r_own["forward_tokens"]  # padded rows
    assert abs(r_shared["grad_norms"][0] - r_own["grad_norms"][0]) < 1e-5
    # The gradients (kept after the step) agree to float summation order. (Not the weights: Adam's first step moves a
    # weight by ~lr * sign(gradient), and a gradient at rounding level may change sign.)
    for (name, a), (_, b) in zip(shared.model.named_parameters(), own.model.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_forcing_it_where_it_cannot_apply_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match="policy.shared_prompt_forward=true cannot apply: .*activation_checkpointing"):
        PolicyWorker(
            rank=0, world_size=1, model_name=EMBEDDED_MODEL, precision="float32", temperature=1.0, num_threads=1, seed=0,
            loss_fn=ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0)), optimizer=OptimizerConfig(lr=1e-3),
            dtensor_cfg={"activation_checkpointing": True}, shared_prompt_forward=True,
        )  # fmt: skip


def test_under_cpu_autocast_attention_runs_in_float32_forward_and_backward():
    """A ``policy.precision: bfloat16`` run trains under CPU autocast, which ran attention in bf16: on a CPU the slower
    kernel (its backward 3x float32's at the W2 shapes: ``benchmarks/cpu_attention.py``) and scores rounded to bf16.
    The written-out forwards attend in float32 there: exactly a float32 attention of the same queries, keys and values,
    and their gradients; a bf16 model (queries in bf16) attends as its own forward does."""
    import torch.nn.functional as F

    from nemo_like.models.attention import attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 6, 8, generator=g)  # rotated queries: float32 (the residual stream's dtype under autocast)
    k, v = (torch.randn(3, 2, 6, 8, generator=g).bfloat16() for _ in range(2))  # bf16: the outputs of autocast's linears
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None].expand(3, 1, 6, 6)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention(*leaves, mask, gqa=True)
        in_bf16 = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out.square().sum().backward()
    exact = [t.float().clone().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*exact, attn_mask=mask, enable_gqa=True)
    reference.square().sum().backward()
    assert out.dtype == torch.float32 and torch.equal(out, reference)
    assert all(torch.equal(a.grad, b.grad.to(a.dtype)) for a, b in zip(leaves, exact, strict=True))
    assert (in_bf16.float() - reference).abs().max() > 1e-3  # what autocast computed instead
    bf16 = [t.bfloat16() for t in (q, k, v)]
    assert torch.equal(attention(*bf16, mask, gqa=True), F.scaled_dot_product_attention(*bf16, attn_mask=mask, enable_gqa=True))


def test_a_loaded_models_own_forward_attends_as_the_written_out_forwards_under_cpu_autocast():
    """The written-out forwards attend in float32 under CPU autocast; the model's own forward (the fallback of the
    shared-prompt forward: activation checkpointing, ``shared_prompt_forward=false``; the reference beside a policy on
    it) attended in bf16, so two passes over the same weights disagreed (a step-0 KL ~13x the float rounding one). A
    model from ``load_causal_lm`` attends through the same float32 attention, with its padding masks."""
    from nemo_like.models.attention import IMPLEMENTATION
    from nemo_like.models.loading import load_causal_lm

    model = load_causal_lm(EMBEDDED_MODEL, "float32").eval()
    assert model.config._attn_implementation == IMPLEMENTATION
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (8, 30), generator=g)
    mask = torch.ones_like(ids)
    mask[4:, 25:] = 0
    token_mask = torch.zeros_like(ids)
    token_mask[:, 10:] = 1
    token_mask *= mask
    dist, trained = SamplingDistribution(), token_mask.bool()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        shared, _, _ = shared_prefix_token_logprobs(model, ids, mask, token_mask, dist)
        own, _ = sequence_logprobs_with_outside(model, ids, mask, dist)
    assert (shared - own)[trained].abs().max() < 1e-5  # was 0.13
    # the padding masks still apply (an attention name transformers has no mask for gets none): a left-padded row
    # scores its tokens as it does alone
    left_ids, left_mask = torch.zeros(2, 12, dtype=torch.long), torch.zeros(2, 12, dtype=torch.long)
    left_ids[0, 4:], left_mask[0, 4:] = ids[0, :8], 1
    left_ids[1], left_mask[1] = ids[1, :12], 1
    with torch.no_grad():
        padded, _ = sequence_logprobs_with_outside(model, left_ids, left_mask, dist)
        alone, _ = sequence_logprobs_with_outside(model, ids[:1, :8], torch.ones(1, 8, dtype=torch.long), dist)
    assert (padded[0, 5:] - alone[0, 1:]).abs().max() < 1e-5
