"""The ``data`` section (datasets and splits) and the ``env`` sections (one per task)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_like.config.sections.base import Section
from nemo_like.config.types import Float, Int, OptStr

#: The single-file prompt sources (one file is one split): suffix -> the ``datasets`` builder that reads it.
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
#: Tables ``datasets`` reads that we do not (a folder holding one is refused, naming it: ``datasets`` would read it, or
#: drop it for the folder's most common type).
UNREAD_TABLE_SUFFIXES = (".tsv", ".ndjson", ".arrow", ".geoparquet", ".gpq")
#: Compression suffixes ``datasets`` reads through (``train-00000.jsonl.gz`` is a ``.jsonl`` data file).
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip")


def data_suffix(file: str | Path) -> str:
    """The data suffix of ``file`` (lower case), past a compression suffix: ``.jsonl`` for ``part.jsonl.gz``."""
    name = Path(file).name.lower()
    for compression in COMPRESSION_SUFFIXES:
        name = name.removesuffix(compression)
    return Path(name).suffix


class DatasetSplitConfig(Section):
    """Where one split's prompts come from and how many are used (see docs/guides/data-and-environments.md)."""

    num_problems: Int | None = Field(
        None,
        gt=0,
        description="arithmetic: problems generated for this split (required). Datasets: use at most this many rows, taken "
        "after a seeded shuffle of the split (null: all rows).",
    )
    seed: Int = Field(0, description="arithmetic: generator seed. Datasets: seed of the row shuffle that precedes num_problems.")
    dataset_name: OptStr = Field(
        None, description="Prompt source of this split only (a built-in spec or hub id); default: data.dataset_name."
    )
    dataset_config: OptStr = Field(None, description="Hub config of this split's source; default: data.dataset_config.")
    split: OptStr = Field(
        None, description="Split of the source to read (e.g. 'train', 'test', 'train_1M'); default: the spec's, else 'train' / none."
    )
    data_path: OptStr = Field(
        None,
        description="Local prompts for this split: a .jsonl/.json/.parquet/.csv file, a directory written by "
        "datasets' save_to_disk, or a directory of such files. Takes precedence over the hub.",
    )
    split_fraction: Float | None = Field(
        None,
        gt=0,
        lt=1,
        description="validation only: hold out this fraction of the TRAIN source's rows as validation (by a hash of the "
        "prompt text: seed-independent, disjoint from training, duplicates stay together) when the set has no split of its own.",
    )


class DataConfig(Section):
    dataset_name: OptStr = Field(
        "arithmetic",
        description="Prompt source: 'arithmetic' (seeded synthetic, checked integer answers), a built-in dataset spec "
        "('math-tiny', 'OpenMathInstruct-2', 'DAPO-Math-17k', 'gsm8k', 'MATH-500'), or any Hugging Face hub id "
        "(needs data.prompt_key / data.answer_key); null with data.train.data_path for local files only.",
    )
    dataset_config: OptStr = Field(None, description="Hub config name (e.g. 'main' for gsm8k); default: the spec's.")
    prompt_key: OptStr = Field(
        None,
        description="Column holding the problem text, or a list of chat messages ({role, content}); default: the spec's, "
        "else a 'messages' column when there is one.",
    )
    answer_key: OptStr = Field(
        None,
        description="Column holding the gold answer; dots reach into nested columns (e.g. 'reward_model.ground_truth'). Default: the spec's.",
    )
    task_key: OptStr = Field(
        None, description="Column naming each row's task (metadata['task_name'], which routes the row to an environment)."
    )
    default_task_name: OptStr = Field(
        None, description="Task name of rows without a task column; default: the spec's ('math' for the math sets), else 'math'."
    )
    prompt_file: OptStr = Field(
        None,
        description="Template file for the user message: Python str.format with one '{}' for the problem text (write literal braces as '{{ }}').",
    )
    system_prompt_file: OptStr = Field(None, description="File whose text is the system message (exclusive with data.system_prompt).")
    drop_long_prompts: bool = Field(
        False,
        description="Drop prompts longer than policy.max_total_sequence_length - policy.generation.max_new_tokens (the count "
        "is printed) instead of failing.",
    )
    train: DatasetSplitConfig = Field(default_factory=lambda: DatasetSplitConfig(num_problems=20000, seed=1))
    validation: DatasetSplitConfig = Field(default_factory=lambda: DatasetSplitConfig(num_problems=256, seed=2))
    shuffle: bool = Field(
        True,
        description="Shuffle the training prompts each epoch (seeded by grpo.seed). false: train the rows in file order "
        "(data.train.num_problems keeps the first N; data.train.seed is unused).",
    )
    system_prompt: OptStr = Field(None, description="Optional system message prepended to every prompt.")

    def no_effect_warnings(self) -> list[str]:
        """A split's ``split`` / ``dataset_config`` set while its ``data_path`` is one file (whose rows are the split);
        ``data.train.seed`` set (not the default 1) while ``data.shuffle`` is false and the rows come from a dataset
        (the seed only shuffles its rows; the arithmetic generator still uses it); and a run that trains on a file or
        dataset while validation stays the built-in arithmetic task (only ``data.dataset_name``'s default names it)."""
        lines = []
        unused = self.unused_dataset_keys()
        if unused:  # (a warnings.warn in the validator had printed with warn=False, and once per process)
            lines.append(
                f"data.{', data.'.join(unused)} has no effect with data.dataset_name=arithmetic (the built-in task has no columns)"
            )
        arithmetic = not self.train.data_path and (self.train.dataset_name or self.dataset_name) == "arithmetic"
        if not self.shuffle and not arithmetic and "seed" in self.train.model_fields_set and self.train.seed != 1:
            lines.append(
                f"data.train.seed={self.train.seed} has no effect: data.shuffle=false trains the rows in file order "
                "(the seed only shuffles them)"
            )
        v = self.validation
        validation_arithmetic = not v.data_path and v.split_fraction is None and (v.dataset_name or self.dataset_name) == "arithmetic"
        if not arithmetic and validation_arithmetic and v.dataset_name != "arithmetic":
            train = f"data.train.data_path={self.train.data_path!r}" if self.train.data_path else f"'{self.train.dataset_name}'"
            lines.append(
                f"data.validation is the built-in arithmetic task (data.dataset_name='arithmetic') while the run trains on "
                f"{train}: validation/accuracy measures arithmetic, not that data. Set data.validation.data_path or "
                "data.validation.split_fraction, or data.validation.dataset_name=arithmetic to keep it"
            )
        for role in ("train", "validation"):
            split_cfg: DatasetSplitConfig = getattr(self, role)
            if not split_cfg.data_path or data_suffix(split_cfg.data_path) not in FILE_BUILDERS:
                continue
            for key in ("split", "dataset_config"):
                if getattr(split_cfg, key) is not None:
                    lines.append(
                        f"data.{role}.{key} has no effect: data.{role}.data_path={split_cfg.data_path!r} is one file, "
                        "whose rows are the split (a save_to_disk directory holds splits to choose from)"
                    )
        return lines

    @model_validator(mode="after")
    def _consistent(self) -> DataConfig:
        if self.system_prompt and self.system_prompt_file:
            raise ValueError("data.system_prompt and data.system_prompt_file are both set; keep one of them")
        if self.train.split_fraction is not None:
            raise ValueError(
                "data.train.split_fraction is not a thing: set data.validation.split_fraction to hold out part of the training source"
            )
        v = self.validation
        if v.split_fraction is not None and (v.data_path or v.dataset_name or v.split):
            raise ValueError(
                "data.validation.split_fraction carves validation out of the training source, but data.validation also names "
                "its own source (data_path / dataset_name / split); keep one of them"
            )
        train_name = self.train.dataset_name or self.dataset_name
        if v.split_fraction is not None and train_name == "arithmetic" and not self.train.data_path:
            raise ValueError(
                "data.validation.split_fraction does not apply to the arithmetic task, which has its own disjoint validation split; unset it"
            )
        for role, split in (("train", self.train), ("validation", self.validation)):
            name = split.dataset_name or self.dataset_name
            synthetic = name == "arithmetic" and not split.data_path and split.split_fraction is None
            if synthetic and split.num_problems is None:
                raise ValueError(f"data.{role}.num_problems is required for the arithmetic task (how many problems to generate)")
        return self

    def unused_dataset_keys(self) -> list[str]:
        """Column keys set while both splits are the synthetic arithmetic task (they have no effect)."""
        if any(s.dataset_name not in (None, "arithmetic") or s.data_path or s.split_fraction for s in (self.train, self.validation)):
            return []
        if self.dataset_name != "arithmetic":
            return []
        unused = [
            k for k in ("dataset_config", "prompt_key", "answer_key", "task_key", "default_task_name") if getattr(self, k) is not None
        ]
        return unused + [f"{role}.split" for role, s in (("train", self.train), ("validation", self.validation)) if s.split]


class EnvSectionConfig(BaseModel):
    """One environment (``env.<task>``): the section name is the task it scores (``metadata["task_name"]``).

    Keys besides ``class`` and ``num_workers`` are the environment's own settings, passed to its
    constructor and checked against it before any actor starts (see docs/guides/data-and-environments.md)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, serialize_by_alias=True)

    env_class: OptStr = Field(
        None,
        alias="class",
        description="Environment class: a built-in name ('arithmetic', 'math', 'tool', 'guess_number', 'reward_model', 'judge', "
        "'composite', 'length_penalty', 'agent') or 'module:Class' implementing "
        "EnvironmentInterface; default: the built-in named like the section.",
    )
    num_workers: Int = Field(1, gt=0, description="Ray actors of this environment; its responses are sharded across them.")


#: Keys of the single-environment shorthand ``env: {name: arithmetic, num_workers: 1, ...}``.
_SHORTHAND_NAME = "name"


def _looks_like_a_task_section(key: str, value: Any, name: str) -> bool:
    """A key merged into a shorthand ``env`` that is a task's section, not one of the named environment's settings:
    a section (a mapping, or null) named like the environment (the agent environment's own ``agent`` setting is a
    string), or a mapping with a section's own keys (no environment setting holds those)."""
    section = value is None or isinstance(value, dict)
    return (key == name and section) or (isinstance(value, dict) and bool({"class", "num_workers"} & set(value)))


def normalize_env_sections(value: Any) -> Any:
    """Accept the single-environment shorthand ``{name: X, num_workers: N, <X's keys>}`` as ``{X: {...}}``;
    an empty/missing ``env`` means one arithmetic environment with default settings."""
    if value is None:
        return {"arithmetic": {}}
    if not isinstance(value, dict):
        return value
    if not value:
        return {"arithmetic": {}}
    if _SHORTHAND_NAME in value:  # one environment's section, whose own settings may nest (a composite's sources)
        section = dict(value)
        name = section.pop(_SHORTHAND_NAME)
        if not isinstance(name, str):
            raise ValueError(f"env.name must be an environment name, got {name!r}")
        if merged := sorted(k for k, v in section.items() if _looks_like_a_task_section(k, v, name)):
            raise ValueError(
                f"env mixes the single-environment shorthand (env.name={name}) with per-task sections {merged} (a parent "
                "recipe's env, or a '+env.<task>.<key>' override, merged into it); write one section per task, "
                "env: {<task>: {class: ..., ...}}, or set '_override_: true' in the shorthand to replace the parent's env"
            )
        return {name: section}
    nested = {k for k, v in value.items() if isinstance(v, dict) or v is None}
    flat = set(value) - nested
    if not flat:
        return {task: (section if section is not None else {}) for task, section in value.items()}
    if nested:
        raise ValueError(
            f"env mixes the single-environment shorthand (keys {sorted(flat)}) with per-task sections {sorted(nested)}; "
            "write one section per task: env: {<task>: {num_workers: ..., ...}}"
        )
    return {"arithmetic": dict(value)}
