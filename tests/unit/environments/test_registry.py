"""Environment config and registry: the env config shapes, built-ins, user classes by import path, the
errors a wrong class or key gives (in the driver, before any actor), and task routing."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_like.config import ConfigError, load_config
from nemo_like.config.schema import MasterConfig
from nemo_like.environments.registry import check_tasks_have_environments, resolve_environments, route_by_task, task_of


def envs(env: object) -> dict:
    return resolve_environments(MasterConfig.model_validate({"env": env}).env)


def test_one_section_per_task_with_builtins_by_name_and_by_class() -> None:
    specs = envs({"arithmetic": {"num_workers": 2}, "math": {"timeout_s": 2}, "gsm8k": {"class": "math", "format_reward": 0.1}})
    assert {t: (s.class_path.rsplit(":", 1)[1], s.num_workers) for t, s in specs.items()} == {
        "arithmetic": ("ArithmeticEnvironment", 2),
        "math": ("MathEnvironment", 1),
        "gsm8k": ("MathEnvironment", 1),
    }
    assert specs["math"].kwargs == {
        "timeout_s": 2.0,
        "format_reward": 0.0,
        "memory_mb": 2048,
    }  # validated and completed by the env's config model
    assert specs["gsm8k"].kwargs["format_reward"] == 0.1


def test_shorthand_and_empty_env_mean_one_section() -> None:
    assert MasterConfig.model_validate({"env": {"name": "math", "num_workers": 3, "timeout_s": 1}}).env["math"].num_workers == 3
    assert list(MasterConfig.model_validate({"env": {"num_workers": 2}}).env) == ["arithmetic"]
    assert list(MasterConfig().env_sections) == ["arithmetic"]
    assert list(load_config(None).env) == ["arithmetic"]
    with pytest.raises(Exception, match="mixes the single-environment shorthand"):
        MasterConfig.model_validate({"env": {"num_workers": 2, "arithmetic": {}}})
    # With a name the whole mapping is that environment's section, whose own settings may nest (it took a composite's
    # sources and a reward model's normalize for per-task sections and refused them); a task's section is then a key
    # the environment does not have.
    sources = {"correct": {"class": "arithmetic"}, "short": {"class": "length_penalty", "free_length": 6}}
    (composite,) = envs({"name": "composite", "num_workers": 2, "sources": sources}).values()
    assert composite.num_workers == 2 and set(composite.kwargs["sources"]) == {"correct", "short"}
    (scorer,) = envs({"name": "reward_model", "normalize": {"squash": "sigmoid"}}).values()
    assert scorer.kwargs["normalize"]["squash"] == "sigmoid"
    agent = {"name": "agent", "agent": "examples.agents.calculator_agent:run"}  # a setting named like its environment
    assert MasterConfig.model_validate({"env": agent}).env_sections["agent"].model_dump()["agent"] == agent["agent"]
    with pytest.raises(ConfigError, match="env.math.arithmetic: unknown key"):
        envs({"name": "math", "arithmetic": {}})
    # but a parent recipe's section (or a '+env.<task>.<key>' override) merged into a shorthand is refused as a task's
    # section: a custom environment taking **kwargs got it as a keyword argument, and the run ignored it
    for merged in ({"arithmetic": {"num_workers": 2}}, {"gsm8k": {"class": "math"}}, {"math": {"timeout_s": 5}}):
        with pytest.raises(Exception, match=r"env mixes the single-environment shorthand \(env.name=math\) with per-task sections"):
            MasterConfig.model_validate({"env": {"name": "math", **merged}})


def test_a_custom_env_by_import_path_gets_its_section_keys() -> None:
    spec = envs({"parity": {"class": "custom_envs:LengthParityEnv", "bonus": 0.5}})["parity"]
    assert spec.class_path == "custom_envs:LengthParityEnv" and spec.kwargs == {"bonus": 0.5}


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"class": "no_such_module_xyz:Env"}, "env.t.class: cannot import 'no_such_module_xyz'"),
        ({"class": "custom_envs:LengthParityEnvv"}, "has no attribute 'LengthParityEnvv'. Did you mean 'LengthParityEnv'"),
        ({"class": "custom_envs:not_a_class"}, "is a LengthParityEnv, not a class"),
        ({"class": "custom_envs:NotAnEnvironment"}, "does not subclass nemo_like.environments.interface.EnvironmentInterface"),
        ({"class": "custom_envs:Unfinished"}, r"leaves abstract methods unimplemented: \['score'\]"),
        ({"class": "custom_envs"}, "must be a built-in environment"),
        (
            {"class": "custom_envs:LengthParityEnv", "bonnus": 1},
            r"env.t.bonnus: unknown key; LengthParityEnv.__init__ accepts \['bonus'\]. Did you mean 'env.t.bonus'",
        ),
        ({"class": "custom_envs:NeedsThreshold"}, r"requires \['threshold'\]"),
        ({"class": "math", "timeout": 3}, "env.t.timeout: unknown key. Did you mean 'env.t.timeout_s'"),
        # the section's own keys are offered too (only the environment's were: no hint for a misspelled num_workers)
        ({"class": "math", "num_worker": 2}, "env.t.num_worker: unknown key. Did you mean 'env.t.num_workers'"),
        ({"class": "custom_envs:LengthParityEnv", "num_worker": 2}, "Did you mean 'env.t.num_workers'"),
        ({"class": "math", "format_reward": 1.0}, "env.t.format_reward: Input should be less than 1"),
        ({"class": "arithmetic", "custom_reward_fn": "custom_envs:nope"}, "custom_reward_fn: 'custom_envs' has no attribute 'nope'"),
        # A check of the whole section (a model validator) is named by the section, not 'env.t.' with an empty key.
        ({"class": "tool", "tools": ["calculator", "no_such_pkg_xyz:search"]}, r"env\.t: tools: cannot import 'no_such_pkg_xyz'"),
    ],
)
def test_custom_env_errors_name_the_key(section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        envs({"t": section})


def test_a_class_registered_in_the_drivers_process_reaches_the_actors_by_its_module_or_is_refused(monkeypatch) -> None:
    """ENVIRONMENTS.add("name", Class) and '__main__:Class' passed the start-up check, then every environment actor
    (another process) failed to find the class after the run had started."""
    import sys

    from custom_envs import LengthParityEnv

    from nemo_like.environments.registry import ENVIRONMENTS

    monkeypatch.setitem(ENVIRONMENTS._entries, "test_runtime_parity", LengthParityEnv)  # noqa: SLF001 (this test only)
    assert envs({"t": {"class": "test_runtime_parity"}})["t"].class_path == "custom_envs:LengthParityEnv"

    class LocalEnv(LengthParityEnv):
        pass

    monkeypatch.setitem(ENVIRONMENTS._entries, "test_runtime_local", LocalEnv)  # noqa: SLF001
    with pytest.raises(ConfigError, match=r"env.t.class: .*LocalEnv is defined in a function.*name it 'file.py:Class'"):
        envs({"t": {"class": "test_runtime_local"}})
    monkeypatch.setattr(sys.modules["__main__"], "ScriptEnv", LocalEnv, raising=False)  # a class of the script being run
    with pytest.raises(ConfigError, match=r"defined in the script being run \(__main__\)"):
        envs({"t": {"class": "__main__:ScriptEnv"}})
    # the classes a composite's sources and an agent's verifier name are resolved again in the actors: the same holds
    composite = {"class": "composite", "sources": {"p": {"class": "test_runtime_parity"}, "math": {}}}
    sources = envs({"t": composite})["t"].kwargs["sources"]
    assert sources["p"]["class"] == "custom_envs:LengthParityEnv" and sources["math"].get("class", "math") == "math"
    agent = {"class": "agent", "agent": "examples/agents/calculator_agent.py:solve", "verifier": "test_runtime_parity"}
    assert envs({"t": agent})["t"].kwargs["verifier"] == "custom_envs:LengthParityEnv"
    with pytest.raises(ConfigError, match=r"env.t.sources.p.class: .*script being run"):
        envs({"t": {"class": "composite", "sources": {"p": {"class": "__main__:ScriptEnv"}}}})
    # a class of a file imported by path, registered by name: the actors import the file
    from nemo_like.utils.imports import import_object

    from_file = import_object(f"{Path(__file__).parents[2] / 'custom_envs.py'}:LengthParityEnv")
    monkeypatch.setitem(ENVIRONMENTS._entries, "test_runtime_from_file", from_file)  # noqa: SLF001
    assert (
        envs({"t": {"class": "test_runtime_from_file"}})["t"].class_path
        == f"{Path(__file__).parents[2] / 'custom_envs.py'}:LengthParityEnv"
    )


def test_an_unknown_section_without_class_is_an_error() -> None:
    with pytest.raises(ConfigError, match="env.maths: 'maths' is not a built-in environment.*Did you mean 'math'"):
        envs({"maths": {}})


def test_routing_by_task_name() -> None:
    tasks = ["arithmetic", "parity"]
    metadata = [{"task_name": "parity"}, {"task_name": "arithmetic"}, {"task_name": "parity"}]
    assert route_by_task(metadata, tasks) == {"parity": [0, 2], "arithmetic": [1]}
    assert task_of({}, ["math"]) == "math"  # no task_name: the only environment
    with pytest.raises(ConfigError, match="no metadata\\['task_name'\\] and several environments are configured"):
        task_of({}, tasks)
    with pytest.raises(ConfigError, match="samples of task 'math' have no environment: configured environments are arithmetic, parity"):
        task_of({"task_name": "math"}, tasks)
    with pytest.raises(ConfigError, match=r"data \(train split\): samples of task 'math'"):
        check_tasks_have_environments([{"task_name": "math"}], tasks, "data (train split)")


def test_an_environment_no_prompt_uses_is_a_config_warning_that_says_how_to_remove_it(capsys) -> None:
    """It was a raw RuntimeWarning (file, line and source line) on the README's own-data command."""
    from nemo_like.algorithms.setup import check_environments
    from nemo_like.data.prompts import PromptRecord
    from nemo_like.environments.registry import EnvSpec

    specs = {t: EnvSpec(t, "arithmetic") for t in ("arithmetic", "math")}
    check_environments(specs, {"train": [PromptRecord("0", [], [1], {"task_name": "math", "answer": "3"})]})
    assert capsys.readouterr().err == (
        "[config] warning: env: no prompt has task ['arithmetic']; their environment actors will sit idle (remove the "
        "section with '~env.arithmetic')\n"
    )


def test_a_gold_answer_an_environment_cannot_score_fails_at_start_naming_the_prompt() -> None:
    """An integer-comparing environment given a non-integer gold answer ('42.0', '9,716'): guess-number failed inside its
    actor at whatever step the policy first emitted a bare integer; the arithmetic and tool environments scored every
    response 0 for the whole run, without a word."""
    from nemo_like.algorithms.setup import check_environments
    from nemo_like.data.prompts import PromptRecord
    from nemo_like.environments.registry import EnvSpec

    def records(*answers: object) -> list[PromptRecord]:
        return [PromptRecord(f"p{i}", [], [1], {"answer": a}) for i, a in enumerate(answers)]

    good = records(42, "17", " -3 ")
    for env, why in (
        ("guess_number", "the game's secret number"),
        ("arithmetic", "the built-in reward compares integers; set custom_reward_fn"),
        ("tool", "answer_checker 'integer' compares integers"),
    ):
        specs = {env: EnvSpec(env, env)}
        check_environments(specs, {"train": good, "validation": good})
        with pytest.raises(ConfigError) as bad:
            check_environments(specs, {"train": good, "validation": records(7, "9,716")})
        assert str(bad.value).startswith(f"data (validation split): prompt p1 (task '{env}'): its answer '9,716' is not an integer ("), env
        assert why in str(bad.value) and "data.answer_key" in str(bad.value)
    # A composite's sources and an agent's verifier score the answer: their rules hold (they were skipped)
    bad = {"train": records("9,716")}
    composite = {"sources": {"acc": {"class": "arithmetic"}, "len": {"class": "length_penalty"}}}
    with pytest.raises(ConfigError, match=r"its answer '9,716' is not an integer \(the built-in reward .*\), for reward source 'acc'"):
        check_environments({"mix": EnvSpec("mix", "composite", kwargs=composite)}, bad)
    agent = {"agent": "os.path:join", "verifier": "tool", "verifier_kwargs": {"answer_checker": "integer"}}
    with pytest.raises(ConfigError, match=r"its answer '9,716' is not an integer \(.*\), for the verifier 'tool'"):
        check_environments({"ag": EnvSpec("ag", "agent", kwargs=agent)}, bad)
    check_environments({"ag": EnvSpec("ag", "agent", kwargs={**agent, "verifier": None})}, bad)  # no verifier: no rule
    # A user's reward function or answer checker takes any answer; an environment that states no rule, too.
    anything = {"train": records("forty-two", "\\frac{1}{2}")}
    check_environments({"arithmetic": EnvSpec("arithmetic", "arithmetic", kwargs={"custom_reward_fn": "os.path:join"})}, anything)
    check_environments({"tool": EnvSpec("tool", "tool", kwargs={"answer_checker": "os.path:join"})}, anything)
    check_environments({"math": EnvSpec("math", "math")}, anything)


def test_setup_checks_the_data_tasks_before_any_actor(monkeypatch) -> None:
    """setup_grpo raises on a task without environment before Ray or any actor starts."""
    from nemo_like.algorithms import setup

    def no_ray(*_args, **_kwargs):
        raise AssertionError("Ray must not start")

    monkeypatch.setattr(setup, "init_ray", lambda *_: None)
    monkeypatch.setattr(setup, "ensure_cluster_capacity", lambda *_, **__: None)
    monkeypatch.setattr(setup, "Policy", no_ray)
    monkeypatch.setattr(setup, "Environments", no_ray)
    cfg = load_config(None, ["~env", "+env.math.num_workers=1", "data.train.num_problems=16", "grpo.max_val_samples=8"])
    with pytest.raises(ConfigError, match="samples of task 'arithmetic' have no environment: configured environments are math"):
        setup.setup_grpo(cfg)


def test_a_non_finite_reward_names_the_response_and_its_metadata() -> None:
    """The error used to name positions in the actor's shard (``responses [1]``), which point at no sample a user can
    find; it now quotes the first offending response and its metadata, and counts them."""
    from nemo_like.environments.worker import EnvironmentWorker

    worker = EnvironmentWorker(0, 1, "buggy", "custom_envs:NanForQuestionMarks", {})
    responses = ["12", "what is 3+4?" + " padding" * 40, "7", "?"]
    metadata = [{"answer": 12}, {"answer": 7, "id": "q-31"}, {"answer": 7}, {"answer": 1}]
    with pytest.raises(
        ValueError,
        match=r"non-finite rewards for 2 of 4 responses, e.g. nan for response 'what is 3\+4\? padding.*\.\.\. "
        r"\(metadata \{'answer': 7, 'id': 'q-31'\}\)",
    ):
        worker.score(responses, metadata)


def test_a_bad_step_names_the_conversation_by_its_metadata_and_last_message() -> None:
    """A bad step was named by its position in one actor's share of the batch only, which points at no sample."""
    from nemo_like.environments.worker import EnvironmentWorker

    worker = EnvironmentWorker(0, 1, "buggy", "custom_envs:NanForQuestionMarks", {})
    logs = [[{"role": "assistant", "content": "12"}], [{"role": "assistant", "content": "why?"}]]
    with pytest.raises(ValueError, match=r"conversation 1 of this actor's 2 \(metadata \{'answer': 7, 'id': 'q-9'\}, last message .*why\?"):
        worker.step(logs, [{"answer": 12}, {"answer": 7, "id": "q-9"}])


def test_a_counter_named_as_the_runs_own_env_metrics_is_refused_by_name() -> None:
    """An environment counter 'num_samples' (or 'reward_sum', or 'reward') replaced the run's env/<task>/num_samples
    and reward, measured over the trained samples, with its own values, silently."""
    from nemo_like.environments.worker import EnvironmentWorker

    worker = EnvironmentWorker(0, 1, "counted", "custom_envs:CountsItsOwnSamples", {})
    with pytest.raises(
        ValueError, match=r"environment 'counted': metrics\(\) names \['num_samples'\], which the run keeps for env/counted"
    ):
        worker.score(["1", "2"], [{}, {}])


def test_an_environments_own_error_names_its_task_and_batch() -> None:
    """A raising score, a None reward and a text counter were bare KeyError / TypeError from the actor, naming no task
    (two tasks can share a class) and no sample; Ray's header named the actor '<EnvironmentWorker object at 0x...>'."""
    from nemo_like.environments.worker import EnvironmentWorker

    worker = EnvironmentWorker(1, 2, "gsm8k", "custom_envs:BuggyScorer", {})
    assert repr(worker) == "EnvironmentWorker(task='gsm8k', rank=1)"
    with pytest.raises(KeyError) as raised:  # its own type: the driver handles some by type (a nested actor's death)
        worker.score(["7"], [{"id": 5}])
    assert raised.value.__notes__ == ["raised by environment 'gsm8k' score; this actor's batch starts with metadata {'id': 5}"]
    with pytest.raises(ValueError, match=r"environment 'gsm8k' returned None, not a number, as a reward"):
        worker.score(["none"], [{"answer": "7"}])
    bad_counter = EnvironmentWorker(0, 1, "gsm8k", "custom_envs:BuggyScorer", {"bad_counter": True})
    with pytest.raises(ValueError, match=r"environment 'gsm8k' metrics\(\) returned 'many', not a number, as a 'scored'"):
        bad_counter.score(["7"], [{"answer": "7"}])
    # the same mistakes in a composite's source, or a custom reward function's, name it (bare TypeErrors from float())
    forgot = EnvironmentWorker(0, 1, "gsm8k", "arithmetic", {"custom_reward_fn": "custom_envs:reward_without_return"})
    with pytest.raises(ValueError, match=r"custom_reward_fn 'custom_envs:reward_without_return' returned None, not a number, as a reward"):
        forgot.score(["7"], [{"answer": "7"}])
    composite = EnvironmentWorker(0, 1, "gsm8k", "composite", {"sources": {"buggy": {"class": "custom_envs:BuggyScorer"}}})
    with pytest.raises(ValueError, match=r"reward source 'buggy' returned None, not a number, as a reward"):
        composite.score(["none"], [{"answer": "7"}])
    sources = {"buggy": {"class": "custom_envs:BuggyScorer", "bad_counter": True}}
    composite = EnvironmentWorker(0, 1, "gsm8k", "composite", {"sources": sources})
    with pytest.raises(ValueError, match=r"reward source 'buggy' metrics\(\) returned 'many', not a number, as a 'scored'"):
        composite.score(["7"], [{"answer": "7"}])


def test_an_async_runs_one_line_error_keeps_the_cause_before_the_environments_note() -> None:
    """The async collector's failure line was the last line of the error's text, which the environment's note had
    become: 'nemo-like: error: ... raised by environment ...' without the KeyError it was about."""
    import traceback

    from ray.exceptions import RayTaskError

    from nemo_like.environments.worker import EnvironmentWorker
    from nemo_like.experience.async_rollouts import loop_failure_cause

    worker = EnvironmentWorker(0, 1, "gsm8k", "custom_envs:BuggyScorer", {})
    try:
        worker.score(["7"], [{"id": 5}])
    except KeyError as exc:
        error = RayTaskError("score", "".join(traceback.format_exception(exc)), exc).as_instanceof_cause()
    line = loop_failure_cause(error)
    assert line.startswith("KeyError: 'answer'; raised by environment 'gsm8k' score"), line
    # the sync loop's gather re-raises it with the note once: Ray's message holds it already (it was printed twice)
    from nemo_like.distributed.supervision import drop_echoed_notes

    printed = "".join(traceback.format_exception(error))
    assert printed.count("raised by environment 'gsm8k' score") == 2
    drop_echoed_notes(error)
    assert (
        "".join(traceback.format_exception(error)).count("raised by environment 'gsm8k' score") == 1 and loop_failure_cause(error) == line
    )
    error.__notes__ = ["raised by environment 'gsm8k' score", "a note the message lacks"]
    drop_echoed_notes(error)
    assert error.__notes__ == ["a note the message lacks"]
