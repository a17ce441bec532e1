"""Micro-batch plans and sequence packing: bin packing by hand, packed attention cannot cross samples,
and every grouping (fixed, token budget, packed) and chunked logprobs train to the same weights."""

from __future__ import annotations

import functools

import pytest
import torch
from policy_batches import padded_rows, with_global_counts

from nemo_like.algorithms.loss_functions import ClippedPGLossFn
from nemo_like.config.loss import ClippedPGLossConfig
from nemo_like.config.schema import EMBEDDED_MODEL, OptimizerConfig
from nemo_like.models.chunked_logprobs import model_token_logprobs
from nemo_like.models.loading import load_causal_lm
from nemo_like.models.logprobs import sequence_logprobs
from nemo_like.models.policy.batching import (
    first_fit_decreasing,
    fixed_groups,
    pack_rows,
    token_budget_groups,
    unpack_logprobs,
)
from nemo_like.models.policy.policy import optimizer_step_shards
from nemo_like.models.policy.worker import PolicyWorker

TEMPERATURE = 0.7


def test_first_fit_decreasing_by_hand():
    # Longest first: 7 -> bin0; 5 -> bin1 (7+5 > 10); 4 -> bin1 (9); 3 -> bin0 (10); 2 -> bin2; 12 (> capacity) alone.
    lengths = [3, 7, 2, 5, 4, 12]
    assert first_fit_decreasing(lengths, 10) == [[5], [1, 0], [3, 4], [2]]
    assert sorted(i for b in first_fit_decreasing(lengths, 10) for i in b) == list(range(6))


def test_token_budget_groups_by_hand():
    # Sorted 9, 8, 5, 4, 2: [9] (2 x 9 > 16), [8, 5] (3 x 8 > 16), [4, 2] then 2 x 4 = 8 <= 16.
    assert token_budget_groups([5, 9, 2, 8, 4], 16) == [[1], [3, 0], [4, 2]]
    assert token_budget_groups([5, 9, 2, 8, 4], 4) == [[1], [3], [0], [4], [2]]  # longer than the budget: alone
    assert fixed_groups(5, 2) == [[0, 1], [2, 3], [4]]


@pytest.fixture(scope="module")
def model():
    return load_causal_lm(EMBEDDED_MODEL).eval()


def rows_of_different_lengths(model) -> dict[str, torch.Tensor]:
    """Sequences sampled from the model itself: logprobs of a few nats, where float32 resolves 1e-5
    (random tokens score ~ -36, where one float32 ulp is already 4e-6)."""
    torch.manual_seed(3)
    prompt = torch.randint(3, 300, (4, 2))
    with torch.no_grad():
        ids = model.generate(prompt, do_sample=True, max_new_tokens=22, min_new_tokens=22, pad_token_id=0)
    lengths = torch.tensor([23, 3, 11, 2])
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@torch.no_grad()
def test_packed_logprobs_equal_unpacked_and_a_plain_causal_mask_leaks(model, attention):
    batch = rows_of_different_lengths(model)
    model.config._attn_implementation = attention
    try:
        unpacked = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], TEMPERATURE)

        def packed_logprobs(block_diagonal: bool) -> torch.Tensor:
            packed = pack_rows(batch, block_diagonal=block_diagonal)
            assert packed.input_ids.shape == (1, 39)
            lp = model_token_logprobs(model, packed.input_ids, packed.attention_mask, packed.position_ids, TEMPERATURE)
            return unpack_logprobs(lp, packed, batch["input_ids"].shape)

        assert (packed_logprobs(True) - unpacked).abs().max() < 1e-5
        # Without the block-diagonal mask the later samples attend to the earlier ones: their logprobs change.
        leak = (packed_logprobs(False) - unpacked).abs()
        assert leak[0].max() < 1e-5 and leak[1:].max() > 1e-2
    finally:
        model.config._attn_implementation = "sdpa"


def test_chunked_logprobs_and_gradients_equal_the_full_logits(model):
    batch = rows_of_different_lengths(model)
    grads = []
    values = []
    for chunk in (None, 7):
        model.zero_grad()
        with torch.enable_grad():
            lp = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], TEMPERATURE, chunk)
            (lp * torch.linspace(-1, 1, lp.shape[1])).sum().backward()
        values.append(lp.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    model.zero_grad()
    assert (values[0] - values[1]).abs().max() < 1e-5
    assert (grads[0] - grads[1]).norm() <= 1e-5 * grads[0].norm()


def make_worker(**kwargs) -> PolicyWorker:
    return PolicyWorker(
        rank=0,
        world_size=1,
        model_name=EMBEDDED_MODEL,
        precision="float32",
        temperature=TEMPERATURE,
        num_threads=1,
        seed=0,
        loss_fn=ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0)),
        optimizer=OptimizerConfig(lr=1e-3, eps=1e-6),
        max_grad_norm=0.5,
        train_micro_batch_size=2,
        logprob_batch_size=3,
        **kwargs,
    )


@functools.lru_cache(maxsize=1)
def sampled_sequences(rows: int = 32, seq: int = 40) -> torch.Tensor:
    """Sequences sampled from the tiny model (see :func:`rows_of_different_lengths` for why)."""
    torch.manual_seed(0)
    with torch.no_grad():
        return load_causal_lm(EMBEDDED_MODEL).generate(
            torch.randint(3, 300, (rows, 2)), do_sample=True, max_new_tokens=seq - 2, min_new_tokens=seq - 2, pad_token_id=0
        )


def long_tailed_batch(step: int, rows: int = 8, seq: int = 40) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    lengths = torch.tensor([40, 6, 7, 5, 22, 6, 8, 9])[torch.randperm(rows, generator=g)]
    ids = sampled_sequences()[torch.randperm(32, generator=g)[:rows]]
    return with_global_counts(padded_rows(ids, lengths, 3, g))


OWN_FORWARD = dict(shared_prompt_forward=False)
VARIANTS = {
    # Packing and the chunked output head are paths of the model's own forward: the shared-prompt forward (on by default
    # on CPU) comes first in the worker and would leave them untested (a packed mask that leaked across rows passed).
    "packed": dict(batching={"mode": "packed", "train_size": 48, "logprob_size": 48}, **OWN_FORWARD),
    "token_budget": dict(batching={"mode": "token_budget", "train_size": 48, "logprob_size": 48}),
    "chunked": dict(logprob_chunk_size=16, **OWN_FORWARD),
    "chunked_shared_prompt": dict(logprob_chunk_size=16),
    "activation_checkpointing": dict(dtensor_cfg={"activation_checkpointing": True}, **OWN_FORWARD),
}
# Each variant is compared with fixed micro-batches on the same forward (the shared-prompt forward is checked against
# the model's in test_shared_prefix.py).
BASELINES = {name: OWN_FORWARD for name, variant in VARIANTS.items() if variant.get("shared_prompt_forward") is False}


@pytest.mark.slow  # six workers x three optimizer steps: ~15 s of CPU per variant
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_grouping_trains_like_fixed_micro_batches(variant, monkeypatch):
    from nemo_like.models import chunked_logprobs

    base, other = make_worker(**BASELINES.get(variant, {})), make_worker(**VARIANTS[variant])
    own = VARIANTS[variant].get("shared_prompt_forward") is False
    assert other.shared_forward is not own, "the variant runs the forward it is named for"
    # a variant whose setting were dropped would compute what the baseline computes: each one's mechanism must run
    assert other.model.is_gradient_checkpointing is (variant == "activation_checkpointing")
    chunked_calls = []
    chunked_head = chunked_logprobs.ChunkedTokenLogprobs.apply
    monkeypatch.setattr(chunked_logprobs.ChunkedTokenLogprobs, "apply", lambda *a: chunked_calls.append(1) or chunked_head(*a))
    probe = long_tailed_batch(50)
    # float32 rounding scales with the value: 1e-5 on the typical logprob, relative 1e-6 on the long tail's (~ -37)
    expected = base.get_logprobs(probe)
    assert not chunked_calls  # the baseline's head is the plain one
    torch.testing.assert_close(expected, other.get_logprobs(probe), atol=1e-5, rtol=1e-6)
    assert bool(chunked_calls) is variant.startswith("chunked"), "the chunked output head runs in the chunked variants only"
    for step in range(3):
        a, b = base.train([long_tailed_batch(step)]), other.train([long_tailed_batch(step)])
        assert abs(a["metrics"]["loss"] - b["metrics"]["loss"]) <= 1e-5 * max(1.0, abs(a["metrics"]["loss"]))
        assert abs(a["grad_norms"][0] - b["grad_norms"][0]) <= 1e-5 * a["grad_norms"][0]
        # Same weights at step 0: 1e-5. Later the weights already differ by float rounding (~1e-7), which moves logprobs more.
        torch.testing.assert_close(a["first_step_logprobs"], b["first_step_logprobs"], atol=1e-5 if step == 0 else 1e-4, rtol=0)
    for (name, x), (_, y) in zip(base.model.named_parameters(), other.model.named_parameters()):
        assert (x - y).abs().max() < 1e-5, name
    if variant in ("packed", "token_budget"):  # fewer forward passes than 4 fixed micro-batches of 2
        assert other.forward_passes["train"] < base.forward_passes["train"]


def test_the_packed_attention_mask_is_built_on_the_segments_device() -> None:
    """The worker moves a micro-batch to its device before packing: the mask was built on the CPU and mixed with the
    device's segment ids, which fails on a GPU (the meta device stands in for one here)."""
    from nemo_like.models.policy.batching import block_causal_mask

    segment = torch.tensor([0, 0, 0, 1, 1])
    on_cpu = block_causal_mask(segment, torch.float32)
    on_device = block_causal_mask(segment.to("meta"), torch.float32)
    assert on_device.device.type == "meta" and on_device.shape == on_cpu.shape == (1, 1, 5, 5)
    assert bool((on_cpu[0, 0, 3, :3] == torch.finfo(torch.float32).min).all()) and bool((on_cpu[0, 0, 4, 3:] == 0).all())


def _rows(n: int) -> dict[str, torch.Tensor]:
    """``n`` distinct rows: row i's tokens are all i, its first (i % 3) + 1 positions loss tokens."""
    token_mask = torch.zeros(n, 4)
    for i in range(n):
        token_mask[i, : i % 3 + 1] = 1
    return {"input_ids": torch.arange(n)[:, None].repeat(1, 4), "token_mask": token_mask, "sample_mask": torch.ones(n)}


@pytest.mark.parametrize(
    ("rows", "steps", "dp", "step_sizes", "rank_sizes"),
    [
        (16, 2, 2, [8, 8], [[4, 4], [4, 4]]),  # as planned: the train_global_batch_size slices
        (17, 2, 2, [8, 9], [[4, 4], [4, 5]]),  # a branched session's extra row: still two steps, split unevenly
        (17, 1, 2, [17], [[8], [9]]),  # one step (fixed slices made a second, one-row step; two ranks failed)
        (13, 2, 1, [6, 7], [[6, 7]]),  # three sessions rejected
        (1, 2, 2, [1], [[0], [1]]),  # fewer rows than steps: no step without a row; a rank may have none
        (0, 2, 2, [], [[], []]),
    ],
)
def test_a_train_call_takes_the_planned_optimizer_steps_whatever_its_row_count(rows, steps, dp, step_sizes, rank_sizes) -> None:
    batch = _rows(rows)
    per_rank = optimizer_step_shards(batch, steps, dp)
    assert [[s["input_ids"].shape[0] for s in rank] for rank in per_rank] == rank_sizes
    assert [sum(rank[k]["input_ids"].shape[0] for rank in per_rank) for k in range(len(step_sizes))] == step_sizes
    in_order = [s["input_ids"][:, 0] for k in range(len(step_sizes)) for s in (rank[k] for rank in per_rank)]
    assert torch.equal(torch.cat(in_order) if in_order else torch.zeros(0, dtype=torch.long), torch.arange(rows))
    for k in range(len(step_sizes)):  # every shard of a step carries the step's global counts
        step_rows = torch.cat([rank[k]["input_ids"][:, 0] for rank in per_rank])
        expected = batch["token_mask"][step_rows].sum()
        assert all(float(rank[k]["global_valid_toks"]) == float(expected) for rank in per_rank)
        assert all(float(rank[k]["global_valid_seqs"]) == len(step_rows) for rank in per_rank)


def sliding_window_models() -> dict[str, torch.nn.Module]:
    """Models whose layers attend within a window of 4 positions: the tiny Qwen2 with alternating sliding and full layers
    (``layer_types``, as Gemma 2/3 and gpt-oss ship them) and a small random Mistral (one ``sliding_window`` for every
    layer, no ``layer_types``)."""
    from transformers import AutoConfig, MistralConfig, MistralForCausalLM

    from nemo_like.models.loading import resolve_model_path

    path = resolve_model_path(EMBEDDED_MODEL)
    config = AutoConfig.from_pretrained(path)
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 4, 0
    config.layer_types = ["sliding_attention", "full_attention"] * (config.num_hidden_layers // 2)
    qwen2 = load_causal_lm(EMBEDDED_MODEL)
    qwen2 = type(qwen2).from_pretrained(path, config=config).eval()
    torch.manual_seed(0)
    mistral = MistralConfig(vocab_size=359, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, sliding_window=4, attn_implementation="sdpa")  # fmt: skip
    return {"qwen2 layer_types": qwen2, "mistral": MistralForCausalLM(mistral).eval()}


@torch.no_grad()
def test_packed_rows_keep_a_sliding_window_models_windows() -> None:
    """transformers hands a ready 4D mask to every layer as it is: a packed row's one block-causal mask let a
    sliding-window layer attend over the whole sample (its rows longer than the window off by nats)."""
    from nemo_like.models.policy.batching import packed_model_mask

    batch = rows_of_different_lengths(load_causal_lm(EMBEDDED_MODEL).eval())  # rows of 23, 3, 11 and 2 tokens
    for name, sliding in sliding_window_models().items():
        unpacked = sequence_logprobs(sliding, batch["input_ids"], batch["attention_mask"], TEMPERATURE)  # the model's own masks
        packed = pack_rows(batch)
        mask = packed_model_mask(packed, sliding.config)
        lp = model_token_logprobs(sliding, packed.input_ids, mask, packed.position_ids, TEMPERATURE)
        assert (unpack_logprobs(lp, packed, batch["input_ids"].shape) - unpacked).abs().max() < 1e-5, name
        one_mask = model_token_logprobs(sliding, packed.input_ids, packed.attention_mask, packed.position_ids, TEMPERATURE)
        wrong = (unpack_logprobs(one_mask, packed, batch["input_ids"].shape) - unpacked).abs().amax(1)
        assert wrong[0] > 1e-2 and wrong[2] > 1e-2 and wrong[[1, 3]].max() < 1e-5, name  # only rows past the window
    # the worker's packed passes take it: logprobs equal to its fixed micro-batches'
    qwen2 = sliding_window_models()["qwen2 layer_types"]
    logprobs = {}
    for mode, kwargs in (("fixed", {}), ("packed", {"batching": {"mode": "packed", "train_size": 16, "logprob_size": 16}})):
        worker = make_worker(shared_prompt_forward=False, **kwargs)
        worker.model = qwen2
        logprobs[mode] = worker.get_logprobs(batch)
    assert (logprobs["packed"] - logprobs["fixed"]).abs().max() < 1e-5


def qwen3_next_model(path) -> torch.nn.Module:
    """A small random Qwen3-Next (three gated-delta-net linear-attention layers, then a full-attention one), saved to
    ``path`` for the driver's check to read."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    config = Qwen3NextConfig(vocab_size=359, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                             shared_expert_intermediate_size=16, num_hidden_layers=4, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
                             linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                             layer_types=["linear_attention"] * 3 + ["full_attention"])  # fmt: skip
    model = Qwen3NextForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


@torch.no_grad()
def test_a_model_with_layers_no_mask_reaches_is_refused_packing(tmp_path) -> None:
    """A linear-attention (or conv, or state-space) layer runs over a packed row's every token: each sample after a row's
    first was scored with the state the ones before it left (silently wrong logprobs, the run went on). The driver
    refuses the recipe naming the key before any actor starts; the worker's mask refuses it too."""
    from nemo_like.algorithms.setup import check_policy_model, check_teacher_model
    from nemo_like.config import ConfigError, load_config
    from nemo_like.models.policy.batching import packed_model_mask

    hybrid = qwen3_next_model(tmp_path / "qwen3_next")
    batch = rows_of_different_lengths(load_causal_lm(EMBEDDED_MODEL).eval())
    unpacked = sequence_logprobs(hybrid, batch["input_ids"], batch["attention_mask"], TEMPERATURE)
    packed = pack_rows(batch)
    leaked = model_token_logprobs(hybrid, packed.input_ids, packed.attention_mask, packed.position_ids, TEMPERATURE)
    wrong = (unpack_logprobs(leaked, packed, batch["input_ids"].shape) - unpacked).abs().amax(1)
    first = int(packed.rows[0])  # the row packed first: nothing before it to leak from
    assert wrong[first] < 1e-5 and all(wrong[r] > 1e-4 for r in range(4) if r != first), wrong
    with pytest.raises(ValueError, match=r"policy.sequence_packing.enabled=true: .*'linear_attention'.*policy.dynamic_batching"):
        packed_model_mask(packed, hybrid.config)
    name = str(tmp_path / "qwen3_next")
    packing = load_config(None, [f"policy.model_name={name}", "policy.sequence_packing.enabled=true"])
    with pytest.raises(ConfigError, match=rf"policy.sequence_packing.enabled=true with policy.model_name='{name}': .*linear_attention"):
        check_policy_model(packing)
    check_policy_model(load_config(None, [f"policy.model_name={name}"]))  # packing off: nothing to refuse
    with pytest.raises(ConfigError, match=rf"with teacher.model_name='{name}': .*linear_attention"):  # a teacher's rows pack too
        check_teacher_model(load_config(None, ["policy.sequence_packing.enabled=true"]), name, "teacher.model_name")
    for attention_only in sliding_window_models().values():  # windows too are kept within a sample (the test above)
        packed_model_mask(packed, attention_only.config)
    from transformers import RwkvConfig, xLSTMConfig

    for headless in (RwkvConfig(num_hidden_layers=2), xLSTMConfig(num_hidden_layers=2)):  # no layer kinds listed, no heads:
        with pytest.raises(ValueError, match=r"'recurrent'"):  # RWKV's second packed sample was scored with the first's state
            packed_model_mask(packed, headless)


def other_attention_models() -> dict[str, torch.nn.Module]:
    """Attention layers transformers names otherwise, which a packed row's mask reaches: DeepSeek-V3.2's indexed
    attention (its indexer applies the mask before its top-k) and Llama 4's chunked attention (samples within a chunk)."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(0)
    deepseek = DeepseekV32Config(
        vocab_size=359,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        head_dim=8,
        index_topk=64,
        index_head_dim=16,
        index_n_heads=2,
        first_k_dense_replace=1,
        attn_implementation="eager",
    )
    llama4 = Llama4TextConfig(vocab_size=359, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2, attention_chunk_size=32,
                              attn_implementation="sdpa")  # fmt: skip
    return {"deepseek_v32": DeepseekV32ForCausalLM(deepseek).eval(), "llama4_text": Llama4ForCausalLM(llama4).eval()}


@torch.no_grad()
def test_attention_layers_of_other_names_pack_exactly_and_only_stateful_layers_are_refused() -> None:
    from transformers import NemotronHConfig, RecurrentGemmaConfig

    from nemo_like.models.policy.batching import packed_model_mask, packing_problem

    batch = rows_of_different_lengths(load_causal_lm(EMBEDDED_MODEL).eval())  # rows of 23, 3, 11 and 2 tokens
    models = other_attention_models()
    for name, model in models.items():
        unpacked = sequence_logprobs(model, batch["input_ids"], batch["attention_mask"], TEMPERATURE)
        packed = pack_rows(batch)
        lp = model_token_logprobs(model, packed.input_ids, packed_model_mask(packed, model.config), packed.position_ids, TEMPERATURE)
        assert (unpack_logprobs(lp, packed, batch["input_ids"].shape) - unpacked).abs().max() < 1e-5, name
    llama4 = models["llama4_text"].config  # chunks of 32: a longer sample attends within them
    assert packing_problem(llama4, 32) is None and "chunks of 32 tokens" in packing_problem(llama4, 33)
    # RecurrentGemma lists its layers as block_types (no layer_types); Nemotron-H's MLP and MoE layers act per token
    recurrent_gemma = RecurrentGemmaConfig(num_hidden_layers=3)
    assert recurrent_gemma.block_types[:3] == ["recurrent", "recurrent", "attention"]
    assert "this model's ['recurrent'] layers carry a state" in packing_problem(recurrent_gemma, 8)
    nemotron_h = NemotronHConfig(layers_block_type=["mamba", "attention", "mlp", "moe"], num_hidden_layers=4)
    assert "this model's ['linear_attention'] layers carry a state" in packing_problem(nemotron_h, 8), nemotron_h.layer_types
    from transformers import FalconH1Config
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    assert "this model's ['hybrid'] layers carry a state" in packing_problem(
        FalconH1Config(num_hidden_layers=2), 8
    )  # Mamba beside attention
    compressed = packing_problem(CONFIG_MAPPING["deepseek_v4"](), 8)  # DeepSeek-V4's compressed attention: not a mask's to say
    assert "['compressed_sparse_attention', 'heavily_compressed_attention'] layers may attend in ways" in compressed
