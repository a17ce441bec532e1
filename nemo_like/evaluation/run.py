"""``nemo-like eval``: sample a model on the recipe's validation prompts, score them with the recipe's
environments, and report accuracy and pass@k.

It reuses the training run's parts: the validation prompts (:func:`load_validation_prompts`), the
generation actors (:func:`~nemo_like.models.engines.build_generation`), the environment actors and
routing (:func:`~nemo_like.experience.rollouts.score_with_environment`). Outputs, in ``eval.output_dir``:

* ``summary.json``: model, the checkpoint directory evaluated, seed, sampling settings, prompt and sample counts,
  accuracy, mean reward, pass@k, per-task accuracy, the environments' counters (timeouts, parse failures) and the
  seconds taken;
* ``results.jsonl``: one row per sample (prompt id, sample index, task, reward, correct, response);
* ``config.yaml``: the resolved config, as training writes it beside its logs;
* ``results.partial.jsonl`` while it runs: the rows of the chunks done so far (:mod:`nemo_like.evaluation.chunks`),
  kept by an eval that stops.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

from nemo_like.algorithms.pass_at_k import correct_counts, mean_pass_at_k
from nemo_like.config.errors import ConfigError
from nemo_like.config.loader import recipe_yaml
from nemo_like.config.schema import ColocatedConfig, MasterConfig
from nemo_like.environments.interface import CORRECT_REWARD
from nemo_like.evaluation.chunks import PARTIAL_RESULTS, EvalChunks, prompt_chunks, seed_of_chunk
from nemo_like.models.loading import ADAPTER_CONFIG, eval_tokenizer, holds_tokenizer
from nemo_like.models.lora import merge_checkpoint, refuse_overwriting_base
from nemo_like.models.policy.checkpoints import POLICY_DIR
from nemo_like.utils import preflight
from nemo_like.utils.files import replace_file
from nemo_like.utils.machine_runs import registered_run
from nemo_like.utils.run_lock import hold_run_locks
from nemo_like.utils.seeds import eval_seed
from nemo_like.utils.stop_signals import raise_if_stopped, stop_signals_kept

#: In ``eval.output_dir``: the absolute path of the ``merged_model/`` a LoRA eval merges into, written before the merge,
#: so that an eval stopped after it (before its summary.json) can still be rerun there.
MERGE_MARKER = ".nemo_like_eval_merge"


def refuse_replacing_a_model_eval_did_not_merge(out: Path) -> None:
    """``out/merged_model`` holding files is replaced only when an eval merged it (:data:`MERGE_MARKER` names it): a model
    the user merged there (``nemo-like merge --out merged_model``) was deleted. Not ``summary.json``'s ``model_dir``,
    the model an eval scored: a plain eval of the user's own ``out/merged_model`` names it too."""
    merged = out / "merged_model"
    if not merged.is_dir() or not any(merged.iterdir()):
        return
    try:
        recorded = (out / MERGE_MARKER).read_text().strip()
    except (OSError, UnicodeDecodeError):
        recorded = ""
    # resolved: the last eval may have spelled the directory otherwise (relative, ./out, through a link)
    if not recorded or Path(recorded).expanduser().resolve() != merged.resolve():
        raise ConfigError(
            f"eval.output_dir: {merged} holds a model no eval merged there (no {out / MERGE_MARKER} names it); choose "
            "another eval.output_dir or move it (one an eval of an earlier version merged is safe to delete)"
        )


def record_merge(out: Path) -> Path:
    """Write :data:`MERGE_MARKER` for ``out/merged_model`` (before merging into it); returns that directory."""
    merged = out / "merged_model"
    (out / MERGE_MARKER).write_text(str(merged.absolute()) + "\n")
    return merged


def with_tokenizer(model_dir: str, tokenizer, scratch: Path) -> str:
    """A model directory without a tokenizer (a checkpoint's ``policy/`` written before it held the run's), which vLLM
    loads from the model directory: give it a directory of the run's tokenizer plus links to the model's other files
    (the tokenizer is written first: written through a link, it rewrote the checkpoint's own ``chat_template.jinja``)."""
    path = Path(model_dir)
    if not path.is_dir() or holds_tokenizer(path):
        return model_dir
    refuse_overwriting(scratch, path)
    with tempfile.TemporaryDirectory() as probe:
        tokenizer_files = {Path(f).name for f in tokenizer.save_pretrained(probe)}
    if scratch.exists():  # an earlier eval's (the default output_dir is shared by every eval), else not ours to delete
        if not all(p.is_symlink() or p.name in tokenizer_files for p in scratch.iterdir()):
            raise ConfigError(
                f"eval.output_dir: {scratch} holds files eval did not write (it keeps links to the evaluated model and the "
                "run's tokenizer there); choose another eval.output_dir or move them"
            )
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    tokenizer.save_pretrained(scratch)
    for item in path.iterdir():
        if not (scratch / item.name).exists():
            os.symlink(item.resolve(), scratch / item.name)
    return str(scratch)


def keep_stopped_rows(out: Path) -> Path | None:
    """Move a stopped eval's rows (a non-empty ``results.partial.jsonl`` in ``out``) aside, named by when it was last
    written; the new path, or ``None`` where there were none."""
    partial = out / PARTIAL_RESULTS
    if not partial.is_file() or not partial.stat().st_size:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(partial.stat().st_mtime))
    kept, n = partial.with_name(f"results.partial.{stamp}.jsonl"), 1
    while kept.exists():  # rows kept from another stopped eval's same second: a rename would replace them
        n += 1
        kept = partial.with_name(f"results.partial.{stamp}.{n}.jsonl")
    partial.rename(kept)
    return kept


def refuse_results_over_model(out: Path, model_dir: Path) -> None:
    """Eval writes ``config.yaml``, ``summary.json`` and ``results.jsonl`` into ``out`` (``eval.output_dir``; its
    ``model/`` and ``merged_model/`` have their own checks): a :class:`ConfigError` when ``out`` is the model directory,
    lies inside it, or is the checkpoint step holding it (``step_N/`` of ``step_N/policy``, whose ``config.yaml`` a
    resume reads). A model somewhere below ``out`` is left alone (``output_dir=.`` beside ``./models/m`` is fine)."""
    written, model = out.resolve(), model_dir.resolve()
    step = model.parent if model.name == POLICY_DIR else None
    if written == model or written.is_relative_to(model) or written == step:
        raise ConfigError(
            f"eval.output_dir: writing {out} would overwrite the model it evaluates (eval.model_path) ({model_dir}"
            f"{' and its checkpoint step' if written == step else ''}); choose a directory outside it"
        )


def refuse_overwriting(target: Path, model_dir: Path) -> None:
    """Eval replaces ``target`` (a directory under ``eval.output_dir``): a :class:`ConfigError` when that is, holds
    or lies inside the model directory it evaluates (``eval.output_dir`` set to the checkpoint's parent deleted the
    weights being evaluated)."""
    preflight.refuse_overwriting(target, model_dir, "eval.output_dir", "the model it evaluates (eval.model_path)")


#: Training validation's decoding keys and the ``eval`` keys that ``nemo-like eval`` reads in their place.
VALIDATION_COUNTERPARTS = (("val_greedy", "greedy"), ("val_num_generations_per_prompt", "num_samples_per_prompt"), ("val_pass_k", "pass_k"))


def ignored_validation_settings(cfg: MasterConfig) -> list[str]:
    """A line per ``grpo.val_*`` decoding key the recipe changed that eval does not use (it reads ``eval.*``: the
    numbers would not be the run's ``validation/*`` kind). ``grpo.max_val_samples`` and the data are shared."""
    defaults = type(cfg.grpo).model_fields
    lines = []
    for val_key, eval_key in VALIDATION_COUNTERPARTS:
        # eval's pass@k ks as it resolves them (eval.pass_k null: from its samples per prompt, which may be the same ks)
        used = cfg.eval.resolved_pass_k if eval_key == "pass_k" else getattr(cfg.eval, eval_key)
        value = getattr(cfg.grpo, val_key)
        if value != defaults[val_key].default and value != used:
            lines.append(
                f"grpo.{val_key}={value} (training validation) has no effect in nemo-like eval, which uses eval.{eval_key}={used}; "
                f"set eval.{eval_key} to evaluate as the run validated"
            )
    return lines


def eval_config(cfg: MasterConfig, model_dir: str) -> MasterConfig:
    """``cfg`` with generation loading ``model_dir`` and no colocation (there is no policy to share a GPU with)."""
    generation = cfg.policy.generation.model_copy(update={"colocated": ColocatedConfig(enabled=False)})
    tokenizer = cfg.policy.tokenizer_name or cfg.policy.model_name
    policy = cfg.policy.model_copy(update={"model_name": model_dir, "tokenizer_name": tokenizer, "generation": generation})
    return cfg.model_copy(update={"policy": policy})


def summarize(rows: list[dict[str, Any]], ks: list[int]) -> dict[str, Any]:
    """Accuracy (mean correctness over samples), mean reward, pass@k (mean over prompts) and per-task accuracy. A
    sample is a row, except in agent and multi-turn tasks (rows with a ``session``): a session that branched into
    several rows (each with the session's reward) counts once, by its first row, and ``num_rows`` counts the rows."""
    sessions = any("session" in row for row in rows)
    num_rows = len(rows)
    if sessions:
        first: dict[tuple[int, int], dict[str, Any]] = {}
        for row in rows:
            first.setdefault((row["prompt_index"], row["session"]), row)
        rows = list(first.values())
    correct = [row["correct"] for row in rows]
    groups = [row["prompt_index"] for row in rows]
    tasks: dict[str, list[bool]] = {}
    for row in rows:
        tasks.setdefault(row["task"], []).append(row["correct"])
    pass_k = mean_pass_at_k(correct_counts(correct, groups), ks)
    return {
        "accuracy": sum(correct) / len(correct),
        "mean_reward": sum(row["reward"] for row in rows) / len(rows),
        **{f"pass@{k}": value for k, value in pass_k.items()},
        "accuracy_per_task": {task: sum(values) / len(values) for task, values in tasks.items()},
        **({"num_rows": num_rows} if sessions else {}),
    }


def format_table(summary: dict[str, Any]) -> str:
    """The console report: one metric per line."""
    head = (
        f"eval: {summary['model']} on {summary['num_prompts']} prompts x {summary['num_samples_per_prompt']} samples "
        f"({'greedy' if summary['greedy'] else 'sampled'})"
    )
    lines = [head, f"{'metric':<24}{'value':>10}"]
    names = ["accuracy", "mean_reward", *(k for k in summary if k.startswith("pass@"))]
    lines += [f"{name:<24}{summary[name]:>10.4f}" for name in names]
    if len(summary["accuracy_per_task"]) > 1:
        lines += [f"{'accuracy/' + task:<24}{value:>10.4f}" for task, value in summary["accuracy_per_task"].items()]
    lines += [f"{name:<24}{value:>10g}" for name, value in summary["env_metrics"].items() if value]
    return "\n".join(lines)


def evaluate(cfg: MasterConfig) -> dict[str, Any]:
    """Run the evaluation ``cfg.eval`` describes; returns the summary (also written to ``summary.json``)."""
    from nemo_like.algorithms.names import check_plugin_names
    from nemo_like.algorithms.setup import (
        check_environments,
        check_sampled_model,
        load_validation_prompts,
        multi_turn_warnings,
        warn_of_runs_sharing_cores,
        with_environments,
    )
    from nemo_like.distributed.capacity import check_cluster_capacity, sum_resources
    from nemo_like.distributed.planning import plan_on_cluster
    from nemo_like.distributed.ray_init import init_ray, joins_existing_cluster
    from nemo_like.environments.worker import Environments, environment_resources
    from nemo_like.experience.agent_rollouts import AgentHandles, load_agents, shut_down, start_agent_rollouts
    from nemo_like.experience.multi_turn import episode_metrics, template_warnings
    from nemo_like.experience.rollouts import collect_rollout, env_metrics_with_means
    from nemo_like.models.engines import build_generation, generation_resources
    from nemo_like.models.generation.interface import sampling_params
    from nemo_like.models.loading import (
        adapter_base_model,
        check_context_length,
        check_generative,
        check_model_source,
        check_stop_token_ids,
        check_tokenizer_source,
        end_of_sequence_ids,
        policy_model,
        resolve_checkpoint_model,
    )

    start = time.perf_counter()
    ev = cfg.eval
    if ev.greedy and ev.num_samples_per_prompt > 1:
        warnings.warn(
            "eval.greedy=true with eval.num_samples_per_prompt > 1: greedy samples of a prompt are identical, so pass@k equals accuracy",
            RuntimeWarning,
            stacklevel=2,
        )
    if ev.greedy and ev.seed is not None:
        warnings.warn("eval.seed has no effect with eval.greedy=true (greedy decoding draws nothing)", RuntimeWarning, stacklevel=2)
    for line in ignored_validation_settings(cfg):
        warnings.warn(line, RuntimeWarning, stacklevel=2)
    specs = check_plugin_names(cfg)
    model_key = "eval.model_path" if ev.model_path else "policy.model_name"
    model_dir = resolve_checkpoint_model(ev.model_path or cfg.policy.model_name, model_key)
    check_tokenizer_source(cfg, model_checked=ev.model_path is None)  # a bad path was a transformers traceback
    checkpoint_dir = os.path.abspath(model_dir) if Path(model_dir).is_dir() else None  # before a LoRA merge; hub id: None
    lora_base = adapter_base_model(model_dir) if (Path(model_dir) / ADAPTER_CONFIG).is_file() else None
    if lora_base is not None:  # a missing base was a transformers traceback (merge named the key)
        check_model_source(lora_base, f"{Path(model_dir) / ADAPTER_CONFIG} base_model_name_or_path")
    check_context_length(model_dir, cfg.policy.max_total_sequence_length)
    check_stop_token_ids(model_dir, cfg.policy.generation.stop_token_ids)
    check_generative(model_dir, model_key)  # a reward model's score head was read as random logits, the eval went on
    tokenizer, tokenizer_source = eval_tokenizer(cfg, model_dir)
    # The plan's refusals (the backend's settings, a model its sampler cannot sample) before a LoRA merge (minutes for a
    # large model) and Ray's start; it is decided again on the cluster, whose CPUs split the threads
    sampled, model, eos_ids = eval_config(cfg, model_dir), policy_model(model_dir), end_of_sequence_ids(tokenizer, model_dir)
    declared = plan_on_cluster(sampled, tuple(eos_ids), with_policy=False, planning_only=True, model=model)
    check_sampled_model(sampled, declared.backend.value, model_key)
    for line in template_warnings(tokenizer) if cfg.grpo.max_rollout_turns > 1 else []:
        warnings.warn(line, RuntimeWarning, stacklevel=2)
    prompts = load_validation_prompts(cfg, tokenizer)
    check_environments(specs, {"validation": prompts})
    for line in multi_turn_warnings(cfg, specs):  # the environments' no-effect lines, as train prints them
        warnings.warn(line, RuntimeWarning, stacklevel=2)
    out = Path(ev.output_dir).expanduser()  # as training's log and checkpoint directories (a literal ./~ otherwise)
    if checkpoint_dir is not None:  # output_dir at a checkpoint step: its config.yaml (what a resume reads) was replaced
        refuse_results_over_model(out, Path(checkpoint_dir))
    if lora_base is not None:  # the merged model replaces output_dir/merged_model: never the adapters or their base
        refuse_overwriting(out / "merged_model", Path(model_dir))
        refuse_overwriting_base(out / "merged_model", model_dir, "eval.output_dir")
        refuse_replacing_a_model_eval_did_not_merge(out)
    preflight.ensure_writable_dir(out, "eval.output_dir")  # a file there was a FileExistsError traceback
    # Two evals (or an eval and a run) writing one directory interleaved their files: a summary beside another's rows
    with hold_run_locks({"eval.output_dir": out}), registered_run(out):  # a training run starting meanwhile sees it
        if (out / "summary.json").is_file():
            warnings.warn(f"eval.output_dir={out} holds an earlier eval's results: this one replaces them", RuntimeWarning, stacklevel=2)
        if kept := keep_stopped_rows(out):  # this eval's rows start the file afresh: a stopped eval's were lost silently
            warnings.warn(f"eval.output_dir={out} holds a stopped eval's rows: kept as {kept.name}", RuntimeWarning, stacklevel=2)
        if lora_base is not None:  # a LoRA checkpoint: serve its merged model
            merged = merge_checkpoint(model_dir, record_merge(out), tokenizer=tokenizer_source, replace=True)
            model_dir = str(Path(merged).absolute())  # summary.json names it whatever directory the next eval runs from
        run_cfg = eval_config(cfg, with_tokenizer(model_dir, tokenizer, out / "model"))

        import ray

        private = not joins_existing_cluster(cfg.cluster)
        with stop_signals_kept():  # Ray's handler would abort on SIGTERM (134): the command's again after it
            init_ray(cfg.cluster)
        raise_if_stopped()  # a signal whose exception C code swallowed (an import): stop before the sampling
        plan = plan_on_cluster(run_cfg, tuple(eos_ids), with_policy=False, model=model)  # decided once, handed down
        plan = with_environments(plan, specs)
        warn_of_runs_sharing_cores(run_cfg, plan, private, trains=False)
        roles = [generation_resources(run_cfg, plan), *environment_resources(run_cfg)]
        check_cluster_capacity(sum_resources(r.total() for r in roles), ray.cluster_resources(), roles)

        agent_settings = load_agents(specs, plan.agent_tasks)  # a wrong agent path fails before any actor starts
        n = ev.num_samples_per_prompt
        seed = ev.seed if ev.seed is not None else cfg.grpo.seed
        params = sampling_params(run_cfg, greedy=ev.greedy)
        generation = environments = agents = None
        try:
            generation = build_generation(run_cfg, tokenizer.pad_token_id, eos_ids, plan=plan)
            environments = Environments(specs, cfg.cluster.placement_timeout_s)
            generation.wait_ready()  # the first call's deadline must not count the engine's start-up
            environments.wait_ready()
            handles = environments.handles
            if plan.agent_tasks:  # agent tasks are rolled out by their agents, through a rollout server, as in training
                agents = start_agent_rollouts(run_cfg, tokenizer, generation, eos_ids, agent_settings)
                handles = AgentHandles(environments.handles.workers, agents)
            gathered = EvalChunks(out / PARTIAL_RESULTS, len(prompts))
            try:
                for first, end in prompt_chunks(len(prompts), n, ev.samples_per_chunk):
                    rollout = collect_rollout(
                        generation,
                        handles,
                        tokenizer,
                        prompts[first:end],
                        n,
                        params,
                        # hashed: eval.seed s + 1 had redrawn (n - 1)/n of seed s's samples
                        seed_of_chunk(eval_seed(seed), first, n),
                        multi_turn=plan.multi_turn,  # grpo.max_rollout_turns > 1: each sample runs its turns
                    )
                    gathered.add(end, rollout, result_rows(rollout, specs, n, first), plan.multi_turn is not None)
            except BaseException:
                if gathered.rows:
                    print(gathered.stopped_line(), file=sys.stderr, flush=True)
                raise
        finally:
            shut_down(agents, (generation, environments))

        rows = gathered.rows
        summary = {
            "model": ev.model_path or cfg.policy.model_name,
            "model_dir": model_dir,
            "checkpoint_dir": checkpoint_dir,
            "num_prompts": len(prompts),
            "num_samples_per_prompt": n,
            "greedy": ev.greedy,
            "seed": seed,
            "sampling": used_sampling(params),
            "pass_k": ev.resolved_pass_k,
            **summarize(rows, ev.resolved_pass_k),
            "env_metrics": env_metrics_with_means(gathered.env_metrics),  # per-source means of a composed reward, as training logs
            # turns, length cuts and the episodes the chat template ended (multi_turn/*, as training logs them)
            **({"multi_turn_metrics": episode_metrics(gathered.episodes)} if plan.multi_turn else {}),
            "seconds": time.perf_counter() - start,
        }
        write_results(out, rows, summary, recipe_yaml(cfg.model_dump(mode="json")))
        gathered.finish()
        return summary


def used_sampling(params: Any) -> dict[str, Any]:
    """The decoding settings a summary records: greedy decoding uses no temperature, top-p or top-k (null there)."""
    sampling = {key: list(v) if isinstance(v, tuple) else v for key, v in asdict(params).items()}
    if params.greedy:
        sampling.update(temperature=None, top_p=None, top_k=None)
    return sampling


def result_rows(rollout: Any, specs: Any, n: int, first_prompt: int = 0) -> list[dict[str, Any]]:
    """One ``results.jsonl`` row per sample: its prompt, task, reward, response and lengths (and turns, multi-turn).
    Agent and multi-turn tasks: one row per row of a session, with its ``session`` and, as ``sample_index``, the session's index
    among its prompt's sessions (a session that branched has several rows with the same index). ``first_prompt``: the
    rollout's first prompt in the eval's (a chunk's: its prompt indices and sessions counted from the eval's first)."""
    from nemo_like.environments.registry import task_of

    sessions = rollout.session_of_row.tolist() if rollout.session_of_row is not None else None
    if sessions is not None:
        sessions = [first_prompt * n + session for session in sessions]
    sample_of_session: dict[int, dict[int, int]] = {}  # prompt index -> session -> its index among the prompt's sessions
    rows = []
    for i, (prompt, sample, text) in enumerate(zip(rollout.prompts, rollout.samples, rollout.response_texts)):
        reward = float(rollout.rewards[i])
        group = first_prompt + int(rollout.group_ids[i])
        if sessions is None:
            index = {"sample_index": i % n}
        else:
            of_prompt = sample_of_session.setdefault(group, {})
            index = {"session": sessions[i], "sample_index": of_prompt.setdefault(sessions[i], len(of_prompt))}
        rows.append(
            {
                "prompt_id": prompt.id,
                "prompt_index": group,
                **index,
                "task": task_of(prompt.metadata, specs),
                "reward": reward,
                "correct": reward >= CORRECT_REWARD,
                "response": text,
                "answer": _jsonable(prompt.metadata.get("answer")),
                "response_tokens": sample.num_sampled_tokens,
                "truncated": bool(sample.truncated),
                **(
                    {"num_turns": sample.num_turns, "turns": sample.messages, "step_metrics": sample.step_metrics or {}}
                    if sample.messages is not None
                    else {}
                ),
            }
        )
    return rows


def write_results(out: Path, rows: list[dict[str, Any]], summary: dict[str, Any], config_yaml: str) -> None:
    """The table on stderr, then ``results.jsonl``, ``config.yaml`` and ``summary.json`` in ``out``. Each file is
    written whole beside its place and renamed into it; an earlier eval's ``summary.json`` goes first and the new one
    comes last, so an interrupted write never leaves new rows beside an old summary (they had been written in place).
    The table comes first so that a filesystem that refuses the files (full, read-only since the start) loses none of
    the figures: that is one line naming the file, after them."""
    texts = {
        "results.jsonl": "".join(json.dumps(row) + "\n" for row in rows),  # a row json cannot write fails before any file
        "config.yaml": config_yaml,
        "summary.json": json.dumps(summary, indent=2) + "\n",
    }
    print(format_table(summary), file=sys.stderr, flush=True)
    (out / "summary.json").unlink(missing_ok=True)
    for name, text in texts.items():
        try:
            replace_file(out / name, text)
        except OSError as exc:  # a full disk after hours of sampling: the table above has the figures
            raise ConfigError(
                f"eval.output_dir={str(out)!r}: cannot write {name} ({exc.strerror or exc}); the figures above were not saved"
            ) from None
    print(f"[done] {out / 'summary.json'}, {out / 'results.jsonl'}", file=sys.stderr)


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)
