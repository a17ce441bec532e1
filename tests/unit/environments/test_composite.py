"""Reward composition without actors: the weighted sum of real sources (arithmetic, length penalty), each source's
reward and counters under its own name, and the section's errors and warnings."""

from __future__ import annotations

import warnings

import pytest

from nemo_like.algorithms.roles import scorer_specs
from nemo_like.config.errors import ConfigError
from nemo_like.config.schema import MasterConfig
from nemo_like.distributed.worker_group import WorkerResources
from nemo_like.environments.composite import CompositeEnvironment, source_devices
from nemo_like.environments.length_penalty import LengthPenaltyEnvironment
from nemo_like.environments.registry import resolve_environments
from nemo_like.environments.worker import environment_resources

SOURCES = {
    "correct": {"class": "arithmetic", "weight": 1.0},
    "short": {"class": "length_penalty", "weight": 0.5, "free_length": 2, "penalty_per_unit": 0.1},
}


def resolve(section: dict, num_workers: int = 1):
    cfg = MasterConfig.model_validate({"env": {"arith": {"class": "composite", "num_workers": num_workers, **section}}})
    return resolve_environments(cfg.env_sections)["arith"]


def test_the_reward_is_the_weighted_sum_and_each_source_is_reported() -> None:
    env = CompositeEnvironment(**resolve({"sources": SOURCES}).kwargs)
    responses = ["7", "8", "7 is it", "77777777777777777"]
    rewards = env.score(responses, [{"answer": 7}] * 4)
    # arithmetic: 1, 0, 0 or 1 (its own parser), 0; length: -0.1 per char beyond 2, at most -1
    correct = [1.0, 0.0, env.sources["correct"][0].score(["7 is it"], [{"answer": 7}])[0], 0.0]
    length = [0.0, 0.0, -0.5, -1.0]
    assert rewards == pytest.approx([c + 0.5 * n for c, n in zip(correct, length)])
    metrics = env.metrics()
    assert metrics["correct/reward_sum"] == pytest.approx(sum(correct)) and "correct/reward" not in metrics  # the run derives the mean
    assert metrics["short/reward_sum"] == pytest.approx(-1.5)
    assert metrics["short/num_samples"] == 4.0 and metrics["short/over_length"] == 2.0  # the source's own counters
    assert env.metrics() == {}  # reset after each read


def test_length_penalty_units() -> None:
    words = LengthPenaltyEnvironment(unit="words", free_length=2, penalty_per_unit=0.25, max_penalty=0.6)
    assert words.score(["a b", "a b c", "a b c d e f"], [{}] * 3) == [0.0, -0.25, -0.6]


def test_sources_state_their_resources_together() -> None:
    cfg = MasterConfig.model_validate(
        {"env": {"arith": {"class": "composite", "sources": {**SOURCES, "j": {"class": "judge", "engine_num_cpus": 0.5}}}}}
    )
    roles = {r.role: r for r in environment_resources(cfg)}
    assert roles["environment:arith"].resources.num_cpus == pytest.approx(0.3)  # three sources at the default 0.1
    assert roles["judge:arith"].count == 1 and roles["judge:arith"].resources.num_cpus == 0.5


def test_an_agent_tasks_actors_reserve_what_its_verifier_needs() -> None:
    """The verifier runs in the agent task's environment actor, but the actor reserved the default 0.1 CPU: a reward
    model verifier's GPU went unreserved and a judge verifier's engine actors uncounted by the capacity check."""
    agent = {"class": "agent", "agent": "examples.agents.calculator_agent:run"}
    rm = {"verifier": "reward_model", "verifier_kwargs": {"model_name": "embedded:tiny-reward-qwen2", "num_gpus": 1}}
    judge = {"verifier": "judge", "verifier_kwargs": {"engine_num_cpus": 0.5, "engine_num_gpus": 1}}
    sections = {"a": agent, "b": {**agent, **rm}, "c": {**agent, **judge}, "d": {**agent, "verifier": "arithmetic"}}
    roles = {r.role: r.resources for r in environment_resources(MasterConfig.model_validate({"env": sections}))}
    assert roles == {
        "environment:a": WorkerResources(num_cpus=0.1, num_gpus=0.0),
        "environment:b": WorkerResources(num_cpus=0.25, num_gpus=1.0),  # the reward model's own reservation
        "environment:c": WorkerResources(num_cpus=0.1, num_gpus=0.0),
        "judge:c": WorkerResources(num_cpus=0.5, num_gpus=1.0),
        "environment:d": WorkerResources(num_cpus=0.1, num_gpus=0.0),
    }
    # the memory plan counts the verifiers' models as it counts a task's own
    assert [spec.role for spec in scorer_specs(MasterConfig.model_validate({"env": sections}))] == ["reward_model:b", "judge:c"]
    # a verifier's bad key names its task (the check ran without it: 'env.<task>.verifier_kwargs')
    bad = {"b": {**agent, "verifier": "reward_model", "verifier_kwargs": {"model_nam": "x"}}}
    with pytest.raises(ConfigError, match=r"env.b.verifier_kwargs.model_nam: unknown key"):
        environment_resources(MasterConfig.model_validate({"env": bad}))


def test_each_reward_model_source_runs_on_its_own_share_of_the_actors_gpus() -> None:
    """The actor holds the sources' GPUs added up, but every reward model went to torch's default GPU (the second
    reserved one idle) and a num_gpus 0 source to the GPU too once another brought one."""
    rm = {"class": "reward_model", "model_name": "embedded:tiny-reward-qwen2"}

    def devices(gpus: list[float]) -> list[str]:
        sources = {f"rm{i}": {**rm, "num_gpus": g} for i, g in enumerate(gpus)} | {"correct": SOURCES["correct"]}
        placed = source_devices(resolve({"sources": sources}).kwargs["sources"])
        assert "correct" not in placed  # it loads no model
        return [placed[f"rm{i}"] for i in range(len(gpus))]

    assert devices([1, 1]) == ["cuda:0", "cuda:1"]
    assert devices([0, 1]) == ["cpu", "cuda:0"]
    assert devices([0.5, 0.5, 1]) == ["cuda:0", "cuda:0", "cuda:1"]
    assert devices([0.5, 1, 0.5]) == ["cuda:0", "cuda:1", "cuda:0"]  # a whole GPU never goes to a shared one
    env = CompositeEnvironment(**resolve({"sources": {"rm": {**rm, "num_gpus": 0}}}).kwargs)  # a real model, on this CPU
    assert str(env.sources["rm"][0].scorer.device) == "cpu"


@pytest.mark.parametrize(
    ("gpus", "reserved", "placed"),
    [
        ([0.25, 0.5], 0.75, ["cuda:0", "cuda:0"]),  # one shared GPU: the fractions' sum
        ([0.6, 0.6], 2.0, ["cuda:0", "cuda:1"]),  # reserved 1.2 (Ray refuses a fraction above 1) for two GPUs
        ([0.6, 0.6, 0.8], 3.0, ["cuda:0", "cuda:1", "cuda:2"]),  # reserved 2.0: cuda:2 was a GPU the actor lacked
        ([0.5, 1, 0.5], 2.0, ["cuda:0", "cuda:1", "cuda:0"]),
        ([0, 0], 0.0, ["cpu", "cpu"]),
    ],
)
def test_a_composite_reserves_every_gpu_its_sources_are_placed_on(gpus, reserved, placed) -> None:
    rm = {"class": "reward_model", "model_name": "embedded:tiny-reward-qwen2"}
    settings = resolve({"sources": {f"rm{i}": {**rm, "num_gpus": g} for i, g in enumerate(gpus)}}).kwargs
    assert CompositeEnvironment.actor_needs(settings).num_gpus == pytest.approx(reserved)
    assert list(source_devices(settings["sources"]).values()) == placed


def test_a_reward_model_reserves_at_most_one_gpu() -> None:
    """Its model runs on one GPU: 1.5 was accepted, reserved (Ray refuses a fraction above 1) and never used."""
    with pytest.raises(ConfigError, match="num_gpus"):
        resolve({"sources": {"rm": {"class": "reward_model", "num_gpus": 1.5}}})


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"sources": {}}, "list at least one reward source"),
        ({}, "env.arith.sources: Field required"),
        ({"sources": {"a/b": {"class": "arithmetic"}}}, "contain no '/'"),
        ({"sources": {"x": {"class": "arithmetc"}}}, "sources.x.class must be a built-in environment"),
        (
            {"sources": {"x": {"class": "length_penalty", "free_lenght": 3}}},
            "env.arith.sources: sources.x.free_lenght: unknown key. Did you mean 'sources.x.free_length'",  # one header
        ),
        # a source's own keys are offered too (a misspelled weight had no hint)
        ({"sources": {"x": {"class": "length_penalty", "wieght": 2}}}, "sources.x.wieght: unknown key. Did you mean 'sources.x.weight'"),
        ({"sources": {"x": {"class": "arithmetic", "weight": "high"}}}, "sources.x.weight must be a finite number"),
        ({"sources": {"x": {"class": "composite", "sources": SOURCES}}}, "cannot be a source of another composite"),
        # a multi-turn environment's turns never ran inside a composite: its step was the default, single-turn one
        ({"sources": {"t": {"class": "tool", "tools": ["calculator"]}}}, r"sources.t: ToolEnvironment is a multi-turn environment"),
        # an agent source: the task was rolled out as plain generation, the agent never ran
        ({"sources": {"a": {"class": "agent", "agent": "examples.agents.calculator_agent:run"}}}, r"sources.a: an agent task"),
    ],
)
def test_bad_sections_name_the_key(section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve(section)


def test_options_that_change_nothing_or_mislead_warn() -> None:
    # a source at weight 0 beside others: one start-up line (it was a Python warning, twice, located in pydantic)
    section = {"sources": {"x": {"class": "arithmetic", "weight": 0}, "y": {"class": "arithmetic"}}}
    assert CompositeEnvironment.config_warnings("arith", resolve(section).kwargs, 1) == [
        "env.arith.sources.x.weight=0: the source is computed and logged but does not change the reward (a NaN or "
        "infinite one still stops the run)"
    ]
    # every source at weight 0: every reward 0, no training signal (a run trained nothing, its models scoring on)
    with pytest.raises(ConfigError, match=r"every source of sources has weight 0.*give one of \['x'\] a weight"):
        resolve({"sources": {"x": {"class": "arithmetic", "weight": 0}}})
    with warnings.catch_warnings():  # several actors are fine: the run derives each source's mean after summing
        warnings.simplefilter("error")
        resolve({"sources": SOURCES}, num_workers=2)


def test_a_sources_counter_named_as_the_composites_own_is_refused() -> None:
    """A source counting its samples as ``num_samples`` added them to the composite's ``<source>/num_samples``: the
    logged per-source reward came out halved, silently."""

    class Counting:
        def score(self, responses, metadata):
            return [1.0] * len(responses)

        def metrics(self):
            return {"num_samples": float(4)}

    env = CompositeEnvironment(**resolve({"sources": {"g": {"class": "arithmetic"}}}).kwargs)
    env.sources["g"] = (Counting(), 1.0)
    with pytest.raises(ValueError, match=r"reward source 'g': metrics\(\) names \['num_samples'\]"):
        env.score(["1", "2", "3", "4"], [{"answer": 1}] * 4)


def test_a_sources_non_finite_reward_stops_the_run_naming_the_source_even_at_weight_0() -> None:
    """``0 * nan`` is NaN: a weight-0 source's NaN made the composed reward NaN, and the run's error named only the task."""

    class NanOnEmpty:
        def score(self, responses, metadata):
            return [float("nan") if not r else 0.5 for r in responses]

        def metrics(self):
            return {}

    env = CompositeEnvironment(
        **resolve({"sources": {"correct": {"class": "arithmetic"}, "custom": {"class": "arithmetic", "weight": 0}}}).kwargs
    )
    env.sources["custom"] = (NanOnEmpty(), 0.0)
    assert env.score(["7"], [{"answer": 7}]) == [1.0]
    with pytest.raises(
        ValueError, match=r"reward source 'custom' returned non-finite rewards for 1 of 2 responses, e.g. nan for response ''"
    ):
        env.score(["7", ""], [{"answer": 7}] * 2)


def test_a_sources_exception_names_the_source() -> None:
    """Two sources of one class (two reward models) raised the same error: only the task was named, not which source."""

    class Rubric:
        def score(self, responses, metadata):
            return [float(m["rubric"]) for m in metadata]

        def metrics(self):
            return {}

    env = CompositeEnvironment(**resolve({"sources": {"plain": {"class": "arithmetic"}, "graded": {"class": "arithmetic"}}}).kwargs)
    env.sources["graded"] = (Rubric(), 1.0)
    with pytest.raises(KeyError, match="rubric") as raised:
        env.score(["7"], [{"answer": 7}])
    assert "raised by reward source 'graded' (Rubric) of the composite" in raised.value.__notes__
