"""A refit into vLLM reverts transformers 5's fused experts to the checkpoint's layout, tensor by tensor: exactly the
names and values ``save_pretrained`` writes (what vLLM loaded at start-up); a model held as saved passes unchanged."""

import glob
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, MixtralConfig, Qwen2Config, Qwen3MoeConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from nemo_like.models.refit.checkpoint_format import checkpoint_tensors, converts, file_tensor_names, held_tensor_batches, skeleton

LAYERS = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 50}
CONFIGS = {
    "qwen2": Qwen2Config(**LAYERS, num_key_value_heads=1),
    "mixtral": MixtralConfig(**LAYERS, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": Qwen3MoeConfig(**LAYERS, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "deepseek_v3": DeepseekV3Config(**LAYERS, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                    first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                    v_head_dim=8, n_group=1, topk_group=1),
    # one file tensor of several held ones (gate_up_proj of gate_proj and up_proj): reverted one at a time, the last won
    "hrm_text": CONFIG_MAPPING["hrm_text"](**LAYERS, head_dim=16),
    # renamings that also match names the model holds (\.norm\. -> .kv_norm.; post_mlp_layernorm -> mlp.post_...)
    "deepseek_v4": CONFIG_MAPPING["deepseek_v4"](**{**LAYERS, "intermediate_size": 16}, head_dim=16, q_lora_rank=16,
                                                 num_experts_per_tok=2, n_routed_experts=4, qk_rope_head_dim=8,
                                                 layer_types=["heavily_compressed_attention"] * 2, mlp_layer_types=["hash_moe"] * 2,
                                                 moe_intermediate_size=16, index_n_heads=2, index_head_dim=16, index_topk=4),
    "axk1": CONFIG_MAPPING["axk1"](**LAYERS, num_key_value_heads=1, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                   kv_lora_rank=8, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                   n_group=1, topk_group=1, head_dim=16),
}  # fmt: skip


def random_model(name: str) -> torch.nn.Module:
    """The ``CONFIGS[name]`` model, every tensor of its own random values (inits of ones and zeros hide a mix-up)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name])
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter))
    return model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_refit_reverts_to_the_files_save_pretrained_writes(name, tmp_path):
    model = random_model(name)
    model.save_pretrained(tmp_path)
    files = {k: v for f in glob.glob(f"{tmp_path}/*.safetensors") for k, v in load_file(f).items()}
    engine_side = skeleton(str(tmp_path))  # the vLLM worker's: built on the meta device from the model's config
    sent = list(model.state_dict().items())  # what the policy sends: the weights as it holds them
    received = dict(checkpoint_tensors(engine_side, iter(sent)))
    assert received.keys() == files.keys() and all(torch.equal(received[k], files[k]) for k in files)
    held_as_saved = name == "qwen2"
    assert converts(engine_side) is not held_as_saved and (dict(sent).keys() == files.keys()) is held_as_saved


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_checkpoint_tensors_convert_back_to_the_held_layout(name):
    """A run's checkpoint is written in the files' layout and converted back on resume: every tensor returns under its
    held name with its values; a checkpoint already in the held layout (written before) loads unchanged."""
    model = random_model(name)
    held = model.state_dict()
    files = dict(checkpoint_tensors(model, iter(held.items())))
    for tensors in (files, held):
        for max_bytes in (1 << 30, 1):  # one batch; a batch a held tensor (each loaded and freed before the next)
            batches = list(held_tensor_batches(model, tensors, max_bytes))
            back = {name: tensor for batch in batches for name, tensor in batch.items()}
            assert back.keys() == held.keys() and all(torch.equal(back[k], held[k]) for k in held)
            assert (len(batches) > 1) is (max_bytes == 1 and converts(model))


@pytest.mark.parametrize("dropped", ["experts.1.gate_proj", "experts.1.down_proj"])
def test_a_checkpoint_missing_one_experts_tensor_is_refused_naming_it(dropped):
    """One expert's projection missing from a checkpoint: stacking the others raised torch's "Sizes of tensors must
    match" (gate_up_proj), or made a (3, ...) tensor for the model's (4, ...) one (down_proj)."""
    model = random_model("qwen3_moe")
    files = dict(checkpoint_tensors(model, iter(model.state_dict().items())))
    del files[f"model.layers.0.mlp.{dropped}.weight"]
    fused = "gate_up_proj" if "gate" in dropped else "down_proj"
    with pytest.raises(ValueError, match=rf"tensor\(s\) for the model's model.layers.0.mlp.experts.{fused} .*A tensor is missing"):
        list(held_tensor_batches(model, files))


def test_a_text_model_in_multimodal_files_is_refitted_under_the_files_names(tmp_path, monkeypatch):
    """Qwen3.5's files hold the text model under ``model.language_model.*`` (a multimodal layout), which transformers
    loads as ``Qwen3_5ForCausalLM`` holding ``model.*``. The engine's skeleton, built from a config, dropped that
    ``PrefixChange``: vLLM refused the first refit ("no module or parameter named 'model'"). It now keeps the
    conversions the files' names use, as ``from_pretrained`` does."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from nemo_like.models.loading import load_causal_lm

    torch.manual_seed(0)
    text = dict(**LAYERS, num_key_value_heads=1, head_dim=16, layer_types=["linear_attention", "full_attention"],
                linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)  # fmt: skip
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
    Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)).save_pretrained(
        tmp_path
    )
    files = load_file(f"{tmp_path}/model.safetensors")
    held = load_causal_lm(str(tmp_path)).state_dict()  # what the policy holds and sends
    assert "model.embed_tokens.weight" in held and "model.language_model.embed_tokens.weight" in files
    sent = dict(checkpoint_tensors(skeleton(str(tmp_path)), iter(held.items())))
    assert set(sent) <= set(files) and all(torch.equal(sent[k], files[k]) for k in sent)
    assert {k for k in files if k not in sent} == {k for k in files if k.startswith("model.visual.")}  # the text model, whole
    # Named by a hub id (as policy.model_name usually is), its files are the snapshot's in the local cache
    snapshot = tmp_path / "hub" / "models--acme--tiny-qwen35" / "snapshots" / "abc"
    shutil.copytree(tmp_path, snapshot, ignore=shutil.ignore_patterns("hub"))
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert sorted(file_tensor_names("acme/tiny-qwen35")) == sorted(files)
