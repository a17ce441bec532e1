"""Prompt datasets through Hugging Face ``datasets``: formats, columns, prompt files, specs, selection, errors.

Every test writes real files into ``tmp_path`` and builds records with the shipped tiny model's real
tokenizer; nothing touches the network.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from pydantic import ValidationError

from nemo_like.config.errors import ConfigError
from nemo_like.config.schema import DataConfig
from nemo_like.data.datasets import find_spec, gsm8k_final_answer, in_validation, load_source, resolve_source
from nemo_like.data.prompts import PromptDataLoader, PromptRecord, build_prompt_dataset, validation_overlap_warning
from nemo_like.models.loading import load_tokenizer

BUDGET = 56  # the tiny recipe's 64 total - 8 new tokens


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("embedded:tiny-arith-qwen2")


def rows(n: int = 30) -> list[dict]:
    return [{"q": f"What is {i} plus {i + 1}?", "a": str(2 * i + 1), "kind": "math" if i % 2 else "arith"} for i in range(n)]


def write_jsonl(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return path


def data_cfg(train_path, val_path=None, **kw) -> DataConfig:
    kw.setdefault("prompt_key", "q")
    kw.setdefault("answer_key", "a")
    val = {"data_path": str(val_path)} if val_path else {"split_fraction": 0.3}
    return DataConfig(
        dataset_name=None, train={"data_path": str(train_path), **kw.pop("train", {})}, validation={**val, **kw.pop("validation", {})}, **kw
    )


def build(cfg: DataConfig, tok, split: str = "train", budget: int = BUDGET):
    return build_prompt_dataset(cfg, tok, split, budget)


def chat_ids(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "input_ids") else ids)


# ---------------------------------------------------------------- formats


def _write_format(fmt: str, path: Path, items: list[dict]) -> Path:
    import datasets

    if fmt == "jsonl":
        return write_jsonl(path.with_suffix(".jsonl"), items)
    if fmt == "json":  # one JSON array
        target = path.with_suffix(".json")
        target.write_text(json.dumps(items))
        return target
    ds = datasets.Dataset.from_list(items)
    if fmt == "parquet":
        ds.to_parquet(str(path.with_suffix(".parquet")))
        return path.with_suffix(".parquet")
    if fmt == "csv":
        ds.to_csv(str(path.with_suffix(".csv")), index=False)
        return path.with_suffix(".csv")
    if fmt == "saved":
        ds.save_to_disk(str(path))
        return path
    raise AssertionError(fmt)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "saved"])
def test_each_file_format_loads_the_same_records(tmp_path, tok, fmt):
    train = _write_format(fmt, tmp_path / "train", rows(20))
    val = write_jsonl(tmp_path / "val.jsonl", rows(5))
    cfg = data_cfg(train, val, train={"seed": 3})
    records = build(cfg, tok)
    assert len(records) == 20
    by_row = {int(r.id.split("-")[1]): r for r in records}
    assert sorted(by_row) == list(range(20))
    for i, r in by_row.items():
        assert r.messages == [{"role": "user", "content": f"What is {i} plus {i + 1}?"}]
        assert r.prompt_token_ids == chat_ids(tok, r.messages)
        # csv's integers come back as the string; the prompt is the last user message (what learned rewards read)
        assert r.metadata == {"answer": str(2 * i + 1), "task_name": "math", "prompt": f"What is {i} plus {i + 1}?"}


def test_save_to_disk_dataset_dict_picks_the_split(tmp_path, tok):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows(10)), "test": datasets.Dataset.from_list(rows(4))})
    dd.save_to_disk(str(tmp_path / "dd"))
    cfg = DataConfig(
        dataset_name=None,
        prompt_key="q",
        answer_key="a",
        train={"data_path": str(tmp_path / "dd")},
        validation={"data_path": str(tmp_path / "dd"), "split": "test"},
    )
    assert len(build(cfg, tok, "train")) == 10 and len(build(cfg, tok, "validation")) == 4
    bad = DataConfig(
        dataset_name=None,
        prompt_key="q",
        answer_key="a",
        train={"data_path": str(tmp_path / "dd")},
        validation={"data_path": str(tmp_path / "dd"), "split": "dev"},
    )
    with pytest.raises(ConfigError, match=r"has no split 'dev'; its splits are \['test', 'train'\]: set data.validation.split"):
        build(bad, tok, "validation")


def test_a_snapshots_metadata_files_are_not_data_and_an_empty_directory_says_so(tmp_path, tok):
    """dataset_infos.json beside train.jsonl (many hub snapshots) was counted a data file 'datasets would leave out'
    (refused), and made a CSV snapshot's cells type-guessed ('02100' read as 2100); a save_to_disk directory of 0 rows
    and a directory with an empty train.jsonl failed with 'list index out of range' and 'StopIteration'."""
    import datasets

    snap = tmp_path / "snap"
    snap.mkdir()
    write_jsonl(snap / "train.jsonl", rows(10))
    write_jsonl(snap / "test.jsonl", rows(4))
    (snap / "dataset_infos.json").write_text(json.dumps({"default": {"description": ""}}, indent=2))
    cfg = data_cfg(snap, snap, validation={"split": "test"})
    assert len(build(cfg, tok)) == 10 and len(build(cfg, tok, "validation")) == 4
    csv_snap = tmp_path / "csv_snap"
    csv_snap.mkdir()
    (csv_snap / "train.csv").write_text("q,a\n" + "".join(f"What is {i} plus 1?,0210{i}\n" for i in range(6)))
    (csv_snap / "dataset_infos.json").write_text("{}")
    answers = [r.metadata["answer"] for r in build(data_cfg(csv_snap), tok)]
    assert answers and all(a.startswith("0210") for a in answers)  # cells as written
    datasets.Dataset.from_list(rows(0) or [{"q": "x", "a": "1"}]).select([]).save_to_disk(str(tmp_path / "zero"))
    with pytest.raises(ConfigError, match="has no rows"):
        build(data_cfg(tmp_path / "zero"), tok)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "train.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"train.jsonl' in '.*plain' is empty \(0 bytes\)"):
        build(data_cfg(tmp_path / "plain"), tok)


# ---------------------------------------------------------------- columns, messages, prompt files


def test_nested_answer_key_numeric_answer_and_task_column(tmp_path, tok):
    items = [
        {"p": f"What is {i} plus 1?", "rm": {"ground_truth": i + 1, "style": "rule"}, "t": "arith" if i < 2 else "math"} for i in range(4)
    ]
    path = write_jsonl(tmp_path / "t.jsonl", items)
    cfg = data_cfg(path, path, prompt_key="p", answer_key="rm.ground_truth", task_key="t")
    recs = sorted(build(cfg, tok), key=lambda r: r.id)
    assert [r.metadata for r in recs] == [
        {"answer": "1", "task_name": "arith", "prompt": "What is 0 plus 1?"},
        {"answer": "2", "task_name": "arith", "prompt": "What is 1 plus 1?"},
        {"answer": "3", "task_name": "math", "prompt": "What is 2 plus 1?"},
        {"answer": "4", "task_name": "math", "prompt": "What is 3 plus 1?"},
    ]
    cfg2 = data_cfg(path, path, prompt_key="p", answer_key="rm.ground_truth", default_task_name="algebra")
    assert {r.metadata["task_name"] for r in build(cfg2, tok)} == {"algebra"}


def test_messages_column_is_found_and_formatted(tmp_path, tok):
    items = [{"messages": [{"role": "user", "content": f"What is {i} plus 2?"}], "answer": str(i + 2)} for i in range(6)]
    path = write_jsonl(tmp_path / "chat.jsonl", items)
    prompt = tmp_path / "p.txt"
    prompt.write_text("Q: {}\n")  # the editor's final newline is dropped
    cfg = DataConfig(
        dataset_name=None,
        answer_key="answer",
        system_prompt="Be brief.",
        prompt_file=str(prompt),
        train={"data_path": str(path)},
        validation={"data_path": str(path)},
    )
    rec = next(r for r in build(cfg, tok) if r.id == "train-3")
    assert rec.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q: What is 3 plus 2?"}]
    assert rec.prompt_token_ids == chat_ids(tok, rec.messages)
    with_system = [{"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}], "answer": "1"}]
    path2 = write_jsonl(tmp_path / "sys.jsonl", with_system)
    cfg2 = DataConfig(
        dataset_name=None,
        answer_key="answer",
        system_prompt="Be brief.",
        train={"data_path": str(path2)},
        validation={"data_path": str(path2)},
    )
    with pytest.raises(ConfigError, match=r"row 1 of .*sys.jsonl.*already have a system turn.*data.system_prompt"):
        build(cfg2, tok)


def test_prompt_file_and_system_prompt_file(tmp_path, tok):
    path = write_jsonl(tmp_path / "t.jsonl", rows(3))
    template = tmp_path / "cot.txt"
    template.write_text("Solve. Put the answer in \\boxed{{}}:\n{}", encoding="utf-8-sig")  # "UTF-8 with BOM" (its U+FEFF
    system = tmp_path / "sys.txt"  # led every prompt, unseen)
    system.write_text("You are careful.\n", encoding="utf-8-sig")
    cfg = data_cfg(path, path, prompt_file=str(template), system_prompt_file=str(system))
    rec = next(r for r in build(cfg, tok, budget=200) if r.id == "train-1")
    assert rec.messages == [
        {"role": "system", "content": "You are careful."},
        {"role": "user", "content": "Solve. Put the answer in \\boxed{}:\nWhat is 1 plus 2?"},
    ]
    for text, needle in [
        ("no field here", "exactly one '{}'"),
        ("{} and {}", "exactly one '{}'"),
        ("{name}", "exactly one"),
        ("\\boxed{} {}", "exactly one"),
        ("unclosed {", "not a valid template"),
        ("Solve: {:.20}", r"the '{}' field takes no format spec or conversion \(found '{:.20}'\)"),  # cut every problem
        ("Solve: {!r}", r"takes no format spec or conversion \(found '{!r}'\)"),
    ]:
        template.write_text(text)
        with pytest.raises(ConfigError, match=rf"data.prompt_file .*{needle}".replace("{}", r"\{\}")):
            build(cfg, tok)
    system.write_text("  \n")  # a broken write: it trained with no system prompt, silently
    template.write_text("{}")
    with pytest.raises(ConfigError, match=r"data.system_prompt_file .*sys.txt' is empty"):
        build(cfg, tok)
    missing = data_cfg(path, path, system_prompt_file=str(tmp_path / "nope.txt"))
    with pytest.raises(ConfigError, match=r"data.system_prompt_file: cannot read .*nope.txt"):
        build(missing, tok)
    with pytest.raises(ValidationError, match="data.system_prompt and data.system_prompt_file"):
        data_cfg(path, path, system_prompt="a", system_prompt_file=str(system))


# ---------------------------------------------------------------- specs


def test_spec_lookup_by_name_hub_id_and_alias():
    assert find_spec("gsm8k") is find_spec("openai/gsm8k") is find_spec("GSM8K")
    assert find_spec("OpenMathInstruct-2") is find_spec("nvidia/OpenMathInstruct-2") is find_spec("openmathinstruct2")
    assert find_spec("DAPO-Math-17k") is find_spec("BytedTsinghua-SIA/DAPO-Math-17k") is find_spec("DAPOMath17K")
    assert find_spec("MATH-500") is find_spec("math500") is find_spec("HuggingFaceH4/MATH-500")
    assert find_spec("someone/else") is None and find_spec(None) is None
    omi = find_spec("openmathinstruct2")
    assert (omi.prompt_key, omi.answer_key, omi.train_split, omi.task_name) == ("problem", "expected_answer", "train_1M", "math")


def test_hub_sources_resolve_split_and_config_without_network():
    cfg = DataConfig(dataset_name="gsm8k", validation={"seed": 2})
    train, val = resolve_source(cfg, "train"), resolve_source(cfg, "validation")
    assert (train.hub_id, train.config, train.split) == ("openai/gsm8k", "main", "train")
    assert (val.hub_id, val.config, val.split) == ("openai/gsm8k", "main", "test")
    mixed = DataConfig(dataset_name="OpenMathInstruct-2", dataset_config="x", validation={"dataset_name": "MATH-500"})
    v = resolve_source(mixed, "validation")
    assert (v.hub_id, v.config, v.split) == ("HuggingFaceH4/MATH-500", None, "test")  # the top-level config is the train set's
    assert resolve_source(mixed, "train").config == "x"
    with pytest.raises(ConfigError, match=r"MATH-500 has no train split.*data.train.split"):
        resolve_source(DataConfig(dataset_name="math500"), "train")
    with pytest.raises(ConfigError, match=r"OpenMathInstruct-2 has no validation split.*split_fraction"):
        resolve_source(DataConfig(dataset_name="OpenMathInstruct-2"), "validation")
    with pytest.raises(ConfigError, match=r"data.validation.split is not set for 'me/set'"):
        resolve_source(DataConfig(dataset_name="me/set"), "validation")


def test_offline_hub_name_fails_with_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = resolve_source(DataConfig(dataset_name="openai/gsm8k"), "train")
    with pytest.raises(ConfigError, match=r"offline.*data.train.data_path.*save_to_disk"):
        load_source(source)


def test_a_hub_set_on_an_unreachable_hub_fails_at_once_naming_the_offline_cause(unreachable_hub, monkeypatch):
    """HF_HUB_OFFLINE unset and no network: datasets retried the hub ~24 s a split, then said "not cached in None"."""
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # restored after the test
    source = resolve_source(DataConfig(dataset_name="openai/gsm8k"), "train")
    with pytest.raises(ConfigError, match=r"this machine is offline .*the hub did not answer.*data.train.data_path"):
        load_source(source)
    assert huggingface_hub.constants.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE  # what the libraries read


def test_gsm8k_spec_extracts_the_final_answer(tmp_path, tok):
    items = [
        {"question": "What is 2 plus 2?", "answer": "2 + 2 = <<2+2=4>>4\n#### 4"},
        {"question": "What is 1000 plus 234?", "answer": "so\n#### 1,234"},
    ]
    path = write_jsonl(tmp_path / "gsm.jsonl", items)
    cfg = DataConfig(dataset_name="gsm8k", train={"data_path": str(path)}, validation={"data_path": str(path)})
    assert sorted(r.metadata["answer"] for r in build(cfg, tok)) == ["1234", "4"]
    assert gsm8k_final_answer("a #### b #### 7 ") == "7"
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "no marker"}])
    cfg = DataConfig(dataset_name="gsm8k", train={"data_path": str(bad)}, validation={"data_path": str(bad)})
    with pytest.raises(ConfigError, match=r"row 1 of .*bad.jsonl.*'####'"):
        build(cfg, tok)


def test_dapo_and_math500_specs_on_local_copies(tmp_path, tok):
    dapo = [
        {
            "data_source": "math_dapo",
            "prompt": [{"content": f"What is {i} plus 1?", "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(i + 1), "style": "rule-lang"},
            "extra_info": {"index": str(i)},
        }
        for i in range(5)
    ]
    math500 = [
        {
            "problem": "What is 1 plus 1?",
            "solution": "...",
            "answer": "\\frac{4}{2}",
            "subject": "Algebra",
            "level": 1,
            "unique_id": "test/x.json",
        }
    ]
    dp, mp = write_jsonl(tmp_path / "dapo.jsonl", dapo), write_jsonl(tmp_path / "m500.jsonl", math500)
    cfg = DataConfig(
        dataset_name="DAPO-Math-17k", train={"data_path": str(dp)}, validation={"dataset_name": "MATH-500", "data_path": str(mp)}
    )
    train = sorted(build(cfg, tok, "train"), key=lambda r: r.id)
    assert train[2].messages == [{"role": "user", "content": "What is 2 plus 1?"}]
    assert train[2].metadata == {"answer": "3", "task_name": "math", "prompt": "What is 2 plus 1?"}
    assert {k: v for k, v in build(cfg, tok, "validation")[0].metadata.items() if k != "prompt"} == {
        "answer": "\\frac{4}{2}",
        "task_name": "math",
    }


def test_shipped_math_tiny_loads_by_name(tok):
    cfg = DataConfig(dataset_name="math-tiny", train={"seed": 1}, validation={"seed": 2, "num_problems": 50})
    train, val = build(cfg, tok, "train"), build(cfg, tok, "validation")
    assert len(train) == 4000 and len(val) == 50
    assert {r.metadata["task_name"] for r in train} == {"math"}
    assert all(isinstance(r.metadata["answer"], str) for r in train + val)


# ---------------------------------------------------------------- selection


def test_an_explicit_answer_key_skips_the_spec_answer_transform(tmp_path, tok):
    # A GSM8K export that carries the final answer in its own column: data.answer_key names it, so the spec's '####'
    # extraction (for its 'answer' column) must not run on it (it did, and failed on the bare '72').
    item = {"question": "What is 48 plus 24?", "answer": "48+24 = 72\n#### 72", "final": "72"}
    path = write_jsonl(tmp_path / "gsm.jsonl", [item])
    cfg = DataConfig(dataset_name="gsm8k", answer_key="final", train={"data_path": str(path)}, validation={"data_path": str(path)})
    assert [r.metadata["answer"] for r in build(cfg, tok)] == ["72"]
    # Naming the spec's own column explicitly still extracts.
    cfg = cfg.model_copy(update={"answer_key": "answer"})
    assert [r.metadata["answer"] for r in build(cfg, tok)] == ["72"]
    item["final"] = "the answer is #### 5"  # not extracted from another column: kept as written
    write_jsonl(path, [item])
    cfg = cfg.model_copy(update={"answer_key": "final"})
    assert [r.metadata["answer"] for r in build(cfg, tok)] == ["the answer is #### 5"]


def test_seeded_shuffle_is_deterministic_and_num_problems_takes_a_prefix(tmp_path, tok):
    path = write_jsonl(tmp_path / "t.jsonl", rows(40))
    ids = lambda **t: [r.id for r in build(data_cfg(path, path, train=t), tok)]  # noqa: E731
    assert ids(seed=5) == ids(seed=5)
    assert ids(seed=5) != ids(seed=6) and sorted(ids(seed=5)) == sorted(ids(seed=6))
    assert ids(seed=5, num_problems=10) == ids(seed=5)[:10]
    assert len(ids(seed=5, num_problems=1000)) == 40  # a cap, not a demand


def test_unshuffled_training_keeps_file_order_and_num_problems_the_first_rows(tmp_path, tok):
    # data.shuffle=false promises training in file order (a curriculum); the rows used to be seeded-shuffled anyway.
    path = write_jsonl(tmp_path / "t.jsonl", rows(12))
    order = lambda split="train", **t: [r.id for r in build(data_cfg(path, path, shuffle=False, train=t), tok, split)]  # noqa: E731
    assert order() == [f"train-{i}" for i in range(12)]
    assert order(num_problems=5) == [f"train-{i}" for i in range(5)]
    loader = PromptDataLoader(build(data_cfg(path, path, shuffle=False), tok), 4, seed=0, shuffle=False)
    assert [r.id for r in loader.next_batch()] == ["train-0", "train-1", "train-2", "train-3"]
    # Validation's selection stays seeded.
    seeded = [r.id for r in build(data_cfg(path, path), tok, "validation")]
    assert order("validation") == seeded != [f"validation-{i}" for i in range(12)]


def test_split_fraction_is_deterministic_disjoint_and_order_free(tmp_path, tok):
    items = rows(400)
    items += [dict(items[7]), dict(items[8])]  # duplicates must land with their twins
    path = write_jsonl(tmp_path / "t.jsonl", items)
    prompts = lambda recs: [r.messages[0]["content"] for r in recs]  # noqa: E731
    cfg = data_cfg(path, validation={"split_fraction": 0.25, "seed": 1}, train={"seed": 1})
    train, val = prompts(build(cfg, tok, "train")), prompts(build(cfg, tok, "validation"))
    assert set(train).isdisjoint(val) and len(train) + len(val) == len(items)
    assert 0.18 < len(val) / len(items) < 0.32
    assert all(in_validation(p, 0.25) for p in val) and not any(in_validation(p, 0.25) for p in train)
    reversed_path = write_jsonl(tmp_path / "rev.jsonl", items[::-1])
    other = data_cfg(reversed_path, validation={"split_fraction": 0.25, "seed": 9}, train={"seed": 4})
    assert sorted(prompts(build(other, tok, "validation"))) == sorted(val)  # by content, not position or seed


# ---------------------------------------------------------------- errors


def test_missing_column_names_it_and_lists_the_columns(tmp_path, tok):
    path = write_jsonl(tmp_path / "t.jsonl", rows(3))
    with pytest.raises(ConfigError, match=r"no column 'question' for data.prompt_key='question'; the columns are \['q', 'a', 'kind'\]"):
        build(data_cfg(path, path, prompt_key="question"), tok)
    with pytest.raises(ConfigError, match=r"no column 'reward' for data.answer_key='reward.gt'"):
        build(data_cfg(path, path, answer_key="reward.gt"), tok)
    with pytest.raises(ConfigError, match=r"no column 'task' for data.task_key"):
        build(data_cfg(path, path, task_key="task"), tok)
    with pytest.raises(ConfigError, match=r"set data.prompt_key .*the columns are \['q', 'a', 'kind'\]"):
        build(data_cfg(path, path, prompt_key=None), tok)
    gsm = DataConfig(dataset_name="gsm8k", train={"data_path": str(path)}, validation={"data_path": str(path)})
    with pytest.raises(ConfigError, match=r"no column 'question' for data.prompt_key='question' \(the dataset spec's default\)"):
        build(gsm, tok)


def test_bad_files_name_the_file_and_key(tmp_path, tok):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match=r"data.train.data_path: .*empty.jsonl' is empty"):
        build(data_cfg(empty, empty), tok)
    header_only = tmp_path / "h.csv"
    header_only.write_text("q,a\n")
    with pytest.raises(ConfigError, match=r"data.train.data_path: .*h.csv' has no rows"):
        build(data_cfg(header_only, header_only), tok)

    def refused(name: str, text: str, message: str) -> Path:
        """``text`` written to ``name`` and used as both splits: a ConfigError matching ``message``."""
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            build(data_cfg(path, path), tok)
        return path

    broken = refused(
        "broken.jsonl",
        '{"q": "x", "a": "1"}\n{"q": "y", "a": \n',
        r"data.train.data_path: cannot read .*broken.jsonl'?: line 2, column \d+: not valid JSON",
    )
    forty = "".join(f'{{"q": "x{i}", "a": "{i}"}}\n' for i in range(40))
    # the bad line far into the file, and not the last (pandas' message named line 1)
    deep = refused(
        "deep.jsonl",
        forty + '{"q": "y" "a": "1"}\n' + '{"q": "z", "a": "2"}\n',
        r"deep.jsonl'?: line 41, column 11: not valid JSON \(Expecting ',' delimiter\)",
    )
    # Lines Python's json module takes and pyarrow's reader does not: no bad line was found, and the message pointed at
    # line 1 ("Trailing data at position 31") or gave a 0-based row and another cause
    for name, bad, cause in [
        ("dup_key", '{"q": "y", "a": "1", "a": "2"}', r"the key 'a' appears twice in one object"),
        ("overflow", '{"q": "y", "a": 1e400}', r"the number 1e400 is beyond a 64-bit float"),
        ("hugeint", '{"q": "y", "a": 123456789012345678901234}', r"the integer 123456789012345678901234 is beyond 64 bits"),
    ]:
        refused(f"{name}.jsonl", forty + bad + "\n", rf"{name}.jsonl'?: line 41: not valid JSON \({cause}\)")
    # a line pyarrow reads (NaN, a uint64) before the malformed one is not blamed for it
    refused(
        "nan_first.jsonl",
        '{"q": "x", "a": "1"}\n{"q": "y", "a": "2", "w": NaN, "n": 9223372036854775808}\n{"q": "z" "a": "3"}\n',
        r"nan_first.jsonl'?: line 3, column 11: not valid JSON \(Expecting ',' delimiter\)",
    )
    # JSON Lines under .json (datasets reads both): pandas said "position 28"
    refused(
        "lines.json",
        '{"q": "x", "a": "1"}\n{"q": "y" "a": "2"}\n',
        r"lines.json'?: line 2, column 11: not valid JSON \(Expecting ',' delimiter\)",
    )
    folder = tmp_path / "jdir"  # a directory of JSON Lines files: the message named neither file nor line
    folder.mkdir()
    (folder / "test.jsonl").write_text('{"q": "x", "a": "1"}\n')
    (folder / "train.jsonl").write_text(deep.read_text())
    with pytest.raises(ConfigError, match=r"cannot read .*jdir'?: .*train.jsonl: line 41, column 11: not valid JSON"):
        build(data_cfg(folder, folder), tok)
    array = tmp_path / "array.json"  # one JSON array of rows
    array.write_text('[\n  {"q": "x", "a": "1"},\n  {"q": "y", "a": "2"}\n  {"q": "z", "a": "3"}\n]\n')
    with pytest.raises(ConfigError, match=r"array.json'?: line 4, column 3: not valid JSON \(Expecting ',' delimiter\)"):
        build(data_cfg(array, array), tok)
    with pytest.raises(ConfigError, match=r"data.validation.data_path: .*nowhere.jsonl' does not exist"):
        build(data_cfg(broken, tmp_path / "nowhere.jsonl"), tok, "validation")
    odd = tmp_path / "x.txt"
    odd.write_text("hi")
    with pytest.raises(ConfigError, match=r"unsupported suffix"):
        build(data_cfg(odd, odd), tok)


def test_csv_cells_are_read_as_written(tmp_path, tok):
    # pandas' type guessing changed answers: 02108 -> 2108, 3.10 -> 3.1, NA / None -> empty (an error).
    path = tmp_path / "qa.csv"
    path.write_text('question,answer\nZip?,02108\nPrice?,3.10\nWhich? A) none,None\nCode?,NA\n"What is 1,000 + 2?",1002\n')
    records = sorted(build(data_cfg(path, path, prompt_key="question", answer_key="answer"), tok), key=lambda r: r.id)
    assert [r.metadata["answer"] for r in records] == ["02108", "3.10", "None", "NA", "1002"]
    assert records[4].messages[-1]["content"] == "What is 1,000 + 2?"
    # A directory of CSV files (one split per file name) is read the same way, and its files need one header.
    folder = tmp_path / "splits"
    folder.mkdir()
    (folder / "train.csv").write_text("question,answer\nZip?,02108\nCode?,NA\n")
    (folder / "test.csv").write_text("question,answer\nPrice?,3.10\n")
    cfg = data_cfg(folder, folder, prompt_key="question", answer_key="answer", train={"split": "train"}, validation={"split": "test"})
    assert sorted(r.metadata["answer"] for r in build(cfg, tok)) == ["02108", "NA"]
    assert [r.metadata["answer"] for r in build(cfg, tok, "validation")] == ["3.10"]
    (folder / "test.csv").write_text("prompt,answer\nPrice?,3.10\n")
    with pytest.raises(ConfigError, match=r"data.train.data_path: the CSV files of .*splits' need one header"):
        build(cfg, tok)


def test_a_csv_row_with_an_unquoted_comma_names_the_line(tmp_path, tok):
    # Every row has one field too many: pandas made the first field an index and shifted the columns, silently.
    path = tmp_path / "qa.csv"
    path.write_text("question,answer\nWhat is 1,000 + 2?,1002\nWhat is 2,000 + 2?,2002\n")
    with pytest.raises(ConfigError, match=r"qa.csv' line 2 has 3 fields, the header has 2; quote fields that contain commas"):
        build(data_cfg(path, path, prompt_key="question", answer_key="answer"), tok)
    # A later row, after a quoted field over two lines and a blank line: its own line number.
    path.write_text('question,answer\n"Two\nlines",2\n\nWhat is 1,000 + 2?,1002\nWhat is 2+2?,4\n')
    with pytest.raises(
        ConfigError, match=r"data.train.data_path: .*qa.csv' line 5 has 3 fields, the header has 2; quote fields that contain commas"
    ):
        build(data_cfg(path, path, prompt_key="question", answer_key="answer"), tok)
    path.write_text("question,answer\nWhat is 2+2?\n")
    with pytest.raises(ConfigError, match=r"qa.csv' line 2 has 1 fields, the header has 2"):
        build(data_cfg(path, path, prompt_key="question", answer_key="answer"), tok)


def test_bad_cells_name_the_row(tmp_path, tok):
    items = rows(5)
    items[3]["a"] = ""
    path = write_jsonl(tmp_path / "t.jsonl", items)
    with pytest.raises(ConfigError, match=r"row 4 of .*t.jsonl: the gold answer \(data.answer_key\) is empty"):
        build(data_cfg(path, path), tok)
    items = rows(5)
    items[1]["kind"] = ""
    path = write_jsonl(tmp_path / "k.jsonl", items)
    with pytest.raises(ConfigError, match=r"row 2 of .*k.jsonl: the task column 'kind' \(data.task_key\)"):
        build(data_cfg(path, path, task_key="kind"), tok)
    sft = [
        {"m": [{"role": "user", "content": f"What is {i} plus 1?"}, {"role": "assistant", "content": f"{i + 1}"}], "a": str(i + 1)}
        for i in range(5)
    ]
    path = write_jsonl(tmp_path / "sft.jsonl", sft)  # SFT-style rows: the gold answer would sit in the prompt
    with pytest.raises(ConfigError, match=r"row \d of .*sft.jsonl: the chat messages end with an 'assistant' turn"):
        build(data_cfg(path, path, prompt_key="m"), tok)
    nested = write_jsonl(tmp_path / "n.jsonl", [{**r, "meta": {"task": "t", "a": r["a"]}} for r in rows(5)])
    for key in ("prompt_key", "task_key"):  # only the answer reads a dotted path into a column
        with pytest.raises(ConfigError, match=rf"no column 'meta.x' for data.{key}='meta.x'.*only data.answer_key may be a dotted path"):
            build(data_cfg(nested, nested, **{key: "meta.x"}), tok)
    built = build(data_cfg(nested, nested, answer_key="meta.a"), tok)
    assert built and all(r.metadata["answer"] == str(2 * int(r.id.split("-")[1]) + 1) for r in built)


def test_prompt_longer_than_the_budget_names_row_file_and_keys(tmp_path, tok):
    items = rows(6)
    items[4]["q"] = "What is " + "1 plus " * 40 + "2?"
    path = write_jsonl(tmp_path / "long.jsonl", items)
    with pytest.raises(
        ConfigError, match=r"row 5 of \S*/long.jsonl \(data.train\) has \d+ tokens.*policy.max_total_sequence_length.*drop_long_prompts"
    ):
        build(data_cfg(path, path), tok)
    kept = build(data_cfg(path, path, drop_long_prompts=True), tok)
    assert sorted(r.id for r in kept) == ["train-0", "train-1", "train-2", "train-3", "train-5"]


def test_a_split_of_a_shipped_set_is_its_file_never_a_hub_lookup():
    named = resolve_source(DataConfig(dataset_name="math-tiny", validation={"num_problems": 3, "split": "validation"}), "validation")
    default = resolve_source(DataConfig(dataset_name="math-tiny", validation={"num_problems": 3}), "validation")
    assert named.data_path == default.data_path and named.data_path.endswith("math-tiny/validation.jsonl") and named.hub_id is None
    with pytest.raises(ConfigError, match=r"data.validation.split='test': math-tiny ships the splits \['train', 'validation'\]"):
        resolve_source(DataConfig(dataset_name="math-tiny", validation={"num_problems": 3, "split": "test"}), "validation")


def test_contradictory_or_incomplete_split_settings():
    with pytest.raises(ValidationError, match="data.train.split_fraction"):
        DataConfig(train={"split_fraction": 0.1, "num_problems": 5})
    with pytest.raises(ValidationError, match="split_fraction carves validation.*keep one"):
        DataConfig(dataset_name=None, train={"data_path": "a.jsonl"}, validation={"split_fraction": 0.1, "data_path": "b.jsonl"})
    with pytest.raises(ValidationError, match="does not apply to the arithmetic task"):
        DataConfig(validation={"split_fraction": 0.1})
    with pytest.raises(ValidationError, match="data.train.num_problems is required for the arithmetic task"):
        DataConfig(train={"seed": 1})
    with pytest.raises(ConfigError, match=r"data.validation: no prompt source.*split_fraction"):
        resolve_source(DataConfig(dataset_name=None, train={"data_path": "a.jsonl"}), "validation")


def test_bad_data_fails_before_ray_starts(tmp_path, monkeypatch, capsys):
    """The CLI reports a data error without a traceback, and no Ray cluster is started for it."""
    import nemo_like.algorithms.setup as setup
    from nemo_like.cli import main

    def no_ray(*_a, **_k):
        raise AssertionError("init_ray was called before the data was checked")

    monkeypatch.setattr(setup, "init_ray", no_ray)
    recipe = Path(__file__).resolve().parents[3] / "examples" / "configs" / "grpo_math_tiny_cpu.yaml"
    rc = main(
        ["train", "--config", str(recipe), f"logger.log_dir={tmp_path / 'logs'}", "logger.progress_bar=false", "data.prompt_key=question"]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "no column 'question' for data.prompt_key" in err and "Traceback" not in err


# ---------------------------------------------------------------- loader state


def test_loader_state_carries_a_fingerprint_of_the_prompts(tmp_path, tok):
    path = write_jsonl(tmp_path / "t.jsonl", rows(12))
    records = build(data_cfg(path, path), tok)
    loader = PromptDataLoader(records, 4, seed=0)
    loader.next_batch()
    state = loader.state_dict()
    resumed = PromptDataLoader(records, 4, seed=0)
    resumed.load_state_dict(state)
    assert [r.id for r in resumed.next_batch()] == [r.id for r in loader.next_batch()]
    changed = PromptDataLoader(records[:-1], 4, seed=0)
    with pytest.raises(ConfigError, match="differ from the ones the checkpoint was trained on"):
        changed.load_state_dict(state)
    legacy = {k: v for k, v in state.items() if "fingerprint" not in k}  # checkpoints from before the fingerprints
    changed.load_state_dict(legacy)
    assert changed.index == state["index"]
    # Same ids, other prompt tokens (an edited system-prompt file: the config's keys are unchanged) are refused too
    reworded = build(data_cfg(path, path, system_prompt="Be brief."), tok)
    assert [r.id for r in reworded] == [r.id for r in records]
    with pytest.raises(ConfigError, match="differ from the ones the checkpoint was trained on"):
        PromptDataLoader(reworded, 4, seed=0).load_state_dict(state)
    # Same prompts, other gold answers or tasks (a file rewritten with new answers; rows routed to another environment):
    # the resumed steps had been scored against the new answers without a word
    for key, value in (("answer", "-1"), ("task_name", "other_task")):
        rescored = [replace(r, metadata={**r.metadata, key: value}) if i == 3 else r for i, r in enumerate(records)]
        with pytest.raises(ConfigError, match=r"gold answers or tasks differ .*data.answer_key"):
            PromptDataLoader(rescored, 4, seed=0).load_state_dict(state)
    legacy = {k: v for k, v in state.items() if k != "answers_fingerprint"}  # checkpoints from before it was kept
    PromptDataLoader(records, 4, seed=0).load_state_dict(legacy)


def test_a_shuffled_loader_draws_another_order_each_epoch_and_resumes_it(tmp_path, tok):
    """docs: "different ones each epoch when shuffled" (the tail a batch size leaves out of an epoch): one permutation
    for every epoch never trained the same tail, and nothing checked it."""
    records = build(data_cfg(write_jsonl(tmp_path / "t.jsonl", rows(10)), None), tok)
    loader = PromptDataLoader(records, 4, seed=0, shuffle=True)
    epochs = [[r.id for b in range(2) for r in loader.next_batch()] for _ in range(3)]
    assert len({tuple(e) for e in epochs}) == 3  # every epoch its own order (and its own 2 left out)
    again = PromptDataLoader(records, 4, seed=0, shuffle=True)
    for _ in range(4):
        again.next_batch()
    resumed = PromptDataLoader(records, 4, seed=0, shuffle=True)
    resumed.load_state_dict(again.state_dict())  # resumed at the start of epoch 2: the same order
    assert [r.id for b in range(2) for r in resumed.next_batch()] == epochs[2]


def test_the_loader_says_which_epoch_its_next_batch_comes_from(tmp_path, tok):
    """grpo.max_num_epochs=1 over 10 prompts in batches of 4 allows 2 steps: the third batch would start epoch 1."""
    path = write_jsonl(tmp_path / "t.jsonl", rows(10))
    loader = PromptDataLoader(build(data_cfg(path, path), tok), 4, seed=0)
    epochs = []
    for _ in range(3):
        epochs.append((loader.next_batch_epoch, loader.epoch))
        loader.next_batch()
    assert epochs == [(0, 0), (0, 0), (1, 0)] and loader.epoch == 1  # the incomplete tail (2 prompts) is skipped
    assert loader.batches_in(1) == 2 and loader.batches_in(3) == 6  # the progress line's last step


def test_a_large_integer_answer_read_as_a_float_is_refused(tmp_path, tok) -> None:
    """An answer column mixing integers and decimals is read as doubles: 12345678901234567 became ...568 silently."""
    items = [{"q": "1+1?", "a": 2}, {"q": "big", "a": 12345678901234567}, {"q": "half", "a": 0.5}]
    path = write_jsonl(tmp_path / "t.jsonl", items)
    with pytest.raises(ConfigError, match=r"read as a float, which cannot hold every integer past 2\*\*53"):
        build(data_cfg(path, path), tok)
    small = write_jsonl(tmp_path / "s.jsonl", [{"q": "1+1?", "a": 2}, {"q": "half", "a": 0.5}])
    assert sorted(r.metadata["answer"] for r in build(data_cfg(small, small), tok)) == ["0.5", "2"]
    # NaN / Infinity (Python's json writes a missing float as NaN): trained against the answer "nan" before
    for constant in ("NaN", "Infinity"):
        (tmp_path / "n.jsonl").write_text(f'{{"q": "1+1?", "a": 2}}\n{{"q": "lost", "a": {constant}}}\n')
        with pytest.raises(ConfigError, match=r"row 2 of .*n.jsonl: the gold answer \(data.answer_key\) is (nan|inf) \(a missing"):
            build(data_cfg(tmp_path / "n.jsonl", tmp_path / "n.jsonl"), tok)
    # a file that is not UTF-8 is an error naming it and its line (pyarrow reads the bytes; decoding them raised a bare
    # error whose position was inside one cell)
    (tmp_path / "latin1.jsonl").write_bytes('{"q": "1+1?", "a": "2"}\n{"q": "café", "a": "1"}\n'.encode("latin-1"))
    with pytest.raises(
        ConfigError, match=r"latin1.jsonl is not UTF-8 text \(line 2, byte 11: .*re-encode it as UTF-8 \(data.train.data_path\)"
    ):
        build(data_cfg(tmp_path / "latin1.jsonl", small), tok)
    # Without a carved validation split only the chosen rows are read (every prompt was, one row at a time: 18 s for a
    # million rows to use 20,000): here the first, in file order; a carved split reads every prompt, and meets the byte.
    (first,) = build(data_cfg(tmp_path / "latin1.jsonl", small, shuffle=False, train={"num_problems": 1}), tok)
    assert first.metadata["answer"] == "2"
    with pytest.raises(ConfigError, match=r"latin1.jsonl is not UTF-8 text \(line 2, byte 11"):
        build(data_cfg(tmp_path / "latin1.jsonl", validation={"split_fraction": 0.5}), tok)
    # a compressed file's lines are no text: the decoder's own words (it named a "line 1, byte 2" of the gzip header)
    import gzip

    with gzip.open(tmp_path / "latin1.jsonl.gz", "wb") as compressed:
        compressed.write((tmp_path / "latin1.jsonl").read_bytes())
    with pytest.raises(ConfigError, match=r"latin1.jsonl.gz is not UTF-8 text \('utf-8' codec can't decode"):
        build(data_cfg(tmp_path / "latin1.jsonl.gz", validation={"split_fraction": 0.5}), tok)
    (tmp_path / "latin").mkdir()  # in a folder too (the re-read of a folder's files met it first: a bare error)
    (tmp_path / "latin" / "rows.jsonl").write_bytes((tmp_path / "latin1.jsonl").read_bytes())
    with pytest.raises(ConfigError, match=r"latin.* is not UTF-8 text .*re-encode it as UTF-8 \(data.train.data_path\)"):
        build(data_cfg(tmp_path / "latin", small), tok)


def test_a_dataset_cut_by_num_problems_says_so(tmp_path, tok, capsys) -> None:
    """data.train.num_problems (20000 by default, for the arithmetic task) cut a larger file without a word."""
    path = write_jsonl(tmp_path / "t.jsonl", rows(12))
    assert len(build(data_cfg(path, path, train={"num_problems": 5}), tok)) == 5
    assert "data.train: using 5 of 12 rows (data.train.num_problems; null uses all)" in capsys.readouterr().out
    assert len(build(data_cfg(path, path, train={"num_problems": 12}), tok)) == 12
    assert "using" not in capsys.readouterr().out


def test_validation_read_from_the_training_rows_is_named(tmp_path, tok) -> None:
    """data.validation.data_path pointed at the training file (no split_fraction): every validation prompt was a
    training prompt, without a word. The hash carve keeps them apart."""
    path = write_jsonl(tmp_path / "t.jsonl", rows(12))
    same = data_cfg(path, path)
    warning = validation_overlap_warning(build(same, tok), build(same, tok, "validation"))
    assert warning is not None and warning.startswith("12 of 12 validation prompts are also training prompts")
    carved = data_cfg(path, validation={"split_fraction": 0.5})
    assert validation_overlap_warning(build(carved, tok), build(carved, tok, "validation")) is None
    # One text for every problem (the shipped guess-number set: the secret differs): the text names no problem, and
    # the remedy the warning suggested (split_fraction, which hashes the text) left no validation rows at all
    guess = write_jsonl(tmp_path / "g.jsonl", [{"q": "Guess my number from 1 to 100.", "a": str(i)} for i in range(12)])
    one_text = data_cfg(guess, guess)
    assert validation_overlap_warning(build(one_text, tok), build(one_text, tok, "validation")) is None
    one_row = data_cfg(guess, guess, validation={"num_problems": 1})  # a one-row validation set of that text too
    assert len(build(one_row, tok, "validation")) == 1
    assert validation_overlap_warning(build(one_row, tok), build(one_row, tok, "validation")) is None
    # while one row of a set of many texts that is also a training row is named, as is a one-row training file read as
    # its own validation set
    single = write_jsonl(tmp_path / "one.jsonl", [{"q": "Guess my number from 1 to 100.", "a": "7"}])
    assert validation_overlap_warning(build(data_cfg(single, single), tok), build(data_cfg(single, single), tok, "validation"))
    assert validation_overlap_warning(build(same, tok), build(same, tok, "validation")[:1]).startswith("1 of 1 validation")


def test_an_unshuffled_loader_trains_every_prompt_the_tail_heading_the_next_epoch() -> None:
    """10 prompts in batches of 4, data.shuffle=false: each epoch trains 8 (no partial batch), continuing in file order
    where the last one stopped, so the two it leaves out head the next epoch (every epoch began at row 0: p8 and p9
    were never trained). Resumed mid-epoch, the order is the same."""
    records = [PromptRecord(f"p{i}", [], [1], {}) for i in range(10)]
    loader = PromptDataLoader(records, 4, seed=0, shuffle=False)
    batches = [[r.id for r in loader.next_batch()] for _ in range(5)]
    assert batches == [
        ["p0", "p1", "p2", "p3"],
        ["p4", "p5", "p6", "p7"],
        ["p8", "p9", "p0", "p1"],
        ["p2", "p3", "p4", "p5"],
        ["p6", "p7", "p8", "p9"],
    ]
    assert loader.epoch == 2
    resumed = PromptDataLoader(records, 4, seed=0, shuffle=False)
    resumed.load_state_dict({**loader.state_dict()})
    assert [r.id for r in resumed.next_batch()] == [r.id for r in loader.next_batch()] == ["p0", "p1", "p2", "p3"]


def test_column_keys_warn_when_every_split_is_arithmetic():
    """On the run's warning channel (``no_effect_warnings``, printed as ``[config] warning:``): a ``warnings.warn`` in the
    validator printed with ``warn=False`` and, Python's filter dropping repeats, never again in the same process."""
    for _ in range(2):
        lines = DataConfig(prompt_key="q", train={"num_problems": 4, "seed": 1, "split": "x"}).no_effect_warnings()
        assert [line for line in lines if "has no effect with data.dataset_name=arithmetic" in line] == [
            "data.prompt_key, data.train.split has no effect with data.dataset_name=arithmetic (the built-in task has no columns)"
        ]
    used = DataConfig(prompt_key="q", validation={"dataset_name": "MATH-500"})  # used by the validation split
    assert not [line for line in used.no_effect_warnings() if "prompt_key" in line]


def test_offline_a_cached_hub_set_reports_its_real_error_not_a_cache_miss(tmp_path, monkeypatch):
    """Offline, every hub failure read "not in the local Hugging Face cache", also a mistyped split of a cached set."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.packaged_modules.parquet.parquet import Parquet

    cache = tmp_path / "cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    for split in ("train", "test"):
        pq.write_table(pa.table({"question": [f"{split} q{i}" for i in range(3)], "answer": ["#### 1"] * 3}), tmp_path / f"{split}.parquet")
    files = datasets.data_files.DataFilesDict.from_patterns({s: [f"{s}.parquet"] for s in ("train", "test")}, base_path=str(tmp_path))
    Parquet(cache_dir=str(cache), dataset_name="gsm8k", config_name="main", data_files=files, hash="0123abcd").download_and_prepare()
    (cache / "gsm8k").rename(cache / "openai___gsm8k")  # where an online load_dataset("openai/gsm8k", "main") caches it
    next((cache / "openai___gsm8k").glob("main-*")).rename(cache / "openai___gsm8k" / "main")
    assert load_source(resolve_source(DataConfig(dataset_name="gsm8k", validation={"split": "test"}), "validation")).num_rows == 3
    with pytest.raises(ConfigError, match=r"Cannot load .*Unknown split \"tset\".*data.validation.split") as caught:
        load_source(resolve_source(DataConfig(dataset_name="gsm8k", validation={"split": "tset"}), "validation"))
    assert "not in the local Hugging Face cache" not in str(caught.value)


@pytest.mark.parametrize("declared", [True, False], ids=["readme-declares-subsets", "folders-only"])
def test_dataset_config_picks_a_subset_of_a_local_snapshot_directory(tmp_path, tok, declared: bool) -> None:
    """A downloaded hub set with subsets (gsm8k: main/, socratic/) as data_path: dataset_config was never passed, so
    with a README the load asked for a subset the key had already named, and without one both were merged (every
    question twice)."""
    root = tmp_path / "snapshot"
    for subset in ("main", "socratic"):
        (root / subset).mkdir(parents=True)
        write_jsonl(root / subset / "train.jsonl", [{"q": f"{subset} q{i}", "a": str(i)} for i in range(5)])
    if declared:
        subsets = "".join(f"- config_name: {s}\n  data_files:\n  - split: train\n    path: {s}/train.jsonl\n" for s in ("main", "socratic"))
        (root / "README.md").write_text(f"---\nconfigs:\n{subsets}---\n")
    rows = build(data_cfg(root, train={"dataset_config": "socratic"}), tok)
    texts = [tok.decode(r.prompt_token_ids) for r in rows]
    assert len(rows) == 4 and all("socratic q" in t and "main q" not in t for t in texts), texts  # 5 rows, 30 % held out
    with pytest.raises(ConfigError, match=r"cannot read .*snapshot'? \(subset data.train.dataset_config='nope'\)"):
        build(data_cfg(root, train={"dataset_config": "nope"}), tok)


def test_a_directory_whose_files_datasets_would_skip_is_refused_naming_them(tmp_path, tok) -> None:
    """datasets splits a directory by file names and reads one file type: ``extra.jsonl`` beside ``train.jsonl``, or a
    CSV beside two JSONL files, was left out with no message (12 rows on disk, 5 trained on)."""
    named = tmp_path / "named"
    named.mkdir()
    write_jsonl(named / "train.jsonl", [{"q": f"q{i}", "a": str(i)} for i in range(5)])
    write_jsonl(named / "extra.jsonl", [{"q": f"x{i}", "a": str(i)} for i in range(7)])
    with pytest.raises(ConfigError, match=r"data.train.data_path: datasets would leave out 1 data file\(s\) of .*extra.jsonl"):
        build(data_cfg(named), tok)
    import gzip  # a compressed shard is a data file too (it was dropped silently where the plain one was refused)

    (named / "extra.jsonl").rename(named / "extra.jsonl.gz.src")
    (named / "extra.jsonl.gz").write_bytes(gzip.compress((named / "extra.jsonl.gz.src").read_bytes()))
    (named / "extra.jsonl.gz.src").unlink()
    with pytest.raises(ConfigError, match=r"leave out 1 data file\(s\) of .*extra.jsonl.gz"):
        build(data_cfg(named), tok)
    shards = tmp_path / "csv_gz"  # compressed CSV shards load (their header was read as text: the gzip bytes)
    shards.mkdir()
    (shards / "train.csv.gz").write_bytes(gzip.compress(b"q,a\n1+1?,2\n2+2?,4\n"))
    assert sorted(r.metadata["answer"] for r in build(data_cfg(shards), tok)) == ["2", "4"]
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for part in ("1", "2"):
        write_jsonl(mixed / f"part_{part}.jsonl", [{"q": f"{part} {10 * i}", "a": str(i)} for i in range(6)])
    (mixed / "more.csv").write_text("q,a\nc0,0\nc1,1\nc2,2\n")
    with pytest.raises(ConfigError, match=r"leave out 1 data file\(s\) of .*more.csv"):
        build(data_cfg(mixed), tok)
    (mixed / "more.csv").unlink()
    assert len(build(data_cfg(mixed), tok)) + len(build(data_cfg(mixed), tok, "validation")) == 12  # every file read


def test_a_compressed_file_as_data_path_is_read_like_the_plain_one(tmp_path, tok) -> None:
    """``data_path=train.jsonl.gz`` was refused ("unsupported suffix ... or a directory") though the same file inside a
    directory loads; its CSV keeps every cell as written, and a broken line is named through the compression."""
    import gzip

    rows = [{"q": f"q{i}", "a": str(i)} for i in range(5)]
    write_jsonl(tmp_path / "plain.jsonl", rows)
    (tmp_path / "train.jsonl.gz").write_bytes(gzip.compress((tmp_path / "plain.jsonl").read_bytes()))
    loaded = build(data_cfg(tmp_path / "train.jsonl.gz", tmp_path / "plain.jsonl"), tok)
    assert sorted(r.metadata["answer"] for r in loaded) == [r["a"] for r in rows]
    (tmp_path / "train.csv.gz").write_bytes(gzip.compress(b"q,a\nzip?,02108\npi?,3.10\n"))
    assert sorted(r.metadata["answer"] for r in build(data_cfg(tmp_path / "train.csv.gz", tmp_path / "plain.jsonl"), tok)) == [
        "02108",
        "3.10",
    ]
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(b'{"q": "a", "a": "1"}\n{"q": "b", "a": 2,\n'))
    with pytest.raises(ConfigError, match=r"cannot read .*bad.jsonl.gz.*line 2, column \d+: not valid JSON"):
        build(data_cfg(tmp_path / "bad.jsonl.gz"), tok)
    (tmp_path / "train.parquet.gz").write_bytes(gzip.compress(b"PAR1"))  # was read as a corrupt Parquet file
    with pytest.raises(ConfigError, match=r"train.parquet.gz'?: a Parquet file compresses inside itself"):
        build(data_cfg(tmp_path / "train.parquet.gz"), tok)
    import importlib.util

    if importlib.util.find_spec("zstandard") is None:  # fsspec then read the compressed bytes as text: "not valid JSON"
        (tmp_path / "zst").mkdir()
        (tmp_path / "zst" / "train.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
        for path in (tmp_path / "zst" / "train.jsonl.zst", tmp_path / "zst"):
            with pytest.raises(ConfigError, match=r"train.jsonl.zst'.*needs the 'zstandard' package"):
                build(data_cfg(path), tok)


@pytest.mark.parametrize("declared", [True, False], ids=["readme-declares-subsets", "folders-only"])
def test_a_local_snapshot_of_a_known_set_reads_the_sets_own_subset(tmp_path, tok, declared: bool) -> None:
    """dataset_name=gsm8k with data_path at a downloaded copy: the spec's subset (main) was never used, so a copy with
    folders only read main/ and socratic/ together (every question twice) and one with a README failed in datasets'
    own words. A copy with several subsets of an unknown set names the key that picks one."""
    root = tmp_path / "gsm8k"
    for subset in ("main", "socratic"):
        (root / subset).mkdir(parents=True)
        write_jsonl(root / subset / "train.jsonl", [{"question": f"{subset} q{i}", "answer": f"#### {i}"} for i in range(5)])
    if declared:
        subsets = "".join(f"- config_name: {s}\n  data_files:\n  - split: train\n    path: {s}/train.jsonl\n" for s in ("main", "socratic"))
        (root / "README.md").write_text(f"---\nconfigs:\n{subsets}---\n")
    cfg = DataConfig(dataset_name="gsm8k", train={"data_path": str(root)}, validation={"split_fraction": 0.2})
    texts = [tok.decode(r.prompt_token_ids) for split in ("train", "validation") for r in build(cfg, tok, split)]
    assert len(texts) == 5 and all("main q" in t for t in texts), texts
    if declared:
        unknown = data_cfg(root, prompt_key="question", answer_key="answer")
        with pytest.raises(ConfigError, match=r"holds several subsets; choose one with data.train.dataset_config"):
            build(unknown, tok)


def test_a_snapshot_whose_card_names_a_default_subset_reads_it(tmp_path, tok) -> None:
    """A card with 'default: true' on one subset (open-r1/OpenR1-Math-220k's): datasets reads that subset, and the
    check for files datasets would leave out refused the directory, counting the other subsets' files."""
    root = tmp_path / "snapshot"
    for subset in ("main", "socratic"):
        (root / subset).mkdir(parents=True)
        write_jsonl(root / subset / "train.jsonl", [{"q": f"{subset} {i}", "a": str(i)} for i in range(5)])
    configs = "".join(
        f"- config_name: {s}\n{'  default: true' + chr(10) if s == 'main' else ''}  data_files:\n  - split: train\n    path: {s}/train.jsonl\n"
        for s in ("main", "socratic")
    )
    (root / "README.md").write_text(f"---\nconfigs:\n{configs}---\n")
    texts = [tok.decode(r.prompt_token_ids) for split in ("train", "validation") for r in build(data_cfg(root), tok, split)]
    assert len(texts) == 5 and all("main" in t for t in texts), texts


def test_dataset_config_beside_a_save_to_disk_directory_has_no_effect_and_says_so(tmp_path, tok) -> None:
    import datasets

    datasets.Dataset.from_list([{"q": f"q{i}", "a": str(i)} for i in range(5)]).save_to_disk(str(tmp_path / "saved"))
    with pytest.warns(RuntimeWarning, match=r"data.train.dataset_config='main' has no effect: .*save_to_disk directory"):
        assert build(data_cfg(tmp_path / "saved", train={"dataset_config": "main"}), tok)


def test_a_chat_template_that_refuses_a_prompt_is_a_config_error_naming_the_row(tmp_path) -> None:
    """Gemma-2-it's template raises "System role not supported" and on roles that do not alternate: a bare jinja
    TemplateError (a traceback naming no row, file or key) came out of the prompt build."""
    from nemo_like.models.loading import load_tokenizer

    tok = load_tokenizer("embedded:tiny-arith-qwen2")
    tok.chat_template = (  # google/gemma-2-2b-it's checks, with a plain rendering
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'model: ' }}{% endif %}"
    )
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "a": str(i)} for i in range(30)]
    rows[17]["messages"] = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = data_cfg(path, path, prompt_key="messages")
    with pytest.raises(
        ConfigError,
        match=r"refuses the prompt of row 18 of .*chat.jsonl \(data.train\): Conversation roles must alternate.*data.prompt_key='messages'",
    ):
        build(cfg, tok)
    with pytest.raises(ConfigError, match=r"refuses the prompt of row \d+ of .*System role not supported; unset data.system_prompt"):
        build(data_cfg(path, path, prompt_key="messages", system_prompt="Answer briefly."), tok)


def test_a_small_float_gold_answer_is_written_in_positional_notation(tmp_path, tok) -> None:
    """JSON 0.00001 became the gold text '1e-05', which math-verify reads as Euler's number minus 5."""
    path = write_jsonl(tmp_path / "g.jsonl", [{"q": f"q{i}", "a": a} for i, a in enumerate([0.00001, 2.5e-05, 3.0, 0.1] * 5)])
    answers = {r.metadata["answer"] for r in build(data_cfg(path, path), tok)}
    assert answers <= {"0.00001", "0.000025", "3", "0.1"} and "0.00001" in answers


def test_a_template_that_stamps_todays_date_renders_one_fixed_date_everywhere(tok):
    """Llama 3.x templates write strftime_now's date unless given date_string: a prompt's ids changed at midnight, so a
    resumed run's data check refused its checkpoint and a multi-turn episode's re-rendering no longer matched its ids."""
    import copy

    from nemo_like.data.prompts import tokenize_conversations
    from nemo_like.experience.multi_turn import render
    from nemo_like.models.loading import CHAT_TEMPLATE_DATE
    from nemo_like.serving.rendering import Renderer

    dated = copy.deepcopy(tok)
    dated.chat_template = (
        "{{ 'Today Date: ' + (date_string if date_string is defined else strftime_now('%d %b %Y')) + '\\n' }}"
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}{{ 'assistant: ' }}"
    )
    messages = [{"role": "user", "content": "What is 2 plus 3?"}]
    stamp = f"Today Date: {CHAT_TEMPLATE_DATE}\n"
    (ids,) = tokenize_conversations(dated, [messages])
    assert dated.decode(ids).startswith(stamp)  # the training prompts
    assert render(dated, messages).startswith(stamp)  # a multi-turn episode's turns
    assert Renderer(dated).chat_text(messages, None, None).startswith(stamp)  # the rollout server's calls


def test_a_json_column_that_changes_type_past_the_first_10_mb_loads(tmp_path, tok, monkeypatch):
    """``datasets`` types a JSON column from the file's first 10 MB chunk: integer answers, then a text one past it
    (``\\frac{1}{2}``) failed the load with a cast error naming neither row nor key, where a smaller file loads."""
    filler = "x" * 10_000  # a wide column no key reads: ~1,050 rows make 10.5 MB
    items = [{"q": f"What is {i} plus {i}?", "a": 2 * i, "notes": filler} for i in range(1_050)]
    path = write_jsonl(tmp_path / "big.jsonl", [*items, {"q": "What is 1 over 2?", "a": "\\frac{1}{2}", "notes": ""}])
    assert path.stat().st_size > 10 << 20
    records = build(data_cfg(path, path, prompt_key="q", answer_key="a"), tok)
    answers = {r.metadata["prompt"]: r.metadata["answer"] for r in records}
    assert answers["What is 1 over 2?"] == "\\frac{1}{2}" and answers["What is 7 plus 7?"] == "14"
    # A file over the whole-file cap (2 GiB overflowed pyarrow's block size) is read in capped chunks: the same
    # change of type is then an error that says what to change
    monkeypatch.setattr("nemo_like.data.datasets.WHOLE_JSON_CHUNK_MAX", 1 << 20)
    with pytest.raises(ConfigError, match=r"data\.train\.data_path: .* past its first chunk: .* every answer as a string"):
        build(data_cfg(path, path, prompt_key="q", answer_key="a"), tok)
    # Across the files of a directory (each typed on its own) the error says what to change
    (tmp_path / "split").mkdir()
    write_jsonl(tmp_path / "split" / "a.jsonl", [{"q": "What is 1 plus 1?", "a": 2}])
    write_jsonl(tmp_path / "split" / "b.jsonl", [{"q": "What is 1 over 2?", "a": "1/2"}])
    with pytest.raises(ConfigError, match=r"data\.train\.data_path: .* change type between the files .* every answer as a string"):
        build(data_cfg(tmp_path / "split", path, prompt_key="q", answer_key="a"), tok)


def test_a_data_path_with_glob_characters_is_the_file_it_names(tmp_path, tok, monkeypatch):
    """The datasets loader takes a data path as a glob pattern: `rows[12].jsonl` trained on rows1.jsonl and rows2.jsonl
    (the labels still naming rows[12].jsonl), a file in a `sweep[lr=1e-6]/` folder failed with "StopIteration", and the
    folder itself with a resolver's repr."""
    named = write_jsonl(tmp_path / "rows[12].jsonl", rows(3))
    write_jsonl(tmp_path / "rows1.jsonl", [{"q": "other 1?", "a": "1"}])
    write_jsonl(tmp_path / "rows2.jsonl", [{"q": "other 2?", "a": "2"}])
    prompts = {r.messages[-1]["content"] for r in build(data_cfg(named, named), tok)}
    assert prompts == {r["q"] for r in rows(3)}
    sweep = tmp_path / "sweep[lr=1e-6]"
    sweep.mkdir()
    inside = write_jsonl(sweep / "train.jsonl", rows(3))
    assert {r.messages[-1]["content"] for r in build(data_cfg(inside, inside), tok)} == prompts
    with pytest.raises(ConfigError, match=r"data.train.data_path: .*sweep\[lr=1e-6\]' has a glob character .*point at one data file"):
        build(data_cfg(sweep, inside), tok)
    # relative to a working directory with glob characters (datasets joins it on unescaped), and a save_to_disk folder
    # under it (read without patterns: not refused)
    import datasets

    datasets.Dataset.from_list(rows(3)).save_to_disk(str(sweep / "saved"))
    monkeypatch.chdir(sweep)
    assert {r.messages[-1]["content"] for r in build(data_cfg(Path("train.jsonl"), Path("train.jsonl")), tok)} == prompts
    assert {r.messages[-1]["content"] for r in build(data_cfg(Path("saved"), Path("saved")), tok)} == prompts


def test_a_prompt_holding_text_the_chat_template_rendered_is_refused_naming_the_row(tmp_path, tok):
    """A prompt column exported with apply_chat_template(..., tokenize=False) was rendered again around itself, with no
    word: four turn starts instead of two, the inner ones real special-token ids inside the user's turn."""
    rendered = tok.apply_chat_template([{"role": "user", "content": "What is 2 plus 3?"}], tokenize=False, add_generation_prompt=True)
    path = write_jsonl(tmp_path / "rendered.jsonl", [*rows(2), {"q": rendered, "a": "5"}])
    with pytest.raises(ConfigError, match=r"row 3 of .*rendered.jsonl.*holds the tokenizer's special token '<\|im_start\|>' in its user"):
        build(data_cfg(path, path), tok)
    system = data_cfg(write_jsonl(tmp_path / "plain.jsonl", rows(2)), None, system_prompt="Be brief.<|im_end|>")
    with pytest.raises(ConfigError, match=r"special token '<\|im_end\|>' in its system message"):
        build(system, tok)
    assert len(build(data_cfg(tmp_path / "plain.jsonl", tmp_path / "plain.jsonl"), tok)) == 2  # plain text passes


def test_a_column_mixing_numbers_and_text_keeps_each_text_as_written(tmp_path, tok):
    """``datasets`` types a JSON column of numbers and text ``Json`` and gives back a text cell that parses as JSON
    parsed: ``"007"`` came back as 7, ``"1.50"`` as 1.5, ``"true"`` as True (then refused), ``"[1, 2]"`` as a list; the
    columns a run reads are re-read as written (a JSON Lines file, a directory of one, a JSON array)."""
    answers = [7, "007", "1.50", "true", "[1, 2]", "\\frac{1}{2}", 2.5]
    items = [{"q": f"Question {i}?", "a": a} for i, a in enumerate(answers)]
    items.append({"q": "123", "a": "x"})  # a text prompt that parses as JSON ...
    items.append({"q": [{"role": "user", "content": "Chat?"}], "a": "y"})  # ... in a column mixing text and chats
    items.append({"q": "Two\u2028lines?", "a": "z"})  # a raw line separator inside a JSON string is no line end
    expected = {f"Question {i}?": a if isinstance(a, str) else str(a) for i, a in enumerate(answers)}
    expected |= {"123": "x", "Chat?": "y", "Two\u2028lines?": "z"}
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "LICENSE").write_text("MIT")  # a file datasets does not read: the re-read had stopped at it
    (tmp_path / "array.json").write_text(json.dumps(items))
    raw = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in items)  # U+2028 written raw, as JSON allows
    (tmp_path / "raw.jsonl").write_text(raw, encoding="utf-8")
    for path in (tmp_path / "raw.jsonl", write_jsonl(tmp_path / "one" / "rows.jsonl", items).parent, tmp_path / "array.json"):
        records = [*build(data_cfg(path, path), tok), *build(data_cfg(path, path), tok, "validation")]
        got = {r.metadata["prompt"]: r.metadata["answer"] for r in records}
        assert got == expected, path
    # a nested answer (data.answer_key=a.b): datasets types the leaf Json inside a struct column
    nested = write_jsonl(tmp_path / "nested.jsonl", [{"q": f"Question {i}?", "a": {"b": a}} for i, a in enumerate(answers)])
    records = build(data_cfg(nested, nested, answer_key="a.b"), tok)
    assert {r.metadata["prompt"]: r.metadata["answer"] for r in records} == {k: v for k, v in expected.items() if k.startswith("Q")}
    # a folder's shards: datasets cast each file's column to the first file's type (here text), and the mixed file's
    # "x" came back JSON-encoded ('"x"'), its 7 as "7"; each split reads its own files (test.jsonl is validation's)
    shards = tmp_path / "shards"
    (shards / "sub").mkdir(parents=True)
    write_jsonl(shards / "sub" / "train-00002.jsonl", [{"q": "Text?", "a": "t"}])
    write_jsonl(shards / "train-00000.jsonl", items[:5])
    write_jsonl(shards / "train-00001.jsonl", items[5:])
    write_jsonl(shards / "test.jsonl", [{"q": "Held out?", "a": 3}, {"q": "Also?", "a": "x"}])
    cfg = data_cfg(shards, shards, train={"split": "train"}, validation={"split": "test"})
    assert {r.metadata["prompt"]: r.metadata["answer"] for r in build(cfg, tok)} == expected | {"Text?": "t"}
    assert {r.metadata["prompt"]: r.metadata["answer"] for r in build(cfg, tok, "validation")} == {"Held out?": "3", "Also?": "x"}
    # a hub snapshot whose README card declares its files: the card's files, re-read
    card = tmp_path / "card"
    card.mkdir()
    (card / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: rows.jsonl\n---\n")
    write_jsonl(card / "rows.jsonl", items)
    assert {r.metadata["prompt"]: r.metadata["answer"] for r in build(data_cfg(card, card), tok)} == expected
    # compressed files, alone and as a folder's shards, and a subset folder of a snapshot (data.*.dataset_config):
    # they had been left as datasets gave them ('"x"' for "x", 2108 for "02108")
    import gzip

    def gzipped(path: Path, part: list[dict]) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in part).encode()))
        return path

    one = gzipped(tmp_path / "one.jsonl.gz", items)
    gz_shards = gzipped(tmp_path / "gz" / "train-00000.jsonl.gz", items[:5]).parent
    gzipped(gz_shards / "train-00001.jsonl.gz", items[5:])
    subsets = tmp_path / "snapshot"
    (subsets / "main").mkdir(parents=True)
    (subsets / "other").mkdir()
    write_jsonl(subsets / "main" / "train-00000.jsonl", items[:5])
    write_jsonl(subsets / "main" / "train-00001.jsonl", items[5:])
    write_jsonl(subsets / "other" / "train.jsonl", [{"q": "Other?", "a": 1}])
    for cfg in (data_cfg(one, one), data_cfg(gz_shards, gz_shards), data_cfg(subsets, subsets, dataset_config="main")):
        assert {r.metadata["prompt"]: r.metadata["answer"] for r in build(cfg, tok)} == expected, cfg.train.data_path


def test_a_mixed_column_in_json_lines_with_a_blank_line_says_to_remove_it(tmp_path, tok):
    """datasets reads a JSON Lines column mixing numbers and text line by line, and a blank line failed that with
    pyarrow's bare 'changed from number to string'; the error says what to change."""
    path = tmp_path / "blank.jsonl"
    path.write_text('{"q": "A?", "a": 7}\n\n{"q": "B?", "a": "007"}\n')
    with pytest.raises(ConfigError, match=r"blank\.jsonl.*changed from.*cannot have blank lines: remove them"):
        build(data_cfg(path, path), tok)
    path.write_text('{"q": "A?", "a": 7}\n{"q": "B?", "a": "007"}\n')
    assert {r.metadata["answer"] for r in build(data_cfg(path, path), tok, "validation")} == {"7", "007"}


def test_a_folder_holding_tables_we_do_not_read_is_refused_naming_the_file(tmp_path, tok):
    """datasets reads one file type a folder: a .arrow shard beside JSON Lines files was dropped silently, and a folder of
    .tsv files was read with type guessing ("007" as 7) where a single .tsv file is refused."""
    import datasets

    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_jsonl(mixed / "train-00001.jsonl", rows(3))
    write_jsonl(mixed / "train-00002.jsonl", rows(3))
    datasets.Dataset.from_list(rows(10)).to_pandas().to_csv(mixed / "notes.tsv", sep="\t", index=False)
    with pytest.raises(ConfigError, match=r"notes\.tsv' in '.*mixed' is a \.tsv file, which is not read here; .*convert it"):
        build(data_cfg(mixed, mixed), tok)
    (mixed / "notes.tsv").unlink()
    assert len(build(data_cfg(mixed, mixed), tok)) == 6  # the same folder without it
    datasets.Dataset.from_list(rows(5)).save_to_disk(str(tmp_path / "saved"))
    (mixed / "extra.arrow").write_bytes(next((tmp_path / "saved").glob("*.arrow")).read_bytes())
    with pytest.raises(ConfigError, match=r"extra\.arrow' in '.*mixed' is a \.arrow file"):  # its rows would be dropped
        build(data_cfg(mixed, mixed), tok)
    # where the load reads every file of its kind, or not the folder's others, nothing is refused: a folder of .arrow
    # shards alone, another subset's save_to_disk folder beside the chosen one, a card's files beside a raw .tsv
    arrows = tmp_path / "arrows"
    arrows.mkdir()
    (arrows / "train-00000.arrow").write_bytes((mixed / "extra.arrow").read_bytes())
    assert len(build(data_cfg(arrows, arrows), tok)) == 5
    snapshot = tmp_path / "snapshot"
    (snapshot / "main").mkdir(parents=True)
    write_jsonl(snapshot / "main" / "train.jsonl", rows(4))
    datasets.Dataset.from_list(rows(3)).save_to_disk(str(snapshot / "other" / "train"))
    assert len(build(data_cfg(snapshot, snapshot, dataset_config="main"), tok)) == 4
    card = tmp_path / "card"
    (card / "raw").mkdir(parents=True)
    (card / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: rows.jsonl\n---\n")
    write_jsonl(card / "rows.jsonl", rows(4))
    (card / "raw" / "original.tsv").write_text("q\ta\nA?\t1\n")
    assert len(build(data_cfg(card, card), tok)) == 4


def test_chat_messages_written_as_text_are_refused_naming_the_row(tmp_path, tok):
    """A messages column exported to CSV (pandas writes each list as its repr) or stored as a JSON string was read as the
    problem's text: the model was prompted with the printed list, its system turn included."""
    import pandas as pd

    chats = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {i}+{i}?"}] for i in range(3)]
    pd.DataFrame({"messages": chats, "a": ["0", "2", "4"]}).to_csv(tmp_path / "chats.csv", index=False)
    write_jsonl(tmp_path / "chats.jsonl", [{"messages": json.dumps(c), "a": "0"} for c in chats])
    for path in (tmp_path / "chats.csv", tmp_path / "chats.jsonl"):
        with pytest.raises(ConfigError, match=r"row \d+ of .*chats.*holds chat messages written as text .*store them as a list"):
            build(data_cfg(path, path, prompt_key=None), tok)
    plain = ["[1, 2, 3]: the largest?", "[{[1, 2]: 'role', 'content': 1}]", "[Physics] role and content?"]  # the 2nd: a TypeError
    write_jsonl(tmp_path / "plain.jsonl", [{"q": q, "a": "3"} for q in plain])  # problems that start with [
    assert len(build(data_cfg(tmp_path / "plain.jsonl", tmp_path / "plain.jsonl"), tok, "validation")) == 3


def test_parquet_shards_that_disagree_name_the_shard_and_the_column(tmp_path, tok):
    """datasets casts a split's shards to the first one's schema: an extra column failed with advice about value types,
    integers then a float failed naming neither the file nor the column."""
    import pandas as pd

    extra, kinds = tmp_path / "extra", tmp_path / "kinds"
    for folder in (extra, kinds):
        folder.mkdir()
        pd.DataFrame({"q": ["A?", "B?"], "a": [1, 2]}).to_parquet(folder / "train-00000-of-00002.parquet")
    pd.DataFrame({"q": ["C?"], "a": [3], "level": ["easy"]}).to_parquet(extra / "train-00001-of-00002.parquet")
    pd.DataFrame({"q": ["C?"], "a": [2.5]}).to_parquet(kinds / "train-00001-of-00002.parquet")
    reordered = tmp_path / "reordered"  # the same columns in another order: datasets reads it
    reordered.mkdir()
    pd.DataFrame({"q": ["A?", "B?"], "a": [1, 2]}).to_parquet(reordered / "train-00000-of-00002.parquet")
    pd.DataFrame({"a": [3], "q": ["C?"]}).to_parquet(reordered / "train-00001-of-00002.parquet")
    assert len(build(data_cfg(reordered, reordered), tok)) == 3
    with pytest.raises(ConfigError, match=r"train-00001-of-00002\.parquet' has the columns \['q', 'a', 'level'\].*same columns"):
        build(data_cfg(extra, extra), tok)
    with pytest.raises(ConfigError, match=r"column 'a' is double in '.*train-00001-of-00002\.parquet', int64 in '.*00000"):
        build(data_cfg(kinds, kinds), tok)


def test_a_split_a_saved_dataset_lacks_says_which_it_has_and_a_saved_datasets_split_has_no_effect(tmp_path, tok):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows(6)), "valid": datasets.Dataset.from_list(rows(4))}).save_to_disk(
        str(tmp_path / "dd")
    )
    datasets.Dataset.from_list(rows(5)).save_to_disk(str(tmp_path / "one"))
    dd, one = tmp_path / "dd", tmp_path / "one"
    with pytest.raises(
        ConfigError, match=r"'.*dd' has no split 'validation'; its splits are \['train', 'valid'\]: set data.validation.split"
    ):
        build(data_cfg(dd, dd, validation={"split": "validation"}), tok, "validation")
    with pytest.warns(RuntimeWarning, match=r"data.validation.split='test' has no effect: '.*one' holds one dataset \(no splits\)"):
        assert len(build(data_cfg(one, one, validation={"split": "test"}), tok, "validation")) == 5
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default split (train) of a saved Dataset warns of nothing, nor (here) a file's
        assert len(build(data_cfg(one, one), tok)) == 5
        path = write_jsonl(tmp_path / "rows.jsonl", rows(6))  # (DataConfig's start-up warning says so for a file)
        assert len(build(data_cfg(path, path, train={"split": "train"}), tok)) == 6


def test_a_utf16_csv_is_named_as_such(tmp_path, tok):
    """Read as UTF-8 (errors replaced), a spreadsheet's UTF-16 export was refused for an unquoted comma it did not have."""
    path = tmp_path / "sheet.csv"
    path.write_text("q,a\nWhat is 1+1?,2\n", encoding="utf-16")
    with pytest.raises(ConfigError, match=r"sheet\.csv' is UTF-16 text .*save it as UTF-8 CSV"):
        build(data_cfg(path, path), tok)


def test_a_card_folder_edited_or_another_of_its_name_loads_its_own_rows(tmp_path, tok):
    """datasets caches a folder whose README card declares configs by the card alone: the rows of a file edited since
    the last load, or of another folder of the same name and card, came back as the rows loaded before."""
    import os

    card = "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: rows.jsonl\n---\n"
    first, second = tmp_path / "a" / "snap", tmp_path / "b" / "snap"
    for folder, n in ((first, 4), (second, 6)):
        folder.mkdir(parents=True)
        (folder / "README.md").write_text(card)
        write_jsonl(folder / "rows.jsonl", rows(n))
    assert len(build(data_cfg(first, first), tok)) == 4
    assert len(build(data_cfg(second, second), tok)) == 6  # had been the first folder's 4
    write_jsonl(first / "rows.jsonl", rows(9))
    os.utime(first / "rows.jsonl", ns=(1, 1))  # a time of its own, whatever the clock's resolution
    assert len(build(data_cfg(first, first), tok)) == 9  # had been the 4 loaded before the edit
    # the card's files through a linked folder (the folder walk did not follow links: the edit was not seen)
    linked = tmp_path / "c" / "snap"
    (tmp_path / "c" / "elsewhere").mkdir(parents=True)
    linked.mkdir()
    (linked / "README.md").write_text(card.replace("path: rows.jsonl", "path: data/rows.jsonl"))
    (linked / "data").symlink_to(tmp_path / "c" / "elsewhere", target_is_directory=True)
    write_jsonl(linked / "data" / "rows.jsonl", rows(3))
    assert len(build(data_cfg(linked, linked), tok)) == 3
    write_jsonl(linked / "data" / "rows.jsonl", rows(7))
    os.utime(linked / "data" / "rows.jsonl", ns=(2, 2))
    assert len(build(data_cfg(linked, linked), tok)) == 7
