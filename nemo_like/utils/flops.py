"""Model FLOPs utilisation (MFU) and per-worker token rates of one step (formulas: pure functions).

What is counted (``N`` = :func:`matmul_params`, the parameters that take part in a matrix multiply per
token: every parameter except the input embedding table, whose lookup is no matmul, plus the output
projection ``vocab x hidden`` when it is tied to that table; norms and biases are included, attention's
``seq x seq`` products are not):

* training: ``6 N`` per trained token (forward 2N + backward 4N: input and weight gradients), tokens =
  ``performance/num_trained_tokens`` (prompt + response of the optimizer steps that ran, no padding); with LoRA ``4 N + 6 N_lora`` (N_lora: the
  adapters' parameters; the frozen base gets no weight gradients: :func:`training_flops_per_token`); plus ``2 N_teacher`` per trained token with the KL term's teacher copy
  (``distillation.kl_weight > 0``: one teacher forward per training micro-batch);
* logprob passes: ``2 N`` per trained token for each of the prev and reference passes that ran
  (``performance/forward_passes/<kind> > 0``; an async run's reference passes: per token they scored since the
  previous step, ``performance/num_reference_tokens``), and ``2 N_i`` per token the ``i``-th teacher model scored
  (``performance/num_teacher_tokens/<i>``, ``teacher.models()`` order; ``N_i`` that teacher's own);
* generation: ``2 N`` per generated token (``performance/num_generated_tokens``: every token the engines decoded,
  those past a stop string's cut too; the prompt's prefill is not counted).

``performance/mfu`` = all of them / (step seconds without validation x peak FLOP/s per device x devices);
``performance/training_mfu`` = training FLOPs / (``policy_training`` seconds x peak x training devices);
``performance/generation_mfu`` = generation FLOPs / (generation seconds x peak x generation devices), with
the generation seconds of :func:`generation_seconds`.

Devices: on GPU, the policy ranks' GPUs, the reference ranks' (when a reference model is loaded), each teacher
model's ranks (when the teacher pass runs) and the generation engine's (none for a colocated vLLM engine or inline
sampling); on CPU a
device is one node with all its cores (every actor of a node shares them), so devices = training devices = the nodes the
policy ranks span (``RunPlan.policy_nodes``: as the thread split places them, with ``PACK`` as many as a node holds on
each, with ``SPREAD`` an even share of the run's nodes, the Ray cluster's CPU nodes).
Peak FLOP/s per device: ``cluster.peak_flops_per_device`` when set; else, on GPU, the dense peak of
:data:`GPU_PEAK_FLOPS` for the driver's GPU and the run's precision; on CPU, a matmul probe on the
driver's node with all its cores, measured once and cached (:func:`cpu_peak_flops`).
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_like.utils.cpus import local_cores
from nemo_like.utils.experts import active_share, experts_of, top_k
from nemo_like.utils.files import replace_file
from nemo_like.utils.text_path import text_path_parameters
from nemo_like.utils.throughput import TIMING_PREFIX, generation_seconds, rate, trained_tokens, training_seconds

# Dense (no sparsity) peak FLOP/s by GPU name fragment and precision (vendor data sheets; a bare name is the SXM part,
# the PCIe / NVL cards have lower clocks); float32 is plain FP32 (TF32 tensor cores are off by default in torch
# matmuls). The longest fragment in a device's name wins (gpu_peak_flops).
GPU_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "B200": {"bfloat16": 2.25e15, "float32": 8.0e13},
    "H200 NVL": {"bfloat16": 8.35e14, "float32": 6.0e13},
    "H200": {"bfloat16": 9.89e14, "float32": 6.7e13},
    "H100 NVL": {"bfloat16": 8.35e14, "float32": 6.0e13},
    "H100 PCIe": {"bfloat16": 7.56e14, "float32": 5.1e13},
    "H100": {"bfloat16": 9.89e14, "float32": 6.7e13},
    "A100": {"bfloat16": 3.12e14, "float32": 1.95e13},
    "L40S": {"bfloat16": 3.62e14, "float32": 9.16e13},
}

#: ``<prefix>/<i>``: the tokens (prompt + response) the ``i``-th teacher model (``teacher.models()`` order) scored in a step
TEACHER_TOKENS = "performance/num_teacher_tokens"
#: The tokens an async run's reference passes scored since the previous step (the collector scores each batch it
#: generates, ahead of the step that trains on it); absent in sync runs, whose reference pass scores the step's batch.
REFERENCE_TOKENS = "performance/num_reference_tokens"


PROBE_SIZE = 1024
CACHE_FILE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nemo_like" / "cpu_peak_flops.json"


@dataclass(frozen=True)
class FlopsSpec:
    """What turns a step's token counts into FLOPs and utilisation (fixed for a run)."""

    matmul_params: int
    peak_flops_per_device: float | None  # None: unknown, MFU not logged
    devices: int
    training_devices: int
    generation_devices: int
    training_workers: int
    generation_workers: int
    peak_source: str = "cluster.peak_flops_per_device"
    teacher_matmul_params: tuple[int, ...] = ()  # N of each teacher model whose logprob pass runs (teacher.models() order)
    kl_teacher_matmul_params: int = 0  # N of the KL term's teacher copy in the policy ranks (0: no KL term)
    lora_params: int | None = None  # the LoRA adapters' parameters (None: full training)

    def describe(self) -> str:
        """One line for the start-up log."""
        peak = f"{self.peak_flops_per_device:.3g} FLOP/s per device ({self.peak_source})" if self.peak_flops_per_device else "unknown"
        return f"MFU: N={self.matmul_params:,} matmul parameters, {self.devices} device(s), peak {peak}"


def matmul_params(config: Any) -> int:
    """``N`` of the module docstring for an HF model config (built on the meta device, nothing loaded): a multimodal
    model's text path (:func:`~nemo_like.utils.text_path.text_path_parameters`); a mixture-of-experts model's routed
    experts count at the share a token runs through (:func:`~nemo_like.utils.experts.active_share`)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    reached = text_path_parameters(model)  # a multimodal model's vision tower never runs in a text run
    total = sum(p.numel() for p in model.parameters() if reached is None or id(p) in reached)  # tied: counted once
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is embedding
    routed, experts = experts_of(model)
    total += active_share(routed, experts, top_k(config)) - routed
    return total if tied else total - embedding.numel()


def training_flops_per_token(n: int, lora_params: int | None = None) -> float:
    """FLOPs of one trained token of a model of ``n`` matmul parameters: ``6 N`` (forward 2N, backward 4N: input
    and weight gradients); with LoRA (``lora_params``: the adapters' parameters, all matmul) the frozen base gets no
    weight gradients: forward and input gradients ``2 (N + N_lora)`` each, weight gradients ``2 N_lora``. Shared by
    the run's ``training_mfu`` and the planner's step time."""
    if lora_params is None:
        return 6.0 * n
    return 4.0 * n + 6.0 * lora_params


def step_flops(
    metrics: Mapping[str, float], n: int, teachers: Sequence[int] = (), kl_teacher: int = 0, lora_params: int | None = None
) -> dict[str, float]:
    """``{"training": ..., "logprobs": ..., "generation": ...}`` FLOPs of one step (module docstring); ``teachers``:
    each teacher model's N (``teacher.models()`` order), ``kl_teacher``: the KL term's teacher copy's (0: none),
    ``lora_params``: the LoRA adapters' parameters (None: full training)."""
    tokens = float(metrics.get("performance/num_batch_tokens", 0.0))

    def pass_tokens(kind: str) -> float:  # the tokens a logprob pass scored this step (0: it did not run)
        if kind == "reference_logprobs" and REFERENCE_TOKENS in metrics:
            return float(metrics[REFERENCE_TOKENS])
        return tokens if metrics.get(f"performance/forward_passes/{kind}", 0.0) > 0 else 0.0

    scored = sum(2.0 * t * float(metrics.get(f"{TEACHER_TOKENS}/{i}", 0.0)) for i, t in enumerate(teachers))
    return {
        "training": (training_flops_per_token(n, lora_params) + 2.0 * kl_teacher) * trained_tokens(metrics),
        "logprobs": 2.0 * n * (pass_tokens("prev_logprobs") + pass_tokens("reference_logprobs")) + scored,
        "generation": 2.0 * n * float(metrics.get("performance/num_generated_tokens", 0.0)),
    }


def flops_metrics(metrics: Mapping[str, float], spec: FlopsSpec) -> dict[str, float]:
    """Per-worker token rates, FLOPs and (when the peak is known) MFU of one step; rates over zero seconds are 0.0."""
    flops = step_flops(metrics, spec.matmul_params, spec.teacher_matmul_params, spec.kl_teacher_matmul_params, spec.lora_params)
    train_s = float(metrics.get(f"{TIMING_PREFIX}policy_training", 0.0))
    gen_s = generation_seconds(metrics)
    work_s = training_seconds(metrics)  # a validation pass's generation is in no FLOP count
    tokens = float(metrics.get("performance/num_batch_tokens", 0.0))
    out = {
        "performance/training_tokens_per_sec_per_worker": rate(trained_tokens(metrics), train_s) / spec.training_workers,
        "performance/generation_tokens_per_sec_per_worker": rate(float(metrics.get("performance/num_generated_tokens", 0.0)), gen_s)
        / spec.generation_workers,
        "performance/tokens_per_sec_per_device": rate(tokens, work_s) / spec.devices,
        "performance/model_flops": sum(flops.values()),
    }
    peak = spec.peak_flops_per_device
    if peak:
        out["performance/mfu"] = rate(sum(flops.values()), work_s * peak * spec.devices)
        out["performance/training_mfu"] = rate(flops["training"], train_s * peak * spec.training_devices)
        out["performance/generation_mfu"] = rate(flops["generation"], gen_s * peak * spec.generation_devices)
    return out


def measure_matmul_flops(dtype: str = "float32", size: int = PROBE_SIZE, seconds: float = 0.5, threads: int | None = None) -> float:
    """Best FLOP/s of ``size x size`` matmuls in ``dtype`` over about ``seconds`` (``threads``: torch threads, default
    all cores), through :func:`~nemo_like.utils.cpu_linear.linear`: the GEMM our passes run (for float32 oneDNN on an AMD CPU, 1.1-2x
    torch's BLAS there; torch's BLAS elsewhere: :func:`~nemo_like.utils.cpu_linear.onednn_beats_blas`), so a floor or
    an MFU is measured against what the code can reach."""
    import torch

    from nemo_like.utils.cpu_linear import linear

    before = torch.get_num_threads()
    torch.set_num_threads(threads or local_cores())
    try:
        a = torch.randn(size, size, dtype=getattr(torch, dtype))
        b = torch.randn(size, size, dtype=getattr(torch, dtype))
        linear(a, b)  # warm-up (a @ b.T: the same 2 * size^3 FLOPs as a @ b)
        best, deadline = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            linear(a, b)
            best = max(best, 2.0 * size**3 / (time.perf_counter() - start))
        return best
    finally:
        torch.set_num_threads(before)


def cpu_key(dtype: str) -> str:
    """Cache key of a CPU probe: CPU model, cores, torch version and dtype."""
    import torch

    from nemo_like.utils.cpu_linear import onednn_beats_blas
    from nemo_like.utils.cpus import cpuinfo_field

    model = cpuinfo_field("model name") or platform.processor() or platform.machine()
    gemm = "onednn" if dtype == "float32" and onednn_beats_blas() else "blas"  # the GEMM linear() runs a square product on
    return f"{model}|{local_cores()} cores|torch {torch.__version__}|{dtype}|{gemm}"


def cpu_peak_flops(dtype: str = "float32", cache: Path = CACHE_FILE) -> float:
    """This node's matmul FLOP/s in ``dtype`` with all cores: :func:`measure_matmul_flops`, cached in ``cache``
    per :func:`cpu_key`.

    A probe taken while the machine was busy (1-minute load average above half its cores) measures the
    share of the CPU it got, not the peak: such an entry is provisional (it records that load), and a later run
    on a less loaded machine probes again and keeps the best figure, until a probe on a quiet machine makes it
    final (delete the file to start over). Runs at the same load or busier reuse the entry without probing.
    """
    key = cpu_key(dtype)
    try:
        cached = json.loads(cache.read_text())
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(key)
    if isinstance(entry, (int, float)):  # a final figure (also the format before provisional entries)
        return float(entry)

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    earlier = entry.get("flops") if isinstance(entry, dict) else None  # anything else (a hand-edited file): measure anew
    earlier = float(earlier) if isinstance(earlier, (int, float)) else 0.0
    earlier_load = entry.get("load") if isinstance(entry, dict) else None
    if earlier > 0 and isinstance(earlier_load, (int, float)) and load >= earlier_load:
        return earlier  # no quieter than at the provisional probe: a new one would read no higher
    best = max(measure_matmul_flops(dtype), earlier)
    busy = {"flops": best, "load": round(load, 2), "provisional": f"measured at load {load:.1f}"}
    kept = store_cache_entry(cache, key, best if load <= local_cores() / 2 else busy)
    return float(kept) if isinstance(kept, (int, float)) else float(kept["flops"])  # another run's better probe, if any


def store_cache_entry(cache: Path, key: str, entry: Any) -> Any:
    """Set ``key`` in the JSON file ``cache`` to the better of ``entry`` and what it holds there
    (:func:`better_entry`), keeping the other keys: read again under an exclusive lock (a ``.lock`` file beside the
    real file) and replaced in one rename, so that runs probing at once (a sweep) neither lose each other's entries,
    nor store a busy probe over a quiet one, nor read a half-written file (read as empty, which dropped every other
    entry at the next write). Returns the entry kept. A filesystem without locks still gets the one-rename write; a
    read-only home is not an error (``entry`` is returned): the next run measures again."""
    try:
        target = Path(os.path.realpath(cache))
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.with_name(target.name + ".lock"), "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
            except OSError:
                pass  # no locks here (NFS without lockd): the replace below is still atomic
            try:
                cached = json.loads(target.read_text())
            except (OSError, ValueError):
                cached = {}
            cached = cached if isinstance(cached, dict) else {}
            kept = better_entry(cached.get(key), entry)
            replace_file(target, json.dumps({**cached, key: kept}, indent=1))
            return kept
    except OSError:
        return entry


def better_entry(old: Any, new: Any) -> Any:
    """The entry to keep of two probes of one key: a final figure (a number) over a provisional one (a mapping with
    ``flops``), and the higher of two of a kind (a probe reads low, never high); anything else in the file yields."""

    def rank(entry: Any) -> tuple[int, float]:
        if isinstance(entry, (int, float)):
            return (2, float(entry))
        flops = entry.get("flops") if isinstance(entry, dict) else None
        return (1, float(flops)) if isinstance(flops, (int, float)) else (0, 0.0)

    return old if rank(old) > rank(new) else new


def gpu_peak_flops(device_name: str, precision: str) -> float | None:
    """Dense peak of :data:`GPU_PEAK_FLOPS` for a device name (e.g. ``NVIDIA H100 80GB HBM3``; the longest matching
    fragment: ``NVIDIA H100 PCIe`` is not the SXM part), or None if unknown."""
    matches = [fragment for fragment in GPU_PEAK_FLOPS if fragment in device_name]
    return GPU_PEAK_FLOPS[max(matches, key=len)].get(precision) if matches else None


def flops_spec(cfg: Any, model_path: str, plan: Any, teacher_paths: Sequence[str] = (), lora_params: int | None = None) -> FlopsSpec:
    """The run's :class:`FlopsSpec` for its :class:`~nemo_like.plan.run_plan.RunPlan` ``plan`` (which roles start,
    which engine) (reads the config of the model at ``model_path``, the policy's resolved ``model_name``, and of each
    teacher model at ``teacher_paths``, ``teacher.models()`` resolved, when a teacher pass or the KL term runs; may run
    the CPU probe once); ``lora_params``: the policy's LoRA adapters' parameters (None: full training)."""
    from transformers import AutoConfig

    pc = cfg.policy
    ranks = pc.dp_size * pc.dtensor_cfg.tensor_parallel_size
    peak, source = cfg.cluster.peak_flops_per_device, "cluster.peak_flops_per_device"
    if cfg.cluster.gpus_per_node:
        # An engine on a GPU of its own: HF, or vLLM not colocated (inline samples on the policy's own GPU).
        own_engine = plan.backend.value == "hf" or (plan.backend.value == "vllm" and not pc.generation.colocated.enabled)
        devices, training, generation = ranks + frozen_ranks(cfg, plan.logprobs) + int(own_engine), ranks, 1
        if peak is None:
            import torch

            name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU on the driver"
            peak, source = gpu_peak_flops(name, pc.precision), f"table: {name}, {pc.precision}"
    else:
        devices, training, generation = plan.policy_nodes, plan.policy_nodes, 1  # a device is a node
        if peak is None:
            peak, source = cpu_peak_flops(pc.precision), f"CPU matmul probe, cached in {CACHE_FILE}"
    n = matmul_params(AutoConfig.from_pretrained(model_path))
    teachers = tuple(matmul_params(AutoConfig.from_pretrained(path)) for path in teacher_paths)
    kl_teacher = teachers[0] if cfg.distillation.kl_weight > 0 and teachers else 0  # teacher.model_name, first of the models
    return FlopsSpec(
        n,
        peak,
        devices,
        training,
        generation,
        training_workers=ranks,
        generation_workers=1,
        peak_source=source,
        teacher_matmul_params=teachers if plan.logprobs.compute_teacher else (),
        kl_teacher_matmul_params=kl_teacher,
        lora_params=lora_params,
    )


def frozen_ranks(cfg: Any, logprobs: Any) -> int:
    """Devices of the frozen models a run starts, each sharded like the policy over ``dp_size x tensor_parallel_size``
    ranks: the reference (when loaded: not with LoRA) and each teacher model (when the teacher pass runs)."""
    ranks = cfg.policy.dp_size * cfg.policy.dtensor_cfg.tensor_parallel_size
    models = int(logprobs.load_reference_model) + (len(cfg.teacher.models()) if logprobs.compute_teacher else 0)
    return ranks * models
