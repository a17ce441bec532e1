"""The judge's own generation engine: generation actors of either backend (``hf``: :class:`HFGenerationWorker`;
``vllm``: :class:`VLLMGenerationWorker`) with the judge model, called with a deadline. Both serve the same
``generate(prompts, params, seeds)``, and greedy verdicts (the default) are the same tokens on either.

A call splits the judge prompts into chunks of ``max_batch_size``, dealt round-robin to the actors, and waits at
most ``deadline_s`` for them: chunks done in time return their responses, the others return ``None`` (timed out).
After a timeout or an actor failure the actors are killed (a stuck judge must not block the next step) and fresh ones
start loading at once, while the run goes on; :attr:`JudgeEngine.restarts` counts those restarts.

A call takes at most ``deadline_s`` (plus, when it kills the actors, :data:`RESTART_PLACEMENT_S` placing their
replacements), and a load is never killed for it: the constructor returns once the actors have loaded the model (the
environment actor that owns the engine is ready only then, and a replaced one is rebuilt before its call is sent
again), and a call that finds a restarted engine still loading counts its samples as timeouts and leaves the load
running (a judge whose load took longer than ``deadline_s`` had been restarted by every call, timing out on all of
them). A restart not placed yet counts the call's samples as engine errors and is tried again by the next call.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from nemo_like.models.generation.interface import SamplingParams


@dataclass(frozen=True)
class JudgeEngineSpec:
    """How to start the judge's actors."""

    model_name: str
    precision: str
    num_workers: int
    num_cpus: float
    num_gpus: float
    num_threads: int
    pad_token_id: int
    eos_token_ids: tuple[int, ...]
    placement_timeout_s: float = 60.0
    backend: str = "hf"  # or "vllm"
    max_model_len: int = 2048  # vLLM: the longest judge prompt + verdict
    kv_cache_space_gib: int = 1  # vLLM on CPU: the KV cache (GiB, an integer: VLLM_CPU_KVCACHE_SPACE)
    gpu_memory_utilization: float = 0.3  # vLLM on GPU: its share of the device


def engine_actor(spec: JudgeEngineSpec, max_batch_size: int) -> tuple[type, dict[str, Any], dict[str, str] | None]:
    """The judge's actor class, its constructor arguments (after ``rank, world_size``) and environment, per backend."""
    if spec.backend == "hf":
        from nemo_like.models.generation.hf_worker import HFGenerationWorker

        init = dict(
            model_name=spec.model_name,
            precision=spec.precision,
            num_threads=spec.num_threads,
            pad_token_id=spec.pad_token_id,
            eos_token_ids=list(spec.eos_token_ids),
            max_batch_size=max_batch_size,
        )
        return HFGenerationWorker, init, None
    if spec.backend == "vllm":
        from nemo_like.models.generation.vllm import vllm_actor_env
        from nemo_like.models.generation.vllm_worker import VLLMGenerationWorker

        init = dict(
            model_name=spec.model_name,
            precision=spec.precision,
            max_model_len=spec.max_model_len,
            seed=0,  # every call passes its own seeds
            pad_token_id=spec.pad_token_id,
            eos_token_ids=list(spec.eos_token_ids),
            gpu_memory_utilization=spec.gpu_memory_utilization,
        )
        return VLLMGenerationWorker, init, vllm_actor_env(spec.num_gpus > 0, spec.kv_cache_space_gib)
    raise ValueError(f"judge engine_backend must be 'hf' or 'vllm', got {spec.backend!r}")


@dataclass
class EngineResult:
    """One call's outcome: response ids per prompt (``None``: no answer), and why a prompt has none (``failures[i]``:
    ``"timeout"`` past the deadline, ``"error"`` its actor failed, ``None`` answered)."""

    responses: list[list[int] | None]
    failures: list[str | None]


def chunked(n: int, size: int) -> list[range]:
    """``range(n)`` cut into consecutive ranges of at most ``size``."""
    return [range(start, min(start + size, n)) for start in range(0, n, size)]


#: Seconds a restart after a timeout or failure waits for its actors' resources, which the killed actors have just freed
#: (the set-up waits ``placement_timeout_s``; a call must not): the rest is left to the next call, within its deadline.
RESTART_PLACEMENT_S = 2.0


class JudgeEngine:
    """The judge's generation actors (see the module docstring)."""

    def __init__(self, spec: JudgeEngineSpec, max_batch_size: int = 16) -> None:
        self.spec = spec
        self.max_batch_size = max_batch_size
        self.group: Any = None
        self.restarts = 0
        self._failure_reported = False  # the first failed call is printed; the rest are counted (engine_errors)
        self._loading: list[Any] = []  # readiness refs of a restarted engine no call has yet seen loaded
        self._start()
        self.group.wait_started()  # set-up's time, not a call's: a model that cannot load fails here, naming the group
        self._loading = []

    def _start(self, placement_timeout_s: float | None = None) -> None:
        from nemo_like.distributed.worker_group import RayWorkerGroup, WorkerResources

        s = self.spec
        actor_cls, init, env = engine_actor(s, self.max_batch_size)
        resources = WorkerResources(num_cpus=s.num_cpus, num_gpus=s.num_gpus, num_threads=s.num_threads)
        timeout = s.placement_timeout_s if placement_timeout_s is None else placement_timeout_s
        self.group = RayWorkerGroup("judge", actor_cls, s.num_workers, resources, init, timeout, env)
        self._loading = [w.__ray_ready__.remote() for w in self.group.workers]

    def _restart(self, placement_timeout_s: float) -> bool:
        """Start fresh actors, waiting at most ``placement_timeout_s`` for their resources (a call's time, not the set-up's
        ``placement_timeout_s``); whether they were placed (if not, the next call tries again)."""
        from nemo_like.distributed.worker_group import PlacementError

        try:
            self._start(placement_timeout_s)
        except PlacementError as exc:
            print(f"[judge] the restarted engine is not placed yet ({exc}); the next call tries again", flush=True)
            return False
        return True

    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], deadline_s: float) -> EngineResult:
        """Responses to ``prompts``, prompt ``i`` sampled with ``seeds[i]`` whatever chunk and actor it lands on (see the
        module docstring), within ``deadline_s`` (see the module docstring); never raises for a slow, loading, failed or
        not yet placed actor."""
        import ray

        result = EngineResult([None] * len(prompts), [None] * len(prompts))
        if not prompts:
            return result
        deadline = time.monotonic() + deadline_s
        if self.group is None and not self._restart(deadline_s):  # shut down, or a restart not placed yet
            result.failures[:] = ["error"] * len(prompts)
            return result
        if self._loading:  # loaded since the last call: an engine like any other
            loaded, _ = ray.wait(self._loading, num_returns=len(self._loading), timeout=0)
            self._loading = [] if len(loaded) == len(self._loading) else self._loading
        loading = bool(self._loading)
        if loading:  # still loading: the load shares this call's deadline, and is never killed for it
            left = max(0.0, deadline - time.monotonic())
            loaded, _ = ray.wait(self._loading, num_returns=len(self._loading), timeout=left)
            if len(loaded) < len(self._loading):
                result.failures[:] = ["timeout"] * len(prompts)
                return result
            self._loading = []
        chunks = chunked(len(prompts), self.max_batch_size)
        workers = self.group.workers
        refs = [
            workers[i % len(workers)].generate.remote([prompts[j] for j in rows], asdict(params), [seeds[j] for j in rows])
            for i, rows in enumerate(chunks)
        ]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
        done = set(ready)
        for ref, rows in zip(refs, chunks):
            if ref not in done:
                result.failures[rows.start : rows.stop] = ["timeout"] * len(rows)
                continue
            try:
                samples = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - an actor failure scores as a judge failure, never crashes the run
                result.failures[rows.start : rows.stop] = ["error"] * len(rows)
                self._report_first_failure(exc)
                continue
            for j, sample in zip(rows, samples):
                result.responses[j] = list(sample["response_ids"])
        # A timeout of an engine that has just loaded is its load's share of the deadline, not a stuck judge: kept
        if "error" in result.failures or ("timeout" in result.failures and not loading):
            self.kill()
        return result

    def _report_first_failure(self, error: Exception) -> None:
        """Print the engine's first failed call (its error's last line): a judge that fails every call otherwise showed
        only as engine_errors in the metrics, each sample scored parse_failure_reward."""
        if self._failure_reported:
            return
        self._failure_reported = True
        cause = next((line for line in reversed(str(error).splitlines()) if line.strip()), type(error).__name__)
        print(
            f"[judge] warning: the judge {self.spec.model_name!r} failed a call ({cause.strip()}): its samples get "
            "parse_failure_reward and the engine restarts; later failures are counted in env/<task>/engine_errors",
            file=sys.stderr,
            flush=True,
        )

    def kill(self) -> None:
        """Kill the actors now and start fresh ones, which load while the run goes on; their resources (just freed) are
        waited for at most :data:`RESTART_PLACEMENT_S`, else the next call tries again."""
        if self.group is not None:
            self.group.kill()
            self.group = None
        self._loading = []
        self.restarts += 1
        self._restart(min(self.spec.placement_timeout_s, RESTART_PLACEMENT_S))

    def shutdown(self) -> None:
        """Release the actors."""
        if self.group is not None:
            self.group.shutdown()
            self.group = None
