"""Processed (top-k / top-p truncated, renormalised) logprobs: exact maths over the full vocabulary,
agreement with vLLM's and transformers' samplers, the out-of-set rule, gradients, memory-free chunking."""

import itertools
import math

import pytest
import torch

from nemo_like.algorithms.loss_functions import ClippedPGLossFn
from nemo_like.config.loss import ClippedPGLossConfig
from nemo_like.config.schema import OptimizerConfig
from nemo_like.models.logprobs import (
    SamplingDistribution,
    gather_token_logprobs,
    processed_token_logprobs,
    processed_token_logprobs_with_outside,
    sampling_keep_mask,
)
from nemo_like.models.processed_logprobs import token_logprobs_from_logits

# (temperature, top_k, top_p): each rule alone, combined, and the degenerate ends.
SETTINGS = [
    (1.0, None, 1.0),
    (0.7, None, 1.0),
    (1.0, 5, 1.0),
    (1.0, None, 0.8),
    (0.7, 20, 0.8),
    (1.3, 3, 0.5),
    (0.5, 1, 1.0),
    (1.0, None, 1e-6),  # keep-at-least-one: only the most likely token survives
    (1.0, 1000, 0.95),  # k > V: no top-k
]


def reference_distribution(z: list[float], temperature: float, top_k: int | None, top_p: float) -> list[float] | None:
    """The truncated renormalised distribution from its definition, in float64 and plain Python.

    Top-k keeps every token whose scaled logit is >= the k-th largest; top-p keeps a token when the
    probability mass (after top-k) of the tokens with a strictly larger logit is < p. Returns None
    when a group of equal logits straddles the nucleus boundary: there the engines split the group
    by sort order, which a definition by value cannot state (the engine tests cover it).
    """
    s = [x / temperature for x in z]
    keep = [True] * len(s)
    if top_k and top_k < len(s):
        kth = sorted(s, reverse=True)[top_k - 1]
        keep = [x >= kth for x in s]
    if top_p < 1.0:
        m = max(x for x, k in zip(s, keep) if k)
        w = [math.exp(x - m) if k else 0.0 for x, k in zip(s, keep)]
        total = sum(w)
        probs = [v / total for v in w]
        new_keep = []
        for i, x in enumerate(s):
            above = sum(p for p, y in zip(probs, s) if y > x)
            ties = sum(p for j, (p, y) in enumerate(zip(probs, s)) if y == x and j != i)
            if keep[i] and above < top_p <= above + ties:
                return None
            new_keep.append(keep[i] and (above < top_p or x == max(s)))
        keep = new_keep
    m = max(x for x, k in zip(s, keep) if k)
    w = [math.exp(x - m) if k else 0.0 for x, k in zip(s, keep)]
    total = sum(w)
    return [v / total for v in w]


def random_logits(batch: int, seq: int, vocab: int, seed: int, tie_step: float | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, seq, vocab, generator=g) * 3
    if tie_step is not None:  # quantised logits: many exact ties, including at the k-th value
        logits = torch.round(logits / tie_step) * tie_step
    return logits


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
@pytest.mark.parametrize("tie_step", [None, 0.5])
def test_processed_logprobs_equal_the_exact_truncated_distribution(temperature, top_k, top_p, tie_step):
    vocab = 40
    logits = random_logits(3, 7, vocab, seed=11, tie_step=tie_step)
    dist = SamplingDistribution(temperature, top_k, top_p)
    # Every token of the vocabulary at every position: the whole distribution, not a sample of it.
    every = logits.unsqueeze(2).expand(3, 7, vocab, vocab).reshape(3, 7 * vocab, vocab)
    targets = torch.arange(vocab).repeat(3, 7)
    full = processed_token_logprobs(every, targets, dist).view(3, 7, vocab).double()
    compared = 0
    for b, t in itertools.product(range(3), range(7)):
        ref = reference_distribution(logits[b, t].tolist(), temperature, top_k, top_p)
        if ref is None:  # a tie group split by the nucleus boundary: the engines' sort order decides
            scaled = logits[b, t : t + 1] / temperature
            assert torch.equal(torch.isfinite(full[b, t : t + 1]), torch.ones_like(scaled, dtype=torch.bool))
            if not top_k:  # transformers then sorts the same array as vLLM (the engine tests cover top-k too)
                ours = sampling_keep_mask(scaled, top_k, top_p)
                assert torch.equal(ours, engine_masks(scaled, top_k, top_p, with_vllm=False)["hf"])
            continue
        compared += 1
        kept = [p > 0 for p in ref]
        expected_kept = torch.tensor([math.log(p) for p, k in zip(ref, kept) if k], dtype=torch.float64)
        torch.testing.assert_close(full[b, t][torch.tensor(kept)], expected_kept, atol=2e-5, rtol=0)
        # Kept tokens form a distribution: their probabilities sum to one.
        assert abs(full[b, t][torch.tensor(kept)].exp().sum().item() - 1) < 1e-5
        # A dropped token is scored over kept set + itself: log(e^{z_x} / (e^{z_x} + sum_kept e^{z_j})).
        s = logits[b, t].double() / temperature
        for v in (i for i, k in enumerate(kept) if not k):
            expected = s[v] - torch.logsumexp(torch.cat([s[torch.tensor(kept)], s[v : v + 1]]), 0)
            assert abs(full[b, t, v].item() - expected.item()) < 2e-5
    assert compared >= 10  # nucleus-boundary ties are rare enough that most positions are checked
    if top_k is None and top_p == 1.0:
        plain = torch.log_softmax(logits.double() / temperature, -1)
        torch.testing.assert_close(full, plain, atol=2e-5, rtol=0)


def test_ties_at_the_kth_logit_are_all_kept():
    z = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    keep = sampling_keep_mask(z, top_k=2, top_p=1.0)
    assert keep.tolist() == [[True, True, True, True, False, False]]
    lp = processed_token_logprobs(z[None], torch.tensor([[1]]), SamplingDistribution(top_k=2))
    expected = 2.0 - torch.logsumexp(torch.tensor([3.0, 2.0, 2.0, 2.0]), 0)
    assert abs(lp.item() - expected.item()) < 1e-6


def test_top_p_keeps_the_smallest_set_reaching_p_and_at_least_one():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    z = probs.log()
    assert sampling_keep_mask(z, None, 0.5).tolist() == [[True, False, False, False]]  # 0.5 already reaches p
    assert sampling_keep_mask(z, None, 0.51).tolist() == [[True, True, False, False]]
    assert sampling_keep_mask(z, None, 0.81).tolist() == [[True, True, True, False]]
    assert sampling_keep_mask(z, None, 1e-9).tolist() == [[True, False, False, False]]
    assert sampling_keep_mask(z, 2, 0.7).tolist() == [[True, True, False, False]]  # top-p runs on top-k's survivors
    # Renormalised: with p = 0.51 the second token has probability 0.3 / 0.8.
    lp = processed_token_logprobs(z[None], torch.tensor([[1]]), SamplingDistribution(top_p=0.51))
    assert abs(lp.item() - math.log(0.3 / 0.8)) < 1e-6


def engine_masks(scaled: torch.Tensor, top_k: int | None, top_p: float, with_vllm: bool = True) -> dict[str, torch.Tensor]:
    """Kept-token masks of transformers' warpers and (when installed) vLLM's sampler on ``scaled`` logits."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    masks = {}
    hf = scaled.clone()
    if top_k:
        hf = TopKLogitsWarper(top_k)(None, hf)
    if top_p < 1.0:
        hf = TopPLogitsWarper(top_p)(None, hf)
    masks["hf"] = torch.isfinite(hf)
    if not with_vllm:
        return masks
    try:
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    except ImportError:
        return masks
    rows = scaled.shape[0]
    k = torch.full((rows,), min(top_k, scaled.shape[-1]), dtype=torch.int32) if top_k else None
    p = torch.full((rows,), top_p) if top_p < 1.0 else None
    masks["vllm"] = torch.isfinite(apply_top_k_top_p(scaled.clone(), k, p))
    return masks


@pytest.mark.parametrize("top_k,top_p", [(20, 1.0), (None, 0.8), (20, 0.8), (3, 0.5), (None, 1e-6), (1, 1.0), (7, 0.99)])
@pytest.mark.parametrize("tie_step", [None, 0.5, 2.0])
def test_kept_sets_match_vllm_and_transformers(top_k, top_p, tie_step):
    scaled = random_logits(1, 256, 64, seed=5, tie_step=tie_step)[0] / 0.7
    ours = sampling_keep_mask(scaled, top_k, top_p)
    masks = engine_masks(scaled, top_k, top_p)
    if "vllm" in masks:
        assert torch.equal(ours, masks["vllm"]), f"vllm: {(ours != masks['vllm']).sum().item()} tokens differ"
    hf = masks["hf"]
    if top_k and top_p < 1.0 and tie_step is not None:
        # A tie group split by the nucleus boundary: transformers sorts the top-k-masked array, so
        # other members of the group may survive. The kept *values* (so the normaliser) are the same.
        for row in (ours != hf).any(-1).nonzero()[:, 0]:
            assert sorted(scaled[row][ours[row]].tolist()) == sorted(scaled[row][hf[row]].tolist())
    else:
        assert torch.equal(ours, hf), f"transformers: {(ours != hf).sum().item()} tokens differ"
    assert ours.sum(-1).min() >= 1


def test_the_nucleus_boundary_is_vllms_in_float32():
    """The cutoff was Python's double 1 - 0.9 rounded to float32 after (0.10000000149), vLLM's 1 - p in float32
    (0.10000002384): a token whose mass fell in between was kept here and dropped by vLLM (its logprob -0.105 here, 0
    in vLLM's record). This row's small token has a mass of 0.10000001639 in float32."""
    import math

    rows = (torch.tensor([[math.log(0.1 / 0.9) + k * 1e-9, 0.0]], dtype=torch.float32) for k in range(2000))
    logits = next(r for r in rows if 0.10000000149011612 < r.softmax(-1)[0, 0].item() <= 0.10000002384185791)
    ours = sampling_keep_mask(logits, None, 0.9)
    assert ours.tolist() == [[False, True]]  # float32 1 - 0.9 = 0.10000002384: the small token's running sum is below it
    masks = engine_masks(logits, None, 0.9)
    if "vllm" in masks:
        assert torch.equal(ours, masks["vllm"])


def test_vllm_processed_logprobs_include_the_truncation():
    """vLLM's own sampler in processed_logprobs mode returns exactly our processed logprobs."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    current_platform.import_kernels()  # the CPU sampler's fused kernel, as the engine loads it
    logits = random_logits(1, 32, 64, seed=9)[0]
    temperature, top_k, top_p = 0.7, 20, 0.8
    sampler = TopKTopPSampler(logprobs_mode="processed_logprobs")
    k = torch.full((32,), top_k, dtype=torch.int32)
    p = torch.full((32,), top_p)
    sampled, vllm_logprobs = sampler(logits.clone() / temperature, {}, k, p)
    ours = processed_token_logprobs(logits[None], sampled[None], SamplingDistribution(temperature, top_k, top_p))[0]
    torch.testing.assert_close(vllm_logprobs.gather(-1, sampled[:, None])[:, 0], ours, atol=1e-6, rtol=0)
    plain = torch.log_softmax(logits / temperature, -1).gather(-1, sampled[:, None])[:, 0]
    assert (ours - plain).min() > 0  # -log(kept mass): renormalising raises every sampled token's logprob


def test_gradient_is_that_of_the_renormalised_logprob_and_finite_outside_the_set():
    temperature, dist = 0.7, SamplingDistribution(0.7, 5, 0.8)
    logits = random_logits(2, 6, 30, seed=3).requires_grad_(True)
    targets = torch.randint(0, 30, (2, 6), generator=torch.Generator().manual_seed(1))  # many outside the set
    lp, outside = processed_token_logprobs_with_outside(logits, targets, dist)
    assert outside.any() and (~outside).any()
    lp.sum().backward()
    assert torch.isfinite(lp).all() and torch.isfinite(logits.grad).all()
    # Analytic: d/dz_j [z_x/T - logsumexp_{S}(z/T)] = (1[j = x] - q_j) / T, q = softmax over S = kept + {x}.
    with torch.no_grad():
        scaled = logits / temperature
        keep = sampling_keep_mask(scaled, dist.top_k, dist.top_p)
        keep.scatter_(-1, targets[..., None], True)
        q = torch.softmax(scaled.masked_fill(~keep, float("-inf")), -1)
        expected = (torch.nn.functional.one_hot(targets, 30).float() - q) / temperature
    torch.testing.assert_close(logits.grad, expected, atol=1e-6, rtol=0)
    # Outside the set the value is the kept-set-plus-token logprob: finite, below log(1) and
    # lower than every kept token with a larger logit would get.
    assert (lp[outside] < 0).all()


def test_an_out_of_set_token_gives_finite_losses_and_gradients_in_training():
    """The policy worker trains on tokens its own sampler would never draw (as after an optimizer
    step): finite loss, finite gradients, and the fraction reported as outside_sampling_set_frac."""
    from nemo_like.config.schema import EMBEDDED_MODEL
    from nemo_like.models.policy.worker import PolicyWorker

    worker = PolicyWorker(
        rank=0,
        world_size=1,
        model_name=EMBEDDED_MODEL,
        precision="float32",
        temperature=0.7,
        num_threads=1,
        seed=0,
        loss_fn=ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0)),
        optimizer=OptimizerConfig(lr=1e-3),
        train_micro_batch_size=4,
        top_k=2,
        top_p=0.5,
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (4, 10), generator=g)  # random tokens: most are outside a top-2 / p=0.5 set
    mask = torch.ones(4, 10)
    token_mask = torch.zeros(4, 10)
    token_mask[:, 4:] = 1
    batch = {
        "input_ids": ids,
        "attention_mask": mask.long(),
        "token_mask": token_mask,
        "sample_mask": torch.ones(4),
        "generation_logprobs": torch.full((4, 10), -0.5) * token_mask,
        "advantages": torch.randn(4, 1, generator=g).expand(4, 10) * token_mask,
    }
    prev = worker.get_logprobs(batch)
    assert torch.isfinite(prev).all()
    batch["prev_logprobs"] = prev
    batch["global_valid_toks"] = token_mask.sum()
    batch["global_valid_seqs"] = torch.tensor(4.0)
    out = worker.train([batch])
    assert out["nonfinite_steps_skipped"] == 0 and math.isfinite(out["grad_norms"][0]) and out["grad_norms"][0] > 0
    assert math.isfinite(out["metrics"]["loss"])
    assert 0.5 < out["metrics"]["outside_sampling_set_frac"] <= 1.0


@pytest.mark.parametrize("dist", [SamplingDistribution(0.9, 4, 0.7), SamplingDistribution(1.3)])
def test_chunking_changes_neither_the_logprobs_nor_their_gradient(dist):
    """All rows in one call, one row per call (blocks of rows) and two positions per call (chunks within a row)."""
    base = random_logits(3, 9, 17, seed=2)
    targets = torch.randint(0, 17, (3, 9), generator=torch.Generator().manual_seed(5))
    weights = torch.rand(3, 9, generator=torch.Generator().manual_seed(6))
    results = []
    for chunk_elements in (1 << 24, 9 * 17, 17 * 2):
        logits = base.clone().requires_grad_(True)
        lp = processed_token_logprobs(logits[:, :-1], targets[:, 1:], dist, chunk_elements=chunk_elements)  # a sliced view
        (lp * weights[:, 1:]).sum().backward()
        results.append((lp.detach(), logits.grad))
    for lp, grad in results[1:]:
        torch.testing.assert_close(lp, results[0][0], atol=0, rtol=0)
        torch.testing.assert_close(grad, results[0][1], atol=0, rtol=0)


def test_gather_token_logprobs_shifts_and_defaults_to_the_tempered_softmax():
    logits = random_logits(2, 5, 11, seed=4)
    ids = torch.randint(0, 11, (2, 5))
    out = gather_token_logprobs(logits, ids, temperature=0.8)
    expected = torch.log_softmax(logits[:, :-1] / 0.8, -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert torch.all(out[:, 0] == 0)
    torch.testing.assert_close(out[:, 1:], expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kwargs", [{"temperature": 0.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}])
def test_bad_settings_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingDistribution(**kwargs)


# -- the HF generation worker and the policy worker agree on processed logprobs -----------------------

SAMPLING = {"temperature": 0.7, "top_k": 20, "top_p": 0.8}


@pytest.fixture(scope="module")
def hf_samples():
    """Responses sampled by a real HF generation worker (top-k 20, top-p 0.8, T 0.7) on the tiny model."""
    from nemo_like.config.schema import EMBEDDED_MODEL
    from nemo_like.models.generation.hf_worker import HFGenerationWorker
    from nemo_like.models.generation.interface import SamplingParams
    from nemo_like.models.loading import load_tokenizer

    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    never = tokenizer.convert_tokens_to_ids("<|im_start|>")  # a stop id the model does not emit: long responses
    worker = HFGenerationWorker(0, 1, EMBEDDED_MODEL, "float32", 1, tokenizer.pad_token_id, [never])
    prompts = [tokenizer(f"{a}+{b}=")["input_ids"] for a, b in [(12, 34), (7, 58), (90, 9), (3, 3)]] * 2
    params = SamplingParams(max_new_tokens=24, **SAMPLING).__dict__
    return tokenizer.pad_token_id, worker.generate(prompts, dict(params), seed=1)


def policy_logprobs_of(samples: list[dict], pad_id: int, **sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy worker's logprobs of ``samples`` (right-padded) and the generation logprobs, both ``[B, S]``."""
    from nemo_like.config.schema import EMBEDDED_MODEL
    from nemo_like.models.policy.worker import PolicyWorker

    worker = PolicyWorker(
        rank=0,
        world_size=1,
        model_name=EMBEDDED_MODEL,
        precision="float32",
        num_threads=1,
        seed=0,
        trainable=False,
        **sampling,
    )
    width = max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    ids = torch.full((len(samples), width), pad_id)
    attention = torch.zeros(len(samples), width, dtype=torch.long)
    gen = torch.zeros(len(samples), width)
    response = torch.zeros(len(samples), width, dtype=torch.bool)
    for i, s in enumerate(samples):
        p, r = len(s["prompt_ids"]), len(s["response_ids"])
        ids[i, : p + r] = torch.tensor(s["prompt_ids"] + s["response_ids"])
        attention[i, : p + r] = 1
        gen[i, p : p + r] = torch.tensor(s["response_logprobs"])
        response[i, p : p + r] = True
    lp = worker.get_logprobs({"input_ids": ids, "attention_mask": attention})
    return lp[response], gen[response]


def test_hf_generation_and_policy_logprobs_agree_under_truncation(hf_samples):
    pad_id, samples = hf_samples
    train, gen = policy_logprobs_of(samples, pad_id, **SAMPLING)
    assert train.numel() > 100
    assert (train - gen).abs().max() < 1e-4


def test_the_agreement_check_fails_when_the_trainer_ignores_the_truncation(hf_samples):
    """The check above can fail: a trainer scoring the full tempered softmax (the TRL bug) is far off."""
    pad_id, samples = hf_samples
    train, gen = policy_logprobs_of(samples, pad_id, temperature=SAMPLING["temperature"])
    gap = gen - train  # = -log(kept mass) >= 0 per token
    assert (gap > -1e-4).all()
    assert gap.abs().max() > 0.05 and gap.mean() > 1e-3
    print(f"untruncated trainer: max |gap| {gap.abs().max():.4f}, mean gap {gap.mean():.4f}, mean IS ratio {torch.exp(-gap).mean():.4f}")


def test_scaling_at_temperature_one_is_the_float32_logits_bit_for_bit_gradient_included() -> None:
    logits = (3 * torch.randn(4, 50, generator=torch.Generator().manual_seed(0))).requires_grad_()
    targets = torch.randint(0, 50, (4,), generator=torch.Generator().manual_seed(1))
    for temperature in (1.0, 0.7):
        dist = SamplingDistribution(temperature)
        scaled = dist.scale(logits)
        assert torch.equal(scaled, logits.float() / temperature)
        assert (scaled is logits) == (temperature == 1.0)  # no copy at temperature 1
        (grad,) = torch.autograd.grad(token_logprobs_from_logits(logits, targets, dist)[0].sum(), logits)
        divided = logits.float() / temperature
        expected_lp = divided.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(divided, dim=-1)
        (expected,) = torch.autograd.grad(expected_lp.sum(), logits)
        assert torch.equal(grad, expected)
    half = SamplingDistribution().scale(logits.detach().half())
    assert half.dtype == torch.float32
