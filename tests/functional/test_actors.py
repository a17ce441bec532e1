"""Real Ray actors: generation/policy logprob agreement across refits, and data parallelism."""

import pytest
import ray
import torch
from functional.helpers import tiny_config

from nemo_like.algorithms.loss_functions import ClippedPGLossFn
from nemo_like.data.collate import collate_samples
from nemo_like.data.prompts import build_prompt_dataset
from nemo_like.distributed.planning import plan_on_cluster
from nemo_like.models.generation.hf import HFGeneration
from nemo_like.models.generation.interface import SamplingParams
from nemo_like.models.loading import end_of_sequence_ids, load_tokenizer
from nemo_like.models.policy.policy import Policy
from nemo_like.models.refit.shared_memory import SharedWeights

pytestmark = pytest.mark.slow


def prompts(cfg, tokenizer, n=16):
    return [r.prompt_token_ids for r in build_prompt_dataset(cfg.data, tokenizer, "train", 48)[:n]]


def train_batch(samples, pad_id):
    batch = collate_samples(samples, pad_id)
    g = torch.Generator().manual_seed(0)
    batch["advantages"] = torch.randn(len(samples), 1, generator=g) * batch["token_mask"]
    return batch


def mean_abs_gap(policy, samples, pad_id):
    batch = collate_samples(samples, pad_id)
    train_lp = policy.get_logprobs(batch)
    mask = batch["token_mask"].bool()
    return (train_lp[mask] - batch["generation_logprobs"][mask]).abs().mean().item()


def check_generation_follows_the_policy(gen, policy, batch_prompts, params, pad_id):
    """Generation logprobs equal the policy's after each of two train+refit rounds; one more update
    without a refit leaves generation a version behind, and the gap shows."""
    samples = gen.generate(batch_prompts, params, seed=1)
    assert mean_abs_gap(policy, samples, pad_id) < 1e-4
    for step in range(2):
        policy.train(train_batch(samples, pad_id))
        gen.refit(policy.state_dict_ref(), policy.weight_version)
        samples = gen.generate(batch_prompts, params, seed=2 + step)
        assert all(s.weight_version == policy.weight_version for s in samples)
        assert mean_abs_gap(policy, samples, pad_id) < 1e-4
    policy.train(train_batch(samples, pad_id))
    stale = gen.generate(batch_prompts, params, seed=9)
    assert mean_abs_gap(policy, stale, pad_id) > 1e-3


def test_generation_logprobs_match_policy_after_each_refit_and_a_missed_refit_shows(ray_cluster, tmp_path):
    cfg = tiny_config(tmp_path, "policy.optimizer.lr=1e-2", "loss_fn.reference_policy_kl_penalty=0")
    tok = load_tokenizer(cfg.policy.model_name)
    policy = Policy(cfg, loss_fn=ClippedPGLossFn(cfg.loss_fn))
    gen = HFGeneration(cfg, tok.pad_token_id, end_of_sequence_ids(tok, cfg.policy.model_name), plan_on_cluster(cfg).threads.generation)
    try:
        check_generation_follows_the_policy(gen, policy, prompts(cfg, tok), SamplingParams(max_new_tokens=8), tok.pad_token_id)
    finally:
        gen.shutdown()
        policy.shutdown()


def test_two_data_parallel_ranks_equal_one_rank(ray_cluster, tmp_path):
    # Sharded ranks run the model's own forward (FSDP2 gathers in its modules' hooks): so does the one-rank run here, so
    # that the comparison isolates sharding (the shared-prompt forward is compared with it in test_shared_prefix.py).
    cfg1 = tiny_config(tmp_path, "policy.optimizer.lr=1e-2", "loss_fn.reference_policy_kl_penalty=0", "policy.shared_prompt_forward=false")
    cfg2 = tiny_config(
        tmp_path, "policy.optimizer.lr=1e-2", "loss_fn.reference_policy_kl_penalty=0", "policy.dp_size=2", "policy.refit_buffer_size_mb=0.5"
    )
    tok = load_tokenizer(cfg1.policy.model_name)
    gen = HFGeneration(cfg1, tok.pad_token_id, end_of_sequence_ids(tok, cfg1.policy.model_name), plan_on_cluster(cfg1).threads.generation)
    params = SamplingParams(max_new_tokens=8)
    samples = gen.generate(prompts(cfg1, tok), params, seed=3)
    batch = train_batch(samples, tok.pad_token_id)
    # A rollout with one row more than planned (an agent session that branched): still one optimizer step, its 17 rows
    # split 8/9 over the two ranks (fixed train_global_batch_size slices made a second, one-row step: two ranks failed).
    branched = train_batch([*samples, samples[0]], tok.pad_token_id)
    single = Policy(cfg1, "single", loss_fn=ClippedPGLossFn(cfg1.loss_fn))
    r1 = single.train(batch)
    _, w1 = torch_get(single.state_dict_ref())
    r1_branched = single.train(branched)
    single.shutdown()
    dp = Policy(cfg2, "dp", loss_fn=ClippedPGLossFn(cfg2.loss_fn))
    r2 = dp.train(batch)
    checksums = dp.parameter_checksums()
    _, w2 = torch_get(dp.state_dict_ref())
    # Compared by loss and gradient norm: weights after a second AdamW step differ by up to 2.5e-4 between one and two
    # ranks even for planned batches (the k_proj biases' gradients are ~0 in exact arithmetic; Adam normalises noise).
    r2_branched = dp.train(branched)
    assert len(r1_branched.grad_norms) == len(r2_branched.grad_norms) == 1
    assert abs(r1_branched.metrics["loss"] - r2_branched.metrics["loss"]) < 1e-6
    assert r2_branched.grad_norms[0] == pytest.approx(r1_branched.grad_norms[0], rel=1e-5)
    _, current = torch_get(dp.state_dict_ref())
    # Refit from the two shards: gathered in buckets of <= 0.5 MB (the tiny model is ~4 MB), streamed to generation.
    buckets = dp.weight_buckets(shared_memory=False)
    assert len(buckets.refs) > 4 and sorted(buckets.all_names()) == sorted(w2)
    gen.refit(buckets, dp.weight_version)
    assert mean_abs_gap(dp, gen.generate(prompts(cfg1, tok), params, seed=4), tok.pad_token_id) < 1e-4
    # The one-node default: gathered from the shards into a shared-memory buffer, bit for bit.
    assert dp.shared_memory_refit
    shared = dp.weight_buckets()
    assert isinstance(shared, SharedWeights) and shared.refs == []
    received = shared.state_dict()
    assert sorted(received) == sorted(current) and all(torch.equal(received[name], current[name]) for name in current)
    gen.refit(shared, dp.weight_version)
    assert mean_abs_gap(dp, gen.generate(prompts(cfg1, tok), params, seed=4), tok.pad_token_id) < 1e-4
    # An engine replaced after the policy trained past the served weights (as in an async run with older samples):
    # it maps the policy's buffer, written in place by the second export, and serves exactly the served version.
    dp.train(batch)
    gen.refit(dp.weight_buckets, dp.weight_version)  # the facade's export: the buffer's second version
    served, before = gen.served.version, gen.generate(prompts(cfg1, tok), params, seed=5)
    dp.train(batch)  # the policy moves on; nothing exported
    gen.replaceable.replace(0)
    assert ray_get_version(gen) == served and gen.generate(prompts(cfg1, tok), params, seed=5) == before
    gen.refit(dp.weight_buckets, dp.weight_version)  # the replacement takes later refits from the same buffer
    assert dp.take_refit_bytes() > 0 and mean_abs_gap(dp, gen.generate(prompts(cfg1, tok), params, seed=4), tok.pad_token_id) < 1e-4

    # A /dev/shm without room for the weights (Docker's 64 MB; here rank 0 may write no file past 1 MiB): the export is
    # refused before any page is written (it was a SIGBUS that killed the worker) and the refit takes the object store.
    def _limit_file_size(worker, soft: int | tuple) -> tuple:
        """In a policy worker: cap the size of the files it writes (``RLIMIT_FSIZE``'s soft limit; SIGXFSZ ignored, so a
        write past it fails with EFBIG); a tuple restores the limits. Returns the limits before."""
        import resource
        import signal

        before = resource.getrlimit(resource.RLIMIT_FSIZE)
        if isinstance(soft, tuple):
            resource.setrlimit(resource.RLIMIT_FSIZE, soft)
            return before
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, before[1]))
        return before

    limits = ray.get(dp.group.workers[0].__ray_call__.remote(_limit_file_size, 1 << 20))
    try:
        dp._fresh_refit_buffer = True  # a new buffer, as after a restart
        fallback = dp.weight_buckets()
        assert not dp.shared_memory_refit and not isinstance(fallback, SharedWeights) and len(fallback.refs) >= 1
        gen.refit(fallback, dp.weight_version)
        assert mean_abs_gap(dp, gen.generate(prompts(cfg1, tok), params, seed=4), tok.pad_token_id) < 1e-4
    finally:
        ray.get(dp.group.workers[0].__ray_call__.remote(_limit_file_size, limits))
    gen.shutdown()
    dp.shutdown()
    assert checksums[0] == checksums[1]  # every rank sums the same full model over its shards
    assert abs(r1.metrics["loss"] - r2.metrics["loss"]) < 1e-6
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], atol=2e-6, rtol=0, msg=name)


def ray_get_version(gen) -> int:
    import ray

    return ray.get(gen.group.workers[0].__ray_call__.remote(lambda actor: actor.weight_version))


def torch_get(ref):
    import ray

    return ray.get(ref)


def test_actors_of_a_private_cluster_run_at_the_drivers_priority(ray_cluster):
    """Ray's default worker niceness (15) would let any other process on the machine starve the run's actors."""
    import os

    @ray_cluster.remote(num_cpus=0)
    def niceness() -> tuple[int, int]:
        # Its own and its raylet's (its parent, started at the driver's priority when the cluster started: a test
        # worker may lower its own priority later, tests/conftest.py): /proc/<pid>/stat's 19th field
        parent = int(open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[16])
        return os.nice(0), parent

    own, raylet = ray_cluster.get(niceness.remote())
    assert own == raylet  # 15 above it without nemo_like.distributed.ray_env


def test_forcing_the_shared_prompt_forward_on_a_non_llama_model_ends_in_one_message_naming_the_key(ray_cluster, tmp_path):
    # The mistake is found in the worker's constructor (the model family is known only once loaded): the driver's error
    # must carry the constructor's message, not only Ray's "died in its creation task".
    from transformers import GPT2Config, GPT2LMHeadModel

    from nemo_like.distributed.worker_group import WorkerFailure
    from nemo_like.models.loading import resolve_model_path

    tok = load_tokenizer(resolve_model_path("embedded:tiny-arith-qwen2"))
    config = GPT2Config(
        vocab_size=len(tok), n_embd=32, n_layer=1, n_head=4, n_positions=256, bos_token_id=None, eos_token_id=tok.eos_token_id
    )
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    cfg = tiny_config(
        tmp_path, f"policy.model_name={tmp_path / 'gpt2'}", "policy.shared_prompt_forward=true", "loss_fn.reference_policy_kl_penalty=0"
    )
    with pytest.raises(
        WorkerFailure, match="its constructor raised ValueError: policy.shared_prompt_forward=true cannot apply: GPT2LMHeadModel"
    ):
        Policy(cfg, "gpt2-forced", loss_fn=ClippedPGLossFn(cfg.loss_fn))


def test_a_failed_start_of_the_policy_releases_every_actor_started_beside_it(ray_cluster, tmp_path, monkeypatch):
    """setup starts every role's workers together (the order is checked in test_grpo_end_to_end.py's two-step run):
    when the policy's start fails, the reference's and the environments' actors started beside it are released too."""
    import ray

    from nemo_like.algorithms import setup as grpo_setup
    from nemo_like.distributed import worker_group

    cfg = tiny_config(tmp_path)  # the tiny recipe's KL penalty loads a reference model
    assert plan_on_cluster(cfg).logprobs.load_reference_model
    real_init, real_environments = Policy.__init__, grpo_setup.Environments
    workers, environment_workers = [], []

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        workers.extend(self.group.workers)

    def recording_environments(*args, **kwargs):
        environments = real_environments(*args, **kwargs)
        environment_workers.extend(w for group in environments.groups.values() for w in group.workers)
        return environments

    def failing_wait(self):
        raise RuntimeError(f"the {self.name} could not start")

    monkeypatch.setattr(Policy, "__init__", recording_init)
    monkeypatch.setattr(grpo_setup, "Environments", recording_environments)
    monkeypatch.setattr(Policy, "wait_ready", failing_wait)
    with pytest.raises(RuntimeError, match="the policy could not start"):
        grpo_setup.setup_grpo(cfg)
    assert len(workers) == 2 and environment_workers  # the policy's, the reference's, the environments' actors
    for worker in workers:  # the models' workers are gone
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(worker.__ray_ready__.remote(), timeout=30)
    idle = {w for group in worker_group._POOL.idle for w in group.workers}
    for worker in environment_workers:  # the environments' actors were shut down: killed, or idle for reuse in tests
        if worker not in idle:
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(worker.__ray_ready__.remote(), timeout=30)
