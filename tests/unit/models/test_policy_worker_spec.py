"""The policy worker's build instructions: one frozen, picklable PolicyWorkerSpec, from the config or from keywords."""

import pickle
from pathlib import Path

import pytest
import torch

from nemo_like.algorithms.loss_functions import ClippedPGLossFn
from nemo_like.config import load_config
from nemo_like.config.loss import ClippedPGLossConfig
from nemo_like.config.schema import EMBEDDED_MODEL, OptimizerConfig
from nemo_like.models.policy.batching import MicroBatchPlan
from nemo_like.models.policy.loss_protocol import LossFunction
from nemo_like.models.policy.spec import PolicyWorkerSpec, ShardingSettings
from nemo_like.models.policy.worker import PolicyWorker

TINY = Path(__file__).resolve().parents[3] / "examples" / "configs" / "grpo_tiny_cpu.yaml"


def loss() -> ClippedPGLossFn:
    return ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0))


def test_the_spec_from_the_config_types_the_sections_and_survives_pickling():
    cfg = load_config(TINY, ["policy.sequence_packing.enabled=true", "policy.lora_cfg.enabled=true"], warn=False)
    spec = PolicyWorkerSpec.from_config(cfg, True, loss(), num_threads=2)
    assert isinstance(spec.loss_fn, LossFunction)
    assert spec.batching == MicroBatchPlan(
        "packed", cfg.policy.sequence_packing.train_mb_tokens, cfg.policy.sequence_packing.logprob_mb_tokens
    )
    assert spec.sharding == ShardingSettings(**cfg.policy.dtensor_cfg.model_dump())
    assert spec.lora is cfg.policy.lora_cfg and spec.num_threads == 2
    reference = PolicyWorkerSpec.from_config(cfg, False, None, num_threads=1)
    assert reference.lora is None and reference.loss_fn is None  # the reference never has adapters
    assert pickle.loads(pickle.dumps(reference)) == reference  # what RayWorkerGroup sends to each actor
    assert "PolicyWorkerSpec(model_name=" in repr(reference)


def test_a_disabled_lora_section_means_no_lora_and_a_trainable_spec_needs_loss_and_optimizer():
    cfg = load_config(TINY, [], warn=False)
    spec = PolicyWorkerSpec.from_kwargs(
        model_name=EMBEDDED_MODEL,
        precision="float32",
        temperature=1.0,
        num_threads=1,
        seed=0,
        trainable=False,
        lora_cfg=cfg.policy.lora_cfg,
        train_micro_batch_size=3,
    )
    assert spec.lora is None and spec.batching == MicroBatchPlan("fixed", 3, 64)
    with pytest.raises(ValueError, match="needs the run's loss_fn and optimizer"):
        PolicyWorkerSpec(EMBEDDED_MODEL, "float32", 1.0, 1, 0, loss_fn=loss())


def test_a_worker_from_a_spec_equals_one_from_keywords_and_reinit_takes_the_spec():
    keywords = dict(
        model_name=EMBEDDED_MODEL,
        precision="float32",
        temperature=0.9,
        num_threads=1,
        seed=3,
        loss_fn=loss(),
        optimizer=OptimizerConfig(lr=1e-3),
        logprob_batch_size=2,
    )
    spec = PolicyWorkerSpec.from_kwargs(**keywords)
    a, b = PolicyWorker(rank=0, world_size=1, spec=spec), PolicyWorker(rank=0, world_size=1, **keywords)
    assert a.spec == b.spec and a.plan == b.plan
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8], [9, 10, 11, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])}
    assert torch.equal(a.get_logprobs(batch), b.get_logprobs(batch))
    with pytest.raises(TypeError, match="a spec or its keywords"):
        PolicyWorker(rank=0, world_size=1, spec=spec, seed=1)
    a.reinit(rank=0, world_size=1, spec=PolicyWorkerSpec.from_kwargs(**{**keywords, "trainable": False, "loss_fn": None}))
    assert not a.trainable and not any(p.requires_grad for p in a.model.parameters())
