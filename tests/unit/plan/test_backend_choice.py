"""Which generation engine ``policy.generation.backend`` resolves to, and the combinations inline refuses."""

from __future__ import annotations

import re

import pytest

from nemo_like.config import DEFAULT_RECIPE, MasterConfig, load_config
from nemo_like.config.errors import ConfigError
from nemo_like.models.engines import generation_resources
from nemo_like.plan.backend import PolicyModel, resolve_backend, vllm_adapter_blocker, vllm_available
from nemo_like.plan.run_plan import Decision, RunPlan, decide_run_plan

MOE = PolicyModel(experts=True)


def recipe(*overrides: str) -> MasterConfig:
    return load_config(DEFAULT_RECIPE, list(overrides))


def plan_of(cfg: MasterConfig, with_policy: bool = True) -> RunPlan:
    return decide_run_plan(cfg, (), cpus_per_node=2, with_policy=with_policy)


def test_auto_samples_inline_on_a_sync_cpu_run_with_one_policy_worker_and_reserves_nothing() -> None:
    cfg = recipe()
    assert resolve_backend(cfg)[0] == "inline"
    role = generation_resources(cfg, plan_of(cfg))
    assert role.count == 0 and role.total() == {"CPU": 0}


@pytest.mark.parametrize(
    "overrides, because",
    [
        (("grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"), "async"),
        (("policy.dp_size=2", "policy.train_global_batch_size=64"), "sharded"),
    ],
)
def test_auto_uses_the_hf_engine_on_cpu_where_inline_does_not_apply_and_says_why(overrides: tuple[str, ...], because: str) -> None:
    backend, reason = resolve_backend(recipe(*overrides))
    assert backend == "hf" and because.lower() in reason.lower()
    assert "policy.generation.backend=vllm" in reason  # how to get vLLM's CPU build instead


def test_auto_serves_lora_adapters_with_vllm_on_cpu_when_it_is_installed() -> None:
    backend, reason = resolve_backend(recipe("policy.lora_cfg.enabled=true"))
    assert "lora" in reason.lower()
    assert backend == ("vllm" if vllm_available() else "hf")


@pytest.mark.parametrize(
    "overrides",
    [
        ("policy.lora_cfg.refit=merged",),
        ("policy.lora_cfg.dim=1024", "policy.lora_cfg.alpha=1024"),
        ("grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true", "grpo.async_grpo.max_trajectory_age_steps=1",
         "grpo.async_grpo.in_flight_weight_updates=true"),
    ],
)  # fmt: skip
def test_auto_takes_the_hf_engine_for_a_lora_run_whose_refit_sends_merged_weights(overrides: tuple[str, ...]) -> None:
    """auto chose vLLM's CPU build "because it serves the adapters" while the refit plan sent merged weights: the
    slower engine (1.5-2.7x) for nothing, and a reason that was false."""
    cfg = recipe("policy.lora_cfg.enabled=true", *overrides)
    plan = plan_of(cfg)
    assert plan.backend.value == "hf" and plan.refit.value == "merged"
    if overrides[0] != "policy.lora_cfg.refit=merged":  # the reasons name what keeps vLLM from the adapters, not "HF"
        unserved = vllm_adapter_blocker(cfg)
        assert unserved in plan.backend.reason and plan.refit.reason.startswith(f"auto: {unserved} (so the auto backend chose hf")
        with pytest.raises(ConfigError, match=rf"refit=adapter is not possible here: {re.escape(unserved)} \(so the auto"):
            plan_of(recipe("policy.lora_cfg.enabled=true", *overrides, "policy.lora_cfg.refit=adapter"))


def test_on_gpus_without_vllm_the_lora_refit_reason_does_not_blame_the_adapters(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto on a GPU cluster takes the HF engine only because vLLM is not installed: the adapters' rank was not why."""
    from nemo_like.plan import backend, refit

    monkeypatch.setattr(backend, "vllm_available", lambda: False)
    monkeypatch.setattr(refit, "vllm_available", lambda: False)
    cfg = recipe("policy.lora_cfg.enabled=true", "policy.lora_cfg.dim=1024", "policy.lora_cfg.alpha=1024", "cluster.gpus_per_node=1")
    assert resolve_backend(cfg) == ("hf", "auto: a GPU cluster, but vllm is not installed")
    assert refit.refit_mode(cfg, "hf") == ("merged", "auto: the HF generation backend serves plain weights")


def test_in_flight_updates_at_trajectory_age_0_change_nothing() -> None:
    """The key was warned 'no effect' at max_trajectory_age_steps=0, yet it made the LoRA refit merged (with its bf16
    warning, and an explicit refit=adapter an error) and the generation actors threaded."""
    from nemo_like.models.generation.interface import actor_concurrency

    async_lora = ["policy.lora_cfg.enabled=true", "grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true",
                  "policy.generation.backend=vllm", "grpo.async_grpo.max_trajectory_age_steps=0"]  # fmt: skip
    off, on = recipe(*async_lora), recipe(*async_lora, "grpo.async_grpo.in_flight_weight_updates=true")
    assert not on.grpo.async_grpo.refits_mid_generation and on.grpo.async_grpo.in_flight_weight_updates
    assert plan_of(on).refit.value == plan_of(off).refit.value == "adapter"
    assert actor_concurrency(on) == actor_concurrency(off) == 1
    recipe(*async_lora, "grpo.async_grpo.in_flight_weight_updates=true", "policy.lora_cfg.refit=adapter")  # no error
    aged = recipe(*async_lora[:-1], "grpo.async_grpo.max_trajectory_age_steps=1", "grpo.async_grpo.in_flight_weight_updates=true")
    assert aged.grpo.async_grpo.refits_mid_generation and actor_concurrency(aged) == 2 and plan_of(aged).refit.value == "merged"


def test_auto_uses_vllm_on_a_gpu_cluster_when_it_is_installed() -> None:
    backend, reason = resolve_backend(recipe("cluster.gpus_per_node=1"))
    assert backend == ("vllm" if vllm_available() else "hf") and "GPU" in reason


def test_evaluation_never_resolves_to_inline() -> None:
    assert resolve_backend(recipe(), with_policy=False)[0] == "hf"
    assert generation_resources(recipe(), plan_of(recipe(), with_policy=False)).count == 1


@pytest.mark.parametrize(
    "overrides, key",
    [
        (("grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"), "grpo.async_grpo.enabled"),
        (("policy.dp_size=2", "policy.train_global_batch_size=64"), "policy.dp_size"),
        (("policy.lora_cfg.enabled=true",), "policy.lora_cfg.enabled"),
    ],
)
def test_an_explicit_inline_backend_that_cannot_apply_is_an_error_naming_the_key(overrides: tuple[str, ...], key: str) -> None:
    with pytest.raises(ConfigError, match="policy.generation.backend=inline") as err:
        resolve_backend(recipe("policy.generation.backend=inline", *overrides))
    assert key in str(err.value)
    with pytest.raises(ConfigError, match="policy.generation.backend=inline"):
        resolve_backend(recipe("policy.generation.backend=inline"), with_policy=False)


def test_engine_options_that_the_chosen_engine_ignores_are_named() -> None:
    from nemo_like.models.engines import ignored_engine_keys

    assert ignored_engine_keys(recipe(), "inline") == []
    cfg = recipe("policy.generation.num_threads_per_worker=1", "policy.generation.vllm_cfg.kv_cache_space_gib=2")
    lines = ignored_engine_keys(cfg, "inline")
    assert len(lines) == 2
    assert lines[0].startswith("policy.generation.num_threads_per_worker=1 has no effect with inline generation")
    assert lines[1].startswith("policy.generation.vllm_cfg.kv_cache_space_gib has no effect with inline generation")
    assert ignored_engine_keys(cfg, "hf") == [
        "policy.generation.vllm_cfg.kv_cache_space_gib has no effect with the hf engine (no vLLM engine starts)"
    ]
    assert ignored_engine_keys(cfg, "vllm") == []
    # The colocated engine's options are vLLM's too (an hf engine always has a device of its own, so asking for one,
    # colocated.enabled=false, as async GPU runs must, is no surprise and stays quiet).
    colocated = recipe("policy.generation.colocated.offload_optimizer=false", "policy.generation.colocated.enabled=false")
    assert ignored_engine_keys(colocated, "hf") == [
        "policy.generation.colocated.offload_optimizer has no effect with the hf engine (no vLLM engine starts)"
    ]
    # On a CPU cluster the vLLM engine reads neither the colocated offload nor the GPU memory share; on a GPU cluster
    # it does not read the CPU KV-cache size (each was ignored silently).
    assert ignored_engine_keys(colocated, "vllm") == [
        "policy.generation.colocated.offload_optimizer=false has no effect with the vLLM engine on a CPU cluster (GPU only)"
    ]
    share = recipe("policy.generation.vllm_cfg.gpu_memory_utilization=0.9")
    assert ignored_engine_keys(share, "vllm") == [
        "policy.generation.vllm_cfg.gpu_memory_utilization=0.9 has no effect with the vLLM engine on a CPU cluster (GPU only)"
    ]
    gpu = ("cluster.gpus_per_node=1", "policy.precision=bfloat16")
    assert ignored_engine_keys(recipe(*gpu, "policy.generation.vllm_cfg.gpu_memory_utilization=0.9"), "vllm") == []
    assert ignored_engine_keys(recipe(*gpu, "policy.generation.vllm_cfg.kv_cache_space_gib=2"), "vllm") == [
        "policy.generation.vllm_cfg.kv_cache_space_gib=2 has no effect with the vLLM engine on a GPU cluster (it sizes the "
        "CPU engine's KV cache)"
    ]
    # On a GPU cluster the offload serves a colocated engine only (an engine on GPUs of its own ignored it silently)
    own_gpus = recipe(*gpu, "policy.generation.colocated.offload_optimizer=false", "policy.generation.colocated.enabled=false")
    assert ignored_engine_keys(own_gpus, "vllm") == [
        "policy.generation.colocated.offload_optimizer=false has no effect with policy.generation.colocated.enabled=false "
        "(the engine has GPUs of its own: nothing is offloaded to make room)"
    ]
    assert ignored_engine_keys(recipe(*gpu, "policy.generation.colocated.offload_optimizer=false"), "vllm") == []
    # FSDP2's CPU offload keeps the AdamW state in host RAM already: the colocated offload moves nothing
    offloaded = recipe(*gpu, "cluster.gpus_per_node=2", "policy.dp_size=2", "policy.dtensor_cfg.cpu_offload=true",
                       "policy.generation.colocated.offload_optimizer=false")  # fmt: skip
    assert ignored_engine_keys(offloaded, "vllm") == [
        "policy.generation.colocated.offload_optimizer=false has no effect with policy.dtensor_cfg.cpu_offload=true "
        "(FSDP2 keeps the AdamW state in host RAM already)"
    ]


def test_every_backend_the_config_allows_is_one_registration() -> None:
    from typing import get_args

    from nemo_like.config.schema import GenerationConfig
    from nemo_like.models.engines import BACKENDS, Backend, register_backend

    allowed = set(get_args(GenerationConfig.model_fields["backend"].annotation)) - {"auto"}
    assert set(BACKENDS) == allowed
    with pytest.raises(ValueError, match="already registered"):
        register_backend(Backend("hf", BACKENDS["hf"].build, BACKENDS["hf"].resources, described="again"))


def test_the_engine_factory_reserves_what_the_plan_decided_not_what_the_config_would_resolve_to() -> None:
    from dataclasses import replace

    from nemo_like.models import engines

    plan = plan_of(recipe())  # auto -> inline on this recipe
    assert plan.backend.value == "inline"
    assert engines.generation_resources(recipe(), replace(plan, backend=Decision("hf", "requested"))).count == 1
    assert engines.generation_resources(recipe(), plan).count == 0


def test_an_unknown_backend_name_gets_the_registry_error_naming_the_key() -> None:
    from nemo_like.models.engines import BACKENDS
    from nemo_like.utils.registry import PluginNameError

    with pytest.raises(PluginNameError, match=r"policy.generation.backend: unknown generation backend 'vlm'.*Did you mean 'vllm'"):
        BACKENDS.get("vlm")


def test_the_lora_refit_mode_takes_the_decided_backend() -> None:
    from nemo_like.models import lora as models_lora
    from nemo_like.models.policy import lora as policy_lora
    from nemo_like.plan import refit as lora

    cfg = recipe("policy.lora_cfg.enabled=true")
    assert lora.refit_mode(cfg, "hf")[0] == "merged"
    assert lora.refit_mode(cfg, "vllm")[0] == "adapter"
    with pytest.raises(ValueError, match="depends on the generation backend"):
        lora.refit_mode(cfg, None)
    assert lora.refit_mode(recipe("policy.lora_cfg.enabled=true", "policy.lora_cfg.refit=merged"), None)[0] == "merged"
    # the old path's cfg-only form (the Policy's) resolves the backend itself
    assert policy_lora.refit_mode(cfg) == lora.refit_mode(cfg, resolve_backend(cfg)[0])
    assert policy_lora.merge_checkpoint is models_lora.merge_checkpoint


@pytest.mark.skipif(not vllm_available(), reason="vllm is not installed")
def test_a_temperature_vllm_refuses_is_a_config_error_before_any_actor_starts() -> None:
    """vLLM 0.32 refuses temperature > 2 per request: the run used to start Ray, the policy and the engine and fail
    at the first generate call. Our own sampler takes any positive temperature."""
    from vllm import SamplingParams as VSamplingParams

    with pytest.raises(Exception, match=r"temperature must be in \[0, 2\]"):  # the rule, read from vLLM itself
        VSamplingParams(temperature=2.5)
    with pytest.raises(ConfigError, match=r"policy.generation.temperature=2.5: vLLM samples at most temperature 2"):
        plan_of(recipe("policy.generation.backend=vllm", "policy.generation.temperature=2.5"))
    assert plan_of(recipe("policy.generation.backend=vllm", "policy.generation.temperature=2")).backend.value == "vllm"
    assert plan_of(recipe("policy.generation.backend=hf", "policy.generation.temperature=2.5")).backend.value == "hf"
    # Below 0.01, vLLM samples at 0.01 instead (read from vLLM itself): its logprobs would not be the trainer's
    assert VSamplingParams(temperature=0.005).temperature == 0.01
    with pytest.raises(ConfigError, match=r"temperature=0.005: vLLM samples at temperature 0.01 or more"):
        plan_of(recipe("policy.generation.backend=vllm", "policy.generation.temperature=0.005"))
    assert plan_of(recipe("policy.generation.backend=vllm", "policy.generation.temperature=0.01")).backend.value == "vllm"
    assert plan_of(recipe("policy.generation.backend=hf", "policy.generation.temperature=0.005")).backend.value == "hf"


def test_a_cpu_training_run_of_a_mixture_of_experts_does_not_generate_with_vllm(tmp_path) -> None:
    # vLLM's CPU build samples from other weights than a refit sent (a tiny Qwen3-MoE refitted with its own weights
    # moved 0.01-0.02 nats a token) and its LoRA layers for experts need Triton: auto takes the HF engine, and an
    # explicit vllm is refused before any actor starts; an eval (no refit) and a GPU cluster keep it
    from transformers import MixtralConfig

    from nemo_like.config.schema import EMBEDDED_MODEL
    from nemo_like.models.loading import routes_experts

    MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  vocab_size=359, num_local_experts=4, num_experts_per_tok=2).save_pretrained(tmp_path)  # fmt: skip
    assert routes_experts(str(tmp_path)) and not routes_experts(EMBEDDED_MODEL)
    from transformers import DogeConfig  # dense, but its config class carries a default num_experts_per_tok

    dense = tmp_path / "doge"
    DogeConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
               vocab_size=359, is_moe=False).save_pretrained(dense)  # fmt: skip
    assert not routes_experts(str(dense))
    lora = recipe("policy.lora_cfg.enabled=true")
    backend, reason = resolve_backend(lora, model=MOE)
    assert backend == "hf" and "mixture of experts" in reason and "backend=vllm for" not in reason
    if vllm_available():
        assert resolve_backend(lora)[0] == "vllm"  # a dense policy's adapters: vLLM serves them
        assert resolve_backend(recipe("policy.generation.backend=vllm"), with_policy=False, model=MOE)[0] == "vllm"
        gpu = recipe("policy.generation.backend=vllm", "cluster.gpus_per_node=1", "policy.generation.colocated.enabled=false")
        assert resolve_backend(gpu, model=MOE)[0] == "vllm"
    with pytest.raises(ConfigError, match=r"backend=vllm on a CPU cluster: .* is a mixture of experts.*use policy.generation.backend=hf"):
        decide_run_plan(recipe("policy.generation.backend=vllm"), (), cpus_per_node=2, model=MOE)


def test_the_auto_backend_and_refit_keep_lora_off_vllm_where_vllm_cannot_serve_the_model(tmp_path) -> None:
    """A LoRA run on CPU with auto picked vLLM's CPU build to serve the adapters for any model: a Mamba2's engine
    asserted at start (vLLM's class takes no adapters, on GPUs too), a head size of 16 failed its first step after every
    actor had started. The facts are read once from the model's config; auto takes the HF engine (CPU) or the merged
    refit (GPU), and what cannot work is refused before any actor starts."""
    from transformers import Mamba2Config, Qwen2Config

    from nemo_like.models.loading import policy_model
    from nemo_like.plan.refit import refit_mode

    Mamba2Config(vocab_size=359, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=8, n_groups=1,
                 architectures=["Mamba2ForCausalLM"]).save_pretrained(tmp_path / "mamba2")  # fmt: skip
    Qwen2Config(vocab_size=359, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, architectures=["Qwen2ForCausalLM"]).save_pretrained(tmp_path / "heads16")  # fmt: skip
    mamba, narrow = policy_model(str(tmp_path / "mamba2")), policy_model(str(tmp_path / "heads16"))
    assert (mamba.architecture, mamba.head_dims, narrow.head_dims) == ("Mamba2ForCausalLM", (), (16,))
    assert policy_model("embedded:tiny-arith-qwen2") == PolicyModel(False, "Qwen2ForCausalLM", (32,))  # vLLM serves it every way
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    gemma4 = CONFIG_MAPPING["gemma4_text"](hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                           num_key_value_heads=1, head_dim=32, vocab_size=359)  # fmt: skip
    gemma4.save_pretrained(tmp_path / "gemma4")  # a head size per layer: reading the config's whole raised, and plan crashed
    assert policy_model(str(tmp_path / "gemma4")).head_dims == (32, 512)
    lora = recipe("policy.lora_cfg.enabled=true")
    for model, why in ((mamba, "vLLM's class for Mamba2ForCausalLM takes no LoRA adapters"), (narrow, "the model's is 16")):
        backend, reason = resolve_backend(lora, model=model)
        assert backend == "hf" and why in reason and "backend=vllm for" not in reason, reason
        assert refit_mode(lora, backend, model)[0] == "merged"
    with pytest.raises(
        ConfigError, match=r"backend=vllm on a CPU cluster: .*vLLM's CPU attention computes head sizes \[32, .*the model's is 16"
    ):
        resolve_backend(recipe("policy.generation.backend=vllm"), with_policy=False, model=narrow)
    # a gated delta net: vLLM's CPU build asserted bf16 in its first step ("CPU GDN attention requires BF16")
    from transformers import Qwen3NextConfig

    Qwen3NextConfig(vocab_size=359, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                    layer_types=["linear_attention", "full_attention"]).save_pretrained(tmp_path / "next")  # fmt: skip
    delta_net = policy_model(str(tmp_path / "next"))
    assert delta_net.gated_delta_net and not mamba.gated_delta_net and not narrow.gated_delta_net
    with pytest.raises(ConfigError, match=r"gated delta nets in bfloat16 only, and it would load it in float32"):
        resolve_backend(recipe("policy.generation.backend=vllm"), model=delta_net)
    bf16 = recipe("policy.generation.backend=vllm", "policy.precision=bfloat16")
    assert resolve_backend(bf16, with_policy=False, model=delta_net)[0] == "vllm"  # (an eval's: Qwen3-Next routes experts)
    # a multimodal class: vLLM imports torchvision for it, which the CPU install removes (auto had picked vLLM to serve
    # a Gemma 3 LoRA run's adapters, and its engine died at start: "No module named 'torchvision'")
    import dataclasses
    import importlib.util

    from unit.models.test_text_path import config_of

    config_of("gemma3").save_pretrained(tmp_path / "gemma3")
    gemma3 = policy_model(str(tmp_path / "gemma3"))
    assert gemma3.multimodal and not delta_net.multimodal and not narrow.multimodal
    vision = dataclasses.replace(gemma3, head_dims=(32,))  # a head size vLLM's CPU attention computes: torchvision alone decides
    backend, reason = resolve_backend(lora, model=vision)
    qwen35 = PolicyModel(architecture="Qwen3_5ForCausalLM", head_dims=(32,))  # a text class in vLLM's qwen3_5 module
    if importlib.util.find_spec("torchvision") is None:
        assert backend == "hf" and "imports torchvision (a multimodal model's), which the CPU install removes" in reason, reason
        assert "imports torchvision" in qwen35.vllm_cpu_problem("bfloat16")
    else:
        assert vision.vllm_cpu_problem("float32") is None and qwen35.vllm_cpu_problem("bfloat16") is None
    on_gpu = recipe("policy.lora_cfg.enabled=true", "cluster.gpus_per_node=1", "policy.generation.colocated.enabled=false")
    assert refit_mode(on_gpu, "vllm", mamba) == ("merged", "auto: vLLM's class for Mamba2ForCausalLM takes no LoRA adapters")
    assert refit_mode(on_gpu, "vllm", narrow)[0] == "adapter"  # vLLM's GPU attention computes it
    adapter = recipe("policy.lora_cfg.enabled=true", "policy.lora_cfg.refit=adapter", "cluster.gpus_per_node=1")
    with pytest.raises(ConfigError, match=r"policy.lora_cfg.refit=adapter is not possible here: vLLM's class for Mamba2"):
        refit_mode(adapter, "vllm", mamba)


def test_the_vllm_facts_the_backend_choice_keeps_are_the_installed_vllms() -> None:
    """VLLM_CPU_HEAD_SIZES and VLLM_ADAPTERLESS_ARCHITECTURES against the installed vLLM's sources (read, not imported:
    the driver never imports vLLM): a vLLM upgrade that changes either fails here."""
    import importlib.util
    import re
    from pathlib import Path

    from nemo_like.plan.backend import VLLM_ADAPTERLESS_ARCHITECTURES, VLLM_CPU_HEAD_SIZES

    if not vllm_available():
        pytest.skip("vllm is not installed")
    root = Path(importlib.util.find_spec("vllm").origin).parent
    cpu_attention = (root / "v1" / "attention" / "backends" / "cpu_attn.py").read_text()
    sizes = re.search(r"def get_supported_head_sizes\(cls\) -> list\[int\]:\s+return \[([\d, ]+)\]", cpu_attention)
    assert sizes and tuple(int(n) for n in sizes.group(1).split(",")) == VLLM_CPU_HEAD_SIZES
    registry = (root / "model_executor" / "models" / "registry.py").read_text()
    for architecture in VLLM_ADAPTERLESS_ARCHITECTURES:
        module, cls = re.search(rf'"{architecture}": \("(\w+)", "(\w+)"\)', registry).groups()
        source = (root / "model_executor" / "models" / f"{module}.py").read_text()
        header = re.search(rf"^class {cls}\((.*?)\):", source, re.S | re.M).group(1)
        assert "SupportsLoRA" not in header and "supports_lora" not in source.split(f"class {cls}(")[1].split("\nclass ")[0], architecture
