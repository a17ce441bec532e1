"""The run plan: every run-level decision from a table of the shipped recipes, and a check that no code outside
``nemo_like/plan/`` derives any of them again."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from nemo_like.config import load_config
from nemo_like.config.errors import ConfigError
from nemo_like.plan.backend import PolicyModel, vllm_available
from nemo_like.plan.run_plan import decide_run_plan

ROOT = Path(__file__).resolve().parents[3]
RECIPES = ROOT / "examples" / "configs"
EOS = (151643,)


def plan_of(recipe: str, *overrides: str, cpus: int = 2, with_policy: bool = True):
    cfg = load_config(RECIPES / recipe, list(overrides), warn=False)
    return decide_run_plan(cfg, EOS, cpus, with_policy)


# recipe, overrides -> (backend, prev pass, reference pass, reference model loaded, threads (policy, ref, gen), multi-turn)
TABLE = [
    ("grpo_tiny_cpu.yaml", (), ("inline", False, True, True, (2, 2, 2), False)),
    ("grpo_tiny_cpu.yaml", ("loss_fn.reference_policy_kl_penalty=0",), ("inline", False, False, False, (2, 2, 2), False)),
    # the policy's 2 threads train and sample alone; 1 in the logprob phase beside the reference (ThreadSplit.policy_logprobs)
    ("grpo_tiny_cpu.yaml", ("grpo.skip_prev_logprobs=false",), ("inline", True, True, True, (2, 1, 2), False)),
    ("grpo_tiny_cpu_async.yaml", (), ("hf", False, True, True, (1, 1, 1), False)),
    ("grpo_multiturn_tiny_cpu.yaml", (), ("inline", False, False, False, (2, 2, 2), True)),
    ("grpo_math_tiny_cpu.yaml", ("policy.generation.backend=hf",), ("hf", False, True, True, (2, 2, 2), False)),
]


@pytest.mark.parametrize("recipe, overrides, expected", TABLE, ids=[f"{r}:{','.join(o) or 'default'}" for r, o, _ in TABLE])
def test_each_recipe_gets_the_decisions_derived_by_hand(recipe: str, overrides: tuple[str, ...], expected: tuple) -> None:
    backend, prev, reference, loaded, threads, multi_turn = expected
    plan = plan_of(recipe, *overrides)
    assert plan.backend.value == backend
    assert (plan.logprobs.compute_prev, plan.logprobs.compute_reference, plan.logprobs.load_reference_model) == (prev, reference, loaded)
    assert (plan.threads.policy, plan.threads.reference, plan.threads.generation) == threads
    assert (plan.multi_turn is not None) == multi_turn
    assert plan.refit.value == "full"


def test_multi_turn_settings_end_turns_on_eos_and_every_stop_token() -> None:
    plan = plan_of("grpo_multiturn_tiny_cpu.yaml")
    cfg = load_config(RECIPES / "grpo_multiturn_tiny_cpu.yaml", warn=False)
    assert plan.multi_turn.max_turns == cfg.grpo.max_rollout_turns
    assert plan.multi_turn.eos_token_ids[0] == EOS[0]
    assert set(cfg.policy.generation.stop_token_ids or ()) <= set(plan.multi_turn.eos_token_ids)


def test_lora_refit_mode_follows_the_decided_backend() -> None:
    plan = plan_of("grpo_tiny_cpu_lora.yaml")
    assert plan.backend.value == ("vllm" if vllm_available() else "hf")
    assert plan.refit.value == ("adapter" if vllm_available() else "merged")
    assert plan_of("grpo_tiny_cpu_lora.yaml", "policy.generation.backend=hf").refit.value == "merged"
    with pytest.raises(ConfigError, match="policy.lora_cfg.refit=adapter is not possible here"):
        plan_of("grpo_tiny_cpu_lora.yaml", "policy.generation.backend=hf", "policy.lora_cfg.refit=adapter")


def test_a_merged_lora_refit_in_bf16_is_warned_about_in_the_plan() -> None:
    """The engine holds W + B @ A * alpha / dim rounded to bf16: adapter updates below bf16's resolution of W never
    reach it (95.7 % of one update's entries, measured), while the policy adds the adapters' product in full."""
    merged_bf16 = plan_of("grpo_tiny_cpu_lora.yaml", "policy.generation.backend=hf", "policy.precision=bfloat16")
    assert merged_bf16.refit.value == "merged"
    assert sum("merged LoRA refit with policy.precision=bfloat16" in line for line in merged_bf16.lines()) == 1
    assert merged_bf16.refit_warning.endswith("use policy.precision=float32, or the vLLM backend's adapter refit (docs/guides/lora.md)")
    # where the adapter refit is refused (a rank vLLM cannot serve), it is not advised
    too_wide = plan_of("grpo_tiny_cpu_lora.yaml", "policy.generation.backend=hf", "policy.precision=bfloat16", "policy.lora_cfg.dim=1024")
    assert too_wide.refit_warning.endswith(
        "use policy.precision=float32 (the vLLM adapter refit is not possible here: vLLM serves adapters up to rank 512, "
        "policy.lora_cfg.dim=1024)"
    )
    assert plan_of("grpo_tiny_cpu_lora.yaml", "policy.generation.backend=hf").refit_warning is None  # fp32: exact
    # nor for a mixture of experts on a CPU, which vLLM's CPU build does not generate for training
    cfg = load_config(RECIPES / "grpo_tiny_cpu_lora.yaml", ["policy.generation.backend=hf", "policy.precision=bfloat16"], warn=False)
    moe = decide_run_plan(cfg, EOS, 2, model=PolicyModel(experts=True))
    assert moe.model.experts and "(the vLLM adapter refit is not possible here: the policy is a mixture of experts" in moe.refit_warning
    assert plan_of("grpo_tiny_cpu.yaml", "policy.precision=bfloat16").refit_warning is None  # no LoRA: the same cast


def test_scoring_overlap_is_off_where_the_config_blocks_it() -> None:
    assert plan_of("grpo_tiny_cpu.yaml").overlap_scoring == load_config(RECIPES / "grpo_tiny_cpu.yaml", warn=False).grpo.overlap_scoring
    assert not plan_of("grpo_tiny_cpu_async.yaml").overlap_scoring
    assert not plan_of("grpo_multiturn_tiny_cpu.yaml").overlap_scoring
    # agent tasks are scored inside their sessions: the plan had claimed an overlap that never happened
    assert not plan_of("grpo_agent_tiny_cpu.yaml").overlap_scoring
    lines = load_config(RECIPES / "grpo_agent_tiny_cpu.yaml", ["grpo.overlap_scoring=false"], warn=False).no_effect_warnings()
    assert "grpo.overlap_scoring=false has no effect with agent tasks ['tool'] (scoring never overlaps there)" in lines


def test_evaluation_plans_an_engine_and_no_refit() -> None:
    plan = plan_of("grpo_tiny_cpu_lora.yaml", with_policy=False)
    assert plan.backend.value != "inline" and plan.refit.value == "full"


def test_the_plan_lines_say_every_decision_once() -> None:
    plan = plan_of("grpo_tiny_cpu_async.yaml", "policy.num_threads_per_worker=2", "policy.generation.num_threads_per_worker=2")
    plan = plan.with_forward("the model's own (test)")
    lines = plan.lines()
    assert sum(line.startswith("generation backend: hf") for line in lines) == 1
    assert sum(line.startswith("threads per worker on 2 CPUs") for line in lines) == 1
    assert lines.count("policy logprob and training forward: the model's own (test)") == 1
    assert any(line.startswith("WARNING: ") and "oversubscribed" in line for line in lines)
    assert all(reason in lines for reason in plan.logprobs.reasons)
    # the async run's staleness line is the plan's (`nemo-like plan` left it out: the loop printed it)
    assert lines.count("async: samples at most 1 update(s) old, refits wait for the batch in flight") == 1
    assert not any(line.startswith("async:") for line in plan_of("grpo_tiny_cpu.yaml").lines())


# The deciding functions, and the modules allowed to call them (the plan itself; the config-only LoRA form that tests
# and tools use outside a run, documented in nemo_like/plan/refit.py).
DECIDERS = {
    "decide_logprob_passes": set(),
    "resolve_backend": set(),
    "refit_mode": set(),
    "thread_split": set(),
    "phase_actors": set(),
    "multi_turn_settings": set(),
    "oversubscription_warning": set(),
    "agent_tasks": set(),
    "async_staleness": set(),
    "decide_run_plan": {"nemo_like/distributed/planning.py"},
    "plan_on_cluster": {"nemo_like/algorithms/setup.py", "nemo_like/evaluation/run.py", "nemo_like/cli.py"},  # cli: `nemo-like plan`
}
# Components that may decide a plan themselves when a caller outside a run builds them without one (tests, tools).
STANDALONE_DEFAULTS = {"nemo_like/models/engines.py", "nemo_like/models/policy/policy.py"}


def rederivations(root: Path) -> list[str]:
    """Calls of a deciding function in ``root/nemo_like`` outside ``nemo_like/plan/`` and the allowed callers."""
    offenders = []
    for path in sorted((root / "nemo_like").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("nemo_like/plan/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                allowed = DECIDERS.get(name)
                if allowed is None or rel in allowed or (name == "plan_on_cluster" and rel in STANDALONE_DEFAULTS):
                    continue
                offenders.append(f"{rel}:{node.lineno} calls {name}")
    return offenders


def test_no_module_outside_the_plan_derives_a_run_level_decision_again() -> None:
    assert rederivations(ROOT) == []


def test_the_rederivation_check_finds_a_component_that_decides_again(tmp_path: Path) -> None:
    component = tmp_path / "nemo_like" / "models" / "generation" / "hf.py"
    component.parent.mkdir(parents=True)
    component.write_text(
        "from nemo_like.plan.threads import thread_split\n\ndef threads(cfg, plan):\n    return thread_split(cfg, 2, plan).generation\n"
    )
    (tmp_path / "nemo_like" / "plan").mkdir()
    (tmp_path / "nemo_like" / "plan" / "threads.py").write_text("def f(cfg, plan):\n    return thread_split(cfg, 2, plan)\n")
    assert rederivations(tmp_path) == ["nemo_like/models/generation/hf.py:4 calls thread_split"]


def test_the_policy_workers_get_the_plans_two_thread_counts() -> None:
    """The plan's logprob-phase share reaches the policy's worker spec (the plan alone was tested: the wiring was not)."""
    from nemo_like.models.policy.policy import policy_resources, policy_worker_spec

    cfg = load_config(RECIPES / "grpo_tiny_cpu.yaml", ["grpo.skip_prev_logprobs=false"], warn=False)
    plan = decide_run_plan(cfg, EOS, 2)
    from nemo_like.algorithms.loss_functions import ClippedPGLossFn

    policy = policy_worker_spec(cfg, policy_resources(cfg, "policy", plan.threads), True, ClippedPGLossFn(cfg.loss_fn), plan.threads)
    reference = policy_worker_spec(cfg, policy_resources(cfg, "reference", plan.threads), False, None, plan.threads)
    assert (policy.num_threads, policy.logprob_threads) == (2, 1) and (reference.num_threads, reference.logprob_threads) == (1, None)
