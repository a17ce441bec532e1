"""Recipe loading: defaults inheritance, _override_, interpolation, overrides and error messages."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nemo_like.cli import main
from nemo_like.config import ConfigError, load_config, resolve_config_dict
from nemo_like.config.loader import load_recipe_dict
from nemo_like.config.overrides import apply_overrides

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "examples" / "configs" / "grpo_tiny_cpu.yaml"
MATH_1B = REPO / "examples" / "configs" / "grpo_math_1B.yaml"
TINY_ASYNC = REPO / "examples" / "configs" / "grpo_tiny_cpu_async.yaml"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults_inheritance_later_wins_and_override_marker(tmp_path):
    write(tmp_path / "a.yaml", "grpo:\n  max_num_steps: 1\n  seed: 7\npolicy:\n  optimizer:\n    lr: 0.1\n    weight_decay: 0.5\n")
    write(tmp_path / "b.yaml", "grpo:\n  max_num_steps: 2\n")
    child = write(
        tmp_path / "child.yaml",
        "defaults: [a.yaml, b.yaml]\ngrpo:\n  val_period: 3\npolicy:\n  optimizer:\n    _override_: true\n    lr: 0.2\n",
    )
    raw = load_recipe_dict(child)
    assert raw["grpo"] == {"max_num_steps": 2, "seed": 7, "val_period": 3}  # b beats a, child adds
    assert raw["policy"]["optimizer"] == {"lr": 0.2}  # replaced, weight_decay gone


def test_two_parents_sharing_a_base_apply_it_once_and_bad_chains_name_the_file(tmp_path):
    """Each parent was loaded with its whole chain: the second parent's copy of the shared base undid the first parent's
    keys (the shipped LoRA + async recipes together trained LoRA at the full fine-tuning lr)."""
    shipped = Path(__file__).resolve().parents[3] / "examples" / "configs"
    both = write(tmp_path / "both.yaml", f"defaults: [{shipped / 'grpo_tiny_cpu_lora.yaml'}, {shipped / 'grpo_tiny_cpu_async.yaml'}]\n")
    lora = load_recipe_dict(shipped / "grpo_tiny_cpu_lora.yaml")
    raw = load_recipe_dict(both)
    assert (
        raw["policy"]["optimizer"]["lr"]
        == lora["policy"]["optimizer"]["lr"]
        != load_recipe_dict(shipped / "grpo_tiny_cpu.yaml")["policy"]["optimizer"]["lr"]
    )
    assert raw["policy"]["lora_cfg"]["enabled"] is True and raw["grpo"]["async_grpo"]["enabled"] is True
    write(tmp_path / "mid.yaml", "defaults: base_typo.yaml\n")  # a missing parent: the recipe naming it is named
    with pytest.raises(ConfigError, match=r"mid.yaml: defaults names 'base_typo.yaml', which is not a file"):
        load_recipe_dict(write(tmp_path / "child.yaml", "defaults: mid.yaml\n"))
    bad_marker = write(tmp_path / "m.yaml", "defaults: b.yaml\ngrpo:\n  _override_: 'false'\n  seed: 1\n")
    write(tmp_path / "b.yaml", "grpo:\n  max_num_steps: 2\n")
    with pytest.raises(ConfigError, match=r"'grpo._override_' must be true or false, got 'false'"):
        load_recipe_dict(bad_marker)


def test_schema_keys_missing_from_the_recipe_can_be_overridden_without_plus(tmp_path):
    recipe = write(tmp_path / "r.yaml", "grpo:\n  seed: 1\n")
    cfg = load_config(recipe, ["grpo.val_greedy=true"])
    assert cfg.grpo.val_greedy is True and cfg.grpo.seed == 1


def test_defaults_as_single_string_relative_to_child(tmp_path):
    (tmp_path / "sub").mkdir()
    write(tmp_path / "base.yaml", "grpo:\n  seed: 3\n")
    child = write(tmp_path / "sub" / "c.yaml", "defaults: ../base.yaml\n")
    assert load_recipe_dict(child)["grpo"]["seed"] == 3


def test_interpolation_follows_overrides_and_resolvers(tmp_path):
    raw = resolve_config_dict(TINY, ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2"])
    assert raw["policy"]["train_global_batch_size"] == 8
    write(tmp_path / "r.yaml", "x: 6\ny: ${div:${x},4}\nz: ${max:${x},9,2}\nw: ${add:${x},1}\n")
    raw = resolve_config_dict(tmp_path / "r.yaml")
    assert (raw["y"], raw["z"], raw["w"]) == (1.5, 9, 7)


def test_resolvers_read_quoted_numbers_as_numbers_and_refuse_text(tmp_path):
    """``mul`` repeated a quoted number (8 x '4' was '44444444') and ``max`` compared texts ('8' > '16')."""
    raw = resolve_config_dict(TINY, ["grpo.num_prompts_per_step='4'"])
    assert raw["policy"]["train_global_batch_size"] == 4 * raw["grpo"]["num_generations_per_prompt"]
    write(tmp_path / "r.yaml", "a: '8'\nb: '16'\nm: ${max:${a},${b}}\ns: ${add:${a},${b}}\nbad: ${mul:${a},many}\n")
    with pytest.raises(ConfigError, match="takes numbers, got the text 'many'"):
        resolve_config_dict(tmp_path / "r.yaml")
    raw = resolve_config_dict(tmp_path / "r.yaml", ["~bad"])
    assert (raw["m"], raw["s"]) == (16, 24)
    # The error named only the interpolating key (policy.train_global_batch_size), not the one the user set.
    with pytest.raises(ConfigError) as caught:
        resolve_config_dict(TINY, ["grpo.num_prompts_per_step=abc"])
    assert "policy.train_global_batch_size: ${mul:${grpo.num_prompts_per_step},${grpo.num_generations_per_prompt}}" in str(caught.value)
    assert "reads grpo.num_prompts_per_step = 'abc', grpo.num_generations_per_prompt = " in str(caught.value)


def test_zero_padded_integers_in_a_recipe_are_decimal_as_on_the_command_line(tmp_path):
    """YAML 1.1 reads a leading 0 as octal: ``seed: 0042`` was 34 while ``grpo.seed=0042`` is 42."""
    recipe = write(tmp_path / "r.yaml", "grpo:\n  seed: 0042\n  max_num_steps: 010\nx: [0x1F, 0o17, 0b11, -010, 1_000, 0]\n")
    raw = resolve_config_dict(recipe)
    assert (raw["grpo"]["seed"], raw["grpo"]["max_num_steps"]) == (42, 10)
    assert raw["x"] == [31, 15, 3, -10, 1000, 0]
    assert load_config(TINY, ["grpo.seed=0042"], warn=False).grpo.seed == 42  # the override, as the schema reads it


def test_override_grammar_add_force_delete():
    raw = resolve_config_dict(TINY, ["+grpo.extra_key=5", "++grpo.seed=9", "++grpo.other=1", "~logger.tensorboard_enabled"])
    assert raw["grpo"]["extra_key"] == 5 and raw["grpo"]["seed"] == 9 and raw["grpo"]["other"] == 1
    assert "tensorboard_enabled" not in raw["logger"]
    with pytest.raises(ConfigError, match="already exists"):
        resolve_config_dict(TINY, ["+grpo.seed=1"])
    with pytest.raises(ConfigError, match="not in the recipe"):
        resolve_config_dict(TINY, ["~grpo.nope"])


def test_a_list_element_is_a_key_of_the_recipe():
    """An element was never found (only mappings were walked): ``betas.1=0.95`` was refused as no key of the recipe
    (its hint: '+'), and ``+betas.1=0.95`` silently overwrote the element '+' promises not to touch."""
    assert load_config(TINY, ["policy.optimizer.betas.1=0.95"]).policy.optimizer.betas == (0.9, 0.95)
    with pytest.raises(ConfigError, match="already exists"):
        resolve_config_dict(TINY, ["+policy.optimizer.betas.1=0.95"])
    for override in ("policy.optimizer.betas.2=0.9", "+policy.optimizer.betas.x=0.9"):
        with pytest.raises(ConfigError, match=r"'policy.optimizer.betas' is a list of 2 \(indices 0-1\).*write the whole list"):
            resolve_config_dict(TINY, [override])
    assert resolve_config_dict(TINY, ["~policy.optimizer.betas.0"])["policy"]["optimizer"]["betas"] == [0.999]


def test_unknown_override_key_suggests_the_right_one():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["grpo.num_prompt_per_step=4"])
    assert "grpo.num_prompt_per_step" in str(err.value) and "grpo.num_prompts_per_step" in str(err.value)


def test_a_key_of_an_empty_mapping_is_told_to_add_it_not_sent_to_another_section():
    """teacher.by_task's keys are the user's task names: the hint sent 'teacher.by_task.arithmetic' to env.arithmetic."""
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["teacher.by_task.arithmetic=embedded:tiny-arith-teacher"])
    assert str(err.value) == (
        "Override 'teacher.by_task.arithmetic=embedded:tiny-arith-teacher': 'teacher.by_task' is empty: use "
        "'+teacher.by_task.arithmetic=...' to add the key 'arithmetic' to it."
    )


@pytest.mark.parametrize(
    ("override", "suggested", "plus"),
    [
        # compared whole, every key of a section shares its prefix: these suggested optimizer.name, top_p, dp_size
        ("policy.optimizer.learning_rate=1e-4", "policy.optimizer.lr", False),
        ("+policy.optimizer.learning_rate=1e-4", "policy.optimizer.lr", False),  # the schema's check: the same suggestion
        ("policy.generation.temp=0.5", "policy.generation.temperature", False),
        ("grpo.group_size=4", "grpo.num_generations_per_prompt", False),
        # the right key in another section, or a new section (the README's '+env.math...'): '+' stays a way
        ("policy.max_num_steps=3", "grpo.max_num_steps", True),
        ("env.math.num_workers=1", "env.arithmetic.num_workers", True),
    ],
)
def test_an_unknown_key_suggests_its_sections_key_or_a_peers_name_for_it(override, suggested, plus):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [override])
    assert f"Did you mean '{suggested}'?" in str(err.value) and ("Use '+" in str(err.value)) == plus
    with pytest.raises(ConfigError, match=r"'grpo.zzz' is not a key of the recipe. \(Use '\+grpo.zzz=...' to add a key"):
        load_config(TINY, ["grpo.zzz=1"])  # nothing close: how to add a key instead


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        # several sections share the last part: the hint named only the last listed, and following it switched on
        # distillation (teacher.model_name), checkpointing (for grpo.lora.enabled) or changed the validation data only
        ("model_name=x", "Did you mean one of 'policy.model_name', 'teacher.model_name'?"),
        ("dataset_name=gsm8k", "Did you mean one of 'data.dataset_name', 'data.train.dataset_name', 'data.validation.dataset_name'?"),
        ("grpo.lora.enabled=true", "Did you mean 'policy.lora_cfg.enabled'?"),  # the path's 'lora' decides
        ("grpo.kl_coef=0.1", "Did you mean 'loss_fn.reference_policy_kl_penalty'?"),  # a peer's name, one section has it
    ],
)
def test_a_key_in_the_wrong_section_lists_every_section_that_has_it_unless_the_path_decides(override, hint):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [override])
    assert hint in str(err.value)


def test_added_unknown_key_is_rejected_by_the_schema_with_suggestion():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["+policy.generation.max_new_token=3"])
    assert "policy.generation.max_new_token: unknown key" in str(err.value)
    assert "policy.generation.max_new_tokens" in str(err.value)


def test_a_dotted_key_written_in_a_recipe_says_recipes_nest_keys(tmp_path):
    """'grpo.max_num_steps: 10' in a recipe is one key named with dots: it was reported as an unknown key under its own,
    correct dotted name."""
    recipe = tmp_path / "dotted.yaml"
    recipe.write_text(f"defaults: {TINY}\ngrpo.max_num_steps: 10\ndata:\n  train.seed: 5\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(recipe), [])
    assert "grpo.max_num_steps: 'grpo.max_num_steps' is one recipe key with dots in its name; a recipe nests its keys" in str(err.value)
    assert "data.train.seed: 'train.seed' is one recipe key with dots in its name" in str(err.value)
    assert "unknown key" not in str(err.value)


def test_wrong_type_names_key_and_type():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["grpo.max_num_steps=abc"])
    assert "grpo.max_num_steps" in str(err.value) and "integer" in str(err.value)


def test_missing_file_and_invalid_yaml_name_the_file_and_line(tmp_path):
    with pytest.raises(ConfigError, match="not found: .*missing.yaml"):
        load_config(tmp_path / "missing.yaml")
    bad = write(tmp_path / "bad.yaml", "grpo:\n  seed: 1\n  x: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml at line \d+"):
        load_config(bad)


def test_yaml_reads_scientific_floats_and_refuses_a_key_given_twice(tmp_path):
    recipe = write(tmp_path / "r.yaml", "policy:\n  optimizer:\n    lr: 1e-4\nx: ${mul:${policy.optimizer.lr},10}\ny: '1e-4'\n")
    raw = resolve_config_dict(recipe)
    assert raw["policy"]["optimizer"]["lr"] == 1e-4 and raw["x"] == pytest.approx(1e-3)  # YAML 1.1 read '1e-4' as text
    assert raw["y"] == "1e-4"  # quoted stays text
    twice = write(tmp_path / "twice.yaml", "grpo:\n  seed: 1\n  max_num_steps: 3\n  seed: 2\n")
    with pytest.raises(ConfigError, match=r"twice\.yaml at line 4.*'seed' is given twice \(first at line 2\)"):
        load_config(twice)


def test_a_mapping_override_merges_into_its_section_and_a_broken_interpolation_can_be_overridden(tmp_path, monkeypatch):
    raw = resolve_config_dict(TINY, ["policy.generation={temperature:0.5}"])
    assert raw["policy"]["generation"]["temperature"] == 0.5
    assert raw["policy"]["generation"]["max_new_tokens"] == resolve_config_dict(TINY)["policy"]["generation"]["max_new_tokens"]
    monkeypatch.delenv("NEMO_LIKE_UNSET_FOR_TEST", raising=False)
    recipe = write(tmp_path / "r.yaml", f"defaults: {TINY}\nlogger:\n  log_dir: ${{oc.env:NEMO_LIKE_UNSET_FOR_TEST}}\n")
    assert load_config(recipe, [f"logger.log_dir={tmp_path / 'logs'}"]).logger.log_dir == str(tmp_path / "logs")


def test_batch_geometry_is_checked():
    with pytest.raises(ConfigError, match="must divide the rollout size"):
        load_config(TINY, ["policy.train_global_batch_size=48"])
    with pytest.raises(ConfigError, match="force_on_policy_ratio requires"):
        load_config(TINY, ["policy.train_global_batch_size=32", "loss_fn.force_on_policy_ratio=true"])


def test_cli_user_errors_exit_2_without_traceback(capsys):
    assert main(["train", "grpo.max_num_steps=2", "grpo.num_prompt_per_step=4"]) == 2
    err = capsys.readouterr().err
    assert "grpo.num_prompts_per_step" in err and "Traceback" not in err


def test_cli_dry_run_prints_resolved_overrides(capsys):
    assert main(["train", "--config", str(TINY), "--dry-run", "grpo.num_prompts_per_step=2"]) == 0
    out = capsys.readouterr().out
    assert "num_prompts_per_step: 2" in out and "train_global_batch_size: 16" in out


@pytest.mark.parametrize(
    "override", ["data.system_prompt=Think step by step, then answer.", "grpo.val_pass_k=1,2", "data.train.seed=range(1,3)"]
)
def test_a_sweep_override_is_a_config_error_naming_it_and_quoting_works(capsys, override):
    # Hydra's grammar reads a comma, range() or choice() as a sweep; OmegaConf used to fail on it with a traceback.
    assert main(["train", "--config", str(TINY), "--dry-run", override]) == 2
    err = capsys.readouterr().err
    assert f"Override '{override}'" in err and "sweep" in err and "quote the value" in err and "Traceback" not in err
    # The advice works: the argv a shell passes for "data.system_prompt='Think step by step, then answer.'".
    assert main(["train", "--config", str(TINY), "--dry-run", "data.system_prompt='Think step by step, then answer.'"]) == 0
    assert "system_prompt: Think step by step, then answer." in capsys.readouterr().out


def test_an_override_omegaconf_cannot_apply_is_a_config_error_naming_it():
    cfg = OmegaConf.create({"sizes": [1, 2]})
    for override in ("++sizes.5=3", "++sizes.x=3"):  # what OmegaConf refused is named before it is tried
        with pytest.raises(ConfigError, match=rf"Override '\+\+{override[2:7]}.*'sizes' is a list of 2 \(indices 0-1\)"):
            apply_overrides(cfg, [override])


def test_every_shipped_recipe_validates():
    shipped = sorted((REPO / "examples" / "configs").glob("*.yaml"))
    assert {TINY, MATH_1B, TINY_ASYNC} <= set(shipped)
    for recipe in shipped:
        load_config(recipe)


def test_async_refuses_to_start_without_the_importance_sampling_correction():
    with pytest.raises(ConfigError, match="grpo.async_grpo.enabled=true requires loss_fn.use_importance_sampling_correction=true"):
        load_config(TINY, ["grpo.async_grpo.enabled=true"])
    with pytest.raises(ConfigError, match="use_dynamic_sampling"):
        load_config(TINY_ASYNC, ["grpo.use_dynamic_sampling=true"])
    with pytest.raises(ConfigError, match="max_trajectory_age_steps"):
        load_config(TINY_ASYNC, ["grpo.async_grpo.max_trajectory_age_steps=-1"])
    cfg = load_config(TINY_ASYNC)
    assert cfg.grpo.async_grpo.enabled and cfg.grpo.async_grpo.max_trajectory_age_steps == 1
    assert cfg.loss_fn.use_importance_sampling_correction


def test_temperature_zero_says_what_greedy_is_called_here():
    """A TRL or vLLM user writes temperature=0 for greedy; pydantic said only 'greater than 0'."""
    with pytest.raises(ConfigError, match=r"policy.generation.temperature must be > 0 .*grpo.val_greedy=true.*eval.greedy=true"):
        load_config(TINY, ["policy.generation.temperature=0"])


def test_deleting_every_environment_is_an_error_not_the_default_arithmetic_one():
    """An empty env means one default arithmetic environment: '~env.arithmetic' without a new section brought it back,
    and the run then failed on the data's task naming 'arithmetic' as configured."""
    with pytest.raises(ConfigError, match="The overrides delete every env section"):
        resolve_config_dict(TINY, ["~env.arithmetic"])
    assert list(resolve_config_dict(TINY, ["+env.math.num_workers=1", "~env.arithmetic"])["env"]) == ["math"]


def test_shared_prompt_forward_true_with_the_teacher_kl_term_is_refused_at_load():
    """It was refused only by the policy worker, once the cluster and actors were up."""
    distill = REPO / "examples" / "configs" / "distill_tiny_cpu.yaml"
    with pytest.raises(ConfigError, match=r"policy.shared_prompt_forward=true cannot run with distillation.kl_weight=0.5"):
        load_config(distill, ["policy.shared_prompt_forward=true", "distillation.kl_weight=0.5"])
    assert load_config(distill, ["policy.shared_prompt_forward=auto", "distillation.kl_weight=0.5"]).distillation.kl_weight == 0.5


def test_the_python_api_says_what_it_takes() -> None:
    """load_config(path, "key=value") parsed the string one character at a time ("Cannot parse override 'g'"), a dict
    was read as its keys, and train("recipe.yaml") failed deep inside with an AttributeError."""
    from nemo_like.train import train

    for overrides in ("grpo.max_num_steps=2", {"grpo.max_num_steps": 2}, [2]):
        with pytest.raises(TypeError, match=r"overrides must be a list of 'key=value' strings, e.g. \['grpo.max_num_steps=2'\]"):
            load_config(None, overrides)  # type: ignore[arg-type]
    assert load_config(None, ("grpo.max_num_steps=3",)).grpo.max_num_steps == 3 and load_config(None, None).grpo.max_num_steps > 0
    assert load_config(None, (o for o in ["grpo.max_num_steps=4"])).grpo.max_num_steps == 4  # a generator: read once (the check ate it)
    with pytest.raises(TypeError, match=r"train\(\) takes a MasterConfig, e.g. load_config\('recipe.yaml'"):
        train("examples/configs/grpo_tiny_cpu.yaml")  # type: ignore[arg-type]
