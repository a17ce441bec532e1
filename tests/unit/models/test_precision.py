"""bf16 training keeps fp32 master weights; refits cast to the engine's dtype; collectives' backends; memory release.

The bf16 test fails on the old code (bf16 parameters and AdamW state): at the GPU recipes' learning rates most
updates rounded away (1.9% of the weights changed at lr 1e-6).
"""

import pytest
import torch
from unit.models.test_policy_worker import random_batch, with_global_counts

from nemo_like.algorithms.loss_functions import ClippedPGLossFn
from nemo_like.config.loss import ClippedPGLossConfig
from nemo_like.config.schema import EMBEDDED_MODEL, OptimizerConfig
from nemo_like.models import precision as precision_lib
from nemo_like.models.policy.worker import PolicyWorker


def make_worker(precision: str, lr: float = 5e-6, shared_prompt_forward: str | bool = "auto") -> PolicyWorker:
    return PolicyWorker(
        rank=0,
        world_size=1,
        model_name=EMBEDDED_MODEL,
        precision=precision,
        temperature=1.0,
        num_threads=1,
        seed=0,
        loss_fn=ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0)),
        optimizer=OptimizerConfig(lr=lr),
        max_grad_norm=None,
        train_micro_batch_size=6,
        shared_prompt_forward=shared_prompt_forward,
    )


def weights(worker: PolicyWorker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker.model.state_dict().items()}


def changed_share(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    changed = sum(int((after[k] != before[k]).sum()) for k in before)
    return changed / sum(t.numel() for t in before.values())


@pytest.mark.parametrize("lr", [1e-6, 5e-6])
def test_bf16_step_moves_the_weights_like_fp32(lr):
    """The GPU recipes' learning rates: a bf16 step must change about as many weights as an fp32 step (>= 90% of
    its share), land close to it, and keep fp32 parameters and optimizer state."""
    batch = with_global_counts(random_batch())
    runs = {}
    for precision in ("float32", "bfloat16"):
        worker = make_worker(precision, lr)
        before = weights(worker)
        result = worker.train([batch])
        after = weights(worker)
        runs[precision] = (before, after, result)
        assert all(p.dtype == torch.float32 for p in worker.model.parameters()), precision
        states = [v for st in worker.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
        assert states and all(v.dtype == torch.float32 for v in states), precision
    fp32_share = changed_share(*runs["float32"][:2])
    bf16_share = changed_share(*runs["bfloat16"][:2])
    assert fp32_share > 0.9
    assert bf16_share >= 0.9 * fp32_share, f"bf16 changed {bf16_share:.1%} of the weights, fp32 {fp32_share:.1%}"
    # Adam's first step is close to -lr * sign(g): weights whose gradient is ~0 may move the other way under bf16
    # rounding, so the updates are compared by direction, and the gradient norms by value.
    delta = {p: torch.cat([(runs[p][1][k] - runs[p][0][k]).flatten() for k in runs[p][0]]) for p in runs}
    assert float(torch.nn.functional.cosine_similarity(delta["bfloat16"], delta["float32"], dim=0)) > 0.98
    norm32, norm16 = runs["float32"][2]["grad_norms"][0], runs["bfloat16"][2]["grad_norms"][0]
    assert abs(norm16 - norm32) <= 2e-2 * norm32
    loss32, loss16 = runs["float32"][2]["metrics"]["loss"], runs["bfloat16"][2]["metrics"]["loss"]
    assert abs(loss16 - loss32) <= 1e-2 * max(abs(loss32), 1e-3)


@pytest.mark.parametrize("shared_prompt_forward", [True, False])
def test_bf16_logprobs_are_computed_in_bf16_and_close_to_fp32(shared_prompt_forward):
    """The compute really runs in bf16 (not silently fp32: the logprobs differ from fp32's) and stays close to it."""
    batch = random_batch()
    lp32 = make_worker("float32", shared_prompt_forward=shared_prompt_forward).get_logprobs(batch)
    lp16 = make_worker("bfloat16", shared_prompt_forward=shared_prompt_forward).get_logprobs(batch)
    mask = batch["token_mask"].bool()
    diff = (lp16 - lp32)[mask].abs()
    assert float(diff.max()) > 0, "bf16 logprobs equal fp32's bitwise: autocast is not on"
    # bf16 logits carry a relative rounding of ~2^-9 (as vLLM's bf16 logits do): a few 1e-2 on logits of ~10.
    assert float(diff.mean()) < 5e-2 and float(diff.max()) < 0.5


def test_refit_tensors_travel_in_the_engine_dtype():
    """Master weights are fp32; what a refit sends is the engine's dtype (bf16), values rounded from the masters."""
    worker = make_worker("bfloat16")
    buckets = dict(worker._refit_tensors("full", keep=True))
    state = worker.model.state_dict()
    assert set(buckets) == set(state)
    for name, tensor in buckets.items():
        assert tensor.dtype == torch.bfloat16, name
        torch.testing.assert_close(tensor, state[name].to(torch.bfloat16), atol=0, rtol=0)
    assert all(t.dtype == torch.bfloat16 for t in worker._engine_state().values())
    # Tied weights (the embedding and the LM head) stay one tensor after the cast: bf16 sent and counted them twice.
    assert worker.model.lm_head.weight is worker.model.model.embed_tokens.weight
    assert buckets["lm_head.weight"] is buckets["model.embed_tokens.weight"]
    engine = worker._engine_state()  # the CUDA-IPC and NCCL refits' source: a detach per name made two bf16 copies
    assert engine["lm_head.weight"] is engine["model.embed_tokens.weight"]
    fp32 = make_worker("float32")
    fp32_engine = fp32._engine_state()
    assert fp32_engine["lm_head.weight"] is fp32_engine["model.embed_tokens.weight"]
    shared = fp32.export_shared_weights(fresh=True)  # the one-node CPU refit (dp 1): the parameters into /dev/shm
    try:
        parameter_bytes = sum(p.numel() * p.element_size() for p in fp32.model.parameters())  # the tied one once
        assert shared.nbytes == parameter_bytes  # what performance/refit_bytes reports
        offsets = {e.name: e.offset for e in shared.entries}
        assert offsets["lm_head.weight"] == offsets["model.embed_tokens.weight"]
    finally:
        fp32.release_shared_weights()
    assert all(t.dtype == torch.float32 for _, t in fp32._refit_tensors("full", keep=True))


def test_process_group_backend_serves_cpu_tensors_on_gpu():
    """On GPUs the policy's group must have a backend for CPU tensors too (counters, checksums, offloaded shards):
    plain ``nccl`` fails every such collective with "No backend type associated with device type cpu"."""
    assert precision_lib.process_group_backend("cpu") == "gloo"
    spec = precision_lib.process_group_backend("cuda")
    backends = dict(part.split(":") for part in spec.split(","))
    assert backends == {"cpu": "gloo", "cuda": "nccl"}
    with pytest.raises(ValueError, match="device type 'xpu'"):
        precision_lib.process_group_backend("xpu")


def test_fsdp_mixed_precision_policy():
    assert precision_lib.fsdp_mixed_precision("float32") is None
    mp = precision_lib.fsdp_mixed_precision("bfloat16")
    assert mp.param_dtype == torch.bfloat16 and mp.reduce_dtype == torch.float32


def test_release_memory_frees_gradients_and_training_after_it_is_unchanged():
    """Releasing memory before a colocated engine wakes drops the gradients; the next update is bitwise the same."""
    batch = with_global_counts(random_batch())
    plain, released = make_worker("float32", lr=1e-3), make_worker("float32", lr=1e-3)
    for worker in (plain, released):
        worker.train([batch])
    report = released.release_memory()
    assert report["grads_freed"] > 0 and report["optimizer_offloaded"] == 0  # a CPU keeps its optimizer state
    assert all(p.grad is None for p in released.model.parameters())
    for worker in (plain, released):
        worker.train([batch])
    for (name, a), (_, b) in zip(plain.model.named_parameters(), released.model.named_parameters()):
        assert torch.equal(a, b), name


def test_chunked_heads_differentiate_in_the_forwards_autocast_dtype():
    """Autograd runs a custom function's backward outside the forward's ``torch.autocast``: the chunked logprob and
    teacher-KL heads recompute their logits there, so under bf16 they returned the fp32 function's gradient (an
    unchunked bf16 forward's differs by 9e-3 on these hidden states) and ran the LM head's backward in fp32. Each row's
    hidden-state gradient depends only on its own chunk, so it must equal the unchunked bf16 path's bitwise."""
    import torch.nn.functional as F

    from nemo_like.models.chunked_logprobs import ChunkedTokenLogprobs
    from nemo_like.models.processed_logprobs import SamplingDistribution, token_logprobs_from_logits
    from nemo_like.models.teacher_kl import KLTerm, chunked_teacher_kl, teacher_kl_from_logits

    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(64, 48, generator=gen), 0.3 * torch.randn(500, 48, generator=gen)
    t_hidden, t_weight = torch.randn(64, 48, generator=gen), 0.3 * torch.randn(500, 48, generator=gen)
    targets, upstream = torch.randint(0, 500, (64,), generator=gen), torch.randn(64, generator=gen)
    dist, term = SamplingDistribution(), KLTerm()
    heads = {
        "logprobs, unchunked": lambda h, w: token_logprobs_from_logits(F.linear(h, w), targets, dist)[0],
        "logprobs, chunked": lambda h, w: ChunkedTokenLogprobs.apply(h, w, None, targets, dist, 16)[0],
        "teacher KL, unchunked": lambda h, w: teacher_kl_from_logits(F.linear(h, w), F.linear(t_hidden, t_weight), term),
        "teacher KL, chunked": lambda h, w: chunked_teacher_kl(h, w, None, t_hidden, t_weight, None, term, 16),
    }

    def hidden_grad(head, dtype: torch.dtype | None) -> torch.Tensor:
        h = hidden.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):  # the forward only, as training
            out = head(h, weight.clone().requires_grad_())
        (out * upstream).sum().backward()
        return h.grad

    for name in ("logprobs", "teacher KL"):
        bf16 = hidden_grad(heads[f"{name}, unchunked"], torch.bfloat16)
        assert (bf16 - hidden_grad(heads[f"{name}, unchunked"], None)).abs().max() > 1e-3, name  # bf16 is visible
        torch.testing.assert_close(hidden_grad(heads[f"{name}, chunked"], torch.bfloat16), bf16, atol=0, rtol=0, msg=name)


def test_chunked_heads_add_up_a_bf16_weights_gradient_in_float32():
    """Under FSDP2's mixed precision the output head's weight in the forward is its bf16 copy: the chunked heads added
    each chunk's weight gradient into a bf16 sum, rounding it at every chunk (0.7 % off float64 at 32 chunks, 2 % at 512,
    against 0.2 % for one chunk). Summed in float32 and rounded once, any chunking is as close as one chunk."""
    from nemo_like.models.chunked_logprobs import ChunkedTokenLogprobs
    from nemo_like.models.processed_logprobs import SamplingDistribution
    from nemo_like.models.teacher_kl import KLTerm, chunked_teacher_kl

    gen = torch.Generator().manual_seed(0)
    rows, width, vocab = 4096, 64, 256
    hidden = torch.randn(rows, width, generator=gen).bfloat16()
    weight = (0.05 * torch.randn(vocab, width, generator=gen)).bfloat16()
    t_hidden, t_weight = torch.randn(rows, width, generator=gen).bfloat16(), (0.05 * torch.randn(vocab, width, generator=gen)).bfloat16()
    targets, upstream = torch.randint(0, vocab, (rows,), generator=gen), torch.randn(rows, generator=gen) / rows
    heads = {
        "logprobs": lambda h, w, chunk: ChunkedTokenLogprobs.apply(h, w, None, targets, SamplingDistribution(), chunk)[0],
        "teacher KL": lambda h, w, chunk: chunked_teacher_kl(h, w, None, t_hidden.to(h.dtype), t_weight.to(w.dtype), None, KLTerm(), chunk),
    }

    def weight_grad(head, dtype: torch.dtype, chunk: int) -> torch.Tensor:
        w = weight.to(dtype).clone().requires_grad_()
        (head(hidden.to(dtype), w, chunk) * upstream.to(dtype)).sum().backward()
        assert w.grad.dtype == dtype
        return w.grad.double()

    for name, head in heads.items():
        exact = weight_grad(head, torch.float64, rows)
        error = {chunk: float((weight_grad(head, torch.bfloat16, chunk) - exact).norm() / exact.norm()) for chunk in (rows, 16)}
        assert error[16] < 1.5 * error[rows], (name, error)
