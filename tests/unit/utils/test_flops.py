"""MFU and per-worker token rates: hand-counted parameters and hand-computed FLOPs (pure functions)."""

import json
from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, DeepseekV3Config, GptOssConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig

from nemo_like.config import load_config
from nemo_like.models.loading import resolve_model_path
from nemo_like.plan.run_plan import decide_run_plan
from nemo_like.utils.experts import experts_of
from nemo_like.utils.flops import (
    FlopsSpec,
    cpu_key,
    cpu_peak_flops,
    flops_metrics,
    flops_spec,
    gpu_peak_flops,
    matmul_params,
    step_flops,
)


def qwen2(tied: bool) -> Qwen2Config:
    return Qwen2Config(
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
        tie_word_embeddings=tied,
    )


def test_matmul_params_by_hand():
    # One layer, h=8, kv dim 4, mlp 16: q 8*8+8, k 8*4+4, v 8*4+4, o 8*8, mlp 3*8*16, 2 norms of 8 = 608;
    # final norm 8; output projection 32*8 = 256 (the tied embedding, or lm_head with the embedding left out).
    assert matmul_params(qwen2(tied=True)) == 608 + 8 + 256
    assert matmul_params(qwen2(tied=False)) == 608 + 8 + 256


MOE_LAYERS = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}
MOE_CONFIGS = {  # top-k of E routed experts, shared experts, dense first layers, fused expert biases
    "mixtral": MixtralConfig(**MOE_LAYERS, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": Qwen2MoeConfig(**MOE_LAYERS, num_key_value_heads=2, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48),
    "deepseek_v3": DeepseekV3Config(**MOE_LAYERS, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                    v_head_dim=8, n_group=1, topk_group=1),
    "gpt_oss": GptOssConfig(**MOE_LAYERS, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=4),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_a_mixture_of_experts_counts_the_experts_a_token_runs_through(name):
    # Against the matmul FLOPs torch counts in a real forward (the experts' eager loop runs each token through its
    # top-k experts): 2N per token, but for the norms' and biases' few parameters (within 2%). Counting every expert
    # was 1.7x to 6x over (MFU and the planner's step time).
    config, tokens = MOE_CONFIGS[name], 16
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager").eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(2, 100, (1, tokens)))
    counted = sum(v for op, v in counter.get_flop_counts()["Global"].items() if str(op) in ("aten.mm", "aten.addmm"))
    n = matmul_params(config)
    assert counted == pytest.approx(2 * n * tokens, rel=0.02)
    routed, experts = experts_of(model)
    assert experts == 8 and n < sum(p.numel() for p in model.parameters()) - routed * 0.5


def test_experts_held_one_module_each_are_routed_experts_too():
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = torch.nn.Linear(4, 3, bias=False)  # the router: every token
            self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 5, bias=False) for _ in range(3))
            self.shared_experts = torch.nn.Linear(4, 5, bias=False)  # every token

    assert experts_of(torch.nn.Sequential(Block(), Block())) == (2 * 3 * 20, 3)
    assert experts_of(torch.nn.Linear(4, 4)) == (0, 0)

    class Stacked(torch.nn.Module):  # DBRX's experts: [experts x width, hidden] matrices, no experts' dimension to read
        def __init__(self) -> None:
            super().__init__()
            self.experts = torch.nn.Module()
            self.experts.w1, self.experts.w2 = (torch.nn.Parameter(torch.zeros(3 * 5, 4)) for _ in range(2))

    assert experts_of(Stacked()) == (0, 0)


def test_top_k_is_read_under_each_models_name_for_it():
    from transformers import DbrxConfig, Gemma4TextConfig, HunYuanMoEV1Config, LlamaConfig

    from nemo_like.utils.experts import expert_block_values_per_token, top_k

    assert top_k(MOE_CONFIGS["mixtral"]) == 2 and top_k(Gemma4TextConfig(top_k_experts=3, enable_moe_block=True)) == 3
    assert top_k(DbrxConfig(ffn_config={"moe_top_k": 4})) == 4 and top_k(HunYuanMoEV1Config(moe_topk=[2, 5])) == 5
    assert top_k(LlamaConfig()) is None
    # not known: the experts count in full for N (an upper bound), and the planner keeps a dense MLP's activations
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(MOE_CONFIGS["mixtral"])
    assert expert_block_values_per_token(model, 64, None) == 0 < expert_block_values_per_token(model, 64, 2)
    # Gemma 4: the experts sit in the decoder layer beside its dense MLP, which every token runs through (the layer's
    # attention is no shared expert): 2 experts of width 32 and the MLP of width 128 a token
    gemma4 = Gemma4TextConfig(**MOE_LAYERS, num_key_value_heads=2, head_dim=16, global_head_dim=16, enable_moe_block=True,
                              num_experts=16, top_k_experts=2, moe_intermediate_size=32, hidden_size_per_layer_input=0,
                              layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(gemma4)
    assert expert_block_values_per_token(model, 64, top_k(gemma4)) == 2 * (4 * 32 + 3 * 64) + 16 + 4 * 128


def step(**extra: float) -> dict[str, float]:
    return {
        "performance/num_batch_tokens": 100.0,
        "performance/num_generated_tokens": 40.0,
        "performance/forward_passes/prev_logprobs": 0.0,
        "performance/forward_passes/reference_logprobs": 2.0,
        "timing/train/total_step_time": 4.0,
        "timing/train/policy_training": 1.0,
        "timing/train/generation": 2.0,
        **extra,
    }


def test_step_flops_count_training_logprob_passes_and_decoded_tokens():
    assert step_flops(step(), n=1000) == {"training": 6e5, "logprobs": 2e5, "generation": 8e4}
    both = step_flops(step(**{"performance/forward_passes/prev_logprobs": 3.0}), n=1000)
    assert both["logprobs"] == 4e5  # two passes, each 2 N per trained token
    # Async: the collector's reference passes since the last step scored other batches than this step's (two, or none)
    ahead = {"performance/num_reference_tokens": 250.0}
    assert step_flops(step(**ahead), n=1000)["logprobs"] == 2e3 * 250
    idle = {"performance/num_reference_tokens": 0.0, "performance/forward_passes/reference_logprobs": 0.0}
    assert step_flops(step(**idle), n=1000)["logprobs"] == 0.0
    # An optimizer step the driver's masks left with no token ran nothing: training counts the steps that ran (it had
    # charged the whole batch: an MFU up to 33 when every step was empty), the logprob passes still every row
    half = step(**{"performance/num_trained_tokens": 50.0})
    assert step_flops(half, n=1000) == {"training": 3e5, "logprobs": 2e5, "generation": 8e4}
    assert step_flops(step(**{"performance/num_trained_tokens": 0.0}), n=1000)["training"] == 0.0


def test_teacher_passes_count_each_teachers_scored_tokens_at_its_own_parameters():
    teachers = step(**{"performance/num_teacher_tokens/0": 100.0, "performance/num_teacher_tokens/1": 30.0})
    flops = step_flops(teachers, n=1000, teachers=(3000, 5000))
    assert flops["logprobs"] == 2e5 + 2 * 3000 * 100 + 2 * 5000 * 30 and flops["training"] == 6e5
    assert step_flops(step(), n=1000, kl_teacher=3000)["training"] == (6000 + 2 * 3000) * 100  # the KL term's teacher forward


def test_lora_training_charges_no_weight_gradients_for_the_frozen_base():
    # forward and input gradients 2 (N + N_lora) each, weight gradients 2 N_lora: 4 N + 6 N_lora per trained token
    assert step_flops(step(), n=1000, lora_params=10)["training"] == (4000 + 60) * 100
    spec = FlopsSpec(1000, 1e3, 1, 1, 1, 1, 1, lora_params=10)
    assert flops_metrics(step(), spec)["performance/training_mfu"] == pytest.approx((4000 + 60) * 100 / 1e3)


def gpu_spec(*overrides: str, backend: str = "hf") -> FlopsSpec:
    cfg = load_config(
        None, ["cluster.gpus_per_node=8", "cluster.peak_flops_per_device=1e15", "policy.dtensor_cfg.enabled=true", *overrides]
    )
    plan = decide_run_plan(cfg, (), 2)
    plan = replace(plan, backend=replace(plan.backend, value=backend))  # whether or not vllm is installed here
    teachers = [resolve_model_path(m) for m in cfg.teacher.models()]
    return flops_spec(cfg, resolve_model_path(cfg.policy.model_name), plan, teachers)


def test_gpu_devices_are_every_role_that_holds_one():
    # grpo_math_1B's layout: 4 policy ranks, 4 reference ranks, vLLM colocated on policy rank 0's GPU
    assert gpu_spec("policy.dp_size=4", backend="vllm").devices == 8
    assert gpu_spec("policy.dp_size=4", "policy.generation.colocated.enabled=false", backend="vllm").devices == 9
    assert gpu_spec("policy.dp_size=4").devices == 9  # an HF engine is never colocated: a GPU of its own
    assert gpu_spec("policy.dp_size=4", "loss_fn.reference_policy_kl_penalty=0", backend="vllm").devices == 4
    assert gpu_spec("policy.dp_size=2", "policy.lora_cfg.enabled=true", backend="vllm").devices == 2  # LoRA: no reference actors
    # two teacher models, each on its own 2 ranks: 2 policy + 2 reference + 2 x 2 teacher + 1 engine
    two = gpu_spec(
        "policy.dp_size=2",
        "teacher.model_name=embedded:tiny-arith-teacher",
        "+teacher.by_task.math=embedded:tiny-arith-qwen2",
        "+env.math.num_workers=1",
    )
    assert two.devices == 9 and two.teacher_matmul_params == (two.matmul_params, two.matmul_params) and two.training_devices == 2
    kl = gpu_spec("teacher.model_name=embedded:tiny-arith-teacher", "distillation.advantage_weight=0", "distillation.kl_weight=1")
    assert (kl.devices, kl.teacher_matmul_params, kl.kl_teacher_matmul_params) == (3, (), kl.matmul_params)
    # Inline sampling runs in the one policy worker, on its GPU: no engine device (it was counted, halving the MFU).
    assert gpu_spec("loss_fn.reference_policy_kl_penalty=0", backend="inline").devices == 1


def test_mfu_and_per_worker_rates():
    spec = FlopsSpec(
        1000, peak_flops_per_device=1e5, devices=3, training_devices=2, generation_devices=1, training_workers=2, generation_workers=1
    )
    out = flops_metrics(step(), spec)
    assert out == pytest.approx(
        {
            "performance/training_tokens_per_sec_per_worker": 100 / 1.0 / 2,
            "performance/generation_tokens_per_sec_per_worker": 40 / 2.0 / 1,
            "performance/tokens_per_sec_per_device": 100 / 4.0 / 3,
            "performance/model_flops": 6e5 + 2e5 + 8e4,
            "performance/mfu": (6e5 + 2e5 + 8e4) / (4.0 * 1e5 * 3),
            "performance/training_mfu": 6e5 / (1.0 * 1e5 * 2),
            "performance/generation_mfu": 8e4 / (2.0 * 1e5 * 1),
        }
    )


def test_a_validation_steps_rates_and_mfu_leave_the_validation_pass_out():
    """Validation's generation is in no token or FLOP count, so its seconds were only a drop in the step's MFU."""
    spec = FlopsSpec(1000, 1e5, 3, 2, 1, 2, 1)
    out = flops_metrics(step(**{"timing/train/total_step_time": 10.0, "timing/train/validation": 6.0}), spec)
    assert out == pytest.approx(flops_metrics(step(), spec))  # 10 s - 6 s of validation: the 4 s step's values


def test_async_steps_use_the_collectors_generation_seconds():
    spec = FlopsSpec(1000, 1e5, 1, 1, 1, 1, 1)
    out = flops_metrics(step(**{"timing/train/generation": 0.0, "async/generation_seconds": 0.5}), spec)
    assert out["performance/generation_tokens_per_sec_per_worker"] == pytest.approx(40 / 0.5)
    assert out["performance/generation_mfu"] == pytest.approx(8e4 / (0.5 * 1e5))


def test_unknown_peak_logs_no_mfu_and_zero_time_gives_zero():
    spec = FlopsSpec(1000, None, 1, 1, 1, 1, 1)
    out = flops_metrics(step(**{"timing/train/generation": 0.0}), spec)  # and no async/generation_seconds
    assert "performance/mfu" not in out and out["performance/generation_tokens_per_sec_per_worker"] == 0.0
    out = flops_metrics(step(**{"timing/train/total_step_time": 0.0}), FlopsSpec(1000, 1e5, 1, 1, 1, 1, 1))
    assert out["performance/mfu"] == 0.0


def test_gpu_table_and_configured_peak():
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 9.89e14
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", "float32") == 1.95e13
    assert gpu_peak_flops("Some Unknown GPU", "bfloat16") is None
    # The PCIe and NVL cards are not the SXM part their name also contains.
    assert gpu_peak_flops("NVIDIA H100 PCIe", "bfloat16") == 7.56e14 and gpu_peak_flops("NVIDIA H100 NVL", "float32") == 6.0e13
    assert gpu_peak_flops("NVIDIA H200 NVL", "bfloat16") == 8.35e14 and gpu_peak_flops("NVIDIA H200", "bfloat16") == 9.89e14
    cfg = load_config(None, ["cluster.peak_flops_per_device=2e12", "policy.dp_size=2", "policy.dtensor_cfg.enabled=true"])
    spec = flops_spec(cfg, resolve_model_path(cfg.policy.model_name), decide_run_plan(cfg, (), 2))  # CPU: a device is a node
    assert (spec.peak_flops_per_device, spec.devices, spec.training_devices, spec.training_workers) == (2e12, 1, 1, 2)
    assert spec.matmul_params > 0
    assert (
        spec.describe()
        == f"MFU: N={spec.matmul_params:,} matmul parameters, 1 device(s), peak 2e+12 FLOP/s per device (cluster.peak_flops_per_device)"
    )


def test_cpu_probe_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setattr("os.getloadavg", lambda: (0.0, 0.0, 0.0))  # a quiet machine: the probe is final
    cache = tmp_path / "peak.json"
    cache.write_text(json.dumps({cpu_key("bfloat16"): 123.0}))
    assert cpu_peak_flops("bfloat16", cache) == 123.0  # read back, not measured
    measured = cpu_peak_flops("float32", cache)
    assert measured > 0 and json.loads(cache.read_text()) == {cpu_key("bfloat16"): 123.0, cpu_key("float32"): measured}


def test_runs_probing_at_once_keep_each_others_entries_and_never_read_a_partial_file(tmp_path):
    """Runs of a sweep write the cache together: a plain read-modify-write lost the other run's entry, and a reader that
    caught the file mid-write read it as empty and dropped every entry at its next write."""
    import threading

    from nemo_like.utils.flops import store_cache_entry

    cache = tmp_path / "peak.json"
    torn: list[str] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                json.loads(cache.read_text())
            except FileNotFoundError:
                pass
            except ValueError as exc:
                torn.append(str(exc))

    def write(prefix: str) -> None:
        for i in range(60):
            store_cache_entry(cache, f"{prefix}{i}", float(i) * 1e9 + 0.123456789)  # ~60 bytes an entry: a slow write

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(prefix,)) for prefix in ("a", "b")]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    done.set()
    reader.join()
    assert torn == []
    assert sorted(json.loads(cache.read_text())) == sorted(f"{p}{i}" for p in "ab" for i in range(60))


def test_a_busy_probe_stored_after_a_quiet_one_of_the_same_key_keeps_the_quiet_one(tmp_path, monkeypatch):
    """Runs of a sweep probe the same key: the last writer won, so a busy (provisional, lower) probe stored over a quiet
    final one halved the peak every later run reused (their MFU read twice too high). Without file locks (NFS without
    lockd) the entry is still written, in one rename."""
    import fcntl

    from nemo_like.utils.flops import store_cache_entry

    cache = tmp_path / "peak.json"
    busy = {"flops": 2e11, "load": 2.0, "provisional": "measured at load 2.0"}
    assert store_cache_entry(cache, "k", 4.2e11) == 4.2e11
    assert store_cache_entry(cache, "k", busy) == 4.2e11 and json.loads(cache.read_text()) == {"k": 4.2e11}
    assert store_cache_entry(cache, "k", 3e11) == 4.2e11  # of two final figures, the higher (a probe reads low)
    assert store_cache_entry(cache, "p", busy) == busy
    assert store_cache_entry(cache, "p", {**busy, "flops": 1e11}) == busy  # of two provisional ones, the higher
    assert store_cache_entry(cache, "p", 1e11) == 1e11  # a final figure over a provisional one
    assert json.loads(cache.read_text()) == {"k": 4.2e11, "p": 1e11}

    def no_locks(*args):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert store_cache_entry(tmp_path / "nfs.json", "k", 5e11) == 5e11
    assert json.loads((tmp_path / "nfs.json").read_text()) == {"k": 5e11}


def test_a_probe_on_a_busy_machine_is_provisional_and_the_best_later_probe_replaces_it(tmp_path, monkeypatch):
    from nemo_like.distributed.threads import local_cores

    cache = tmp_path / "peak.json"
    key = cpu_key("float32")
    monkeypatch.setattr("os.getloadavg", lambda: (local_cores() * 4.0, 0.0, 0.0))
    busy = cpu_peak_flops("float32", cache)
    entry = json.loads(cache.read_text())[key]
    assert entry["flops"] == busy and "measured at load" in entry["provisional"]
    cache.write_text(json.dumps({key: {"flops": 1e15, "provisional": "x"}}))  # an earlier, better busy probe is kept
    assert cpu_peak_flops("float32", cache) == 1e15
    cache.write_text(json.dumps({key: {"flops": 1.0, "provisional": "x"}}))
    monkeypatch.setattr("os.getloadavg", lambda: (0.0, 0.0, 0.0))
    quiet = cpu_peak_flops("float32", cache)  # quiet: measured again, and final
    assert quiet > 1.0 and json.loads(cache.read_text())[key] == quiet
    assert cpu_peak_flops("float32", cache) == quiet
    cache.write_text(json.dumps({key: {"flops": "fast"}}))  # a hand-edited entry is measured anew, not a traceback
    assert cpu_peak_flops("float32", cache) > 1.0
    monkeypatch.setattr("os.getloadavg", lambda: (local_cores() * 4.0, 0.0, 0.0))
    cache.write_text(json.dumps({key: {"flops": 5.0, "load": local_cores() * 2.0, "provisional": "x"}}))
    assert cpu_peak_flops("float32", cache) == 5.0  # busier than at that probe: reused, not probed again
