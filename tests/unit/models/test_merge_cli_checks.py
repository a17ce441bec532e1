"""`nemo-like merge` on the shipped tiny model, with real adapters and real base models built from its config: a base
the adapters do not fit is one line naming both and --base-model (it dropped adapters silently, exit 0, or gave a raw
size-mismatch traceback), the merged generation config stops on the run's ids, a failed or interrupted merge leaves
no --out behind (the retry was refused as 'not empty'), and a run's checkpoint directory merges its latest valid step,
as eval and serve take it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from lora_adapters import random_adapters
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from nemo_like.cli import main
from nemo_like.config import ConfigError
from nemo_like.config.schema import EMBEDDED_MODEL
from nemo_like.models import lora
from nemo_like.models.loading import end_of_sequence_ids, load_causal_lm, load_tokenizer, resolve_model_path
from nemo_like.utils.checkpoint import STATE_FILE

IDS = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(1))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_checkpoint(step_dir: Path, base: str | Path = EMBEDDED_MODEL, seed: int = 0, tokenizer: bool = True) -> torch.nn.Module:
    """A LoRA checkpoint step as a run writes it (``policy/``: adapters, adapter config, the run's tokenizer, and the
    step's state file), with random ``lora_B`` (fresh adapters are a no-op); returns the adapted model."""
    model, tensors = random_adapters(base, seed)
    lora.write_adapter(step_dir / "policy", tensors, lora.adapter_config_dict(model))
    if tokenizer:
        load_tokenizer(EMBEDDED_MODEL).save_pretrained(step_dir / "policy")
    (step_dir / STATE_FILE).write_text(json.dumps({"step": int(step_dir.name.removeprefix("step_"))}))
    return model


def logprobs(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits.float().log_softmax(-1)


def make_base(directory: Path, **changes: int) -> Path:
    """A model of the tiny model's family with ``changes`` to its config (random weights), with its tokenizer."""
    source = Path(resolve_model_path(EMBEDDED_MODEL))
    config = AutoConfig.from_pretrained(source)
    for key, value in changes.items():
        setattr(config, key, value)
    if "num_hidden_layers" in changes:
        config.layer_types = ["full_attention"] * changes["num_hidden_layers"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, directory / name)
    return directory


def leftovers(parent: Path) -> list[str]:
    """Hidden entries of ``parent``: a merge's temporary directory left behind."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"num_hidden_layers": 2}, r"28 adapter tensors of the checkpoint have no place in it \(.*layers\.2\."),  # dropped, exit 0
        ({"num_hidden_layers": 6}, r"28 adapter tensors it needs are not in the checkpoint \(.*layers\.4\."),  # warned, exit 0
        ({"intermediate_size": 256}, r"12 adapter tensors have another shape on it .*\[4, 512\] in the checkpoint, \[4, 256\]"),
    ],
    ids=["fewer_layers", "more_layers", "narrower_mlp"],
)
def test_a_base_the_adapters_do_not_fit_is_one_line_naming_them_and_the_flag(tmp_path, capsys, changes, problem) -> None:
    write_checkpoint(tmp_path / "step_1")
    base = make_base(tmp_path / "base", **changes)
    out = tmp_path / "merged"
    assert main(["merge", str(tmp_path / "step_1"), "--out", str(out), "--base-model", str(base)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err  # no traceback
    assert f"the LoRA adapters of {tmp_path / 'step_1' / 'policy'} do not fit --base-model {base}: " in err
    assert re.search(problem, err), err
    assert not out.exists() and leftovers(tmp_path) == []
    if changes == {"num_hidden_layers": 2}:  # the recorded base replaced by another model: the key and the way out
        config = tmp_path / "step_1" / "policy" / "adapter_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": str(base)}))
        with pytest.raises(ConfigError, match=rf"do not fit its base model {base} \(adapter_config.json .*--base-model"):
            lora.merge_checkpoint(tmp_path / "step_1" / "policy", out)


def test_the_merged_generation_config_stops_on_the_runs_end_of_sequence_ids(tmp_path) -> None:
    """A run whose tokenizer (eos <|im_end|>, id 2) is not its base model's (generation config eos <|endoftext|>, id 0)
    stops on both; the merged model shipped the base's generation config: generate() ran past the run's stop."""
    source = Path(resolve_model_path(EMBEDDED_MODEL))
    base = tmp_path / "base"
    shutil.copytree(source, base)
    for name in ("config.json", "generation_config.json"):
        (base / name).write_text(json.dumps({**json.loads((base / name).read_text()), "eos_token_id": 0}))
    write_checkpoint(tmp_path / "step_1", base)  # the run's tokenizer saved in policy/: the shipped one, eos id 2
    run_ids = end_of_sequence_ids(load_tokenizer(str(tmp_path / "step_1" / "policy")), str(base))
    assert run_ids == [2, 0]
    assert main(["merge", str(tmp_path / "step_1"), "--out", str(tmp_path / "merged")]) == 0
    assert GenerationConfig.from_pretrained(tmp_path / "merged").eos_token_id == run_ids
    # ... and on its policy.generation.stop_token_ids (the checkpoint's config.yaml)
    (tmp_path / "step_1" / "config.yaml").write_text("policy:\n  generation:\n    stop_token_ids: [5, 2]\n")
    assert main(["merge", str(tmp_path / "step_1"), "--out", str(tmp_path / "merged_stops")]) == 0
    assert GenerationConfig.from_pretrained(tmp_path / "merged_stops").eos_token_id == [2, 0, 5]
    assert load_tokenizer(str(tmp_path / "merged")).eos_token_id == 2


def test_a_failed_or_interrupted_merge_leaves_no_out_and_the_tokenizer_is_named_by_its_flag(tmp_path, capsys, monkeypatch) -> None:
    """A checkpoint without a tokenizer (written before 2026-12-04) on a base without one: the weights were written to
    --out before the tokenizer failed (naming policy.tokenizer_name, which merge has no flag for), and the retry was
    refused as 'not empty'."""
    adapted = write_checkpoint(tmp_path / "step_1", tokenizer=False)
    base = tmp_path / "base"
    base.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(Path(resolve_model_path(EMBEDDED_MODEL)) / name, base / name)
    results = tmp_path / "results"
    results.mkdir()
    out = results / "merged"
    command = ["merge", str(tmp_path / "step_1"), "--out", str(out), "--base-model", str(base)]
    assert main(command) == 2
    err = capsys.readouterr().err
    assert not out.exists() and leftovers(results) == []  # the weights were there, and the retry refused
    assert "holds no tokenizer" in err and "name the run's tokenizer with --tokenizer" in err and "policy.tokenizer_name," in err
    assert main([*command, "--tokenizer", str(base)]) == 2
    assert f"--tokenizer {base} holds no tokenizer" in capsys.readouterr().err
    # Interrupted (Ctrl-C) after every file is written, before the rename: no --out, no temporary directory.
    import nemo_like.utils.checkpoint as checkpoint_utils

    written: list[str] = []
    real_fsync_tree = checkpoint_utils.fsync_tree

    def interrupted(root: Path) -> None:
        written.extend(sorted(p.name for p in root.iterdir()))
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_utils, "fsync_tree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        lora.merge_checkpoint(tmp_path / "step_1" / "policy", out, str(base), tokenizer=EMBEDDED_MODEL)
    assert "model.safetensors" in written and "tokenizer.json" in written
    assert not out.exists() and leftovers(results) == []
    monkeypatch.setattr(checkpoint_utils, "fsync_tree", real_fsync_tree)
    out.mkdir()  # an empty --out is filled (the rename replaces it)
    assert main([*command, "--tokenizer", EMBEDDED_MODEL]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "generation_config.json", "model.safetensors", *TOKENIZER_FILES])
    assert leftovers(results) == []
    torch.testing.assert_close(logprobs(load_causal_lm(str(out))), logprobs(adapted), atol=1e-5, rtol=1e-6)


def test_a_checkpoint_directory_merges_its_latest_valid_step_as_eval_and_serve_take_it(tmp_path, capsys, monkeypatch) -> None:
    ckdir = tmp_path / "checkpoints"
    steps = {n: write_checkpoint(ckdir / f"step_{n}", seed=n) for n in (1, 2, 3)}
    (ckdir / "step_3" / STATE_FILE).unlink()  # an interrupted save: not a valid step
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(ckdir)
    # `--out=~/merged`: the shell leaves that ~ to us (it wrote ./~/merged), as it does CHECKPOINT's in quotes
    assert main(["merge", str(ckdir), "--out=~/merged"]) == 0
    captured = capsys.readouterr()
    assert f"merging its latest valid step, {ckdir / 'step_2' / 'policy'}" in captured.err
    assert captured.out.strip() == str(tmp_path / "merged") and not (ckdir / "~").exists()
    merged = logprobs(load_causal_lm(str(tmp_path / "merged")))
    gaps = {n: (merged - logprobs(model)).abs().max().item() for n, model in steps.items()}
    assert gaps[2] < 1e-4 and gaps[1] > 1e-2 and gaps[3] > 1e-2, gaps
    # A directory holding no checkpoint, and a missing one: one line naming CHECKPOINT.
    (tmp_path / "empty").mkdir()
    for path, message in [(tmp_path / "empty", "CHECKPOINT: "), (tmp_path / "gone", "does not exist")]:
        assert main(["merge", str(path), "--out", str(tmp_path / "merged2")]) == 2
        err = capsys.readouterr().err
        assert message in err and str(path) in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    ("content", "problem", "flags"),
    [
        (
            '{"base_model_name_or_path": "x',
            r"adapter_config.json is not readable JSON \(Unterminated string",
            ["--base-model", EMBEDDED_MODEL],
        ),
        ("[]", r"adapter_config.json holds a JSON list, not the object of a PEFT adapter config", ["--base-model", EMBEDDED_MODEL]),
        ('{"r": 4}', r"adapter_config.json names no base model \(base_model_name_or_path is None\): nemo-like merge --base-model", []),
        # PEFT's own reading: no peft_type (a TypeError traceback with --base-model), a rank that is text
        ('{"base_model_name_or_path": "embedded:tiny-arith-qwen2", "r": 4}', r"is no adapter config PEFT can read \(.*peft_type", []),
        (
            '{"base_model_name_or_path": "embedded:tiny-arith-qwen2", "peft_type": "LORA", "r": "4"}',
            r"holds a value PEFT cannot use",
            [],
        ),
        ('{"base_model_name_or_path": null}', r"names no base model \(base_model_name_or_path is None\)", []),
    ],
    ids=["truncated", "not-an-object", "no-key", "no-peft-type", "text-rank", "null"],
)
def test_a_damaged_adapter_config_is_one_line_naming_the_file(tmp_path, capsys, content, problem, flags) -> None:
    """A truncated or hand-edited adapter_config.json gave a JSONDecodeError, KeyError or AttributeError traceback,
    or (with --base-model) blamed the base model the adapters "do not fit"."""
    write_checkpoint(tmp_path / "step_1")
    (tmp_path / "step_1" / "policy" / "adapter_config.json").write_text(content)
    for extra in ([], flags) if flags else ([],):
        assert main(["merge", str(tmp_path / "step_1"), "--out", str(tmp_path / "merged"), *extra]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and re.search(problem, err), err
        assert re.match(r"nemo-like: error: \S+adapter_config.json ", err), err  # the file, not "do not fit" the base
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("save_embedding_layers", [False, True])
def test_an_adapted_embedding_saved_with_or_without_its_full_weights_fits(tmp_path, save_embedding_layers) -> None:
    """PEFT saves an adapted embedding's full weights only when asked (save_embedding_layers): without them a valid
    adapter was refused as missing a tensor."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from nemo_like.models.loading import load_merged

    torch.manual_seed(0)
    adapted = get_peft_model(load_causal_lm(EMBEDDED_MODEL), PeftLoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]))
    adapted.save_pretrained(tmp_path / "adapter", save_embedding_layers=save_embedding_layers)
    load_merged(tmp_path / "adapter")


def test_a_rerun_eval_replaces_its_merged_model_and_a_bases_sampling_defaults_are_kept(tmp_path) -> None:
    """`nemo-like eval` rerun into one output directory merges into its merged_model again (replace=True): the atomic
    rename refused the filled directory; and a base whose generation config sets temperature without do_sample (many
    instruct models) failed the merge at save_pretrained's validation, after the whole merge."""
    base = tmp_path / "base"
    shutil.copytree(Path(resolve_model_path(EMBEDDED_MODEL)), base)
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.7, "top_p": 0.8}))
    adapted = write_checkpoint(tmp_path / "step_1", base)
    out = tmp_path / "eval_out" / "merged_model"
    for _ in range(2):
        lora.merge_checkpoint(tmp_path / "step_1" / "policy", out, replace=True)
        merged = load_causal_lm(str(out))
        assert torch.allclose(logprobs(merged), logprobs(adapted), atol=1e-4)
    assert GenerationConfig.from_pretrained(out).temperature == 0.7
    assert [p.name for p in out.parent.iterdir()] == ["merged_model"]  # nothing left beside it
    with pytest.raises(ConfigError, match="cannot move the merged model into place"):  # without replace: refused
        lora.merge_checkpoint(tmp_path / "step_1" / "policy", out)


def test_an_interrupt_between_the_replace_renames_puts_the_old_model_back(tmp_path, monkeypatch) -> None:
    """Replacing a filled merged_model moves it aside, then the new one in: an interrupt between the two left no
    merged_model, the old one under a hidden name nothing removed."""
    import os

    write_checkpoint(tmp_path / "step_1")
    out = tmp_path / "eval_out" / "merged_model"
    lora.merge_checkpoint(tmp_path / "step_1" / "policy", out, replace=True)
    before = sorted(p.name for p in out.iterdir())
    real_rename, calls = os.rename, []

    def interrupted_second_rename(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", interrupted_second_rename)
    with pytest.raises(KeyboardInterrupt):
        lora.merge_checkpoint(tmp_path / "step_1" / "policy", out, replace=True)
    monkeypatch.setattr(os, "rename", real_rename)
    assert sorted(p.name for p in out.iterdir()) == before and [p.name for p in out.parent.iterdir()] == ["merged_model"]


def test_a_directory_no_rename_reaches_is_filled_in_place_and_a_failed_write_leaves_it_as_it_was(tmp_path, monkeypatch) -> None:
    """A mount point (a container volume) as --out: the rename into it failed after the whole merge (EBUSY); written
    in place, a failed write had left a partial model there."""
    final = tmp_path / "volume"
    final.mkdir()
    (final / "old.txt").write_text("old")

    def failing(directory: Path) -> None:
        (directory / "config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    with pytest.raises(ConfigError, match=r"volume: cannot write the merged model \(No space left on device\); nothing of it was left"):
        lora._fill_in_place(final, final, failing, replace=True)
    assert [p.name for p in final.iterdir()] == ["old.txt"]
    with pytest.raises(ConfigError, match="is not empty"):
        lora._fill_in_place(final, final, lambda d: None, replace=False)
    lora._fill_in_place(final, final, lambda d: (d / "config.json").write_text("{}"), replace=True)
    assert [p.name for p in final.iterdir()] == ["config.json"]
    # A fresh volume's lost+found is not content (the merge was refused as 'not empty'); a move that fails midway puts
    # the old model back (it was half deleted, the new one stranded in a hidden directory)
    volume = tmp_path / "fresh"
    (volume / "lost+found").mkdir(parents=True)
    lora._fill_in_place(volume, volume, lambda d: (d / "model.safetensors").write_text("new"), replace=False)
    assert sorted(p.name for p in volume.iterdir()) == ["lost+found", "model.safetensors"]

    def half_written(directory: Path) -> None:
        (directory / "model.safetensors").write_text("newer")
        (directory / "sub").mkdir()
        (directory / "sub" / "x").write_text("x")

    import os

    real_rename, calls = os.rename, []

    def failing_third(src, dst):
        calls.append(dst)
        if len(calls) == 3:
            raise PermissionError(13, "Permission denied")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", failing_third)
    with pytest.raises(ConfigError, match=r"cannot write the merged model \(Permission denied\)"):
        lora._fill_in_place(volume, volume, half_written, replace=True)
    monkeypatch.setattr(os, "rename", real_rename)
    assert sorted(p.name for p in volume.iterdir()) == ["lost+found", "model.safetensors"]
    assert (volume / "model.safetensors").read_text() == "new"


def test_what_a_killed_in_place_merge_left_is_recovered_or_removed_by_the_next(tmp_path) -> None:
    """A merge killed inside a volume left the old model moved aside, or the new one's stage, hidden for good (every
    later merge skipped them): a full model copy leaked per kill."""
    import subprocess
    import sys

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True).stdout)
    volume = tmp_path / "volume"
    aside = volume / f".replaced.{dead}.0123abcd.tmp"
    aside.mkdir(parents=True)
    (aside / "model.safetensors").write_text("old")  # killed before the new entries moved up: the old ones come back
    lora._recover_leftovers(volume)
    assert [p.name for p in volume.iterdir()] == ["model.safetensors"] and (volume / "model.safetensors").read_text() == "old"
    (stage := volume / f".merged.{dead}.89abcdef.tmp").mkdir()
    (stage / "partial").write_text("x")
    (replaced := volume / f".replaced.{dead}.fedcba98.tmp").mkdir()
    (replaced / "model.safetensors").write_text("older")  # killed after: the new model is in place, the aside goes
    lora._fill_in_place(volume, volume, lambda d: (d / "model.safetensors").write_text("new"), replace=True)
    assert [p.name for p in volume.iterdir()] == ["model.safetensors"] and (volume / "model.safetensors").read_text() == "new"


SLOW_WRITE = """
import sys, time
import nemo_like.utils.checkpoint as checkpoint_utils
from nemo_like.cli import console_main

def slow(root):  # every file of the merged model written, not yet renamed into place
    print("written", flush=True)
    time.sleep(60)

checkpoint_utils.fsync_tree = slow
sys.argv = ["nemo-like", "merge", *sys.argv[1:]]
console_main()
"""


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_a_signal_mid_merge_ends_it_with_one_line_its_status_and_no_partial_copy(tmp_path, signum) -> None:
    """SIGTERM killed a merge mid-write with its cleanup skipped: a hidden full-size copy stayed beside --out (28 GB
    for a 7B float32 model), and Ctrl-C printed a traceback, exit 1. A real process and real signals."""
    import signal
    import subprocess
    import sys

    write_checkpoint(tmp_path / "step_1")
    results = tmp_path / "results"
    args = [str(tmp_path / "step_1"), "--out", str(results / "merged"), "--tokenizer", EMBEDDED_MODEL]
    process = subprocess.Popen([sys.executable, "-c", SLOW_WRITE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "written"
        assert leftovers(results)  # the copy being written
        process.send_signal(getattr(signal, signum))
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    status = 128 + getattr(signal, signum)
    assert process.returncode == status, err
    assert err.strip().splitlines() == [f"nemo-like: stopped by {signum} (exit status {status})"]
    assert sorted(p.name for p in results.iterdir()) == []  # no --out, no hidden copy


def test_a_refused_write_is_one_line_and_a_dead_merges_copy_is_removed_once_quiet(tmp_path, capsys, monkeypatch) -> None:
    """A read-only or full filesystem under --out was a traceback (exit 1; safetensors reports its own I/O errors); a
    copy a killed merge left (SIGKILL, out of memory) stayed for good."""
    import os
    import subprocess
    import sys
    import time

    from safetensors import SafetensorError

    import nemo_like.utils.checkpoint as checkpoint_utils

    write_checkpoint(tmp_path / "step_1")
    results = tmp_path / "results"
    command = ["merge", str(tmp_path / "step_1"), "--out", str(results / "merged"), "--tokenizer", EMBEDDED_MODEL]
    for error, problem in (
        (OSError(28, "No space left on device"), "No space left on device"),
        (
            SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
            "No space left on device (os error 28)",
        ),
        (OSError(30, "Read-only file system"), "Read-only file system"),
    ):

        def refused(root: Path, error: BaseException = error) -> None:
            raise error

        monkeypatch.setattr(checkpoint_utils, "fsync_tree", refused)
        assert main(command) == 2
        err = capsys.readouterr().err
        assert f"{results / 'merged'}: cannot write the merged model ({problem}); nothing of it was left" in err, err
        assert "Traceback" not in err and leftovers(results) == []
    monkeypatch.undo()
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True).stdout)
    old, young, live = (
        results / f".merged.{pid}.{tag}.tmp" for pid, tag in ((dead, "0123abcd"), (dead, "89abcdef"), (os.getpid(), "fedcba98"))
    )
    for stage in (old, young, live):
        stage.mkdir()
        (stage / "model.safetensors").write_text("partial")
    long_ago = time.time() - 3600
    for path in (old, old / "model.safetensors"):
        os.utime(path, (long_ago, long_ago))
    assert main(command) == 0
    # the dead process's quiet copy goes; a recent one may be another machine's writer (a shared filesystem), a live one's is its own
    assert leftovers(results) == sorted([young.name, live.name])
