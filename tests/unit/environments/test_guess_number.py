"""Guess-the-number: feedback, termination, rewards and determinism, played by a binary-search agent."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from nemo_like.environments.games.guess_number import GuessNumberEnvironment
from nemo_like.environments.interface import FINAL_TURN


def play(env: GuessNumberEnvironment, secret: int, low: int = 1, high: int = 100) -> tuple[float, int, list[str]]:
    """A binary search against the environment; returns the total reward, the guesses made and the feedback."""
    meta, log, reward, feedback = {"answer": str(secret)}, [{"role": "user", "content": "Guess my number from 1 to 100."}], 0.0, []
    while True:
        guess = (low + high) // 2
        log.append({"role": "assistant", "content": f"{guess}<|im_end|>"})
        (step,) = env.step([log], [meta])
        reward += step.reward
        meta = step.metadata if step.metadata is not None else meta
        if step.terminated:
            return reward, meta["guesses"], feedback
        feedback.append(step.observation["content"])
        log.append(step.observation)
        low, high = (guess + 1, high) if step.observation["content"] == "higher" else (low, guess - 1)


def test_binary_search_solves_every_secret_within_log2_guesses() -> None:
    env = GuessNumberEnvironment(max_guesses=7)
    for secret in range(1, 101):
        reward, guesses, _ = play(env, secret)
        assert reward == 1.0 and guesses <= math.ceil(math.log2(101)), secret
    counts = env.metrics()
    assert counts["solved"] == 100 and counts["malformed"] == 0 and counts["out_of_guesses"] == 0


def test_feedback_for_secret_37() -> None:
    # 50 -> lower, 25 -> higher, 37 -> correct
    assert play(GuessNumberEnvironment(), 37) == (1.0, 3, ["lower", "higher"])


def test_out_of_guesses_and_malformed_answers_terminate_with_zero_reward() -> None:
    env = GuessNumberEnvironment(max_guesses=2)
    assert play(env, 37) == (0.0, 2, ["lower"])  # the second guess (25) was the last one: no feedback after it
    steps = env.step([[{"role": "assistant", "content": "maybe 40?"}], [{"role": "assistant", "content": ""}]], [{"answer": 4}] * 2)
    assert [(s.reward, s.terminated, s.observation) for s in steps] == [(0.0, True, None)] * 2
    assert env.metrics()["malformed"] == 2


def test_a_game_cut_by_the_turn_limit_is_counted_and_a_too_short_limit_warns() -> None:
    """A wrong guess in the sample's final turn (metadata[FINAL_TURN]) ended the game counted in neither solved nor
    out_of_guesses; max_guesses above grpo.max_rollout_turns had no effect, silently."""
    env = GuessNumberEnvironment(max_guesses=7)
    log = [{"role": "assistant", "content": "50"}]
    wrong, right = env.step([log, log], [{"answer": 37, FINAL_TURN: True}, {"answer": 50, FINAL_TURN: True}])
    assert (wrong.reward, wrong.observation, right.reward, right.terminated) == (0.0, None, 1.0, True)
    counts = env.metrics()
    assert (counts["turn_limit"], counts["solved"], counts["out_of_guesses"]) == (1.0, 1.0, 0.0)
    (line,) = GuessNumberEnvironment.config_warnings("game", {"max_guesses": 7}, 2)
    assert line.startswith("env.game.max_guesses=7 has no effect beyond grpo.max_rollout_turns=2")
    assert GuessNumberEnvironment.config_warnings("game", {}, 7) == []  # the default 7 fits 7 turns


def test_steps_are_a_pure_function_of_the_turn_and_metadata() -> None:
    env = GuessNumberEnvironment(feedback_role="environment")
    log, meta = [{"role": "assistant", "content": "10"}], {"answer": 20, "guesses": 3, "task_name": "guess_number"}
    first, second = env.step([log], [meta])[0], env.step([log], [meta])[0]
    assert first == second and first.observation == {"role": "environment", "content": "higher"}
    assert first.metadata == {"answer": 20, "guesses": 4, "task_name": "guess_number"} and meta["guesses"] == 3  # input not mutated
    assert env.score(["20", "19"], [{"answer": "20"}] * 2) == [1.0, 0.0]
    with pytest.raises(ValueError, match="must be an integer"):
        env.step([log], [{"answer": "twenty"}])


def test_a_single_turn_game_counts_a_wrong_guess_at_the_turn_limit() -> None:
    """score() (grpo.max_rollout_turns=1) is the game's only turn: a wrong guess was counted nowhere (turn_limit stayed
    0 while the start-up warning said these games are counted there)."""
    env = GuessNumberEnvironment(max_guesses=7)
    assert env.score(["50", "37", "no idea"], [{"answer": 37}] * 3) == [0.0, 1.0, 0.0]
    counts = env.metrics()
    assert (counts["turn_limit"], counts["solved"], counts["malformed"], counts["out_of_guesses"]) == (1.0, 1.0, 1.0, 0.0)


def test_the_turn_loop_knows_the_role_each_environment_replies_with() -> None:
    """Where a row is full, the turn loop probes only the roles an environment replies with (a tool environment's full
    row was told "not final" because a user's reply would have branched, and its tool ran for nothing)."""
    from nemo_like.algorithms.names import check_plugin_names
    from nemo_like.algorithms.setup import environment_reply_roles
    from nemo_like.config import load_config
    from nemo_like.plan.multi_turn import ANY_REPLY_ROLES, MultiTurnSettings, with_reply_roles

    recipe = Path(__file__).resolve().parents[3] / "examples" / "configs" / "grpo_multiturn_tiny_cpu.yaml"
    overrides = ["+env.game.class=guess_number", "+env.game.feedback_role=environment", "+env.plain.class=custom_envs:FirstOfFour"]
    roles = environment_reply_roles(check_plugin_names(load_config(recipe, overrides, warn=False)))
    assert roles == {"tool": ("tool",), "game": ("environment",), "plain": ANY_REPLY_ROLES}
    settings = with_reply_roles(MultiTurnSettings(3, 64, (2,)), roles)
    assert settings.reply_roles_of("game") == ("environment",) and settings.reply_roles_of(None) == ANY_REPLY_ROLES
    assert with_reply_roles(MultiTurnSettings(3, 64, (2,)), {"tool": ("tool",)}).reply_roles_of(None) == ("tool",)  # the only one
    assert with_reply_roles(None, roles) is None
    # ("user") is a string: split into letters it silently told a full row "final" where a user's reply would branch
    from nemo_like.config import ConfigError

    with pytest.raises(
        ConfigError, match=r"env.plain: custom_envs:StringReplyRoles.reply_roles returned 'user'; expected a non-empty tuple"
    ):
        environment_reply_roles(check_plugin_names(load_config(recipe, ["+env.plain.class=custom_envs:StringReplyRoles"], warn=False)))
