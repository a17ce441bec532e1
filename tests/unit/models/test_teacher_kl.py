"""The token-level KL term to a teacher: value and gradient of the chunked and unchunked functions against a plain
float64 full-vocabulary computation, for every support and direction, and its bounds."""

from __future__ import annotations

import itertools

import pytest
import torch

from nemo_like.models.teacher_kl import KLTerm, chunked_teacher_kl, teacher_kl_from_logits

N, H, V = 13, 8, 40  # 13 positions: chunks of 5 leave a 3-row tail
TERMS = [KLTerm(d, "full") for d in ("forward", "reverse")] + [
    KLTerm(d, s, 6) for d, s in itertools.product(("forward", "reverse"), ("teacher_top_k", "student_top_k"))
]


def reference_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, term: KLTerm) -> torch.Tensor:
    """Written out plainly: probabilities over the vocabulary, the support's top-k tokens and a tail of 1 - their mass."""
    ps, pt = student_logits.softmax(-1), teacher_logits.softmax(-1)
    if term.support != "full":
        source = teacher_logits if term.support == "teacher_top_k" else student_logits
        top = source.detach().topk(term.top_k, dim=-1).indices
        ps_k, pt_k = ps.gather(-1, top), pt.gather(-1, top)
        if term.top_k < ps.shape[-1]:
            ps_k = torch.cat([ps_k, 1 - ps_k.sum(-1, keepdim=True)], -1)
            pt_k = torch.cat([pt_k, 1 - pt_k.sum(-1, keepdim=True)], -1)
        ps, pt = ps_k, pt_k
    if term.direction == "forward":
        return (pt * (pt.log() - ps.log())).sum(-1)
    return (ps * (ps.log() - pt.log())).sum(-1)


def inputs(seed: int = 0, dtype: torch.dtype = torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=dtype)
    weight, bias = torch.randn(V, H, generator=g, dtype=dtype) * 0.7, torch.randn(V, generator=g, dtype=dtype)
    t_hidden, t_weight = torch.randn(N, H + 3, generator=g, dtype=dtype), torch.randn(V, H + 3, generator=g, dtype=dtype) * 0.7
    upstream = torch.rand(N, generator=g, dtype=dtype)  # per-token weights (a mask times the loss scale)
    return hidden, weight, bias, t_hidden, t_weight, upstream


def ours(term: KLTerm, chunk: int | None, hidden, weight, bias, t_hidden, t_weight, upstream):
    h, w, b = (x.clone().requires_grad_(True) for x in (hidden, weight, bias))
    if chunk is None:
        kl = teacher_kl_from_logits(torch.nn.functional.linear(h, w, b), t_hidden @ t_weight.T, term)
    else:
        kl = chunked_teacher_kl(h, w, b, t_hidden, t_weight, None, term, chunk)
    (kl * upstream).sum().backward()
    return kl.detach(), h.grad, w.grad, b.grad


def reference(term: KLTerm, hidden, weight, bias, t_hidden, t_weight, upstream):
    h, w, b = (x.clone().requires_grad_(True) for x in (hidden, weight, bias))
    kl = reference_kl(h @ w.T + b, t_hidden @ t_weight.T, term)
    (kl * upstream).sum().backward()
    return kl.detach(), h.grad, w.grad, b.grad


@pytest.mark.parametrize("term", TERMS, ids=lambda t: f"{t.support}-{t.direction}")
def test_value_and_gradient_match_a_float64_full_vocabulary_reference(term: KLTerm) -> None:
    args = inputs()
    expected = reference(term, *args)
    assert bool((expected[0] > 0).all())
    for chunk in (None, 1, 5, N, 64):  # unchunked, one row, uneven (13 = 5 + 5 + 3), exact, larger than the batch
        got = ours(term, chunk, *args)
        for name, a, b in zip(("value", "d hidden", "d weight", "d bias"), got, expected):
            assert (a - b).abs().max() < 1e-12, (chunk, name, float((a - b).abs().max()))  # float64 throughout
    # float32 inputs (the training dtype) stay close to the float64 reference too
    got32 = ours(term, 5, *(x.float() for x in args))
    for a, b in zip(got32, expected):
        assert (a.double() - b).abs().max() < 1e-5


def test_top_k_of_the_whole_vocabulary_is_the_full_kl_and_top_k_bounds_it() -> None:
    hidden, weight, bias, t_hidden, t_weight, upstream = inputs(1)
    s, t = hidden @ weight.T + bias, t_hidden @ t_weight.T
    for direction in ("forward", "reverse"):
        full = teacher_kl_from_logits(s, t, KLTerm(direction, "full"))
        for support in ("teacher_top_k", "student_top_k"):
            whole = teacher_kl_from_logits(s, t, KLTerm(direction, support, V))
            assert (whole - full).abs().max() < 1e-12
            for k in (1, 3, 20):
                part = teacher_kl_from_logits(s, t, KLTerm(direction, support, k))
                assert bool((part >= 0).all()) and bool((part <= full + 1e-12).all()), (direction, support, k)


@pytest.mark.parametrize("term", TERMS, ids=lambda t: f"{t.support}-{t.direction}")
def test_a_teacher_equal_to_the_student_gives_exactly_zero_value_and_gradient(term: KLTerm) -> None:
    hidden, weight, bias, _, _, upstream = (x.float() for x in inputs(2))
    for chunk in (None, 5):
        h, w, b = (x.clone().requires_grad_(True) for x in (hidden, weight, bias))
        if chunk is None:
            kl = teacher_kl_from_logits(torch.nn.functional.linear(h, w, b), torch.nn.functional.linear(hidden, weight, bias), term)
        else:
            kl = chunked_teacher_kl(h, w, b, hidden, weight, bias, term, chunk)
        (kl * upstream).sum().backward()
        assert bool((kl == 0).all())
        assert all(bool((g == 0).all()) for g in (h.grad, w.grad, b.grad)), chunk


# -- in the policy worker's training forward --------------------------------------------------------------------
TEACHER = "embedded:tiny-arith-teacher"


def kl_worker(
    teacher: str,
    term: KLTerm,
    chunk: int | None,
    mode: str = "fixed",
    weight: float = 0.5,
    precisions: tuple[str, str] = ("float32", "float32"),
):
    """A worker with the KL term to ``teacher``; ``precisions``: the policy's and the teacher's."""
    from unit.models.test_policy_worker import make_worker

    from nemo_like.models.policy.spec import TeacherKLSettings

    batching = {"mode": mode, "train_size": 4 if mode == "fixed" else 40, "logprob_size": 4 if mode == "fixed" else 40}
    policy_precision, teacher_precision = precisions
    settings = TeacherKLSettings(teacher, teacher_precision, weight, term)
    worker = make_worker(4, batching=batching, logprob_chunk_size=chunk, teacher_kl=settings, precision=policy_precision)
    for group in worker.optimizer.param_groups:
        group["weight_decay"] = 0.0  # a zero gradient must leave every weight as it is
    return worker


def policy_batch(advantages: bool = False) -> dict[str, torch.Tensor]:
    from unit.models.test_policy_worker import random_batch, with_global_counts

    batch = random_batch(6, 12, seed=3)
    batch["sample_mask"] = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])  # a masked row adds nothing
    if not advantages:
        batch["advantages"] = torch.zeros_like(batch["advantages"])
    return with_global_counts(batch)


def test_the_workers_kl_term_and_its_gradient_match_a_plain_computation_in_every_forward() -> None:
    from nemo_like.config.schema import EMBEDDED_MODEL
    from nemo_like.models.assets import embedded_model_path
    from nemo_like.models.loading import load_causal_lm

    term, weight = KLTerm("reverse", "teacher_top_k", 5), 0.5
    batch = policy_batch()
    # Plain: each row on its own, unpadded, both models' full logits, the float64 reference KL above.
    student, teacher = load_causal_lm(EMBEDDED_MODEL), load_causal_lm(embedded_model_path(TEACHER))
    total = torch.zeros((), dtype=torch.float64)
    for row in range(6):
        n = int(batch["attention_mask"][row].sum())
        ids = batch["input_ids"][row : row + 1, :n]
        with torch.no_grad():
            t_logits = teacher(input_ids=ids).logits[0, :-1].double()
        kl = reference_kl(student(input_ids=ids).logits[0, :-1].double(), t_logits, term)
        total = total + (kl * (batch["token_mask"][row, 1:n] * batch["sample_mask"][row])).sum()
    (weight * total / batch["global_valid_toks"]).backward()
    expected_grads = {name: p.grad for name, p in student.named_parameters()}
    expected_value = float(total.detach() / batch["global_valid_toks"])
    for chunk, mode in ((None, "fixed"), (7, "packed")):  # padded rows unchunked; packed into one row, chunks of 7
        worker = kl_worker(TEACHER, term, chunk, mode, weight)
        worker.model.train()
        worker.optimizer.zero_grad(set_to_none=False)
        fragments: list[dict[str, float]] = []
        worker._accumulate_gradients(batch, fragments, None)
        assert sum(f["distillation/kl_loss"] for f in fragments) == pytest.approx(expected_value, rel=1e-6), (chunk, mode)
        for name, p in worker.model.named_parameters():  # advantages are 0: the KL term is the only gradient
            error = float((p.grad.double() - expected_grads[name]).abs().max())
            assert error <= 1e-4 * float(expected_grads[name].abs().max()) + 1e-8, (chunk, mode, name)


@pytest.mark.parametrize("precisions", [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_packed_rows_give_the_kl_term_of_padded_rows_when_the_teacher_runs_at_another_precision(precisions) -> None:
    """A bf16 policy with an fp32 teacher crashed in packed training: the teacher got the packed attention mask in the
    policy's compute dtype, which SDPA refuses beside fp32 queries."""
    term, batch = KLTerm("reverse", "teacher_top_k", 5), policy_batch()
    values = {}
    for mode in ("fixed", "packed"):
        worker = kl_worker(TEACHER, term, None, mode, precisions=precisions)
        worker.model.train()
        fragments: list[dict[str, float]] = []
        worker._accumulate_gradients(batch, fragments, None)
        values[mode] = sum(f["distillation/kl_loss"] for f in fragments)
    assert values["packed"] == pytest.approx(values["fixed"], rel=2e-2)  # bf16 rounding apart


@pytest.mark.parametrize("chunk", [None, 7])
def test_a_teacher_equal_to_the_student_gives_a_zero_kl_term_and_changes_no_weight(chunk: int | None) -> None:
    from nemo_like.config.schema import EMBEDDED_MODEL

    worker = kl_worker(EMBEDDED_MODEL, KLTerm("reverse", "student_top_k", 5), chunk)
    before = {name: p.detach().clone() for name, p in worker.model.named_parameters()}
    result = worker.train([policy_batch()])
    assert result["metrics"]["distillation/kl_loss"] == 0.0 and result["grad_norms"] == [0.0]
    assert all(torch.equal(before[name], p) for name, p in worker.model.named_parameters())


@pytest.mark.parametrize("chunk", [None, 7])
def test_a_teacher_with_a_padded_vocabulary_is_compared_over_the_shared_rows(chunk: int | None, tmp_path) -> None:
    """One family pads its vocabulary to different sizes (Qwen2.5-0.5B: 151,936 rows, 7B: 152,064) and shares the
    tokenizer: the KL term failed mid-training with a shape error. Over the shared rows, the student itself with 25
    padding rows added is the student: the term is exactly 0 and changes no weight."""
    from nemo_like.config.schema import EMBEDDED_MODEL
    from nemo_like.models.loading import load_causal_lm, load_tokenizer

    padded = load_causal_lm(EMBEDDED_MODEL)
    vocab = padded.get_output_embeddings().weight.shape[0]
    padded.resize_token_embeddings(vocab + 25, mean_resizing=False)
    with torch.no_grad():
        padded.get_output_embeddings().weight[vocab:] = torch.randn(25, padded.config.hidden_size)  # mass on padding rows
    padded.save_pretrained(tmp_path)
    load_tokenizer(EMBEDDED_MODEL).save_pretrained(tmp_path)
    worker = kl_worker(str(tmp_path), KLTerm("forward", "full"), chunk)
    before = {name: p.detach().clone() for name, p in worker.model.named_parameters()}
    result = worker.train([policy_batch()])
    assert result["metrics"]["distillation/kl_loss"] == pytest.approx(0.0, abs=1e-6) and result["grad_norms"][0] < 1e-5
    assert all(torch.allclose(before[name], p, atol=1e-7) for name, p in worker.model.named_parameters())


def test_the_memory_planner_counts_the_teacher_copy_a_real_policy_worker_holds() -> None:
    from nemo_like.config import DEFAULT_RECIPE, load_config
    from nemo_like.config.schema import EMBEDDED_MODEL
    from nemo_like.models.footprint import model_footprint
    from nemo_like.plan.memory import plan_memory
    from nemo_like.plan.run_plan import decide_run_plan

    cfg = load_config(DEFAULT_RECIPE, [f"teacher.model_name={TEACHER}", "distillation.kl_weight=1"], warn=False)
    params, shape = model_footprint(EMBEDDED_MODEL, "float32")
    teacher = model_footprint(TEACHER, "float32")
    run_plan = decide_run_plan(cfg, (), 2)
    with_term = plan_memory(cfg, run_plan, params, shape, teachers={TEACHER: teacher}).roles[0]
    without = plan_memory(
        cfg.model_copy(update={"distillation": cfg.distillation.model_copy(update={"kl_weight": 0.0})}),
        run_plan,
        params,
        shape,
        teachers={TEACHER: teacher},
    ).roles[0]
    worker = kl_worker(TEACHER, KLTerm(), None)
    held = sum(p.numel() * p.element_size() for p in worker.teacher_model.parameters())
    assert with_term.params - without.params == held and with_term.activations > without.activations
    assert "teacher copy of the KL term" in with_term.line()
