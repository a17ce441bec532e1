"""LoRA GRPO end to end (real actors, vLLM serving the adapters): adapter-only refit, the reference from the
policy with adapters disabled, generation agreeing with training after every refit, bitwise resume (2 + 2 steps),
a PEFT-loadable checkpoint whose merged model scores like the adapted one, and the merged-weight refit."""

import shutil

import pytest
import torch
from functional.helpers import ckpt_overrides, read_metrics, tiny_config
from safetensors.torch import load_file

from nemo_like.models import lora
from nemo_like.models.loading import load_causal_lm
from nemo_like.train import train

pytestmark = pytest.mark.slow

NO_VALIDATION = ("grpo.val_at_start=false", "grpo.val_at_end=false", "grpo.val_period=0")
LORA = ("policy.lora_cfg.enabled=true", "policy.lora_cfg.dim=4", "policy.lora_cfg.alpha=32", "policy.optimizer.lr=1e-3")
GEN_KL_BOUND = 0.002


def test_lora_adapter_refit_resumes_bitwise_and_the_checkpoint_merges(ray_cluster, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(tiny_config(straight, "grpo.max_num_steps=4", *LORA, *NO_VALIDATION, *ckpt_overrides(straight / "ckpt", 2)))
    # 2 + 2: the 4-step run's step-2 checkpoint (what a 2-step run writes) resumed for steps 3 and 4 elsewhere.
    shutil.copytree(straight / "ckpt" / "step_2", split / "ckpt" / "step_2")
    resumed = train(tiny_config(split, "grpo.max_num_steps=4", *LORA, *NO_VALIDATION, *ckpt_overrides(split / "ckpt", 2)))
    assert [h["step"] for h in resumed] == [3, 4]
    records = read_metrics(straight / "logs")
    for ra, rb in zip(records[2:], read_metrics(split / "logs")):
        for key in ("train/reward", "train/loss", "train/gen_kl", "train/grad_norm", "train/kl_penalty"):
            assert ra[key] == rb[key], (ra["step"], key)  # bitwise
    final_a = load_file(str(straight / "ckpt" / "step_4" / "policy" / lora.ADAPTER_WEIGHTS))
    final_b = load_file(str(split / "ckpt" / "step_4" / "policy" / lora.ADAPTER_WEIGHTS))
    assert final_a.keys() == final_b.keys() and all(torch.equal(final_a[k], final_b[k]) for k in final_a)

    # Only the adapters travel: a refit before every step after the first, of exactly the adapters' bytes.
    trainable = records[0]["train/trainable_params"]
    assert all(lora.is_adapter(k) for k in final_a) and sum(t.numel() for t in final_a.values()) == trainable
    assert [r["performance/refit_bytes"] for r in records] == [0.0] + [4.0 * trainable] * 3
    # vLLM serving the adapters samples like the trainer scores (processed logprobs) after every refit.
    assert all(r["train/gen_kl"] < GEN_KL_BOUND for r in records), [r["train/gen_kl"] for r in records]
    # The reference is the policy with its adapters disabled: reference passes ran, and the KL to it grows.
    assert all(r["performance/forward_passes/reference_logprobs"] > 0 for r in records)
    assert records[0]["train/kl_penalty"] < 1e-9 < records[-1]["train/kl_penalty"]
    optimizer = torch.load(straight / "ckpt" / "step_4" / "optimizer.pt", weights_only=False)["optimizer"]
    assert optimizer["state"] and all(lora.is_adapter(k) for k in optimizer["state"])

    # The checkpoint is a PEFT adapter; merged into a plain HF model it scores like the adapted model.
    from peft import PeftModel

    adapter_dir = straight / "ckpt" / "step_4" / "policy"
    adapted = PeftModel.from_pretrained(load_causal_lm("embedded:tiny-arith-qwen2"), str(adapter_dir)).eval()
    merged = load_causal_lm(str(lora.merge_checkpoint(adapter_dir, tmp_path / "merged")))
    ids = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, m = (model(input_ids=ids).logits.log_softmax(-1) for model in (adapted, merged))
    torch.testing.assert_close(m, a, atol=1e-5, rtol=1e-6)


def test_lora_merged_refit_agrees_with_training(ray_cluster, tmp_path):
    """policy.lora_cfg.refit=merged: the full-weight refit path with W + B@A*alpha/dim under the HF names."""
    records = train(tiny_config(tmp_path, "grpo.max_num_steps=2", "policy.lora_cfg.refit=merged", *LORA, *NO_VALIDATION))
    full_bytes = 4.0 * sum(p.numel() for p in load_causal_lm("embedded:tiny-arith-qwen2").parameters())  # tied: sent once
    assert [r["performance/refit_bytes"] for r in records] == [0.0, full_bytes]
    assert all(r["train/gen_kl"] < GEN_KL_BOUND for r in records), [r["train/gen_kl"] for r in records]
