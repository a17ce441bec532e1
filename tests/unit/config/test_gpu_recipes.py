"""The GPU recipes and the GPU-only contradictions, checked on a CPU (nothing here needs a GPU to decide).

* every GPU recipe runs vLLM with CUDA graphs and a private object store that holds two refits of its model;
* async GRPO with a colocated engine is an error (both would hold policy rank 0's GPU at once);
* FSDP2's CPU offload with one worker (nothing sharded) is a no-effect warning, not silence.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from nemo_like.config import ConfigError, load_config

RECIPES = Path(__file__).resolve().parents[3] / "examples" / "configs"
# Shapes of the hub models the GPU recipes name (their config.json), so their size is known offline.
QWEN25 = {
    "Qwen/Qwen2.5-0.5B-Instruct": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14),
    "Qwen/Qwen2.5-1.5B-Instruct": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12),
}
GPU_RECIPES = ["grpo_gsm8k_0.5B.yaml", "grpo_math_1B.yaml", "grpo_gsm8k_0.5B_1gpu.yaml"]


def refit_bytes(model_name: str) -> int:
    """Bytes of one bf16 refit: every parameter, the tied head again under its own name (built on the meta device)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=151936, num_key_value_heads=2, tie_word_embeddings=True, **QWEN25[model_name])
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    return 2 * sum(t.numel() for t in model.state_dict().values())


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_gpu_recipes_use_cuda_graphs_and_an_object_store_that_holds_two_refits(recipe):
    cfg = load_config(str(RECIPES / recipe), [])
    assert cfg.cluster.gpus_per_node > 0 and cfg.policy.precision == "bfloat16"
    assert cfg.policy.generation.vllm_cfg.enforce_eager is False
    per_refit = refit_bytes(cfg.policy.model_name)
    assert cfg.cluster.object_store_memory_mb * 2**20 >= 2 * per_refit, f"{per_refit / 2**30:.2f} GiB per refit"
    assert cfg.policy.refit_buffer_size_mb * 2**20 < per_refit  # streamed in several buckets
    # The GPUs the recipe's comment promises: policy ranks, plus as many reference ranks when a KL penalty needs one.
    ranks = cfg.policy.dp_size * cfg.policy.dtensor_cfg.tensor_parallel_size
    gpus = ranks * (2 if cfg.loss_fn.reference_policy_kl_penalty else 1)
    assert gpus == cfg.cluster.gpus_per_node * cfg.cluster.num_nodes
    assert cfg.no_effect_warnings() == []


def test_one_gpu_recipe_takes_the_cuda_ipc_path():
    """One policy rank, colocated, no LoRA: the only recipe shape whose refit hands CUDA-IPC handles to the engine."""
    cfg = load_config(str(RECIPES / "grpo_gsm8k_0.5B_1gpu.yaml"), [])
    assert cfg.policy.dp_size == 1 and cfg.policy.generation.colocated.enabled and not cfg.policy.lora_cfg.enabled
    assert cfg.loss_fn.reference_policy_kl_penalty == 0  # no reference: it would need a second GPU


def test_async_with_a_colocated_engine_on_gpus_is_an_error(monkeypatch):
    from nemo_like.config import schema

    overrides = ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true", "cluster.gpus_per_node=1"]
    with pytest.raises(ConfigError, match=r"policy\.generation\.colocated\.enabled=true"):
        load_config(str(RECIPES / "grpo_tiny_cpu.yaml"), [*overrides, "policy.generation.backend=vllm"])
    # auto picks vLLM on GPUs where it is installed, else the HF engine, which is never colocated: the same recipe was
    # refused without vLLM, though it would run
    for installed in (True, False):
        monkeypatch.setattr(schema, "vllm_available", lambda installed=installed: installed)
        with pytest.raises(ConfigError) if installed else contextlib.nullcontext():
            load_config(str(RECIPES / "grpo_tiny_cpu.yaml"), overrides)
    cfg = load_config(str(RECIPES / "grpo_tiny_cpu.yaml"), [*overrides, "policy.generation.colocated.enabled=false"])
    assert cfg.grpo.async_grpo.enabled
    # The HF engine always has a GPU of its own: the (default) colocation key does nothing there, no error
    assert load_config(str(RECIPES / "grpo_tiny_cpu.yaml"), [*overrides, "policy.generation.backend=hf"]).grpo.async_grpo.enabled
    # On a CPU there is no colocation, so the async CPU recipe stays valid.
    assert load_config(str(RECIPES / "grpo_tiny_cpu_async.yaml"), []).grpo.async_grpo.enabled


def test_cpu_offload_with_one_worker_warns_that_nothing_is_sharded():
    base = ["cluster.gpus_per_node=2", "policy.dtensor_cfg.cpu_offload=true"]
    one = load_config(str(RECIPES / "grpo_tiny_cpu.yaml"), base).no_effect_warnings()
    assert any(line.startswith("policy.dtensor_cfg.cpu_offload has no effect with one policy worker") for line in one)
    two = load_config(str(RECIPES / "grpo_tiny_cpu.yaml"), [*base, "policy.dp_size=2"]).no_effect_warnings()
    assert not any("cpu_offload" in line for line in two)


def test_sharding_switched_off_warns_that_it_changes_nothing():
    """false is valid with one policy worker only, which never shards: an ablation flipping the key ran the baseline."""
    off = load_config(str(RECIPES / "grpo_tiny_cpu.yaml"), ["policy.dtensor_cfg.enabled=false"]).no_effect_warnings()
    assert [line for line in off if "dtensor_cfg.enabled" in line] == [
        "policy.dtensor_cfg.enabled=false has no effect with policy.dp_size=1 and tensor_parallel_size=1 (nothing is sharded: "
        "the plain model is used either way)"
    ]
    on = load_config(str(RECIPES / "grpo_tiny_cpu.yaml"), []).no_effect_warnings()
    assert not any("dtensor_cfg.enabled" in line for line in on)
