"""Which directory `nemo-like eval` and `nemo-like serve` load for eval.model_path (one resolver for both)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nemo_like.config import ConfigError, load_config
from nemo_like.config.schema import default_pass_k
from nemo_like.evaluation.run import summarize
from nemo_like.models.loading import load_tokenizer, resolve_checkpoint_model, resolve_model_path
from nemo_like.serving.standalone import served_model


def resolve_eval_model(model_path: str) -> str:
    return resolve_checkpoint_model(model_path, "eval.model_path")


def test_model_dir_checkpoint_step_and_checkpoint_root(tmp_path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert resolve_eval_model(str(model)) == str(model)
    for step in (2, 10):
        (tmp_path / "ckpt" / f"step_{step}" / "policy").mkdir(parents=True)
        (tmp_path / "ckpt" / f"step_{step}" / "policy" / "config.json").write_text("{}")
        (tmp_path / "ckpt" / f"step_{step}" / "trainer_state.json").write_text(json.dumps({"metrics": {}}))
    assert resolve_eval_model(str(tmp_path / "ckpt" / "step_2")) == str(tmp_path / "ckpt" / "step_2" / "policy")
    assert resolve_eval_model(str(tmp_path / "ckpt")) == str(tmp_path / "ckpt" / "step_10" / "policy")  # the latest
    assert resolve_eval_model("embedded:tiny-arith-qwen2") == "embedded:tiny-arith-qwen2"


def test_serve_resolves_a_lora_checkpoint_and_the_latest_valid_step_as_eval_does(tmp_path) -> None:
    """`nemo-like serve` refused a LoRA checkpoint (it looked for policy/config.json only) and took the highest
    step_N directory whether or not it was a complete checkpoint; it now resolves the path as `nemo-like eval` does."""
    for step in (3, 5):
        (tmp_path / "ckpt" / f"step_{step}" / "policy").mkdir(parents=True)
        (tmp_path / "ckpt" / f"step_{step}" / "policy" / "adapter_config.json").write_text("{}")
        (tmp_path / "ckpt" / f"step_{step}" / "trainer_state.json").write_text(json.dumps({"metrics": {}}))
    (tmp_path / "ckpt" / "step_9" / "policy").mkdir(parents=True)  # an incomplete step: no trainer_state.json
    (tmp_path / "ckpt" / "step_9" / "policy" / "config.json").write_text("{}")

    def serve_path(model_path: str) -> str:
        return served_model(load_config(None, [f"eval.model_path={model_path}"]))

    assert serve_path(str(tmp_path / "ckpt" / "step_3")) == str(tmp_path / "ckpt" / "step_3" / "policy")
    with pytest.warns(UserWarning, match=r"skipping .*step_9"):
        served = serve_path(str(tmp_path / "ckpt"))
    assert served == str(tmp_path / "ckpt" / "step_5" / "policy")
    assert served_model(load_config(None, [])) == load_config(None, []).policy.model_name
    with pytest.raises(ConfigError, match=r"eval.model_path: .* neither a model directory"):
        serve_path(str(tmp_path))


def test_bad_paths_are_config_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_eval_model(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="neither a model directory"):
        resolve_eval_model(str(tmp_path))


def test_k_above_n_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"eval.pass_k: k must be between 1 and eval.num_samples_per_prompt = 4.*\[8\]"):
        load_config(None, ["eval.num_samples_per_prompt=4", "eval.pass_k=[1,8]"])
    with pytest.raises(ConfigError, match=r"grpo.val_pass_k: k must be between 1 and grpo.val_num_generations_per_prompt = 2"):
        load_config(None, ["grpo.val_num_generations_per_prompt=2", "grpo.val_pass_k=[4]"])
    assert load_config(None, ["grpo.val_num_generations_per_prompt=4"]).grpo.resolved_val_pass_k == [1, 2, 4]


@pytest.mark.parametrize(
    ("n", "ks"),
    [
        (1, [1]),
        (2, [1, 2]),
        (3, [1, 2, 3]),
        (4, [1, 2, 4]),
        (6, [1, 2, 4, 6]),
        (8, [1, 2, 4, 8]),
        (12, [1, 2, 4, 8, 12]),
        (16, [1, 2, 4, 8, 16]),
    ],
)
def test_default_pass_k_is_powers_of_two_up_to_n_and_n(n: int, ks: list[int]) -> None:
    """`nemo-like eval` and training validation report pass@k for the same default ks: 1, 2, 4, ... <= n, and n."""
    assert default_pass_k(n) == ks
    cfg = load_config(None, [f"eval.num_samples_per_prompt={n}", f"grpo.val_num_generations_per_prompt={n}"])
    assert cfg.eval.pass_k is None  # not given: the default applies
    assert cfg.eval.resolved_pass_k == ks
    assert cfg.grpo.resolved_val_pass_k == ks


def test_explicit_pass_k_wins_over_the_default() -> None:
    cfg = load_config(
        None, ["eval.num_samples_per_prompt=8", "eval.pass_k=[1,8]", "grpo.val_num_generations_per_prompt=8", "grpo.val_pass_k=[3]"]
    )
    assert cfg.eval.resolved_pass_k == [1, 8]
    assert cfg.grpo.resolved_val_pass_k == [3]


def test_eval_summary_reports_every_default_k() -> None:
    """summarize() over 2 prompts x 4 samples with the default ks: pass@1, pass@2 and pass@4, each the estimator's value."""
    ks = load_config(None, ["eval.num_samples_per_prompt=4"]).eval.resolved_pass_k
    correct = [[True, False, False, False], [False, False, False, False]]  # prompt 0: c=1 of 4; prompt 1: c=0
    rows = [{"prompt_index": p, "task": "arith", "reward": float(ok), "correct": ok} for p, samples in enumerate(correct) for ok in samples]
    summary = summarize(rows, ks)
    assert [key for key in summary if key.startswith("pass@")] == ["pass@1", "pass@2", "pass@4"]
    assert summary["pass@1"] == pytest.approx((1 / 4 + 0) / 2)
    assert summary["pass@2"] == pytest.approx((1 / 2 + 0) / 2)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert summary["pass@4"] == pytest.approx((1.0 + 0) / 2)


def test_eval_links_the_checkpoint_it_was_given_not_an_earlier_evals(tmp_path) -> None:
    """Every eval links its checkpoint into ``output_dir/model/`` (with the tokenizer, for vLLM); an existing link was
    kept, so with the default output_dir evaluating step_100 after step_50 served step_50's weights, and crashed
    when retention had deleted step_50 (a dangling link)."""
    from nemo_like.config.schema import EMBEDDED_MODEL
    from nemo_like.evaluation.run import refuse_overwriting, with_tokenizer
    from nemo_like.models.loading import load_tokenizer

    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    for step in (50, 100):
        policy = tmp_path / "ckpt" / f"step_{step}" / "policy"
        policy.mkdir(parents=True)
        (policy / "config.json").write_text("{}")
        (policy / "model.safetensors").write_text(f"weights of step {step}")
    scratch = tmp_path / "results" / "eval" / "model"
    served = with_tokenizer(str(tmp_path / "ckpt" / "step_50" / "policy"), tokenizer, scratch)
    assert (Path(served) / "model.safetensors").read_text() == "weights of step 50"
    served = with_tokenizer(str(tmp_path / "ckpt" / "step_100" / "policy"), tokenizer, scratch)
    assert (Path(served) / "model.safetensors").read_text() == "weights of step 100"
    assert (Path(served) / "tokenizer.json").is_file()
    shutil.rmtree(tmp_path / "ckpt" / "step_100")  # retention deleted it: the next eval must not trip on its links
    served = with_tokenizer(str(tmp_path / "ckpt" / "step_50" / "policy"), tokenizer, scratch)
    assert (Path(served) / "model.safetensors").read_text() == "weights of step 50"
    # eval.output_dir set to the checkpoint's parent: output_dir/model/ was the model itself, and it was deleted.
    model = tmp_path / "run" / "model"
    shutil.copytree(tmp_path / "ckpt" / "step_50" / "policy", model)
    with pytest.raises(ConfigError, match=r"eval.output_dir: writing .* would overwrite the model it evaluates"):
        with_tokenizer(str(model), tokenizer, tmp_path / "run" / "model")
    with pytest.raises(ConfigError, match="eval.output_dir"):  # an output_dir inside the model directory
        with_tokenizer(str(model), tokenizer, model / "eval" / "model")
    assert sorted(p.name for p in model.iterdir()) == ["config.json", "model.safetensors"]
    nested = tmp_path / "out" / "model" / "step_50" / "policy"  # the model inside output_dir/model/, which is replaced
    shutil.copytree(model, nested)
    with pytest.raises(ConfigError, match="eval.output_dir"):
        with_tokenizer(str(nested), tokenizer, tmp_path / "out" / "model")
    assert (nested / "model.safetensors").is_file()
    with pytest.raises(ConfigError, match="eval.output_dir"):  # a LoRA checkpoint merged into its own directory
        refuse_overwriting(tmp_path / "run" / "merged_model", tmp_path / "run" / "merged_model")


def test_validation_decoding_keys_that_eval_does_not_use_are_named() -> None:
    """eval read grpo.max_val_samples but silently not grpo.val_greedy / val_num_generations_per_prompt / val_pass_k."""
    from nemo_like.evaluation.run import ignored_validation_settings

    assert ignored_validation_settings(load_config(None, warn=False)) == []
    changed = ["grpo.val_greedy=true", "grpo.val_num_generations_per_prompt=4", "grpo.val_pass_k=[1,4]"]
    lines = ignored_validation_settings(load_config(None, changed, warn=False))
    assert [line.split(" (")[0] for line in lines] == [
        "grpo.val_greedy=True",
        "grpo.val_num_generations_per_prompt=4",
        "grpo.val_pass_k=[1, 4]",
    ]
    assert "uses eval.num_samples_per_prompt=1" in lines[1]
    same = ["eval.greedy=true", "eval.num_samples_per_prompt=4", "eval.pass_k=[1,4]"]
    assert ignored_validation_settings(load_config(None, changed + same, warn=False)) == []
    # eval.pass_k unset reports the ks its samples per prompt give: the same as validation's, nothing to warn about
    resolved = ["grpo.val_num_generations_per_prompt=4", "grpo.val_pass_k=[1,2,4]", "eval.num_samples_per_prompt=4"]
    assert ignored_validation_settings(load_config(None, resolved, warn=False)) == []
    lines = ignored_validation_settings(load_config(None, [*resolved[:2], "eval.num_samples_per_prompt=2"], warn=False))
    assert "grpo.val_pass_k=[1, 2, 4] (training validation) has no effect in nemo-like eval, which uses eval.pass_k=[1, 2]" in lines[-1]


def test_eval_refuses_what_it_cannot_serve_or_would_overwrite_before_any_actor(tmp_path, capsys) -> None:
    """Through `nemo-like eval` itself (the helpers alone passed with the calls removed from run_eval): an output_dir
    at the checkpoint step replaced its config.yaml (what a resume reads); a stop id outside the vocabulary; and the
    grpo.val_* keys eval does not read are named before it stops."""
    from nemo_like.cli import main
    from nemo_like.models.assets import default_model_path

    step = tmp_path / "ckpt" / "step_5"
    shutil.copytree(default_model_path(), step / "policy")
    (step / "trainer_state.json").write_text(json.dumps({"metrics": {}}))
    (step / "config.yaml").write_text("the run's own config\n")
    assert main(["eval", f"eval.model_path={step}", f"eval.output_dir={step}"]) == 2
    assert "eval.output_dir: writing" in capsys.readouterr().err and (step / "config.yaml").read_text() == "the run's own config\n"
    out = f"eval.output_dir={tmp_path / 'out'}"
    with pytest.warns(RuntimeWarning, match=r"grpo.val_greedy=True"):
        assert main(["eval", out, "grpo.val_greedy=true", "policy.generation.stop_token_ids=[359]"]) == 2
    assert "policy.generation.stop_token_ids: [359] are outside" in capsys.readouterr().err
    # a reward model's score head was evaluated as random logits (accuracy 0.125, exit 0); a model the HF sampler cannot
    # sample failed inside the engine actor, the refusal naming policy.model_name
    assert main(["eval", out, "eval.model_path=embedded:tiny-reward-qwen2"]) == 2
    assert "eval.model_path=embedded:tiny-reward-qwen2 is not a causal language model" in capsys.readouterr().err
    from transformers import MiniMaxConfig

    MiniMaxConfig(vocab_size=359, hidden_size=32, num_hidden_layers=2, num_attention_heads=2).save_pretrained(tmp_path / "minimax")
    assert main(["eval", out, f"eval.model_path={tmp_path / 'minimax'}"]) == 2
    refusal = f"eval.model_path='{tmp_path / 'minimax'}' with policy.generation.backend=auto chose hf: the HF sampler cannot sample MiniMax"
    assert refusal in capsys.readouterr().err


def lora_checkpoint(where: Path, base: Path) -> Path:
    """A LoRA adapter of the shipped model's shape whose adapter_config.json names ``base``."""
    from peft import LoraConfig, get_peft_model

    from nemo_like.config.schema import EMBEDDED_MODEL
    from nemo_like.models.loading import load_causal_lm

    model = get_peft_model(load_causal_lm(EMBEDDED_MODEL), LoraConfig(r=2, target_modules=["q_proj"]))
    model.save_pretrained(where)
    config = json.loads((where / "adapter_config.json").read_text())
    (where / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(base)}))
    return where


def test_eval_never_writes_into_the_base_model_or_a_directory_it_did_not_make(tmp_path, capsys) -> None:
    """A second review of eval: it merged a LoRA checkpoint into output_dir/merged_model when that was the adapters'
    base (every later eval applied them twice); a base that was gone was a transformers traceback; output_dir/model/
    was deleted whatever it held; and the run's tokenizer was written through links into the model's own files."""
    from nemo_like.cli import main
    from nemo_like.config.schema import EMBEDDED_MODEL
    from nemo_like.evaluation.run import with_tokenizer
    from nemo_like.models.assets import default_model_path
    from nemo_like.models.loading import load_tokenizer

    base = tmp_path / "stage1" / "merged_model"  # stage 1's eval merged it; stage 2 trained adapters on it
    shutil.copytree(default_model_path(), base)
    before = (base / "model.safetensors").read_bytes()
    adapters = lora_checkpoint(tmp_path / "stage2" / "policy", base)
    assert main(["eval", f"eval.model_path={adapters}", f"eval.output_dir={tmp_path / 'stage1'}"]) == 2
    assert "the base model the adapters apply to" in capsys.readouterr().err
    assert (base / "model.safetensors").read_bytes() == before
    gone = lora_checkpoint(tmp_path / "orphan", tmp_path / "moved_base")
    assert main(["eval", f"eval.model_path={gone}", f"eval.output_dir={tmp_path / 'out'}"]) == 2
    assert "adapter_config.json base_model_name_or_path" in capsys.readouterr().err
    # the backend's refusals come before the merge (minutes and gigabytes for a large model) and Ray's start
    hot = ["policy.generation.backend=vllm", "policy.generation.temperature=3.0", f"eval.output_dir={tmp_path / 'hot'}"]
    assert main(["eval", f"eval.model_path={lora_checkpoint(tmp_path / 'run' / 'policy', base)}", *hot]) == 2
    assert "policy.generation." in capsys.readouterr().err and not (tmp_path / "hot" / "merged_model").exists()
    # output_dir/model/ of files eval did not write is refused, not deleted
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    model = tmp_path / "ckpt" / "policy"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "chat_template.jinja").write_text("{{ my own template }}")  # no tokenizer file holds_tokenizer looks for
    mine = tmp_path / "mine" / "model"
    mine.mkdir(parents=True)
    (mine / "my_finetune.safetensors").write_text("mine")
    with pytest.raises(ConfigError, match="holds files eval did not write"):
        with_tokenizer(str(model), tokenizer, mine)
    assert (mine / "my_finetune.safetensors").read_text() == "mine"
    served = Path(with_tokenizer(str(model), tokenizer, tmp_path / "out" / "model"))
    assert (model / "chat_template.jinja").read_text() == "{{ my own template }}"  # not written through a link
    assert (served / "config.json").is_symlink() and not (served / "chat_template.jinja").is_symlink()
    assert Path(with_tokenizer(str(model), tokenizer, served)) == served  # its own earlier links are replaced
    # An earlier eval's results in output_dir are named before they are replaced (here the foreign model/ then stops it).
    (mine.parent / "summary.json").write_text("{}")
    shutil.copytree(default_model_path(), tmp_path / "bare")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "chat_template.jinja"):
        (tmp_path / "bare" / name).unlink(missing_ok=True)
    with pytest.warns(RuntimeWarning, match=r"holds an earlier eval's results: this one replaces them"):
        assert main(["eval", f"eval.model_path={tmp_path / 'bare'}", f"eval.output_dir={mine.parent}"]) == 2
    assert "holds files eval did not write" in capsys.readouterr().err and not (mine.parent / "config.yaml").exists()


def test_evals_over_consecutive_seeds_share_no_request_seed() -> None:
    """A prompt's samples are consecutive requests and request i samples with the batch seed + i: eval.seed s + 1 used
    as it was redrew (n - 1)/n of seed s's samples, so a mean over seeds 0, 1, 2 understated its spread."""
    from nemo_like.models.generation.interface import prompt_seeds
    from nemo_like.utils.seeds import eval_seed

    requests = 4 * 8  # 8 prompts x 4 samples
    by_seed = [set(prompt_seeds(eval_seed(s), requests)) for s in range(3)]
    assert all(len(seeds) == requests for seeds in by_seed)
    assert not (by_seed[0] & by_seed[1]) and not (by_seed[1] & by_seed[2]) and not (by_seed[0] & by_seed[2])
    assert set(prompt_seeds(0, requests)) & set(prompt_seeds(1, requests))  # the overlap the hash removes


def test_eval_results_replace_an_earlier_evals_whole_and_the_output_dir_may_hold_the_model(tmp_path, monkeypatch, capsys) -> None:
    """An interrupted write had left new rows beside the earlier eval's summary (written in place, summary last); an
    output_dir with the evaluated model somewhere below it was refused though eval writes nothing there."""
    from nemo_like.evaluation import run
    from nemo_like.evaluation.run import refuse_results_over_model, write_results

    (tmp_path / "summary.json").write_text('{"model": "OLD"}')
    (tmp_path / "results.jsonl").write_text('{"old": 1}\n')
    unwritable = {"prompt_id": "p", "reward": object()}  # json cannot write it: nothing may change
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_results(tmp_path, [{"prompt_id": "q"}, unwritable], {"model": "NEW"}, "config: 1\n")
    assert (tmp_path / "summary.json").read_text() == '{"model": "OLD"}' and (tmp_path / "results.jsonl").read_text() == '{"old": 1}\n'
    real_replace = run.replace_file
    summary = {"model": "NEW", "num_prompts": 1, "num_samples_per_prompt": 1, "greedy": False, "accuracy": 0.625}
    summary.update(mean_reward=1.0, accuracy_per_task={"t": 1.0}, env_metrics={})

    def interrupted_before_the_summary(path, text):
        if Path(path).name == "summary.json":
            raise KeyboardInterrupt
        return real_replace(path, text)

    monkeypatch.setattr(run, "replace_file", interrupted_before_the_summary)
    with pytest.raises(KeyboardInterrupt):  # the new rows are in, the new summary is not: no summary at all
        write_results(tmp_path, [{"prompt_id": "q"}], summary, "config: 1\n")
    assert not (tmp_path / "summary.json").exists() and (tmp_path / "results.jsonl").read_text() == '{"prompt_id": "q"}\n'
    capsys.readouterr()

    def full(path, text):
        raise OSError(28, "No space left on device")

    # A full disk after the whole eval: a traceback, and the figures (printed after the files) were never seen
    monkeypatch.setattr(run, "replace_file", full)
    with pytest.raises(ConfigError, match=r"cannot write results.jsonl \(No space left on device\); the figures above were not saved"):
        write_results(tmp_path, [{"prompt_id": "q"}], summary, "config: 1\n")
    assert "accuracy                    0.6250" in capsys.readouterr().err
    monkeypatch.setattr(run, "replace_file", real_replace)
    write_results(tmp_path, [{"prompt_id": "q"}], summary, "config: 1\n")
    assert json.loads((tmp_path / "summary.json").read_text())["model"] == "NEW"
    assert (tmp_path / "results.jsonl").read_text() == '{"prompt_id": "q"}\n' and (tmp_path / "config.yaml").read_text() == "config: 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "results.jsonl", "summary.json"]  # no partial file
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    refuse_results_over_model(tmp_path, model)  # output_dir=. beside ./models/m: eval writes none of the model's files
    step = tmp_path / "ckpt" / "step_5"
    (step / "policy").mkdir(parents=True)
    refuse_results_over_model(tmp_path / "ckpt", step / "policy")  # the checkpoint directory: its steps are untouched
    for out in (step, step / "policy", step / "policy" / "eval"):  # the step's config.yaml, the model, inside it
        with pytest.raises(ConfigError, match="eval.output_dir: writing"):
            refuse_results_over_model(out, step / "policy")


def test_a_merged_model_eval_did_not_merge_is_refused_not_replaced(tmp_path, capsys, monkeypatch) -> None:
    """A LoRA eval replaced output_dir/merged_model whatever it held: a model the user merged there (`nemo-like merge
    --out merged_model`, as lora.md shows) and their notes were deleted. The last eval's own merge is replaced."""
    from nemo_like.cli import main
    from nemo_like.evaluation.run import MERGE_MARKER, refuse_replacing_a_model_eval_did_not_merge
    from nemo_like.models.assets import default_model_path

    adapters = lora_checkpoint(tmp_path / "step_2" / "policy", default_model_path())
    out = tmp_path / "out"
    (out / "merged_model").mkdir(parents=True)
    refuse_replacing_a_model_eval_did_not_merge(out)  # empty: nothing to lose
    (out / "merged_model" / "NOTES.txt").write_text("my step-1 merge")
    assert main(["eval", f"eval.model_path={adapters}", f"eval.output_dir={out}"]) == 2
    assert "holds a model no eval merged there" in capsys.readouterr().err
    assert (out / "merged_model" / "NOTES.txt").read_text() == "my step-1 merge"
    # ~ is the home directory, as in training's directories (eval wrote a literal ./~/out and never saw this model)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path / "step_2")
    assert main(["eval", f"eval.model_path={adapters}", "eval.output_dir='~/out'"]) == 2
    assert f"{out / 'merged_model'} holds a model no eval merged there" in capsys.readouterr().err
    assert not (tmp_path / "step_2" / "~").exists()
    (out / MERGE_MARKER).write_text(str(tmp_path / "elsewhere"))  # an eval merged somewhere else
    with pytest.raises(ConfigError, match="holds a model no eval merged there"):
        refuse_replacing_a_model_eval_did_not_merge(out)
    # A plain eval of the user's own out/merged_model scored it (summary.json's model_dir names it) and merged nothing
    (out / MERGE_MARKER).unlink()
    (out / "summary.json").write_text(json.dumps({"model_dir": str(out / "merged_model")}))
    with pytest.raises(ConfigError, match="holds a model no eval merged there"):
        refuse_replacing_a_model_eval_did_not_merge(out)
    # An eval's merge is replaced, however either eval spelled the directory: relative, with ./, through a link
    monkeypatch.chdir(tmp_path)
    (tmp_path / "link").symlink_to(out)
    for written, spelled in [("out/merged_model", out), (str(out / "merged_model"), Path("./out")), ("link/merged_model", Path("out"))]:
        (out / MERGE_MARKER).write_text(written)
        refuse_replacing_a_model_eval_did_not_merge(spelled)
    # A real LoRA eval into an emptied out, stopped right after its merge (before Ray, long before its summary.json):
    # the merge is on record, so the rerun there may replace it
    shutil.rmtree(out)

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as stop:
        stop.setattr("nemo_like.distributed.ray_init.init_ray", stopped)  # evaluate imports it when it runs
        assert main(["eval", f"eval.model_path={adapters}", "eval.output_dir=out"]) == 130  # one line, no traceback
    assert any((out / "merged_model").iterdir()) and not (out / "summary.json").exists()
    assert Path((out / MERGE_MARKER).read_text().strip()) == out / "merged_model"
    refuse_replacing_a_model_eval_did_not_merge(Path("./out"))


def test_eval_tokenizes_with_the_checkpoints_own_tokenizer_and_refuses_one_that_cannot_be_the_models(tmp_path) -> None:
    """A checkpoint of another shipped model (embedded:tiny-tool-qwen2, 315 rows) evaluated with the recipe, as the
    README shows: its prompts were tokenized with the recipe's tokenizer (359 ids) and the sampler's actor failed with an
    IndexError after Ray started. The checkpoint's own tokenizer is used; an explicit other one, or one whose ids pass
    the model's rows, is refused before Ray starts, naming the key."""
    from nemo_like.evaluation.run import eval_tokenizer

    tool = Path(resolve_model_path("embedded:tiny-tool-qwen2"))
    step = tmp_path / "ckpt" / "step_2" / "policy"
    shutil.copytree(tool, step)
    tokenizer, source = eval_tokenizer(load_config(None, []), str(step))
    assert source == str(step) and len(tokenizer.get_vocab()) == len(load_tokenizer(str(tool)).get_vocab())
    named = load_config(None, ["policy.model_name=embedded:tiny-arith-teacher", "policy.tokenizer_name=embedded:tiny-arith-qwen2"])
    with pytest.raises(ConfigError, match=r"policy.tokenizer_name=.* has another tokenizer than the one .*step_2/policy holds"):
        eval_tokenizer(named, str(step))
    bare = tmp_path / "bare"  # a checkpoint written before it held the run's tokenizer
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(tool / name, bare / name)
    with pytest.raises(ConfigError, match=r"the tokenizer of policy.model_name=.* has ids up to 358, past the 315 vocabulary rows of"):
        eval_tokenizer(load_config(None, []), str(bare))
    assert eval_tokenizer(load_config(None, ["policy.model_name=embedded:tiny-tool-qwen2"]), str(bare))[1] == "embedded:tiny-tool-qwen2"
    # a shipped model named as such holds its tokenizer too (the recipe's had been taken: accuracy 0.00 against 0.91)
    assert eval_tokenizer(load_config(None, []), "embedded:tiny-tool-qwen2")[1] == str(tool)
