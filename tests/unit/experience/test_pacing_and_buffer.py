"""The staleness pacer and the replay buffer: ages never exceed the bound, nothing finished is
dropped, groups come out FIFO by target step; plus a randomised simulation of collector and trainer."""

import random

import pytest

from nemo_like.data.prompts import PromptRecord
from nemo_like.experience.pacing import StalenessPacer
from nemo_like.experience.replay_buffer import (
    ReplayBuffer,
    ReplayBufferError,
    TrajectoryGroup,
    trajectory_ages,
)
from nemo_like.models.generation.interface import GeneratedSample


def group(target: int, version: int, prompt_id: int = 0, size: int = 2, final_version: int | None = None) -> TrajectoryGroup:
    samples = [GeneratedSample([1, 2], [3], [-0.5], False, version, final_version) for _ in range(size)]
    record = PromptRecord(prompt_id, [], [1, 2], {})
    return TrajectoryGroup(target, record, samples, ["x"] * size, [1.0] * size)


# -- pacer -----------------------------------------------------------------------------------------------
def test_pacer_hands_out_steps_in_order_up_to_the_bound():
    pacer = StalenessPacer(max_age=1, last_step=10)
    assert [pacer.reserve(0), pacer.reserve(0)] == [1, 2]  # step 1 at age 0, step 2 at age 1
    assert pacer.reserve(0) is None  # step 3 would train weights v2 on v0 samples: age 2 > 1
    assert pacer.reserve(1) == 3 and pacer.reserve(1) is None
    assert pacer.reserve(5) == 4  # newer weights never make a sample too old


def test_pacer_with_age_zero_is_the_sync_schedule():
    pacer = StalenessPacer(max_age=0, last_step=3)
    assert pacer.reserve(0) == 1 and pacer.reserve(0) is None
    assert pacer.reserve(1) == 2 and pacer.reserve(2) == 3
    assert pacer.done and pacer.reserve(99) is None  # every step served: nothing more is generated


def test_pacer_state_round_trips_and_rejects_a_negative_bound():
    pacer = StalenessPacer(max_age=2, last_step=9)
    for _ in range(3):
        pacer.reserve(0)
    restored = StalenessPacer(max_age=2, last_step=9)
    restored.load_state_dict(pacer.state_dict())
    assert restored.next_target == 4 and restored.reserve(1) == 4
    with pytest.raises(ValueError, match="max_age"):
        StalenessPacer(max_age=-1, last_step=3)


# -- buffer ----------------------------------------------------------------------------------------------
def test_buffer_returns_a_step_only_when_complete_and_in_arrival_order():
    buffer = ReplayBuffer(groups_per_step=2, max_age=1)
    buffer.push([group(1, 0, prompt_id=10)])
    assert not buffer.ready(1)
    buffer.push([group(1, 0, prompt_id=11), group(2, 0, prompt_id=20), group(2, 0, prompt_id=21)])
    assert buffer.ready(1) and buffer.ready(2)
    assert [g.prompt.id for g in buffer.take(1, trainer_version=0)] == [10, 11]
    assert len(buffer) == 2  # step 2's groups stay
    assert [g.prompt.id for g in buffer.take(2, trainer_version=1)] == [20, 21]


def test_buffer_refuses_samples_older_than_the_bound():
    buffer = ReplayBuffer(groups_per_step=1, max_age=1)
    buffer.push([group(3, 0)])
    with pytest.raises(ReplayBufferError, match="ages 2..2, outside 0..1"):
        buffer.take(3, trainer_version=2)


def test_buffer_refuses_samples_from_weights_newer_than_the_trainer():
    buffer = ReplayBuffer(groups_per_step=1, max_age=1)
    buffer.push([group(1, 3)])
    with pytest.raises(ReplayBufferError, match="outside"):
        buffer.take(1, trainer_version=0)


def test_buffer_never_silently_skips_a_step():
    buffer = ReplayBuffer(groups_per_step=1, max_age=5)
    buffer.push([group(1, 0), group(2, 0)])
    with pytest.raises(ReplayBufferError, match=r"earlier steps \[1\]"):
        buffer.take(2, trainer_version=1)  # step 1's finished group would be dropped


def test_buffer_is_fifo_by_target_step():
    buffer = ReplayBuffer(groups_per_step=1, max_age=5)
    buffer.push([group(2, 0)])
    with pytest.raises(ReplayBufferError, match="FIFO"):
        buffer.push([group(1, 0)])
    buffer = ReplayBuffer(groups_per_step=1, max_age=5)
    buffer.push([group(1, 0)])
    buffer.take(1, trainer_version=0)
    with pytest.raises(ReplayBufferError, match="last taken: 1"):
        buffer.push([group(1, 0)])  # a step that was already trained


def test_buffer_state_round_trips():
    buffer = ReplayBuffer(groups_per_step=1, max_age=1)
    buffer.push([group(1, 0), group(2, 0, prompt_id=7)])
    buffer.take(1, trainer_version=0)
    restored = ReplayBuffer(groups_per_step=1, max_age=1)
    restored.load_state_dict(buffer.state_dict())
    assert restored.last_taken_step == 1 and [g.prompt.id for g in restored.take(2, trainer_version=1)] == [7]


def test_a_kept_buffer_is_busy_while_a_take_waits_and_its_finish_releases_it():
    """A take the last run left waiting (the trainer stopped mid-wait) would wait on in a kept actor re-initialised
    under it: the buffer says it is busy until the run's end (``finish``) releases the take."""
    import threading
    import time

    from nemo_like.data.prompts import DataExhausted
    from nemo_like.experience.replay_buffer import ReplayBufferActor

    actor, raised = ReplayBufferActor(0, 1, groups_per_step=1, max_age=1), []
    assert actor.busy_with() is None

    def take() -> None:
        try:
            actor.take(1, trainer_version=0)
        except DataExhausted as exc:
            raised.append(exc)

    waiting = threading.Thread(target=take)
    waiting.start()
    for _ in range(500):  # until the take waits (5 s at most)
        if actor.busy_with() is not None:
            break
        time.sleep(0.01)
    assert actor.busy_with() == "take"
    actor.finish("the run ended")
    waiting.join(timeout=10)
    assert not waiting.is_alive() and actor.busy_with() is None and "the run ended" in str(raised[0])


def test_ages_use_the_oldest_weights_of_an_in_flight_refitted_sample():
    g = group(4, version=2, final_version=3)
    assert g.generation_version == 2 and g.samples[0].refitted_mid_sequence
    assert trajectory_ages([g], trainer_version=3) == [1, 1]


# -- collector and trainer, simulated ---------------------------------------------------------------------
@pytest.mark.parametrize("max_age", [0, 1, 2, 4])
@pytest.mark.parametrize("seed", range(5))
def test_simulated_collector_and_trainer_keep_the_bound_and_drop_nothing(max_age, seed):
    """Random generation and training speeds (generation lengths vary 10x, as long hard samples do).
    Every started batch is consumed at its target step, every step trains, and no age exceeds the bound."""
    rng = random.Random(seed)
    steps, groups_per_step = 30, 3
    pacer = StalenessPacer(max_age, steps)
    buffer = ReplayBuffer(groups_per_step, max_age)
    clock, trainer_free_at, gen_free_at = 0.0, 0.0, 0.0
    generation_version, trainer_step, started, pushed = 0, 1, 0, 0
    in_flight: tuple[float, int, int] | None = None  # (finish time, target, start version)
    refit_to: int | None = None  # the version generation gets when the current update finishes
    seen_ages: list[int] = []
    while trainer_step <= steps:
        if refit_to is not None and clock >= trainer_free_at:
            generation_version, refit_to = refit_to, None
        if in_flight is None and clock >= gen_free_at:
            target = pacer.reserve(generation_version)
            if target is not None:
                in_flight = (clock + rng.uniform(0.1, 1.0), target, generation_version)
                started += 1
        if in_flight is not None and clock >= in_flight[0]:
            _, target, version = in_flight
            buffer.push([group(target, version, prompt_id=target * 10 + i) for i in range(groups_per_step)])
            pushed += 1
            in_flight = None
        if clock >= trainer_free_at and refit_to is None and buffer.ready(trainer_step):
            taken = buffer.take(trainer_step, trainer_version=trainer_step - 1)
            assert [g.prompt.id for g in taken] == [trainer_step * 10 + i for i in range(groups_per_step)]
            seen_ages += trajectory_ages(taken, trainer_step - 1)
            trainer_free_at = clock + rng.uniform(0.05, 0.8)
            refit_to = trainer_step  # the update of this step, pushed to generation when it ends
            trainer_step += 1
        clock += 0.01
    assert started == pushed == steps and len(buffer) == 0
    assert max(seen_ages) <= max_age
    if max_age > 0:
        assert max(seen_ages) >= 1  # the collector really ran ahead
