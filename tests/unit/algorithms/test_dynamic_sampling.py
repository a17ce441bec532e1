"""DAPO dynamic sampling (group selection, accumulator) and overlong reward shaping."""

from __future__ import annotations

import pytest
import torch

from nemo_like.algorithms.dynamic_sampling import (
    DynamicSamplingAccumulator,
    apply_overlong_reward_shaping,
    select_groups_with_signal,
)

T = torch.tensor


def test_select_groups_with_signal():
    prompt_ids = T([0, 0, 1, 1, 2, 2, 3, 3, 3])
    rewards = T([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    valid = T([1, 1, 1, 1, 1, 1, 1, 0, 0])
    # Group 0 differs -> kept; 1 and 2 are constant; 3 has a single valid sample (the 0s are masked).
    keep = select_groups_with_signal(rewards, prompt_ids, valid)
    assert keep.tolist() == [True, True, False, False, False, False, False, False, False]


def make_batch(prompt_ids: list[int], rewards: list[float], seq_len: int = 3, tag: str = "") -> dict:
    n = len(prompt_ids)
    return {
        "prompt_ids": T(prompt_ids),
        "rewards": T(rewards),
        "input_ids": torch.arange(n * seq_len).reshape(n, seq_len),
        "text": [f"{tag}{i}" for i in range(n)],
    }


def add_batch(acc: DynamicSamplingAccumulator, batch: dict) -> None:
    keep = select_groups_with_signal(batch["rewards"], batch["prompt_ids"], torch.ones(len(batch["text"])))
    acc.add(batch, keep)


def test_accumulator_fills_fifo_with_whole_groups():
    acc = DynamicSamplingAccumulator(num_prompts_needed=3, max_gen_batches=4)
    # Batch a: groups 5 (rows 0, 2: rewards 1, 0 -> kept), 3 (rows 1, 3: 1, 1 -> dropped),
    # 8 (rows 4, 5: 0, 1 -> kept). Interleaved rows come out group-contiguous, 5 before 8.
    add_batch(acc, make_batch([5, 3, 5, 3, 8, 8], [1, 1, 0, 1, 0, 1], tag="a"))
    assert not acc.is_full and acc.num_kept_groups == 2
    # Batch b: group 1 (rows 0, 1: kept), group 2 (rows 2, 3: kept, surplus), group 4 (constant).
    add_batch(acc, make_batch([1, 1, 2, 2, 4, 4], [0, 1, 1, 0, 0, 0], tag="b"))
    assert acc.is_full

    batch, metrics = acc.take()
    assert batch["text"] == ["a0", "a2", "a4", "a5", "b0", "b1"]
    assert batch["prompt_ids"].tolist() == [5, 5, 8, 8, 1, 1]
    assert batch["rewards"].tolist() == [1, 0, 0, 1, 0, 1]
    assert batch["input_ids"][:, 0].tolist() == [0, 6, 12, 15, 0, 3]
    assert metrics == {
        "dynamic_sampling/num_gen_batches": 2.0,
        "dynamic_sampling/num_discarded_groups": 2.0,
        "dynamic_sampling/num_kept_groups": 4.0,
        "dynamic_sampling/num_surplus_groups": 1.0,
    }
    # A new round starts from zero.
    assert not acc.is_full and acc.metrics()["dynamic_sampling/num_gen_batches"] == 0.0


def test_accumulator_full_on_first_batch_takes_exactly_needed():
    acc = DynamicSamplingAccumulator(num_prompts_needed=1, max_gen_batches=1)
    add_batch(acc, make_batch([0, 0, 1, 1], [0, 1, 1, 0]))
    batch, metrics = acc.take()
    assert batch["text"] == ["0", "1"]
    assert metrics["dynamic_sampling/num_surplus_groups"] == 1.0


def test_accumulator_raises_past_max_gen_batches():
    acc = DynamicSamplingAccumulator(num_prompts_needed=2, max_gen_batches=2)
    add_batch(acc, make_batch([0, 0, 1, 1], [0, 1, 1, 1]))  # 1 kept, 1 discarded
    with pytest.raises(
        RuntimeError,
        match=r"1/2 prompt groups.*2 generation batch\(es\).*"
        r"grpo\.dynamic_sampling_max_gen_batches=2.*3 groups were discarded",
    ):
        add_batch(acc, make_batch([0, 0, 1, 1], [0, 0, 1, 1]))


def test_accumulator_filling_on_last_allowed_batch_is_fine():
    acc = DynamicSamplingAccumulator(num_prompts_needed=2, max_gen_batches=2)
    add_batch(acc, make_batch([0, 0], [1, 1]))
    add_batch(acc, make_batch([0, 0, 1, 1], [0, 1, 1, 0]))
    assert acc.take()[0]["text"] == ["0", "1", "2", "3"]


def test_accumulator_unlimited_and_take_before_full():
    acc = DynamicSamplingAccumulator(num_prompts_needed=1, max_gen_batches=None)
    for _ in range(20):
        add_batch(acc, make_batch([0, 0], [1, 1]))
    with pytest.raises(RuntimeError, match="0/1"):
        acc.take()


def test_accumulator_rejects_split_groups_and_bad_lengths():
    acc = DynamicSamplingAccumulator(num_prompts_needed=1)
    with pytest.raises(ValueError, match="whole prompt groups"):
        acc.add({"i": torch.arange(2)}, T([True, False]), T([0, 0]))
    with pytest.raises(ValueError, match="'i' has 3 rows"):
        acc.add({"i": torch.arange(3)}, T([True, True]), T([0, 0]))


def test_accumulator_pads_sequence_dim_when_told():
    acc = DynamicSamplingAccumulator(num_prompts_needed=2, pad_values={"input_ids": -1})
    add_batch(acc, make_batch([0, 0], [0, 1], seq_len=2))
    add_batch(acc, make_batch([0, 0], [0, 1], seq_len=3))
    batch, _ = acc.take()
    assert batch["input_ids"].tolist() == [[0, 1, -1], [2, 3, -1], [0, 1, 2], [3, 4, 5]]

    acc = DynamicSamplingAccumulator(num_prompts_needed=2)
    add_batch(acc, make_batch([0, 0], [0, 1], seq_len=2))
    add_batch(acc, make_batch([0, 0], [0, 1], seq_len=3))
    with pytest.raises(ValueError, match="'input_ids'.*pad_values"):
        acc.take()


def test_accumulator_with_index_payload_and_prompt_rows():
    # Payload of indices only; groups defined by [B, L] prompt rows passed separately.
    rows = T([[7, 7], [1, 2], [7, 7], [1, 2]])
    acc = DynamicSamplingAccumulator(num_prompts_needed=1)
    acc.add({"index": torch.arange(4)}, T([False, True, False, True]), rows)
    assert acc.take()[0]["index"].tolist() == [1, 3]


def test_overlong_reward_shaping_values():
    # L_max 20, buffer 4 -> penalty starts after 16 tokens: -(len - 16) / 4 * 1, clamped to [-1, 0].
    lengths = T([10, 16, 17, 18, 20, 25])
    rewards = T([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    shaped = apply_overlong_reward_shaping(rewards, lengths, 20, 4, 1.0)
    torch.testing.assert_close(shaped, T([1.0, 1.0, 0.75, -0.5, 0.0, -1.0]))
    # Penalty 0.5 halves it: len 18 -> -0.25.
    assert apply_overlong_reward_shaping(T([0.0]), T([18]), 20, 4, 0.5).item() == pytest.approx(-0.25)


@pytest.mark.parametrize("buffer, penalty", [(0, 1.0), (30, 1.0), (4, -1.0)])
def test_overlong_reward_shaping_rejects_bad_config(buffer: int, penalty: float):
    with pytest.raises(ValueError, match="grpo.reward_shaping"):
        apply_overlong_reward_shaping(T([0.0]), T([5]), 20, buffer, penalty)


def test_dynamic_sampling_filters_on_the_raw_reward_then_shapes():
    """DAPO order, through the function the loop runs per generation batch: a group whose raw rewards
    are all 0 has no signal, even when overlong shaping would give its responses different rewards."""
    from pathlib import Path

    from nemo_like.algorithms.grpo import filter_then_shape
    from nemo_like.config import load_config

    recipe = Path(__file__).resolve().parents[3] / "examples" / "configs" / "grpo_tiny_cpu.yaml"
    cfg = load_config(
        recipe,
        [
            "grpo.use_dynamic_sampling=true",
            "grpo.reward_shaping.enabled=true",
            # L_max 30, buffer 10: no penalty up to 20 tokens, -0.2 at 22, -1 at 30.
            "grpo.reward_shaping.max_response_length=30",
            "grpo.reward_shaping.overlong_buffer_length=10",
        ],
    )
    raw = T([0.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    lengths = T([10.0, 22.0, 30.0, 10.0, 20.0, 10.0])
    group_ids = T([0, 0, 0, 1, 1, 1])
    rewards, keep = filter_then_shape(cfg, raw, lengths, group_ids)
    assert keep.tolist() == [False, False, False, True, True, True]
    torch.testing.assert_close(rewards, T([0.0, -0.2, -1.0, 1.0, 0.0, 1.0]))  # shaped, for the kept groups' advantages

    acc = DynamicSamplingAccumulator(num_prompts_needed=1, max_gen_batches=1)
    acc.add({"rewards": rewards, "group_ids": group_ids}, keep, prompt_ids=group_ids)
    batch, metrics = acc.take()
    assert batch["group_ids"].tolist() == [1, 1, 1] and batch["rewards"].tolist() == [1.0, 0.0, 1.0]
    assert metrics["dynamic_sampling/num_discarded_groups"] == 1.0

    no_sampling = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"use_dynamic_sampling": False})})
    rewards, keep = filter_then_shape(no_sampling, raw, lengths, group_ids)
    assert keep is None and rewards[2].item() == -1.0  # shaping alone still applies


def test_agent_rows_keep_their_sessions_through_refills_and_per_session_counters_average(monkeypatch) -> None:
    """Agent tasks with dynamic sampling: the kept rows lost their sessions (advantages then weighed a branched
    session's three rows as three samples: 0.5 / -1.5 instead of 0.707 / -0.707), and the per-session means were summed
    over the generation batches. Generation stands in as a batch of fixed agent rows: 2 prompts x 2 sessions, prompt 0's
    first session branched into 3 rows; the first batch has no signal, the refill has."""
    from types import SimpleNamespace

    import nemo_like.algorithms.grpo as grpo
    from nemo_like.config.schema import MasterConfig
    from nemo_like.data.prompts import PromptDataLoader, PromptRecord
    from nemo_like.experience.rollouts import Rollout
    from nemo_like.models.generation.interface import GeneratedSample
    from nemo_like.utils.timer import StepTimer

    batches = iter([[0.0] * 6, [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]])

    def agent_batch(*args, **kwargs) -> Rollout:
        groups, owners = [0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 2, 3]
        prompts = [PromptRecord(f"p{g}", [], [1], {"task_name": "agent"}) for g in groups]
        samples = [GeneratedSample([1], [2], [0.0], False, 0) for _ in owners]
        counters = {"agent/sessions": 4.0, "agent/rows_per_session": 1.5}
        return Rollout(
            prompts, torch.tensor(groups), samples, ["x"] * 6, torch.tensor(next(batches)), counters, session_of_row=torch.tensor(owners)
        )

    monkeypatch.setattr(grpo, "collect_rollout", agent_batch)
    cfg = MasterConfig.model_validate(
        {"grpo": {"use_dynamic_sampling": True, "num_prompts_per_step": 2, "num_generations_per_prompt": 2},
         "policy": {"train_global_batch_size": 4, "train_micro_batch_size": 1}}
    )  # fmt: skip
    loader = PromptDataLoader([PromptRecord(f"p{i}", [], [1], {"task_name": "agent"}) for i in range(2)], 2, 0, False)
    parts = SimpleNamespace(cfg=cfg, generation=None, environment=None, tokenizer=None, train_loader=loader,
                            plan=SimpleNamespace(multi_turn=None, overlap_scoring=False))  # fmt: skip
    rollout, metrics = grpo.collect_training_rollout(parts, 1, StepTimer())
    assert metrics["dynamic_sampling/num_gen_batches"] == 2.0
    assert rollout.session_of_row.tolist() == [4, 4, 4, 5, 6, 7]  # the refill's sessions, numbered apart from batch 0's
    batch = {"sample_mask": torch.ones(6), "token_mask": torch.ones(6, 1)}
    grpo.attach_advantages(cfg, batch, rollout)
    a = 2**-0.5
    torch.testing.assert_close(batch["advantages"].squeeze(-1), torch.tensor([a, a, a, -a, a, -a]), rtol=1e-3, atol=1e-3)
    assert rollout.env_metrics["agent/sessions"] == 8.0 and rollout.env_metrics["agent/rows_per_session"] == 1.5


def test_a_refill_never_starts_an_epoch_past_max_num_epochs(monkeypatch) -> None:
    """grpo.max_num_epochs=1, 4 prompts, 2 per step, no group with signal: step 1's refill takes the epoch's second
    batch, the next would start epoch 1 (refills drew it: a one-epoch run trained second-epoch prompts, a prompt could
    come twice in one step). The run ends there, the loader back where the step began."""
    from types import SimpleNamespace

    import nemo_like.algorithms.grpo as grpo
    from nemo_like.config.schema import MasterConfig
    from nemo_like.data.prompts import DataExhausted, PromptDataLoader, PromptRecord
    from nemo_like.experience.rollouts import Rollout
    from nemo_like.models.generation.interface import GeneratedSample
    from nemo_like.utils.timer import StepTimer

    drawn: list[list[str]] = []

    def no_signal(generation, environment, tokenizer, prompts, *args, **kwargs) -> Rollout:
        drawn.append([p.id for p in prompts])
        samples = [GeneratedSample([1], [2], [0.0], False, 0) for _ in range(4)]
        return Rollout([p for p in prompts for _ in range(2)], torch.tensor([0, 0, 1, 1]), samples, ["x"] * 4, torch.zeros(4), {})

    monkeypatch.setattr(grpo, "collect_rollout", no_signal)
    cfg = MasterConfig.model_validate(
        {"grpo": {"use_dynamic_sampling": True, "num_prompts_per_step": 2, "num_generations_per_prompt": 2, "max_num_epochs": 1},
         "policy": {"train_global_batch_size": 4, "train_micro_batch_size": 1}}
    )  # fmt: skip
    loader = PromptDataLoader([PromptRecord(f"p{i}", [], [1], {}) for i in range(4)], 2, 0, False)
    parts = SimpleNamespace(cfg=cfg, generation=None, environment=None, tokenizer=None, train_loader=loader,
                            plan=SimpleNamespace(multi_turn=None, overlap_scoring=False))  # fmt: skip
    with pytest.raises(DataExhausted, match=r"grpo.max_num_epochs=1 reached while dynamic sampling refilled step 1 \(2 generation"):
        grpo.collect_training_rollout(parts, 1, StepTimer())
    assert drawn == [["p0", "p1"], ["p2", "p3"]] and (loader.epoch, loader.index, loader.consumed) == (0, 0, 0)


def test_refill_batches_never_repeat_an_earlier_batchs_request_seeds() -> None:
    """Request i of a batch samples with its seed + i: with consecutive batch seeds, refill b + 1's request i repeated
    batch b's request i + 1 (the same sample again wherever a prompt came back within the step)."""
    from nemo_like.models.generation.interface import prompt_seeds
    from nemo_like.utils.seeds import rollout_seed

    requests = 64
    seen: set[int] = set()
    for batch in range(20):
        seeds = set(prompt_seeds(rollout_seed(42, 7, batch), requests))
        assert not seeds & seen, batch
        seen |= seeds
    assert rollout_seed(42, 7, 0) == (42 * 1_000_003 + 7) * 101  # batch 0 keeps its seed: runs without refills unchanged


def test_big_batches_of_consecutive_steps_never_share_a_request_seed() -> None:
    """Steps' batch seeds are BATCH_STRIDE (101) apart and request i samples with seed + i: in a batch of more than 101
    requests (vLLM's per-request seeds; grpo_math_1B sends 512) step s + 1's request j drew step s's request j + 101's
    numbers. Offsets from 101 on are hashed; below it every seed is as before (the CPU recipes' 64-request batches)."""
    from nemo_like.models.generation.interface import prompt_seeds
    from nemo_like.utils.seeds import chunk_seed, rollout_seed

    seen: set[int] = set()
    for step in range(1, 30):
        seeds = prompt_seeds(rollout_seed(3, step), 512)
        assert len(set(seeds)) == 512 and not set(seeds) & seen, step
        seen |= set(seeds)
    base = rollout_seed(3, 1)
    assert [chunk_seed(base, i) for i in range(101)] == [base + i for i in range(101)]


def test_generation_ranks_never_draw_another_steps_request_seeds() -> None:
    """Rank r's seed was the batch seed + 1,000,003 r, and 1,000,003 = 2 (mod 101): rank r at step s drew rank 0's
    numbers at step s + 9,901 r. Rank 0 keeps the batch seed; the others hash."""
    from nemo_like.models.generation.interface import prompt_seeds
    from nemo_like.utils.seeds import rollout_seed, worker_seed

    assert worker_seed(rollout_seed(0, 5), 0) == rollout_seed(0, 5)  # one engine: every seed as before
    rank0 = {s for step in range(1, 20_000) for s in prompt_seeds(rollout_seed(0, step), 64)}
    others = {s for step in (1, 2, 3) for rank in (1, 2, 3) for s in prompt_seeds(worker_seed(rollout_seed(0, step), rank), 64)}
    assert len(others) == 9 * 64 and not others & rank0
