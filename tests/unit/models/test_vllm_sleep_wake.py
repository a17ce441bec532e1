"""A colocated vLLM worker's sleep / wake bookkeeping, on a small engine that keeps vLLM 0.32's sleep-mode rules.

The engine below does what vLLM's executor does with its sleeping tags (``sleep(level=1)`` unmaps every tag,
``wake_up(tags)`` maps the ones asked for, all remaining ones for ``None``, and answers whether it is fully awake),
and, like a GPU, refuses writes into unmapped memory (the CUDA illegal address a real engine would hit).
The worker is the real :class:`VLLMGenerationWorker`; only its engine is this one (vLLM's CPU build has no sleep mode).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

import pytest
import torch

from nemo_like.config.schema import EMBEDDED_MODEL
from nemo_like.models.generation.interface import SamplingParams
from nemo_like.models.generation.vllm_worker import VLLMGenerationWorker, fully_awake

SLEEP_TAGS = ("weights", "kv_cache")


class UnmappedMemoryError(RuntimeError):
    """A write into memory that sleep mode unmapped (on a GPU: an illegal memory access)."""


class KvCache:
    """One KV cache tensor of the engine: writable only while the engine's ``kv_cache`` memory is mapped."""

    def __init__(self, engine: SleepModeEngine) -> None:
        self.engine = engine
        self.zeroed = 0

    def zero_(self) -> None:
        if "kv_cache" in self.engine.sleeping:
            raise UnmappedMemoryError("KV cache written while unmapped (sleep level 1)")
        self.zeroed += 1


class SleepModeEngine:
    """Stands in for ``vllm.LLM`` and its in-process worker (``collective_rpc`` runs on ``self``)."""

    def __init__(self, wake_answers_none: bool = False, fail_enqueue: bool = False) -> None:
        self.sleeping: set[str] = set()
        self.calls: list[tuple[str, Any]] = []
        self.wake_answers_none = wake_answers_none  # a vLLM whose wake_up returns None
        self.fail_enqueue = fail_enqueue
        self.kv_caches = [KvCache(self), KvCache(self)]
        self.model_runner = self  # what _zero_kv_cache reads: worker.model_runner.kv_caches
        self.loaded: list[str] = []

    # -- sleep mode (vLLM 0.32: executor/abstract.py) --
    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))
        if "weights" not in self.sleeping:  # vLLM: "Executor is already sleeping" (no-op)
            self.sleeping |= set(SLEEP_TAGS)

    def wake_up(self, tags: list[str] | None = None) -> bool | None:
        self.calls.append(("wake_up", None if tags is None else tuple(tags)))
        self.sleeping -= set(SLEEP_TAGS if tags is None else tags)
        return None if self.wake_answers_none else not self.sleeping

    # -- what the worker calls inside the engine --
    def collective_rpc(self, method: Any, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        name = method if isinstance(method, str) else method.__name__
        self.calls.append(("rpc", name))
        target = getattr(self, method) if isinstance(method, str) else (lambda *a, **k: method(self, *a, **k))
        return [target(*args, **(kwargs or {}))]

    def reload_weights(self, weights_iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        if "weights" in self.sleeping:
            raise UnmappedMemoryError("weights written while unmapped")
        self.loaded = [name for name, _ in weights_iterator]

    def reset_prefix_cache(self) -> bool:
        return True

    def enqueue(self, *args: Any, **kwargs: Any) -> None:
        if self.sleeping:
            raise UnmappedMemoryError(f"generation on an engine with {sorted(self.sleeping)} unmapped")
        if self.fail_enqueue:
            raise RuntimeError("engine failed mid-generate")


class ColocatedWorker(VLLMGenerationWorker):
    """The real worker on a :class:`SleepModeEngine`, set up as a colocated GPU engine."""

    def __init__(self, engine: SleepModeEngine) -> None:
        self._engine = engine
        super().__init__(0, 1, EMBEDDED_MODEL, "float32", 64, 0, pad_token_id=0, eos_token_ids=[1], colocated=True)
        self.on_gpu = self.colocated = True  # what torch.cuda.is_available() gives a GPU actor

    def _start_engine(self, *args: Any) -> SleepModeEngine:
        return self._engine


INIT = dict(model_name=EMBEDDED_MODEL, precision="float32", max_model_len=64, seed=0, pad_token_id=0, eos_token_ids=[1])


def test_reinit_of_a_sleeping_colocated_engine_wakes_it_before_zeroing_the_kv_cache_and_sleeps_after():
    engine = SleepModeEngine()
    worker = ColocatedWorker(engine)
    worker._sleep()  # as every generate call leaves a colocated engine
    engine.calls.clear()

    worker.reinit(rank=0, world_size=1, **INIT)  # before: wakes "weights" only, then writes the unmapped KV cache

    assert all(cache.zeroed == 1 for cache in engine.kv_caches)
    assert "model.embed_tokens.weight" in engine.loaded  # the checkpoint's weights went in as version 0
    assert worker.weight_version == 0
    order = [c for c in engine.calls if c[0] != "rpc" or c[1] == "_zero_kv_cache"]
    assert order == [("wake_up", ("weights",)), ("wake_up", None), ("rpc", "_zero_kv_cache"), ("sleep", 1)]
    assert engine.sleeping == set(SLEEP_TAGS) and worker.asleep  # the policy gets the GPU memory back


def test_reinit_of_an_engine_that_is_not_colocated_neither_sleeps_nor_wakes():
    engine = SleepModeEngine()
    worker = ColocatedWorker(engine)
    worker.colocated = False
    worker.reinit(rank=0, world_size=1, **INIT)
    assert all(cache.zeroed == 1 for cache in engine.kv_caches)
    assert not [c for c in engine.calls if c[0] in ("sleep", "wake_up")]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="generate builds vLLM's request objects")
def test_a_generate_call_that_fails_still_puts_the_colocated_engine_back_to_sleep():
    engine = SleepModeEngine(fail_enqueue=True)
    worker = ColocatedWorker(engine)
    worker._sleep()
    with pytest.raises(RuntimeError, match="engine failed mid-generate"):
        worker.generate([[5, 6, 7]], asdict(SamplingParams(max_new_tokens=4)), seed=0)
    assert engine.calls[-1] == ("sleep", 1)  # before: the engine stayed awake, holding the policy's memory
    assert engine.sleeping == set(SLEEP_TAGS) and worker.asleep


def test_a_vllm_whose_wake_up_returns_none_never_leaves_the_worker_believing_it_sleeps():
    engine = SleepModeEngine(wake_answers_none=True)
    worker = ColocatedWorker(engine)
    worker._sleep()
    worker._wake_up(tags=["weights"])  # a refit: only the weights; the KV cache is still unmapped
    assert worker.asleep
    worker._wake_up()  # a generate call: everything
    assert not worker.asleep and not engine.sleeping
    worker._sleep()  # before: `asleep = not None` stuck True, so this never slept again
    assert engine.calls.count(("sleep", 1)) == 2 and engine.sleeping == set(SLEEP_TAGS)


@pytest.mark.parametrize(
    ("answer", "tags", "awake"),
    [(True, None, True), (False, ["weights"], False), (True, ["kv_cache"], True), (None, None, True), (None, ["weights"], False)],
)
def test_fully_awake_reads_vllms_answer_and_takes_none_as_awake_after_a_full_wake(answer, tags, awake):
    assert fully_awake(answer, tags) is awake


class LoraEngine(SleepModeEngine):
    """With vLLM 0.32's LoRA manager: adapter slots are allocated inside ``load_model``, under the weights' memory
    pool (``v1/worker/gpu_worker.py``), and ``add_lora`` / ``remove_lora`` write into them at once."""

    def __init__(self) -> None:
        super().__init__()
        self.llm_engine = self
        self.adapters: set[int] = set()

    def add_lora(self, request: Any) -> bool:
        if "weights" in self.sleeping:
            raise UnmappedMemoryError("LoRA slots written while the weights are unmapped")
        self.calls.append(("add_lora", request.lora_int_id))
        self.adapters.add(request.lora_int_id)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        if "weights" in self.sleeping:
            raise UnmappedMemoryError("LoRA slot cleared while the weights are unmapped")
        self.calls.append(("remove_lora", lora_id))
        self.adapters.discard(lora_id)
        return True


class LoraColocatedWorker(ColocatedWorker):
    def __init__(self, engine: SleepModeEngine) -> None:
        from nemo_like.config.schema import LoraConfig

        self._engine = engine
        VLLMGenerationWorker.__init__(
            self,
            0,
            1,
            EMBEDDED_MODEL,
            "float32",
            64,
            0,
            pad_token_id=0,
            eos_token_ids=[1],
            colocated=True,
            lora_cfg=LoraConfig(enabled=True),
        )
        self.on_gpu = self.colocated = True


class LocalBuckets:
    """An adapter refit's buckets already in this process (the transport is not what is tested here)."""

    def __new__(cls, version: int, tensors: dict[str, torch.Tensor]) -> Any:
        from nemo_like.models.refit.buckets import WeightBuckets

        class Local(WeightBuckets):
            def iter_buckets(self):
                yield tensors

        return Local(version, [list(tensors)], [None], kind="adapter", adapter_config={"r": 8})


def test_an_adapter_refit_of_a_sleeping_colocated_engine_wakes_its_weights_first():
    """The default GPU LoRA run (colocated, adapter refits): every generate call leaves the engine asleep, and the
    adapter refit called add_lora / remove_lora without waking it: a write into unmapped memory (an illegal address on
    a GPU; or, had it survived, a wake that restores the old adapter)."""
    engine = LoraEngine()
    worker = LoraColocatedWorker(engine)
    tensors = {name: torch.zeros(2, 2) for name in worker.expected_adapter_names}
    for version in (1, 2):
        worker._sleep()  # as every generate call leaves a colocated engine
        assert worker.update_weights(LocalBuckets(version, tensors)) == version
    assert engine.adapters == {2} and worker.lora_request.lora_int_id == 2
    assert [c for c in engine.calls if c[0] in ("wake_up", "add_lora", "remove_lora")] == [
        ("wake_up", ("weights",)),
        ("add_lora", 1),
        ("wake_up", ("weights",)),
        ("add_lora", 2),
        ("wake_up", ("weights",)),  # the KV cache still sleeps, so the worker asks again (vLLM skips awake memory)
        ("remove_lora", 1),
    ]
    worker._sleep()
    worker.reinit(rank=0, world_size=1, **INIT, lora_cfg=worker.lora_cfg)  # a kept engine drops the adapter while asleep
    assert engine.adapters == set() and worker.lora_request is None
