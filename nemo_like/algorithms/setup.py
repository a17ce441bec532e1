"""Build everything a GRPO run needs from a validated config, as one named object."""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nemo_like.algorithms.distillation import Teachers, check_teacher_tokenizer, check_teacher_vocab
from nemo_like.algorithms.loss_functions import ClippedPGLossFn
from nemo_like.algorithms.names import check_plugin_names
from nemo_like.algorithms.roles import ensure_cluster_capacity, ensure_private_cluster_gpus, idle_gpus_warning
from nemo_like.config.errors import ConfigError
from nemo_like.config.schema import MasterConfig
from nemo_like.data.prompts import PromptDataLoader, PromptRecord, ToolsOf, build_prompt_dataset, validation_overlap_warning
from nemo_like.distributed.planning import plan_on_cluster
from nemo_like.distributed.ray_init import init_ray, joins_existing_cluster
from nemo_like.distributed.worker_group import actors_not_kept
from nemo_like.environments.registry import EnvSpec, check_tasks_have_environments, import_environment_class, resolve_environments, task_of
from nemo_like.environments.worker import Environments
from nemo_like.experience.agent_rollouts import AgentHandles, load_agents, shut_down, start_agent_rollouts
from nemo_like.experience.multi_turn import template_warnings
from nemo_like.models.engines import build_generation
from nemo_like.models.footprint import (
    check_teacher_config_names,
    model_config_here,
    model_config_path,
    teacher_config_path,
    teacher_key,
)
from nemo_like.models.generation.hf import HFGeneration
from nemo_like.models.generation.lean_decoder import model_sampling_problem
from nemo_like.models.loading import (
    check_chunkable_head,
    check_context_length,
    check_generative,
    check_stop_token_ids,
    check_trained_length,
    end_of_sequence_ids,
    holds_tokenizer,
    load_tokenizer,
    meta_skeleton,
    model_config,
    model_configs_given,
    model_vocab_size,
    policy_model,
    renders_tools,
    resolve_model_path,
    token_id_count,
)
from nemo_like.models.lora import check_lora_targets, refit_bytes
from nemo_like.models.policy.batching import packing_problem
from nemo_like.models.policy.policy import AdapterDisabledReference, Policy
from nemo_like.models.policy.sharding import decoder_layers, tensor_parallel_problem
from nemo_like.plan.backend import VLLM_CPU_EXPERTS_BLOCKER
from nemo_like.plan.memory import layer_values, tensor_parallel_problems
from nemo_like.plan.multi_turn import with_reply_roles
from nemo_like.plan.run_plan import RunPlan
from nemo_like.plan.threads import node_count_warning, shared_cores_warning
from nemo_like.utils.machine_runs import other_live_runs
from nemo_like.utils.run_control import run_control


@dataclass
class GRPOComponents:
    """The actors, data and decisions of one run."""

    cfg: MasterConfig
    tokenizer: object
    policy: Policy
    reference: Policy | AdapterDisabledReference | None
    generation: HFGeneration
    environments: Environments
    train_loader: PromptDataLoader
    val_prompts: list[PromptRecord]
    plan: RunPlan  # every run-level decision, made once in setup_grpo
    teacher: Teachers | None = None  # on-policy distillation's teachers (teacher.model_name, teacher.by_task)
    agents: Any = None  # agent tasks: the rollout server and the sessions' driver side (experience/agent_rollouts.py)

    def shutdown(self) -> None:
        """Stop the rollout server, kill every actor of the run (the Ray cluster itself stays up)."""
        shut_down(self.agents, (self.generation, self.policy, self.reference, self.teacher, self.environments))

    @property
    def environment(self):
        """The environments' actor handles, by task (what the rollout helpers score with)."""
        return self.environments.handles


def check_environments(specs: dict[str, EnvSpec], datasets: dict[str, list[PromptRecord]]) -> None:
    """Every prompt's task must have an environment that can score its gold answer
    (:meth:`EnvironmentInterface.answer_problem`); an environment no prompt uses only warns."""
    classes = {task: import_environment_class(spec.class_path, f"env.{task}") for task, spec in specs.items()}
    used: set[str] = set()
    for split, records in datasets.items():
        used |= set(check_tasks_have_environments((r.metadata for r in records), specs, f"data ({split} split)"))
        for record in records:
            task = task_of(record.metadata, specs)
            problem = classes[task].answer_problem(specs[task].kwargs, record.metadata.get("answer"))
            if problem is not None:
                raise ConfigError(
                    f"data ({split} split): prompt {record.id} (task '{task}'): its answer {problem}. Fix the row, or the "
                    "answer column (data.answer_key)"
                )
    unused = sorted(set(specs) - used)
    if unused:
        print(
            f"[config] warning: env: no prompt has task {unused}; their environment actors will sit idle (remove the "
            f"section{'s' if len(unused) > 1 else ''} with {' '.join(repr('~env.' + t) for t in unused)})",
            file=sys.stderr,
        )


def environment_reply_roles(specs: dict[str, EnvSpec]) -> dict[str, tuple[str, ...]]:
    """Per task, the roles its environment's observations take (:meth:`EnvironmentInterface.reply_roles`): what the
    multi-turn loop probes where a row is full (``MultiTurnSettings.reply_roles``)."""
    roles = {}
    for task, spec in specs.items():
        env_class = import_environment_class(spec.class_path, f"env.{task}")
        declared = env_class.reply_roles(spec.kwargs)
        if isinstance(declared, str) or not declared or not all(isinstance(role, str) and role for role in declared):
            raise ConfigError(
                f"env.{task}: {spec.class_path}.reply_roles returned {declared!r}; expected a non-empty tuple of role "
                'names, e.g. ("user",) (a bare string is not one: ("user") is the string "user")'
            )
        roles[task] = tuple(declared)
    return roles


def with_environments(plan: RunPlan, specs: dict[str, EnvSpec]) -> RunPlan:
    """``plan`` with what the environments decide for the run: each task's reply roles (:func:`environment_reply_roles`)
    in its multi-turn settings (train and eval hand the same plan down)."""
    return replace(plan, multi_turn=with_reply_roles(plan.multi_turn, environment_reply_roles(specs)))


def multi_turn_warnings(cfg: MasterConfig, specs: dict[str, EnvSpec]) -> list[str]:
    """``grpo.max_rollout_turns`` and the environments' kind disagree: the setting (or the env's ``step``) has no effect;
    and each environment's own no-effect lines (:meth:`EnvironmentInterface.config_warnings`)."""
    from nemo_like.environments.agent import AgentEnvironment
    from nemo_like.environments.interface import EnvironmentInterface

    turns = cfg.grpo.max_rollout_turns
    lines = []
    for task, spec in specs.items():
        env_class = import_environment_class(spec.class_path, f"env.{task}")
        lines += env_class.config_warnings(task, spec.kwargs, turns)
        multi = env_class.step is not EnvironmentInterface.step
        if issubclass(env_class, AgentEnvironment):
            if turns > 1:  # its agent decides the calls: the turn loop never runs for it
                lines.append(
                    f"grpo.max_rollout_turns={turns} does not bound agent task env.{task}: its agent decides how many model "
                    f"calls a session makes (bounded by env.{task}.max_tokens_per_session); it adds the multi_turn/* metrics only"
                )
        elif multi and turns == 1:
            lines.append(
                f"env.{task} is a multi-turn environment (it overrides step) but grpo.max_rollout_turns=1: the run scores "
                "single responses with its score(); set grpo.max_rollout_turns > 1 to use its turns"
            )
        elif not multi and turns > 1:
            overlap = " (it still turns grpo.overlap_scoring off: multi-turn rollouts score as they go)" if cfg.grpo.overlap_scoring else ""
            lines.append(
                f"grpo.max_rollout_turns={turns} has no effect for env.{task}: it is single-turn (no step override), so its "
                f"samples end after one turn{overlap}"
            )
    return lines


def prompt_tools(cfg: MasterConfig, tokenizer) -> ToolsOf | None:
    """Each task's prompt tools (its environment's :meth:`~nemo_like.environments.interface.EnvironmentInterface.prompt_tools`:
    the tool environment's, unless ``env.<task>.tools_in_prompt`` is false), by task; None where no task offers any.
    Warns when the chat template does not render tools: the model would read no tool list."""
    specs = resolve_environments(cfg.env_sections)
    tools = {}
    for task, spec in specs.items():
        if schemas := import_environment_class(spec.class_path, f"env.{task}").prompt_tools(spec.kwargs):
            tools[task] = schemas
    if not tools:
        return None
    if not renders_tools(tokenizer):
        sections = ", ".join(f"env.{task}" for task in tools)
        print(
            f"[config] warning: {sections}: the chat template of {getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'!r} "
            "does not render tools, so the prompts list none of the tools offered (the model must know them already). "
            "Describe them in data.system_prompt, or use a template that renders tools; env.<task>.tools_in_prompt=false "
            "silences this",
            file=sys.stderr,
        )
    only = next(iter(specs)) if len(specs) == 1 else None  # where a prompt without a task goes (task_of)
    return lambda task: tools.get(task if task is not None else only)


def load_validation_prompts(cfg: MasterConfig, tokenizer, tools_of: ToolsOf | None = None) -> list[PromptRecord]:
    """The first ``grpo.max_val_samples`` validation prompts (training validation and ``nemo-like eval``); ``tools_of``:
    :func:`prompt_tools`' (found here when not given)."""
    max_prompt = cfg.policy.max_total_sequence_length - cfg.policy.generation.max_new_tokens
    tools_of = tools_of if tools_of is not None else prompt_tools(cfg, tokenizer)
    prompts = build_prompt_dataset(cfg.data, tokenizer, "validation", max_prompt, tools_of)
    if len(prompts) > cfg.grpo.max_val_samples:  # said: data.validation.num_problems alone does not raise it
        print(f"data.validation: using the first {cfg.grpo.max_val_samples} of {len(prompts)} prompts (grpo.max_val_samples)")
    return prompts[: cfg.grpo.max_val_samples]


def _driver_tokenizer(cfg: MasterConfig, key: str | None = None):
    """The run's tokenizer (``cfg`` may be :meth:`MasterConfig.teacher_config`'s, ``key`` then the config key that names
    that model); an id that cannot be loaded (offline, typo, an unknown ``embedded:`` name) is a ConfigError naming the
    key."""
    name = cfg.policy.tokenizer_name or cfg.policy.model_name
    key = key or ("policy.tokenizer_name" if cfg.policy.tokenizer_name else "policy.model_name")
    try:
        return load_tokenizer(name, _tokenizer_fix(key))
    except (OSError, ValueError) as exc:
        local = Path(resolve_model_path(name)).expanduser().is_dir()
        raise ConfigError(
            f"cannot load the tokenizer of {key}={name!r} ({str(exc).splitlines()[0]})"
            + ("" if local else f"; on an offline machine point {key} at a local model directory")
        ) from None


def _tokenizer_fix(key: str) -> str:
    """What to do about a directory that ``key`` names and that holds no tokenizer."""
    if key.startswith("teacher.by_task."):
        return (
            "a teacher.by_task model's directory must hold its tokenizer (teacher.tokenizer_name names teacher.model_name's "
            "only): copy the student's tokenizer files into it"
        )
    if key.endswith("tokenizer_name"):
        return f"point {key} at a model directory or id that holds one"
    return f"name the tokenizer's model with {key.split('.')[0]}.tokenizer_name"


def report_lora(cfg: MasterConfig, policy: Policy, plan: RunPlan) -> None:
    """Print the trainable parameters and how generation receives weights (LoRA: adapters or merged, as ``plan``
    decided)."""
    fraction = policy.trainable_params / max(policy.total_params, 1)
    line = f"[setup] trainable parameters: {policy.trainable_params:,} of {policy.total_params:,} ({100 * fraction:.2f}%)"
    print(line, file=sys.stderr)
    if cfg.policy.lora_cfg.enabled:
        mode, reason = plan.refit.value, plan.refit.reason
        print(f"[setup] LoRA refit: {mode} ({reason})", file=sys.stderr)
        sizes = refit_bytes(policy.trainable_params, policy.full_refit_elements, cfg.policy.precision)
        adapter_bytes, full_bytes = sizes["adapter"], sizes["full"]
        sent = adapter_bytes if mode == "adapter" else full_bytes
        print(f"[setup] refit bytes per weight version: {sent:,} (adapters {adapter_bytes:,}, full model {full_bytes:,})", file=sys.stderr)


def release_on_failure(models: tuple[Policy | None, ...], parts: list[Any]) -> None:
    """After a failed set-up: kill the spawned models' workers and shut the other started parts down (their errors
    are not allowed to hide the one being raised)."""
    for model in models:
        if model is not None:
            model.group.kill()
    for part in parts:
        with contextlib.suppress(Exception):
            part.shutdown()


def check_policy_model(cfg: MasterConfig, local_only: bool = False) -> None:
    """The recipe against ``policy.model_name``'s config (train before any actor starts, ``nemo-like plan`` when the
    model's config is on the machine, with ``local_only``: a hub id's cached copy, never the hub): the sequence length
    within its context (and a position-dependent RoPE's pretrained one), ``policy.logprob_chunk_size`` against a head
    whose logits its forward post-processes, the stop ids within its vocabulary, the LoRA targets among its modules, its
    layers packable with ``policy.sequence_packing``."""
    name = cfg.policy.model_name
    check_context_length(name, cfg.policy.max_total_sequence_length, local_only=local_only)
    check_trained_length(name, cfg.policy.max_total_sequence_length, local_only=local_only)
    check_chunkable_head(name, cfg.policy.logprob_chunk_size, local_only=local_only)
    check_stop_token_ids(name, cfg.policy.generation.stop_token_ids, local_only=local_only)
    check_generative(name, "policy.model_name", local_only)
    check_tensor_parallel_heads(cfg, name, local_only=local_only)
    check_shardable(cfg, name, "policy.model_name", local_only)
    check_packable(cfg, name, "policy.model_name", local_only)
    if cfg.policy.lora_cfg.enabled:
        check_lora_targets(name, cfg.policy.lora_cfg, local_only)


def check_sampled_model(
    cfg: MasterConfig, backend: str, key: str = "policy.model_name", local_only: bool = False, experts: bool = False
) -> None:
    """A :class:`ConfigError` naming ``key`` when ``backend`` (the run's resolved one) samples ``policy.model_name``
    with the HF sampler (``hf``, ``inline``) and that cannot sample it
    (:func:`~nemo_like.models.generation.lean_decoder.sampling_problem`): its actor refused it at the first generate
    call, after every actor had started. ``key``: where the model was named (``eval.model_path`` for an eval);
    ``experts``: a training run's policy is a mixture of experts (no vLLM for it on a CPU cluster)."""
    if backend not in ("hf", "inline"):
        return
    name, requested = cfg.policy.model_name, cfg.policy.generation.backend
    if problem := model_sampling_problem(name, local_only):
        chose = f"policy.generation.backend={requested}" + (f" chose {backend}" if requested != backend else "")
        if experts and not cfg.cluster.gpus_per_node:
            way_out = f"nor can vLLM train it on a CPU cluster ({VLLM_CPU_EXPERTS_BLOCKER})"
        else:
            way_out = "vLLM's engine (policy.generation.backend=vllm) samples the architectures vLLM supports"
        raise ConfigError(f"{key}={name!r} with {chose}: the HF sampler cannot sample {problem}; {way_out}")


def check_packable(cfg: MasterConfig, name: str, key: str, local_only: bool = False) -> None:
    """A :class:`ConfigError` naming ``key`` when ``policy.sequence_packing`` is on and model ``name`` has layers a
    packed row cannot keep to each sample (:func:`~nemo_like.models.policy.batching.packing_problem`): its logprobs
    were silently wrong for every sample after a row's first."""
    longest = cfg.policy.max_total_sequence_length
    if cfg.policy.sequence_packing.enabled and (problem := packing_problem(model_config(name, local_only), longest)):
        raise ConfigError(f"policy.sequence_packing.enabled=true with {key}={name!r}: {problem}")


def check_tensor_parallel_heads(cfg: MasterConfig, name: str, key: str | None = None, local_only: bool = False) -> None:
    """A :class:`ConfigError` when ``policy.dtensor_cfg.tensor_parallel_size`` does not divide model ``name``'s heads
    (:func:`~nemo_like.plan.memory.tensor_parallel_problems`; ``key``: a teacher's, which takes the policy's degree):
    the workers refused it after every actor had started."""
    if cfg.policy.dtensor_cfg.tensor_parallel_size == 1:
        return
    text = model_config(name, local_only).get_text_config()
    heads = getattr(text, "num_attention_heads", None)  # transformers maps a GPT-2's n_head onto it
    if heads is None:  # no attention to split (Mamba): check_shardable refuses it
        return
    for kv_heads in sorted(set(layer_values(text, "num_key_value_heads"))) or [None]:  # Gemma 4's differ per layer
        if problems := tensor_parallel_problems(cfg, heads, kv_heads or heads):
            raise ConfigError(f"{key}={name!r}: {problems[0]}" if key else problems[0])


def check_shardable(cfg: MasterConfig, name: str, key: str, local_only: bool = False) -> None:
    """A :class:`ConfigError` naming ``key`` when the workers would shard model ``name`` (``policy.dp_size`` x
    ``tensor_parallel_size`` above 1) and cannot: no decoder layers where FSDP2 looks for them, or a tensor-parallel
    plan that does not fit its layers (:func:`~nemo_like.models.policy.sharding.tensor_parallel_problem`). Both failed
    inside the workers after every actor had started; a per-head query/key norm trained silently wrong."""
    dp, tp = cfg.policy.dp_size, cfg.policy.dtensor_cfg.tensor_parallel_size
    if dp * tp == 1:
        return
    skeleton = meta_skeleton(name, local_only)
    try:
        decoder_layers(skeleton)  # FSDP2 shards each block
    except ValueError as exc:  # neither degree can shard it
        problem, keys = (
            str(exc),
            [k for k, degree in (("policy.dp_size", dp), ("policy.dtensor_cfg.tensor_parallel_size", tp)) if degree > 1],
        )
    else:
        problem, keys = tensor_parallel_problem(skeleton) if tp > 1 else None, ["policy.dtensor_cfg.tensor_parallel_size"]
    if problem:
        raise ConfigError(
            f"{key}={name!r} with policy.dp_size={dp} and policy.dtensor_cfg.tensor_parallel_size={tp}: the workers cannot "
            f"shard it: {problem}; lower {' and '.join(keys)} to 1"
        )


def check_teachers(cfg: MasterConfig, tokenizer: Any) -> list[str]:
    """Check every teacher model (``teacher.models()``) against the student (``tokenizer``: the run's), before any actor
    starts; a :class:`ConfigError` names the key (``teacher.model_name``, ``teacher.by_task.<task>``,
    ``teacher.tokenizer_name``; the student's ``policy.tokenizer_name`` when set, else ``policy.model_name``):

    * the teacher's tokenizer equals the student's: ``teacher.tokenizer_name`` when set, and then also the tokenizer
      the model's own directory holds, if any (a hub id's is not fetched: ``tokenizer_name`` is taken on trust there);
    * the model's own vocabulary rows (``vocab_size`` in its config.json) cover the student's token ids;
    * its head can be chunked (``policy.logprob_chunk_size``: the teachers' passes and the KL term's copy chunk it).

    Returns the warnings only the models' configs tell: ``distillation.kl_top_k`` covering the vocabulary, a teacher
    with fewer rows than the student's head (a sampled padding id past them would fail its pass), a teacher whose
    config.json this machine cannot read (a hub id not cached offline: not checked here; its workers load it)."""
    lines: list[str] = []
    unreadable: set[str] = set()

    def rows_of(name: str, key: str) -> int | None:
        try:
            return model_vocab_size(name)
        except (OSError, ValueError) as exc:
            if Path(resolve_model_path(name)).expanduser().is_dir():  # a local directory whose config.json is not a model's
                raise ConfigError(f"{key}={name!r} is not a model directory here ({type(exc).__name__}: {exc})") from None
            unreadable.add(name)
            lines.append(f"{key}={name!r}: its vocabulary and head are not checked here ({type(exc).__name__}: {exc})")
            return None

    student_key = "policy.tokenizer_name" if cfg.policy.tokenizer_name else "policy.model_name"
    student_name = cfg.policy.tokenizer_name or cfg.policy.model_name
    student_ids = token_id_count(tokenizer)
    student_rows = model_vocab_size(cfg.policy.model_name)  # read on the driver anyway (check_context_length)
    teacher_rows: dict[str, int | None] = {}
    for name in cfg.teacher.models():
        key = teacher_key(cfg, name)
        teacher_cfg = cfg.teacher_config(name)
        named = teacher_cfg.policy.tokenizer_name  # teacher.tokenizer_name (teacher.model_name's only)
        if named:
            named_tokenizer = _driver_tokenizer(teacher_cfg, "teacher.tokenizer_name")
            check_teacher_tokenizer(
                tokenizer, student_name, named_tokenizer, named, student_key=student_key, teacher_key="teacher.tokenizer_name"
            )
        path = Path(resolve_model_path(name)).expanduser()
        if not named or (path.is_dir() and holds_tokenizer(path)):  # the model's own tokenizer
            own = teacher_cfg.model_copy(update={"policy": teacher_cfg.policy.model_copy(update={"tokenizer_name": None})})
            check_teacher_tokenizer(tokenizer, student_name, _driver_tokenizer(own, key), name, student_key=student_key, teacher_key=key)
        rows = teacher_rows[name] = rows_of(name, key)
        check_teacher_vocab(rows, name, key, student_ids, student_name, student_key)
        if rows is not None and student_rows is not None and rows < student_rows:
            lines.append(
                f"{key}={name!r} has {rows} vocabulary rows, policy.model_name={cfg.policy.model_name!r} {student_rows}: "
                f"the student's padding rows {rows}..{student_rows - 1} hold no token, but one sampled there would fail "
                "the teacher's pass"
            )
        if name not in unreadable:  # the same config.json
            check_teacher_model(cfg, name, key)
    d = cfg.distillation
    if d.kl_weight > 0 and cfg.teacher.model_name is not None:  # the KL term's teacher copy: teacher.model_name
        shared = [r for r in (student_rows, teacher_rows.get(cfg.teacher.model_name)) if r is not None]
        if shared and (line := d.top_k_vocab_warning(min(shared))):  # the term compares the rows both heads have
            lines.append(line)
    return lines


def check_teacher_model(cfg: MasterConfig, name: str, key: str, local_only: bool = False) -> None:
    """What a teacher's config.json alone decides (``key``: the config key naming it): a causal language model, heads
    that ``policy.dtensor_cfg.tensor_parallel_size`` divides, a head ``policy.logprob_chunk_size`` can chunk, layers
    ``policy.sequence_packing`` can pack."""
    check_generative(name, key, local_only)
    check_tensor_parallel_heads(cfg, name, key, local_only)
    check_shardable(cfg, name, key, local_only)
    check_chunkable_head(name, cfg.policy.logprob_chunk_size, key, local_only)
    check_packable(cfg, name, key, local_only)


def plan_model_checks(cfg: MasterConfig, policy_config: str | None = None, teacher_configs: dict[str, str] | None = None) -> list[str]:
    """``nemo-like plan``'s run of train's checks of the models (:func:`check_policy_model`, :func:`check_teachers`) on
    what this machine holds, never the hub: a model's own config.json when it is here (what a run reads), else the file
    given for it (``policy_config``: ``--model-config``; ``teacher_configs``: ``--teacher-config NAME=PATH``); a model
    with neither is not checked. The teachers' tokenizers against the student's, and their vocabularies against its
    ids, only where the student, its tokenizer and every teacher are local directories (check_teachers reads them
    without ``local_only``). Returns check_teachers' warnings."""
    teacher_configs = teacher_configs or {}
    check_teacher_config_names(cfg, teacher_configs)
    policy_name = cfg.policy.model_name
    given = {policy_name: model_config_path(policy_name, policy_config)} if policy_config and not model_config_here(policy_name) else {}
    for name, path in teacher_configs.items():
        if not model_config_here(name):
            given[name] = teacher_config_path(cfg, name, path)
    local = [policy_name, cfg.policy.tokenizer_name or policy_name, *cfg.teacher.models(), *filter(None, [cfg.teacher.tokenizer_name])]
    with model_configs_given(given):
        if policy_name in given or model_config_here(policy_name):
            check_policy_model(cfg, local_only=True)
        if cfg.teacher.models() and all(Path(resolve_model_path(name)).expanduser().is_dir() for name in local):
            return check_teachers(cfg, _driver_tokenizer(cfg))
        for name in cfg.teacher.models():
            if name in given or model_config_here(name):
                check_teacher_model(cfg, name, teacher_key(cfg, name), local_only=True)
    return []


def checked_tokenizer(cfg: MasterConfig) -> Any:
    """The run's tokenizer, once the policy's and the teachers' configs passed their checks (:func:`check_teachers`,
    :func:`check_policy_model`): a bad model is refused in a fraction of a second, before the prompts are tokenised
    (minutes for a large data set)."""
    tokenizer = _driver_tokenizer(cfg)
    for line in check_teachers(cfg, tokenizer):  # a teacher that cannot score the student's ids fails here
        warnings.warn(line, RuntimeWarning, stacklevel=2)
    check_policy_model(cfg)
    return tokenizer


@dataclass
class TrainingData:
    """The run's prompts, built in the driver before Ray starts: the tokenizer, the training and validation prompts and
    the training loader (fresh: at its first batch)."""

    tokenizer: Any
    train: list[PromptRecord]
    val: list[PromptRecord]
    loader: PromptDataLoader


def training_data(cfg: MasterConfig) -> TrainingData:
    """Check the models' configs (:func:`checked_tokenizer`), then load and tokenise the run's prompts (a bad file,
    column or prompt length fails here, in seconds)."""
    tokenizer = checked_tokenizer(cfg)
    max_prompt = cfg.policy.max_total_sequence_length - cfg.policy.generation.max_new_tokens
    tools_of = prompt_tools(cfg, tokenizer)
    train = build_prompt_dataset(cfg.data, tokenizer, "train", max_prompt, tools_of)
    val = load_validation_prompts(cfg, tokenizer, tools_of)
    if overlap := validation_overlap_warning(train, val):
        warnings.warn(overlap, RuntimeWarning, stacklevel=2)
    loader = PromptDataLoader(train, cfg.grpo.num_prompts_per_step, cfg.grpo.seed, cfg.data.shuffle)
    return TrainingData(tokenizer, train, val, loader)


def warn_of_runs_sharing_cores(cfg: MasterConfig, plan: RunPlan, private: bool, trains: bool = True) -> None:
    """Warn when other nemo-like runs alive on this machine may run on this CPU run's cores (``private``: it starts a
    cluster of its own, whose CPUs are the machine's whatever else runs there; a joined cluster's Ray schedules its
    CPUs); ``trains`` False: ``nemo-like eval`` (:func:`~nemo_like.plan.threads.shared_cores_warning`)."""
    others = [run.describe() for run in other_live_runs()] if private else []
    if line := shared_cores_warning(cfg, plan.threads, plan.actors, others, trains):
        warnings.warn(line, RuntimeWarning, stacklevel=3)


def setup_grpo(cfg: MasterConfig, ray_started: Callable[[], None] | None = None, data: TrainingData | None = None) -> GRPOComponents:
    """Start Ray (or join it), load data, start the policy, reference, generation and reward actors.

    ``ray_started`` is called once Ray is up, before any model loads or actor starts (``train.py`` lets SIGTERM and
    SIGINT through there: see ``stop_signals_held``). ``data``: the prompts already built (:func:`training_data`; a
    resuming run checks them against its checkpoint first), else built here."""
    env_specs = check_plugin_names(cfg)  # fail fast in the driver, not inside an actor
    # The models' configs, then the data: a bad model, file, column or prompt length fails in seconds, before Ray or any
    # actor starts.
    data = data or training_data(cfg)
    tokenizer, train, val, loader = data.tokenizer, data.train, data.val, data.loader
    check_environments(env_specs, {"train": train, "validation": val})
    for line in multi_turn_warnings(cfg, env_specs):
        warnings.warn(line, RuntimeWarning, stacklevel=2)
    for line in template_warnings(tokenizer) if cfg.grpo.max_rollout_turns > 1 else []:
        warnings.warn(line, RuntimeWarning, stacklevel=2)
    joins = joins_existing_cluster(cfg.cluster)
    if joins:  # the plan's thread split needs the joined cluster's node CPUs
        init_ray(cfg.cluster)
    # Every run-level decision, made once here and handed down (an impossible requested backend or LoRA refit mode
    # fails here, before any actor starts).
    eos_ids = end_of_sequence_ids(tokenizer, cfg.policy.model_name)  # the tokenizer's and the generation config's
    model = policy_model(cfg.policy.model_name)  # what the backend and refit choices need to know of it
    plan = plan_on_cluster(cfg, tuple(eos_ids), model=model)
    check_sampled_model(cfg, plan.backend.value, experts=model.experts)
    plan = with_environments(plan, env_specs)
    if nodes := node_count_warning(cfg, plan.nodes):
        warnings.warn(nodes, RuntimeWarning, stacklevel=2)
    ensure_private_cluster_gpus(cfg, plan)  # a GPU recipe on a machine without them: fail before Ray starts
    if idle := idle_gpus_warning(cfg, plan):
        warnings.warn(idle, RuntimeWarning, stacklevel=2)
    warn_of_runs_sharing_cores(cfg, plan, private=not joins)
    agent_settings = load_agents(env_specs, plan.agent_tasks)  # a wrong agent path fails before any actor starts
    mode = init_ray(cfg.cluster)
    run_control().stage_finished()  # each stage of the start is watched on its own (setup_timeout_s)
    if ray_started is not None:
        ray_started()
    ensure_cluster_capacity(cfg, plan, private_cluster=mode == "local")  # fail fast, before any actor starts
    # Every role's workers start at the same time, taking their resources in the order they always did (policy,
    # reference, teachers, generation, environments); only then are the models' workers waited for (each start is
    # mostly imports and loading a model, and none needs another's).
    policy = Policy(cfg, "policy", trainable=True, loss_fn=ClippedPGLossFn(cfg.loss_fn), plan=plan, wait=False)
    spawned_reference: Policy | None = None
    started: list[Any] = []  # shut down if set-up fails from here on
    try:
        if plan.logprobs.load_reference_model:
            spawned_reference = Policy(cfg, "reference", trainable=False, plan=plan, wait=False)
        teacher = Teachers(cfg, plan, wait=False) if plan.logprobs.compute_teacher else None
        started.append(teacher)
        generation = build_generation(cfg, tokenizer.pad_token_id, eos_ids, policy, plan)
        started.append(generation)
        environments = Environments(env_specs, cfg.cluster.placement_timeout_s)
        started.append(environments)
        for model in (policy, spawned_reference, teacher):
            if model is not None:
                model.wait_ready()
                run_control().stage_finished()
        environments.wait_ready()
        run_control().stage_finished()
        generation.wait_ready()  # its first call's deadline must not count its start-up (a vLLM load: minutes on a GPU)
        reference: Policy | AdapterDisabledReference | None = spawned_reference
        if reference is None and plan.logprobs.reference_from_policy:
            reference = AdapterDisabledReference(policy)
        plan = plan.with_forward(policy.forward_description)
        report_lora(cfg, policy, plan)
        agents = None
        if plan.agent_tasks:  # the rollout server on the driver, sampling with the run's engine (docs/guides/agents.md)
            agents = start_agent_rollouts(cfg, tokenizer, generation, eos_ids, agent_settings)
            handles = AgentHandles(environments.handles.workers, agents)
            handles.replaceable = environments.handles.replaceable  # the verifier's dead actors are replaced too
            environments.handles = handles
    except BaseException as exc:  # every actor started so far is released (a failing rollout server's start included)
        # interrupted (the stall watchdog's abort, a Ctrl-C): actors hung or mid-start, never kept for another run
        with actors_not_kept() if isinstance(exc, KeyboardInterrupt) else contextlib.nullcontext():
            release_on_failure((policy, spawned_reference), [p for p in started if p is not None])
        raise
    return GRPOComponents(cfg, tokenizer, policy, reference, generation, environments, loader, val, plan, teacher, agents)
