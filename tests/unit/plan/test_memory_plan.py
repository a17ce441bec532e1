"""The memory planner: parameters, gradients and AdamW state per rank equal what a real policy worker holds (full and
LoRA, one rank and FSDP2 shards); the estimates follow their formulas; the fit check gives advice."""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from unit.models.test_policy_worker import make_worker, random_batch, with_global_counts

from nemo_like.config import DEFAULT_RECIPE, load_config
from nemo_like.config.schema import EMBEDDED_MODEL, LoraConfig
from nemo_like.distributed.threads import declared_node_cpus, local_cores, node_cpus
from nemo_like.models.footprint import model_footprint, sampler_copy_bytes
from nemo_like.models.loading import resolve_model_path
from nemo_like.plan.backend import HF_MAX_BATCH_SIZE, PolicyModel
from nemo_like.plan.memory import (
    GIB,
    VLLM_NON_TORCH_BYTES,
    ModelShape,
    ParameterSpec,
    _logprob_activations,
    activation_bytes,
    colocated_peak,
    generation_memory,
    lora_advice,
    micro_batch_tokens,
    mkl_packed_head,
    over_budget,
    plan_memory,
    policy_memory,
    step_estimate,
    vllm_overhead_bytes,
    with_teacher_copy,
)
from nemo_like.plan.run_plan import decide_run_plan


def recipe(*overrides: str):
    return load_config(DEFAULT_RECIPE, list(overrides), warn=False)


#: The rollout's sampling alone (a validation round samples its 256 sequences in one call, planned with them)
NO_VALIDATION = ("grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false")


@pytest.mark.parametrize("lora", [False, True])
def test_parameters_gradients_and_adamw_state_equal_a_real_workers(lora: bool) -> None:
    lora_cfg = LoraConfig(enabled=True, dim=4) if lora else None
    cfg = recipe(*(["policy.lora_cfg.enabled=true", "policy.lora_cfg.dim=4"] if lora else []))
    worker = make_worker(6, lora_cfg=lora_cfg)
    worker.train([with_global_counts(random_batch())])  # gradients and AdamW moments now exist
    measured = worker.memory_footprint()
    params, shape = model_footprint(EMBEDDED_MODEL, "float32", cfg.policy.lora_cfg)
    planned = policy_memory(cfg, params, shape)
    assert (planned.params, planned.grads, planned.optimizer) == (measured["params"], measured["grads"], measured["optimizer"])


def test_fsdp2_shards_are_ceil_rows_of_dim_zero() -> None:
    spec = ParameterSpec((359, 128), True, 4)
    assert spec.shard_bytes(1) == 359 * 128 * 4
    assert spec.shard_bytes(2) == 180 * 128 * 4  # rank 0 holds ceil(359 / 2) rows
    assert ParameterSpec((), False, 4).shard_bytes(2) == 4


def test_tensor_parallel_splits_the_projections_and_fsdp2_shards_the_rest_over_dp_only() -> None:
    params, shape = model_footprint(EMBEDDED_MODEL, "float32")
    split = sum(p.shard_bytes(1) for p in params if p.tp_dim is not None)  # q/k/v/o, gate/up/down (and q/k/v biases)
    whole = sum(p.shard_bytes(1) for p in params if p.tp_dim is None)  # embeddings (tied head), norms
    tp2 = policy_memory(recipe("policy.dtensor_cfg.tensor_parallel_size=2"), params, shape)
    assert shape.mlp_splits and tp2.params == whole + split // 2 == 2_156_544  # what each rank of a real (dp 1, tp 2) gloo worker holds
    assert (tp2.grads, tp2.optimizer, tp2.workers) == (2_156_544, 2 * 2_156_544, 2)
    # dp 2 x tp 2: the embeddings' 359 rows in ceil(359 / 2) = 180 on rank 0, a q_proj's 128 rows in 64, then 32
    both = policy_memory(recipe("policy.dp_size=2", "policy.dtensor_cfg.tensor_parallel_size=2"), params, shape)
    assert both.params == sum(p.shard_bytes(2, 2) for p in params)
    assert ParameterSpec((359, 128), True, 4).shard_bytes(2, 2) == 180 * 128 * 4
    assert ParameterSpec((128, 128), True, 4, tp_dim=0).shard_bytes(2, 2) == 32 * 128 * 4
    assert ParameterSpec((128, 512), True, 4, tp_dim=1).shard_bytes(2, 2) == 64 * 256 * 4


def test_activations_follow_their_formula_and_chunking_bounds_the_logits() -> None:
    cfg = recipe()
    params, shape = model_footprint(EMBEDDED_MODEL, "float32")
    tokens = micro_batch_tokens(cfg, training=True)
    expected = tokens * shape.layer_values_per_token() * 4 * shape.layers + tokens * shape.vocab * 12
    base = policy_memory(cfg, params, shape)
    assert base.activations == max(expected, micro_batch_tokens(cfg, False) * (shape.layer_values_per_token() * 4 + shape.vocab * 8))
    chunked = policy_memory(recipe("policy.logprob_chunk_size=16"), params, shape)
    checkpointed = policy_memory(recipe("policy.dtensor_cfg.activation_checkpointing=true"), params, shape)
    assert chunked.activations < base.activations and checkpointed.activations < base.activations
    # Sharded bf16 (FSDP2's bf16 compute copy of the head): the chunked head's float32 sum of its weight gradient
    sharded = ("policy.dp_size=2", "policy.precision=bfloat16", "policy.train_global_batch_size=64")
    plain, summed = (policy_memory(recipe(*sharded, *chunk), params, shape) for chunk in ((), ("policy.logprob_chunk_size=16",)))
    one = recipe(*sharded, "policy.logprob_chunk_size=16")
    rows = micro_batch_tokens(one, training=True)
    # a chunk's recompute holds 16 bytes a logit (12 unchunked); the head's gradient: a float32 sum and one chunk's bf16;
    # on a CPU, MKL's packed copy of the head a chunk's few-row matmul leaves (4 bytes a weight: measured 24-28 MiB for 31)
    assert mkl_packed_head(one, shape) == shape.vocab * shape.hidden * 4
    assert (
        mkl_packed_head(recipe(*sharded), shape)
        == 0
        == mkl_packed_head(recipe("cluster.gpus_per_node=1", "policy.logprob_chunk_size=16"), shape)
    )
    head_terms = shape.vocab * shape.hidden * (4 + 2 + 4)
    assert summed.activations - plain.activations == head_terms - (rows * 12 - 16 * 16) * shape.vocab
    # float32 (and autocast: a float32 master head): the chunk's head gradient is float32 too
    fp32_plain, fp32_chunked = (policy_memory(recipe(*chunk), params, shape) for chunk in ((), ("policy.logprob_chunk_size=16",)))
    fp32_rows = micro_batch_tokens(cfg, training=True)
    per_layer = fp32_plain.activations - fp32_rows * shape.vocab * 12
    assert fp32_chunked.activations == per_layer + 16 * shape.vocab * 16 + shape.vocab * shape.hidden * (4 + 4 + 4)
    lora = ("policy.lora_cfg.enabled=true", "policy.lora_cfg.dim=4")  # a frozen head: no gradient, no sum
    lora_params, _ = model_footprint(EMBEDDED_MODEL, "bfloat16", recipe(*lora).policy.lora_cfg)
    no_sum, chunked_lora = (
        policy_memory(recipe(*sharded, *lora, *chunk), lora_params, shape) for chunk in ((), ("policy.logprob_chunk_size=16",))
    )
    assert chunked_lora.activations - no_sum.activations == shape.vocab * shape.hidden * 4 - (rows * 12 - 16 * 16) * shape.vocab


def test_checkpointing_keeps_each_layer_input_and_the_larger_of_the_logits_and_one_recomputed_layer() -> None:
    cfg = recipe("policy.dtensor_cfg.activation_checkpointing=true", "policy.logprob_batch_size=1")
    params, tiny = model_footprint(EMBEDDED_MODEL, "float32")
    # 32 rows x 64 tokens = 2048 tokens. The tiny model (H 128, 2 KV heads of 32, I 512, 4 layers, vocab 359): one layer
    # saves 8*128 + 4*64 + 4*512 = 3328 values a token, 2048 * 3328 * 4 = 27,262,976 bytes, more than the logits'
    # 2048 * 359 * 12 = 8,822,784; the layer inputs 2048 * 128 * 4 * 4 = 4,194,304.
    assert policy_memory(cfg, params, tiny).activations == 4_194_304 + 27_262_976
    # A wide vocabulary: the logits' 2048 * 1000 * 12 = 24,576,000 bytes outweigh a layer's 2048 * (64 + 16 + 64) * 4 =
    # 1,179,648; inputs 2048 * 8 * 4 * 2 = 131,072. The layer is recomputed after the logits are freed: not added.
    wide = ModelShape(layers=2, hidden=8, intermediate=16, heads=2, kv_heads=1, head_dim=4, vocab=1000)
    assert policy_memory(cfg, params, wide).activations == 131_072 + 24_576_000


def saved_bytes(model, forward) -> int:
    """Bytes autograd keeps for backward while ``forward()`` runs (distinct storages, ``model``'s parameters excluded)."""
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(size for ptr, size in seen.items() if ptr not in parameters)


@pytest.mark.parametrize("moe", ["mixtral", "qwen2_moe"])
def test_a_mixture_of_experts_layer_saves_what_each_token_runs_through(moe: str) -> None:
    # What the last layer of a real model saves per token (transformers' eager experts: each token's top-k experts),
    # against the plan: a token's gathered input, gate/up output, activation, product and weighted output for each of
    # its k experts (4 I_e + 3H), the router's E logits, a shared expert's 4 I_s. A dense MLP's 4I was 0.53-0.57 of it.
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig

    from nemo_like.models.attention import attend_in_float32_on_cpu
    from nemo_like.utils.experts import expert_block_values_per_token, top_k

    layers = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 100, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}  # fmt: skip
    config = {
        "mixtral": MixtralConfig(**layers, num_local_experts=8, num_experts_per_tok=2),
        "qwen2_moe": Qwen2MoeConfig(
            **layers, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32, shared_expert_intermediate_size=48
        ),
    }[moe]
    torch.manual_seed(0)
    model = attend_in_float32_on_cpu(AutoModelForCausalLM.from_config(config, experts_implementation="eager").train())
    ids = torch.randint(2, 100, (1, 256))

    def forward() -> None:
        model(input_ids=ids).logits.float().sum()

    block = expert_block_values_per_token(model, 64, top_k(config))
    assert block == {"mixtral": 2 * (4 * 128 + 3 * 64) + 8, "qwen2_moe": 4 * (4 * 32 + 3 * 64) + 8 + 4 * 48}[moe]
    every_layer = saved_bytes(model, forward)
    model.model.layers = model.model.layers[:2]
    measured = (every_layer - saved_bytes(model, forward)) / 256 / 4
    shape = replace(ModelShape.from_hf_config(config), expert_block_values=block)
    assert shape.layer_values_per_token() == pytest.approx(measured, rel=0.05)
    # a tensor-parallel rank splits the attention only: the experts run whole there (a tp-2 Qwen3-MoE rank saved 0.96
    # of a plain rank's values, planned at 0.55 when the block was halved too)
    kv = 4 * shape.kv_heads * shape.head_dim
    assert shape.layer_bytes_per_token(4, tp=2) == (5 * 64 + block + math.ceil((3 * 64 + kv) / 2)) * 4
    with tempfile.TemporaryDirectory() as config_dir:  # what `nemo-like plan --model-config` plans with
        config.save_pretrained(config_dir)
        planned = model_footprint(moe, "float32", config_path=config_dir)[1]
        assert planned.expert_block_values == block and not planned.mlp_splits  # no mlp.*_proj for the plan to split


NORMED = {  # family: (its config's extra keys, the norm values planned, the tolerance of the layer's plan)
    "llama": ({}, 0, 0.02),
    "qwen3": ({}, 2 * (4 + 2) * 32, 0.02),
    "olmo2": ({}, 2 * (4 + 2) * 32, 0.02),
    "hunyuan_v1_dense": ({}, 2 * (4 + 2) * 32, 0.02),  # query_layernorm / key_layernorm
    "gemma2": ({"sliding_window": 512}, 4 * 64, 0.02),
    "gemma3_text": ({"sliding_window": 512}, 4 * 64 + 2 * (4 + 2) * 32, 0.02),
    "cohere": ({"use_qk_norm": True}, 2 * (4 + 2) * 32, 0.05),  # [heads, head size] weights; one hidden norm, planned two
}


@pytest.mark.parametrize("family", sorted(NORMED))
def test_a_layers_norms_beyond_llamas_two_are_planned_with_what_they_save(family: str, tmp_path) -> None:
    """Gemma's pre/post-feedforward norms and the per-head query/key norms of Qwen3, OLMo 2, Hunyuan, Gemma 3 and Cohere
    each save their input and output: planned as a Llama layer, a Gemma 3 layer saved 1.51x its plan, a Qwen3 layer
    1.31x (1.18x at Gemma-3-1B's widths). Each layer's measured bytes within 2% of the plan (heads x head size !=
    hidden), Cohere's within 5% (its one hidden norm is planned as a Llama layer's two)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from nemo_like.models.attention import attend_in_float32_on_cpu

    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 32, "vocab_size": 100, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}  # fmt: skip
    extra, norm_values, tolerance = NORMED[family]
    config = CONFIG_MAPPING[family](**sizes, **extra)
    torch.manual_seed(0)
    model = attend_in_float32_on_cpu(AutoModelForCausalLM.from_config(config).train())
    ids = torch.randint(2, 100, (1, 256))

    def forward() -> None:
        model(input_ids=ids).logits.float().sum()

    every_layer = saved_bytes(model, forward)
    model.model.layers = model.model.layers[:2]
    measured = (every_layer - saved_bytes(model, forward)) / 256
    config.save_pretrained(tmp_path)
    shape = model_footprint(str(tmp_path), "float32")[1]
    assert shape.norm_values == norm_values
    assert measured == pytest.approx(shape.layer_bytes_per_token(4), rel=tolerance)


def saved_for_backward(model, ids, precision: str, sharded: bool = False) -> int:
    """Bytes autograd keeps for backward in one training forward of ``model`` on ``ids`` under the run's
    :func:`~nemo_like.models.precision.compute_context`."""
    import torch

    from nemo_like.models.precision import compute_context

    def forward() -> None:
        with compute_context(torch.device("cpu"), precision, sharded):
            model(input_ids=ids).logits.float().sum()

    return saved_bytes(model, forward)


def tiny_model(layers: int | None = None):
    """The embedded model, random float32 masters, in training mode, attending as a run's models do
    (:func:`~nemo_like.models.attention.attend_in_float32_on_cpu`); ``layers``: only its first few decoder layers."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from nemo_like.models.attention import attend_in_float32_on_cpu
    from nemo_like.models.loading import resolve_model_path

    torch.manual_seed(0)
    config = json.loads((Path(resolve_model_path(EMBEDDED_MODEL)) / "config.json").read_text())
    model = attend_in_float32_on_cpu(AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).float().train())
    if layers is not None:
        model.model.layers = model.model.layers[:layers]
    return model


def test_one_rank_bfloat16_counts_autocasts_weight_copies_and_a_float32_residual_stream() -> None:
    import torch

    # dp 1, bfloat16: the forward runs under torch.autocast over float32 masters. Measured on the real model, a layer
    # saves per token (8H at 4 bytes + (4KD + 4I) at 2, and attention in float32 on a CPU: its 3H and the keys' and
    # values' float32 copies at 2 bytes more) at most, and per layer its weights' bf16 copies, whatever the tokens; the
    # whole model also the (tied) head's copy.
    params, shape = model_footprint(EMBEDDED_MODEL, "float32")
    h, kd, i = shape.hidden, shape.kv_heads * shape.head_dim, shape.intermediate
    per_token = 8 * h * 4 + (4 * kd + 4 * i) * 2 + (3 * h + 2 * kd) * 2
    assert shape.layer_bytes_per_token(2, 4, float32_attention=True) == per_token
    ids = {t: torch.randint(0, shape.vocab, (1, t)) for t in (128, 256)}
    one, two = tiny_model(1), tiny_model(2)
    layer = {t: saved_for_backward(two, ids[t], "bfloat16") - saved_for_backward(one, ids[t], "bfloat16") for t in ids}
    slope, constant = (layer[256] - layer[128]) / 128, 2 * layer[128] - layer[256]
    assert slope <= per_token <= 1.1 * slope  # the old 2 bytes for every value: 0.81 of the measured slope
    layer_weights = sum(p.numel() for p in two.model.layers[0].parameters() if p.dim() == 2)
    assert constant == layer_weights * 2
    full = tiny_model()
    whole = {t: saved_for_backward(full, ids[t], "bfloat16") for t in ids}
    copies = 2 * whole[128] - whole[256]
    assert copies == (shape.layers * layer_weights + shape.vocab * h) * 2

    cfg = recipe("policy.precision=bfloat16")
    tokens, rows = micro_batch_tokens(cfg, True), micro_batch_tokens(cfg, False)
    training = tokens * per_token * shape.layers + tokens * shape.vocab * 12
    scoring = rows * per_token + rows * shape.vocab * 8
    policy = policy_memory(cfg, params, shape)
    assert policy.activations == max(training, scoring) + copies and "bfloat16 weight copies" in policy.line()
    # a frozen copy requires no gradient: autocast caches none of its weights, its residual stream is float32 all the same
    assert policy_memory(cfg, params, shape, "reference").activations == scoring
    # sharded ranks compute with FSDP2's bf16 parameters: every value at 2 bytes, no copies
    dp2 = recipe("policy.precision=bfloat16", "policy.dp_size=2")
    tokens, rows, values = micro_batch_tokens(dp2, True), micro_batch_tokens(dp2, False), shape.layer_values_per_token()
    training, scoring = tokens * values * 2 * shape.layers + tokens * shape.vocab * 12, rows * values * 2 + rows * shape.vocab * 8
    assert policy_memory(dp2, params, shape).activations == max(training, scoring)


@pytest.mark.parametrize("mode", ["sequence_packing", "dynamic_batching"])
def test_a_sample_longer_than_the_token_budget_is_a_micro_batch_of_its_own(mode: str) -> None:
    from nemo_like.models.policy.batching import first_fit_decreasing, token_budget_groups

    cfg = recipe(f"policy.{mode}.enabled=true", f"policy.{mode}.train_mb_tokens=16", f"policy.{mode}.logprob_mb_tokens=24")
    longest = cfg.policy.max_total_sequence_length  # 64
    lengths = [longest, 10, 5]
    if mode == "sequence_packing":
        largest = max(sum(lengths[i] for i in b) for b in first_fit_decreasing(lengths, 16))
    else:
        largest = max(len(g) * lengths[g[0]] for g in token_budget_groups(lengths, 16))
    assert largest == longest == micro_batch_tokens(cfg, True) == micro_batch_tokens(cfg, False)
    roomy = recipe(f"policy.{mode}.enabled=true", f"policy.{mode}.train_mb_tokens=100", f"policy.{mode}.logprob_mb_tokens=200")
    assert (micro_batch_tokens(roomy, True), micro_batch_tokens(roomy, False)) == (100, 200)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_sequence_packing_holds_the_dense_block_causal_mask_of_its_largest_micro_batch(precision: str) -> None:
    import torch

    from nemo_like.models.policy.batching import block_causal_mask
    from nemo_like.models.precision import compute_dtype

    params, shape = model_footprint(EMBEDDED_MODEL, "float32")
    packed = ["policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=16"]
    packed += ["policy.sequence_packing.logprob_mb_tokens=16", f"policy.precision={precision}", "policy.dp_size=2"]
    cfg = recipe(*packed)
    t = cfg.policy.max_total_sequence_length  # a 64-token sample packs alone: a 64 x 64 mask
    mask = block_causal_mask(torch.zeros(t, dtype=torch.long), compute_dtype(precision))
    value_bytes = mask.element_size()
    activations = t * shape.layer_values_per_token() * value_bytes * shape.layers + t * shape.vocab * 12
    assert policy_memory(cfg, params, shape).activations == activations + mask.nbytes
    # the mask a pass holds is small next to the layers here; building it peaks at two masks and two bool temporaries
    narrow = ModelShape(layers=1, hidden=1, intermediate=1, heads=1, kv_heads=1, head_dim=1, vocab=1)
    small = t * narrow.layer_values_per_token() * value_bytes + t * 12
    assert policy_memory(cfg, params, narrow).activations == max(small + t * t * value_bytes, t * t * (2 * value_bytes + 2))
    # a sliding-window model's packed row holds a second, windowed mask (one per layer type): model_footprint says so,
    # from the config as transformers reads it
    import json

    from nemo_like.models.loading import resolve_model_path
    from nemo_like.models.policy.batching import pack_rows, packed_model_mask

    config = json.loads((Path(resolve_model_path(EMBEDDED_MODEL)) / "config.json").read_text())
    assert shape.packed_masks == 1
    with tempfile.TemporaryDirectory() as tmp:
        sliding = {
            **config,
            "use_sliding_window": True,
            "sliding_window": 16,
            "max_window_layers": 0,
            "layer_types": ["sliding_attention"] * 4,
        }
        (Path(tmp) / "config.json").write_text(json.dumps(sliding))
        params, two = model_footprint(EMBEDDED_MODEL, "float32", None, str(Path(tmp) / "config.json"))
        from transformers import AutoConfig

        masks = packed_model_mask(pack_rows({"input_ids": torch.ones(1, t, dtype=torch.long), "attention_mask": torch.ones(1, t)},
                                            compute_dtype(precision)), AutoConfig.from_pretrained(tmp))  # fmt: skip
    assert two.packed_masks == 2 == len(masks)
    assert policy_memory(cfg, params, two).activations == activations + sum(m.nbytes for m in masks.values())


def saved_by_training_forward(model, ids, dist) -> int:
    """Bytes autograd keeps for backward in the trainer's own forward (:func:`sequence_logprobs_with_outside`)."""
    import torch

    from nemo_like.models.logprobs import sequence_logprobs_with_outside

    return saved_bytes(model, lambda: sequence_logprobs_with_outside(model, ids, torch.ones_like(ids), dist))


def test_top_p_top_k_and_lora_dropout_add_what_the_trainers_forward_saves_for_them() -> None:
    import torch

    from nemo_like.models.lora import apply_lora
    from nemo_like.models.processed_logprobs import SamplingDistribution

    # one training micro-batch of 4 rows x 64 tokens (the logprob pass smaller), as measured below
    small = ["policy.train_micro_batch_size=4", "policy.logprob_batch_size=1"]
    params, shape = model_footprint(EMBEDDED_MODEL, "float32")
    ids = torch.randint(0, shape.vocab, (4, 64))
    model = tiny_model()
    base = saved_by_training_forward(model, ids, SamplingDistribution())
    plain = policy_memory(recipe(*small), params, shape).activations
    for option, dist in (
        ("policy.generation.top_p=0.9", SamplingDistribution(top_p=0.9)),
        ("policy.generation.top_k=50", SamplingDistribution(top_k=50)),
    ):
        # a masked float32 copy of the logits and its bool mask: 5 bytes a logit (4 x 63 scored positions measured)
        measured = saved_by_training_forward(model, ids, dist) - base
        planned = policy_memory(recipe(*small, option), params, shape).activations - plain
        assert planned == 4 * 64 * shape.vocab * 5 and measured <= planned <= 1.05 * measured
        # chunked: the backward recomputes one chunk's logits at a time, and its masked copy and mask with them
        chunked = [*small, "policy.logprob_chunk_size=16"]
        extra = (
            policy_memory(recipe(*chunked, option), params, shape).activations - policy_memory(recipe(*chunked), params, shape).activations
        )
        assert extra == 16 * shape.vocab * 5
    # LoRA dropout: PEFT drops out each adapted projection's input, a copy lora_A saves
    lora = recipe(*small, "policy.lora_cfg.enabled=true", "policy.lora_cfg.dim=8")
    dropped = recipe(*small, "policy.lora_cfg.enabled=true", "policy.lora_cfg.dim=8", "policy.lora_cfg.dropout=0.1")
    lora_params, _ = model_footprint(EMBEDDED_MODEL, "float32", lora.policy.lora_cfg)
    saved = {}
    for cfg in (lora, dropped):
        torch.manual_seed(0)
        saved[cfg.policy.lora_cfg.dropout] = saved_by_training_forward(
            apply_lora(tiny_model(), cfg.policy.lora_cfg).train(), ids, SamplingDistribution()
        )
    measured = saved[0.1] - saved[0.0]
    planned = policy_memory(dropped, lora_params, shape).activations - policy_memory(lora, lora_params, shape).activations
    # per token and layer, the inputs of q, k, v, o, gate, up (128 each) and down (512) at 6 bytes
    assert planned == 4 * 64 * shape.layers * (6 * 128 + 512) * 6 and measured <= planned <= 1.2 * measured, (planned, measured)


@pytest.mark.parametrize("dp", [1, 3, 4])
def test_a_logprob_micro_batch_holds_at_most_the_ranks_share_of_the_rollout(dp: int) -> None:
    import torch

    from nemo_like.models.policy.rows import split_rows_unevenly

    rollout = ["grpo.num_prompts_per_step=6", "policy.train_global_batch_size=48", f"policy.dp_size={dp}"]
    cfg = recipe(*rollout, "policy.logprob_batch_size=64")
    rollout_rows = cfg.rollout_batch_size  # 48 sequences in dp row blocks (1: 48 rows, under logprob_batch_size; 3: 16; 4: 12)
    blocks = split_rows_unevenly({"input_ids": torch.zeros(rollout_rows, 2, dtype=torch.long)}, dp)
    largest = max(b["input_ids"].shape[0] for b in blocks)
    assert micro_batch_tokens(cfg, False) == min(64, largest) * cfg.policy.max_total_sequence_length
    assert largest == -(-48 // dp) and micro_batch_tokens(recipe(*rollout, "policy.logprob_batch_size=8"), False) == 8 * 64


def test_fsdp2_holds_the_root_unit_unsharded_on_every_rank_above_dp_1() -> None:
    params, shape = model_footprint(EMBEDDED_MODEL, "float32")
    assert [p.shape for p in params if p.root] == [(359, 128), (128,)]  # tied embeddings/head and the final norm
    one, two = policy_memory(recipe(), params, shape), policy_memory(recipe("policy.dp_size=2"), params, shape)
    assert one.unsharded_root == 0 and "unsharded root" not in one.line()
    assert two.unsharded_root == (359 * 128 + 128) * 4 == 184_320  # full size, fp32
    assert two.total == two.params + two.grads + two.optimizer + two.activations + 184_320
    assert "unsharded root 0.000" in two.line()
    bf16 = policy_memory(recipe("policy.dp_size=2", "policy.precision=bfloat16"), params, shape)
    assert bf16.unsharded_root == 92_160  # FSDP2's mixed-precision policy gathers bf16 copies
    assert policy_memory(recipe("policy.dp_size=2"), params, shape, "reference").unsharded_root == 184_320


def test_the_plan_lists_each_role_and_advises_when_a_gpu_is_too_small() -> None:
    cfg = recipe("cluster.gpus_per_node=2", "policy.generation.backend=hf")
    params, shape = model_footprint(EMBEDDED_MODEL, "float32")
    run_plan = decide_run_plan(cfg, (), 2)
    roomy = plan_memory(cfg, run_plan, params, shape, device_bytes=80 * GIB)
    assert [r.role for r in roomy.roles] == ["policy", "reference", "generation"] and roomy.fits
    tight = plan_memory(cfg, run_plan, params, shape, device_bytes=1024**2)
    assert tight.fits is False and any("activation_checkpointing" in line for line in tight.lines())


def test_a_cpu_nodes_ram_counts_the_workers_packing_may_put_there_and_the_refits_copy_of_the_weights() -> None:
    """Two nodes with PACK (the default) were planned as if each role's workers spread evenly (one policy rank a node),
    while Ray packed both policy ranks on one node: over the budget the plan accepted. A refit through /dev/shm keeps a
    third copy of the weights in the node's RAM for the whole run, which the plan left out."""
    params, shape = model_footprint(EMBEDDED_MODEL, "float32")

    def planned(*overrides: str):
        cfg = recipe(*overrides)
        return plan_memory(cfg, decide_run_plan(cfg, (), 2), params, shape)

    two = ["policy.dp_size=2", "cluster.num_nodes=2", "policy.generation.backend=hf"]
    packed, spread = planned(*two), planned(*two, "cluster.placement_strategy=SPREAD")
    # 2 CPUs a node hold four 0.5-CPU bundles, of any role (each has its own placement group): the four heaviest of the
    # six workers (summing each role's own most counted six: more than a node holds)
    heaviest = sorted((r.total for r in packed.roles if r.role != "refit buffer" for _ in range(r.workers)), reverse=True)[:4]
    buffer = {r.role: r for r in packed.roles}["refit buffer"].total
    assert packed.per_device["each node (RAM)"] == sum(heaviest) + buffer
    assert spread.per_device["each node (RAM)"] == sum(r.total * -(-r.workers // 2) for r in spread.roles)
    assert spread.per_device["each node (RAM)"] < packed.per_device["each node (RAM)"]
    assert "(PACK: up to 4 workers on one node of 2 CPUs; a run reads" in packed.lines()[-1], packed.lines()
    assert not any("workers on one node" in line for line in spread.lines())
    # before a cluster is reached its nodes' CPUs are cluster.num_cpus as declared, not capped by this machine's (the
    # plan of several nodes had changed with the cores of the machine that made it)
    big = recipe(*two, "cluster.num_cpus=64")
    assert (declared_node_cpus(big.cluster), declared_node_cpus(recipe("cluster.num_cpus=64").cluster)) == (64, local_cores())
    assert node_cpus(big.cluster) <= local_cores()  # a run's threads: its private cluster is this machine, or Ray's nodes
    big_plan = decide_run_plan(big, (), declared_node_cpus(big.cluster))
    assert "up to 128 workers on one node of 64 CPUs" in plan_memory(big, big_plan, params, shape).lines()[-1]
    weights = sum(math.prod(p.shape) for p in params)
    buffer = {r.role: r for r in planned("policy.generation.backend=hf").roles}["refit buffer"]
    assert (buffer.total, buffer.workers) == (4 * weights, 1) and "in /dev/shm, kept between refits" in buffer.line()
    bf16 = {r.role: r for r in planned("policy.generation.backend=hf", "policy.precision=bfloat16").roles}["refit buffer"]
    assert bf16.total == 2 * weights  # the engine's dtype, not the float32 master's
    for overrides in ([], ["policy.lora_cfg.enabled=true", "policy.generation.backend=vllm"]):  # inline: no refit; adapters only
        assert "refit buffer" not in {r.role for r in planned(*overrides).roles}, overrides
    merged = {r.role: r for r in planned("policy.lora_cfg.enabled=true", "policy.generation.backend=hf").roles}
    assert "in the object store during each refit" in merged["refit buffer"].line()


def test_raising_dp_is_advised_only_where_it_shrinks_the_device_that_is_over() -> None:
    params, shape = model_footprint(EMBEDDED_MODEL, "float32")
    # one CPU node: every policy rank (and its reference rank) shares the node's RAM, so more ranks need more of it
    for dp in (1, 2):
        cfg = recipe(f"policy.dp_size={dp}", "policy.generation.backend=hf")
        run_plan = decide_run_plan(cfg, (), 2)
        tight = plan_memory(cfg, run_plan, params, shape, device_bytes=1024**2)
        doubled = plan_memory(recipe(f"policy.dp_size={2 * dp}", "policy.generation.backend=hf"), run_plan, params, shape)
        assert doubled.per_device["each node (RAM)"] > tight.per_device["each node (RAM)"]
        fit = tight.lines()[-1]
        assert tight.fits is False and "raise policy.dp_size" not in fit
        assert f"a larger policy.dp_size (now {dp}) would not help (every rank shares the node's RAM)" in fit
        assert "lower policy.train_micro_batch_size (now 32) or policy.logprob_batch_size (now 64)" in fit
        assert ("raise cluster.num_nodes (now 1)" in fit) is (dp > 1)  # two nodes split two ranks, not one
    # with sequence packing the micro-batches are token budgets: those are what to lower (row counts do nothing there)
    cfg = recipe("policy.sequence_packing.enabled=true", "policy.generation.backend=hf")
    fit = plan_memory(cfg, decide_run_plan(cfg, (), 2), params, shape, device_bytes=1024**2).lines()[-1]
    assert "lower policy.sequence_packing.train_mb_tokens (now " in fit and "train_micro_batch_size" not in fit
    # GPUs: each rank has its own, and a second rank halves the shards
    cfg = recipe("cluster.gpus_per_node=2", "policy.generation.backend=hf")
    fit = plan_memory(cfg, decide_run_plan(cfg, (), 2), params, shape, device_bytes=1024**2).lines()[-1]
    assert "raise policy.dp_size (now 1)" in fit and "would not help" not in fit and "cluster.num_nodes" not in fit
    # ... where the declared GPUs hold the larger dp's ranks: else the advice says what it takes (following it alone was
    # refused by the same plan), and the micro-batches are advised too
    from nemo_like.algorithms.roles import reserved_gpus_problem

    for gpus, short in ((8, None), (3, "at policy.dp_size=2 the run's actors reserve 5 GPUs (policy 2, reference 2, generation 1)")):
        cfg = recipe(f"cluster.gpus_per_node={gpus}", "policy.generation.backend=hf")
        run_plan = decide_run_plan(cfg, (), 2)
        memory = plan_memory(
            cfg, run_plan, params, shape, device_bytes=1024**2, cluster_problem=lambda c, p=run_plan: reserved_gpus_problem(c, p)
        )
        fit = memory.lines()[-1]
        assert "raise policy.dp_size (now 1) to shard parameters, gradients and AdamW state over more devices" in fit
        assert (f"on more GPUs than declared ({short}" in fit) is (short is not None), fit
        assert ("lower policy.train_micro_batch_size (now 32) or policy.logprob_batch_size (now 64) or "
                "policy.max_total_sequence_length (now 64): these need no more GPUs" in fit) is (short is not None)  # fmt: skip
        offload = "set policy.dtensor_cfg.cpu_offload=true (with more than one policy worker) to keep parameters, gradients and AdamW state in host RAM"
        assert offload in fit and (f"{offload}, on more GPUs than declared ({short}" in fit) is (short is not None)


def test_only_changes_that_shrink_the_device_that_is_over_are_advised() -> None:
    """An HF engine on its own GPU the only device over: LoRA and smaller training micro-batches were advised (each
    leaves that GPU as it is, LoRA even grows nothing but the policy's), and a smaller rollout batch, what helps, was not."""
    params, shape = model_footprint(EMBEDDED_MODEL, "float32")
    long = ["policy.max_total_sequence_length=4096", "policy.generation.max_new_tokens=4000", "policy.logprob_chunk_size=256"]
    small = ["policy.train_micro_batch_size=1", "policy.logprob_batch_size=1", "policy.dtensor_cfg.activation_checkpointing=true"]
    cfg = recipe("cluster.gpus_per_node=2", "policy.generation.backend=hf", "grpo.num_prompts_per_step=64", *long, *small, *NO_VALIDATION)
    memory = plan_memory(cfg, decide_run_plan(cfg, (), 2), params, shape, device_bytes=1.5 * GIB)
    assert list(over_budget(memory.per_device, 1.5 * GIB)) == ["generation GPU"]
    fit = memory.lines()[-1]
    assert "lower grpo.num_prompts_per_step (now 64) under 32: the generation engine holds the KV cache" in fit
    assert "lower policy.max_total_sequence_length (now 4096)" in fit
    for useless in ("lora_cfg", "train_micro_batch_size", "logprob_batch_size", "cpu_offload", "raise policy.dp_size"):
        assert useless not in fit, useless
    # The reference GPU over from its logprob pass, the generation GPU not: a smaller rollout batch shrinks its
    # micro-batches, but the KV-cache reason would be untrue (logprob_batch_size is advised there). The policy runs no
    # logprob pass here (prev skipped: one optimizer step per rollout), so its GPU holds training's micro-batch only.
    logprob_heavy = recipe("cluster.gpus_per_node=2", "policy.generation.backend=hf", "grpo.num_prompts_per_step=8",
                           "policy.logprob_batch_size=64", "policy.train_micro_batch_size=1", "policy.train_global_batch_size=64",
                           "policy.max_total_sequence_length=4096", "policy.generation.max_new_tokens=64", *NO_VALIDATION)  # fmt: skip
    memory_over = plan_memory(logprob_heavy, decide_run_plan(logprob_heavy, (), 2), params, shape, device_bytes=0.6 * GIB)
    assert sorted(over_budget(memory_over.per_device, 0.6 * GIB)) == ["reference GPU"]
    assert "num_prompts_per_step" not in memory_over.lines()[-1] and "logprob_chunk_size" in memory_over.lines()[-1]
    halved = recipe(
        "cluster.gpus_per_node=2", "policy.generation.backend=hf", "grpo.num_prompts_per_step=16", *long, *small, *NO_VALIDATION
    )
    assert (
        plan_memory(halved, decide_run_plan(halved, (), 2), params, shape).per_device["generation GPU"]
        < memory.per_device["generation GPU"]
    )
    # Validating, the engine samples the validation set's 256 sequences in one call: that is its KV cache, and what to
    # lower (the rollout batch, 64 x 8 sampled in calls of 256 too, would not shrink it)
    validating = recipe("cluster.gpus_per_node=2", "policy.generation.backend=hf", "grpo.num_prompts_per_step=8", *long, *small)
    memory = plan_memory(validating, decide_run_plan(validating, (), 2), params, shape, device_bytes=1.5 * GIB)
    fit = memory.lines()[-1]
    assert "lower grpo.max_val_samples (now 256): a validation round samples its 256 sequences in one call" in fit
    assert "num_prompts_per_step" not in fit


def test_a_smaller_rollout_is_advised_for_the_inline_kv_cache_only_when_sampling_is_the_policys_peak() -> None:
    """The tiny recipe over its node from training: "the generation engine holds the KV cache" was the reason given,
    though inline sampling held 0.010 of the policy's 0.110 GiB of activations."""
    params, shape = model_footprint(EMBEDDED_MODEL, "float32")
    training_bound = recipe(*NO_VALIDATION)
    memory = plan_memory(training_bound, decide_run_plan(training_bound, (), 2), params, shape, device_bytes=0.15 * GIB)
    assert memory.fits is False and not memory.roles[0].samples_at_peak and "KV cache" not in memory.lines()[-1]
    sampling_bound = recipe("grpo.num_prompts_per_step=64", "policy.max_total_sequence_length=1024", "policy.generation.max_new_tokens=960",
                            "policy.train_micro_batch_size=1", "policy.logprob_batch_size=1", "policy.logprob_chunk_size=64",
                            *NO_VALIDATION)  # fmt: skip
    memory = plan_memory(sampling_bound, decide_run_plan(sampling_bound, (), 2), params, shape, device_bytes=0.5 * GIB)
    assert memory.roles[0].samples_at_peak and "lower grpo.num_prompts_per_step (now 64)" in memory.lines()[-1]


def test_the_policy_counts_a_logprob_micro_batch_only_when_it_runs_a_logprob_pass() -> None:
    """A 0.5B recipe on 40 GiB was refused for a 64-row logprob pass the run never makes (prev skipped, no LoRA)."""
    params, shape = model_footprint(EMBEDDED_MODEL, "float32")
    heavy = ("policy.generation.backend=hf", "policy.logprob_batch_size=64", "policy.train_micro_batch_size=1",
             "policy.max_total_sequence_length=4096", "policy.generation.max_new_tokens=64")  # fmt: skip
    lora_keys = ("policy.lora_cfg.enabled=true", "policy.lora_cfg.dim=4")  # the reference: the base, adapters disabled
    for extra, prev, lora in (((), False, False), (("policy.train_global_batch_size=32",), True, False), (lora_keys, False, True)):
        cfg = recipe(*heavy, *extra)
        value_bytes, hidden_bytes = activation_bytes(cfg)
        run_plan = decide_run_plan(cfg, (), 2)
        assert (run_plan.logprobs.compute_prev, run_plan.logprobs.reference_from_policy) == (prev, lora)
        lora_params = model_footprint(EMBEDDED_MODEL, "float32", cfg.policy.lora_cfg)[0] if lora else params
        planned = plan_memory(cfg, run_plan, lora_params, shape).roles[0]
        training = policy_memory(cfg, lora_params, shape, policy_logprob_pass=False).activations
        logprob = _logprob_activations(cfg, shape, value_bytes, hidden_bytes)
        assert logprob > training  # the logprob micro-batch is the larger: whether it counts decides the figure
        assert planned.activations == (logprob if prev or lora else training)


def test_the_inline_backends_policy_worker_holds_the_kv_cache_of_what_it_samples_at_once() -> None:
    # 64 prompts x 8 = 512 sequences of 1024 tokens, sampled 256 at a time; the tiny model's float32 KV is
    # 2 x 4 layers x 2 KV heads x 32 x 4 bytes = 2048 bytes a token: 256 x 2048 x 1024 = 512 MiB, + logits 256 x 359 x 4,
    # + the sampler's weight copies: per layer q|k|v (128 + 2 x 64) x 128 and gate|up 2 x 512 x 128, and with oneDNN the
    # packed down projection (256 x 128 x 512 multiply-accumulates: over PACK_MIN_MACS) and head (256 x 359 x 128);
    # the output projection's 256 x 128 x 128 is under it
    from nemo_like.utils.cpu_linear import onednn_linear_available

    long = ["grpo.num_prompts_per_step=64", "policy.max_total_sequence_length=1024", "policy.generation.max_new_tokens=960"]
    small = ["policy.train_micro_batch_size=1", "policy.logprob_batch_size=1", "policy.dtensor_cfg.activation_checkpointing=true"]
    cfg = recipe(*long, *small, "policy.logprob_chunk_size=256")
    params, shape = model_footprint(EMBEDDED_MODEL, "float32")
    run_plan = decide_run_plan(cfg, (), 2)
    assert run_plan.backend.value == "inline"
    packed = onednn_linear_available()
    copies = 4 * (4 * ((128 + 2 * 64) * 128 + 2 * 512 * 128 + (512 * 128 if packed else 0)) + (359 * 128 if packed else 0))
    assert sampler_copy_bytes(cfg, run_plan, shape) == copies
    policy = plan_memory(cfg, run_plan, params, shape, sampler_weight_copies=copies).roles[0]
    training = policy_memory(cfg, params, shape)
    sampling = 256 * 2048 * 1024 + 256 * 359 * 4 + copies
    assert sampling > training.activations and policy.activations == sampling
    assert policy.total == training.total - training.activations + sampling
    assert f"(kv cache of 256 sequences 0.500 + logits 0.000 + weight copies {copies / GIB:.3f})" in policy.line()
    bf16 = recipe(*long, *small, "policy.logprob_chunk_size=256", "policy.precision=bfloat16")
    # bf16: every projection of the float32 masters cast once per call to bf16 (2 bytes), the head's too, never packed
    # (the sampler runs under autocast)
    every = 4 * ((128 + 2 * 64) * 128 + 128 * 128 + 2 * 512 * 128 + 512 * 128) + 359 * 128
    assert sampler_copy_bytes(bf16, run_plan, shape) == 2 * every
    hf = recipe(*long, *small, "policy.generation.backend=hf")  # the HF engine samples with the same decoder, at 256 rows
    assert sampler_copy_bytes(hf, decide_run_plan(hf, (), 2), shape) == copies
    vllm = recipe("cluster.gpus_per_node=1", "policy.generation.colocated.enabled=false", "policy.generation.backend=vllm")
    assert sampler_copy_bytes(vllm, with_vllm(vllm), shape) == 0
    # a model the fused step does not serve (Qwen3: norms on the queries and keys) samples with its own forward: no copies
    from transformers import AutoConfig

    config = AutoConfig.for_model(**json.loads((Path(resolve_model_path(EMBEDDED_MODEL)) / "config.json").read_text()))
    qwen3 = AutoConfig.for_model("qwen3", **{k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")})
    with tempfile.TemporaryDirectory() as config_dir:
        qwen3.save_pretrained(config_dir)
        other = model_footprint("qwen3-shaped", "float32", config_path=config_dir)[1]
    assert shape.fused_sampler and not other.fused_sampler and sampler_copy_bytes(cfg, run_plan, other) == 0
    # ... but for autocast's bf16 casts of every projection and the head, held for the call as the fused step's are
    assert sampler_copy_bytes(bf16, run_plan, other) == sampler_copy_bytes(bf16, run_plan, replace(other, fused_sampler=True)) > 0


def test_cpu_offload_keeps_params_grads_and_adamw_state_in_host_ram_and_turns_a_refusal_into_a_fit() -> None:
    params, shape = model_footprint(EMBEDDED_MODEL, "float32")
    base = [
        "cluster.gpus_per_node=2",
        "policy.dp_size=2",
        "policy.generation.backend=hf",
        "policy.logprob_batch_size=1",
        "grpo.num_prompts_per_step=1",
        *NO_VALIDATION,
    ]
    small = ["policy.train_micro_batch_size=1", "policy.dtensor_cfg.activation_checkpointing=true"]
    cfg, offload = recipe(*base, *small), recipe(*base, *small, "policy.dtensor_cfg.cpu_offload=true")
    on_gpu = plan_memory(cfg, decide_run_plan(cfg, (), 2), params, shape, device_bytes=8 * 1024**2)
    assert on_gpu.fits is False and "set policy.dtensor_cfg.cpu_offload=true" in on_gpu.lines()[-1]
    offloaded = plan_memory(offload, decide_run_plan(offload, (), 2), params, shape, device_bytes=8 * 1024**2)
    policy = offloaded.roles[0]
    # one decoder layer of the tiny model, float32: q 128x128 + 128, k and v 64x128 + 64, o 128x128, gate/up/down
    # 512x128, 2 norms of 128 = 246,272 values
    assert policy.offloaded and policy.unsharded_layer == 246_272 * 4
    assert policy.total == policy.activations + policy.unsharded_root + policy.unsharded_layer
    assert "host RAM (cpu_offload)" in policy.line() and offloaded.fits is True
    # one policy worker shards nothing: FSDP2's offload never runs, and neither does the plan's
    one = recipe("cluster.gpus_per_node=1", "policy.generation.backend=hf", "policy.dtensor_cfg.cpu_offload=true")
    assert not policy_memory(one, params, shape).offloaded


def with_vllm(cfg):
    """The run plan of ``cfg`` with a vLLM engine (whether or not vllm is installed here)."""
    run_plan = decide_run_plan(cfg, (), 2)
    return replace(run_plan, backend=type(run_plan.backend)("vllm", "test"))


def test_vllm_kv_budget_counts_full_length_sequences() -> None:
    cfg = recipe("cluster.gpus_per_node=1", "policy.generation.backend=hf")
    params, shape = model_footprint(EMBEDDED_MODEL, "float32")
    memory = plan_memory(cfg, with_vllm(cfg), params, shape, device_bytes=8 * GIB)
    engine = memory.roles[-1]
    per_sequence = shape.kv_bytes_per_sequence(4, cfg.policy.max_total_sequence_length)  # float32: the engine's dtype
    # vLLM's own memory comes out of its share first: 0.5 GiB of non-torch memory, and its profile run's activations at
    # the LLM class's batch defaults (8,192 tokens, 256 sequences under 70 GiB): 8,192 x (3 x 512 + 2 x 128) x 4 bytes
    # + 256 x 359 x 4 x 2 (float32 logits and softmax) = 58,720,256 + 735,232
    own = GIB // 2 + 58_720_256 + 735_232
    assert vllm_overhead_bytes(shape, 4, 8 * GIB) == engine.activations == own == 596_326_400
    assert vllm_overhead_bytes(shape, 4, 80 * GIB) == GIB // 2 + 16384 * 1792 * 4 + 1024 * 359 * 8  # 16,384 and 1,024 at 70+
    assert engine.kv_cache == int(cfg.policy.generation.vllm_cfg.gpu_memory_utilization * 8 * GIB) - engine.params - own
    assert f"holds {engine.kv_cache // per_sequence} sequences" in engine.note and "vLLM's own 0.555 GiB" in engine.note


@pytest.mark.parametrize("latent", [False, True])
def test_kv_bytes_equal_what_a_transformers_model_caches(latent: bool) -> None:
    # Latent attention (DeepSeek-V2/V3's MLA) caches one latent of kv_lora_rank + qk_rope_head_dim values a layer, not
    # per-head keys and values (vLLM too: its MLA cache is one head of that width); planned as keys and values of its
    # config's head_dim (the rotary part) x 4 heads, the cache was 2 x 4 x 8 / (16 + 8) = 2.7x over here, 28x for V3
    from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig

    layers = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 50}
    config = (
        DeepseekV3Config(**layers, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                         qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                         n_group=1, topk_group=1)
        if latent else LlamaConfig(**layers, num_key_value_heads=2)
    )  # fmt: skip
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 1
    tokens = 7
    with torch.no_grad():
        cache = AutoModelForCausalLM.from_config(config).eval()(torch.randint(2, 50, (1, tokens)), use_cache=True).past_key_values
    cached = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    shape = ModelShape.from_hf_config(config)
    assert shape.kv_bytes_per_sequence(4, tokens) == cached
    assert shape.latent_kv_width == (16 + 8 if latent else 0) and shape.head_dim == (16 if latent else 8)
    # vLLM caches the latent of its MLA models (DeepSeek's) but builds MiniCPM3 with per-head keys and values
    per_head = 2 * 2 * 4 * 16 * 4 if latent else cached // tokens
    assert shape.kv_bytes_per_sequence(4, tokens, "vllm") == (cached if latent else per_head * tokens)
    if latent:
        minicpm3 = replace(shape, vllm_caches_latent=False)  # as from_hf_config reads a minicpm3 config
        assert minicpm3.kv_bytes_per_sequence(4, 1, "vllm") == per_head and minicpm3.kv_bytes_per_sequence(4, tokens) == cached
        assert not ModelShape.from_hf_config(replace_model_type(config, "minicpm3")).vllm_caches_latent


def cached_bytes(cache) -> int:
    """Every tensor a transformers cache holds: keys and values, a linear-attention layer's convolution and recurrent states."""
    total = 0
    for layer in cache.layers:
        for value in vars(layer).values():
            tensors = value.values() if isinstance(value, dict) else [value]
            total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor) and t.dim() > 0)
    return total


@pytest.mark.parametrize("family", ["mistral", "gemma3", "qwen3_next"])
def test_a_cache_that_does_not_grow_with_every_layer_is_planned_as_transformers_holds_it(family: str, tmp_path) -> None:
    """Sliding-window layers keep their last window - 1 tokens, a gated delta net a fixed state: planned as a full
    layer's keys and values for every token, Qwen3.5-9B's 32k-token sequence was 4 GiB (1.03 GiB; vLLM "held no
    sequence", exit 3) and Mistral v0.1's 8x its cache."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, MistralConfig, Qwen3NextConfig

    from nemo_like.models.footprint import model_footprint

    layers = {"vocab_size": 50, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8}  # fmt: skip
    config = {
        "mistral": lambda: MistralConfig(**layers, sliding_window=5),
        "gemma3": lambda: Gemma3TextConfig(**layers, sliding_window=5, layer_types=["sliding_attention"] * 3 + ["full_attention"]),
        "qwen3_next": lambda: Qwen3NextConfig(**layers, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
                                              num_experts_per_tok=2, linear_num_value_heads=4, linear_num_key_heads=2,
                                              linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
                                              layer_types=["linear_attention"] * 3 + ["full_attention"]),
    }[family]()  # fmt: skip
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 1
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path)
    shape = model_footprint(str(tmp_path), "float32")[1]
    full = ModelShape.from_hf_config(config)  # every layer planned as a full-attention one
    for tokens in (3, 12):  # within the window; past it
        with torch.no_grad():
            cached = cached_bytes(model(torch.randint(2, 50, (1, tokens)), use_cache=True).past_key_values)
        assert shape.kv_bytes_per_sequence(4, tokens) == cached, (tokens, cached)
        assert (full.kv_bytes_per_sequence(4, tokens) == cached) is (tokens == 3 and family != "qwen3_next")  # off but within a window
    assert bool(shape.unplanned()) is (family == "qwen3_next")  # the gated delta net's activations: a lower bound
    if family == "qwen3_next":  # in bfloat16 transformers keeps the recurrent state in float32 (vLLM: the model's dtype)
        with torch.no_grad():
            cached = cached_bytes(model.to(torch.bfloat16)(torch.randint(2, 50, (1, 12)), use_cache=True).past_key_values)
        assert shape.kv_bytes_per_sequence(2, 12) == cached > shape.kv_bytes_per_sequence(2, 12, "vllm")


MAMBA_SIZES = {"vocab_size": 60, "hidden_size": 64, "num_hidden_layers": 2}
MAMBA2_SIZES = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_d_conv": 4}
ATTENTION_SIZES = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}


def mamba_family_config(family: str):
    """A tiny config of one of the families whose Mamba blocks the plan sizes (``MAMBA_BLOCK_KEYS``): pure state-space
    models and hybrids with attention layers beside (Jamba, Bamba, Granite 4, Nemotron-H) or in the same layer
    (Falcon-H1, Zamba2)."""
    import transformers as t

    sizes, mamba1 = MAMBA_SIZES, {"state_size": 16, "expand": 2, "conv_kernel": 4}
    return {
        "mamba": lambda: t.MambaConfig(**sizes, **mamba1),
        "falcon_mamba": lambda: t.FalconMambaConfig(**sizes, **mamba1),
        "mamba2": lambda: t.Mamba2Config(**sizes, num_heads=8, head_dim=16, state_size=16, n_groups=2, expand=2, conv_kernel=4),
        "jamba": lambda: t.JambaConfig(**sizes, **ATTENTION_SIZES, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                                       attn_layer_period=2, attn_layer_offset=1, num_experts=1),
        "falcon_h1": lambda: t.FalconH1Config(**sizes, **ATTENTION_SIZES, **{**MAMBA2_SIZES, "mamba_d_head": 12}, mamba_d_ssm=96),  # not expand x H
        "bamba": lambda: t.BambaConfig(**sizes, **ATTENTION_SIZES, **MAMBA2_SIZES, mamba_expand=2, attn_layer_indices=[1]),
        "granitemoehybrid": lambda: t.GraniteMoeHybridConfig(**sizes, **ATTENTION_SIZES, **MAMBA2_SIZES, mamba_expand=2,
                                                             layer_types=["mamba", "attention"]),
        "nemotron_h": lambda: t.NemotronHConfig(**sizes, **ATTENTION_SIZES, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16,
                                                n_groups=2, conv_kernel=4, expand=2, layers_block_type=["mamba", "attention"]),
        "zamba2": lambda: t.Zamba2Config(**sizes, **ATTENTION_SIZES, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2,
                                         n_mamba_heads=8, mamba_headdim=16, layers_block_type=["mamba", "hybrid"]),
    }[family]()  # fmt: skip


@pytest.mark.parametrize("family", sorted(__import__("nemo_like.models.layer_kinds").models.layer_kinds.MAMBA_BLOCK_KEYS))
def test_a_mamba_blocks_state_is_planned_as_transformers_caches_it(family: str, tmp_path, capsys) -> None:
    """Each Mamba block keeps a convolution window (the model's dtype) and a recurrent state (float32) per sequence:
    the plan's cache of a sequence equals what transformers' cache holds after a bfloat16 forward, attention layers'
    keys and values included; a pure state-space model (no attention heads in its config) is planned too (its
    config was refused: "a model without attention layers, such as Mamba, is not planned")."""
    from transformers import AutoModelForCausalLM

    from nemo_like.models.footprint import cache_layout

    config = mamba_family_config(family)
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 1
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    shape = replace(ModelShape.from_hf_config(config), **cache_layout(config))
    assert shape.state_values and shape.state_float32_values and not any("fixed state" in line for line in shape.unplanned())
    for tokens in (3, 9):
        with torch.no_grad():
            out = model(torch.randint(2, 50, (1, tokens)), use_cache=True)
        cached = cached_bytes(getattr(out, "past_key_values", None) or out.cache_params)
        assert shape.kv_bytes_per_sequence(2, tokens) == cached, (tokens, cached)
    if not shape.heads:  # its config.json is read and planned as a run's
        from nemo_like.models.footprint import model_footprint

        config.save_pretrained(tmp_path)
        params, planned = model_footprint(str(tmp_path), "float32")
        layer_facts = {key: getattr(planned, key) for key in ("expert_block_values", "mlp_splits", "norm_values")}  # from modules
        assert planned == replace(shape, fused_sampler=False, **layer_facts)
        assert sum(math.prod(p.shape) for p in params) == sum(p.numel() for p in model.parameters())
        if family == "mamba2":  # as a teacher: `nemo-like plan` plans it and says what it leaves out
            from nemo_like.cli import main

            teacher = ("--teacher-config", f"org/mamba2={tmp_path / 'config.json'}", "teacher.model_name=org/mamba2")
            assert main(["plan", "--config", "examples/configs/distill_tiny_cpu.yaml", *teacher]) == 0
            out = capsys.readouterr().out
            assert "[plan] memory teacher x1:" in out and "[plan] not planned: teacher org/mamba2: what the model's 2" in out


def test_attention_beside_a_state_space_block_is_planned_with_its_keys_and_values() -> None:
    """Falcon-H1's "hybrid" layers run attention and a Mamba block side by side: counted as state only, their cache was
    0 bytes a sequence and the plan refused the run ("holds no sequence ... needs 0.000 MiB")."""
    from transformers import FalconH1Config

    from nemo_like.models.footprint import cache_layout

    config = FalconH1Config(num_hidden_layers=4)
    layout = cache_layout(config)
    assert layout["cached_layers"] == 4 and layout["state_layers"] == 4 and layout["state_values"] > 0
    shape = replace(ModelShape.from_hf_config(config), **layout)
    state = 4 * (layout["state_values"] * 2 + layout["state_float32_values"] * 4)
    assert shape.kv_bytes_per_sequence(2, 100) - state == ModelShape.from_hf_config(config).kv_bytes_per_sequence(2, 100) > 0


def test_a_config_whose_layers_differ_in_head_dim_is_planned_at_the_largest() -> None:
    # Gemma 4: sliding layers of head_dim 64, full-attention layers of global_head_dim 128; reading head_dim raises
    from transformers import Gemma4TextConfig

    config = Gemma4TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=64, global_head_dim=128, layer_types=["sliding_attention", "full_attention"], vocab_size=100)  # fmt: skip
    with pytest.raises(RuntimeError):
        _ = config.head_dim
    assert ModelShape.from_hf_config(config).head_dim == 128


def replace_model_type(config, model_type: str):
    """``config`` read as another model type's (the planner reads ``model_type`` and sizes only)."""
    copy = type(config).from_dict(config.to_dict())
    copy.model_type = model_type
    return copy


def test_a_vllm_engine_whose_kv_budget_holds_no_full_length_sequence_does_not_fit() -> None:
    params, shape = model_footprint(EMBEDDED_MODEL, "float32")
    # 0.0077 x 80 GiB = 661,424,963 bytes, less the float32 weights' 4,124,672 and vLLM's own 657,252,352 (0.5 GiB +
    # 16,384 x 1,792 x 4 + 1,024 x 359 x 8 on an 80 GiB GPU): 47,939 bytes of KV budget, under one sequence of 64 tokens
    # (2 x 4 layers x 2 KV heads x 32 x 4 bytes x 64 = 131,072)
    share = "policy.generation.vllm_cfg.gpu_memory_utilization=0.0077"
    cfg = recipe("cluster.gpus_per_node=1", "policy.generation.colocated.enabled=false", share)
    memory = plan_memory(cfg, with_vllm(cfg), params, shape, device_bytes=80 * GIB)
    engine = memory.roles[-1]
    assert engine.kv_cache == 47_939 and engine.kv_sequences == 0 and "holds 0 sequences" in engine.note
    assert max(memory.per_device.values()) < 80 * GIB and memory.fits is False
    # it names the device, what one sequence needs and the shortfall (131,072 - 47,939 = 83,133 bytes), and the share
    # that holds the weights, vLLM's own memory and one sequence: (4,124,672 + 657,252,352 + 131,072) / 80 GiB = 0.0077010,
    # rounded up to 3 significant digits
    assert memory.lines()[-1] == (
        "fits: NO: the vLLM engine's KV budget (0.046 MiB = 0.0077 x 80 GiB - weights 0.004 GiB - vLLM's own 0.612 GiB) on "
        "the generation GPU holds no full-length sequence: one of 64 tokens needs 0.125 MiB (short 0.079 MiB); raise "
        "policy.generation.vllm_cfg.gpu_memory_utilization (now 0.0077) to at least 0.00771 (weights, vLLM's own memory and "
        "one full-length sequence) or lower policy.max_total_sequence_length (now 64)"
    )
    enough = recipe(
        "cluster.gpus_per_node=1", "policy.generation.colocated.enabled=false", "policy.generation.vllm_cfg.gpu_memory_utilization=0.00771"
    )
    assert plan_memory(enough, with_vllm(enough), params, shape, device_bytes=80 * GIB).roles[-1].kv_sequences >= 1
    # a CPU engine's budget is kv_cache_space_gib (whole GiB): 1 GiB, under one sequence of 64 tokens of a model whose
    # float32 KV is 2 x 64 layers x 32 KV heads x 2048 x 4 bytes = 32 MiB a token: 2 GiB
    cpu = recipe("policy.generation.vllm_cfg.kv_cache_space_gib=1")
    wide = ModelShape(layers=64, hidden=128, intermediate=512, heads=32, kv_heads=32, head_dim=2048, vocab=359)
    fit = plan_memory(cpu, with_vllm(cpu), params, wide).lines()[-1]  # no node budget: the engine alone
    assert "KV budget (1.000 GiB: policy.generation.vllm_cfg.kv_cache_space_gib) in its node's RAM holds no full-length" in fit
    assert "needs 2.000 GiB (short 1.000 GiB); raise policy.generation.vllm_cfg.kv_cache_space_gib (now 1) to at least 2 (one" in fit
    roomy = recipe("cluster.gpus_per_node=1", "policy.generation.colocated.enabled=false")
    assert plan_memory(roomy, with_vllm(roomy), params, shape, device_bytes=80 * GIB).fits is True


def test_a_vllm_share_smaller_than_the_weights_says_by_how_much_and_advises_no_shorter_sequence() -> None:
    params, shape = model_footprint(EMBEDDED_MODEL, "float32")
    # 0.00004 x 80 GiB = 3,435,974 bytes, under the float32 weights' 4,124,672 and vLLM's own 657,252,352 bytes: short
    # 657,941,050 bytes (0.613 GiB)
    share = "policy.generation.vllm_cfg.gpu_memory_utilization=0.00004"
    cfg = recipe("cluster.gpus_per_node=1", "policy.generation.colocated.enabled=false", share)
    memory = plan_memory(cfg, with_vllm(cfg), params, shape, device_bytes=80 * GIB)
    fit = memory.lines()[-1]
    assert memory.fits is False and "max_total_sequence_length" not in fit
    assert (
        "the vLLM engine's weights (0.004 GiB) and its own memory (0.612 GiB) exceed "
        "policy.generation.vllm_cfg.gpu_memory_utilization x device = 0.003 GiB on the generation GPU (short 0.613 GiB)"
    ) in fit
    # a model whose per-sequence cache is not known (every layer a state of unknown size): still over its share
    unknown = replace(shape, cached_layers=0, state_layers=shape.layers)
    assert plan_memory(cfg, with_vllm(cfg), params, unknown, device_bytes=80 * GIB).lines()[-1] == fit
    assert "holds an unknown number of sequences" in plan_memory(roomy := recipe("cluster.gpus_per_node=1"), with_vllm(roomy), params,
                                                                 unknown, device_bytes=80 * GIB).roles[-1].note  # fmt: skip
    colocated = recipe("cluster.gpus_per_node=1", "policy.generation.colocated.enabled=true", share)
    assert (
        "0.003 GiB on the policy GPU (colocated) (short"
        in plan_memory(colocated, with_vllm(colocated), params, shape, 80 * GIB).lines()[-1]
    )
    assert "(short 0.613 GiB)" in fit and "above 0.0077 (the share" in fit and "a device with more memory" in fit
    # A device smaller than the weights and vLLM's own memory: no share holds them (it advised a share "above 1.3",
    # which the config refuses); the advice is a larger device, and bfloat16 for a float32 run only where it fits (vLLM's
    # 0.5 GiB of non-torch memory does not shrink with it): float32 needs 0.559 GiB, bfloat16 0.530
    tiny_gpu = recipe("cluster.gpus_per_node=1", "policy.generation.colocated.enabled=false")
    for device_gib, bf16_fits in ((0.5, False), (0.54, True)):
        fit = plan_memory(tiny_gpu, with_vllm(tiny_gpu), params, shape, device_bytes=device_gib * GIB).lines()[-1]
        assert f"more than the whole device ({device_gib:g} GiB): no policy.generation.vllm_cfg.gpu_memory_utilization (at most 1)" in fit
        assert ("or policy.precision=bfloat16 (0.53 GiB)" in fit) is bf16_fits and "gpu_memory_utilization (now" not in fit


@pytest.mark.parametrize("offload", [True, False])
def test_a_colocated_gpu_holds_the_larger_of_training_and_what_the_policy_keeps_while_the_engine_generates(offload: bool) -> None:
    params, shape = model_footprint(EMBEDDED_MODEL, "float32")
    cfg = recipe("cluster.gpus_per_node=1", f"policy.generation.colocated.offload_optimizer={str(offload).lower()}")
    memory = plan_memory(cfg, with_vllm(cfg), params, shape, device_bytes=8 * GIB)
    policy, engine = memory.roles[0], memory.roles[-1]
    # gradients and activations are freed before the engine wakes, the AdamW state moved to CPU memory when offloaded
    kept = policy.params + (0 if offload else policy.optimizer)
    assert engine.total == 4 * GIB > policy.total and "generation GPU" not in memory.per_device  # its share, whole
    assert memory.per_device["policy GPU"] == kept + engine.total < policy.total + engine.total
    assert "the larger of training" in memory.lines()[len(memory.roles)] and memory.fits
    # training beside the sleeping engine: sleep(level=1) frees its weights and KV cache, not its process's CUDA context
    training_heavy = dataclasses.replace(policy, activations=8 * GIB)
    assert colocated_peak(cfg, training_heavy, engine) == training_heavy.total + VLLM_NON_TORCH_BYTES
    # the whole GPU for the engine: policy rank 0's GPU is over by what the policy keeps while it generates
    full = recipe(
        "cluster.gpus_per_node=1",
        f"policy.generation.colocated.offload_optimizer={str(offload).lower()}",
        "policy.generation.vllm_cfg.gpu_memory_utilization=1.0",
    )
    over = plan_memory(full, with_vllm(full), params, shape, device_bytes=8 * GIB)
    fit = over.lines()[-1]
    assert over.fits is False and fit.startswith(f"fits: NO: policy GPU over by {kept / GIB:.3f} GiB")
    assert "lower policy.generation.vllm_cfg.gpu_memory_utilization (now 1)" in fit
    assert ("set policy.generation.colocated.offload_optimizer=true" in fit) is not offload


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_gpu_engines_hold_weights_and_kv_at_the_policys_precision_and_hf_only_its_batch(precision: str) -> None:
    params, shape = model_footprint(EMBEDDED_MODEL, "float32")
    parameters = sum(p.shard_bytes(1) for p in params) // 4
    value_bytes = {"float32": 4, "bfloat16": 2}[precision]
    per_sequence = shape.kv_bytes_per_sequence(value_bytes, 64)  # the tiny recipe's max_total_sequence_length
    # 64 prompts x 8 responses = 512 sequences: the HF engine samples them in batches of HF_MAX_BATCH_SIZE (256)
    cfg = recipe("cluster.gpus_per_node=1", f"policy.precision={precision}", "grpo.num_prompts_per_step=64")
    hf_plan = decide_run_plan(recipe("cluster.gpus_per_node=1", f"policy.precision={precision}", "policy.generation.backend=hf"), (), 2)
    hf = plan_memory(cfg, hf_plan, params, shape, 80 * GIB, sampler_weight_copies=sampler_copy_bytes(cfg, hf_plan, shape)).roles[-1]
    assert hf.params == parameters * value_bytes and hf.kv_cache == HF_MAX_BATCH_SIZE * per_sequence == 256 * per_sequence
    # and its sampler's fused q|k|v and gate|up copies at the engine's precision (nothing packed on a GPU), the logits of
    # its 256 rows' next token: 4 layers x ((128 + 2 x 64) x 128 + 2 x 512 x 128) values, 256 x 359 x 4 bytes
    assert hf.activations == 4 * ((128 + 2 * 64) * 128 + 2 * 512 * 128) * value_bytes + 256 * 359 * 4
    small = generation_memory(
        recipe("cluster.gpus_per_node=1", f"policy.precision={precision}", *NO_VALIDATION), "hf", parameters, shape, 80 * GIB
    )
    assert small.kv_cache == 64 * per_sequence  # a rollout batch of 8 x 8 at once
    # validating, the engine samples the validation set's 256 sequences in one call (it was planned for the 64)
    validating = generation_memory(recipe("cluster.gpus_per_node=1", f"policy.precision={precision}"), "hf", parameters, shape, 80 * GIB)
    assert validating.kv_cache == 256 * per_sequence
    vllm = generation_memory(cfg, "vllm", parameters, shape, 80 * GIB)
    assert vllm.params == parameters * value_bytes and f"holds {vllm.kv_cache // per_sequence} sequences" in vllm.note


def test_step_estimate_counts_2n_per_scored_token_and_6n_per_trained_token() -> None:
    cfg = recipe("grpo.skip_prev_logprobs=false")
    tokens = cfg.rollout_batch_size * cfg.policy.max_total_sequence_length
    step = step_estimate(cfg, decide_run_plan(cfg, (), 2), matmul_parameters=1000, peak_flops=1e9, mfu=0.5, trained_token_flops=6000.0)
    scored = 2000.0 * tokens
    assert step.flops == {"generation": scored, "prev logprobs": scored, "reference logprobs": scored, "training": 6000.0 * tokens}
    assert step.seconds == pytest.approx(12000.0 * tokens / 5e8)  # one policy rank, one reference rank, one engine
    # an upper bound: dynamic sampling may generate up to dynamic_sampling_max_gen_batches batches, activation
    # checkpointing runs each training forward again (2N more per trained token)
    bound = recipe("grpo.skip_prev_logprobs=false", "grpo.use_dynamic_sampling=true", "grpo.dynamic_sampling_max_gen_batches=3",
                   "policy.dtensor_cfg.activation_checkpointing=true")  # fmt: skip
    step = step_estimate(bound, decide_run_plan(bound, (), 2), 1000, 1e9, 0.5, trained_token_flops=6000.0)
    assert step.flops["generation"] == 3 * scored and step.flops["training"] == 8000.0 * tokens


@pytest.mark.parametrize("dp, tp", [(4, 1), (2, 2)])
def test_step_estimate_spreads_each_phase_over_the_ranks_or_engines_that_run_it(dp: int, tp: int) -> None:
    ranks = (f"policy.dp_size={dp}", f"policy.dtensor_cfg.tensor_parallel_size={tp}")
    # On a CPU cluster a device is a node: ranks sharing one run no faster than one (a dp of 4 had been 4x faster)
    cpu = recipe("grpo.skip_prev_logprobs=false", *ranks)
    on_cpu = step_estimate(cpu, decide_run_plan(cpu, (), 2), 1000, 1e9, 0.5, trained_token_flops=6000.0)
    assert set(on_cpu.devices.values()) == {1}
    # two nodes of 2 CPUs: PACK puts the four ranks (0.5 CPU each) on one of them, as the thread split counts them
    # (the estimate had spread them over both); SPREAD puts two on each
    for strategy, nodes in (("PACK", 1), ("SPREAD", 2)):
        two_nodes = recipe("grpo.skip_prev_logprobs=false", *ranks, "cluster.num_nodes=2", f"cluster.placement_strategy={strategy}")
        step = step_estimate(two_nodes, decide_run_plan(two_nodes, (), 2), 1000, 1e9, 0.5, trained_token_flops=6000.0)
        assert step.devices["training"] == nodes, strategy
    cfg = recipe("grpo.skip_prev_logprobs=false", *ranks, "cluster.gpus_per_node=8")
    tokens = cfg.rollout_batch_size * cfg.policy.max_total_sequence_length
    step = step_estimate(cfg, decide_run_plan(cfg, (), 2), matmul_parameters=1000, peak_flops=1e9, mfu=0.5, trained_token_flops=6000.0)
    assert step.devices == {"generation": 1, "prev logprobs": 4, "reference logprobs": 4, "training": 4}
    # the one engine generates every token; the policy and reference ranks split the passes and the training
    assert step.seconds == pytest.approx((2000.0 + (2000.0 + 2000.0 + 6000.0) / 4) * tokens / 5e8)
    assert "training " in step.line() and "s on 4 devices" in step.line() and "generation " in step.line()


def test_teacher_passes_cost_each_teachers_own_parameters() -> None:
    cfg = recipe("teacher.model_name=embedded:tiny-arith-teacher", "+teacher.by_task.math=big", "+env.math.num_workers=1")
    tokens = cfg.rollout_batch_size * cfg.policy.max_total_sequence_length
    teachers = {"embedded:tiny-arith-teacher": 3000, "big": 7000}
    step = step_estimate(cfg, decide_run_plan(cfg, (), 2), 1000, 1e9, 0.5, teachers, trained_token_flops=6000.0)
    # the teachers score disjoint rows at the same time: at most the largest one scoring every row
    assert step.flops["teacher logprobs"] == 2.0 * 7000 * tokens and step.devices["teacher logprobs"] == 1
    kl = recipe("teacher.model_name=embedded:tiny-arith-teacher", "distillation.kl_weight=0.5", "distillation.advantage_weight=0")
    step = step_estimate(kl, decide_run_plan(kl, (), 2), 1000, 1e9, 0.5, {"embedded:tiny-arith-teacher": 3000}, trained_token_flops=6000.0)
    assert "teacher logprobs" not in step.flops and step.flops["teacher copy (KL term)"] == 2.0 * 3000 * tokens


def test_the_plan_command_costs_a_teacher_with_its_own_config(tmp_path) -> None:
    import json

    from nemo_like.models.footprint import matmul_parameters, memory_report
    from nemo_like.models.loading import resolve_model_path

    student = json.loads((Path(resolve_model_path(EMBEDDED_MODEL)) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**student, "intermediate_size": 8 * student["intermediate_size"]}))
    cfg = recipe(f"teacher.model_name={tmp_path}")
    n, teacher_n = matmul_parameters(EMBEDDED_MODEL), matmul_parameters(str(tmp_path))
    assert teacher_n > 3 * n
    lines, _ = memory_report(cfg, decide_run_plan(cfg, (), 2), None, peak_flops=1e9, mfu=0.5)
    seconds = 2.0 * teacher_n * cfg.rollout_batch_size * cfg.policy.max_total_sequence_length / 5e8
    assert f"teacher logprobs {seconds:.2f}s on 1 device" in lines[-1]


def test_by_task_teachers_are_each_planned_as_the_run_starts_them(tmp_path) -> None:
    import json

    from nemo_like.algorithms.roles import role_requests
    from nemo_like.models.footprint import memory_report
    from nemo_like.models.loading import resolve_model_path

    student = json.loads((Path(resolve_model_path(EMBEDDED_MODEL)) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**student, "intermediate_size": 8 * student["intermediate_size"]}))
    cfg = recipe("teacher.model_name=embedded:tiny-arith-teacher", f"+teacher.by_task.math={tmp_path}", "+env.math.num_workers=1")
    run_plan = decide_run_plan(cfg, (), 2)
    params, shape = model_footprint(EMBEDDED_MODEL, "float32")
    small, big = model_footprint("embedded:tiny-arith-teacher", "float32"), model_footprint(str(tmp_path), "float32")
    memory = plan_memory(cfg, run_plan, params, shape, None, {"embedded:tiny-arith-teacher": small, str(tmp_path): big})
    planned = [r for r in memory.roles if r.role.startswith("teacher")]
    started = [r for r in role_requests(cfg, run_plan) if r.role == "teacher"]
    assert [r.workers for r in planned] == [r.count for r in started] == [1, 1]
    assert [r.role for r in planned] == ["teacher:embedded:tiny-arith-teacher", f"teacher:{tmp_path}"]
    assert planned[1].params > planned[0].params  # each at its own size
    lines, _ = memory_report(cfg, run_plan, None, None, 0.4)
    assert sum(line.startswith("memory teacher:") for line in lines) == 2


@pytest.mark.parametrize("teacher_precision", ["float32", "bfloat16"])
def test_a_teacher_is_planned_at_its_own_precision(teacher_precision: str) -> None:
    """A teacher's workers compute at teacher.precision; the plan sized their activations (and the KL term's teacher
    copy's hidden states) at policy.precision."""
    common = ["policy.precision=bfloat16", "policy.dp_size=2", "teacher.model_name=embedded:tiny-arith-teacher"]
    cfg = recipe(*common, f"teacher.precision={teacher_precision}")
    params, shape = model_footprint(EMBEDDED_MODEL, "bfloat16")
    teacher = model_footprint("embedded:tiny-arith-teacher", "float32")
    memory = plan_memory(cfg, decide_run_plan(cfg, (), 2), params, shape, None, {"embedded:tiny-arith-teacher": teacher})
    (planned,) = [r for r in memory.roles if r.role == "teacher"]
    as_started = policy_memory(cfg.teacher_config(), *teacher, "teacher")
    at_student = policy_memory(cfg, *teacher, "teacher")
    assert (planned.activations, planned.unsharded_root) == (as_started.activations, as_started.unsharded_root)
    assert (planned.activations > at_student.activations) == (teacher_precision == "float32")
    kl = recipe(*common, f"teacher.precision={teacher_precision}", "distillation.kl_weight=0.5", "policy.logprob_chunk_size=64")
    half = recipe(*common, "teacher.precision=bfloat16", "distillation.kl_weight=0.5", "policy.logprob_chunk_size=64")
    student = policy_memory(kl, params, shape)
    hidden = micro_batch_tokens(kl, True) * teacher[1].hidden  # the teacher copy's last hidden states, chunked KL
    gap = with_teacher_copy(kl, student, *teacher).activations - with_teacher_copy(half, student, *teacher).activations
    assert gap == (2 * hidden if teacher_precision == "float32" else 0)
    # packed rows: the teacher copy builds its own masks, in its dtype (a float32 teacher of a bf16 student: a new one;
    # the same dtype: the student's, and a sliding-window teacher's windowed second)
    packing = ("policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=64")
    packed_kl = recipe(*common, f"teacher.precision={teacher_precision}", "distillation.kl_weight=0.5", *packing)
    unpacked_kl = recipe(*common, f"teacher.precision={teacher_precision}", "distillation.kl_weight=0.5", "policy.train_micro_batch_size=1")
    t = micro_batch_tokens(packed_kl, True)
    assert t == micro_batch_tokens(unpacked_kl, True) == 64
    teacher_bytes = 4 if teacher_precision == "float32" else 2
    for masks in (1, 2):
        sliding = (teacher[0], dataclasses.replace(teacher[1], packed_masks=masks))
        extra = with_teacher_copy(packed_kl, student, *sliding).activations - with_teacher_copy(unpacked_kl, student, *sliding).activations
        assert extra == (masks - (teacher_bytes == 2)) * t * t * teacher_bytes, masks


def test_a_teacher_not_on_this_machine_is_named_by_its_key_and_planned_with_teacher_config(capsys) -> None:
    from nemo_like.cli import main

    teacher, config = "Qwen/Qwen2.5-7B-Instruct", "examples/cluster/model_configs/Qwen2.5-0.5B-Instruct.json"
    assert main(["plan", f"teacher.model_name={teacher}"]) == 2
    err = capsys.readouterr().err
    assert f"teacher.model_name={teacher!r}: its config.json is not on this machine" in err
    assert f"pass --teacher-config {teacher}=PATH" in err and "policy.model_name" not in err
    assert main(["plan", f"+teacher.by_task.math={teacher}", "+env.math.num_workers=1"]) == 2
    assert f"teacher.by_task.math={teacher!r}" in capsys.readouterr().err
    assert main(["plan", "--teacher-config", f"{teacher}={config}", f"teacher.model_name={teacher}"]) == 0
    assert "[plan] memory teacher x1:" in capsys.readouterr().out


def test_a_model_whose_layers_the_plan_cannot_lay_out_is_planned_without_memory_figures(capsys, tmp_path) -> None:
    """GPT-2's layers are transformer.h: train runs it ("memory: not estimated") and plan stopped with exit 2, printing
    nothing of the run plan; as a teacher too."""
    from transformers import GPT2Config

    from nemo_like.cli import main

    GPT2Config(vocab_size=359, n_embd=32, n_layer=2, n_head=2).save_pretrained(tmp_path)
    config = str(tmp_path / "config.json")
    policy = ["--model-config", config, "policy.model_name=org/gpt2"]
    teacher = [
        "--config",
        "examples/configs/distill_tiny_cpu.yaml",
        "--teacher-config",
        f"org/gpt2={config}",
        "teacher.model_name=org/gpt2",
    ]
    for args in (policy, teacher):
        assert main(["plan", *args, "--device-memory-gib", "8"]) == 0
        out = capsys.readouterr().out
        assert "[plan] generation backend:" in out and "memory policy" not in out and "fits" not in out
        assert out.splitlines()[-1].startswith("[plan] not planned: the memory of every role and the fit (") and "GPT2LMHeadModel" in out
    # what does not fit the declared cluster whatever the memory is still refused (the 1B recipe's actors take 8 GPUs)
    assert main(["plan", "--config", "examples/configs/grpo_math_1B.yaml", *policy, "cluster.gpus_per_node=4"]) == 3
    assert capsys.readouterr().out.splitlines()[-1].startswith("[plan] fits: NO: the run's actors reserve 8 GPUs")


def test_the_plan_commands_training_time_falls_with_more_policy_ranks() -> None:
    import re

    from nemo_like.models.footprint import memory_report

    def training_seconds(dp: int, *where: str) -> float:
        cfg = recipe(f"policy.dp_size={dp}", "policy.generation.backend=hf", *where)
        lines, _ = memory_report(cfg, decide_run_plan(cfg, (), 2), None, peak_flops=1e9, mfu=0.5)
        return float(re.search(r"training ([0-9.]+)s", lines[-1]).group(1))

    gpus = "cluster.gpus_per_node=4"
    assert training_seconds(1, gpus) > 10 and training_seconds(4, gpus) == pytest.approx(training_seconds(1, gpus) / 4, rel=0.01)
    assert training_seconds(4) == training_seconds(1)  # ranks sharing one CPU node share its cores


def test_the_plan_commands_lora_training_is_charged_about_4n_per_token() -> None:
    import re

    from nemo_like.models.footprint import matmul_parameters, memory_report

    cfg = recipe("policy.lora_cfg.enabled=true", "policy.lora_cfg.dim=4", "policy.generation.backend=hf")
    lines, _ = memory_report(cfg, decide_run_plan(cfg, (), 2), None, peak_flops=1e9, mfu=0.5)
    seconds = float(re.search(r"training ([0-9.]+)s", lines[-1]).group(1))
    four_n = 4.0 * matmul_parameters(EMBEDDED_MODEL) * cfg.rollout_batch_size * cfg.policy.max_total_sequence_length / 5e8
    assert four_n < seconds < 1.2 * four_n  # the frozen base gets no weight gradients: not 6N


def test_the_plan_command_prints_the_plan_checks_the_fit_and_names_a_missing_model_config(capsys) -> None:
    from nemo_like.cli import main

    assert main(["plan", "--device-memory-gib", "64", "--peak-tflops", "0.2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[plan] prev logprobs") and "[plan] fits: yes" in out and out[-1].startswith("[plan] step time at most")
    # the split is this machine's: the run's nodes may have other CPUs
    assert any(
        line.startswith("[plan] threads per worker on")
        and "CPUs of this machine" in line
        and line.endswith("; a run splits its nodes' own CPUs")
        for line in out
    )
    assert main(["plan", "--device-memory-gib", "0.01"]) == 3  # the tiny run does not fit in 10 MiB
    out = capsys.readouterr().out
    assert "fits: NO: each node (RAM) over by " in out and "GiB); set policy.dtensor_cfg.activation_checkpointing=true" in out
    gpu_recipe = "examples/configs/grpo_gsm8k_0.5B_1gpu.yaml"
    assert main(["plan", "--config", gpu_recipe]) == 2
    assert "pass --model-config PATH" in capsys.readouterr().err
    config = "examples/cluster/model_configs/Qwen2.5-0.5B-Instruct.json"
    assert main(["plan", "--config", gpu_recipe, "--model-config", config, "--device-memory-gib", "139"]) == 0
    assert "params 1.840 + grads 1.840 + optimizer 3.681" in capsys.readouterr().out  # 494,032,768 fp32 values: 1.840 GiB


def test_lora_advice_on_a_cpu_keeps_the_engine_and_a_vllm_node_is_told_its_kv_space(capsys) -> None:
    """On a CPU, auto picks vLLM for a LoRA run, whose KV space (at least 1 GiB) is in the node's RAM: "train LoRA
    adapters" made the tiny recipe's node 5x fuller (0.19 -> 1.12 GiB), and a vLLM node over was never told the KV
    space was what filled it. LoRA is advised with the HF engine, which shrinks the node, and a vLLM run is told."""
    from nemo_like.cli import main
    from nemo_like.plan.backend import vllm_available

    tiny = ["plan", "--config", "examples/configs/grpo_tiny_cpu.yaml", "--device-memory-gib", "0.15"]

    def node_and_fit(*overrides: str) -> tuple[float, str]:
        assert main([*tiny, *overrides]) == 3
        out = capsys.readouterr().out.splitlines()
        node = next(line for line in out if line.startswith("[plan] memory on each node (RAM): "))
        return float(node.split(": ")[1].split()[0]), next(line for line in out if "fits: NO" in line)

    full, advice = node_and_fit()
    if not vllm_available():
        assert "train LoRA adapters (policy.lora_cfg.enabled=true): no full" in advice
        return
    assert "train LoRA adapters (policy.lora_cfg.enabled=true) with policy.generation.backend=hf: no full" in advice
    with_hf, _ = node_and_fit("policy.lora_cfg.enabled=true", "policy.generation.backend=hf")
    on_vllm, vllm_advice = node_and_fit("policy.lora_cfg.enabled=true")
    assert with_hf < full < 1 < on_vllm  # the advice as given shrinks the node; LoRA alone filled it
    assert "set policy.generation.backend=hf: vLLM's KV space (policy.generation.vllm_cfg.kv_cache_space_gib, now 1 GiB)" in vllm_advice
    # inline generation does not serve adapters: the advice names the engine that does (the plan failed: "inline is not
    # possible here", for a LoRA the user had not enabled)
    _, inline_advice = node_and_fit("policy.generation.backend=inline")
    assert "train LoRA adapters (policy.lora_cfg.enabled=true) with policy.generation.backend=hf: no full" in inline_advice
    # a mixture of experts' LoRA run keeps the HF engine on a CPU (the run plan's experts): no "auto would pick vLLM"
    cfg = load_config(DEFAULT_RECIPE, [], warn=False)
    kv = "policy.generation.vllm_cfg.kv_cache_space_gib, now 1 GiB"
    assert "auto would pick vLLM" in lora_advice(cfg, "hf", kv) and "auto would pick vLLM" not in lora_advice(
        cfg, "hf", kv, PolicyModel(experts=True)
    )


def test_a_smaller_engine_share_is_advised_only_where_it_shrinks_the_gpu_that_is_over(capsys) -> None:
    """The 1.5B recipe on 20 GiB GPUs: policy rank 0's GPU is over by its training peak, which comes before the colocated
    engine wakes; "lower gpu_memory_utilization" was advised first (and, at 0.1, beside "raise it above 0.144")."""
    from nemo_like.cli import main

    root = Path(__file__).resolve().parents[3]
    args = ["plan", "--config", str(root / "examples/configs/grpo_math_1B.yaml"), "--device-memory-gib", "20"]
    args += ["--model-config", str(root / "examples/cluster/model_configs/Qwen2.5-1.5B-Instruct.json")]
    for share in ("0.5", "0.1"):
        assert main([*args, f"policy.generation.vllm_cfg.gpu_memory_utilization={share}"]) == 3
        fit = next(line for line in capsys.readouterr().out.splitlines() if "fits: NO" in line)
        assert "policy GPU over by" in fit and "lower policy.generation.vllm_cfg.gpu_memory_utilization" not in fit, fit


def test_the_plan_command_refuses_what_the_declared_cluster_or_the_models_heads_cannot_hold(tmp_path, capsys) -> None:
    """It printed "fits: yes" (exit 0) for recipes the run refuses: actors reserving more GPUs than cluster.num_nodes x
    cluster.gpus_per_node declares, and a tensor-parallel degree that does not divide the KV heads (refused only
    after the workers started)."""
    from nemo_like.cli import main

    recipe_1b = ["--config", "examples/configs/grpo_math_1B.yaml"]
    model = ["--model-config", "examples/cluster/model_configs/Qwen2.5-1.5B-Instruct.json", "--device-memory-gib", "80"]
    assert main(["plan", *recipe_1b, *model]) == 0
    assert "[plan] fits: yes" in capsys.readouterr().out
    assert main(["plan", *recipe_1b, *model, "policy.dp_size=8"]) == 3
    assert (
        "[plan] fits: NO: the run's actors reserve 16 GPUs (policy 8, reference 8) but cluster.num_nodes x "
        "cluster.gpus_per_node declares 8: short by 8"
    ) in capsys.readouterr().out
    # refused as train refuses it (exit 2), on the --model-config file as on a model here
    assert main(["plan", *recipe_1b, *model, "policy.dp_size=1", "policy.dtensor_cfg.tensor_parallel_size=4"]) == 2
    assert "error: policy.dtensor_cfg.tensor_parallel_size=4 must divide num_attention_heads=12 and num_key_value_heads=2" in (
        capsys.readouterr().err
    )
    # a teacher's workers take the student's tensor-parallel degree: its heads are checked too, the teacher named
    teacher = ["--teacher-config", "T=examples/cluster/model_configs/Qwen2.5-0.5B-Instruct.json", "teacher.model_name=T"]
    tp4 = ["policy.dp_size=1", "policy.dtensor_cfg.tensor_parallel_size=4", "loss_fn.reference_policy_kl_penalty=0"]
    divisible = json.loads(Path("examples/cluster/model_configs/Qwen2.5-1.5B-Instruct.json").read_text())
    divisible["num_key_value_heads"] = 4  # a student whose heads 4 ranks divide
    (tmp_path / "config.json").write_text(json.dumps(divisible))
    assert main(["plan", *recipe_1b, "--model-config", str(tmp_path / "config.json"), *teacher, *tp4]) == 2
    assert "teacher.model_name='T': policy.dtensor_cfg.tensor_parallel_size=4 must divide num_attention_heads=14" in (
        capsys.readouterr().err
    )
    # GPU shares the declared node cannot place (three of 0.6 on 4 GPUs beside two whole ones: 3.8 <= 4 in total),
    # which a run refuses once Ray has started; no GPU is idle then
    shares = [
        "--config",
        REWARDS_RECIPE,
        "cluster.gpus_per_node=4",
        "env.arithmetic.num_workers=3",
        "+env.arithmetic.sources.rm.num_gpus=0.6",
    ]
    assert main(["plan", *shares, "--device-memory-gib", "8"]) == 3
    out, err = capsys.readouterr()
    assert "fits: NO: The cluster cannot place this recipe on its nodes: 3 bundles ask for more than half a GPU" in out, out
    assert "short by GPU 1" in out and "would stay idle" not in err, (out, err)
    assert main(["plan", "policy.model_name=embedded:tiny-arith-qwen"]) == 2  # a typo: one line naming the key
    assert (
        "error: policy.model_name='embedded:tiny-arith-qwen': 'embedded:tiny-arith-qwen' is not a shipped model" in capsys.readouterr().err
    )


REWARDS_RECIPE = "examples/configs/grpo_tiny_rewards_cpu.yaml"


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_a_reward_model_is_planned_with_the_weights_its_actor_loads(precision: str) -> None:
    """The reward models the environments load were named, not counted ('not planned'): their weights are now the
    bytes a real scorer holds, each actor on a GPU of its own on a GPU cluster (a CPU one in its node's RAM), and a
    GPU it does not fit is refused with advice naming the environment's keys."""
    from nemo_like.algorithms.roles import scorer_specs
    from nemo_like.environments.reward_model_scorer import RewardModelScorer
    from nemo_like.models.footprint import memory_report, scorer_roles

    cfg = load_config(REWARDS_RECIPE, [f"+env.arithmetic.sources.rm.precision={precision}"])
    spec, _judge = scorer_specs(cfg)
    assert spec.role == "reward_model:arithmetic.rm" and spec.precision == precision and spec.num_gpus == 0
    (role,), unplanned = scorer_roles([spec])
    real = RewardModelScorer(resolve_model_path(spec.model_name), precision)
    assert role.params == sum(p.numel() * p.element_size() for p in real.model.parameters()) and not unplanned
    on_gpu = load_config(REWARDS_RECIPE, ["cluster.gpus_per_node=4", "+env.arithmetic.sources.rm.num_gpus=1"])
    run_plan = decide_run_plan(on_gpu, (), 2)
    lines, fits = memory_report(on_gpu, run_plan, 80, None, 0.4, scorers=scorer_specs(on_gpu))
    assert fits and any(line.startswith("memory on reward_model:arithmetic cuda:0 GPU: ") for line in lines)  # the actor's GPU 0
    timed, _ = memory_report(on_gpu, run_plan, 80, 1e15, 0.4, scorers=scorer_specs(on_gpu))  # the step time leaves them out
    assert timed[-1].startswith("step time at most") and timed[-1].endswith(
        "; not counted: the scoring of reward_model:arithmetic.rm, judge:arithmetic.judge"
    )
    lines, fits = memory_report(on_gpu, run_plan, 0.02, None, 0.4, scorers=scorer_specs(on_gpu))  # 20 MiB: all over
    assert fits is False and "reward_model:arithmetic cuda:0 GPU: lower its environment's max_tokens_per_batch" in lines[-1]
    huge = load_config(
        REWARDS_RECIPE,
        ["cluster.gpus_per_node=4", "+env.arithmetic.sources.rm.num_gpus=1", "+env.arithmetic.sources.rm.max_tokens_per_batch=10000000"],
    )
    lines, fits = memory_report(huge, decide_run_plan(huge, (), 2), 8, None, 0.4, scorers=scorer_specs(huge))  # the scorer alone over
    assert fits is False and "max_tokens_per_batch" in lines[-1] and "policy." not in lines[-1], lines[-1]  # no policy advice
    on_cpu = load_config(REWARDS_RECIPE, ["cluster.gpus_per_node=4"])  # num_gpus 0: its node's RAM, no GPU of its own
    lines, _ = memory_report(on_cpu, decide_run_plan(on_cpu, (), 2), 80, None, 0.4, scorers=scorer_specs(on_cpu))
    assert not any("reward_model" in line and "GPU" in line for line in lines)
    assert any("reward_model:arithmetic.rm x1" in line and "in its node's RAM" in line for line in lines)


def test_reward_models_that_share_a_gpu_are_planned_on_one_device() -> None:
    """A composite actor's reward models of half a GPU each are placed on one GPU (cuda:0), and Ray may pack two actors
    of half a GPU on one: each had been planned on a GPU of its own, the shared GPU's sum never checked."""
    from nemo_like.algorithms.roles import scorer_specs
    from nemo_like.models.footprint import memory_report

    shared = load_config(
        REWARDS_RECIPE,
        ["cluster.gpus_per_node=4", "+env.arithmetic.sources.rm.num_gpus=0.5", "+env.arithmetic.sources.rm2.class=reward_model",
         "+env.arithmetic.sources.rm2.num_gpus=0.5"],
    )  # fmt: skip
    lines, _ = memory_report(shared, decide_run_plan(shared, (), 2), 80, None, 0.4, scorers=scorer_specs(shared))
    per_worker = [float(line.split(": ")[1].split(" GiB")[0]) for line in lines if line.startswith("memory reward_model:arithmetic.rm")]
    (device,) = [line for line in lines if line.startswith("memory on reward_model:")]
    assert device.startswith("memory on reward_model:arithmetic cuda:0 GPU: ") and len(per_worker) == 2
    assert float(device.split(": ")[1].split(" GiB")[0]) == pytest.approx(sum(per_worker), abs=2e-3)
    # Two composite actors of half a GPU each (two 0.25 sources): Ray may put both on one GPU
    quarters = load_config(
        REWARDS_RECIPE,
        ["cluster.gpus_per_node=4", "+env.arithmetic.sources.rm.num_gpus=0.25", "+env.arithmetic.sources.rm2.class=reward_model",
         "+env.arithmetic.sources.rm2.num_gpus=0.25", "env.arithmetic.num_workers=2"],
    )  # fmt: skip
    lines, _ = memory_report(quarters, decide_run_plan(quarters, (), 2), 80, None, 0.4, scorers=scorer_specs(quarters))
    per_worker = [float(line.split(": ")[1].split(" GiB")[0]) for line in lines if line.startswith("memory reward_model:arithmetic.rm")]
    (device,) = [line for line in lines if line.startswith("memory on reward_model:")]
    assert float(device.split(": ")[1].split(" GiB")[0]) == pytest.approx(2 * sum(per_worker), abs=3e-3)
    own = ["cluster.gpus_per_node=4", "+env.arithmetic.class=reward_model", "+env.arithmetic.num_gpus=0.5", "env.arithmetic.num_workers=3"]
    packed = load_config(DEFAULT_RECIPE, own)  # a task's own reward model: three actors of half a GPU, two to a GPU
    lines, _ = memory_report(packed, decide_run_plan(packed, (), 2), 80, None, 0.4, scorers=scorer_specs(packed))
    (worker,) = [float(line.split(": ")[1].split(" GiB")[0]) for line in lines if line.startswith("memory reward_model:arithmetic x3")]
    (device,) = [line for line in lines if line.startswith("memory on reward_model:")]
    assert float(device.split(": ")[1].split(" GiB")[0]) == pytest.approx(2 * worker, abs=2e-3)


def test_an_llm_judge_is_planned_with_what_its_engine_allocates() -> None:
    """A judge was named, not counted ('not planned'): its HF engine's weights, KV cache and the lean decoder's weight
    copies are now the bytes a real judge actor allocates for its max_batch_size prompts; a vLLM judge on a GPU takes
    its share, and one whose share leaves no KV room is refused, naming it."""
    import torch

    from nemo_like.algorithms.roles import scorer_specs
    from nemo_like.models.footprint import memory_report, scorer_roles
    from nemo_like.models.generation.lean_decoder import FusedLlamaStep
    from nemo_like.models.loading import load_causal_lm, load_tokenizer

    cfg = load_config(
        REWARDS_RECIPE, ["+env.arithmetic.sources.judge.engine_max_model_len=96", "+env.arithmetic.sources.judge.max_batch_size=8"]
    )
    (judge,) = [s for s in scorer_specs(cfg) if s.role.startswith("judge:")]
    assert (judge.role, judge.workers, judge.backend, judge.context, judge.max_batch_size) == ("judge:arithmetic.judge", 1, "hf", 96, 8)
    (role,), unplanned = scorer_roles([judge])
    model = load_causal_lm(judge.model_name, judge.precision)
    step = FusedLlamaStep(model, judge.max_batch_size, judge.context)  # what the judge's engine builds for a full call
    tensor_bytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))  # noqa: E731
    assert role.params == tensor_bytes(model.parameters()) and not unplanned and role.on_host
    assert role.kv_cache == tensor_bytes(step.k_cache + step.v_cache)
    own = {p.data_ptr() for p in model.parameters()}
    weights = [w for layer in step.layers for w in (layer[1], layer[3], layer[6], layer[7])] + ([step.head[0]] if step.head else [])
    copies = tensor_bytes(w for w in weights if w.is_mkldnn or w.data_ptr() not in own)  # fused, or packed for oneDNN
    logits = judge.max_batch_size * model.config.vocab_size * 4
    assert role.activations == pytest.approx(copies + logits, rel=0.05)
    # vLLM on a GPU: its share of the device; a share its weights leave no KV room in is refused
    gpu = [
        "cluster.gpus_per_node=4",
        "+env.arithmetic.sources.judge.engine_backend=vllm",
        "+env.arithmetic.sources.judge.engine_num_gpus=1",
    ]
    on_gpu = load_config(REWARDS_RECIPE, gpu)
    (vllm_judge,) = [s for s in scorer_specs(on_gpu) if s.role.startswith("judge:")]  # started with the tokenizer's context
    assert vllm_judge.context == load_tokenizer(vllm_judge.model_name).model_max_length != judge.context
    lines, fits = memory_report(on_gpu, decide_run_plan(on_gpu, (), 2), 80, None, 0.4, scorers=scorer_specs(on_gpu))
    (device,) = [line for line in lines if line.startswith("memory on judge:arithmetic.judge GPU: ")]
    assert fits and float(device.split(": ")[1].split(" GiB")[0]) == pytest.approx(0.3 * 80, abs=0.01)  # its default share
    starved = load_config(REWARDS_RECIPE, [*gpu, "+env.arithmetic.sources.judge.engine_gpu_memory_utilization=0.0001"])
    lines, fits = memory_report(starved, decide_run_plan(starved, (), 2), 80, None, 0.4, scorers=scorer_specs(starved))
    assert fits is False and "judge:arithmetic.judge's vLLM KV budget (0.000 MiB = engine_gpu_memory_utilization x device" in lines[-1]
    lines, fits = memory_report(on_gpu, decide_run_plan(on_gpu, (), 2), 20, None, 0.4, scorers=scorer_specs(on_gpu))
    assert fits  # 0.3 of a 20 GiB GPU: still its share
    tight = load_config(REWARDS_RECIPE, [*gpu[:2], "+env.arithmetic.sources.judge.engine_num_gpus=0.25", "env.arithmetic.num_workers=4"])
    lines, fits = memory_report(tight, decide_run_plan(tight, (), 2), 80, None, 0.4, scorers=scorer_specs(tight))
    (device,) = [line for line in lines if line.startswith("memory on judge:arithmetic.judge GPU: ")]
    assert fits is False and float(device.split(": ")[1].split(" GiB")[0]) == pytest.approx(4 * 0.3 * 80, abs=0.05)  # 4 on a GPU
    assert "judge:arithmetic.judge GPU: lower its environment's engine_gpu_memory_utilization" in lines[-1]


def test_an_hf_judge_the_fused_step_does_not_serve_is_planned_without_its_weight_copies(tmp_path) -> None:
    """The lean decoder's fused weight copies were counted for every HF judge: a Gemma2 judge (its own forward, no
    copies) was planned 10 GiB over at 9B parameters, as the policy's sampler was before."""
    from transformers import Gemma2Config, LlamaConfig

    from nemo_like.models.footprint import judge_role
    from nemo_like.plan.memory import JudgeSpec

    size = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=359,
    )
    activations = {}
    for name, config in (("gemma2", Gemma2Config(**size)), ("llama", LlamaConfig(**size))):
        config.save_pretrained(tmp_path / name)
        spec = JudgeSpec("judge:t", str(tmp_path / name), "float32", 1, 0.0, "hf", 8, 64, "given", 1, 0.3)
        activations[name] = judge_role(spec, None).activations
    logits = 8 * 359 * 4
    assert activations["gemma2"] == logits < activations["llama"], activations


def test_a_state_the_plan_does_not_size_leaves_a_vllm_judges_sequences_unknown_and_says_so(tmp_path) -> None:
    """LFM2's convolution layers keep a state the plan does not size: a vLLM judge's budget was said to hold a count of
    sequences from the attention layers' cache alone (4x vLLM's for a Falcon-H1 judge, before Mamba states were
    planned), and the judge's 'not planned' line was the policy's only."""
    from transformers import Lfm2Config

    from nemo_like.models.footprint import scorer_roles
    from nemo_like.plan.memory import JudgeSpec

    Lfm2Config(vocab_size=359, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
               layer_types=["conv", "full_attention"]).save_pretrained(tmp_path)  # fmt: skip
    spec = JudgeSpec("judge:t", str(tmp_path), "float32", 1, 0.0, "vllm", 8, 64, "given", 1, 0.3)
    (role,), lines = scorer_roles([spec])
    assert role.kv_sequences is None and "KV budget holds an unknown number of sequences" in role.note
    assert lines == ["not planned: judge:t: the fixed state each of the model's 1 stateful layers caches per sequence"]
    params, shape = model_footprint(str(tmp_path), "float32")  # the same model as the policy, on a vLLM engine
    cfg = recipe("cluster.gpus_per_node=1", "policy.generation.colocated.enabled=false")
    engine = plan_memory(cfg, with_vllm(cfg), params, shape, device_bytes=80 * GIB).roles[-1]
    assert engine.kv_sequences is None and "KV budget holds an unknown number of sequences" in engine.note


def test_the_plan_reads_a_cached_hub_models_config(cached_hub_model) -> None:
    """The planner looked for a hub id's config.json under the name as a path: a model in the local cache (what an
    offline cluster node holds) was 'not on this machine'."""
    from nemo_like.config.errors import ConfigError
    from nemo_like.models.footprint import model_config_path

    assert model_config_path("acme/tiny-chat") == cached_hub_model / "config.json"
    with pytest.raises(ConfigError, match="policy.model_name='acme/other': its config.json is not on this machine"):
        model_config_path("acme/other")


def test_a_merged_lora_refit_plans_the_engine_and_its_refit_buffer_with_the_bases_weights(capsys) -> None:
    """The engine of a merged refit serves base-shaped weights; its parameters and the refit buffer had counted the
    adapters too (0.015 GiB against the base's 0.004 at dim 256)."""
    from nemo_like.cli import main

    engine_lines = {}
    for lora in ((), ("policy.lora_cfg.enabled=true", "policy.lora_cfg.dim=256")):
        assert main(["plan", "policy.generation.backend=hf", *lora]) == 0
        out = capsys.readouterr().out.splitlines()
        engine_lines[lora] = [line.split(" GiB")[0] for line in out if "memory generation" in line or "memory refit buffer" in line]
        policy = next(line for line in out if "memory policy" in line)
    assert len(engine_lines[()]) == 2 and engine_lines[lora] == engine_lines[()], engine_lines
    assert "params 0.015" in policy, policy  # the policy itself holds the adapters


def test_a_vllm_judge_whose_cache_size_is_unknown_is_refused_only_when_its_weights_leave_no_budget() -> None:
    from nemo_like.plan.memory import JudgeSpec, judge_memory

    shape = ModelShape(layers=4, hidden=64, intermediate=128, heads=4, kv_heads=4, head_dim=16, vocab=359, cached_layers=0, state_layers=4)
    assert shape.kv_bytes_per_sequence(2, 4096) == 0  # every layer a state of unknown size (LFM2's conv layers)
    spec = JudgeSpec("judge:t", "m", "bfloat16", 1, 1.0, "vllm", 8, 4096, "engine_max_model_len", 4, 0.3)
    over = judge_memory(spec, 15 * GIB, shape, 80 * GIB)  # 30 GiB of bf16 weights over 0.3 x 80 GiB
    assert "holds no sequence of 4096 tokens (its weights and vLLM's own memory leave none)" in over.problem
    roomy = judge_memory(spec, GIB // 2, shape, 80 * GIB)
    assert not roomy.problem and "holds an unknown number of sequences" in roomy.note
