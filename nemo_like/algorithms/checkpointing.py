"""Saving a GRPO run's full state, and resuming it exactly where it stopped."""

from __future__ import annotations

import json
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
import yaml

from nemo_like.algorithms.setup import GRPOComponents
from nemo_like.config.errors import ConfigError
from nemo_like.config.schema import MasterConfig
from nemo_like.distributed.worker_group import WorkerFailure
from nemo_like.experience.async_rollouts import BUFFER_FILE
from nemo_like.models.loading import save_generation_config
from nemo_like.models.lora import ADAPTER_CONFIG, same_adapted_modules
from nemo_like.models.policy.checkpoints import POLICY_DIR, checkpoint_files
from nemo_like.utils.checkpoint import (
    MODULE_SET_KEYS,
    VALIDATED_AT_STEP,
    CheckpointError,
    CheckpointInfo,
    CheckpointManager,
    driver_rng_state,
    incompatible_differences,
    restore_driver_rng_state,
)
from nemo_like.utils.files import replace_file
from nemo_like.utils.log_backends import starts_new_run

#: The policy workers' RNG states, beside the policy's files.
WORKER_RNG_FILE = "worker_rng.pt"
MOVE_IT_AWAY = "Move it away (the previous step_N is then used) or use another checkpointing.checkpoint_dir."


def checkpoint_manager(parts: GRPOComponents) -> CheckpointManager | None:
    ck = parts.cfg.checkpointing
    if not ck.enabled:
        return None
    return CheckpointManager(ck.checkpoint_dir, ck.keep_top_k, ck.metric_name, ck.higher_is_better)


def write_stop_ids(model_dir: Path, end_ids: Sequence[int]) -> None:
    """Give the saved model's ``generation_config.json`` the ids the run ended its responses on (the plan's
    ``end_of_response_ids``: the eos ids and ``policy.generation.stop_token_ids``): plain ``transformers`` ``generate``
    on the copy had stopped only on the base's eos, running past the end the policy learned where
    ``policy.tokenizer_name`` names another eos or a stop id ends turns (``<|im_end|>`` on a base whose eos is
    ``<|endoftext|>``)."""
    from transformers import GenerationConfig

    if not end_ids:
        return
    path = model_dir / "generation_config.json"
    config = GenerationConfig.from_pretrained(model_dir) if path.exists() else GenerationConfig()
    ids = list(end_ids)
    config.eos_token_id = ids[0] if len(ids) == 1 else ids
    save_generation_config(config, model_dir)


def save_run(
    parts: GRPOComponents,
    manager: CheckpointManager,
    step: int,
    metrics: dict[str, Any],
    loader_state: dict[str, int] | None = None,
    extra_state: dict[str, Any] | None = None,
    extra_files: dict[str, Any] | None = None,
) -> Path:
    """Write ``step_<step>/`` with policy weights, optimizer, RNG states, loader position and config.

    The step is refused (:class:`CheckpointError`) when the policy's weights, its optimizer state or any other file
    written here is missing from it (a worker that wrote them elsewhere). ``loader_state`` replaces the driver loader's position (async: the collector owns the data);
    ``extra_state`` goes into the JSON state; each ``extra_files`` value is ``torch.save``d under its name."""
    rng_holder: dict[str, Any] = {}

    def write_contents(tmp: Path) -> None:
        rng_holder["workers"] = parts.policy.save_checkpoint(str(tmp))
        # The run's tokenizer (chat template included) beside the weights: policy/ loads as a model and its tokenizer
        # (AutoTokenizer gave an empty one for a folder without), and `nemo-like merge` ships the tokenizer it trained with.
        parts.tokenizer.save_pretrained(str(tmp / "policy"))
        if not parts.cfg.policy.lora_cfg.enabled:  # an adapter directory: `nemo-like merge` writes the merged model's
            write_stop_ids(tmp / "policy", parts.plan.end_of_response_ids)
        torch.save(rng_holder["workers"], tmp / WORKER_RNG_FILE)
        for name, value in (extra_files or {}).items():
            torch.save(value, tmp / name)

    numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
    loader_state = loader_state if loader_state is not None else parts.train_loader.state_dict()
    state = {
        "weight_version": parts.policy.weight_version,
        "dataloader": loader_state,
        "consumed_prompts": loader_state["consumed"],
        "driver_rng": driver_rng_state(),
        "metrics": numeric,
        **(extra_state or {}),
    }
    expected = (*checkpoint_files(parts.cfg.policy.lora_cfg.enabled), WORKER_RNG_FILE, *(extra_files or {}))
    try:
        return manager.save(step, write_contents, state, parts.cfg.model_dump(mode="json"), expected)
    except CheckpointError as exc:
        if isinstance(exc.__cause__, WorkerFailure):  # a policy rank died writing (the save is the memory peak): the
            raise exc.__cause__ from exc  # run restarts from its last checkpoint, as restore_run lets it; kept: the step before
        raise


def load_checkpoint_file(checkpoint: CheckpointInfo, name: str) -> Any:
    """A file written through ``save_run(extra_files=...)``, or ``None`` when the checkpoint has none."""
    path = checkpoint.path / name
    return torch.load(path, weights_only=False) if path.exists() else None


def adapts_the_same_modules(step_dir: Path, cfg: MasterConfig) -> bool:
    """Whether the LoRA checkpoint in ``step_dir`` holds adapters on exactly the modules ``policy.lora_cfg`` resolves to
    now: ``target_modules: null`` (every decoder linear layer) and the list of those layers are the same adapters,
    which the keys' comparison alone refused. Its ``adapter_config.json`` names them as PEFT saved them (the fewest
    name suffixes that match exactly the adapted modules), resolved here against the model as a target list."""
    lora_cfg = cfg.policy.lora_cfg
    try:
        saved = json.loads((step_dir / POLICY_DIR / ADAPTER_CONFIG).read_text())["target_modules"]
        if not isinstance(saved, list):  # a regular expression: not resolved here
            return False
        as_saved = lora_cfg.model_copy(update={"target_modules": saved, "exclude_modules": None})
        return same_adapted_modules(cfg.policy.model_name, lora_cfg, as_saved)
    except (OSError, ValueError, KeyError, ConfigError):
        return False  # unreadable, or names no module of the model now: the keys' comparison stands


def adapted_expert_parameters(step_dir: Path) -> list[str]:
    """The fused expert parameters a LoRA checkpoint's adapters sit on (PEFT's ``target_parameters``; none for a
    checkpoint of this version, whose targets PEFT adapts as named: :func:`~nemo_like.models.lora.peft_left_out`)."""
    try:
        return sorted(json.loads((step_dir / POLICY_DIR / ADAPTER_CONFIG).read_text()).get("target_parameters") or [])
    except (OSError, ValueError):
        return []


def find_resume_checkpoint(cfg: MasterConfig) -> CheckpointInfo | None:
    """The checkpoint a run will resume from (``None`` for a fresh start). Removes partial saves and
    refuses a checkpoint written by an incompatible config, naming the differing keys."""
    ck = cfg.checkpointing
    if not ck.enabled:
        return None
    manager = CheckpointManager(ck.checkpoint_dir)
    for path in manager.remove_partial_saves():
        print(f"[checkpoint] removed an interrupted save: {path}")
    if not ck.resume:
        if earlier := manager.valid_checkpoints():
            raise CheckpointError(fresh_run_refusal(ck.checkpoint_dir, earlier))
        return None
    checkpoint = manager.latest()
    if checkpoint is None:
        return None
    config_file = checkpoint.path / "config.yaml"
    try:
        saved_config = yaml.safe_load(config_file.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise CheckpointError(
            f"Checkpoint {checkpoint.path} cannot be resumed: {config_file} cannot be read ({exc}). "
            "Move the checkpoint away or use another checkpointing.checkpoint_dir."
        ) from exc
    if not isinstance(saved_config, dict):
        raise CheckpointError(f"Checkpoint {checkpoint.path} cannot be resumed: {config_file} holds no config mapping")
    diffs = incompatible_differences(saved_config, cfg.model_dump(mode="json"))
    if any(d.startswith(MODULE_SET_KEYS) for d in diffs) and adapts_the_same_modules(checkpoint.path, cfg):
        diffs = [d for d in diffs if not d.startswith(MODULE_SET_KEYS)]  # spelled otherwise (null, short names, a list)
    if diffs:  # first: a key changed since (LoRA turned on) leaves other files expected, and "incomplete" misleads
        raise CheckpointError(
            f"Checkpoint {checkpoint.path} was written by an incompatible config; differing keys: "
            + "; ".join(diffs)
            + ". Use another checkpointing.checkpoint_dir, or move its step_* directories away."
        )
    if cfg.policy.lora_cfg.enabled and (fused := adapted_expert_parameters(checkpoint.path)):
        raise CheckpointError(
            f"Checkpoint {checkpoint.path} cannot be resumed: its adapters sit on fused expert parameters ({', '.join(fused)}), "
            "where PEFT put the adapters of layers named like expert projections before such layers were left out "
            "(docs/guides/lora.md); nemo-like eval and merge still read it. Use another checkpointing.checkpoint_dir."
        )
    expected = (*checkpoint_files(cfg.policy.lora_cfg.enabled), WORKER_RNG_FILE)
    if cfg.grpo.async_grpo.enabled:  # the same on both sides (pinned above): an async checkpoint holds its replay buffer
        expected += (BUFFER_FILE,)
    missing = [f for f in expected if not (checkpoint.path / f).is_file()]
    if missing:  # before any actor starts (a partial copy of the directory, a file removed by hand)
        raise CheckpointError(f"Checkpoint {checkpoint.path} is incomplete: no {', '.join(missing)}. {MOVE_IT_AWAY}")
    if checkpoint.step > cfg.grpo.max_num_steps:  # the loop would train nothing and exit 0
        raise CheckpointError(
            f"Checkpoint {checkpoint.path} is at step {checkpoint.step}, past grpo.max_num_steps={cfg.grpo.max_num_steps}: "
            "nothing to train. Raise grpo.max_num_steps, or use another checkpointing.checkpoint_dir."
        )
    return checkpoint


def fresh_run_refusal(checkpoint_dir: str, earlier: Sequence[CheckpointInfo]) -> str:
    """Why ``checkpointing.resume=false`` is refused in a directory holding ``earlier`` checkpoints: the fresh run's
    ``step_N`` would replace theirs (saved over, pruned with them by ``keep_top_k``), and a later resume takes the newest
    of either run."""
    names = [c.path.name for c in earlier]
    listed = ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:2])}, ..., {names[-1]} ({len(names)} in all)"
    return (
        f"checkpointing.resume=false starts a fresh run, but checkpointing.checkpoint_dir={checkpoint_dir} holds an "
        f"earlier run's checkpoints ({listed}): the fresh run would save over those of the same steps and prune them as "
        "its own, and a later resume would take the newest of either run. Use another checkpointing.checkpoint_dir or "
        "move those away (drop checkpointing.resume=false to resume them)"
    )


def run_is_complete(cfg: MasterConfig, checkpoint: CheckpointInfo) -> bool:
    """Whether resuming ``checkpoint`` has nothing left to do: it is at ``grpo.max_num_steps`` and holds that step's
    end-of-run validation (or none is asked for). A checkpoint saved before that validation is not complete: the
    resumed run validates it (and saves it again with it)."""
    if checkpoint.step != cfg.grpo.max_num_steps:
        return False
    validated = checkpoint.state.get("metrics", {}).get(VALIDATED_AT_STEP) == float(checkpoint.step)
    return validated or not cfg.grpo.val_at_end


def restore_run(parts: GRPOComponents, checkpoint: CheckpointInfo) -> int:
    """Load a checkpoint's weights, optimizer, RNG and loader state; returns its step. A file that cannot be read (a
    truncated ``optimizer.pt``, bit rot) is a :class:`CheckpointError` naming the checkpoint, not a worker's traceback;
    a worker that dies meanwhile is still a :class:`WorkerFailure` (a restart)."""
    try:
        rng = torch.load(checkpoint.path / WORKER_RNG_FILE, weights_only=False)
        parts.policy.load_checkpoint(str(checkpoint.path), rng)
    except WorkerFailure:
        raise
    except (ray.exceptions.RayTaskError, OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        cause = getattr(exc, "cause", None) or exc
        reason = next((line.strip() for line in str(cause).splitlines() if line.strip()), type(cause).__name__)
        raise CheckpointError(f"Checkpoint {checkpoint.path} cannot be resumed: {type(cause).__name__}: {reason}. {MOVE_IT_AWAY}") from exc
    parts.train_loader.load_state_dict(checkpoint.state["dataloader"])
    restore_driver_rng_state(checkpoint.state["driver_rng"])
    return int(checkpoint.state["step"])


@dataclass(frozen=True)
class MetricsReplay:
    """The checkpoint run's records that :func:`trim_metrics_after` wrote again after another run's, and the line that
    says so; the run's logger hands the records to the dashboards too (TensorBoard would otherwise show the other run's
    steps before the resumed ones)."""

    note: str
    records: list[dict]


def trim_metrics_after(metrics_path: Path, last_step: int, from_byte: int | None = None) -> MetricsReplay | None:
    """Drop records of steps after ``last_step`` (logged after the checkpoint, redone on resume). The file's first
    ``from_byte`` bytes (what earlier runs wrote) are kept as they are; ``None``: everything before the last run in
    the file (:func:`last_run_start`: another run in the same ``logger.log_dir`` went past the checkpoint's step, and
    its records are not this run's to drop). A torn last line (a process killed mid-write) is dropped too.

    With ``from_byte`` ``None``, when the last run holds no record of ``last_step`` but an earlier one does, another run
    logged here after the checkpoint's: it is kept whole, and the checkpoint run's records up to ``last_step`` are
    written again after it, so the resumed steps continue their own run (the plot's last run was the other run's
    steps followed by the resumed ones). Another run that went past ``last_step`` holds a record of it and still reads
    as the checkpoint's (its later records are dropped, as before). Returns those records and
    a line saying so, else ``None``."""
    if not metrics_path.exists():
        return None
    data = metrics_path.read_bytes()
    start = last_run_start(data) if from_byte is None else from_byte
    lines = data[start:].decode(errors="replace").splitlines()
    kept = [line for line in lines if (step := _step_of(line)) is not None and step <= last_step]
    replay = None
    if from_byte is None and last_step > 0 and not any(_step_of(line) == last_step for line in kept):
        own = _run_ending_at(data[:start], last_step)
        if own:
            other = [line for line in lines if _step_of(line) is not None]  # another run's records: kept whole
            kept = other + own
            note = (
                f"[checkpoint] {metrics_path}: another run logged steps {_step_of(other[0])}-{_step_of(other[-1])} "
                f"here after the checkpoint's run; its records stay, and the checkpoint run's steps up to {last_step} are "
                "written again after them so the resumed steps continue their own run (give each run its own logger.log_dir)"
            )
            replay = MetricsReplay(note, [json.loads(line) for line in own])
    replace_file(metrics_path, data[:start] + "".join(line + "\n" for line in kept).encode())
    return replay


def _run_ending_at(data: bytes, step: int) -> list[str]:
    """The records up to ``step`` of the last run in ``data`` (runs split as :func:`last_run_start` splits them) that
    logged ``step``; empty if none did."""
    runs: list[list[str]] = []
    previous = None
    for line in data.decode(errors="replace").splitlines():
        record = _record_of(line)
        if record is None:
            continue
        if previous is None or starts_new_run(record, previous):
            runs.append([])
        runs[-1].append(line)
        previous = record["step"]
    for run in reversed(runs):
        if any(_step_of(line) == step for line in run):
            return [line for line in run if _step_of(line) <= step]  # type: ignore[operator]
    return []


def last_run_start(data: bytes) -> int:
    """The byte offset where the last run of a ``metrics.jsonl`` begins: the last record that begins a run
    (:func:`~nemo_like.utils.log_backends.starts_new_run`: a fresh run's first carries the marker; a resumed one goes
    on from its checkpoint's step), as :func:`nemo_like.utils.plot.read_metrics` reads it."""
    start = offset = 0
    previous = None
    for line in data.splitlines(keepends=True):
        record = _record_of(line.decode(errors="replace"))
        if record is not None:
            if starts_new_run(record, previous):
                start = offset
            previous = record["step"]
        offset += len(line)
    return start


def _record_of(line: str) -> dict | None:
    """A ``metrics.jsonl`` line's record, its ``step`` an int (``None``: not a metrics record, a torn line)."""
    try:
        record = json.loads(line)
        return {**record, "step": int(record["step"])}
    except (ValueError, KeyError, TypeError):
        return None


def _step_of(line: str) -> int | None:
    record = _record_of(line)
    return None if record is None else record["step"]
