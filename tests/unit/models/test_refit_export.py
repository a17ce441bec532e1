"""Which refit transport each setup uses (one decision), and that the policy exports its weights to CPU only for a
transport that reads them, with ``performance/refit_bytes`` counting what was exported (0 when nothing was).

The loop's real ``refit_if_stale`` drives the real ``VLLMGeneration.refit`` / ``HFGeneration.refit`` and the real
``Policy.weight_buckets`` / ``take_refit_bytes`` / ``release_memory``; only the actor groups behind them are small
scripted objects that log each call and answer through the real object store (no engine, no policy worker).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from nemo_like.algorithms.grpo import refit_if_stale
from nemo_like.distributed.supervision import Replaceable
from nemo_like.models.generation.hf import HFGeneration
from nemo_like.models.generation.interface import ServedWeights, export_weights
from nemo_like.models.generation.vllm import VLLMGeneration
from nemo_like.models.policy.inline import InlineGeneration
from nemo_like.models.policy.policy import Policy
from nemo_like.models.refit.buckets import WeightBuckets
from nemo_like.models.refit.transport import refit_transport, shared_memory_refit_possible

EXPORT_BYTES = 4096
VERSION = 3


@pytest.mark.parametrize(
    ("on_gpu", "colocated", "policy_ranks", "lora", "transport"),
    [
        (False, False, 1, False, "object_store"),  # CPU
        (False, False, 2, True, "object_store"),
        (True, True, 1, False, "cuda_ipc"),  # GPU, colocated, one policy rank
        (True, False, 1, False, "nccl"),  # GPU, generation on its own GPUs, one policy rank
        (True, True, 2, False, "object_store"),  # a sharded policy: no rank holds every tensor
        (True, False, 4, False, "object_store"),
        (True, True, 1, True, "object_store"),  # LoRA: adapters or merged weights
        (True, False, 1, True, "object_store"),
        (True, True, 0, False, "object_store"),  # no policy attached
        (True, False, 0, False, "object_store"),
    ],
)
def test_refit_transport_decision_table(on_gpu, colocated, policy_ranks, lora, transport):
    assert refit_transport(on_gpu, colocated, policy_ranks, lora) == transport


@pytest.mark.parametrize(
    ("gpus_per_node", "shared_memory", "alive_nodes", "possible"),
    [
        (0, True, 1, True),  # a one-node CPU cluster with a writable /dev/shm
        (0, True, 2, False),  # several nodes share no memory
        (0, False, 1, False),  # no writable /dev/shm
        (1, True, 1, False),  # GPU clusters refit through the engine's transport
    ],
)
def test_shared_memory_refit_decision_table(gpus_per_node, shared_memory, alive_nodes, possible):
    assert shared_memory_refit_possible(gpus_per_node, shared_memory, alive_nodes) is possible


def test_export_weights_calls_an_exporter_and_passes_exported_weights_through():
    buckets = WeightBuckets(version=1, names=[["w"]], refs=[])
    calls = []
    assert export_weights(buckets) is buckets
    assert export_weights(lambda: calls.append(1) or buckets) is buckets and calls == [1]


class ScriptedGroup:
    """Stands in for a ``RayWorkerGroup``: logs every method called and answers it through the object store."""

    def __init__(self, size: int, answers: dict[str, Callable[..., Any]], log: list[str]) -> None:
        self.workers = list(range(size))
        self.answers, self.log = answers, log

    def __len__(self) -> int:
        return len(self.workers)

    def run_all(self, method: str, *args: Any) -> list[ray.ObjectRef]:
        self.log.append(method)
        return [ray.put(self.answers[method](*args)) for _ in self.workers]

    def run_rank0(self, method: str, *args: Any) -> ray.ObjectRef:
        self.log.append(method)
        return ray.put(self.answers[method](*args))


class ScriptedPolicy:
    """The driver's real ``Policy`` methods for export, byte accounting and memory release, over a scripted group."""

    weight_buckets = Policy.weight_buckets
    take_refit_bytes = Policy.take_refit_bytes
    release_memory = Policy.release_memory

    def __init__(self, ranks: int, log: list[str]) -> None:
        self.name, self.weight_version, self.refit_mode = "policy", VERSION, "full"
        self.shared_memory_refit, self._fresh_refit_buffer, self._refit_bytes = False, True, 0
        self.cfg = SimpleNamespace(
            policy=SimpleNamespace(refit_buffer_size_mb=1, generation=SimpleNamespace(colocated=SimpleNamespace(offload_optimizer=True)))
        )
        answers = {
            "export_weight_buckets": lambda mb, mode: WeightBuckets(version=VERSION, names=[["w"]], refs=[], nbytes=EXPORT_BYTES),
            "release_memory": lambda offload: {"grads_freed": 0},
            "ipc_handles": lambda: (["w"], {"GPU-0": {}}),
            "release_ipc_tensors": lambda: None,
            "rendezvous_address": lambda: ("127.0.0.1", 1),
            "init_weight_broadcast_group": lambda address, port, world: None,
            "weight_manifest": lambda: [("w", "float32", (1,))],
            "broadcast_weights": lambda: 1,
        }
        self.group = ScriptedGroup(ranks, answers, log)

    def exports(self) -> int:
        """How many times the policy gathered its weights for a refit."""
        return self.group.log.count("export_weight_buckets")


def engine_answers() -> dict[str, Callable[..., Any]]:
    """A generation worker's refit entry points, each returning the weight version it loaded (-1: not weights)."""
    return {
        "update_weights": lambda weights: weights.version if isinstance(weights, WeightBuckets) else -1,
        "update_weights_from_ipc": lambda handles, names, version: version,
        "init_weight_update_group": lambda address, port, world: None,
        "update_weights_from_broadcast": lambda manifest, version: version,
    }


def vllm_generation(policy: ScriptedPolicy, on_gpu: bool, colocated: bool, lora: bool = False) -> VLLMGeneration:
    """The real facade's state, as ``VLLMGeneration.__init__`` leaves it, without starting an engine."""
    generation = VLLMGeneration.__new__(VLLMGeneration)
    generation.on_gpu, generation.colocated, generation.policy, generation.lora = on_gpu, colocated, policy, lora
    generation.group = ScriptedGroup(1, engine_answers(), policy.group.log)
    generation.weight_version, generation._broadcast_manifest = 0, None
    generation.served = ServedWeights()
    generation.replaceable = Replaceable("generation", generation.group)
    return generation


@pytest.mark.parametrize(("colocated", "transport"), [(True, "cuda_ipc"), (False, "nccl")])
def test_a_gpu_transport_refits_without_any_cpu_export_and_counts_no_refit_bytes(ray_cluster, colocated, transport):
    log: list[str] = []
    policy = ScriptedPolicy(1, log)
    generation = vllm_generation(policy, on_gpu=True, colocated=colocated)
    assert generation.transport == transport

    refit_if_stale(SimpleNamespace(policy=policy, generation=generation))

    assert policy.exports() == 0  # before: refit_if_stale gathered every weight to CPU first, and the refit ignored it
    assert policy.take_refit_bytes() == 0
    assert generation.weight_version == VERSION
    assert ("update_weights_from_ipc" if colocated else "update_weights_from_broadcast") in log


def test_a_colocated_refit_releases_the_policys_memory_before_the_engine_is_touched(ray_cluster):
    log: list[str] = []
    policy = ScriptedPolicy(1, log)
    refit_if_stale(SimpleNamespace(policy=policy, generation=vllm_generation(policy, on_gpu=True, colocated=True)))
    # before: no release at all; after the engine copied the weights, the policy drops the tensors behind the handles
    assert log == ["release_memory", "ipc_handles", "update_weights_from_ipc", "release_ipc_tensors"]


def test_a_generation_on_its_own_gpus_leaves_the_policys_memory_alone(ray_cluster):
    log: list[str] = []
    policy = ScriptedPolicy(1, log)
    refit_if_stale(SimpleNamespace(policy=policy, generation=vllm_generation(policy, on_gpu=True, colocated=False)))
    assert "release_memory" not in log


@pytest.mark.parametrize(
    ("on_gpu", "colocated", "ranks", "lora"),
    [(False, False, 1, False), (True, True, 2, False), (True, False, 2, False), (True, True, 1, True)],
    ids=["cpu", "gpu-colocated-sharded", "gpu-separate-sharded", "gpu-colocated-lora"],
)
def test_the_object_store_transport_exports_once_and_counts_the_bytes(ray_cluster, on_gpu, colocated, ranks, lora):
    log: list[str] = []
    policy = ScriptedPolicy(ranks, log)
    generation = vllm_generation(policy, on_gpu=on_gpu, colocated=colocated, lora=lora)
    assert generation.transport == "object_store"

    refit_if_stale(SimpleNamespace(policy=policy, generation=generation))

    assert policy.exports() == 1 and log[-1] == "update_weights"  # the engine got the exported buckets, not the exporter
    assert policy.take_refit_bytes() == EXPORT_BYTES
    assert generation.weight_version == VERSION


def test_the_hf_backend_always_exports(ray_cluster):
    log: list[str] = []
    policy = ScriptedPolicy(1, log)
    generation = HFGeneration.__new__(HFGeneration)
    generation.group, generation.weight_version = ScriptedGroup(1, engine_answers(), log), 0
    generation.served = ServedWeights()
    generation.replaceable = Replaceable("generation", generation.group)

    refit_if_stale(SimpleNamespace(policy=policy, generation=generation))

    assert log == ["export_weight_buckets", "update_weights"]  # no release: an HF engine is never colocated
    assert policy.take_refit_bytes() == EXPORT_BYTES and generation.weight_version == VERSION


def test_inline_generation_never_refits_nor_exports():
    log: list[str] = []
    policy = ScriptedPolicy(1, log)
    assert refit_if_stale(SimpleNamespace(policy=policy, generation=InlineGeneration(policy, 0, [1]))) == 0.0
    assert log == [] and policy.take_refit_bytes() == 0


def test_a_lora_engines_adapter_folder_of_a_process_that_no_longer_runs_is_removed(tmp_path, monkeypatch):
    """The vLLM LoRA engine's adapter folder was never removed (its actor is killed at the end of a run): one folder
    and the last adapter were left in the temporary directory per run."""
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from nemo_like.models.generation.vllm_worker import ADAPTER_ROOT_PREFIX, new_adapter_root
    from nemo_like.utils.orphans import process_tag

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    dead = tmp_path / f"{ADAPTER_ROOT_PREFIX}{gone}_abc"
    (dead / "v3").mkdir(parents=True)
    (dead / "v3" / "adapter_model.safetensors").write_bytes(b"x" * 1000)
    alive = tmp_path / f"{ADAPTER_ROOT_PREFIX}{os.getppid()}_def"  # a running engine's (this test's parent process)
    alive.mkdir()
    other = tmp_path / f"{ADAPTER_ROOT_PREFIX}unnamed"  # another naming: left alone
    other.mkdir()
    root = Path(new_adapter_root())
    assert root.parent == tmp_path and root.name.startswith(f"{ADAPTER_ROOT_PREFIX}{process_tag()}_")
    assert not dead.exists() and alive.exists() and other.exists()
