"""Two or more GPUs (``make test-gpu-multi``): the NCCL-broadcast refit, FSDP2 dp 2 against dp 1, TP 2 against TP 1.

Same stack and models as tier B (:mod:`tier_b`); one private Ray cluster over the machine's GPUs. M1 uses two GPUs
(policy, engine), M2 and M3 two policy ranks each, one after the other.
"""

from __future__ import annotations

from checklib import Check, Context, Figures
from tier_b import BASE, GEN, PINS, POLICY, Session, gen_kl, params, refit, train_batch


def _session(ctx: Context) -> Session:
    if "session" not in ctx.state:
        import torch

        s = Session(ctx, (f"cluster.gpus_per_node={torch.cuda.device_count()}", "policy.generation.colocated.enabled=false"))
        ctx.state["session"] = s
        ctx.cleanups.append(s.close)
    return ctx.state["session"]


def _release(s: Session) -> None:
    for name in ("gen", "policy"):
        obj = getattr(s, name)
        if obj is not None:
            obj.group.kill()  # not kept: the next check needs the GPUs
            setattr(s, name, None)


def m1_nccl_refit(ctx: Context, fig: Figures) -> None:
    """Policy on one GPU, the engine on another: the refit is an NCCL broadcast from policy rank 0."""
    import ray

    from nemo_like.algorithms.loss_functions import ClippedPGLossFn
    from nemo_like.distributed.planning import plan_on_cluster
    from nemo_like.models.generation.vllm import VLLMGeneration
    from nemo_like.models.policy.policy import Policy

    s = _session(ctx)
    try:
        s.policy = Policy(s.cfg, loss_fn=ClippedPGLossFn(s.cfg.loss_fn))
        s.gen = VLLMGeneration(s.cfg, s.pad, s.eos, plan_on_cluster(s.cfg).threads.generation, policy=s.policy)
        fig["transport"] = s.gen.transport
        fig.expect("transport", "==", "nccl")
        fig["separate_gpus"] = ray.get(s.gen.group.run_rank0("device_uuid")) != ray.get(s.policy.group.run_rank0("device_info"))["uuid"]
        fig.expect("separate_gpus", "==", True)
        base = s.gen.generate(s.prompts[:64], params(64), seed=1)
        fig["baseline_gen_kl"] = gen_kl(s, base)["gen_kl"]
        fig.expect("baseline_gen_kl", "<=", 1e-3)
        s.policy.train(train_batch(base, s.pad, seed=2))
        stale = s.gen.generate(s.prompts[:64], params(64), seed=3)
        fig["stale_gen_kl"] = gen_kl(s, stale)["gen_kl"]
        fig.expect("stale_gen_kl", ">=", 1e-2, "blind: a missed refit would not show")
        fig["refit_s"] = refit(s)  # the first one includes the NCCL group's creation
        fresh = s.gen.generate(s.prompts[:64], params(64), seed=4)
        fig["gen_kl"] = gen_kl(s, fresh)["gen_kl"]
        fig.expect("gen_kl", "<=", 1e-3)
        s.policy.train(train_batch(fresh, s.pad, seed=5))
        fig["second_refit_s"] = refit(s)
        again = s.gen.generate(s.prompts[:64], params(64), seed=6)
        fig["second_gen_kl"] = gen_kl(s, again)["gen_kl"]
        fig.expect("second_gen_kl", "<=", 1e-3, "the cached broadcast group and manifest serve the next refit")
    finally:
        _release(s)


def _fp32_policy(s: Session, name: str, *overrides: str):
    from tier_b import RECIPE

    from nemo_like.algorithms.loss_functions import ClippedPGLossFn
    from nemo_like.config import load_config
    from nemo_like.models.policy.policy import Policy

    cfg = load_config(RECIPE, [*s.overrides, "policy.precision=float32", "policy.shared_prompt_forward=false", "policy.optimizer.lr=1e-6",
                               "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8", "policy.logprob_batch_size=8",
                               *overrides], warn=False)  # fmt: skip
    return Policy(cfg, name, loss_fn=ClippedPGLossFn(cfg.loss_fn))


def _batch():
    from models import grpo_batch, tokenizer_vocab

    return grpo_batch(tokenizer_vocab(), prompts=2, group=8, prompt_len=96, response_len=96, min_response=48, seed=7)


def m2_fsdp_dp2(ctx: Context, fig: Figures) -> None:
    """One fp32 optimizer step on the same 16 rows: one rank, then FSDP2 over two ranks (8 rows each)."""
    s = _session(ctx)
    batch = _batch()
    single = _fp32_policy(s, "dp1")
    try:
        batch["generation_logprobs"] = single.get_logprobs(batch)
        ctx.state["dp1_logprobs"] = batch["generation_logprobs"]
        r1 = single.train(batch)
    finally:
        single.group.kill()
    sharded = _fp32_policy(s, "dp2", "policy.dp_size=2")
    try:
        r2 = sharded.train(batch)
    finally:
        sharded.group.kill()
    fig["loss_dp1"], fig["loss_dp2"] = float(r1.metrics["loss"]), float(r2.metrics["loss"])
    fig["loss_rel"] = abs(fig["loss_dp2"] - fig["loss_dp1"]) / max(abs(fig["loss_dp1"]), 1e-12)
    fig["grad_norm_rel"] = abs(r2.grad_norms[0] - r1.grad_norms[0]) / max(abs(r1.grad_norms[0]), 1e-12)
    fig.expect("loss_rel", "<=", 1e-3)
    fig.expect("grad_norm_rel", "<=", 1e-3)


def m3_tensor_parallel(ctx: Context, fig: Figures) -> None:
    """fp32 logprobs of tensor_parallel_size 2 (heads split 7 + 7, key-value heads 1 + 1) against one rank's."""
    s = _session(ctx)
    reference = ctx.need("dp1_logprobs", "M2")
    batch = _batch()
    tp = _fp32_policy(s, "tp2", "policy.dtensor_cfg.tensor_parallel_size=2")
    try:
        lp = tp.get_logprobs(batch)
    finally:
        tp.group.kill()
    mask = batch["attention_mask"].bool()
    mask[:, 0] = False  # the first position has no logprob
    fig["max_dlp"] = float((lp - reference)[mask].abs().max())
    fig.expect("max_dlp", "<=", 1e-3)


CHECKS = [
    Check("M1", "NCCL refit", "multi", 300, m1_nccl_refit, imports=(*BASE, *POLICY, *GEN), pins=PINS, min_gpus=2,
          why="the broadcast refit path (review U3)"),
    Check("M2", "FSDP2 dp 2 = dp 1", "multi", 240, m2_fsdp_dp2, imports=(*BASE, *POLICY), pins=PINS, min_gpus=2,
          why="sharded training on NCCL equals one rank (review #1, U7)"),
    Check("M3", "TP 2 = TP 1", "multi", 180, m3_tensor_parallel, imports=(*BASE, *POLICY), pins=PINS, min_gpus=2,
          why="tensor-parallel logprobs equal one rank's (U7)"),
]  # fmt: skip
