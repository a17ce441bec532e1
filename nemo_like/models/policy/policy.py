"""Driver-side facade over the policy (or reference) worker group: reads like one local model."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import ray
import torch

from nemo_like.config.schema import MasterConfig
from nemo_like.distributed.faults import inject
from nemo_like.distributed.worker_group import RayWorkerGroup, RoleResources, WorkerResources, get_with_context
from nemo_like.models.policy.loss_protocol import LossFunction
from nemo_like.models.policy.rows import Batch, split_rows_unevenly
from nemo_like.models.policy.sharded_logprobs import ShardedLogprobs
from nemo_like.models.policy.spec import PolicyWorkerSpec
from nemo_like.models.policy.spec import batching_plan as batching_plan  # noqa: F401  (re-exported: tests, benchmarks)
from nemo_like.models.policy.worker import PolicyWorker
from nemo_like.models.refit.buckets import WeightBuckets
from nemo_like.models.refit.shared_memory import SharedMemoryRefused, shared_memory_available
from nemo_like.models.refit.transport import shared_memory_refit_possible
from nemo_like.plan.logprob_passes import optimizer_steps_per_rollout
from nemo_like.plan.run_plan import RunPlan
from nemo_like.plan.threads import ThreadSplit
from nemo_like.utils.counters import Increments


def worker_rng_states(saved: list[dict[str, Any]] | None, workers: int, directory: str) -> list[dict[str, Any] | None]:
    """The RNG state each of ``workers`` ranks resumes with: the checkpoint's, rank for rank, when it saved as many;
    otherwise none (each keeps its seeded start), said in one line: a resume on another ``dp_size`` restores weights and
    optimizer exactly, but draws of torch's RNG in the workers (LoRA dropout) differ from an uninterrupted run's."""
    if saved is not None and len(saved) == workers:
        return list(saved)
    if saved is not None:
        print(
            f"[checkpoint] {directory} holds the RNG states of {len(saved)} policy ranks, this run has {workers}: the workers "
            "keep their seeded RNG (weights and optimizer resume exactly; random draws in the workers, e.g. LoRA dropout, "
            "differ from an uninterrupted run's)",
            flush=True,
        )
    return [None] * workers


def optimizer_step_shards(batch: Batch, num_steps: int, dp_size: int) -> list[list[Batch]]:
    """``[rank][step]`` row blocks of one train call: the rows cut into ``num_steps`` contiguous global batches whose
    sizes differ by at most one, each carrying its ``global_valid_toks`` / ``global_valid_seqs`` and split across the
    ``dp_size`` ranks the same way (a rank may get no row; it then runs filler forwards, see ``_agree_on_count``).
    An agent rollout has more rows than planned when sessions branched and fewer when some were rejected: it still
    takes the planned number of steps (fixed ``train_global_batch_size`` slices gave branched rows a small extra,
    unclipped step, or failed to split across two ranks), never a step without a row."""
    size = batch["input_ids"].shape[0]
    steps = min(num_steps, size)
    per_rank: list[list[Batch]] = [[] for _ in range(dp_size)]
    for chunk in split_rows_unevenly(batch, steps) if steps else []:
        valid = chunk["token_mask"] * chunk["sample_mask"].unsqueeze(-1)
        chunk["global_valid_toks"] = valid.sum()
        chunk["global_valid_seqs"] = chunk["sample_mask"].sum()
        for rank, shard in enumerate(split_rows_unevenly(chunk, dp_size)):
            per_rank[rank].append(shard)
    return per_rank


#: The roles a :class:`Policy` group plays; each gets its own threads from the run plan's split.
POLICY_ROLES = ("policy", "reference", "teacher")


def policy_resources(cfg: MasterConfig, role: str, split: ThreadSplit) -> RoleResources:
    """The policy, the reference or a teacher (``role``, one of :data:`POLICY_ROLES`; every teacher model's group is a
    ``teacher``, whatever its name): ``policy.dp_size x tensor_parallel_size`` workers each (frozen models are sharded
    like the policy), CPUs each, threads each as the run plan's ``split`` says, one GPU each on GPU clusters."""
    if role not in POLICY_ROLES:
        raise ValueError(f"a policy group's role must be one of {POLICY_ROLES}, got {role!r}")
    pc = cfg.policy
    resources = WorkerResources(
        num_cpus=pc.num_cpus_per_worker,
        num_gpus=1.0 if cfg.cluster.gpus_per_node else 0.0,
        num_threads={"policy": split.policy, "reference": split.reference, "teacher": split.teacher}[role],
    )
    return RoleResources(role, pc.dp_size * pc.dtensor_cfg.tensor_parallel_size, resources)


def policy_worker_spec(
    cfg: MasterConfig, request: RoleResources, trainable: bool, loss_fn: LossFunction | None, split: ThreadSplit
) -> PolicyWorkerSpec:
    """What every worker of ``request``'s role is built from: its threads as the plan's ``split`` says, the policy's
    logprob phase on its own share where that is smaller (:attr:`ThreadSplit.policy_logprobs`)."""
    logprob_threads = (split.policy_logprobs or None) if request.role == "policy" else None
    return PolicyWorkerSpec.from_config(cfg, trainable, loss_fn, request.resources.num_threads, logprob_threads)


def alive_node_count() -> int:
    """Ray's live nodes (for :func:`~nemo_like.models.refit.transport.shared_memory_refit_possible`)."""
    return sum(1 for node in ray.nodes() if node.get("Alive"))


@dataclass
class TrainResult:
    """What one call of :meth:`Policy.train` reports back."""

    metrics: dict[str, float]
    grad_norms: list[float]
    lr: float
    nonfinite_steps_skipped: int
    first_step_logprobs: torch.Tensor | None  # None when the batch had no row or its first step had no token to train on
    logprob_passes_since_last_update: int = 0  # logprob forward passes (all workers) since the previous train call
    empty_steps_skipped: int = 0  # optimizer steps with no token to train on: skipped (no update, no schedule step)
    forward_tokens: int = 0  # tokens the training forwards ran through the transformer, all data-parallel ranks
    trained_tokens: int = 0  # tokens (attention mask) of the optimizer steps that ran, all data-parallel ranks


class Policy:
    """``policy.dp_size`` x ``tensor_parallel_size`` workers sharing one sharded model: the trainable policy,
    or the frozen reference."""

    def __init__(
        self,
        cfg: MasterConfig,
        name: str = "policy",
        trainable: bool = True,
        loss_fn: LossFunction | None = None,
        plan: RunPlan | None = None,
        *,
        wait: bool = True,
        role: str | None = None,
    ) -> None:
        """``loss_fn``: the run's loss (a :class:`~nemo_like.models.policy.loss_protocol.LossFunction`, e.g. the clipped
        PG loss), built once by the driver (required when ``trainable``; the reference needs none). ``plan``: the run's
        plan (its thread split, and what a refit sends: :func:`nemo_like.plan.refit.refit_mode`); ``None``, for a caller
        outside a run: decided here on the running cluster. Every worker is built from one
        :class:`~nemo_like.models.policy.spec.PolicyWorkerSpec` of ``cfg``. ``wait=False``: return once the workers are
        spawned; :meth:`wait_ready` then waits for them (so that several models' workers start at the same time).
        ``role``: whose threads of the plan's split the workers get (:func:`policy_resources`); ``None``: ``policy``
        when ``trainable``, else ``reference`` (a teacher passes ``teacher``: its group names are its own)."""
        if trainable and loss_fn is None:
            raise ValueError(f"the trainable policy '{name}' needs the run's loss_fn")
        self.cfg = cfg
        self.trainable = trainable
        self.loss_fn = loss_fn
        if plan is None:
            from nemo_like.distributed.planning import plan_on_cluster

            plan = plan_on_cluster(cfg)
        request = policy_resources(cfg, role or ("policy" if trainable else "reference"), plan.threads)
        num_workers = request.count
        init = dict(spec=policy_worker_spec(cfg, request, trainable, loss_fn, plan.threads))
        self.group = RayWorkerGroup(
            name,
            PolicyWorker,
            num_workers,
            request.resources,
            init,
            cfg.cluster.placement_timeout_s,
            strategy=cfg.cluster.placement_strategy,
        )
        self.name = name
        self._ready = False
        self.weight_version = 0
        self.refit_mode = plan.refit.value if trainable else "full"
        self._refit_bytes = 0  # exported since the last take_refit_bytes()
        self._prev_passes = Increments()  # read by train(): the prev passes since the last update
        self._logprob_passes = Increments()  # read by take_logprob_passes()
        # Full-weight refits on a one-node CPU cluster go through a shared-memory buffer; LoRA's adapter and merged
        # refits keep the object-store path.
        self.shared_memory_refit = (
            trainable
            and self.refit_mode == "full"
            and shared_memory_refit_possible(cfg.cluster.gpus_per_node, shared_memory_available(), alive_node_count())
        )
        self._fresh_refit_buffer = True
        if wait:
            self.wait_ready()

    def wait_ready(self) -> Policy:
        """Wait until every worker is built (and, with several, joined in one process group); read the parameter
        counts and the forward the workers chose. A worker whose constructor raised (a config it cannot serve) fails
        here, and the group is released. Returns ``self``; a second call returns at once."""
        if self._ready:
            return self
        name = self.name
        try:
            if len(self.group) > 1:
                address, port = get_with_context(self.group.run_rank0("rendezvous_address"), f"{name}: rendezvous")
                get_with_context(self.group.run_all("setup_distributed", address, port), f"{name}: process group")
            if name == "policy":
                inject("policy", "setup", self.group.workers)  # tests only (cluster.fault_injection); a no-op when unset
            counts = get_with_context(self.group.run_rank0("parameter_counts"), f"{name}: parameter counts")
            self.forward_description = get_with_context(self.group.run_rank0("describe_forward"), f"{name}: forward")
        except BaseException:
            self.group.kill()
            raise
        self.trainable_params, self.total_params = counts["trainable"], counts["total"]
        self.full_refit_elements = counts["full_refit_elements"]  # what a full (or merged) refit sends
        self._ready = True
        return self

    def get_logprobs_async(self, batch: Batch, reference: bool = False) -> list[ray.ObjectRef]:
        """Start a logprob pass sharded over the workers; pass the result to :meth:`gather_logprobs`.
        ``reference=True`` (LoRA): the base model's logprobs, adapters disabled."""
        return self.logprob_client.start(batch, reference=reference)

    def gather_logprobs(self, refs: list[ray.ObjectRef], what: str) -> torch.Tensor:
        """Wait for a logprob pass and stitch the shards back into one ``[B, S]`` tensor."""
        return self.logprob_client.gather(refs, what)

    @property
    def logprob_client(self) -> ShardedLogprobs:
        """The picklable handle for this model's logprob passes."""
        return ShardedLogprobs(tuple(self.group.workers), self.cfg.policy.dp_size, self.name)

    def take_logprob_passes(self) -> int:
        """Logprob forward passes the workers ran since the previous call (the reference's count for a step)."""
        return self._logprob_passes.take(self.forward_pass_counts()["logprobs"])

    def get_logprobs(self, batch: Batch) -> torch.Tensor:
        """``[B, S]`` logprobs of every sample under the current weights."""
        return self.gather_logprobs(self.get_logprobs_async(batch), "logprobs")

    def train(self, batch: Batch) -> TrainResult:
        """Train on a rollout batch: the planned ``rollout / train_global_batch_size`` optimizer steps
        (:func:`optimizer_step_shards`)."""
        dp = self.cfg.policy.dp_size
        per_rank_steps = optimizer_step_shards(batch, optimizer_steps_per_rollout(self.cfg), dp)
        tp = len(self.group) // dp  # the ranks of one tensor-parallel group see the same data
        per_worker = [per_rank_steps[r // tp] for r in range(len(self.group))]
        inject("policy", "train", self.group.workers)  # tests only (cluster.fault_injection); a no-op when unset
        all_results = get_with_context(self.group.run_sharded("train", per_worker), f"{self.name}: training")
        results = all_results[::tp]
        self.weight_version += 1
        metrics = self.loss_fn.combine_metrics([r["metrics"] for r in results])
        # The ranks' first-step rows are contiguous blocks of the first global batch, in rank order.
        # None when the first step was skipped (no token to train on: every rank skips it alike)
        firsts = [r["first_step_logprobs"] for r in results]
        first = torch.cat(firsts, dim=0) if per_rank_steps[0] and all(f is not None for f in firsts) else None
        # Summed over every worker, as forward_pass_counts() does.
        passes = sum(r["forward_passes"]["logprobs"] for r in all_results)
        since = self._prev_passes.take(passes)
        return TrainResult(
            metrics=metrics,
            grad_norms=results[0]["grad_norms"],
            lr=results[0]["lr"],
            nonfinite_steps_skipped=results[0]["nonfinite_steps_skipped"],
            empty_steps_skipped=results[0]["empty_steps_skipped"],
            first_step_logprobs=first,
            logprob_passes_since_last_update=since,
            forward_tokens=sum(r["forward_tokens"] for r in results),
            trained_tokens=sum(r["trained_tokens"] for r in results),
        )

    def save_checkpoint(self, directory: str) -> list[dict[str, Any]]:
        """Write weights and optimizer state into ``directory``; returns each rank's RNG state."""
        return get_with_context(self.group.run_all("save_checkpoint", directory), f"{self.name}: checkpoint save")

    def load_checkpoint(self, directory: str, rng_states: list[dict[str, Any]] | None) -> None:
        """Restore every rank from ``directory`` (RNG states per rank when they match the group size)."""
        per_rank = worker_rng_states(rng_states, len(self.group), directory)
        refs = [w.load_checkpoint.remote(directory, rng) for w, rng in zip(self.group.workers, per_rank)]
        versions = get_with_context(refs, f"{self.name}: checkpoint load")
        self.weight_version = versions[0]

    def state_dict_ref(self) -> ray.ObjectRef:
        """Object ref to ``(version, full state_dict)`` gathered on rank 0 (every rank takes part; tests and
        small models: a refit uses :meth:`weight_buckets`)."""
        return self.group.run_all("get_state_dict")[0]

    def weight_buckets(self, shared_memory: bool | None = None) -> WeightBuckets:
        """The weights for a refit: on a one-node CPU cluster without LoRA written into a shared-memory buffer the
        generation workers map (:class:`~nemo_like.models.refit.shared_memory.SharedWeights`); otherwise gathered into the
        object store, ``policy.refit_buffer_size_mb`` per bucket, for generation to stream: every weight, or with LoRA
        the adapters only or the merged weights (:attr:`refit_mode`). ``shared_memory`` forces one path (``None``: the
        automatic choice)."""
        if self.shared_memory_refit if shared_memory is None else shared_memory:
            refs = self.group.run_all("export_shared_weights", self._fresh_refit_buffer)
            self._fresh_refit_buffer = False
        else:
            refs = self.group.run_all("export_weight_buckets", self.cfg.policy.refit_buffer_size_mb, self.refit_mode)
        buckets = get_with_context(refs, f"{self.name}: weight export")[0]
        if isinstance(buckets, SharedMemoryRefused):  # /dev/shm too small: every later refit takes the object store
            print(f"[refit] {buckets.reason}; refits go through Ray's object store instead", file=sys.stderr, flush=True)
            self.shared_memory_refit = False
            return self.weight_buckets()
        self._refit_bytes += buckets.nbytes
        return buckets

    def take_refit_bytes(self) -> int:
        """Bytes exported for refits since the last call (``performance/refit_bytes`` of a step)."""
        taken, self._refit_bytes = self._refit_bytes, 0
        return taken

    def release_memory(self) -> list[dict[str, int]]:
        """Before a colocated engine wakes: every rank frees its gradients, moves its AdamW state to CPU
        (``policy.generation.colocated.offload_optimizer``) and empties the CUDA cache; per rank, what it released
        (:meth:`PolicyWorker.release_memory`)."""
        offload = self.cfg.policy.generation.colocated.offload_optimizer
        return get_with_context(self.group.run_all("release_memory", offload), f"{self.name}: release memory")

    def memory_footprints(self) -> list[dict[str, int]]:
        """Per rank, the bytes of parameters, gradients and optimizer state it holds."""
        return get_with_context(self.group.run_all("memory_footprint"), f"{self.name}: memory")

    def forward_pass_counts(self) -> dict[str, int]:
        """Forward passes by kind, summed over the workers."""
        return self.logprob_client.forward_pass_counts()

    def parameter_checksums(self) -> list[float]:
        """The full model's parameter checksum as each worker computes it (over its shards: identical on every rank)."""
        return get_with_context(self.group.run_all("parameter_checksum"), f"{self.name}: checksum")

    def shutdown(self) -> None:
        if self.trainable:
            # Unlink the refit buffer: milliseconds on a healthy worker; a hung one (a stalled run being aborted) is
            # given 5 s, not the run's exit. A worker that already died took nothing with it but its mapping.
            try:
                get_with_context(self.group.run_all("release_shared_weights"), f"{self.name}: release refit buffer", timeout_s=5)
            except Exception:  # noqa: BLE001 - cleanup on the way out must not hide the run's own error
                pass
        self.group.shutdown()


class AdapterDisabledReference:
    """The reference policy of a LoRA run: the policy's own base model with its adapters disabled, so no
    reference actors and no second copy of the weights. Reads like a reference :class:`Policy`."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.name = "reference (policy, adapters disabled)"
        self._passes = Increments()

    def get_logprobs_async(self, batch: Batch) -> list[ray.ObjectRef]:
        """Start the base model's logprob pass on the policy's workers."""
        return self.policy.get_logprobs_async(batch, reference=True)

    def gather_logprobs(self, refs: list[ray.ObjectRef], what: str) -> torch.Tensor:
        return self.policy.gather_logprobs(refs, what)

    def get_logprobs(self, batch: Batch) -> torch.Tensor:
        """``[B, S]`` logprobs of every sample under the base model."""
        return self.gather_logprobs(self.get_logprobs_async(batch), "reference logprobs")

    def forward_pass_counts(self) -> dict[str, int]:
        """The reference passes the policy's workers ran (under ``logprobs``, as a reference Policy reports them)."""
        return {"logprobs": self.policy.forward_pass_counts()["reference_logprobs"]}

    def take_logprob_passes(self) -> int:
        """Reference passes since the previous call."""
        return self._passes.take(self.forward_pass_counts()["logprobs"])

    def shutdown(self) -> None:
        """Nothing to release: the actors are the policy's."""
