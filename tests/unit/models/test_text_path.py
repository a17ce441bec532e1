"""A multimodal policy trained on text: what a text-only forward never reaches is frozen, and only that."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_like.utils.text_path import freeze_outside_text_path

TEXT = {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1}  # fmt: skip
SIGLIP = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14}


def config_of(family: str):
    import transformers as t

    sliding = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}
    return {
        "gemma3": lambda: t.Gemma3Config(text_config={"model_type": "gemma3_text", **TEXT, **sliding}, vision_config=SIGLIP,
                                         mm_tokens_per_image=4, image_token_index=99, boi_token_index=97, eoi_token_index=98),
        "gemma4": lambda: t.Gemma4Config(text_config={**TEXT, **sliding, "global_head_dim": 8, "hidden_size_per_layer_input": 8,
                                                      "vocab_size_per_layer_input": 100},
                                         vision_config={**SIGLIP, "head_dim": 16}, audio_config=None),
        "llama4": lambda: t.Llama4Config(text_config={**TEXT, "num_local_experts": 2, "num_experts_per_tok": 1, "intermediate_size_mlp": 64,
                                                      "interleave_moe_layer_step": 1},
                                         vision_config={**SIGLIP, "vision_output_dim": 32, "projector_input_dim": 32, "projector_output_dim": 32}),
        "qwen2": lambda: t.Qwen2Config(**TEXT),
    }[family]()  # fmt: skip


@pytest.mark.parametrize("family", ["gemma3", "gemma4", "llama4", "qwen2"])
def test_exactly_the_parameters_a_text_forward_gives_no_gradient_are_frozen(family: str, tmp_path) -> None:
    """Gemma 3's and Gemma 4's vision towers and projectors (their conditional-generation classes, which a causal LM's
    auto class builds) get no gradient from text: frozen, and nothing else; Llama 4's config builds a text-only class
    and Qwen2 is text: nothing frozen. The memory plan's skeleton freezes the same."""
    from transformers import AutoModelForCausalLM

    from nemo_like.models.footprint import model_footprint

    config = config_of(family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model(input_ids=torch.randint(3, 90, (2, 6))).logits.float().sum().backward()
    without_gradient = {name for name, p in model.named_parameters() if p.grad is None}
    values = freeze_outside_text_path(model)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen == without_gradient and bool(frozen) is (family in ("gemma3", "gemma4"))
    assert values == sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert freeze_outside_text_path(model) == 0  # once
    if family == "gemma3":  # MFU's N: the text path (tied embeddings), not the tower that never runs (48% over here)
        from nemo_like.utils.flops import matmul_params

        assert matmul_params(config) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    config.save_pretrained(tmp_path)
    params = model_footprint(str(tmp_path), "float32")[0]
    assert sum(math.prod(p.shape) for p in params if p.trainable) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    # LoRA adapts the decoder's layers alone (the vision tower's blocks are `layers` too: adapters without a gradient)
    from nemo_like.config import load_config
    from nemo_like.models.lora import apply_lora

    lora = load_config("examples/configs/grpo_tiny_cpu.yaml", ["policy.lora_cfg.enabled=true"]).policy.lora_cfg
    torch.manual_seed(0)
    adapted = apply_lora(AutoModelForCausalLM.from_config(config), lora)
    adapted(input_ids=torch.randint(3, 90, (2, 6))).logits.float().sum().backward()
    adapters = [(name, p) for name, p in adapted.named_parameters() if p.requires_grad]
    assert adapters and all(".lora_" in name and p.grad is not None for name, p in adapters), [n for n, p in adapters if p.grad is None][:3]


def test_a_gemma3_policy_worker_trains_the_text_path_and_resumes_an_older_lora_checkpoint(tmp_path, capsys) -> None:
    """The policy worker freezes the tower (its start-up line counted it as trained); a LoRA checkpoint written when
    the tower's blocks got adapters (never trained: lora_B zero) resumes without them, and one whose extra adapters
    are not zero is still another run's."""
    from peft import get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from unit.models.test_sharding import make_worker, step_batch

    from nemo_like.config.schema import LoraConfig
    from nemo_like.models.assets import default_model_path
    from nemo_like.models.loading import load_tokenizer
    from nemo_like.models.lora import ADAPTER_WEIGHTS, peft_config

    config = config_of("gemma3")
    config.text_config.vocab_size = config.vocab_size = 359  # the shipped tokenizer's
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gemma3")
    load_tokenizer(default_model_path()).save_pretrained(tmp_path / "gemma3")
    full = make_worker(model_name=str(tmp_path / "gemma3"))
    tower = [p for name, p in full.model.named_parameters() if "vision_tower" in name or "multi_modal" in name]
    counts = full.parameter_counts()  # the start-up line's "trainable parameters: X of Y"
    assert tower and not any(p.requires_grad for p in tower) and counts["trainable"] == counts["total"] - sum(p.numel() for p in tower)
    del full
    worker = make_worker(model_name=str(tmp_path / "gemma3"), lora_cfg=LoraConfig(enabled=True))
    worker.train([step_batch(0)])
    worker.save_checkpoint(str(tmp_path / "ckpt"))
    weights = tmp_path / "ckpt" / "policy" / ADAPTER_WEIGHTS
    own = load_file(str(weights))
    # the adapters an older run put on the tower: those PEFT gives every linear layer of its blocks
    torch.manual_seed(0)
    older = get_peft_model(AutoModelForCausalLM.from_config(config), peft_config(LoraConfig(enabled=True), ["fc1", "fc2"]))
    tower_adapters = {
        name.replace(".default.", ".").removeprefix("base_model.model."): p.detach().clone()
        for name, p in older.named_parameters()
        if ".lora_" in name
    }
    assert tower_adapters and all("vision_tower" in name for name in tower_adapters)
    save_file({**own, **{f"base_model.model.{k}": v for k, v in tower_adapters.items()}}, str(weights))
    worker.load_checkpoint(str(tmp_path / "ckpt"), None)
    assert f"[checkpoint] {len(tower_adapters)} adapter tensors of modules this run does not adapt" in capsys.readouterr().err
    trained = {k: (v + 1 if ".lora_B." in k else v) for k, v in tower_adapters.items()}
    save_file({**own, **{f"base_model.model.{k}": v for k, v in trained.items()}}, str(weights))
    with pytest.raises(RuntimeError, match=r"does not match the model: missing=\[\] unexpected=\[.*vision_tower"):
        worker.load_checkpoint(str(tmp_path / "ckpt"), None)
