"""Prompt datasets through Hugging Face ``datasets``: hub names, local files, and specs of known sets.

A *source* is where one split's rows come from: a local file or directory (``data.<split>.data_path``)
or a hub set (``data.dataset_name`` + config + split). A *spec* names the columns of a known set, so
a recipe only has to name it. Rows become :class:`Problem`\\ s (messages, gold answer, task name);
tokenising them is :mod:`nemo_like.data.prompts`' job.

Selection of one split's rows, in order:
1. carve (validation only, ``data.validation.split_fraction``): a row belongs to validation iff a
   sha256 of its prompt text falls below the fraction; training keeps the others. Seed- and
   order-independent, and duplicate rows always land on the same side.
2. seeded shuffle of the row indices (``data.<split>.seed``), then the first ``num_problems``. Training with
   ``data.shuffle`` false keeps file order instead (the first ``num_problems`` rows); validation is always shuffled.
Every error is a :class:`ConfigError` naming the file/set, the row and the key to change.
"""

from __future__ import annotations

import csv
import glob
import hashlib
import json
import logging
import math
import os
import random
import re
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from nemo_like.config.errors import ConfigError
from nemo_like.config.schema import DataConfig, DatasetSplitConfig
from nemo_like.config.sections.data import FILE_BUILDERS, UNREAD_TABLE_SUFFIXES, data_suffix
from nemo_like.data.templates import PromptFormat, dropped_message_keys
from nemo_like.environments.math_verify_process import number_text

ARITHMETIC = "arithmetic"
#: Task name of rows whose source names none (the math-verify environment's name).
DEFAULT_TASK = "math"
#: Local file suffixes and the ``datasets`` builder that reads them.


def gsm8k_final_answer(solution: str) -> str:
    """GSM8K's gold answer: the text after the final ``####`` of the worked solution, commas removed."""
    if "####" not in solution:
        raise ValueError("no '####' marker in the GSM8K answer")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


@dataclass(frozen=True)
class DatasetSpec:
    """Column layout and splits of a known prompt set."""

    name: str
    hub_id: str | None
    prompt_key: str
    answer_key: str
    task_name: str = DEFAULT_TASK
    task_key: str | None = None
    config: str | None = None
    train_split: str | None = "train"
    validation_split: str | None = None
    answer_transform: Callable[[str], str] | None = None
    #: Shipped files per split (relative to the package); used instead of the hub.
    local_files: dict[str, str] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()


_ASSETS = Path(__file__).resolve().parents[1] / "assets"

# Column names as published on the Hugging Face hub dataset cards (checked against the cards'
# schemas; splits noted where they matter).
SPECS: tuple[DatasetSpec, ...] = (
    # Shipped: scripts/build_math_dataset.py -> nemo_like/assets/math-tiny/ (problem, answer, task).
    DatasetSpec(
        "math-tiny",
        None,
        "problem",
        "answer",
        task_key="task",
        validation_split="validation",
        local_files={"train": str(_ASSETS / "math-tiny" / "train.jsonl"), "validation": str(_ASSETS / "math-tiny" / "validation.jsonl")},
    ),
    # Shipped: scripts/build_multiturn_datasets.py -> nemo_like/assets/multiturn-tasks/ (problem, answer, task).
    *(
        DatasetSpec(
            name,
            None,
            "problem",
            "answer",
            task_key="task",
            validation_split="validation",
            local_files={s: str(_ASSETS / "multiturn-tasks" / name / f"{s}.jsonl") for s in ("train", "validation")},
        )
        for name in ("tool-arith", "guess-number")
    ),
    # nvidia/OpenMathInstruct-2: problem, generated_solution, expected_answer, problem_source.
    # Splits train (14M rows), train_1M, train_2M, train_5M; no validation split (NeMo-RL uses train_1M).
    DatasetSpec(
        "OpenMathInstruct-2",
        "nvidia/OpenMathInstruct-2",
        "problem",
        "expected_answer",
        train_split="train_1M",
        aliases=("openmathinstruct2", "openmath"),
    ),
    # BytedTsinghua-SIA/DAPO-Math-17k: data_source, prompt (chat messages [{content, role}] that already
    # carry the "Answer: $Answer" instruction), ability, reward_model {ground_truth, style}, extra_info
    # {index}. One 'train' split; each of the ~17k problems is repeated ~100 times (1.79M rows).
    DatasetSpec("DAPO-Math-17k", "BytedTsinghua-SIA/DAPO-Math-17k", "prompt", "reward_model.ground_truth", aliases=("dapomath17k", "dapo")),
    # openai/gsm8k, config 'main' (or 'socratic'): question, answer (worked solution ending "#### 72").
    # Splits train (7,473) and test (1,319).
    DatasetSpec("gsm8k", "openai/gsm8k", "question", "answer", config="main", validation_split="test", answer_transform=gsm8k_final_answer),
    # HuggingFaceH4/MATH-500: problem, solution, answer, subject, level, unique_id. One 'test' split,
    # meant for evaluation, so it has no training split by default.
    DatasetSpec("MATH-500", "HuggingFaceH4/MATH-500", "problem", "answer", train_split=None, validation_split="test", aliases=("math500",)),
)


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def find_spec(name: str | None) -> DatasetSpec | None:
    """The spec called ``name`` (its name, hub id or an alias; case, '-' and '_' ignored), if any."""
    if not name:
        return None
    key = _norm(name)
    for spec in SPECS:
        if key in {_norm(spec.name), *(_norm(a) for a in spec.aliases)} or (spec.hub_id and key == _norm(spec.hub_id)):
            return spec
    return None


@dataclass(frozen=True)
class Source:
    """Where one split's rows come from (exactly one of ``data_path`` / ``hub_id`` is set)."""

    role: str  # "train" | "validation"
    spec: DatasetSpec | None
    data_path: str | None = None
    hub_id: str | None = None
    config: str | None = None
    split: str | None = None
    split_given: bool = False  # ``data.<role>.split`` set (else ``split`` is the default: train, or the spec's)

    @property
    def label(self) -> str:
        """How errors name this source."""
        if self.data_path:
            if Path(self.data_path).is_dir():  # rows are numbered across its files, in the order datasets reads them
                parts = [f"split {self.split!r}"] if self.split else []
                parts.append("its files' rows in file-name order")
                return f"{self.data_path} ({'; '.join(parts)})"
            return self.data_path
        return f"hub dataset {self.hub_id!r}" + (f" config {self.config!r}" if self.config else "") + f" split {self.split!r}"


@dataclass(frozen=True)
class Problem:
    """One prompt before tokenisation."""

    id: str
    messages: list[dict[str, str]]
    answer: str | int  # int only for the built-in arithmetic task
    task_name: str
    where: str  # e.g. "row 17 of train.jsonl", for error messages


def is_arithmetic(data: DataConfig, role: str) -> bool:
    """Whether ``role``'s prompts are the built-in synthetic arithmetic task."""
    split = data.train if role == "train" else data.validation
    carved = role == "validation" and split.split_fraction is not None
    return (split.dataset_name or data.dataset_name) == ARITHMETIC and not split.data_path and not carved


def resolve_source(data: DataConfig, role: str) -> Source:
    """The source of ``role`` ('train' or 'validation'); a carved validation split shares train's source.

    A split's own ``dataset_name`` / ``dataset_config`` / ``split`` / ``data_path`` win over the
    top-level ``data.dataset_name`` / ``data.dataset_config`` and the spec's defaults; the top-level
    config name applies only to the top-level set.
    """
    split_cfg: DatasetSplitConfig = data.train if role == "train" else data.validation
    if role == "validation" and split_cfg.split_fraction is not None:
        return resolve_source(data, "train")
    name = split_cfg.dataset_name or data.dataset_name
    if name == ARITHMETIC:
        name = None  # a file for one split of an otherwise arithmetic recipe
    spec = find_spec(name)
    if spec:
        default_split = spec.train_split if role == "train" else spec.validation_split
    else:
        default_split = "train" if role == "train" else None
    split = split_cfg.split or default_split
    if split_cfg.data_path:  # a directory may hold several subsets (a hub snapshot): the config names one
        config = split_cfg.dataset_config or (None if split_cfg.dataset_name else data.dataset_config)
        if config is None and spec and spec.config and has_subset(Path(split_cfg.data_path), spec.config):
            config = spec.config  # a local snapshot of the spec's hub set: its subset, as the hub load takes
        return Source(role, spec, data_path=split_cfg.data_path, config=config, split=split, split_given=split_cfg.split is not None)
    if spec and role in spec.local_files and not split_cfg.split:
        return Source(role, spec, data_path=spec.local_files[role])
    if spec and spec.local_files and not spec.hub_id:  # a shipped set: its splits are its files
        if split not in spec.local_files:
            raise ConfigError(f"data.{role}.split={split!r}: {spec.name} ships the splits {sorted(spec.local_files)}; choose one of them")
        return Source(role, spec, data_path=spec.local_files[split])
    if not name:
        raise ConfigError(
            f"data.{role}: no prompt source. Set data.{role}.data_path (a .jsonl/.json/.parquet/.csv file or a "
            f"save_to_disk directory) or data.dataset_name"
            + (", or data.validation.split_fraction to hold out part of the training rows" if role == "validation" else "")
        )
    if split is None:
        what = f"{spec.name} has no {role} split" if spec else f"data.{role}.split is not set for {name!r}"
        raise ConfigError(
            f"{what}. Set data.{role}.split (a split of the set) or data.{role}.data_path / data.{role}.dataset_name "
            "(another source)"
            + (", or data.validation.split_fraction (hold out part of the training rows)" if role == "validation" else "")
        )
    top_config = None if split_cfg.dataset_name else data.dataset_config
    config = split_cfg.dataset_config or top_config or (spec.config if spec else None)
    return Source(role, spec, hub_id=spec.hub_id if spec and spec.hub_id else name, config=config, split=split)


def _innermost_message(exc: BaseException) -> str:
    """The root cause's message (``datasets`` wraps e.g. a JSON parse error naming the bad line)."""
    seen = {id(exc)}
    while (inner := exc.__cause__ or exc.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        exc = inner
    return str(exc) or type(exc).__name__


#: Compressions whose codec is a package of its own (fsspec reads them only where it is installed).
COMPRESSION_PACKAGES = {".zst": "zstandard", ".lz4": "lz4"}


def unreadable_compression(file: Path) -> str | None:
    """Why ``file``'s compression cannot be read here (its codec's package is missing; a compressed Parquet file, which
    compresses inside itself), or ``None``."""
    from fsspec.utils import infer_compression

    name = file.name.lower()
    for suffix, package in COMPRESSION_PACKAGES.items():
        if name.endswith(suffix) and infer_compression(name) is None:
            return f"reading {suffix} files needs the {package!r} package (pip install {package}), or decompress it"
    if data_suffix(file) == ".parquet" and not name.endswith(".parquet"):
        return "a Parquet file compresses inside itself: give the .parquet file, not a compressed copy"
    return None


def open_text(path: Path, encoding: str = "utf-8", newline: str | None = None, errors: str = "replace") -> IO[str]:
    """``path`` opened as text, decompressed as its suffix says (``.jsonl.gz``: gzip; what ``datasets`` reads through)."""
    import fsspec

    return fsspec.open(str(path), mode="rt", compression="infer", encoding=encoding, errors=errors, newline=newline).open()


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    row = dict(pairs)
    if len(row) < len(pairs):
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise ValueError(f"the key {twice!r} appears twice in one object")
    return row


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} is beyond a 64-bit float")
    return value


def _64_bit_int(text: str) -> int:
    value = int(text)
    if not -(1 << 63) <= value < 1 << 64:  # pyarrow reads up to uint64
        raise ValueError(f"the integer {text} is beyond 64 bits")
    return value


#: What pyarrow's JSON reader refuses and Python's json module takes: a duplicate key, a float literal past a double
#: (``1e400``), an integer past 64 bits. Looked for only where no line is malformed (:func:`first_bad_json_line`).
_STRICT_JSON: dict[str, Any] = {"object_pairs_hook": _unique_keys, "parse_float": _finite_float, "parse_int": _64_bit_int}


def first_bad_json_line(path: Path) -> str | None:
    """``line N: <what is wrong>`` for the first line of a JSONL file that is not one JSON object (blank lines are
    allowed), or failing that the first that pyarrow's reader refuses (:data:`_STRICT_JSON`); ``None`` when there is
    none. The ``datasets`` loader's own message points into pandas' fallback parser, at a byte offset of the wrong
    line."""
    for strict in ({}, _STRICT_JSON):  # a malformed line first: a line the strict reading refuses may load
        with open_text(path) as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line, **strict)
                except json.JSONDecodeError as exc:
                    return f"line {number}, column {exc.colno}: not valid JSON ({exc.msg})"
                except ValueError as exc:  # an integer of more digits than Python converts, or a _STRICT_JSON refusal
                    return f"line {number}: not valid JSON ({exc})"
                if not isinstance(row, dict):
                    return f"line {number}: a JSON {type(row).__name__}, expected an object (one row per line)"
    return None


def first_bad_json_place(path: Path) -> str | None:
    """Where a ``.json`` or ``.jsonl`` prompt file stops being valid: a whole-file JSON document (an array of rows)
    by :func:`json.loads`'s line and column, else one object per line (:func:`first_bad_json_line`); ``None`` when it
    parses. pandas' own message gives a byte offset, for JSON Lines at the end of the last good line."""
    with open_text(path) as handle:
        text = handle.read()
    if not text.lstrip().startswith("["):
        try:
            json.loads(text)  # one whole document (a pretty-printed object, a save_to_disk's state.json): not the culprit
            return None
        except json.JSONDecodeError:
            return first_bad_json_line(path)
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        return f"line {exc.lineno}, column {exc.colno}: not valid JSON ({exc.msg})"
    return None


def _wide_unicode(path: Path) -> str | None:
    """``"UTF-16"`` / ``"UTF-32"`` when ``path`` (decompressed) starts with that encoding's byte-order mark, else None."""
    import fsspec

    with fsspec.open(str(path), "rb", compression="infer") as handle:
        start = handle.read(4)
    if start in (b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff"):
        return "UTF-32"
    return "UTF-16" if start[:2] in (b"\xff\xfe", b"\xfe\xff") else None


def csv_header(path: Path, key: str) -> list[str]:
    """The column names of a CSV file, after checking that every record has as many fields as the header (an unquoted
    comma shifts a row's columns; pandas silently made the extra first field an index). Blank lines are skipped."""
    if encoding := _wide_unicode(path):  # read as UTF-8 it had "fields" the header had not
        raise ConfigError(f"{key}: {str(path)!r} is {encoding} text (a spreadsheet's 'Unicode text' export?); save it as UTF-8 CSV")
    with open_text(path, encoding="utf-8-sig", newline="") as handle:
        reader = csv.reader(handle)
        header: list[str] | None = None
        line = 1
        for record in reader:
            if record:
                if header is None:
                    header = record
                    if len(set(header)) < len(header):
                        twice = sorted({name for name in header if header.count(name) > 1})
                        raise ConfigError(f"{key}: {str(path)!r}: the header names the columns {twice} more than once")
                elif len(record) != len(header):
                    raise ConfigError(
                        f"{key}: {str(path)!r} line {line} has {len(record)} fields, the header has {len(header)}; "
                        'quote fields that contain commas ("What is 1,000 + 2?")'
                    )
            line = reader.line_num + 1  # the next record's first line (a quoted field may span lines)
    return header or []


def _csv_kwargs(header: list[str]) -> dict[str, Any]:
    """The CSV builder's settings that keep every cell as written: no type guessing (02108 -> 2108, 3.10 -> 3.1,
    "NA" -> empty) and no index column."""
    import datasets

    strings = datasets.Features({name: datasets.Value("string") for name in header})
    return {"features": strings, "keep_default_na": False, "index_col": False}


def directory_data_files(path: Path, suffixes: Collection[str] = tuple(FILE_BUILDERS)) -> list[Path]:
    """The data files ``datasets`` reads from a directory: ``suffixes`` (ours; compressed ones too), hidden and ``__``
    parts and the metadata files ``datasets`` never reads as data (its ``FILES_TO_IGNORE``: a hub snapshot's
    ``dataset_infos.json`` beside its ``train.jsonl`` was counted a data file) skipped."""
    from datasets.data_files import FILES_TO_IGNORE

    return [
        file
        for file in sorted(path.rglob("*"))
        if file.is_file()
        and data_suffix(file) in suffixes
        and file.name not in FILES_TO_IGNORE
        and not any(part.startswith((".", "__")) for part in file.relative_to(path).parts)
    ]


def parquet_shard_mismatch(path: Path, load_kwargs: dict[str, Any]) -> str | None:
    """Where the Parquet shards of one split of folder ``path`` stop agreeing with its first shard, for a load that
    failed: other columns, or a column of another type; ``None`` when they agree (or the split is not all Parquet).
    ``datasets`` casts every shard to the first one's schema (columns in any order): an extra column failed with advice
    about value types, a float where the first shard had integers named neither the file nor the column."""
    import fsspec
    import pyarrow.parquet as pq

    for files in _builder_data_files(path, load_kwargs).values():
        if len(files) < 2 or any(FILE_BUILDERS.get(data_suffix(f)) != "parquet" for f in files):
            continue
        schemas = []
        for file in files:
            with fsspec.open(file, "rb", compression="infer") as handle:
                schemas.append(pq.read_schema(handle))
        first = schemas[0]
        for file, schema in zip(files[1:], schemas[1:]):
            if set(schema.names) != set(first.names):
                return f"{file!r} has the columns {schema.names}, {files[0]!r} {first.names}: every shard of a split needs the same columns"
            for name in first.names:
                if schema.field(name).type != first.field(name).type:
                    return f"column {name!r} is {schema.field(name).type} in {file!r}, {first.field(name).type} in {files[0]!r}"
    return None


def _shard_types_mismatch(path: Path, source: Source) -> str | None:
    """:func:`parquet_shard_mismatch` for a folder whose load failed (``None`` where it cannot say)."""
    try:
        return parquet_shard_mismatch(path.resolve(), _subset_kwargs(path, source.config))
    except Exception:  # noqa: BLE001 - the load's own error is reported; this only adds where it can
        return None


def _refuse_unread_table_files(path: Path, source: Source, key: str, load_kwargs: dict[str, Any]) -> None:
    """Raise for a directory (the part :func:`_folder_to_check` names) holding tables ``datasets`` reads and we do not
    read as it would (:data:`UNREAD_TABLE_SUFFIXES`): ``.tsv`` / ``.ndjson`` (type-guessed cells, ``007`` as 7, where a
    single file is refused), and ``.arrow`` / ``.geoparquet`` beside our data files (``datasets`` reads one file type a
    folder: an ``.arrow`` shard beside JSON Lines files had its rows dropped silently; a folder of them alone loads)."""
    root = _folder_to_check(path, source, load_kwargs)
    if root is None:
        return
    mixed = bool(directory_data_files(root))
    unread = [f for f in directory_data_files(root, UNREAD_TABLE_SUFFIXES) if mixed or data_suffix(f) in (".tsv", ".ndjson")]
    if unread:
        raise ConfigError(
            f"{key}: {str(unread[0])!r} in {str(path)!r} is a {data_suffix(unread[0])} file"
            f"{f' (and {len(unread) - 1} more of such types)' if len(unread) > 1 else ''}, which is not read here; data files "
            f"are {', '.join(sorted(FILE_BUILDERS))} (compressed too): convert it (a .tsv as .csv, an .ndjson named .jsonl) "
            "or move it out of the folder"
        )


def _csv_directory_kwargs(path: Path, key: str) -> dict[str, Any]:
    """For a directory whose data files are all CSV (``datasets`` reads it with its CSV builder, one split per file
    name), the same no-guessing settings as a single CSV file; they need one header across the files. Else none."""
    data_files = directory_data_files(path)
    if not data_files or any(FILE_BUILDERS.get(data_suffix(file)) != "csv" for file in data_files):
        return {}  # not all CSV
    headers = {file: csv_header(file, key) for file in data_files}
    first = data_files[0]
    for file, header in headers.items():
        if header != headers[first]:
            raise ConfigError(
                f"{key}: the CSV files of {str(path)!r} need one header; {str(first)!r} has {headers[first]}, {str(file)!r} has {header}"
            )
    return _csv_kwargs(headers[first])


#: The largest JSON file read as one chunk (pyarrow parses a chunk as one block: ~4x its size in memory, and a block
#: of 2 GiB overflows its 32-bit block size).
WHOLE_JSON_CHUNK_MAX = 256 << 20


def _json_file(file: Path) -> bool:
    """Whether ``file`` is a JSON or JSON Lines file, compressed or not (``.jsonl``, ``.jsonl.gz``)."""
    return FILE_BUILDERS.get(data_suffix(file)) == "json"


def _plain_json_file(file: Path) -> bool:
    """Whether ``file`` is a JSON or JSON Lines file, not compressed (``.jsonl``, not ``.jsonl.gz``)."""
    return _json_file(file) and data_suffix(file) == file.suffix.lower()


def _json_kwargs(files: list[Path]) -> dict[str, Any]:
    """For JSON files (and directories of them) up to :data:`WHOLE_JSON_CHUNK_MAX`, read each file as one chunk:
    ``datasets`` types a column from its first 10 MB, and a value of another type past that (integer answers, then
    ``"\\frac{1}{2}"``) failed the load with a cast error naming neither the row nor the key, where the same values in a
    smaller file load (the column becomes JSON, whose values the answer reader takes). Larger and compressed files
    (whose read size is unknown) keep the default; such a cast error then says what to change (:func:`_load_local`)."""
    if not files or not all(map(_plain_json_file, files)):
        return {}
    return {"chunksize": min(max(10 << 20, max(f.stat().st_size for f in files) + 1), WHOLE_JSON_CHUNK_MAX)}


def _raw_json_rows(file: Path, keep: set[str]) -> list[dict[str, Any]] | None:
    """The rows of a JSON or JSON Lines file (decompressed as its suffix says) as Python's ``json`` reads them (one
    object a line, a top-level list of objects, or one object), each cut to its ``keep`` keys as it is read; ``None``
    for any other shape or text that is not UTF-8 (read as ``datasets`` reads it, not re-read: its errors name the key)."""

    def cut(row: Any) -> dict[str, Any] | None:
        return {k: v for k, v in row.items() if k in keep} if isinstance(row, dict) else None

    def text() -> IO[str]:  # lines end at "\n" only: JSON strings may hold U+2028, U+2029, U+0085 (and \r) raw
        return open_text(file, encoding="utf-8-sig", newline="\n", errors="strict")

    try:
        with text() as lines:
            rows = [cut(json.loads(line)) for line in lines if line.strip()]
        if all(row is not None for row in rows):
            return rows
    except json.JSONDecodeError:
        pass  # a JSON document over several lines (or a list on one)
    except UnicodeDecodeError:
        return None
    try:
        with text() as whole_text:
            whole = json.loads(whole_text.read())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    rows = [cut(row) for row in (whole if isinstance(whole, list) else [whole])]
    return rows if all(row is not None for row in rows) else None


def _builder_data_files(path: Path, load_kwargs: dict[str, Any] | None = None) -> dict[str, list[str]]:
    """The data files ``datasets.load_dataset(path, **load_kwargs)`` reads, by split, in the order their rows come, as
    its builder resolves them (split-named files, a README card's ``configs``, other files skipped)."""
    import datasets

    card_log = logging.getLogger("huggingface_hub.repocard")  # its notice of a README without metadata: said by the load
    level = card_log.level
    card_log.setLevel(logging.ERROR)
    try:
        return dict(datasets.load_dataset_builder(str(path), **(load_kwargs or {})).config.data_files or {})
    finally:
        card_log.setLevel(level)


def _split_data_files(path: Path, source: Source) -> list[Path]:
    """The files ``datasets`` reads for ``source``'s split of folder ``path`` (:func:`_builder_data_files`, its subset
    ``data.<role>.dataset_config`` if any, the split :func:`_chosen_split` picks); ``[]`` when that is not one split, or
    the builder cannot resolve the folder."""
    try:
        by_split = _builder_data_files(path.resolve(), _subset_kwargs(path, source.config))
    except Exception:  # noqa: BLE001 - a folder the builder cannot resolve is read as load_dataset reads it, not re-read
        return []
    return [Path(f) for f in by_split.get(_chosen_split(list(by_split), source), [])]


def json_columns_as_written(ds: Any, source: Source, names: list[str]) -> dict[str, list[Any]]:
    """The values of ``names``' columns re-read from a local JSON source as written, where ``datasets`` may have
    changed them; ``{}`` where it cannot have, or for a source this cannot re-read (its values stay as ``datasets``
    gives them).

    * A column mixing numbers and text in a file is typed ``Json`` (at any depth), and a text cell that parses as JSON
      comes back parsed: the answer ``"007"`` came back as ``7``, ``"1.50"`` as ``1.5``, ``"true"`` as ``True`` (then
      refused as not text), ``"[1, 2]"`` as a list. Such columns are re-read.
    * A folder's files (its splits' shards) are cast to one type a column, its first file's: after a file of text
      answers, another file's ``Json`` column came back JSON-encoded (``"x"`` as ``'"x"'``, so no answer matched) and its
      numbers as text. Every column of ``names`` of a folder is re-read.

    Re-read for a local source of JSON / JSON Lines files, compressed or not (one file, or the files ``datasets`` reads
    for the subset's split from a folder) whose rows are the loaded set's, in order."""
    import datasets

    if source.data_path is None:
        return {}
    path = Path(source.data_path)
    if path.is_file():
        files = [path]
    elif _saved_dataset(path):
        return {}
    else:
        files = _split_data_files(path, source)
    if not files or not all(map(_json_file, files)):
        return {}
    reread = names if path.is_dir() else [name for name in names if _holds_json(ds.features.get(name), datasets.Json)]
    if not reread:
        return {}
    rows: list[dict[str, Any]] = []
    for file in files:
        file_rows = _raw_json_rows(file, set(reread))
        if file_rows is None:
            return {}
        rows += file_rows
    if len(rows) != len(ds):
        return {}
    return {name: [row.get(name) for row in rows] for name in reread}


def _has_blank_line(file: Path) -> bool:
    """Whether a plain text file has a line of only whitespace (its last line break aside)."""
    return any(not line.strip() for line in file.read_text(encoding="utf-8-sig", errors="replace").rstrip("\n").split("\n"))


def _holds_json(feature: Any, json_type: type) -> bool:
    """Whether a column's ``datasets`` feature is ``Json`` or holds one at any depth (``{"b": Json}``: the rows'
    ``{"a": {"b": ...}}`` with mixed ``b`` values, read through ``data.answer_key=a.b``)."""
    if isinstance(feature, json_type):
        return True
    if isinstance(feature, dict):
        return any(_holds_json(inner, json_type) for inner in feature.values())
    inner = getattr(feature, "feature", None)  # List / Sequence / LargeList
    return inner is not None and _holds_json(inner, json_type)


def _saved_dataset(path: Path) -> bool:
    """Whether directory ``path`` holds a ``save_to_disk`` dataset (or dataset dict)."""
    return any((path / name).is_file() for name in ("dataset_info.json", "dataset_dict.json", "state.json"))


def _is_offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in {"1", "true", "yes", "on"} for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _load_local(source: Source, key: str):
    import datasets

    path = Path(source.data_path)
    if not path.exists():
        raise ConfigError(f"{key}: {str(path)!r} does not exist (relative paths are resolved from the working directory {os.getcwd()})")
    try:
        if path.is_dir():
            if _saved_dataset(path):
                if source.config:
                    warnings.warn(
                        f"data.{source.role}.dataset_config={source.config!r} has no effect: {str(path)!r} is a save_to_disk "
                        "directory, which holds one subset",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                try:
                    ds = datasets.load_from_disk(str(path))
                except IndexError:  # a saved dataset of 0 rows (no arrow shard): "list index out of range"
                    raise ConfigError(f"{key}: {str(path)!r} has no rows; it must hold at least one prompt row") from None
            else:
                if re.search(r"[*?[]", str(path.resolve())):  # datasets finds a folder's files by glob patterns under it
                    raise ConfigError(
                        f"{key}: {str(path)!r} has a glob character (* ? [) in its path ({path.resolve()}), which the "
                        "datasets loader reads as a pattern; rename the folder, or point at one data file in it"
                    )
                subset = _subset_kwargs(path, source.config)
                _refuse_unread_table_files(path, source, key, subset)
                _refuse_skipped_files(path, source, key, subset)
                data_files = directory_data_files(path)
                for file in data_files:
                    if problem := unreadable_compression(file):
                        raise ConfigError(f"{key}: cannot read {str(file)!r} in {str(path)!r}: {problem}")
                empty = [str(f) for f in data_files if f.stat().st_size == 0]
                if empty:  # datasets' own error was a bare StopIteration
                    raise ConfigError(f"{key}: {empty[0]!r} in {str(path)!r} is empty (0 bytes); it must hold at least one prompt row")
                card = _card_declares_subsets(path)
                plain = not subset and not card  # builder settings would replace a card's subsets
                kwargs = {**_csv_directory_kwargs(path, key), **(_json_kwargs(data_files) if plain else {})}
                if card:
                    kwargs["cache_dir"] = _card_folder_cache(path, subset)
                ds = datasets.load_dataset(str(path), **subset, **kwargs)
        else:
            builder = FILE_BUILDERS.get(data_suffix(path))
            if builder is None:
                raise ConfigError(f"{key}: {str(path)!r} has an unsupported suffix; expected one of {sorted(FILE_BUILDERS)} or a directory")
            if problem := unreadable_compression(path):
                raise ConfigError(f"{key}: cannot read {str(path)!r}: {problem}")
            if path.stat().st_size == 0:
                raise ConfigError(f"{key}: {str(path)!r} is empty (0 bytes); it must hold at least one prompt row")
            kwargs = _csv_kwargs(csv_header(path, key)) if builder == "csv" else _json_kwargs([path])
            # data_files is a glob pattern: `rows[12].jsonl` read rows1.jsonl and rows2.jsonl, a `sweep[lr=1e-6]/` folder
            # nothing; escaped, it is the one file named
            ds = datasets.load_dataset(builder, data_files=glob.escape(str(path.resolve())), split="train", **kwargs)
    except ConfigError:
        raise
    except Exception as exc:  # datasets/pyarrow raise many types for one cause: an unreadable file
        message = _innermost_message(exc)
        if "Config name is missing" in message:  # a hub snapshot with several subsets and none chosen
            raise ConfigError(
                f"{key}: {str(path)!r} holds several subsets; choose one with data.{source.role}.dataset_config ({message})"
            ) from None
        if "corresponds to no data" in message:  # datasets' wording for a file with a header and no rows
            raise ConfigError(f"{key}: {str(path)!r} has no rows; it must hold at least one prompt row") from None
        json_files = [path] if path.is_file() else directory_data_files(path)
        for file in (f for f in json_files if data_suffix(f) in (".jsonl", ".json")):
            if place := first_bad_json_place(file):
                message = place if file == path else f"{file}: {place}"
                break
        subset = f" (subset data.{source.role}.dataset_config={source.config!r})" if source.config else ""
        if ") changed from" in message and any(_has_blank_line(f) for f in json_files if data_suffix(f) == ".jsonl"):
            # datasets reads a column mixing types line by line, and a blank line fails that read with pyarrow's error
            message += "; a JSON Lines file whose column mixes numbers and text cannot have blank lines: remove them"
        if path.is_dir() and not _saved_dataset(path) and (mismatch := _shard_types_mismatch(path, source)):
            message += f"; {mismatch}"
        elif "as a scalar of type" in message or "Couldn't cast" in message:  # typed from one file or chunk, cast in another
            message += (
                "; a column's values change type between the files (or, in a file, past its first chunk: 10 MB of a "
                f"compressed file, {WHOLE_JSON_CHUNK_MAX >> 20} MB of another): "
                "write every value of a column as one type (e.g. every answer as a string)"
            )
        raise ConfigError(f"{key}: cannot read {str(path)!r}{subset}: {message}") from None
    return _pick_split(ds, source, key)


def has_subset(path: Path, config: str) -> bool:
    """Whether directory ``path`` (a hub snapshot) holds subset ``config``: a folder of that name, or a README whose
    card declares it (``config_name: <config>``)."""
    if not path.is_dir():
        return False
    if (path / config).is_dir():
        return True
    readme = path / "README.md"
    return (
        readme.is_file()
        and re.search(rf"config_name:\s*['\"]?{re.escape(config)}['\"]?\s*$", readme.read_text(errors="replace"), re.M) is not None
    )


def _card_folder_cache(path: Path, load_kwargs: dict[str, Any]) -> str:
    """A ``datasets`` cache directory for folder ``path`` as the files the load reads are now (the card and the data
    files its builder resolves, links followed: their paths, sizes and times). For a folder whose README card declares
    its configs, ``datasets`` keys the cache by the card alone (the configs' file patterns, not the files): a data file
    edited since, or another folder of the same name and card, loaded the rows cached before, silently. Each version of
    the folder gets its own cache; an unchanged one reuses it."""
    import datasets.config

    read = {Path(f).resolve() for files in _builder_data_files(path.resolve(), load_kwargs).values() for f in files}
    files = sorted(read | {(path / "README.md").resolve()})
    stamp = hashlib.sha256(repr([(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]).encode()).hexdigest()
    return str(Path(datasets.config.HF_DATASETS_CACHE) / "nemo_like_card_folders" / stamp[:16])


def _card_declares_subsets(path: Path) -> bool:
    """Whether directory ``path``'s README card declares its subsets (a ``configs:`` list in its YAML header)."""
    readme = path / "README.md"
    return readme.is_file() and re.search(r"^configs:\s*$", readme.read_text(errors="replace"), re.M) is not None


def _folder_to_check(path: Path, source: Source, load_kwargs: dict[str, Any]) -> Path | None:
    """The part of directory ``path`` whose every data file the load must read: the chosen subset's folder, else all of
    it; ``None`` where a README card's patterns choose the files (a subset it declares, or its default)."""
    if source.config is not None and "data_dir" not in load_kwargs:
        return None
    if "data_dir" not in load_kwargs and _card_declares_subsets(path):  # the card's default subset, by its patterns
        return None
    return path / load_kwargs["data_dir"] if "data_dir" in load_kwargs else path


def _refuse_skipped_files(path: Path, source: Source, key: str, load_kwargs: dict[str, Any]) -> None:
    """Raise when ``datasets`` would leave out data files of directory ``path``: it splits a directory by file names
    (``train.jsonl`` beside ``extra.jsonl`` reads only the first) and reads one file type (the most common), silently.
    With a subset chosen by the card (README), the card's patterns decide and nothing is checked."""
    root = _folder_to_check(path, source, load_kwargs)
    if root is None:
        return
    used = {Path(file).resolve() for files in _builder_data_files(path, load_kwargs).values() for file in files}
    skipped = [str(file) for file in directory_data_files(root) if file.resolve() not in used]
    if skipped:
        raise ConfigError(
            f"{key}: datasets would leave out {len(skipped)} data file(s) of {str(path)!r}: {skipped[:5]}. A directory is split "
            "by file names (train*, test*, validation*: every other name is ignored once one of them is present) and "
            "read as one file type. Name every file by its split, keep one file type, or point the key at one file."
        )


def _subset_kwargs(path: Path, config: str | None) -> dict[str, Any]:
    """How ``datasets`` picks subset ``config`` of a data directory (a hub snapshot): its folder where it has one
    (with or without a README that declares the subsets), else the README's subset of that name."""
    if config is None:
        return {}
    return {"data_dir": config} if (path / config).is_dir() else {"name": config}


def _chosen_split(splits: list[str], source: Source) -> str | None:
    """The split a source reads of ``splits``: its ``split``, else the only one (``None`` when there are several)."""
    return source.split if source.split is not None else (splits[0] if len(splits) == 1 else None)


def _pick_split(ds, source: Source, key: str):
    import datasets

    role_key = f"data.{source.role}.split"
    if isinstance(ds, datasets.DatasetDict):
        split = _chosen_split(list(ds), source)
        if split not in ds:
            if source.split is not None:
                raise ConfigError(
                    f"{key}: {source.data_path!r} has no split {source.split!r}; its splits are {sorted(ds)}: set {role_key} to one of them"
                )
            raise ConfigError(f"{key}: {source.data_path!r} holds splits {sorted(ds)}; choose one with {role_key}")
        return ds[split]
    if source.split_given and Path(source.data_path).is_dir():  # a saved Dataset (a single file: DataConfig warns)
        warnings.warn(
            f"{role_key}={source.split!r} has no effect: {source.data_path!r} holds one dataset (no splits); all its rows are read",
            RuntimeWarning,
            stacklevel=2,
        )
    return ds


def _load_hub(source: Source):
    import datasets

    from nemo_like.models.loading import go_offline, hub_endpoint_reachable

    if not _is_offline():  # the check train makes for a hub model: an unreachable hub is known in seconds
        reachable, detail = hub_endpoint_reachable()
        if not reachable:  # else datasets retries the hub for ~24 s a split, then says "not cached in None"
            print(f"[setup] {detail}: loading {source.label} from the local cache only (HF_HUB_OFFLINE=1)")
            go_offline()
    try:
        return datasets.load_dataset(source.hub_id, source.config, split=source.split)
    except Exception as exc:
        local = (
            f"point data.{source.role}.data_path at a local copy (a .jsonl/.parquet/.csv file, or the directory written by "
            f"datasets.load_dataset({source.hub_id!r}{', ' + repr(source.config) if source.config else ''}, "
            f"split={source.split!r}).save_to_disk(DIR) on a machine with network)"
        )
        if _is_offline() and _is_cache_miss(exc):
            raise ConfigError(
                f"Cannot load {source.label}: this machine is offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set, or the hub "
                "did not answer) and the set "
                f"is not in the local Hugging Face cache. Download it where there is network, or {local}."
            ) from None
        raise ConfigError(
            f"Cannot load {source.label}: {_innermost_message(exc)}. Check data.dataset_name / "
            f"data.dataset_config / data.{source.role}.split, or {local}."
        ) from None


def _is_cache_miss(exc: BaseException) -> bool:
    """Whether an offline hub load failed for want of the set in the cache (datasets raises ``ConnectionError``
    "Couldn't reach ... (OfflineModeIsEnabled)"), not for another cause of a cached set (a split it lacks)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionError) or type(seen).__name__ in ("OfflineModeIsEnabled", "LocalEntryNotFoundError"):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def load_source(source: Source):
    """Load the rows of ``source`` as a ``datasets.Dataset`` (ConfigError on any failure)."""
    import datasets

    datasets.disable_progress_bars()
    if source.data_path:
        return _load_local(source, f"data.{source.role}.data_path")
    return _load_hub(source)


@dataclass(frozen=True)
class Columns:
    """Which columns of a source hold the prompt, the answer and the task."""

    prompt: str
    answer: str
    task: str | None


def resolve_columns(data: DataConfig, source: Source, column_names: list[str]) -> Columns:
    """The columns to read, checked against ``column_names`` (a missing one names the key to set)."""
    spec = source.spec
    prompt = data.prompt_key or (spec.prompt_key if spec else None)
    if prompt is None:
        if "messages" not in column_names:
            raise ConfigError(
                f"{source.label}: set data.prompt_key to the column holding the problem (or chat messages); the columns are {column_names}"
            )
        prompt = "messages"
    answer = data.answer_key or (spec.answer_key if spec else None)
    if answer is None:
        raise ConfigError(f"{source.label}: set data.answer_key to the column holding the gold answer; the columns are {column_names}")
    task = data.task_key or (spec.task_key if spec else None)
    # Only the answer may be a dotted path into a column's nested value (answer.value); prompt and task name columns.
    for key, column in (("data.prompt_key", prompt), ("data.answer_key", answer), ("data.task_key", task)):
        name = column.split(".")[0] if column is not None and key == "data.answer_key" else column
        if name is not None and name not in column_names:
            default = " (the dataset spec's default)" if getattr(data, key.split(".")[1]) is None else ""
            nested = " (only data.answer_key may be a dotted path into a column)" if "." in name else ""
            raise ConfigError(
                f"{source.label}: no column {name!r} for {key}={column!r}{default}; the columns are {column_names}. "
                f"Set {key} to one of them{nested}"
            )
    return Columns(prompt, answer, task)


def _nested(row: dict[str, Any], dotted: str, where: str, key: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ConfigError(f"{where}: {key}={dotted!r} does not reach a value (no {part!r} in {value!r})")
        value = value[part]
    return value


def _answer_text(value: Any, transform: Callable[[str], str] | None, where: str, key: str) -> str:
    """The gold answer of one cell as text, through ``transform`` (a spec's extraction) when given."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ConfigError(f"{where}: the gold answer ({key}) is empty")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{where}: the gold answer ({key}) must be a string or a number, got {type(value).__name__}: {value!r}")
    if isinstance(value, float) and not math.isfinite(value):  # Python's json writes a missing float as NaN
        raise ConfigError(f"{where}: the gold answer ({key}) is {value!r} (a missing value?); every row needs an answer")
    if isinstance(value, float) and value.is_integer():
        if abs(value) >= 2**53:  # a column of ints and floats is read as doubles: 12345678901234567 came back ...68
            raise ConfigError(
                f"{where}: the gold answer ({key}) {value!r} was read as a float, which cannot hold every integer past 2**53 "
                "(the column mixes integers and decimals); store the answers as strings"
            )
        value = int(value)  # a JSON/CSV "19" read as 19.0
    text = number_text(value)  # 0.00001, not '1e-05' (which math-verify reads as e - 5)
    if transform is not None:
        try:
            text = transform(text)
        except ValueError as exc:
            raise ConfigError(f"{where}: cannot extract the gold answer from {key} ({exc}): {text[-80:]!r}") from None
    return text


def prompt_text_for_split(value: Any) -> str:
    """Canonical text of a prompt cell, the key of the hash split (a chat log's timestamps, read as datetimes, as text)."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def in_validation(prompt: Any, fraction: float) -> bool:
    """Whether a row with this prompt cell belongs to the carved validation split."""
    digest = hashlib.sha256(("nemo-like/split|" + prompt_text_for_split(prompt)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def select_rows(
    prompts: Sequence[Any], role: str, split_cfg: DatasetSplitConfig, fraction: float | None, shuffle: bool = True
) -> list[int]:
    """Row indices of ``role``: carved by ``fraction`` (if any: by each row's prompt; else only ``len(prompts)`` is
    read), seeded-shuffled (in file order when not ``shuffle``), cut to num_problems."""
    rows = list(range(len(prompts)))
    if fraction is not None:
        rows = [i for i in rows if in_validation(prompts[i], fraction) == (role == "validation")]
    if shuffle:
        random.Random(f"data/{role}/{split_cfg.seed}").shuffle(rows)
    if split_cfg.num_problems and len(rows) > split_cfg.num_problems:  # said: the default (20000 / 256) cuts silently otherwise
        cap = ", then grpo.max_val_samples" if role == "validation" else ""
        print(f"data.{role}: using {split_cfg.num_problems} of {len(rows)} rows (data.{role}.num_problems; null uses all{cap})")
        return rows[: split_cfg.num_problems]
    return rows


def load_problems(data: DataConfig, role: str, fmt: PromptFormat) -> list[Problem]:
    """The ``role`` problems of a dataset source (not arithmetic), selected and formatted."""
    split_cfg = data.train if role == "train" else data.validation
    source = resolve_source(data, role)
    print(f"data.{role}: reading {source.label}", flush=True)
    ds = load_source(source)
    columns = resolve_columns(data, source, list(ds.column_names))
    if len(ds) == 0:
        raise ConfigError(f"{source.label} has no rows; data.{role} needs at least one prompt")
    needed = sorted({columns.prompt, columns.answer.split(".")[0], *([columns.task] if columns.task else [])})
    as_written = json_columns_as_written(ds, source, needed)
    fraction = data.validation.split_fraction
    # Only a carved split reads every prompt (in one batch: list(ds[column]) built the rows one by one, 18 s and 0.6 GB
    # for a million); otherwise the rows are chosen by number and only the chosen ones are read.
    prompts = as_written.get(columns.prompt) or (
        _decoded(lambda: ds.select_columns([columns.prompt])[:][columns.prompt], source, role) if fraction is not None else range(len(ds))
    )
    # data.shuffle=false trains in file order (a curriculum); validation's selection stays seeded.
    rows = select_rows(prompts, role, split_cfg, fraction, shuffle=data.shuffle or role != "train")
    if not rows:
        raise ConfigError(
            f"{source.label}: no {role} rows left after data.validation.split_fraction={data.validation.split_fraction}; change it"
        )
    spec, task_default = source.spec, data.default_task_name or (source.spec.task_name if source.spec else DEFAULT_TASK)
    # The spec's extraction (GSM8K's '####') is for its own answer column; an explicit data.answer_key elsewhere wins.
    transform = spec.answer_transform if spec and columns.answer == spec.answer_key else None
    problems, dropped, label = [], set(), source.label  # (a label looks at the disk)
    for i, row in zip(rows, _decoded(lambda: ds.select_columns(needed).select(rows).to_list(), source, role)):
        row.update({name: values[i] for name, values in as_written.items()})
        where = f"row {i + 1} of {label}"  # data rows counted from 1 (a CSV header and blank lines are not rows)
        if isinstance(row[columns.prompt], list):
            dropped |= dropped_message_keys(row[columns.prompt])
        problems.append(
            Problem(
                id=f"{role}-{i}",
                messages=_messages(row[columns.prompt], fmt, where, columns.prompt),
                answer=_answer_text(_nested(row, columns.answer, where, "data.answer_key"), transform, where, "data.answer_key"),
                task_name=_task_name(row, columns.task, task_default, where),
                where=where,
            )
        )
    if dropped:  # printed, as the other data notices, so a run's log holds it
        print(
            f"data.{role}: {source.label}: the chat messages' keys {sorted(dropped)} are not passed to the chat "
            "template (a prompt holds each message's role and content only)",
            flush=True,
        )
    return problems


def _decoded(read: Callable[[], list], source: Source, role: str) -> list:
    """``read()``: the set's cells as Python values; pyarrow's JSON reader takes any bytes, so text that is not UTF-8
    fails only here, as a :class:`ConfigError` naming the set and, for a local text file, the line and byte (it was a
    bare ``UnicodeDecodeError``; its position is inside one cell)."""
    try:
        return read()
    except UnicodeDecodeError as exc:
        where = _first_undecodable_line(source.data_path) if source.data_path else None
        raise ConfigError(f"{source.label} is not UTF-8 text ({where or exc}); re-encode it as UTF-8 (data.{role}.data_path)") from None


#: The files whose lines :func:`_first_undecodable_line` reads (a compressed or parquet file's bytes are no text).
TEXT_SUFFIXES = (".json", ".jsonl", ".csv", ".txt")


def _first_undecodable_line(path: str) -> str | None:
    """``line N, byte M`` of the first byte of the text file ``path`` that is not UTF-8 (counted from 1); None for a
    directory, a file that is not text (:data:`TEXT_SUFFIXES`), or where every line decodes."""
    if not Path(path).is_file() or not path.lower().endswith(TEXT_SUFFIXES):
        return None
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as exc:
                return f"line {number}, byte {exc.start + 1}: {line[max(0, exc.start - 20) : exc.start + 4]!r}"
    return None


def _chat_written_as_text(value: str) -> bool:
    """Whether a text cell is a list of chat messages written out (JSON, or Python's repr as pandas' CSV export writes
    it): read as the problem's text, the model would be prompted with the list, its system turn and all."""
    import ast

    if not value.lstrip().startswith("[") or "role" not in value or "content" not in value:
        return False
    for parse in (json.loads, ast.literal_eval):
        try:
            parsed = parse(value)
        except Exception:  # noqa: BLE001 - not a literal (literal_eval raises several types: an unhashable key, ...)
            continue
        return isinstance(parsed, list) and bool(parsed) and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in parsed)
    return False


def _messages(value: Any, fmt: PromptFormat, where: str, column: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        if not value.strip():
            raise ConfigError(f"{where}: the prompt (column {column!r}, data.prompt_key) is empty")
        if _chat_written_as_text(value):
            raise ConfigError(
                f"{where}: the prompt (column {column!r}, data.prompt_key) holds chat messages written as text "
                f"({value[:60]!r}...; a CSV export?), which would be the problem's text, list and all: store them as a list "
                "of {role, content} objects (JSON Lines or Parquet), or point data.prompt_key at a column of plain text"
            )
        return fmt.messages_for_text(value)
    if isinstance(value, list):
        return fmt.messages_for_chat(value, where)
    raise ConfigError(
        f"{where}: the prompt column {column!r} (data.prompt_key) must hold text or a list of chat messages, "
        f"got {type(value).__name__}: {value!r}"
    )


def _task_name(row: dict[str, Any], task_key: str | None, default: str, where: str) -> str:
    if task_key is None:
        return default
    value = row[task_key]
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: the task column {task_key!r} (data.task_key) must hold a non-empty string, got {value!r}")
    return value.strip()
