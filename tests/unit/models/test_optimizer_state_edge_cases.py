"""The optimizer state at its edges, on the policy worker in-process (no Ray): a checkpoint saved, or resumed, before
AdamW's first update (every optimizer step so far skipped: empty or non-finite), and the gradient norms of a train call
with a skipped step.

torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` initialise an empty optimizer's state with a fake
lr-0 ``step()``: AdamW then held a step count of 1 and zero moments, so a save before the first update changed the
running optimizer (and recorded a step that never happened) and a resume of an empty state kept the fake step's state;
either way the first real update was bias-corrected as AdamW's second step, ~0.74x its size.
"""

from __future__ import annotations

import math
import socket

import pytest
import torch
from policy_batches import random_step_batch, with_global_counts

from nemo_like.algorithms.loss_functions import ClippedPGLossFn
from nemo_like.config.loss import ClippedPGLossConfig
from nemo_like.config.schema import EMBEDDED_MODEL, OptimizerConfig
from nemo_like.models.policy import sharding
from nemo_like.models.policy.checkpoints import OPTIMIZER_FILE
from nemo_like.models.policy.worker import PolicyWorker

SKIPPED = ("empty", "nonfinite")


def make_worker(**overrides) -> PolicyWorker:
    """A one-rank fp32 worker of the shipped model (``overrides``: other PolicyWorker keywords)."""
    options = dict(
        rank=0,
        world_size=1,
        model_name=EMBEDDED_MODEL,
        precision="float32",
        temperature=1.0,
        num_threads=1,
        seed=0,
        loss_fn=ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0)),
        max_grad_norm=None,
        train_micro_batch_size=3,
        optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.1),
    )
    options.update(overrides)
    return PolicyWorker(**options)


def step_batch(seed: int) -> dict[str, torch.Tensor]:
    """One optimizer step's rows (right-padded, a 4-token prompt) with their global counts."""
    return random_step_batch(seed, rows=6, seq=12, vocab=200)


def skipped_step(kind: str) -> dict[str, torch.Tensor]:
    """An optimizer step the worker skips: every row masked out (``empty``), or a NaN advantage (``nonfinite``)."""
    batch = step_batch(50)
    if kind == "empty":
        batch["sample_mask"] = torch.zeros_like(batch["sample_mask"])
        return with_global_counts(batch)
    batch["advantages"] = batch["advantages"].clone()
    batch["advantages"][0] = float("nan")
    return batch


def train_skipped(worker: PolicyWorker, kind: str) -> None:
    result = worker.train([skipped_step(kind)])
    assert result[f"{kind}_steps_skipped"] == 1
    assert not worker.optimizer.state  # no update has run: AdamW has no state yet


def saved_optimizer(directory) -> dict:
    return torch.load(directory / OPTIMIZER_FILE, map_location="cpu", weights_only=False)["optimizer"]


def assert_same_training_state(a: PolicyWorker, b: PolicyWorker) -> None:
    """Bitwise: weights, AdamW state (step counts and moments) and the schedule."""
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name].detach(), pb[name].detach()), name
        sa, sb = a.optimizer.state[pa[name]], b.optimizer.state[pb[name]]
        assert sa.keys() == sb.keys() and sa, name
        for key in sa:
            assert torch.equal(sa[key], sb[key]), (name, key)
    assert a.scheduler.last_epoch == b.scheduler.last_epoch
    assert a.optimizer.param_groups[0]["lr"] == b.optimizer.param_groups[0]["lr"]


def adam_steps(worker: PolicyWorker) -> set[float]:
    return {float(state["step"]) for state in worker.optimizer.state.values()}


@pytest.mark.parametrize("skipped", SKIPPED)
def test_a_save_before_the_first_update_leaves_the_running_optimizer_as_it_was(skipped, tmp_path) -> None:
    """(a) A skipped first step, a save, then real steps: bitwise the run that did not save. The save ran torch's fake
    lr-0 step on the live optimizer (empty first step): its first real update was AdamW's second, ~0.74x the size."""
    unsaved, saving = make_worker(), make_worker()
    for worker in (unsaved, saving):
        train_skipped(worker, skipped)
    grads = [p.grad for p in saving.model.parameters()]
    saving.save_checkpoint(str(tmp_path))
    assert not saving.optimizer.state
    assert all(p.grad is g for p, g in zip(saving.model.parameters(), grads))  # None, or the skipped step's own
    saved = saved_optimizer(tmp_path)
    assert saved["state"] == {}  # no step that never happened in the checkpoint
    assert len(saved["param_groups"]) == 1 and len(saved["param_groups"][0]["params"]) == len(grads)
    for seed in (1, 2):
        for worker in (unsaved, saving):
            worker.train([step_batch(seed)])
        assert adam_steps(saving) == {float(seed)}
        assert_same_training_state(unsaved, saving)


@pytest.mark.parametrize("into", ["fresh", "trained"])
@pytest.mark.parametrize("skipped", SKIPPED)
def test_a_checkpoint_saved_before_the_first_update_resumes_to_the_uninterrupted_run(skipped, into, tmp_path) -> None:
    """(b) A skipped first step, a save, a resume in another worker, real steps: bitwise the run never interrupted. The
    resume kept the state of the fake lr-0 step torch ran to initialise the empty optimizer (or, in a worker that had
    trained before loading, that worker's own state) where the checkpoint had none."""
    uninterrupted, first = make_worker(), make_worker()
    for worker in (uninterrupted, first):
        train_skipped(worker, skipped)
    first.save_checkpoint(str(tmp_path))
    resumed = make_worker()
    if into == "trained":  # e.g. a reused actor: its weights, moments and schedule all come from the checkpoint
        resumed.train([step_batch(7)])
        assert resumed.optimizer.state
    assert resumed.load_checkpoint(str(tmp_path), None) == first.weight_version
    assert not resumed.optimizer.state and resumed.scheduler.last_epoch == uninterrupted.scheduler.last_epoch
    for seed in (1, 2):
        for worker in (uninterrupted, resumed):
            worker.train([step_batch(seed)])
        assert adam_steps(resumed) == {float(seed)}
        assert_same_training_state(uninterrupted, resumed)


def test_a_checkpoint_after_an_update_still_saves_and_resumes_the_moments(tmp_path) -> None:
    """The usual case is unchanged: a save after an update records AdamW's state, and a resume replays bitwise."""
    first, uninterrupted = make_worker(), make_worker()
    for worker in (first, uninterrupted):
        worker.train([step_batch(1)])
    first.save_checkpoint(str(tmp_path))
    saved = saved_optimizer(tmp_path)
    assert len(saved["state"]) == len(list(first.model.parameters()))
    assert {float(s["step"]) for s in saved["state"].values()} == {1.0}
    resumed = make_worker()
    resumed.load_checkpoint(str(tmp_path), None)
    assert_same_training_state(uninterrupted, resumed)
    for worker in (uninterrupted, resumed):
        worker.train([step_batch(2)])
    assert_same_training_state(uninterrupted, resumed)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_fsdp2_rank_saves_and_resumes_before_the_first_update_without_a_step(tmp_path) -> None:
    """The DTensor path (one gloo rank, FSDP2-sharded parameters): an empty first step, a save, an update; the
    checkpoint resumed into the same worker replays that update bitwise, as AdamW's first step."""
    import torch.distributed as dist

    worker = make_worker(shared_prompt_forward=False)  # sharded ranks run the model's own forward (FSDP2's hooks)
    worker.setup_distributed("127.0.0.1", free_port())
    try:
        assert sharding.is_sharded(worker.model)
        train_skipped(worker, "empty")
        worker.save_checkpoint(str(tmp_path))
        assert not worker.optimizer.state and all(p.grad is None for p in worker.model.parameters())
        assert saved_optimizer(tmp_path)["state"] == {}
        worker.train([step_batch(1)])
        assert adam_steps(worker) == {1.0}
        _, after = worker.get_state_dict()
        worker.load_checkpoint(str(tmp_path), None)
        assert not worker.optimizer.state
        worker.train([step_batch(1)])
        assert adam_steps(worker) == {1.0}
        _, replayed = worker.get_state_dict()
        assert after.keys() == replayed.keys()
        for name in after:
            assert torch.equal(after[name], replayed[name]), name
    finally:
        dist.destroy_process_group()


def test_a_non_finite_step_leaves_the_grad_norms_of_the_steps_that_updated() -> None:
    """One non-finite (skipped) optimizer step among three: its NaN norm was reported with the others, and the logged
    train/grad_norm (their mean) was NaN for the whole call, which the guide reads as 'no optimizer step ran'. The
    skipped step is counted in nonfinite_steps_skipped; the norms are those of the steps that updated."""
    result = make_worker().train([step_batch(1), skipped_step("nonfinite"), step_batch(2)])
    alone = make_worker().train([step_batch(1), step_batch(2)])
    assert result["nonfinite_steps_skipped"] == 1 and alone["nonfinite_steps_skipped"] == 0
    assert len(result["grad_norms"]) == 2 and all(math.isfinite(g) and g > 0 for g in result["grad_norms"])
    assert result["grad_norms"] == alone["grad_norms"]
    only_nonfinite = make_worker().train([skipped_step("nonfinite")])
    assert only_nonfinite["nonfinite_steps_skipped"] == 1 and only_nonfinite["grad_norms"] == []  # train/grad_norm NaN


def test_a_parameter_that_never_had_a_gradient_resumes_without_a_state_and_another_models_state_is_refused() -> None:
    """A multimodal policy trained on text (Gemma 3's vision tower) saves no optimizer state for the parameters that
    never got a gradient: torch's strict load refused every such checkpoint ("Missing optimizer state"). They resume
    without one, as saved; a state whose groups do not list a trainable parameter is another model's, refused."""

    def model_and_optimizer(second: str = "unused") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 4), second: torch.nn.Linear(4, 4)})
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, optimizer = model_and_optimizer()
    model["used"](torch.ones(2, 4)).sum().backward()
    optimizer.step()
    state = sharding.gather_optimizer_state(model, optimizer)
    assert set(state["state"]) == {"used.weight", "used.bias"}
    fresh, fresh_optimizer = model_and_optimizer()
    sharding.load_optimizer_state(fresh, fresh_optimizer, state)
    moments = {name: fresh_optimizer.state[p].get("exp_avg") for name, p in fresh.named_parameters()}
    assert torch.equal(moments["used.weight"], state["state"]["used.weight"]["exp_avg"]) and moments["unused.weight"] is None
    other, other_optimizer = model_and_optimizer("renamed")
    with pytest.raises(RuntimeError, match=r"the saved optimizer state does not list 2 trainable parameters, e.g. \['renamed.weight'"):
        sharding.load_optimizer_state(other, other_optimizer, state)
    # such a checkpoint resumes where those parameters are now frozen (models.text_path): its groups list them, the
    # optimizer does not
    frozen, _ = model_and_optimizer()
    frozen["unused"].requires_grad_(False)
    frozen_optimizer = torch.optim.AdamW([p for p in frozen.parameters() if p.requires_grad], lr=1e-2)
    sharding.load_optimizer_state(frozen, frozen_optimizer, state)
    assert torch.equal(frozen_optimizer.state[frozen["used"].weight]["exp_avg"], state["state"]["used.weight"]["exp_avg"])
    assert len(frozen_optimizer.state) == 2 and sharding.gather_optimizer_state(frozen, frozen_optimizer)["param_groups"][0]["params"] == [
        "used.weight",
        "used.bias",
    ]
