"""In-flight weight updates: the gate's threading contract, and a real HF generation worker whose
weights are replaced mid-sequence (tokens before the swap keep the old weights' logprobs)."""

import threading
import time
from dataclasses import asdict

import pytest
import torch

from nemo_like.config.schema import EMBEDDED_MODEL
from nemo_like.models.generation.hf_worker import HFGenerationWorker
from nemo_like.models.generation.interface import SamplingParams
from nemo_like.models.loading import load_causal_lm, load_tokenizer
from nemo_like.models.refit.gate import WeightUpdateGate


def test_gate_applies_at_once_when_idle():
    gate = WeightUpdateGate()
    assert gate.submit(lambda: 7) == 7 and gate.mid_generation_updates == 0


class FakeClock:
    """``perf_counter`` for the gate, moved on by the updates themselves (no wall-clock time is asserted)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def load(self, seconds: float):
        def run() -> None:
            self.now += seconds

        return run


def test_gate_defers_an_update_to_the_next_step_boundary_and_returns_its_result(monkeypatch):
    from nemo_like.models.refit import gate as gate_module

    clock = FakeClock()
    monkeypatch.setattr(gate_module, "time", clock)
    gate = WeightUpdateGate()
    applied_at: list[int] = []
    result: dict[str, int] = {}
    step = {"n": 0}
    with gate.generating_scope():
        thread = threading.Thread(target=lambda: result.update(v=gate.submit(lambda: applied_at.append(step["n"]) or 3)))
        thread.start()
        while not gate.pending:
            time.sleep(0.001)
        assert not applied_at  # not applied while a "decoding step" runs
        step["n"] = 5
        assert gate.apply_pending() == 1
        thread.join(5)
    assert applied_at == [5] and result == {"v": 3} and gate.mid_generation_updates == 1
    # The load's time is counted apart (the collector takes it out of its generation seconds: it is not decoding);
    # an update applied as the call ends is not mid-sequence, but its load is inside the call's time too
    with gate.generating_scope():
        thread = threading.Thread(target=lambda: gate.submit(clock.load(0.2)))
        thread.start()
        while not gate.pending:
            time.sleep(0.001)
        assert gate.apply_pending() == 1
        thread.join(5)
    assert gate.mid_generation_seconds == 0.2 and gate.mid_generation_updates == 2
    seconds = gate.mid_generation_seconds
    with gate.generating_scope():
        thread = threading.Thread(target=lambda: gate.submit(clock.load(0.1)))
        thread.start()
        while not gate.pending:
            time.sleep(0.001)
    thread.join(5)
    assert gate.mid_generation_seconds == pytest.approx(seconds + 0.1) and gate.mid_generation_updates == 2
    gate.submit(clock.load(0.3))  # no call running: applied at once, outside any generate call's time
    assert gate.mid_generation_seconds == pytest.approx(seconds + 0.1)


def test_gate_hands_an_update_error_to_the_caller():
    gate = WeightUpdateGate()
    errors: list[BaseException] = []

    def submit():
        try:
            gate.submit(lambda: (_ for _ in ()).throw(RuntimeError("bad manifest")))
        except RuntimeError as exc:
            errors.append(exc)

    with gate.generating_scope():
        thread = threading.Thread(target=submit)
        thread.start()
        while not gate.pending:
            time.sleep(0.001)
    thread.join(5)  # leaving the scope applies what is pending
    assert [str(e) for e in errors] == ["bad manifest"]


def teacher_forced_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_only_a_failed_update_that_overwrites_in_place_holds_the_engine_unusable():
    """A LoRA adapter swap that fails serves the old adapter whole: it had been reported as a mix of two versions."""

    def fail() -> None:
        raise RuntimeError("could not load")

    gate = WeightUpdateGate()
    with pytest.raises(RuntimeError, match="could not load"):
        gate.submit(fail, 4, overwrites=False)
    gate.check_usable()
    with pytest.raises(RuntimeError, match="could not load"):
        gate.submit(fail, 5)
    with pytest.raises(RuntimeError, match=r"the refit to weight version 5 failed partway \(RuntimeError: could not load\)"):
        gate.check_usable()
    assert gate.submit(lambda: 6, 6) == 6 and gate.unusable is None  # a refit that succeeds clears it


def test_hf_worker_swaps_weights_mid_sequence():
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    never = tokenizer.convert_tokens_to_ids("<|im_start|>")  # a stop id the model does not emit: long responses
    worker = HFGenerationWorker(0, 1, EMBEDDED_MODEL, "float32", 1, tokenizer.pad_token_id, [never], max_batch_size=256)
    old_model = load_causal_lm(EMBEDDED_MODEL).eval()
    # Only the projections the fused decode step copies into fused matrices change: a swap that did not rebuild
    # those copies would go on sampling from the old weights.
    fused = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    new_state = {k: v + 0.05 * torch.randn_like(v) if any(f in k for f in fused) else v for k, v in old_model.state_dict().items()}
    prompt = tokenizer("12+34=")["input_ids"]
    outputs: list[dict] = []
    params = {**SamplingParams(max_new_tokens=48).__dict__}
    thread = threading.Thread(target=lambda: outputs.extend(worker.generate([prompt] * 256, params, seed=3)))
    thread.start()
    while not worker.gate.generating:
        time.sleep(0.001)
    time.sleep(0.05)
    assert worker.busy_with() == "a generate call"  # a kept actor is not re-initialised under it (worker_group)
    assert worker.update_weights((1, new_state)) == 1  # returns once applied, between two decoding steps
    thread.join(120)
    assert worker.busy_with() is None
    assert worker.mid_generation_updates() == 1 and len(outputs) == 256 and worker.mid_generation_seconds() > 0
    sample = outputs[0]
    assert sample["weight_version"] == 0 and sample["final_weight_version"] == 1
    old_lp = teacher_forced_logprobs(old_model, prompt, sample["response_ids"])
    recorded = torch.tensor(sample["response_logprobs"])
    matches_old = (recorded - old_lp).abs() < 1e-4
    swap = int((~matches_old).nonzero()[0]) if (~matches_old).any() else len(recorded)
    assert 0 < swap < len(recorded)  # the swap happened inside the sequence
    assert matches_old[:swap].all()  # every token before it: the old weights' logprobs
    assert (recorded[swap:] - old_lp[swap:]).abs().mean() > 1e-2  # after it: other weights produced them
    assert sample["weight_version_changes"] == ((swap, 1),)  # where the new weights began, as the logprobs show
    # A stop string cut before the swap keeps only the old weights' tokens: the sample was not refitted mid-sequence
    # (the cut kept the uncut sample's final version, 1, and the async refitted_mid_sequence_fraction counted it)
    from nemo_like.experience.multi_turn import apply_stop_strings, decode_exact
    from nemo_like.models.generation.interface import GeneratedSample

    uncut = GeneratedSample(**sample)
    for kept, version in ((swap, 0), (swap + 1, 1)):
        cut = apply_stop_strings(tokenizer, uncut, [decode_exact(tokenizer, uncut.response_ids[:kept])])
        assert len(cut.response_ids) == kept and cut.final_weight_version == version
        assert cut.refitted_mid_sequence is (version == 1)


def test_hf_worker_checks_a_refits_names_before_loading_any():
    """A refit missing a tensor (or naming one the model lacks) loaded the buckets before it and then failed, leaving the
    engine serving a mix of two versions at the old version number; now it loads nothing and names the keys."""
    from nemo_like.models.refit.manifest import RefitManifestError

    worker = HFGenerationWorker(0, 1, EMBEDDED_MODEL, "float32", 1, 0, [2])
    before = {k: v.clone() for k, v in worker.model.state_dict().items()}
    shifted = {k: v + 0.5 for k, v in before.items()}
    lacking = {k: v for k, v in shifted.items() if k != "model.norm.weight"}
    with pytest.raises(RefitManifestError, match=r"the HF engine's parameters: missing=\['model.norm.weight'\] extra=\[\]"):
        worker.update_weights((1, lacking))
    with pytest.raises(RefitManifestError, match=r"missing=\[\] extra=\['model.extra.weight'\]"):
        worker.update_weights((1, {**shifted, "model.extra.weight": torch.zeros(1)}))
    assert worker.weight_version == 0
    assert all(torch.equal(v, before[k]) for k, v in worker.model.state_dict().items())
    assert worker.update_weights((1, shifted)) == 1  # the whole state still loads
    # Right names, one tensor of another shape: the load copies the others before it fails. The engine had served that
    # mix as the old version; it now refuses to sample until a refit succeeds.
    params = SamplingParams(max_new_tokens=4)
    misshaped = {**{k: v + 1.0 for k, v in before.items()}, "model.norm.weight": torch.ones(before["model.norm.weight"].numel() + 1)}
    with pytest.raises(RuntimeError, match="size mismatch for model.norm.weight"):
        worker.update_weights((2, misshaped))
    with pytest.raises(RuntimeError, match=r"the refit to weight version 2 failed partway \(RuntimeError: .*a mix of two versions"):
        worker.generate([[5, 6, 7]], asdict(params), 0)
    assert worker.update_weights((3, shifted)) == 3 and len(worker.generate([[5, 6, 7]], asdict(params), 0)) == 1


def test_gate_counts_a_call_queued_behind_another_as_busy_and_forgets_one_that_raised():
    """Only a running call (``generating``) counted: a kept actor's call queued behind the last run's running one, or
    in its first lines, looked idle, and the next run's re-initialisation could run under it."""
    gate = WeightUpdateGate()
    gate.generate_lock.acquire()  # another call holds the engine

    def queued_call() -> None:
        with gate.generating_scope():
            pass

    queued = threading.Thread(target=queued_call)
    queued.start()
    deadline = time.monotonic() + 10
    while gate.calls == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not gate.generating and gate.busy_with() == "a generate call"  # waiting for the lock, already busy
    gate.generate_lock.release()
    queued.join(10)
    assert gate.busy_with() is None
    with pytest.raises(ValueError), gate.generating_scope():
        raise ValueError("engine error")
    assert gate.busy_with() is None and gate.calls == 0  # a call that raised is over too
