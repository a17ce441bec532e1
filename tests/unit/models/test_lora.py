"""LoRA on the shipped tiny model (no Ray): adapter-only trainables, the merged stream equals PEFT's merge and
the adapted model, the adapter export is exactly the adapters, checkpoints load with PeftModel.from_pretrained,
config mistakes name the key."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch

from nemo_like.config import ConfigError, load_config
from nemo_like.config.schema import EMBEDDED_MODEL, LoraConfig, MasterConfig
from nemo_like.models import lora
from nemo_like.models.loading import load_causal_lm, resolve_model_path
from nemo_like.plan import refit as plan_refit

_BASE = []


def base_model() -> torch.nn.Module:
    """A fresh copy of the shipped tiny model (loaded once per module)."""
    if not _BASE:
        _BASE.append(load_causal_lm(EMBEDDED_MODEL).eval())
    return copy.deepcopy(_BASE[0])


def adapted(cfg: LoraConfig, seed: int = 0) -> torch.nn.Module:
    """The tiny model with adapters whose B factors are random (fresh adapters are a no-op: B = 0)."""
    torch.manual_seed(seed)
    model = lora.apply_lora(base_model(), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    return model.eval()


def token_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float().log_softmax(-1)


IDS = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(1))


def test_only_adapters_train_and_the_counts_match_the_hand_count():
    cfg = LoraConfig(enabled=True, dim=4, alpha=8)
    torch.manual_seed(0)
    model = lora.apply_lora(base_model(), cfg)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(lora.is_adapter(n) for n in trainable)
    # Per layer (hidden 128, kv dim 64, mlp 512): r * (in + out) for q, k, v, o, gate, up, down.
    per_layer = 4 * ((128 + 128) + (128 + 64) * 2 + (128 + 128) + (128 + 512) * 3)
    counts = lora.parameter_counts(model)
    assert counts["trainable"] == 4 * per_layer
    assert counts["total"] == sum(p.numel() for p in base_model().parameters()) + counts["trainable"]
    # A fresh adapter (B = 0) leaves the model unchanged.
    torch.testing.assert_close(token_logprobs(model, IDS), token_logprobs(base_model(), IDS), atol=0, rtol=0)


def test_merged_stream_equals_peft_merge_and_the_adapted_logprobs():
    cfg = LoraConfig(
        enabled=True, dim=8, alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], exclude_modules=["model.layers.0.mlp.down_proj"]
    )
    model = adapted(cfg)
    merged = dict(lora.merged_tensors(model.state_dict().items(), lora.scaling(cfg)))
    plain = base_model()
    assert set(merged) == set(plain.state_dict())
    # By hand for one layer: W + alpha / r * B @ A.
    name = "model.layers.1.self_attn.q_proj"
    sd = model.state_dict()
    a, b = sd[f"base_model.model.{name}.lora_A.default.weight"], sd[f"base_model.model.{name}.lora_B.default.weight"]
    torch.testing.assert_close(merged[f"{name}.weight"], plain.state_dict()[f"{name}.weight"] + 2.0 * b @ a)
    assert torch.equal(merged["model.layers.0.mlp.down_proj.weight"], plain.state_dict()["model.layers.0.mlp.down_proj.weight"])
    plain.load_state_dict(merged)
    expected = token_logprobs(model, IDS)
    torch.testing.assert_close(token_logprobs(plain, IDS), expected, atol=1e-5, rtol=1e-6)  # float32 rounding of W + BA
    assert (expected - token_logprobs(base_model(), IDS)).abs().max() > 1e-2  # the adapters matter
    # PEFT's own merge gives the same weights.
    peft_merged = adapted(cfg).merge_and_unload().state_dict()
    for key, value in merged.items():
        torch.testing.assert_close(value, peft_merged[key], atol=1e-6, rtol=0)
    # The adapters disabled: the base model exactly (the reference policy of a LoRA run).
    with model.disable_adapter():
        torch.testing.assert_close(token_logprobs(model, IDS), token_logprobs(base_model(), IDS), atol=0, rtol=0)


def test_adapter_directory_loads_with_peft_and_merges_to_the_adapted_model(tmp_path, capsys):
    from peft import PeftModel

    cfg = LoraConfig(enabled=True, dim=4, alpha=8)
    model = adapted(cfg)
    tensors = {lora.saved_name(k): v for k, v in model.state_dict().items() if lora.is_adapter(k)}
    assert sorted(tensors) == lora.expected_adapter_names(resolve_model_path(EMBEDDED_MODEL), cfg)
    adapter_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert adapter_bytes == lora.parameter_counts(model)["trainable"] * 4
    lora.write_adapter(tmp_path / "policy", tensors, lora.adapter_config_dict(model))
    loaded = PeftModel.from_pretrained(base_model(), str(tmp_path / "policy")).eval()
    expected = token_logprobs(model, IDS)
    torch.testing.assert_close(token_logprobs(loaded, IDS), expected, atol=0, rtol=0)
    from peft import AutoPeftModelForCausalLM  # "Cannot infer the auto class from the config" (task_type was null)

    auto = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "policy")).eval()
    torch.testing.assert_close(token_logprobs(auto, IDS), expected, atol=1e-6, rtol=1e-6)
    out = lora.merge_checkpoint(tmp_path / "policy", tmp_path / "merged")
    torch.testing.assert_close(token_logprobs(load_causal_lm(str(out)), IDS), expected, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(token_logprobs(load_causal_lm(str(tmp_path / "policy")), IDS), expected, atol=1e-5, rtol=1e-6)
    assert (out / "tokenizer.json").is_file()
    # `nemo-like merge --out` on the base model replaced it (exit 0): every later merge applied the adapters twice.
    import shutil

    from nemo_like.cli import main

    base = tmp_path / "base"
    shutil.copytree(resolve_model_path(EMBEDDED_MODEL), base)
    before = {f.name: f.read_bytes() for f in base.iterdir() if f.is_file()}
    for out_dir, extra, message in [
        (base, ["--base-model", str(base)], "--out: writing .* would overwrite the base model the adapters apply to"),
        (tmp_path / "policy", [], "--out: writing .* would overwrite the checkpoint it merges"),
        (tmp_path / "merged", [], r"--out .*merged is not empty"),
    ]:
        assert main(["merge", str(tmp_path / "policy"), "--out", str(out_dir), *extra]) == 2
        assert re.search(message, capsys.readouterr().err), message
    assert {f.name: f.read_bytes() for f in base.iterdir() if f.is_file()} == before


def test_unknown_modules_are_errors_naming_the_key_and_the_model_modules():
    model = base_model()
    with pytest.raises(ConfigError, match=r"policy.lora_cfg.target_modules: 'qkv' .*'q_proj'"):
        lora.resolve_target_modules(model, LoraConfig(enabled=True, target_modules=["qkv"]))
    with pytest.raises(ConfigError, match=r"policy.lora_cfg.exclude_modules: 'lm_head'"):
        lora.resolve_target_modules(model, LoraConfig(enabled=True, exclude_modules=["lm_head"]))
    with pytest.raises(ConfigError, match="no adapter is left"):
        lora.resolve_target_modules(model, LoraConfig(enabled=True, target_modules=["q_proj"], exclude_modules=["q_proj"]))
    assert lora.resolve_target_modules(model, LoraConfig(enabled=True, target_modules=["o_proj"])) == [
        f"model.layers.{i}.self_attn.o_proj" for i in range(4)
    ]
    # An empty target list was blamed on exclude_modules ("removes every module"); it is the target list's own error.
    with pytest.raises(ConfigError, match=r"policy.lora_cfg.target_modules: .*at least 1 item"):
        load_config(None, ["policy.lora_cfg.enabled=true", "policy.lora_cfg.target_modules=[]"], warn=False)
    # An exclusion of a module the targets do not include has no effect: a warning (ablations flip target_modules).
    cfg = LoraConfig(enabled=True, target_modules=["q_proj"], exclude_modules=["v_proj", "model.layers.0.self_attn.q_proj"])
    with pytest.warns(RuntimeWarning, match=r"exclude_modules: 'v_proj' has no effect") as caught:
        chosen = lora.check_lora_targets(resolve_model_path(EMBEDDED_MODEL), cfg)
    assert len(caught) == 1 and chosen == [f"model.layers.{i}.self_attn.q_proj" for i in range(1, 4)]


def test_config_keys_warnings_and_refit_choice():
    cfg = MasterConfig.model_validate({"policy": {"lora_cfg": {"dim": 16, "alpha": 8}}})
    assert cfg.policy.lora_cfg.dim == 16
    # A 'rank' alias passed model_validate but never a recipe (the defaults' 'dim' won, 'rank' was an unknown key): gone
    with pytest.raises(ConfigError, match=r"rank"):
        load_config(None, ["++policy.lora_cfg.rank=16"], warn=False)
    assert cfg.no_effect_warnings() == [
        "policy.lora_cfg.alpha has no effect with policy.lora_cfg.enabled=false",
        "policy.lora_cfg.dim has no effect with policy.lora_cfg.enabled=false",
    ]
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        MasterConfig.model_validate({"policy": {"lora_cfg": {"enabled": True}, "dtensor_cfg": {"tensor_parallel_size": 2}}})
    hf = {"policy": {"lora_cfg": {"enabled": True}, "generation": {"backend": "hf"}}}
    assert plan_refit.refit_mode(MasterConfig.model_validate(hf), "hf")[0] == "merged"
    hf["policy"]["lora_cfg"]["refit"] = "adapter"
    with pytest.raises(ConfigError, match="policy.lora_cfg.refit=adapter is not possible here: the HF generation backend"):
        plan_refit.refit_mode(MasterConfig.model_validate(hf), "hf")
    assert plan_refit.refit_mode(MasterConfig(), None)[0] == "full"
    assert [plan_refit.vllm_max_lora_rank(r) for r in (1, 4, 8, 9, 512, 513)] == [1, 8, 8, 16, 512, None]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert MasterConfig.model_validate({"policy": {"lora_cfg": {"enabled": True, "dim": 4}}}).no_effect_warnings() == []


def test_lora_reference_runs_on_the_policy_so_no_reference_role_is_planned():
    from nemo_like.algorithms.roles import required_resources, role_requests
    from nemo_like.plan.run_plan import decide_run_plan

    kl = {"loss_fn": {"reference_policy_kl_penalty": 0.01}}
    hf = {"backend": "hf"}  # the same engine in both runs (without LoRA, auto would sample inline and reserve none)
    with_lora = MasterConfig.model_validate({**kl, "policy": {"lora_cfg": {"enabled": True}, "generation": hf}})
    full = MasterConfig.model_validate({**kl, "policy": {"generation": hf}})
    plan, full_plan = decide_run_plan(with_lora, (), 2), decide_run_plan(full, (), 2)
    assert plan.logprobs.compute_reference and plan.logprobs.reference_from_policy and not plan.logprobs.load_reference_model
    assert any("adapters disabled" in r for r in plan.logprobs.reasons)
    assert [r.role for r in role_requests(full, full_plan)].count("reference") == 1
    assert "reference" not in [r.role for r in role_requests(with_lora, plan)]
    # The capacity check agrees: the LoRA run asks for one policy group's CPUs less.
    saved = full.policy.dp_size * full.policy.num_cpus_per_worker
    assert required_resources(full, full_plan)["CPU"] - required_resources(with_lora, plan)["CPU"] == pytest.approx(saved)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_the_refit_size_the_run_prints_is_what_a_refit_sends(precision: str) -> None:
    """Adapters travel in fp32 and a merged model in the engine's dtype: under bf16 the printed sizes were half and
    double what the export streams (the adapters counted at 2 bytes, the merged model at its fp32 masters'); and the
    base loaded as the policy worker loads it (a LoRA policy's frozen base in the compute dtype) was counted at half."""
    from nemo_like.models.policy import sharding
    from nemo_like.models.policy.weight_export import WeightExport, distinct_bytes

    cfg = LoraConfig(enabled=True, dim=4, alpha=8)
    model = lora.apply_lora(load_causal_lm(EMBEDDED_MODEL, precision), cfg)  # as PolicyWorker._load_model does
    export = WeightExport()
    export.model, export.device, export.precision, export.lora_cfg, export.rank, export.weight_version = (
        model, torch.device("cpu"), precision, cfg, 0, 1,
    )  # fmt: skip
    counts = lora.parameter_counts(model)
    printed = lora.refit_bytes(counts["trainable"], counts["full_refit_elements"], precision)
    for mode, key in (("adapter", "adapter"), ("merged", "full")):
        tensors = dict(export._refit_tensors(mode, True))
        sent = distinct_bytes(tensors.values())  # what the buckets pickle: a tied weight once
        assert printed[key] == sent, (mode, printed[key], sent)
        if mode == "merged":  # the tied LM head is the embedding itself after the cast too (bf16 sent it twice)
            assert tensors["lm_head.weight"] is tensors["model.embed_tokens.weight"]
        # In buckets as the object-store refit sends them (each pickled on its own), small enough that the model spans
        # several: the tied embedding and LM head share one (split over two, the tensor was sent and counted twice)
        buckets = list(sharding.bucketize(export._refit_tensors(mode, True), 64 * 1024))
        assert len(buckets) > 2 and sum(distinct_bytes(b.values()) for b in buckets) == printed[key], mode
        assert sorted(n for b in buckets for n in b) == sorted(tensors)


def test_a_relative_base_model_path_is_recorded_absolute_and_a_missing_base_is_one_line(tmp_path, monkeypatch):
    """policy.model_name='models/base' was recorded as given: `nemo-like merge` (or eval, serve) run from another
    directory merged the adapters onto whatever 'models/base' named there, or sent it to the hub as a repo id."""
    import json
    import shutil

    from nemo_like.models.assets import embedded_model_path

    (tmp_path / "run" / "models").mkdir(parents=True)
    (tmp_path / "other" / "models").mkdir(parents=True)
    shutil.copytree(embedded_model_path(EMBEDDED_MODEL), tmp_path / "run" / "models" / "base")
    shutil.copytree(embedded_model_path("embedded:tiny-arith-teacher"), tmp_path / "other" / "models" / "base")  # another model
    monkeypatch.chdir(tmp_path / "run")
    from lora_adapters import random_adapters

    model, tensors = random_adapters("models/base")
    policy = lora.write_adapter(tmp_path / "ckpt" / "policy", tensors, lora.adapter_config_dict(model))
    recorded = json.loads((policy / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == str(tmp_path / "run" / "models" / "base")
    monkeypatch.chdir(tmp_path / "other")
    out = lora.merge_checkpoint(policy, tmp_path / "merged")
    torch.testing.assert_close(token_logprobs(load_causal_lm(str(out)), IDS), token_logprobs(model, IDS), atol=1e-5, rtol=1e-6)
    # The checkpoint's own tokenizer (the run's, saved beside the adapters: here one with another chat template) is the
    # one the merged model ships; the base model's was shipped whatever the run trained with.
    from nemo_like.models.loading import load_tokenizer

    run_tokenizer = load_tokenizer(EMBEDDED_MODEL)
    run_tokenizer.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    run_tokenizer.save_pretrained(policy)
    assert load_tokenizer(str(lora.merge_checkpoint(policy, tmp_path / "merged_own"))).chat_template == run_tokenizer.chat_template
    # A folder without tokenizer files is an error, not an empty tokenizer that encodes every text as no tokens.
    with pytest.raises(ConfigError, match=r"holds no tokenizer .*policy.tokenizer_name"):
        load_tokenizer(str(tmp_path / "ckpt"))
    # A base that is not on this machine (a checkpoint moved elsewhere): one line naming the key and the way out.
    (policy / "adapter_config.json").write_text(
        json.dumps({**json.loads((policy / "adapter_config.json").read_text()), "base_model_name_or_path": "gone/base/model"})
    )
    with pytest.raises(
        ConfigError, match=r"adapter_config.json base_model_name_or_path \(override it with --base-model\)='gone/base/model'"
    ):
        lora.merge_checkpoint(policy, tmp_path / "merged2")


def test_a_mixture_of_experts_says_its_fused_experts_get_no_adapters(tmp_path):
    from transformers import MixtralConfig

    MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  vocab_size=359, num_local_experts=4, num_experts_per_tok=2).save_pretrained(tmp_path)  # fmt: skip
    with pytest.warns(RuntimeWarning, match=r"4 routed experts per layer \(24,576 parameters in all\) get no adapters"):
        chosen = lora.check_lora_targets(str(tmp_path), LoraConfig(enabled=True))
    assert chosen and not any(".experts" in name for name in chosen)


def test_layers_peft_would_move_onto_the_experts_get_no_adapters_or_are_refused(tmp_path):
    """On transformers 5, PEFT maps a target named like an expert projection (a shared expert's gate_proj, a dense
    layer's) onto a mixture of experts' fused experts: the announced layers got no adapter, the routed experts did, and
    the first merged refit failed ("incomplete LoRA layers in the weight stream"). By default they are left out (a
    warning lists them); named, they are refused; what PEFT adapts is exactly what was resolved."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    # layer 0 dense (mlp.gate_proj, up_proj, down_proj: linear layers), layer 1 a mixture of experts
    config = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=16, vocab_size=359, num_experts=4, num_experts_per_tok=2,
                            mlp_only_layers=[0])  # fmt: skip
    config.save_pretrained(tmp_path)
    with pytest.warns(RuntimeWarning, match=r"3 linear layers of .* get no adapters \(mlp.down_proj, mlp.gate_proj, mlp.up_proj\)"):
        chosen = lora.check_lora_targets(str(tmp_path), LoraConfig(enabled=True))
    assert "model.layers.0.self_attn.q_proj" in chosen and not any(".mlp." in name for name in chosen)
    model = lora.apply_lora(AutoModelForCausalLM.from_config(config), LoraConfig(enabled=True))
    assert not model.peft_config["default"].target_parameters  # the routed experts got none
    excluded = LoraConfig(enabled=True, exclude_modules=["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"])
    with pytest.warns(RuntimeWarning) as caught:  # the routed experts' warning; none for the layers the user excluded
        assert lora.check_lora_targets(str(tmp_path), excluded) == chosen
    assert not any("linear layers of" in str(w.message) for w in caught), [str(w.message) for w in caught]
    named = LoraConfig(enabled=True, target_modules=["q_proj", "gate_proj", "up_proj"])
    with pytest.raises(ConfigError, match=r"target_modules: 2 of the named layers cannot take adapters as named .*fused experts"):
        lora.check_lora_targets(str(tmp_path), named)


def test_a_model_without_linear_decoder_layers_is_refused_naming_the_key():
    """GPT-2 (Conv1D projections under transformer.h): an IndexError, or an error blaming the unset exclude_modules."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=2))
    for targets in (None, ["c_attn"]):
        with pytest.raises(ConfigError, match=r"lora_cfg.enabled=true: GPT2LMHeadModel has no torch.nn.Linear layer in decoder blocks"):
            lora.resolve_target_modules(gpt2, LoraConfig(enabled=True, target_modules=targets))


def test_a_mamba_blocks_out_proj_is_left_out_by_default_and_refused_when_named(tmp_path):
    """PEFT refuses adapters on a Mamba block's out_proj (and conv1d): the default targets took every decoder linear
    layer, and the policy actor died with PEFT's message naming its own target_modules, after Ray had started."""
    from transformers import AutoModelForCausalLM, Mamba2Config

    config = Mamba2Config(vocab_size=359, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=8, n_groups=1)
    config.save_pretrained(tmp_path)
    with pytest.warns(RuntimeWarning, match=r"2 linear layers of .* get no adapters \(mixer.out_proj\): PEFT refuses adapters"):
        chosen = lora.check_lora_targets(str(tmp_path), LoraConfig(enabled=True))
    assert chosen == ["backbone.layers.0.mixer.in_proj", "backbone.layers.1.mixer.in_proj"]
    lora.apply_lora(AutoModelForCausalLM.from_config(config), LoraConfig(enabled=True))  # PEFT accepts what is left
    with pytest.raises(ConfigError, match=r"target_modules: 2 of the named layers cannot take adapters as named .*out_proj"):
        lora.check_lora_targets(str(tmp_path), LoraConfig(enabled=True, target_modules=["out_proj"]))


def test_a_quantised_projection_with_a_forward_of_its_own_takes_adapters_and_a_router_does_not() -> None:
    """A Linear subclass with a forward of its own that returns x W^T + b (BitNet's online-quantised AutoBitLinear is
    one) takes adapters: a rule by class had left every BitNet projection out and refused the run; Llama 4's router,
    whose forward returns scores and logits, is left out (PEFT's wrapper failed on it in the first forward)."""
    from transformers import AutoModelForCausalLM

    from nemo_like.models.lora import NOT_A_PROJECTION, _resolved_targets, not_a_projection

    class RoundedLinear(torch.nn.Linear):  # as a quantised projection: its own forward, a projection's output
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(x, self.weight.round(), self.bias)

    assert not not_a_projection(RoundedLinear(8, 4)) and not not_a_projection(torch.nn.Linear(8, 4))
    from unit.models.test_text_path import config_of

    llama4 = AutoModelForCausalLM.from_config(config_of("llama4"))
    targets, left_out = _resolved_targets(llama4, LoraConfig(enabled=True))
    assert set(left_out.values()) == {NOT_A_PROJECTION} and all(name.endswith("feed_forward.router") for name in left_out)
    assert len(left_out) == 2 and not any(name.endswith("router") for name in targets)
    # DeepSeek-V4's grouped o_a_proj reshapes its input into groups: the probe's row raised on the driver (a traceback)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    v4 = CONFIG_MAPPING["deepseek_v4"](vocab_size=100, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       head_dim=32, q_lora_rank=32, n_routed_experts=4, num_experts_per_tok=2, o_groups=2, o_lora_rank=16,
                                       index_n_heads=2, index_head_dim=16, index_topk=4, num_nextn_predict_layers=0)  # fmt: skip
    with torch.device("meta"):
        grouped = AutoModelForCausalLM.from_config(v4)
    targets, left_out = _resolved_targets(grouped, LoraConfig(enabled=True))
    assert sorted(left_out) == [f"model.layers.{i}.self_attn.o_a_proj" for i in range(2)] and targets

    # a forward that fails for another reason (an FP8 layer whose kernel is not installed) says so: it was "no projection"
    class WithoutItsKernel(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ImportError("finegrained-fp8 kernel unavailable")

    with pytest.raises(ImportError, match="kernel unavailable"):
        not_a_projection(WithoutItsKernel(4, 4))
