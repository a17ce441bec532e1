"""The in-place vLLM CPU loader's name mapping and its refusals (which send a refit to vLLM's own reload).
That it generates exactly what vLLM's reload does is tested on a real engine in
tests/functional/test_vllm_backend.py."""

import pytest
import torch

from nemo_like.models.refit.cpu_reload import InPlaceReloadUnsupported, check_in_place_architecture, fused_target, plan_in_place_reload

QWEN2_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


@pytest.mark.parametrize(
    "name, target",
    [
        ("model.layers.0.self_attn.q_proj.weight", ("model.layers.0.self_attn.qkv_proj", "weight", 0, 3)),
        ("model.layers.3.self_attn.v_proj.bias", ("model.layers.3.self_attn.qkv_proj", "bias", 2, 3)),
        ("model.layers.1.mlp.up_proj.weight", ("model.layers.1.mlp.gate_up_proj", "weight", 1, 2)),
        ("model.layers.1.mlp.down_proj.weight", ("model.layers.1.mlp.down_proj", "weight", 0, 1)),
        ("model.norm.weight", ("model.norm", "weight", 0, 1)),
        ("lm_head.weight", ("lm_head", "weight", 0, 1)),
    ],
)
def test_checkpoint_names_map_to_the_fused_parameters(name, target):
    assert fused_target(name, QWEN2_PACKED) == target


class TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 3)
        self.b = torch.nn.Linear(3, 2, bias=False)


def test_a_plain_model_is_planned_and_gaps_are_refused_before_anything_changes():
    model = TwoLinears()
    full = {"a.weight": torch.ones(3, 4), "a.bias": torch.ones(3), "b.weight": torch.ones(2, 3)}
    assert len(plan_in_place_reload(model, full.items())) == 3
    before = {n: p.clone() for n, p in model.named_parameters()}
    cases = {
        "does not cover": {k: v for k, v in full.items() if k != "b.weight"},
        "no parameter c.weight": {**full, "c.weight": torch.ones(1)},
        r"got \(2, 2\)": {**full, "b.weight": torch.ones(2, 2)},
        "float64": {**full, "a.bias": torch.ones(3, dtype=torch.float64)},
    }
    for message, weights in cases.items():
        with pytest.raises(InPlaceReloadUnsupported, match=message):
            plan_in_place_reload(model, weights.items())
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_a_packed_module_with_a_missing_part_is_refused():
    class Attn(torch.nn.Module):
        packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

        def __init__(self):
            super().__init__()
            self.qkv_proj = torch.nn.Linear(2, 6, bias=False)

    weights = {"q_proj.weight": torch.ones(2, 2), "k_proj.weight": torch.ones(2, 2)}
    with pytest.raises(InPlaceReloadUnsupported, match="only some of its packed parts"):
        plan_in_place_reload(Attn(), weights.items())
    full = {**weights, "v_proj.weight": torch.ones(2, 2)}
    (update,) = plan_in_place_reload(Attn(), full.items())
    assert update.shape == (6, 2) and len(update.parts) == 3  # q, k, v, in that order
    assert [p.data_ptr() for p in update.parts] == [full[f"{x}_proj.weight"].data_ptr() for x in "qkv"]


def test_only_vllm_classes_whose_loader_the_in_place_reload_follows_take_it():
    """Falcon's vLLM loader reorders its fused query_key_value rows within their shape: copied as sent, every refit
    left the engine with scrambled attention weights (train/gen_kl ~4e-3, no fallback said)."""
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        check_in_place_architecture(type(name, (torch.nn.Module,), {})())
    for name in ("FalconForCausalLM", "GPT2LMHeadModel", "Gemma2ForCausalLM"):
        with pytest.raises(InPlaceReloadUnsupported, match=f"vLLM's {name} may rearrange checkpoint tensors"):
            check_in_place_architecture(type(name, (torch.nn.Module,), {})())
