"""Small builders shared by the end-to-end tests (real model, real tokenizer, real actors)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import sys
from pathlib import Path

import psutil  # ships with Ray

from nemo_like.config import MasterConfig, load_config

REPO = Path(__file__).resolve().parents[2]
TINY_RECIPE = REPO / "examples" / "configs" / "grpo_tiny_cpu.yaml"


# The functional tests' tiny run: 4 prompts x 4 generations, 2 steps, 32 validation prompts, no plot at the end.
TINY_OVERRIDES = [
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "grpo.max_num_steps=2",
    "grpo.max_val_samples=32",
    "grpo.val_period=0",
    "policy.train_micro_batch_size=8",
    "policy.num_cpus_per_worker=0.25",
    "data.train.num_problems=256",
    "logger.progress_bar=false",
    "logger.plot_at_end=false",  # ~2 s per run; the tests that check the plot turn it on
]


def tiny_config(tmp_path: Path, *overrides: str) -> MasterConfig:
    """The shipped tiny recipe, shrunk for tests (:data:`TINY_OVERRIDES`), logging under ``tmp_path``."""
    return load_config(TINY_RECIPE, [*TINY_OVERRIDES, f"logger.log_dir={tmp_path / 'logs'}", *overrides])


def ckpt_overrides(ckpt_dir: Path, period: int = 3) -> tuple[str, ...]:
    """Checkpoint every ``period`` steps into ``ckpt_dir``, keeping every checkpoint (no best-k by a metric)."""
    return (
        "checkpointing.enabled=true",
        f"checkpointing.checkpoint_dir={ckpt_dir}",
        f"checkpointing.save_period={period}",
        "checkpointing.keep_top_k=null",
    )


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a JSONL file (``metrics.jsonl``, sample dumps, ``results.jsonl``)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def read_metrics(log_dir: Path) -> list[dict]:
    """The per-step records a run wrote to ``<log_dir>/metrics.jsonl``."""
    return read_jsonl(Path(log_dir) / "metrics.jsonl")


def tensorboard_session_status(log_dir: Path) -> str:
    """The outcome a run wrote to TensorBoard's HParams view under ``<log_dir>/tensorboard`` (``STATUS_SUCCESS``,
    ``STATUS_FAILURE``)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.api_pb2 import Status
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    events = EventAccumulator(str(Path(log_dir) / "tensorboard"))
    events.Reload()
    content = events.PluginTagToContent("hparams")["_hparams_/session_end_info"]
    return Status.Name(HParamsPluginData.FromString(content).session_end_info.status)


# -- a CLI run's sockets (tests/functional/test_fault_tolerance.py, test_local_cluster_address.py) --------------
#: What the CLI printed when ray was imported first and the private cluster bound the network address (the old bug).
OLD_WARNING = "ray was imported before nemo_like.distributed"


def is_loopback(ip: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4-mapped loopback (``::ffff:127.0.0.1``, how Ray's gRPC servers show in ``ss``)."""
    address = ipaddress.ip_address(ip.split("%")[0])
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def cli_command() -> list[str]:
    """The installed ``nemo-like`` console script beside this interpreter (what a user runs), else ``-m nemo_like.cli``."""
    script = Path(sys.executable).with_name("nemo-like")
    return [str(script)] if script.exists() else [sys.executable, "-m", "nemo_like.cli"]


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def listeners(procs: list[psutil.Process]) -> dict[tuple[int, str, int], str]:
    """{(pid, ip, port): process name} of every TCP socket in LISTEN state owned by these processes.

    One machine-wide table per call: reading each process's own sockets costs a parse of /proc/net per process."""
    names = {}
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            names[proc.pid] = proc.name()
    return {
        (conn.pid, conn.laddr.ip, conn.laddr.port): names[conn.pid]
        for conn in psutil.net_connections(kind="tcp")
        if conn.status == psutil.CONN_LISTEN and conn.pid in names
    }


def record_model_starts(monkeypatch, environments_owner=None) -> list[tuple[str, list[str]]]:
    """Record, for each model waited for (``Policy.wait_ready``), the models (and, with ``environments_owner``, the
    module whose ``Environments`` set-up calls, ``"environments"``) spawned by then. The real classes still run."""
    from nemo_like.models.policy.policy import Policy

    spawned: list[str] = []
    waited: list[tuple[str, list[str]]] = []
    real_init, real_wait = Policy.__init__, Policy.wait_ready

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        spawned.append(self.name)

    def recording_wait(self):
        waited.append((self.name, list(spawned)))
        return real_wait(self)

    monkeypatch.setattr(Policy, "__init__", recording_init)
    monkeypatch.setattr(Policy, "wait_ready", recording_wait)
    if environments_owner is not None:
        real_environments = environments_owner.Environments

        def recording_environments(*args, **kwargs):
            environments = real_environments(*args, **kwargs)
            spawned.append("environments")
            return environments

        monkeypatch.setattr(environments_owner, "Environments", recording_environments)
    return waited
