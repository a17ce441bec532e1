"""Tier B: the pinned stack (CUDA torch 2.13, vllm 0.32.0, ray 2.60) and the project's own classes, on one GPU.

One private Ray cluster; ``Policy`` (dp 1, bf16, no KL) and a colocated ``VLLMGeneration`` (gpu_memory_utilization 0.4,
sleep mode) start in B1 and serve B2-B6 and B9. B7 starts two more engines on the same GPU (the 151936-vocab model),
B8 runs ``nemo-like train`` in a subprocess (its own Ray cluster, same GPU), B9 re-initialises B1's engine last (a
crash there cannot spoil the others).

Memory of the engine is measured inside the policy's actor (which holds a CUDA context anyway): the device's used
memory (``torch.cuda.mem_get_info``) minus what the policy's caching allocator reserves. That difference moves with
the engine (and nothing else), so it is comparable across the policy's training steps.

The driver builds the random models on the GPU (then empties its cache: it keeps only its CUDA context, a constant in
every memory figure) and never imports vLLM (only the engine actors do).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

from checklib import REPO, Check, Context, Figures, NotRun
from models import QWEN25_VOCAB, cached_model

GIB = 2**30
PINS = ("torch==2.13.0", "vllm==0.32.0", "ray==2.60.0")
BASE = (
    "models",
    "nemo_like.config",
    "nemo_like.distributed.ray_init",
    "nemo_like.distributed.worker_group",
    "ray",
)  # ray last: a chain names who needs it
POLICY = (
    "nemo_like.models.policy.policy",
    "nemo_like.algorithms.loss_functions",
    "nemo_like.algorithms.setup",
    "nemo_like.algorithms.grpo",
)
GEN = (
    "nemo_like.models.generation.vllm",
    "nemo_like.models.generation.interface",
    "nemo_like.data.collate",
    "nemo_like.algorithms.metrics",
)
RECIPE = REPO / "examples" / "configs" / "grpo_tiny_cpu.yaml"
ENGINE_UTILIZATION = 0.4
PROMPT_BUDGET = 48
B8_TIMEOUT_S = 200.0


# What the Makefile exports; set before anything imports Ray (the runner imports a check's modules before running it).
for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}.items():
    os.environ.setdefault(_key, _value)


def gpu_overrides(model_dir: str, log_dir: str) -> list[str]:
    """The tiny recipe on one GPU: the random 0.5B-shape model, bf16, vLLM colocated, no KL (one GPU: the reference
    would need its own, review U9), room for B6's 512-token responses."""
    return [
        f"policy.model_name={model_dir}",
        "policy.precision=bfloat16",
        "policy.dp_size=1",
        "policy.train_micro_batch_size=16",
        "policy.logprob_batch_size=64",
        f"policy.max_total_sequence_length={PROMPT_BUDGET + 512}",
        "policy.num_cpus_per_worker=1",
        "policy.optimizer.lr=1e-3",
        "policy.generation.backend=vllm",
        "policy.generation.max_new_tokens=128",
        "policy.generation.colocated.enabled=true",
        f"policy.generation.vllm_cfg.gpu_memory_utilization={ENGINE_UTILIZATION}",
        "policy.generation.vllm_cfg.enforce_eager=true",
        "loss_fn.reference_policy_kl_penalty=0",
        "data.train.num_problems=2048",
        "cluster.gpus_per_node=1",
        "cluster.object_store_memory_mb=4096",
        f"logger.log_dir={log_dir}",
        "logger.progress_bar=false",
    ]


def engine_config(cfg):
    """``cfg`` with in-flight weight updates, so the engine actor runs with ``max_concurrency`` 2 (a refit can reach it
    while it generates, B6). Only the engine's construction reads it (``interface.actor_concurrency``); a copy, not
    re-validated: the check does not depend on whether the schema accepts async with a colocated engine."""
    copy = cfg.model_copy(deep=True)
    copy.grpo.async_grpo.enabled = True
    copy.grpo.async_grpo.in_flight_weight_updates = True
    return copy


# -- helpers that run inside actors (pickled by value: actors cannot import this module) ---------------------
def _memory_probe(worker: Any) -> dict[str, int]:
    import torch

    free, total = torch.cuda.mem_get_info()
    return {"used": total - free, "total": total, "reserved": torch.cuda.memory_reserved(), "allocated": torch.cuda.memory_allocated()}


def _timed_generate(worker: Any, prompts: list[list[int]], params: dict, seed: int) -> dict[str, float]:
    """The engine's generate loop alone: woken first, put back to sleep after, neither timed."""
    worker._wake_up()
    colocated, worker.colocated = worker.colocated, False
    try:
        start = time.perf_counter()
        samples = worker.generate(prompts, params, seed)
        seconds = time.perf_counter() - start
    finally:
        worker.colocated = colocated
        worker._sleep()
    lengths = [len(s["response_ids"]) for s in samples]
    return {
        "seconds": seconds,
        "tokens": sum(lengths),
        "full": sum(n == params["max_new_tokens"] for n in lengths),
        "samples": len(samples),
    }


class Session:
    """What B1 starts and the later checks use."""

    def __init__(self, ctx: Context, extra_overrides: tuple[str, ...] = ()) -> None:
        import contextlib

        from ray import cloudpickle

        from nemo_like.config import load_config
        from nemo_like.data.prompts import build_prompt_dataset
        from nemo_like.distributed.ray_init import init_ray
        from nemo_like.distributed.worker_group import reuse_actors
        from nemo_like.models.loading import end_of_sequence_ids, load_tokenizer

        cloudpickle.register_pickle_by_value(sys.modules[__name__])
        self.model_dir = cached_model(ctx, "0.5B")
        self.log_dir = str(ctx.workdir / "logs")
        self.overrides = [*gpu_overrides(self.model_dir, self.log_dir), *extra_overrides]
        self.cfg = load_config(RECIPE, self.overrides, warn=False)
        self.tok = load_tokenizer(self.model_dir)
        self.pad = self.tok.pad_token_id
        self.eos = end_of_sequence_ids(self.tok, self.model_dir)
        records = build_prompt_dataset(self.cfg.data, self.tok, "train", PROMPT_BUDGET)
        self.prompts = [r.prompt_token_ids for r in records]
        self.stack = contextlib.ExitStack()
        init_ray(self.cfg.cluster)
        self.stack.enter_context(reuse_actors())  # B9 takes the kept engine back
        self.policy: Any = None
        self.gen: Any = None

    def memory(self) -> dict[str, float]:
        """Device-level used memory and the policy's reserved memory (GiB), and the engine's share ``engine``."""
        import ray

        m = ray.get(self.policy.group.workers[0].__ray_call__.remote(_memory_probe))
        return {
            "used": m["used"] / GIB,
            "policy_reserved": m["reserved"] / GIB,
            "engine": (m["used"] - m["reserved"]) / GIB,
            "total": m["total"] / GIB,
        }

    def close(self) -> None:
        import ray

        for obj in (self.gen, self.policy):
            if obj is not None:
                try:
                    obj.shutdown()
                except Exception as exc:  # noqa: BLE001 - closing down after a failure
                    print(f"#   shutdown: {type(exc).__name__}: {exc}", file=sys.stderr)
        self.stack.close()  # kills the kept actors
        ray.shutdown()


def session(ctx: Context) -> Session:
    return ctx.need("session", "B1")


def gen_kl(s: Session, samples: list) -> dict[str, float]:
    """``gen_kl`` as the run logs it (``algorithms.metrics.divergence_metric_fragments``: k3 of the policy's logprobs
    against the engine's sampled logprobs, over the response tokens), and the mean / max |Δ logprob|."""
    from nemo_like.algorithms.metrics import divergence_metric_fragments
    from nemo_like.data.collate import collate_samples

    batch = collate_samples(samples, s.pad)
    train = s.policy.get_logprobs(batch)
    mask = batch["token_mask"] * batch["sample_mask"][:, None]
    frags = divergence_metric_fragments(
        train, batch["generation_logprobs"], batch["token_mask"], batch["sample_mask"], mask.sum(), batch["sample_mask"].sum()
    )
    diff = (train - batch["generation_logprobs"])[mask > 0].abs()
    return {"gen_kl": float(frags["gen_kl"]), "mean_dlp": float(diff.mean()), "max_dlp": float(diff.max())}


def train_batch(samples: list, pad: int, seed: int) -> dict:
    import torch

    from nemo_like.data.collate import collate_samples

    batch = collate_samples(samples, pad)
    g = torch.Generator().manual_seed(seed)
    batch["advantages"] = torch.randn(len(samples), 1, generator=g) * batch["token_mask"]
    return batch


def params(tokens: int):
    from nemo_like.models.generation.interface import SamplingParams

    return SamplingParams(max_new_tokens=tokens, temperature=1.0)


def refit(s: Session) -> float:
    """The training loop's refit (``grpo.refit_if_stale``: a colocated engine's policy first releases its memory, then
    generation gets the policy's exporter, which the GPU transports never call); returns its seconds."""
    from types import SimpleNamespace

    from nemo_like.algorithms.grpo import refit_if_stale

    return refit_if_stale(SimpleNamespace(policy=s.policy, generation=s.gen))


def sample_figures(fig: Figures, samples: list, tokens: int, p: str = "") -> None:
    lengths = [len(x.response_ids) for x in samples]
    fig[p + "samples"] = len(samples)
    fig[p + "full_length_frac"] = sum(n == tokens for n in lengths) / max(len(lengths), 1)
    finite = all(math.isfinite(v) for x in samples for v in x.response_logprobs)
    fig[p + "logprobs_finite"] = finite
    fig.expect(p + "logprobs_finite", "==", True)
    if min(lengths, default=0) < 1:
        fig.fail(f"{p}an empty response")


# -- B1 ------------------------------------------------------------------------------------------
def b1_bring_up(ctx: Context, fig: Figures) -> None:
    import ray

    from nemo_like.algorithms.loss_functions import ClippedPGLossFn
    from nemo_like.distributed.planning import plan_on_cluster
    from nemo_like.models.generation.vllm import VLLMGeneration
    from nemo_like.models.policy.policy import Policy

    start = time.perf_counter()
    s = Session(ctx)
    ctx.state["session"] = s
    ctx.cleanups.append(s.close)
    s.policy = Policy(s.cfg, loss_fn=ClippedPGLossFn(s.cfg.loss_fn))
    fig["policy_up_s"] = time.perf_counter() - start
    m0 = s.memory()
    fig["gpu_total_gib"] = m0["total"]
    fig["used_before_engine_gib"] = m0["used"]
    start = time.perf_counter()
    s.gen = VLLMGeneration(engine_config(s.cfg), s.pad, s.eos, plan_on_cluster(engine_config(s.cfg)).threads.generation, policy=s.policy)
    engine_uuid = ray.get(s.gen.group.run_rank0("device_uuid"))
    fig["engine_up_s"] = time.perf_counter() - start
    policy_uuid = ray.get(s.policy.group.run_rank0("device_info"))["uuid"]
    fig["same_gpu"] = str(engine_uuid) == str(policy_uuid)
    fig.expect("same_gpu", "==", True, f"engine {engine_uuid}, policy {policy_uuid}")
    m1 = s.memory()
    fig["used_awake_gib"] = m1["used"]
    fig["engine_awake_gib"] = m1["engine"] - m0["engine"]
    fig.expect("engine_awake_gib", ">=", 0.5 * ENGINE_UTILIZATION * m0["total"], "the engine took its share of the GPU")
    ctx.state["mem0"], ctx.state["mem1"] = m0, m1


# -- B2 ------------------------------------------------------------------------------------------
def b2_generate_and_sleep(ctx: Context, fig: Figures) -> None:
    s = session(ctx)
    prompts = s.prompts[:256]
    start = time.perf_counter()
    samples = s.gen.generate(prompts, params(128), seed=1)
    fig["generate_s"] = time.perf_counter() - start
    sample_figures(fig, samples, 128)
    fig.expect("samples", "==", len(prompts))
    fig["tok_s"] = sum(len(x.response_ids) for x in samples) / fig["generate_s"]
    m0, m1, m2 = ctx.state["mem0"], ctx.state["mem1"], s.memory()
    fig["used_asleep_gib"] = m2["used"]
    fig["released_frac"] = (m1["engine"] - m2["engine"]) / max(m1["engine"] - m0["engine"], 1e-9)
    fig.expect("released_frac", ">=", 0.8, "sleep(level=1) frees the KV cache and offloads the weights")
    ctx.state["mem2"] = m2
    ctx.state["samples_v0"] = samples


# -- B3 ------------------------------------------------------------------------------------------
def b3_gen_kl_baseline(ctx: Context, fig: Figures) -> None:
    s = session(ctx)
    samples = ctx.need("samples_v0", "B2")
    fig.update(gen_kl(s, samples))
    fig.expect("gen_kl", "<=", 1e-3)
    fig.expect("mean_dlp", "<=", 2e-2)


# -- B4 ------------------------------------------------------------------------------------------
def b4_ipc_refit(ctx: Context, fig: Figures) -> None:
    s = session(ctx)
    samples = ctx.need("samples_v0", "B2")[:64]
    fig["transport"] = s.gen.transport
    fig.expect("transport", "==", "cuda_ipc", "a colocated engine with one policy rank refits through CUDA-IPC")
    start = time.perf_counter()
    result = s.policy.train(train_batch(samples, s.pad, seed=4))
    fig["train_s"] = time.perf_counter() - start
    fig["loss"], fig["grad_norm"] = float(result.metrics["loss"]), float(result.grad_norms[0])
    version = s.policy.weight_version
    # Control first: without a refit the engine samples from the old weights, and gen_kl must show it.
    stale = s.gen.generate(s.prompts[:64], params(64), seed=2)
    fig["stale_gen_kl"] = gen_kl(s, stale)["gen_kl"]
    fig.expect("stale_gen_kl", ">=", 1e-2, "blind: a missed refit would not show")
    fig["refit_s"] = refit(s)
    fig["engine_version"] = s.gen.weight_version
    fig.expect("engine_version", "==", version)
    fig.expect("refit_s", "<", 5.0)
    fresh = s.gen.generate(s.prompts[:64], params(64), seed=3)
    fig["versions_match"] = all(x.weight_version == version for x in fresh)
    fig.expect("versions_match", "==", True)
    after = gen_kl(s, fresh)
    fig["gen_kl"], fig["mean_dlp"] = after["gen_kl"], after["mean_dlp"]
    fig.expect("gen_kl", "<=", 1e-3)
    ctx.state["refitted"] = True


# -- B5 ------------------------------------------------------------------------------------------
def b5_cycles(ctx: Context, fig: Figures) -> None:
    s = session(ctx)
    ctx.need("refitted", "B4")
    base = ctx.need("mem2", "B2")["engine"]
    drift, kls, refits, reserved, trained, train_rates = [], [], [], [], [], []
    for cycle in range(3):
        samples = s.gen.generate(s.prompts[64 * cycle : 64 * (cycle + 1)], params(64), seed=10 + cycle)
        drift.append(s.memory()["engine"] - base)
        kls.append(gen_kl(s, samples)["gen_kl"])
        batch = train_batch(samples, s.pad, seed=20 + cycle)
        start = time.perf_counter()
        s.policy.train(batch)
        train_rates.append(float(batch["attention_mask"].sum()) / (time.perf_counter() - start))
        trained.append(s.memory()["policy_reserved"])
        refits.append(refit(s))  # releases the policy's gradients, cache and (offload_optimizer) AdamW state first
        reserved.append(s.memory()["policy_reserved"])
    fig["asleep_drift_gib"] = max(drift, key=abs)
    fig["max_gen_kl"] = max(kls)
    fig["max_refit_s"] = max(refits)
    fig["policy_reserved_trained_gib"] = max(trained)
    fig["policy_reserved_released_gib"] = max(reserved)
    fig["train_tok_s"] = sum(train_rates) / len(train_rates)
    fig["_per_cycle"] = {
        "asleep_drift_gib": drift, "gen_kl": kls, "refit_s": refits, "policy_reserved_after_train_gib": trained,
        "policy_reserved_after_release_gib": reserved,
    }  # fmt: skip
    fig.expect("asleep_drift_gib", "<=", 1.0, "the asleep engine's memory stays flat")
    if min(drift) < -1.0:
        fig.fail(f"asleep memory fell by {-min(drift):.2f} GiB below B2's")
    fig.expect("max_gen_kl", "<=", 1e-3)
    fig.expect("max_refit_s", "<", 5.0)


# -- B6 ------------------------------------------------------------------------------------------
def b6_in_flight_refit(ctx: Context, fig: Figures) -> None:
    import ray

    s = session(ctx)
    ctx.need("refitted", "B4")
    before = s.gen.mid_generation_updates()
    old = s.gen.weight_version
    samples = s.gen.generate(s.prompts[:64], params(64), seed=30)
    s.policy.train(train_batch(samples, s.pad, seed=31))  # the policy moves on; the engine still has `old`
    new = s.policy.weight_version
    start = time.perf_counter()
    running = s.gen.group.workers[0].generate.remote(s.prompts[:512], asdict(params(512)), 32)
    time.sleep(2.0)  # well inside a 512 x 512-token generate
    s.gen.refit(s.policy.weight_buckets, new)  # as AsyncRollouts.refit does in flight
    fig["refit_at_s"] = time.perf_counter() - start
    raw = ray.get(running)
    fig["generate_s"] = time.perf_counter() - start
    fig["mid_generation_updates"] = s.gen.mid_generation_updates() - before
    fig.expect("mid_generation_updates", ">=", 1, "the refit landed between engine steps")
    swapped = [x for x in raw if x["weight_version"] == old and x["final_weight_version"] == new]
    fig["swapped_samples"] = len(swapped)
    fig.expect("swapped_samples", ">=", 1, "samples running across the swap carry the new final_weight_version")
    # Prompts repeat: the prefix cache held old-weight blocks, reset at the next generate call.
    after = s.gen.generate(s.prompts[:64], params(32), seed=33)
    fig["gen_kl_after"] = gen_kl(s, after)["gen_kl"]
    fig.expect("gen_kl_after", "<=", 1e-3, "the next generate uses the new weights only (prefix cache reset)")


# -- B7 ------------------------------------------------------------------------------------------
def b7_throughput(ctx: Context, fig: Figures) -> None:
    import ray

    from nemo_like.config import load_config
    from nemo_like.distributed.planning import plan_on_cluster
    from nemo_like.models.generation.vllm import VLLMGeneration

    s = session(ctx)
    big = cached_model(ctx, "0.5B", vocab_size=QWEN25_VOCAB, save_dtype="bfloat16")
    prompts = (s.prompts * 2)[:1024]
    rates = {}
    for eager in (True, False):
        tag = "eager" if eager else "graphs"
        overrides = [*gpu_overrides(big, s.log_dir), f"policy.generation.vllm_cfg.enforce_eager={str(eager).lower()}",
                     f"policy.max_total_sequence_length={PROMPT_BUDGET + 256}"]  # fmt: skip
        cfg = load_config(RECIPE, overrides, warn=False)
        start = time.perf_counter()
        gen = VLLMGeneration(cfg, s.pad, s.eos, plan_on_cluster(cfg).threads.generation, policy=s.policy, name=f"b7-{tag}")
        try:
            worker = gen.group.workers[0]
            ray.get(worker.__ray_call__.remote(_timed_generate, prompts[:32], asdict(params(16)), 0))  # warm-up
            fig[f"{tag}_up_s"] = time.perf_counter() - start
            out = ray.get(worker.__ray_call__.remote(_timed_generate, prompts, asdict(params(256)), 1))
        finally:
            gen.group.kill()  # not kept for reuse: its memory goes back now
        rates[tag] = out["tokens"] / out["seconds"]
        fig[f"{tag}_tok_s"] = rates[tag]
        fig[f"{tag}_full_length_frac"] = out["full"] / out["samples"]
    fig["graphs_speedup"] = rates["graphs"] / rates["eager"]
    for tag in rates:
        fig.expect(f"{tag}_tok_s", ">=", 5000.0, "below this a slow path is in use")
        fig.warn(f"{tag}_tok_s", ">=", 20000.0)
    fig.expect("graphs_speedup", ">=", 1.3, "CUDA graphs should beat eager decode of a 0.5B model")


# -- B8 ------------------------------------------------------------------------------------------
def b8_train_end_to_end(ctx: Context, fig: Figures) -> None:
    import json

    s = session(ctx)
    log_dir = ctx.workdir / "b8_logs"
    overrides = [
        *gpu_overrides(s.model_dir, str(log_dir)),
        "policy.optimizer.lr=1e-6",
        "policy.generation.max_new_tokens=32",
        "policy.max_total_sequence_length=96",
        "policy.generation.vllm_cfg.gpu_memory_utilization=0.3",
        "grpo.max_num_steps=2",
        "grpo.val_period=0",
        "grpo.val_at_start=false",
        "grpo.val_at_end=false",
        "data.train.num_problems=256",
        "logger.plot_at_end=false",
        "logger.tensorboard_enabled=false",
    ]
    command = [sys.executable, "-m", "nemo_like.cli", "train", "--config", str(RECIPE), *overrides]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own private cluster, not ours
    limit = max(30.0, min(ctx.deadline - time.monotonic(), B8_TIMEOUT_S))
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output = ""
    try:
        output, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        fig.fail(f"nemo-like train did not finish within {limit:.0f} s")
    finally:
        if proc.poll() is None:
            output += stop_process_group(proc)
    fig["seconds"] = time.perf_counter() - start
    fig["exit"] = proc.returncode
    fig["_output_tail"] = output.splitlines()[-40:]
    fig.expect("exit", "==", 0)
    path = log_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    steps = [r for r in records if "train/gen_kl" in r]
    fig["steps"] = len(steps)
    fig.expect("steps", "==", 2)
    if steps:
        fig["max_gen_kl"] = max(float(r["train/gen_kl"]) for r in steps)
        fig.expect("max_gen_kl", "<=", 1e-3)
        bad = sorted({k for r in steps for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)})
        fig["nonfinite_metrics"] = len(bad)
        fig.expect("nonfinite_metrics", "==", 0, ", ".join(bad[:5]))
        rates = [r.get("performance/generation_tokens_per_sec") for r in steps]
        fig["generation_tok_s"] = rates[-1] if rates[-1] is not None else "missing"
        if any(r is None for r in rates):
            fig.fail("performance/generation_tokens_per_sec not logged")
    if proc.returncode != 0:
        print("\n".join(fig["_output_tail"]), file=sys.stderr)


def stop_process_group(proc: subprocess.Popen) -> str:
    """SIGTERM to the run's process group (its own shutdown stops its Ray cluster), SIGKILL 30 s later."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.communicate(timeout=30)[0] or ""
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()[0] or ""


# -- B9 ------------------------------------------------------------------------------------------
def b9_reused_engine(ctx: Context, fig: Figures) -> None:
    from nemo_like.distributed.planning import plan_on_cluster
    from nemo_like.models.generation.vllm import VLLMGeneration

    s = session(ctx)
    if s.gen is None:
        raise NotRun("needs B1's engine")
    actor = s.gen.group.workers[0]._actor_id.hex()
    s.gen.shutdown()  # inside reuse_actors(): kept idle
    s.gen = None
    start = time.perf_counter()
    s.gen = VLLMGeneration(engine_config(s.cfg), s.pad, s.eos, plan_on_cluster(engine_config(s.cfg)).threads.generation, policy=s.policy)
    fig["reinit_s"] = time.perf_counter() - start
    fig["reused"] = s.gen.group.workers[0]._actor_id.hex() == actor
    fig.expect("reused", "==", True, "the kept engine died in reinit and a fresh one was started")
    samples = s.gen.generate(s.prompts[:16], params(16), seed=40)
    sample_figures(fig, samples, 16)
    fig.expect("samples", "==", 16)


CHECKS = [
    Check("B1", "colocated bring-up", "B", 240, b1_bring_up, imports=(*BASE, *POLICY, *GEN), pins=PINS,
          why="the engine on policy rank 0's GPU (review #8, U1); its memory"),
    Check("B2", "generate + sleep", "B", 90, b2_generate_and_sleep, imports=(*BASE, *GEN), pins=PINS,
          why="256 x 128 tokens; sleep releases >= 80% of the engine's memory"),
    Check("B3", "gen_kl baseline", "B", 60, b3_gen_kl_baseline, imports=(*BASE, *GEN), pins=PINS,
          why="vLLM's processed logprobs = the policy's (U6)"),
    Check("B4", "IPC refit + stale control", "B", 120, b4_ipc_refit, imports=(*BASE, *GEN), pins=PINS,
          why="CUDA-IPC refit lands; a missed refit shows (the check is not blind)"),
    Check("B5", "3 cycles, memory flat", "B", 120, b5_cycles, imports=(*BASE, *GEN), pins=PINS,
          why="sleep/wake/refit do not leak; policy memory after training (review #4)"),
    Check("B6", "in-flight refit", "B", 120, b6_in_flight_refit, imports=(*BASE, *GEN), pins=PINS,
          why="a refit between engine steps on the V2 runner with async scheduling (U5)"),
    Check("B7", "tokens/s eager vs CUDA graphs", "B", 300, b7_throughput, imports=(*BASE, *GEN), pins=PINS,
          why="151936-vocab decode rate; graphs worth turning on (review #10)"),
    Check("B8", "nemo-like train 2 steps", "B", 240, b8_train_end_to_end, imports=(*BASE, "nemo_like.cli"), pins=PINS,
          why="the CLI end to end on a GPU recipe"),
    Check("B9", "reused engine reinit", "B", 120, b9_reused_engine, imports=(*BASE, *GEN), pins=PINS,
          why="reuse_actors re-initialises a sleeping colocated engine (review #6)"),
]  # fmt: skip
