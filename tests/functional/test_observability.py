"""Observability on real runs: TensorBoard and W&B get the metrics of metrics.jsonl, a W&B backend
that cannot start only warns, per-step sample dumps, and ``nemo-like plot``.

One 2-step run (TensorBoard + W&B offline + dumps) is shared by most tests; the W&B failure test
makes its own 1-step run.
"""

import json
import math
import struct
from pathlib import Path

import pytest
from functional.helpers import read_jsonl, read_metrics, tiny_config

from nemo_like.cli import main as cli_main
from nemo_like.train import train

pytestmark = pytest.mark.slow


def numeric(record: dict) -> dict[str, float]:
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


PEAK = 1e9  # FLOP/s per device: set, so no CPU probe runs and the MFU is exact arithmetic


@pytest.fixture(scope="module")
def observed_run(ray_cluster, tmp_path_factory):
    """A real 2-step run with every sink on; returns (log_dir, wandb_dir, history)."""
    tmp = tmp_path_factory.mktemp("observed")
    wandb_env = {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp / "wandb_dir"),
        "WANDB_CONFIG_DIR": str(tmp / "wandb_config"),
        "WANDB_CACHE_DIR": str(tmp / "wandb_cache"),
        "WANDB_DATA_DIR": str(tmp / "wandb_data"),
        "WANDB_SILENT": "true",
    }
    cfg = tiny_config(
        tmp,
        "grpo.max_val_samples=16",
        "logger.tensorboard_enabled=true",
        "logger.wandb_enabled=true",
        "logger.wandb.name=observability-test",
        "logger.dump_train_data=true",
        "logger.num_val_samples_to_print=2",
        "logger.plot_at_end=true",
        f"cluster.peak_flops_per_device={PEAK}",
    )
    with pytest.MonkeyPatch.context() as mp:
        for key, value in wandb_env.items():
            mp.setenv(key, value)
        history = train(cfg)
    return tmp / "logs", Path(wandb_env["WANDB_DIR"]), history


def test_tensorboard_holds_the_same_scalars_as_metrics_jsonl(observed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir, _, _ = observed_run
    records = read_metrics(log_dir)
    acc = EventAccumulator(str(log_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    expected = {(key, r["step"]): value for r in records for key, value in numeric(r).items()}
    logged = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    assert logged.keys() == expected.keys()
    for key, value in expected.items():
        assert math.isclose(logged[key], value, rel_tol=1e-6, abs_tol=1e-6), key  # TB stores float32
    assert "config/text_summary" in acc.Tags()["tensors"]
    assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")


def read_wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` transaction log (LevelDB log format: 32 KiB blocks of
    chunks, each ``crc32 | length | type``), decoded with wandb's own ``Record`` message."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's trailing bytes too short for a header are padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: one whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_run_holds_the_metrics_and_the_config(observed_run):
    log_dir, wandb_dir, _ = observed_run
    runs = list((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    (wandb_file,) = runs[0].glob("run-*.wandb")
    history, config_keys = [], set()
    for record in read_wandb_records(wandb_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
        elif kind == "config":
            config_keys |= {item.key for item in record.config.update}
        elif kind == "run":
            assert record.run.display_name == "observability-test" and record.run.project == "nemo-like"
    records = read_metrics(log_dir)
    assert [h["_step"] for h in history] == [r["step"] for r in records] == [0, 1, 2]
    for logged, record in zip(history, records):
        assert {k: v for k, v in logged.items() if not k.startswith("_")} == pytest.approx(numeric(record))
    assert "train/reward" in history[1] and {"grpo", "policy", "logger"} <= config_keys


def test_throughput_and_time_shares_are_logged_every_step(observed_run):
    log_dir, _, history = observed_run
    for record in read_metrics(log_dir)[1:]:
        for key in ("tokens_per_sec", "generation_tokens_per_sec", "training_tokens_per_sec", "samples_per_sec"):
            assert record[f"performance/{key}"] > 0, key
        # Over the step's time without its validation pass (whose generation no count holds), validating or not.
        work = record["timing/train/total_step_time"] - record["timing/train/validation"]
        assert record["performance/samples_per_sec"] == pytest.approx(16 / work)
        shares = {k: v for k, v in record.items() if k.startswith("timing/train/share/")}
        assert {"generation", "policy_training", "validation"} <= {k.rsplit("/", 1)[1] for k in shares}
        # Each share is its phase's seconds over the step's; the phases are disjoint (how much of the step they cover
        # depends on the machine's load: a bound on it failed a loaded CI run at 0.45)
        total = record["timing/train/total_step_time"]
        for key, share in shares.items():
            assert share == pytest.approx(record[f"timing/train/{key.rsplit('/', 1)[1]}"] / total), key
        assert 0.0 < sum(shares.values()) <= 1.0 + 1e-9


def test_mfu_and_per_worker_rates_follow_the_documented_formulas(observed_run):
    from transformers import AutoConfig

    from nemo_like.models.loading import resolve_model_path
    from nemo_like.utils.flops import matmul_params

    log_dir, _, _ = observed_run
    n = matmul_params(AutoConfig.from_pretrained(resolve_model_path("embedded:tiny-arith-qwen2")))
    for r in read_metrics(log_dir)[1:]:
        assert r["performance/forward_passes/prev_logprobs"] == 0 and r["performance/forward_passes/reference_logprobs"] > 0
        flops = (
            6 * n * r["performance/num_trained_tokens"]
            + 2 * n * r["performance/num_batch_tokens"]
            + 2 * n * r["performance/num_generated_tokens"]
        )
        assert r["performance/model_flops"] == pytest.approx(flops)
        work = r["timing/train/total_step_time"] - r["timing/train/validation"]
        assert r["performance/mfu"] == pytest.approx(flops / (work * PEAK))  # one CPU node
        assert r["performance/training_tokens_per_sec_per_worker"] == pytest.approx(r["performance/training_tokens_per_sec"])
        assert r["performance/generation_tokens_per_sec_per_worker"] == pytest.approx(r["performance/generation_tokens_per_sec"])


def test_train_dumps_back_fill_prev_logprobs_from_the_training_pass(observed_run):
    log_dir, _, history = observed_run
    assert history[-1]["performance/forward_passes/prev_logprobs"] == 0  # prev pass skipped: back-filled
    for step in (1, 2):
        rows = read_jsonl(log_dir / f"train_data_step{step}.jsonl")
        assert len(rows) == 16
        for row in rows:
            assert {"prompt", "response", "reward", "advantage", "generation_logprobs", "prev_logprobs"} <= row.keys()
            assert "<|im_start|>user" in row["prompt"] and row["reward"] in (0.0, 1.0)
            n = len(row["response_token_ids"])
            assert n > 0 and len(row["generation_logprobs"]) == n == len(row["prev_logprobs"])
            assert any(lp != 0.0 for lp in row["prev_logprobs"])  # real values, never zeros
            # On-policy step: the trainer's pre-update logprobs equal the sampler's.
            assert max(abs(p - g) for p, g in zip(row["prev_logprobs"], row["generation_logprobs"])) < 1e-4
        group = [r["advantage"] for r in rows if r["group_id"] == 0]
        assert abs(sum(group)) < 1e-4  # group-normalised advantages


def test_validation_dumps_exist_for_each_validation(observed_run):
    log_dir, _, _ = observed_run
    for step in (0, 2):
        rows = read_jsonl(log_dir / f"val_data_step{step}.jsonl")
        assert len(rows) == 16
        assert {"prompt", "response", "reward", "generation_logprobs"} <= rows[0].keys()
    assert not (log_dir / "val_data_step1.jsonl").exists()


def test_plot_cli_renders_the_standard_panel(observed_run, tmp_path, capsys):
    from matplotlib.image import imread

    log_dir, _, _ = observed_run
    assert (log_dir / "metrics.png").stat().st_size > 20_000  # written by the run itself
    out = tmp_path / "panel.png"
    assert cli_main(["plot", str(log_dir), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.stat().st_size > 20_000
    image = imread(out)
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 600
    custom = tmp_path / "custom.png"
    assert cli_main(["plot", str(log_dir), "--metrics", "train/reward", "performance/tokens_per_sec", "--out", str(custom)]) == 0
    assert imread(custom).shape[1] > 300
    assert cli_main(["plot", str(tmp_path / "nowhere")]) == 2


def test_a_wandb_backend_that_fails_to_start_only_warns(ray_cluster, tmp_path, monkeypatch):
    # A real failure: online mode, not logged in, and the server address unreachable.
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for key, value in {
        "WANDB_MODE": "online",
        "WANDB_BASE_URL": "http://127.0.0.1:9",
        "WANDB_INIT_TIMEOUT": "5",
        "WANDB_DIR": str(tmp_path / "wandb_dir"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb_data"),
        "NETRC": str(tmp_path / "no-netrc"),
        "WANDB_SILENT": "true",
    }.items():
        monkeypatch.setenv(key, value)
    cfg = tiny_config(
        tmp_path,
        "grpo.max_num_steps=1",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "loss_fn.reference_policy_kl_penalty=0",  # no reference actor: a cheaper run
        "logger.wandb_enabled=true",
        "logger.tensorboard_enabled=true",
    )
    with pytest.warns(RuntimeWarning, match="Weights & Biases logging disabled"):
        history = train(cfg)
    assert [h["step"] for h in history] == [1]
    assert [r["step"] for r in read_metrics(tmp_path / "logs")] == [1]
    assert list((tmp_path / "logs" / "tensorboard").glob("events.out.tfevents.*"))  # the other sinks went on
