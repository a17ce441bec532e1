"""FSDP2 data parallelism and DTensor tensor parallelism: two gloo ranks (spawned processes, no Ray)
against one plain rank.

The same logprobs, the same loss and gradient norm, the same weights after three optimizer steps,
checkpoints written by two ranks resume exactly (also on one plain rank), and refit buckets carry the
full model in bounded pieces; the same for LoRA adapters on FSDP2. One spawn for all of it: starting the ranks is
the expensive part.
"""

from __future__ import annotations

import shutil
import socket

import pytest
import torch
import torch.multiprocessing as mp
from policy_batches import random_step_batch

from nemo_like.algorithms.loss_functions import ClippedPGLossFn
from nemo_like.config.loss import ClippedPGLossConfig
from nemo_like.config.schema import EMBEDDED_MODEL, LoraConfig, OptimizerConfig
from nemo_like.models.policy import sharding
from nemo_like.models.policy.policy import optimizer_step_shards
from nemo_like.models.policy.worker import PolicyWorker

pytestmark = pytest.mark.slow  # two processes that each import torch and transformers: ~30 s on this machine

STEPS = 3
# AdamW's update is ~lr * sign(g) where |g| >> eps: for gradient entries near 0 it would turn float
# rounding differences (another summation order across ranks) into lr-sized weight differences.
# eps = 1e-6 keeps those entries in Adam's linear regime, so equal gradients give equal weights.
MAX_GRAD_NORM = 0.5  # low enough that every step is clipped: clipping must use the global norm


def make_worker(rank: int = 0, world_size: int = 1, **kwargs) -> PolicyWorker:
    options = dict(
        model_name=EMBEDDED_MODEL,
        precision="float32",
        temperature=0.8,
        num_threads=1,
        seed=0,
        loss_fn=ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0)),
        optimizer=OptimizerConfig(lr=1e-3, eps=1e-6),
        max_grad_norm=MAX_GRAD_NORM,
        train_micro_batch_size=2,
        logprob_batch_size=2,
        # Sharded ranks run the model's own forward (FSDP2 gathers in its modules' hooks), so the one-rank reference
        # does too: the comparison isolates sharding.
        shared_prompt_forward=False,
    )
    options.update(kwargs)
    return PolicyWorker(rank=rank, world_size=world_size, **options)


def step_batch(step: int, rows: int = 8, seq: int = 20) -> dict[str, torch.Tensor]:
    """Right-padded rows of very different lengths, a 4-token prompt, global counts attached."""
    return random_step_batch(100 + step, rows, seq, vocab=300)


def rank_rows(batch: dict, rank: int, world: int) -> dict:
    n = batch["input_ids"].shape[0] // world
    return {k: (v[rank * n : (rank + 1) * n] if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in batch.items()}


def _rank_main(rank: int, world: int, port: int, out_dir: str, worker_kwargs: dict) -> None:
    """One FSDP2 rank: logprobs, 3 steps with a checkpoint after step 2, resume, buckets, footprint."""
    from nemo_like.models.policy import sharding

    worker = make_worker(rank, world, **worker_kwargs)
    worker.setup_distributed("127.0.0.1", port)
    probe = step_batch(99, rows=5)  # 5 rows: uneven logprob shards (3 + 2)
    bounds = [0, 3, 5]
    logprobs = worker.get_logprobs(
        {k: (v[bounds[rank] : bounds[rank + 1]] if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in probe.items()}
    )
    results = [worker.train([rank_rows(step_batch(s), rank, world)]) for s in range(STEPS - 1)]
    worker.save_checkpoint(f"{out_dir}/ckpt")
    results.append(worker.train([rank_rows(step_batch(STEPS - 1), rank, world)]))
    _, final = worker.get_state_dict()
    footprint = worker.memory_footprint()
    # A checkpoint missing a tensor is refused on every rank (a sharded load fills the dict it is given with every key
    # of the model: counted after it, nothing was ever missing, and the fresh tensor stayed)
    if rank == 0:
        from safetensors.torch import load_file, save_file

        shutil.copytree(f"{out_dir}/ckpt", f"{out_dir}/truncated")
        weights = load_file(f"{out_dir}/truncated/policy/model.safetensors")
        del weights["model.layers.1.mlp.down_proj.weight"]
        save_file(weights, f"{out_dir}/truncated/policy/model.safetensors")
    torch.distributed.barrier()
    try:
        worker.load_checkpoint(f"{out_dir}/truncated", None)
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    worker.load_checkpoint(f"{out_dir}/ckpt", None)
    worker.train([rank_rows(step_batch(STEPS - 1), rank, world)])
    _, resumed = worker.get_state_dict()
    buckets = list(sharding.iter_weight_buckets(worker.model, 200_000, keep=rank == 0))
    worker.loss_fn = ClippedPGLossFn(SEQUENCE_LOSS)
    uneven = worker.train(optimizer_step_shards(odd_batch(), 2, world)[rank])
    _, after_uneven = worker.get_state_dict()
    if rank == 0:
        torch.save(
            {"logprobs": logprobs, "results": results, "final": final, "resumed": resumed, "buckets": buckets, "footprint": footprint,
             "uneven": uneven, "after_uneven": after_uneven, "refused": refused},
            f"{out_dir}/rank0.pt",
        )  # fmt: skip
    else:
        torch.save(
            {"logprobs": logprobs, "results": results, "footprint": footprint, "uneven": uneven, "refused": refused}, f"{out_dir}/rank1.pt"
        )


#: A sequence-level aggregation for the odd batch (the steps above use the default token-mean): its normaliser is the
#: global count of sequences, which a rank with fewer rows, or none, must use as the others do.
SEQUENCE_LOSS = ClippedPGLossConfig(reference_policy_kl_penalty=0.05, loss_aggregation="seq-mean-token-sum")


def odd_batch() -> dict[str, torch.Tensor]:
    """7 rows (two optimizer steps of 4 and 3 rows, each split 2 + 2 and 2 + 1 over two ranks), one sample masked, off
    policy: prev and reference logprobs around the untrained model's (~ -log 359), so ratios straddle the clip range and
    every ratio, clip and KL metric is non-trivial (without prev logprobs every ratio was 1 and clip_fraction 0 = 0)."""
    batch = step_batch(7, rows=7)
    batch["sample_mask"][5] = 0.0
    g = torch.Generator().manual_seed(7)
    mask = batch["token_mask"]
    batch["prev_logprobs"] = (-5.9 + 0.4 * torch.randn(mask.shape, generator=g)) * mask
    batch["reference_policy_logprobs"] = (-5.9 + 0.4 * torch.randn(mask.shape, generator=g)) * mask
    return batch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_states_close(a: dict, b: dict, atol: float) -> None:
    assert set(a) == set(b)
    worst = {name: float((a[name] - b[name]).abs().max()) for name in a}
    assert max(worst.values()) <= atol, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


# The two FSDP ranks pack their samples (unequal micro-batch counts: the rank with fewer runs filler passes)
# and chunk the logprobs; the single rank runs the plain path. Every result must agree.
FSDP_RANK_KWARGS = dict(batching={"mode": "packed", "train_size": 24, "logprob_size": 24}, logprob_chunk_size=5)


def check_fsdp(out_dir) -> None:
    r0, r1 = (torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    single = make_worker()
    probe = step_batch(99, rows=5)
    # fp32 rounding of a different reduction order: logprobs near -32 (an ulp is 3.8e-6) differed by up to 1.14e-5 in
    # one loaded CI run, so 1e-6 relative on top of 1e-5 absolute (a sharding error is orders of magnitude larger).
    torch.testing.assert_close(torch.cat([r0["logprobs"], r1["logprobs"]]), single.get_logprobs(probe), atol=1e-5, rtol=1e-6)
    single_results = [single.train([step_batch(s)]) for s in range(STEPS)]
    for step, ref in enumerate(single_results):
        dp_loss = r0["results"][step]["metrics"]["loss"] + r1["results"][step]["metrics"]["loss"]
        assert abs(dp_loss - ref["metrics"]["loss"]) <= 1e-5 * max(1.0, abs(ref["metrics"]["loss"])), step
        assert r0["results"][step]["grad_norms"] == r1["results"][step]["grad_norms"]  # one global norm on every rank
        assert abs(r0["results"][step]["grad_norms"][0] - ref["grad_norms"][0]) <= 1e-5 * ref["grad_norms"][0], step
        assert ref["grad_norms"][0] > MAX_GRAD_NORM  # clipping was active
    _, single_state = single.get_state_dict()
    assert_states_close(r0["final"], single_state, atol=1e-5)
    # Two optimizer steps of an odd batch under a sequence-level loss: the same metrics (combined as the driver does),
    # grad norms and weights as one rank
    single.loss_fn = ClippedPGLossFn(SEQUENCE_LOSS)
    alone = single.train(optimizer_step_shards(odd_batch(), 2, 1)[0])
    combined = single.loss_fn.combine_metrics([r0["uneven"]["metrics"], r1["uneven"]["metrics"]])
    assert combined.keys() == alone["metrics"].keys() and 0.0 < alone["metrics"]["clip_fraction"] < 1.0
    for key, value in alone["metrics"].items():  # every metric, not three
        assert combined[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert r0["uneven"]["grad_norms"] == pytest.approx(alone["grad_norms"], rel=1e-5) and len(alone["grad_norms"]) == 2
    assert_states_close(r0["after_uneven"], single.get_state_dict()[1], atol=1e-5)
    for r in (r0, r1):
        assert "missing=['model.layers.1.mlp.down_proj.weight'] unexpected=[]" in r["refused"], r["refused"]
    # Resuming the two-rank checkpoint replays step 3 exactly.
    assert_states_close(r0["resumed"], r0["final"], atol=0.0)
    # Each rank holds half of the parameters, gradients and AdamW moments.
    full = single.memory_footprint()
    for key in ("params", "grads", "optimizer"):
        assert r0["footprint"][key] + r1["footprint"][key] == full[key], key
        assert r0["footprint"][key] <= 0.55 * full[key], key
    # Refit buckets: the full model, tied head included, no bucket over the limit unless it is one tensor.
    seen: dict[str, torch.Tensor] = {}
    for bucket in r0["buckets"]:
        distinct = {id(t): t for t in bucket.values()}  # a tied tensor's names share a bucket and count once
        assert len(distinct) == 1 or sum(t.numel() * t.element_size() for t in distinct.values()) <= 200_000
        seen.update(bucket)
    assert len(r0["buckets"]) > 3 and "lm_head.weight" in seen
    assert_states_close(seen, r0["resumed"], atol=0.0)
    # The optimizer state is saved by parameter name: the two-rank checkpoint resumes on one plain rank.
    resumed_single = make_worker()
    resumed_single.load_checkpoint(str(out_dir / "ckpt"), None)
    resumed_single.train([step_batch(STEPS - 1)])
    assert_states_close(resumed_single.get_state_dict()[1], r0["final"], atol=1e-5)


LAYER_TOKENS = 256


def first_layer_saved_bytes(model) -> int:
    """Bytes autograd keeps for backward inside the first decoder layer in one training forward of ``model`` on
    :data:`LAYER_TOKENS` tokens (distinct storages of this rank's local pieces, parameters excluded), read when the
    forward has ended: FSDP2 has freed the unsharded weights the layer's products saved by then (they are gathered
    again for the backward), so what remains is what the layer holds."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    seen: dict[int, torch.UntypedStorage] = {}
    inside = [False]

    def pack(t):
        if inside[0]:
            storage = local(t).untyped_storage()
            seen[storage.data_ptr()] = storage
        return t

    layer = model.model.layers[0]
    hooks = [
        layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)),
        layer.register_forward_hook(lambda *_: inside.__setitem__(0, False)),
    ]
    parameters = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    ids = torch.randint(0, 359, (1, LAYER_TOKENS), generator=torch.Generator().manual_seed(1))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids).logits.float().sum()
    finally:
        for hook in hooks:
            hook.remove()
    return sum(storage.nbytes() for ptr, storage in seen.items() if ptr not in parameters)


def _tensor_parallel_rank(rank: int, world: int, port: int, out: str) -> None:
    """One rank of a (dp=1, tp=2) mesh: both ranks see the same rows."""
    worker = make_worker(rank, world, dtensor_cfg={"tensor_parallel_size": 2})
    worker.setup_distributed("127.0.0.1", port)
    checksum = worker.parameter_checksum()
    logprobs = worker.get_logprobs(step_batch(99, rows=5))
    results = [worker.train([step_batch(s)]) for s in range(STEPS)]
    _, state = worker.get_state_dict()
    footprint = worker.memory_footprint()
    layer_bytes = first_layer_saved_bytes(worker.model)
    if rank == 0:
        torch.save(
            {
                "logprobs": logprobs,
                "results": results,
                "state": state,
                "footprint": footprint,
                "layer_bytes": layer_bytes,
                "checksum": checksum,
            },
            out,
        )


def check_tensor_parallel(out) -> None:
    """DTensor tensor parallelism (column/row-parallel projections) runs on gloo and changes no number; each rank
    holds what the memory planner says (the projections halved, embeddings and norms whole)."""
    from nemo_like.config import DEFAULT_RECIPE, load_config
    from nemo_like.models.footprint import model_footprint
    from nemo_like.plan.memory import policy_memory

    tp = torch.load(out, weights_only=False)
    params, shape = model_footprint(EMBEDDED_MODEL, "float32")
    planned = policy_memory(load_config(DEFAULT_RECIPE, ["policy.dtensor_cfg.tensor_parallel_size=2"], warn=False), params, shape)
    assert tp["footprint"] == {"params": planned.params, "grads": planned.grads, "optimizer": planned.optimizer}
    # A layer's activations on a tp rank: the split projections' values are half as wide (the plan counted them whole)
    single = make_worker()
    # the full model's sum: the embeddings and norms, whole on both tp ranks, counted once (they were counted twice)
    assert tp["checksum"] == pytest.approx(single.parameter_checksum(), rel=1e-12)
    whole = first_layer_saved_bytes(single.model)
    assert tp["layer_bytes"] < 0.7 * whole
    assert tp["layer_bytes"] == pytest.approx(LAYER_TOKENS * shape.layer_bytes_per_token(4, tp=2), rel=0.05)
    assert whole == pytest.approx(LAYER_TOKENS * shape.layer_bytes_per_token(4), rel=0.05)
    assert (tp["logprobs"] - single.get_logprobs(step_batch(99, rows=5))).abs().max() < 1e-5
    for step in range(STEPS):
        ref = single.train([step_batch(step)])
        assert abs(tp["results"][step]["metrics"]["loss"] - ref["metrics"]["loss"]) <= 1e-5 * max(1.0, abs(ref["metrics"]["loss"]))
        assert abs(tp["results"][step]["grad_norms"][0] - ref["grad_norms"][0]) <= 1e-5 * ref["grad_norms"][0]
    assert_states_close(tp["state"], single.get_state_dict()[1], atol=1e-5)


LORA = LoraConfig(enabled=True, dim=4, alpha=8)


def _lora_rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    """One FSDP2 rank of a LoRA policy: 3 steps with a checkpoint after step 2, the reference (adapters
    disabled) logprobs, the exported adapters, the resume of step 3."""
    worker = make_worker(rank, world, lora_cfg=LORA)
    worker.setup_distributed("127.0.0.1", port)
    results = [worker.train([rank_rows(step_batch(s), rank, world)]) for s in range(STEPS - 1)]
    worker.save_checkpoint(f"{out_dir}/ckpt")
    results.append(worker.train([rank_rows(step_batch(STEPS - 1), rank, world)]))
    probe = rank_rows(step_batch(99, rows=4), rank, world)
    reference = worker.get_logprobs(probe, reference=True)
    _, adapters = worker.get_state_dict("adapter")
    _, merged = worker.get_state_dict("merged")  # the merged refit's stream, gathered from the shards
    footprint = worker.memory_footprint()
    worker.load_checkpoint(f"{out_dir}/ckpt", None)
    worker.train([rank_rows(step_batch(STEPS - 1), rank, world)])
    _, resumed = worker.get_state_dict("adapter")
    out = {"results": results, "reference": reference, "footprint": footprint}
    if rank == 0:
        out.update(adapters=adapters, resumed=resumed, merged=merged)
    torch.save(out, f"{out_dir}/rank{rank}.pt")


def check_lora(out_dir) -> None:
    """LoRA on FSDP2 (frozen base + trainable adapters in one unit): dp 2 == dp 1 after 3 steps, only the adapters
    get gradients and AdamW moments, the reference is the base model, the checkpoint resumes bitwise."""
    r0, r1 = (torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    single = make_worker(lora_cfg=LORA)
    for step in range(STEPS):
        ref = single.train([step_batch(step)])
        dp_loss = r0["results"][step]["metrics"]["loss"] + r1["results"][step]["metrics"]["loss"]
        assert abs(dp_loss - ref["metrics"]["loss"]) < 1e-5, step
        assert abs(r0["results"][step]["grad_norms"][0] - ref["grad_norms"][0]) <= 1e-5 * max(ref["grad_norms"][0], 1e-3), step
    _, single_adapters = single.get_state_dict("adapter")
    assert_states_close(r0["adapters"], single_adapters, atol=1e-5)
    assert max(float(t.abs().max()) for k, t in single_adapters.items() if ".lora_B." in k) > 1e-4  # the adapters trained
    assert_states_close(r0["resumed"], r0["adapters"], atol=0.0)
    # Merged refit: W + B@A*alpha/dim under exactly the names the vLLM engine's manifest expects.
    from nemo_like.models.loading import resolve_model_path
    from nemo_like.models.refit.manifest import expected_weight_names

    assert sorted(r0["merged"]) == expected_weight_names(resolve_model_path(EMBEDDED_MODEL))
    assert_states_close(r0["merged"], single.get_state_dict("merged")[1], atol=1e-5)
    base = make_worker()  # the plain model: what the adapters-disabled pass must reproduce
    torch.testing.assert_close(torch.cat([r0["reference"], r1["reference"]]), base.get_logprobs(step_batch(99, rows=4)), atol=1e-5, rtol=0)
    # Adapters only: gradients and optimizer state are the adapters' (sharded in halves); <= 5% of full fine-tuning's.
    lora_total = {k: r0["footprint"][k] + r1["footprint"][k] for k in ("grads", "optimizer")}
    trainable = single.parameter_counts()["trainable"]
    assert lora_total == {"grads": 4 * trainable, "optimizer": 2 * 4 * trainable}  # fp32 grads, AdamW's two moments
    base.train([step_batch(0)])
    full = base.memory_footprint()
    assert lora_total["optimizer"] <= 0.05 * full["optimizer"], (lora_total, full)


BF16_LR = 5e-6  # the math GPU recipe's learning rate: bf16 parameters would round most of its updates away


def _bf16_rank_main(rank: int, world: int, port: int, out: str) -> None:
    """One FSDP2 rank with ``precision=bfloat16``: bf16 compute through FSDP2's mixed-precision policy, fp32 shards."""
    worker = make_worker(rank, world, precision="bfloat16", optimizer=OptimizerConfig(lr=BF16_LR))
    worker.setup_distributed("127.0.0.1", port)
    _, before = worker.get_state_dict()
    result = worker.train([rank_rows(step_batch(0), rank, world)])
    _, after = worker.get_state_dict()
    dtypes = {str(p.to_local().dtype) for p in worker.model.parameters()} | {
        str(p.grad.to_local().dtype) for p in worker.model.parameters()
    }
    torch.save({"result": result, "before": before, "after": after, "dtypes": dtypes}, f"{out}.rank{rank}")


def check_bf16(out) -> None:
    """Sharded bf16 trains fp32 shards (parameters, gradients), moves as many weights as one fp32 rank does, and
    agrees with it to bf16 rounding (loss, gradient norm)."""
    r0, r1 = (torch.load(f"{out}.rank{r}", weights_only=False) for r in (0, 1))
    assert r0["dtypes"] == r1["dtypes"] == {"torch.float32"}
    single = make_worker(precision="float32", optimizer=OptimizerConfig(lr=BF16_LR))
    _, before = single.get_state_dict()
    ref = single.train([step_batch(0)])
    _, after = single.get_state_dict()

    def changed(a: dict, b: dict) -> float:
        return sum(int((a[k] != b[k]).sum()) for k in a) / sum(t.numel() for t in a.values())

    assert changed(r0["before"], r0["after"]) >= 0.9 * changed(before, after) > 0.5
    dp_loss = r0["result"]["metrics"]["loss"] + r1["result"]["metrics"]["loss"]
    assert abs(r0["result"]["grad_norms"][0] - ref["grad_norms"][0]) <= 2e-2 * ref["grad_norms"][0]
    assert abs(dp_loss - ref["metrics"]["loss"]) <= 1e-2 * max(abs(ref["metrics"]["loss"]), 1e-2)


def _all_ranks_main(rank: int, world: int, ports: list[int], out_dir: str) -> None:
    """One rank of each two-rank setup in turn (each joins a new process group): FSDP2, tensor parallel, LoRA on FSDP2,
    FSDP2 in bf16."""
    _rank_main(rank, world, ports[0], f"{out_dir}/fsdp", FSDP_RANK_KWARGS)
    _tensor_parallel_rank(rank, world, ports[1], f"{out_dir}/tp.pt")
    _lora_rank_main(rank, world, ports[2], f"{out_dir}/lora")
    _bf16_rank_main(rank, world, ports[3], f"{out_dir}/bf16")


def test_two_gloo_ranks_equal_one_plain_rank_with_fsdp_tensor_parallel_lora_and_bf16(tmp_path):
    """The three two-rank setups in one spawn (starting the ranks and importing torch and transformers in them is the
    expensive part), each then checked against one plain rank."""
    for sub in ("fsdp", "lora"):
        (tmp_path / sub).mkdir()
    mp.spawn(_all_ranks_main, args=(2, [free_port() for _ in range(4)], str(tmp_path)), nprocs=2, join=True)
    check_fsdp(tmp_path / "fsdp")
    check_tensor_parallel(tmp_path / "tp.pt")
    check_lora(tmp_path / "lora")
    check_bf16(tmp_path / "bf16")


@pytest.mark.parametrize("max_norm", [None, 0.5, 1e6])
def test_clip_grad_norm_matches_torchs_on_plain_parameters(max_norm) -> None:
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(4)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn_like(a)
        b.grad = a.grad.clone()
    norm = sharding.clip_grad_norm(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm if max_norm is not None else float("inf"))
    assert norm == pytest.approx(float(expected), rel=1e-6)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)
    if max_norm == 0.5:
        assert float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ours]))) == pytest.approx(0.5, rel=1e-4)
