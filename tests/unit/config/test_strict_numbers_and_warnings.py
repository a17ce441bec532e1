"""Numeric keys refuse booleans (everywhere in the schema); ineffective options print one warning line."""

from __future__ import annotations

import operator
import re
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from nemo_like.cli import main
from nemo_like.config import ConfigError, load_config
from nemo_like.config.schema import MasterConfig

RECIPES = sorted((Path(__file__).resolve().parents[3] / "examples" / "configs").glob("*.yaml"))


def _numeric_keys(model: type[BaseModel], prefix: str = "", elements: bool = False) -> list[tuple[str, str]]:
    """(dotted key, 'number' | 'integer') of every int/float field, recursing into sections; ``elements``: also the
    first element of a tuple or list of numbers (``clip.0``)."""
    keys = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        args = (
            typing.get_args(annotation)
            if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union
            else (annotation,)
        )
        for arg in args:
            if typing.get_origin(arg) is typing.Annotated:
                arg = typing.get_args(arg)[0]
            if elements and typing.get_origin(arg) in (tuple, list):
                first = typing.get_args(arg)[0]
                first = typing.get_args(first)[0] if typing.get_origin(first) is typing.Annotated else first
                if first in (int, float):
                    keys.append((f"{prefix}{name}.0", "a number" if first is float else "an integer"))
            elif isinstance(arg, type) and issubclass(arg, BaseModel):
                keys += _numeric_keys(arg, f"{prefix}{name}.", elements)
            elif arg is float:
                keys.append((f"{prefix}{name}", "a number"))
            elif arg is int:
                keys.append((f"{prefix}{name}", "an integer"))
    return keys


NUMERIC_KEYS = _numeric_keys(MasterConfig)


def test_the_walk_finds_the_numeric_keys() -> None:
    found = dict(NUMERIC_KEYS)
    assert found["loss_fn.truncated_importance_sampling_ratio"] == "a number"
    assert found["loss_fn.reference_policy_kl_penalty"] == "a number"
    assert found["policy.optimizer.lr"] == "a number"
    assert found["grpo.num_prompts_per_step"] == "an integer"
    assert found["grpo.rollout_rejection.upper"] == "a number"
    assert len(found) > 45


@pytest.mark.parametrize(("key", "expected"), NUMERIC_KEYS, ids=[k for k, _ in NUMERIC_KEYS])
def test_a_boolean_is_rejected_for_every_numeric_key(key: str, expected: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(None, [f"{key}=true"], warn=False)
    assert f"{key}: expected {expected}, not a boolean (got True)" in str(excinfo.value)


def _environment_numeric_keys() -> list[tuple[str, str, str]]:
    """(environment, key, expected) of every int/float key of each built-in environment's ``env.<task>`` section."""
    from nemo_like.environments.registry import ENVIRONMENTS

    keys = []
    for name in ENVIRONMENTS:
        model = getattr(ENVIRONMENTS.get(name), "config_model", None)
        keys += [(name, key, expected) for key, expected in _numeric_keys(model, elements=True)] if model is not None else []
    return keys


ENV_NUMERIC_KEYS = _environment_numeric_keys()


def test_every_environment_section_refuses_a_boolean_for_its_numeric_keys() -> None:
    """The ``env.<task>`` sections are validated when the run resolves its environments (before any actor starts):
    ``env.tool.max_calls_per_turn: true`` was taken as 1, ``env.math.memory_mb: true`` as 1 MiB."""
    from nemo_like.environments.registry import resolve_environments

    assert {name for name, _, _ in ENV_NUMERIC_KEYS} >= {"math", "tool", "guess_number", "reward_model", "judge", "agent"}
    assert {("judge", "score_range.0"), ("reward_model", "normalize.clip.0")} <= {(n, k) for n, k, _ in ENV_NUMERIC_KEYS}
    for name, key, expected in ENV_NUMERIC_KEYS:
        *path, leaf = key.split(".")  # a nested section's key: env.reward_model.normalize.shift
        value: object = True
        if leaf.isdigit():  # a tuple's first element: env.judge.score_range.0
            *path, leaf = path
            value = [True, 1.0]
        section: dict = {}
        inner = section
        for part in path:
            inner = inner.setdefault(part, {})
        inner[leaf] = value
        cfg = MasterConfig.model_validate({"env": {name: section}})
        with pytest.raises(ConfigError) as excinfo:
            resolve_environments(cfg.env)
        assert f"env.{name}.{key}: expected {expected}, not a boolean (got True)" in str(excinfo.value), (name, key)


def test_list_and_tuple_elements_refuse_booleans_too() -> None:
    with pytest.raises(ConfigError, match=r"policy.optimizer.betas.0: expected a number, not a boolean"):
        load_config(None, ["policy.optimizer.betas=[true,0.99]"], warn=False)
    with pytest.raises(ConfigError, match=r"policy.generation.stop_token_ids.1: expected an integer"):
        load_config(None, ["policy.generation.stop_token_ids=[3,false]"], warn=False)


@pytest.mark.parametrize(
    ("betas", "message"),
    [("[0.9,1.0]", r"betas.1: Input should be less than 1"), ("[-0.1,0.99]", r"betas.0: .*greater than or equal to 0")],
)
def test_adam_betas_outside_zero_to_one_are_refused_by_key(betas: str, message: str) -> None:
    """beta2 = 1 never updates the second moment (steps divide by ~eps), > 1 diverges: refused, naming the element."""
    with pytest.raises(ConfigError, match=rf"policy.optimizer.{message}"):
        load_config(None, [f"policy.optimizer.betas={betas}"], warn=False)
    assert load_config(None, ["policy.optimizer.betas=[0,0.5]"], warn=False).policy.optimizer.betas == (0.0, 0.5)


def test_ints_are_still_numbers() -> None:
    cfg = load_config(None, ["policy.optimizer.lr=1", "loss_fn.reference_policy_kl_penalty=0", "loss_fn.ratio_clip_c=3"], warn=False)
    assert cfg.policy.optimizer.lr == 1.0 and isinstance(cfg.policy.optimizer.lr, float)
    assert cfg.loss_fn.ratio_clip_c == 3.0


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("key", ["policy.optimizer.lr", "grpo.rollout_rejection.upper", "loss_fn.reference_policy_kl_penalty"])
def test_non_finite_numbers_are_refused(key: str, value: str) -> None:
    """``nan`` passes every bound check (a rejection bound of nan kept every token) and no key means anything by inf."""
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}: Input should be a finite number"):
        load_config(None, [f"{key}={value}"], warn=False)


@pytest.mark.parametrize("key", ["data.system_prompt", "logger.wandb.name", "teacher.model_name", "policy.tokenizer_name"])
def test_none_spelled_as_text_is_refused_for_keys_that_take_null(key: str) -> None:
    """Overrides and YAML spell null ``null``: ``None`` reached the run as the text 'None' (a system prompt "None")."""
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}: write null \(or ~\) for no value"):
        load_config(None, [f"{key}=None"], warn=False)
    assert operator.attrgetter(key)(load_config(None, [f"{key}=null"], warn=False)) is None  # null is None, not 'null'


@pytest.mark.parametrize("key", ["checkpointing.keep_top_k", "policy.generation.top_k", "data.train.num_problems"])
def test_none_spelled_as_text_for_a_nullable_number_says_to_write_null(key: str) -> None:
    """It said only that 'None' is not an integer, though the key takes null."""
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}: Input should be a valid integer.*\(got 'None'\); write null \(or ~\)"):
        load_config(None, [f"{key}=None"], warn=False)
    with pytest.raises(ConfigError) as err:  # a key that takes no null is not told to write one
        load_config(None, ["grpo.max_num_steps=None"], warn=False)
    assert "write null" not in str(err.value)


# (overrides that make a key have no effect, the warning, overrides after which the key takes effect: no warning)
NO_EFFECT_CASES = [
    (
        ["grpo.reward_shaping.overlong_buffer_length=4"],
        "grpo.reward_shaping.overlong_buffer_length has no effect with grpo.reward_shaping.enabled=false",
        ["grpo.reward_shaping.enabled=true"],
    ),
    (  # the penalty starts past 20 - 4 = 16 sampled tokens: a 16-token response never reaches it (two turns would)
        [
            "grpo.reward_shaping.enabled=true",
            "grpo.reward_shaping.overlong_buffer_length=4",
            "grpo.reward_shaping.max_response_length=20",
            "policy.generation.max_new_tokens=16",
        ],
        "grpo.reward_shaping.enabled=true has no effect: the penalty starts past max_response_length - overlong_buffer_length "
        "= 16 sampled tokens, and a sample has at most policy.generation.max_new_tokens=16 = 16",
        ["grpo.max_rollout_turns=2"],
    ),
    (
        [
            "grpo.reward_shaping.enabled=true",
            "grpo.reward_shaping.overlong_buffer_length=4",
            "grpo.reward_shaping.overlong_buffer_penalty=0",
        ],
        "grpo.reward_shaping.enabled=true has no effect with grpo.reward_shaping.overlong_buffer_penalty=0",
        ["grpo.reward_shaping.overlong_buffer_penalty=0.5"],
    ),
    (  # micro-batches are token budgets: the sample counts are not read
        ["policy.sequence_packing.enabled=true", "policy.train_micro_batch_size=4"],
        "policy.train_micro_batch_size has no effect with policy.sequence_packing.enabled=true",
        ["policy.sequence_packing.enabled=false"],
    ),
    (
        ["policy.dynamic_batching.enabled=true", "policy.logprob_batch_size=8"],
        "policy.logprob_batch_size has no effect with policy.dynamic_batching.enabled=true",
        ["policy.dynamic_batching.enabled=false"],
    ),
    (
        ["cluster.fault_tolerance.on_stall=abort"],
        "cluster.fault_tolerance.on_stall=abort has no effect with cluster.fault_tolerance.stall_timeout_s and setup_timeout_s null",
        ["cluster.fault_tolerance.stall_timeout_s=600"],
    ),
    (  # the start's watchdog acts on it too
        ["cluster.fault_tolerance.on_stall=abort"],
        "cluster.fault_tolerance.on_stall=abort has no effect",
        ["cluster.fault_tolerance.setup_timeout_s=600"],
    ),
    (  # the watchdog reports (and with abort, ends) a hung call before its deadline replaces the actor
        ["cluster.fault_tolerance.stall_timeout_s=60", "cluster.fault_tolerance.call_timeout_s=60"],
        "cluster.fault_tolerance.call_timeout_s=60 has no effect past cluster.fault_tolerance.stall_timeout_s=60",
        ["cluster.fault_tolerance.stall_timeout_s=600"],
    ),
    (
        ["cluster.fault_tolerance.max_restarts=5"],
        "cluster.fault_tolerance.max_restarts=5 has no effect with checkpointing.enabled=false",
        ["checkpointing.enabled=true"],
    ),
    (
        ["loss_fn.force_on_policy_ratio=true", "grpo.skip_prev_logprobs=false"],
        "grpo.skip_prev_logprobs=false has no effect with loss_fn.force_on_policy_ratio=true",
        ["loss_fn.force_on_policy_ratio=false"],
    ),
    (
        ["policy.sequence_packing.train_mb_tokens=256"],
        "policy.sequence_packing.train_mb_tokens has no effect with policy.sequence_packing.enabled=false",
        ["policy.sequence_packing.enabled=true"],
    ),
    (
        ["policy.dynamic_batching.logprob_mb_tokens=256"],
        "policy.dynamic_batching.logprob_mb_tokens has no effect with policy.dynamic_batching.enabled=false",
        ["policy.dynamic_batching.enabled=true"],
    ),
    (
        ["checkpointing.keep_top_k=5"],
        "checkpointing.keep_top_k has no effect with checkpointing.enabled=false",
        ["checkpointing.enabled=true"],
    ),
    (["logger.wandb.project=x"], "logger.wandb.project has no effect with logger.wandb_enabled=false", ["logger.wandb_enabled=true"]),
    (
        ["grpo.dynamic_sampling_max_gen_batches=20"],
        "grpo.dynamic_sampling_max_gen_batches has no effect with grpo.use_dynamic_sampling=false",
        ["grpo.use_dynamic_sampling=true"],
    ),
    (
        ["logger.num_val_samples_to_print=4", "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false"],
        "logger.num_val_samples_to_print has no effect: validation never runs",
        ["grpo.val_at_end=true"],
    ),
    (
        ["grpo.val_greedy=true", "grpo.max_val_samples=16", "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false"],
        "grpo.val_greedy has no effect: validation never runs",
        ["grpo.val_period=5"],
    ),
    (
        ["cluster.ray_address=10.0.0.1:6379", "cluster.num_cpus=64"],
        "cluster.num_cpus has no effect with cluster.ray_address set",
        ["cluster.ray_address=null"],
    ),
    (
        ["checkpointing.enabled=true", "checkpointing.keep_top_k=null", "checkpointing.higher_is_better=false"],
        "checkpointing.higher_is_better has no effect with checkpointing.keep_top_k=null",
        ["checkpointing.keep_top_k=3"],
    ),
    (
        ["checkpointing.enabled=true", "checkpointing.metric_name=null", "checkpointing.higher_is_better=false"],
        "checkpointing.higher_is_better has no effect with checkpointing.metric_name=null",
        ["checkpointing.metric_name=train:loss", "checkpointing.keep_top_k=3"],
    ),
    (
        [
            "checkpointing.enabled=true",
            "checkpointing.metric_name=val:pass@1",
            "grpo.val_period=0",
            "grpo.val_at_start=false",
            "grpo.val_at_end=false",
        ],
        "checkpointing.metric_name='val:pass@1' has no effect: validation never runs",
        ["grpo.val_at_end=true"],
    ),
    (
        ["grpo.adv_estimator.name=rloo", "grpo.use_leave_one_out_baseline=true"],
        "grpo.use_leave_one_out_baseline has no effect with grpo.adv_estimator.name='rloo'",
        ["grpo.adv_estimator.name=grpo"],
    ),
    (
        ["grpo.adv_estimator.name=dr_grpo", "grpo.normalize_rewards=false"],
        "grpo.normalize_rewards has no effect with grpo.adv_estimator.name='dr_grpo'",
        ["grpo.adv_estimator.name=grpo"],
    ),
    (
        ["grpo.adv_estimator.name=dr_grpo", "grpo.advantage_std_epsilon=0.05"],
        "grpo.advantage_std_epsilon has no effect with grpo.adv_estimator.name='dr_grpo'",
        ["grpo.adv_estimator.name=rloo"],
    ),
    (
        ["grpo.normalize_rewards=false", "grpo.advantage_std_epsilon=0.05"],
        "grpo.advantage_std_epsilon has no effect with grpo.normalize_rewards=false",
        ["grpo.normalize_rewards=true"],
    ),
]


@pytest.mark.parametrize("overrides, warning, working", NO_EFFECT_CASES, ids=[w.split(" has")[0] for _, w, _ in NO_EFFECT_CASES])
def test_keys_under_a_switch_that_is_off_warn(overrides: list[str], warning: str, working: list[str]) -> None:
    """Each case warns, and once the key takes effect (``working``, applied after) the warning is gone: a check that
    warned whatever the combination would pass the first half alone."""
    lines = load_config(None, overrides, warn=False).no_effect_warnings()
    assert [line for line in lines if line.startswith(warning)] != [], lines
    key = warning.split(" has no effect")[0]
    lines = load_config(None, [*overrides, *working], warn=False).no_effect_warnings()
    assert not [line for line in lines if line.startswith(key) and "no effect" in line], lines


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_shipped_recipes_load_without_warnings(recipe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--config", str(recipe), "--dry-run"]) == 0
    assert "[config] warning" not in capsys.readouterr().err


def _recipe(tmp_path: Path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


def test_force_on_policy_ratio_on_a_clip_higher_recipe_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = _recipe(tmp_path, "defaults: " + str(RECIPES[-1].parent / "grpo_tiny_cpu.yaml") + "\nloss_fn:\n  ratio_clip_max: 0.28\n")
    for argv in (["--dry-run"], ["--dry-run", "grpo.max_num_steps=1"]):
        assert main(["train", "--config", recipe, *argv, "loss_fn.force_on_policy_ratio=true"]) == 0
        err = capsys.readouterr().err
        assert err.splitlines() == [
            "[config] warning: loss_fn.ratio_clip_max has no effect because loss_fn.force_on_policy_ratio=true (ignored)",
            "[config] warning: loss_fn.force_on_policy_ratio has no effect because the run takes one optimizer step per rollout "
            "(policy.train_global_batch_size = grpo.num_prompts_per_step x grpo.num_generations_per_prompt), so pi/pi_prev = 1 "
            "on every token already",
        ]


def test_kl_penalty_zero_on_a_recipe_with_kl_clamps_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = _recipe(
        tmp_path,
        "loss_fn:\n  reference_policy_kl_penalty: 0.01\n  kl_input_clamp_value: 5.0\n  kl_output_clamp_value: 2.0\n",
    )
    assert main(["train", "--config", recipe, "--dry-run", "loss_fn.reference_policy_kl_penalty=0"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "[config] warning: loss_fn.kl_input_clamp_value has no effect because loss_fn.reference_policy_kl_penalty=0 (ignored)",
        "[config] warning: loss_fn.kl_output_clamp_value has no effect because loss_fn.reference_policy_kl_penalty=0 (ignored)",
    ]


def test_contradictions_stay_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--dry-run", "loss_fn.use_cispo=true", "loss_fn.ratio_clip_c=3"]) == 2
    assert "loss_fn.use_cispo and loss_fn.ratio_clip_c are exclusive" in capsys.readouterr().err
    assert main(["train", "--dry-run", "loss_fn.token_level_loss=false", "loss_fn.loss_aggregation=token-sum"]) == 2
    err = capsys.readouterr().err
    assert "loss_fn.token_level_loss=false" in err and "loss_fn.loss_aggregation='token-sum'" in err


@pytest.mark.parametrize(
    "overrides, blocker",
    [
        (("grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"), "grpo.async_grpo.enabled=true"),
        (("grpo.use_dynamic_sampling=true",), "grpo.use_dynamic_sampling=true"),
    ],
)
def test_turning_off_scoring_overlap_where_it_never_happens_warns(overrides: tuple[str, ...], blocker: str) -> None:
    cfg = load_config(None, ["grpo.overlap_scoring=false", *overrides], warn=False)
    assert f"grpo.overlap_scoring=false has no effect with {blocker} (scoring never overlaps there)" in cfg.no_effect_warnings()
    assert not any("overlap_scoring" in w for w in load_config(None, ["grpo.overlap_scoring=false"], warn=False).no_effect_warnings())


def test_in_flight_refits_at_age_bound_zero_warn() -> None:
    """At max_trajectory_age_steps=0 no batch is generating when a refit comes: in-flight updates never happen."""
    common = [
        "grpo.async_grpo.enabled=true",
        "loss_fn.use_importance_sampling_correction=true",
        "grpo.async_grpo.in_flight_weight_updates=true",
    ]
    zero = load_config(None, [*common, "grpo.async_grpo.max_trajectory_age_steps=0"], warn=False).no_effect_warnings()
    assert any(w.startswith("grpo.async_grpo.in_flight_weight_updates=true has no effect") for w in zero)
    one = load_config(None, [*common, "grpo.async_grpo.max_trajectory_age_steps=1"], warn=False).no_effect_warnings()
    assert not any("in_flight_weight_updates" in w for w in one)


def test_async_keys_of_a_sync_run_warn() -> None:
    """The bound and in-flight refits do nothing while grpo.async_grpo.enabled=false: that was silent."""
    lines = load_config(
        None, ["grpo.async_grpo.max_trajectory_age_steps=3", "grpo.async_grpo.in_flight_weight_updates=true"], warn=False
    ).no_effect_warnings()
    assert [w for w in lines if w.startswith("grpo.async_grpo")] == [
        "grpo.async_grpo.max_trajectory_age_steps has no effect with grpo.async_grpo.enabled=false (a sync run)",
        "grpo.async_grpo.in_flight_weight_updates has no effect with grpo.async_grpo.enabled=false (a sync run)",
    ]
    assert not [w for w in load_config(None, [], warn=False).no_effect_warnings() if w.startswith("grpo.async_grpo")]


def test_an_async_kl_penalty_without_the_on_policy_weight_warns_that_it_is_biased() -> None:
    """Async tokens come from older weights: weighted by 1 the k-estimators estimate the KL under pi_gen, not pi_curr."""
    on = ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true", "loss_fn.reference_policy_kl_penalty=0.01"]

    def kl_lines(*extra: str) -> list[str]:
        return [w for w in load_config(None, [*on, *extra], warn=False).no_effect_warnings() if "use_on_policy_kl" in w]

    (line,) = kl_lines()
    assert line.startswith("loss_fn.use_on_policy_kl_approximation=false with grpo.async_grpo.enabled=true") and "(biased)" in line
    assert kl_lines("loss_fn.use_on_policy_kl_approximation=true") == []
    assert kl_lines("loss_fn.reference_policy_kl_penalty=0") == []


def test_a_split_or_config_for_a_single_local_file_warns(tmp_path: Path) -> None:
    """One .jsonl file is one split: data.<split>.split and .dataset_config were ignored silently."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "1+1?", "answer": "2"}\n')
    common = [f"data.train.data_path={rows}", f"data.validation.data_path={rows}", "data.prompt_key=question", "data.answer_key=answer"]
    lines = load_config(None, [*common, "data.train.split=test", "data.train.dataset_config=main"], warn=False).no_effect_warnings()
    assert [w.split(":")[0] for w in lines if w.startswith("data.")] == [
        "data.train.split has no effect",
        "data.train.dataset_config has no effect",
    ]
    assert not any(w.startswith("data.") for w in load_config(None, common, warn=False).no_effect_warnings())


def test_a_train_seed_without_shuffle_warns(tmp_path: Path) -> None:
    """data.shuffle=false trains a dataset's rows in file order: a data.train.seed set beside it shuffles nothing."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "1+1?", "answer": "2"}\n')
    common = [f"data.train.data_path={rows}", "data.prompt_key=question", "data.answer_key=answer", "data.shuffle=false"]

    def data_lines(overrides: list[str]) -> list[str]:
        return [w for w in load_config(None, overrides, warn=False).no_effect_warnings() if w.startswith("data.train.seed")]

    assert data_lines([*common, "data.train.seed=7"]) == [
        "data.train.seed=7 has no effect: data.shuffle=false trains the rows in file order (the seed only shuffles them)"
    ]
    assert data_lines(common) == []  # the default seed: nothing was set
    assert data_lines([*common[:3], "data.train.seed=7"]) == []  # shuffled: the seed picks the order
    assert data_lines(["data.shuffle=false", "data.train.seed=7"]) == []  # the arithmetic generator's seed


def test_validation_rows_past_max_val_samples_warn_and_the_cut_is_said(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """grpo.max_val_samples cut the validation prompts silently, and the printed hint named data.validation.num_problems,
    whose null or larger value changed nothing."""
    from nemo_like.algorithms.setup import load_validation_prompts
    from nemo_like.models.loading import load_tokenizer

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"question": "{i} + 1", "answer": "{i + 1}"}}\n' for i in range(10)))
    common = [f"data.validation.data_path={rows}", "data.prompt_key=question", "data.answer_key=answer", "grpo.max_val_samples=4"]

    def val_lines(overrides: list[str]) -> list[str]:
        return [w for w in load_config(None, overrides, warn=False).no_effect_warnings() if w.startswith("data.validation.num")]

    assert val_lines([*common, "data.validation.num_problems=9"]) == [
        "data.validation.num_problems=9 has no effect past grpo.max_val_samples=4: validation uses the first 4 prompts; "
        "raise grpo.max_val_samples to use more"
    ]
    assert val_lines([*common, "data.validation.num_problems=4"]) == []
    assert val_lines([*common, "data.validation.num_problems=null"]) == []  # all rows: the set may hold no more
    assert val_lines([]) == []  # the defaults: 256 and 256
    cfg = load_config(None, [*common, "data.validation.num_problems=null"], warn=False)
    assert len(load_validation_prompts(cfg, load_tokenizer(cfg.policy.model_name))) == 4
    assert "data.validation: using the first 4 of 10 prompts (grpo.max_val_samples)" in capsys.readouterr().out


def test_greedy_validation_with_several_samples_per_prompt_warns_that_pass_at_k_is_accuracy() -> None:
    greedy = ["grpo.val_greedy=true", "grpo.val_num_generations_per_prompt=4"]
    assert any(
        "validation/pass@k equals validation/accuracy" in line for line in load_config(None, greedy, warn=False).no_effect_warnings()
    )
    for working in (["grpo.val_greedy=false"], ["grpo.val_num_generations_per_prompt=1"]):
        lines = load_config(None, [*greedy, *working], warn=False).no_effect_warnings()
        assert not any("pass@k equals" in line for line in lines), lines


def test_val_pass_k_with_one_validation_sample_warns() -> None:
    """One sample per validation prompt logs no validation/pass@k (accuracy is pass@1): a val_pass_k set there did nothing."""
    lines = load_config(None, ["grpo.val_pass_k=[1]"], warn=False).no_effect_warnings()
    assert [w for w in lines if w.startswith("grpo.val_pass_k")] == [
        "grpo.val_pass_k=[1] has no effect with grpo.val_num_generations_per_prompt=1 (validation/pass@1 is "
        "validation/accuracy then; raise the generations to log pass@k)"
    ]
    two = load_config(None, ["grpo.val_pass_k=[1,2]", "grpo.val_num_generations_per_prompt=2"], warn=False)
    assert not [w for w in two.no_effect_warnings() if w.startswith("grpo.val_pass_k")]


def test_one_sample_per_prompt_warns_that_no_advantage_moves_the_policy_and_dynamic_sampling_refuses_it() -> None:
    """G=1 with a group baseline: every advantage is 0 (a run that trained on nothing but the KL term, silently)."""
    lines = load_config(None, ["grpo.num_generations_per_prompt=1"], warn=False).no_effect_warnings()
    assert [w for w in lines if w.startswith("grpo.num_generations_per_prompt")] == [
        "grpo.num_generations_per_prompt=1: every advantage is 0 with grpo.adv_estimator.name='grpo' (a sample is its own "
        "group's baseline), so the policy-gradient term never moves the policy; use 2 or more samples per prompt"
    ]
    for quiet in (
        ["grpo.num_generations_per_prompt=2"],
        ["grpo.num_generations_per_prompt=1", "grpo.adv_estimator.name=my_pkg.adv:reinforce"],  # user code: its own baseline
        ["grpo.num_generations_per_prompt=1", "teacher.model_name=embedded:tiny-arith-teacher", "distillation.kl_weight=0.1"],
    ):
        lines = load_config(None, quiet, warn=False).no_effect_warnings()
        assert not [w for w in lines if w.startswith("grpo.num_generations_per_prompt")], quiet
    with pytest.raises(ConfigError, match=r"grpo.use_dynamic_sampling=true needs grpo.num_generations_per_prompt >= 2"):
        load_config(None, ["grpo.num_generations_per_prompt=1", "grpo.use_dynamic_sampling=true"])


def test_training_on_a_file_while_validation_stays_the_arithmetic_task_warns() -> None:
    """data.train.data_path alone on the default recipe: validation/accuracy silently measured the synthetic task."""

    def lines(overrides: list[str]) -> list[str]:
        return [w for w in load_config(None, overrides, warn=False).no_effect_warnings() if w.startswith("data.validation is")]

    assert lines(["data.train.data_path=my.jsonl"]) == [
        "data.validation is the built-in arithmetic task (data.dataset_name='arithmetic') while the run trains on "
        "data.train.data_path='my.jsonl': validation/accuracy measures arithmetic, not that data. Set "
        "data.validation.data_path or data.validation.split_fraction, or data.validation.dataset_name=arithmetic to keep it"
    ]
    assert lines(["data.train.dataset_name=math-tiny"])[0].endswith("arithmetic to keep it")
    for quiet in (
        [],  # both arithmetic
        ["data.train.data_path=my.jsonl", "data.validation.split_fraction=0.1"],
        ["data.train.data_path=my.jsonl", "data.validation.data_path=val.jsonl"],
        ["data.train.data_path=my.jsonl", "data.validation.dataset_name=arithmetic"],  # asked for
        ["data.dataset_name=math-tiny"],
    ):
        assert lines(quiet) == [], quiet


@pytest.mark.parametrize(
    "key",
    [
        "loss_fn.ratio_clip_max=0.28",
        "loss_fn.ratio_clip_c=3.0",
        "loss_fn.use_cispo=true",
        "loss_fn.disable_ppo_ratio=true",
        "loss_fn.surrogate=reinforce",
        "loss_fn.surrogate=unclipped",
        "loss_fn.force_on_policy_ratio=true",
    ],
)
def test_clip_and_surrogate_settings_warn_when_every_ratio_is_one(key: str) -> None:
    """One optimizer step per rollout (the default) skips the prev pass: pi/pi_prev is exactly 1, as with
    force_on_policy_ratio, which warned (CISPO: refused) while the default case accepted a ported clip-higher silently.
    At a ratio of 1 every built-in surrogate has PPO's gradient: a PPO-against-REINFORCE ablation trained the same
    weights (only train/loss's value differed) without a word."""
    name = key.split("=")[0]
    one_step = load_config(None, [key], warn=False)
    assert one_step.optimizer_steps_per_rollout == 1
    assert [line for line in one_step.no_effect_warnings() if line.startswith(name) and "one optimizer step per rollout" in line]
    # The prev pass (here for a sequence-level rejection) runs in eval mode, the loss's forward with LoRA's dropout:
    # the ratio is not 1 then, and the clip bounds it.
    dropout = ["policy.lora_cfg.enabled=true", "policy.lora_cfg.dropout=0.1", "grpo.seq_logprob_error_threshold=2.0"]
    assert not [line for line in load_config(None, [key, *dropout], warn=False).no_effect_warnings() if line.startswith(name)]
    if name == "loss_fn.force_on_policy_ratio":
        return  # it requires one step per rollout (refused with two)
    half = one_step.rollout_batch_size // 2
    two_steps = load_config(None, [key, f"policy.train_global_batch_size={half}"], warn=False)
    assert not [line for line in two_steps.no_effect_warnings() if line.startswith(name)]


def test_no_recipe_in_a_non_editable_install_says_to_pass_one(monkeypatch, tmp_path) -> None:
    """A pip-installed (non-editable) package has no examples/ beside it: 'Recipe file not found: .../site-packages/
    examples/...' named a path inside site-packages and no way out."""
    import nemo_like.config as config_module

    monkeypatch.setattr(config_module, "DEFAULT_RECIPE", tmp_path / "examples" / "configs" / "grpo_tiny_cpu.yaml")
    with pytest.raises(ConfigError, match=r"No recipe given, and the embedded default recipe .* pass --config FILE"):
        config_module.load_config(None, [], warn=False)


def test_a_response_budget_that_leaves_no_room_for_a_prompt_is_refused_at_load() -> None:
    """Single-turn runs accepted max_total_sequence_length <= max_new_tokens and failed at data build with a negative
    budget, advising data.drop_long_prompts (which then dropped every prompt)."""
    with pytest.raises(ConfigError, match=r"policy.max_total_sequence_length \(8\) must exceed policy.generation.max_new_tokens \(16\)"):
        load_config(None, ["policy.max_total_sequence_length=8", "policy.generation.max_new_tokens=16"], warn=False)


@pytest.mark.parametrize(
    ("key", "value", "bound"),
    [
        ("grpo.seed", "-1", "greater than or equal to 0"),
        ("grpo.seed", "4294967296", "less than 4294967296"),
        ("eval.seed", "-3", "greater than or equal to 0"),
    ],
)
def test_seeds_outside_what_the_samplers_take_are_refused_by_key(key: str, value: str, bound: str) -> None:
    """The vLLM engine seeds numpy with grpo.seed (0 <= seed < 2**32) and a millisecond timestamp's derived sampling
    seeds overflowed torch's generator: both crashed at the first generate call, after Ray and the policy had started."""
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}: Input should be {bound}"):
        load_config(None, [f"{key}={value}"], warn=False)
    assert load_config(None, ["grpo.seed=4294967295"], warn=False).grpo.seed == 2**32 - 1


def test_a_warmup_as_long_as_the_run_is_warned_about() -> None:
    """policy.scheduler.warmup_steps=1000 in a 100-step run trained every step below a tenth of policy.optimizer.lr,
    and nothing said so. The lr factor of 0-based optimizer step s is (s + 1) / (warmup + 1)."""

    def warmup_lines(overrides: list[str]) -> list[str]:
        return [w for w in load_config(None, overrides, warn=False).no_effect_warnings() if w.startswith("policy.scheduler")]

    assert warmup_lines(["policy.scheduler.warmup_steps=1000", "grpo.max_num_steps=100"]) == [
        "policy.scheduler.warmup_steps=1000 is not shorter than the run's 100 optimizer steps (grpo.max_num_steps x 1 per "
        "rollout): its last step trains at 0.0999 x policy.optimizer.lr, never at the peak"
    ]
    assert warmup_lines(["policy.scheduler.warmup_steps=99", "grpo.max_num_steps=100"]) == []  # step 99 trains at the peak
    two_per_rollout = ["policy.scheduler.warmup_steps=150", "grpo.max_num_steps=100", "policy.train_global_batch_size=32"]
    assert warmup_lines(two_per_rollout) == []  # 200 optimizer steps


def test_a_micro_batch_larger_than_a_ranks_share_of_a_step_says_what_it_holds() -> None:
    """An ablation of the global batch (64 -> 16) kept the recipe's micro-batch of 32, capped at 16 without a word."""
    lines = load_config(None, ["policy.train_global_batch_size=16"], warn=False).no_effect_warnings()
    assert (
        "policy.train_micro_batch_size=32 is more than a rank's share of an optimizer step (policy.train_global_batch_size / "
        "policy.dp_size = 16): its micro-batches hold 16 samples"
    ) in lines
    quiet = load_config(None, ["policy.train_global_batch_size=32"], warn=False).no_effect_warnings()
    assert not [line for line in quiet if "train_micro_batch_size" in line]
    packed = ["policy.train_global_batch_size=16", "policy.sequence_packing.enabled=true"]  # token budgets: another line
    assert not [line for line in load_config(None, packed, warn=False).no_effect_warnings() if "rank's share" in line]
