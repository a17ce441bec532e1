"""The policy worker in-process (no Ray): logprob layout and gradient accumulation."""

import json

import pytest
import torch
from policy_batches import random_rows, with_global_counts

from nemo_like.algorithms.loss_functions import ClippedPGLossFn
from nemo_like.config.loss import ClippedPGLossConfig
from nemo_like.config.schema import EMBEDDED_MODEL, OptimizerConfig
from nemo_like.models.loading import load_causal_lm
from nemo_like.models.logprobs import gather_token_logprobs
from nemo_like.models.policy.checkpoints import checkpoint_files
from nemo_like.models.policy.worker import PolicyWorker


def make_worker(micro_batch_size: int, **overrides) -> PolicyWorker:
    """A one-rank worker of the shipped model, fp32 unless ``precision`` is given (``overrides``: other PolicyWorker
    keywords, e.g. ``lora_cfg``)."""
    return PolicyWorker(
        rank=0,
        world_size=1,
        model_name=overrides.pop("model_name", EMBEDDED_MODEL),
        precision=overrides.pop("precision", "float32"),
        temperature=1.0,
        num_threads=overrides.pop("num_threads", 1),
        seed=0,
        loss_fn=ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0)),
        max_grad_norm=None,
        train_micro_batch_size=micro_batch_size,
        **{"optimizer": OptimizerConfig(lr=1e-3), **overrides},
    )


def random_batch(batch: int = 6, seq: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded rows of different lengths with a 4-token prompt and a response after it."""
    return random_rows(seed, batch, seq, 200)


def test_logprob_layout_matches_a_direct_computation():
    model = load_causal_lm(EMBEDDED_MODEL).eval()
    batch = random_batch()
    worker = make_worker(2)
    lp = worker.get_logprobs(batch)
    assert torch.all(lp[:, 0] == 0)
    # Row 0 on its own, no padding, computed the textbook way.
    n = int(batch["attention_mask"][0].sum())
    ids = batch["input_ids"][0:1, :n]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    manual = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    torch.testing.assert_close(lp[0, 1:n], manual, atol=1e-5, rtol=0)
    torch.testing.assert_close(gather_token_logprobs(logits, ids)[0, 1:], manual, atol=1e-5, rtol=0)
    assert torch.all(lp[0, n:] == 0)


def test_microbatch_losses_sum_to_the_full_batch_and_give_the_same_update():
    batch = with_global_counts(random_batch())
    full, micro = make_worker(6), make_worker(2)
    r_full = full.train([batch])
    r_micro = micro.train([batch])
    assert abs(r_full["metrics"]["loss"] - r_micro["metrics"]["loss"]) < 1e-6
    assert abs(r_full["grad_norms"][0] - r_micro["grad_norms"][0]) < 1e-5
    for (name, a), (_, b) in zip(full.model.named_parameters(), micro.model.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=0, msg=name)  # the gradients, kept after the step
        # The weights: Adam's first step moves a weight by lr * g / (|g| + eps), eps = 1e-8, so where |g| is itself
        # ~1e-8 (the key biases' gradients are 0 up to rounding: softmax ignores a key bias) the rounding of each
        # micro-batch split moves the step by a good part of lr. Where |g| >> eps the steps agree to 1e-5.
        clear = a.grad.abs() > 1e-6
        torch.testing.assert_close(a[clear], b[clear], atol=1e-5, rtol=0, msg=name)
        assert (a - b).abs().max() <= 2e-3, name  # elsewhere: at most two steps of lr = 1e-3 apart


def test_the_logprob_phase_runs_on_its_share_of_threads_and_training_and_sampling_on_the_workers_own():
    """A sync run with the prev pass runs the policy's logprob phase beside the reference's ranks: the plan gives it
    fewer threads there than in training (which runs alone); the worker had one count for every phase."""
    before = torch.get_num_threads()
    try:
        worker = make_worker(3, num_threads=2, logprob_threads=1)
        assert torch.get_num_threads() == 2
        worker.get_logprobs(random_batch())
        assert torch.get_num_threads() == 1
        worker.train([with_global_counts(random_batch())])
        assert torch.get_num_threads() == 2
        worker.get_logprobs(random_batch())
        worker.generate([[5, 6, 7]], {"max_new_tokens": 2}, 0, 0, [2])  # inline sampling runs alone too
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_training_changes_the_weights_and_bumps_the_version():
    worker = make_worker(3)
    before = worker.parameter_checksum()
    result = worker.train([with_global_counts(random_batch())])
    assert worker.parameter_checksum() != before
    assert worker.weight_version == 1 and result["nonfinite_steps_skipped"] == 0
    version, state = worker.get_state_dict()
    assert version == 1 and "lm_head.weight" in state  # tied head travels with the refit


def test_metrics_of_several_optimizer_steps_are_means_over_the_calls_tokens_not_sums() -> None:
    """A rollout of two global batches takes two optimizer steps in one train call: a mean or a fraction is the mean over
    the call's tokens, the steps' values weighed by their tokens (it was their sum: an on-policy probs_ratio of 2.0, an
    effective sample size of 2; then the plain mean of the steps'), a loss term the mean of the steps', counts add."""
    steps, alone = [], []
    for seed in (0, 1):
        worker = make_worker(6, optimizer=OptimizerConfig(lr=1e-9))  # the weights barely move between the steps
        batch = random_batch(seed=seed)
        batch["generation_logprobs"] = worker.get_logprobs(batch) * batch["token_mask"]  # on-policy
        batch["prev_logprobs"] = batch["generation_logprobs"].clone()
        steps.append(with_global_counts(batch))
        alone.append(worker.train([steps[-1]])["metrics"])
    both = make_worker(6, optimizer=OptimizerConfig(lr=1e-9)).train(steps)["metrics"]
    tokens = [a["num_valid_tokens"] for a in alone]
    assert tokens[0] != tokens[1]  # the two steps weigh differently
    for key in ("probs_ratio", "trust_region/kept_fraction", "approx_entropy"):
        by_tokens = (alone[0][key] * tokens[0] + alone[1][key] * tokens[1]) / sum(tokens)
        assert both[key] == pytest.approx(by_tokens, rel=1e-5, abs=1e-6), key
    assert both["loss"] == pytest.approx((alone[0]["loss"] + alone[1]["loss"]) / 2, rel=1e-5, abs=1e-6)
    assert both["probs_ratio"] == pytest.approx(1.0, abs=1e-5) and both["rollout_corr/is_eff_sample_size"] <= 1.0 + 1e-6
    assert both["num_valid_tokens"] == alone[0]["num_valid_tokens"] + alone[1]["num_valid_tokens"]


def test_an_optimizer_step_with_no_token_to_train_on_is_skipped_whole() -> None:
    """Every row masked out (the driver's rejection can do it): the zero gradient still moved AdamW's weights by their
    momentum, advanced the schedule and halved the call's loss mean; now the step is skipped on every rank alike."""
    trained = with_global_counts(random_batch(seed=1))
    empty = random_batch(seed=2)
    empty["sample_mask"][:] = 0
    empty = with_global_counts(empty)
    worker = make_worker(4)
    worker.train([trained])  # AdamW has momentum now
    before, schedule = worker.parameter_checksum(), worker.scheduler.last_epoch
    result = worker.train([empty])
    assert worker.parameter_checksum() == before and worker.scheduler.last_epoch == schedule
    assert result["empty_steps_skipped"] == 1 and result["grad_norms"] == [] and result["metrics"] == {}
    # no forward ran for it: no pre-update logprobs (they were zeros, dumped as prev logprobs of probability 1)
    assert result["first_step_logprobs"] is None
    alone = make_worker(4).train([trained])
    beside_an_empty_step = make_worker(4).train([trained, empty])
    assert beside_an_empty_step["metrics"] == alone["metrics"] and beside_an_empty_step["empty_steps_skipped"] == 1
    # the MFU counts the tokens of the steps that ran (the empty one's had been charged 6N each: an MFU of 33 at worst)
    assert beside_an_empty_step["trained_tokens"] == alone["trained_tokens"] == int(trained["attention_mask"].sum())
    assert result["trained_tokens"] == 0
    # an empty step first, two trained after it: their metrics weighed by their own counts, not shifted onto the empty one's
    second = with_global_counts(random_batch(seed=3))
    assert make_worker(4).train([empty, trained, second])["metrics"] == make_worker(4).train([trained, second])["metrics"]


def test_a_rank_with_no_row_in_one_optimizer_step_still_averages_over_every_step() -> None:
    """dp 2, two optimizer steps, 3 rows: rank 0 has no row in the first step. The worker left that step out of its
    means, so summed over the ranks every mean was inflated (an on-policy probs_ratio of 1.25): the ranks' results,
    combined as Policy.train combines them, must equal one rank's (lr 1e-12: the weights barely move between the steps)."""
    from nemo_like.models.policy.policy import optimizer_step_shards

    batch = random_batch(batch=3, seed=3)
    probe = make_worker(3, optimizer=OptimizerConfig(lr=1e-12))
    batch["generation_logprobs"] = probe.get_logprobs(batch) * batch["token_mask"]  # on-policy
    batch["prev_logprobs"] = batch["generation_logprobs"].clone()
    per_rank = optimizer_step_shards(batch, 2, 2)
    assert [[s["input_ids"].shape[0] for s in steps] for steps in per_rank] == [[0, 1], [1, 1]]
    fn = probe.loss_fn
    ranks = fn.combine_metrics([make_worker(3, optimizer=OptimizerConfig(lr=1e-12)).train(steps)["metrics"] for steps in per_rank])
    (one_rank,) = optimizer_step_shards(batch, 2, 1)
    single = make_worker(3, optimizer=OptimizerConfig(lr=1e-12)).train(one_rank)["metrics"]
    assert ranks["probs_ratio"] == pytest.approx(1.0, abs=1e-5)
    for key in ("loss", "probs_ratio", "approx_entropy", "num_valid_tokens"):
        assert ranks[key] == pytest.approx(single[key], rel=1e-5, abs=1e-6), key


def test_a_resumed_worker_trains_with_this_runs_optimizer_settings(tmp_path) -> None:
    """Loading the optimizer and scheduler state brought back the saved lr (and weight decay, betas, eps): a run
    resumed with policy.optimizer.lr lowered (as the non-finite guard advises, and the guide allows) kept the old lr.
    The moments and the schedule's position are the checkpoint's; the hyperparameters are this run's."""
    first = make_worker(4, optimizer=OptimizerConfig(lr=1e-3))
    for seed in (0, 1):
        first.train([with_global_counts(random_batch(seed=seed))])
    first.save_checkpoint(str(tmp_path))
    assert all((tmp_path / name).is_file() for name in checkpoint_files(lora=False))  # what the driver checks a save for
    resumed = make_worker(4, optimizer=OptimizerConfig(lr=1e-5, weight_decay=0.5, betas=[0.8, 0.9], eps=1e-6), warmup_steps=10)
    resumed.load_checkpoint(str(tmp_path), None)
    group = resumed.optimizer.param_groups[0]
    assert resumed.scheduler.last_epoch == 2 and resumed.optimizer.state[group["params"][0]]["step"] == 2  # the checkpoint's
    assert (group["weight_decay"], group["betas"], group["eps"]) == (0.5, (0.8, 0.9), 1e-6)
    assert group["lr"] == pytest.approx(1e-5 * 3 / 11) and resumed.scheduler.get_last_lr() == [group["lr"]]  # warmup step 2
    result = resumed.train([with_global_counts(random_batch(seed=2))])
    assert result["lr"] == pytest.approx(1e-5 * 4 / 11)


def test_a_resume_on_another_number_of_ranks_says_the_worker_rng_is_not_restored(capsys) -> None:
    """A checkpoint of 2 ranks resumed on 4 gave every rank no RNG state without a word, while the guide listed the
    worker RNG among what comes back."""
    from nemo_like.models.policy.policy import worker_rng_states

    saved = [{"torch": torch.get_rng_state()}, {"torch": torch.get_rng_state()}]
    assert worker_rng_states(saved, 2, "ckpt") == saved and capsys.readouterr().out == ""
    assert worker_rng_states(saved, 4, "ckpt") == [None] * 4
    assert "[checkpoint] ckpt holds the RNG states of 2 policy ranks, this run has 4" in capsys.readouterr().out
    assert worker_rng_states(None, 3, "ckpt") == [None] * 3 and capsys.readouterr().out == ""


def test_each_data_parallel_rank_draws_its_own_dropout_and_a_tensor_parallel_group_one() -> None:
    """Every rank was seeded alike, so LoRA dropout drew the same masks on every data-parallel rank's k-th micro-batch
    (noise correlated across ranks, not averaged out as over one rank's rows). The model and adapters stay the same."""

    def built(rank: int, world_size: int, tp: int = 1) -> tuple[torch.Tensor, dict]:
        worker = PolicyWorker(
            rank=rank, world_size=world_size, model_name=EMBEDDED_MODEL, precision="float32", temperature=1.0, num_threads=1,
            seed=0, loss_fn=ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0)), max_grad_norm=None, optimizer=OptimizerConfig(lr=1e-3),
            lora_cfg=LoraConfig(enabled=True, dim=4, alpha=8, dropout=0.5), dtensor_cfg={"tensor_parallel_size": tp},
        )  # fmt: skip
        weights = {k: v.detach().clone() for k, v in worker.model.state_dict().items()}
        return torch.get_rng_state(), weights

    from nemo_like.config.schema import LoraConfig

    (state0, weights0), (state1, weights1) = built(0, 2), built(1, 2)
    assert not torch.equal(state0, state1)
    assert weights0.keys() == weights1.keys() and all(torch.equal(weights0[k], weights1[k]) for k in weights0)
    assert torch.equal(built(1, 2, tp=2)[0], state0)  # ranks 0 and 1 form one tensor-parallel group: one stream


def test_the_training_forward_runs_without_the_models_own_dropout(tmp_path, capsys) -> None:
    """A model whose config sets ``attention_dropout``: the training forward (train mode) dropped out, so a skipped
    prev-logprob pass stood for a forward it did not equal (a 1-step run's loss 0.047 against 0.324 with the pass,
    43% of tokens clipped). Generation samples without dropout: the policy trains that distribution."""
    import json
    import shutil

    from nemo_like.models.loading import resolve_model_path

    model_dir = tmp_path / "with_dropout"
    shutil.copytree(resolve_model_path(EMBEDDED_MODEL), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.3}))
    worker = make_worker(6, model_name=str(model_dir))
    assert "[policy] the model's own dropout is off for training (attention_dropout=0.3)" in capsys.readouterr().err
    batch = random_batch()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    eval_lp = worker.get_logprobs(batch)
    worker.model.train()
    with torch.no_grad():
        logits = worker.model(input_ids=ids, attention_mask=mask).logits
    train_lp = gather_token_logprobs(logits, ids)
    assert (train_lp - eval_lp).mul(mask).abs().max() < 1e-5
    assert worker.model.config.attention_dropout == 0.0
    # a checkpoint's config.json is the model's (another trainer fine-tuning it gets its dropout back)
    worker.save_checkpoint(str(tmp_path / "ckpt"))
    assert json.loads((tmp_path / "ckpt" / "policy" / "config.json").read_text())["attention_dropout"] == 0.3
    assert worker.model.config.attention_dropout == 0.0


def test_a_mixture_of_experts_checkpoint_is_written_as_save_pretrained_writes_and_resumes_exactly(tmp_path) -> None:
    """transformers 5 holds Mixtral's experts fused (``mlp.experts.gate_up_proj``); the checkpoint wrote that held
    layout, which vLLM (eval, serve of a checkpoint) refused: "no module or parameter named 'layers.0.mlp'". It now holds
    the names and values save_pretrained writes, and a resumed worker gets back every trained weight."""
    from safetensors.torch import load_file
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    MixtralForCausalLM(config).save_pretrained(tmp_path / "base")
    first = make_worker(3, model_name=str(tmp_path / "base"))
    first.train([with_global_counts(random_batch())])
    first.model.config.architectures = None  # as a text sub-config holds it (Qwen3.5's): vLLM fell back to its generic class
    first.save_checkpoint(str(tmp_path / "ckpt"))
    saved_config = json.loads((tmp_path / "ckpt" / "policy" / "config.json").read_text())
    assert saved_config["architectures"] == ["MixtralForCausalLM"]
    written = load_file(str(tmp_path / "ckpt" / "policy" / "model.safetensors"))
    trained = MixtralForCausalLM(config)
    trained.load_state_dict(first.model.state_dict())
    trained.save_pretrained(tmp_path / "expected")
    expected = load_file(str(tmp_path / "expected" / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in written
    assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in expected)
    resumed = make_worker(3, model_name=str(tmp_path / "base"))
    resumed.load_checkpoint(str(tmp_path / "ckpt"), None)
    held = first.model.state_dict()
    assert all(torch.equal(resumed.model.state_dict()[k], held[k]) for k in held)


@torch.no_grad()
def test_a_routers_input_jitter_is_off_too() -> None:
    """Mixtral's router_jitter_noise multiplies the router's input by noise in train mode only, as dropout does."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from nemo_like.models.dropout import disable_dropout

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.5)  # fmt: skip
    model = MixtralForCausalLM(config)
    ids = torch.randint(0, 64, (2, 12))
    model.eval()
    expected = model(input_ids=ids).logits
    model.train()
    assert (model(input_ids=ids).logits - expected).abs().max() > 1e-3  # the jitter's noise
    assert [str(rate) for rate in disable_dropout(model)] == ["router_jitter_noise=0.5"]
    assert (model(input_ids=ids).logits - expected).abs().max() < 1e-5
    # PhiMoE's router_jitter_noise is its sparsemixer's cut-off, in eval mode too: kept (its input jitter is noise)
    from transformers import PhimoeConfig, PhimoeForCausalLM

    phimoe = PhimoeForCausalLM(PhimoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                            router_jitter_noise=0.5, input_jitter_noise=0.1)).eval()  # fmt: skip
    before = phimoe(input_ids=ids).logits
    assert [str(rate) for rate in disable_dropout(phimoe)] == ["input_jitter_noise=0.1"]
    assert phimoe.config.router_jitter_noise == 0.5 and torch.equal(phimoe(input_ids=ids).logits, before)
    # DBRX's router noise lives in a nested config (ffn_config.moe_jitter_eps); OPT skips layers at random (layerdrop)
    from transformers import DbrxConfig, DbrxForCausalLM, OPTConfig, OPTForCausalLM

    dbrx = DbrxForCausalLM(DbrxConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, max_seq_len=32,
                                      ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2, "moe_jitter_eps": 0.5},
                                      attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}))  # fmt: skip
    opt = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=4, num_attention_heads=4,
                                   max_position_embeddings=32, word_embed_proj_dim=32, layerdrop=0.5, dropout=0.0))  # fmt: skip
    for noisy, rates in ((dbrx, ["moe_jitter_eps=0.5"]), (opt, ["layerdrop=0.5"])):
        expected = noisy.eval()(input_ids=ids).logits
        noisy.train()
        torch.manual_seed(1)
        assert (noisy(input_ids=ids).logits - expected).abs().max() > 1e-3, rates
        assert [str(rate) for rate in disable_dropout(noisy)] == rates
        assert (noisy(input_ids=ids).logits - expected).abs().max() < 1e-5, rates
