"""Generation throughput and refit time: vLLM vs HF backends, on the tiny model and on a ~10M model.

Usage: python benchmarks/generation.py [--prompts 64] [--new-tokens 32] [--repeats 3]

Each backend runs in its own Ray actor exactly as in training (one worker, ``policy.num_cpus_per_worker``
and ``policy.num_threads_per_worker`` of the default recipe). Per model and backend it prints the best
tokens/s over ``--repeats`` sampled batches (after one warm-up batch; tokens = response tokens
actually produced, stop token included) and the median time of 3 refits from a state dict in the
object store, then the vLLM/HF ratios. The ~10M model (hidden 384, intermediate 1792, 4 layers,
6 heads, 2 KV heads, tied embeddings) is built with random weights in a temporary directory from the
tiny model's tokenizer; random weights rarely emit the stop token, so its responses run to
``--new-tokens``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import ray  # noqa: E402  (after nemo_like.distributed, which sets Ray's environment defaults)

from nemo_like.config import DEFAULT_RECIPE, load_config
from nemo_like.config.schema import ClusterConfig, MasterConfig
from nemo_like.data.prompts import build_prompt_dataset
from nemo_like.distributed.ray_init import init_ray
from nemo_like.models.generation.interface import SamplingParams
from nemo_like.models.loading import full_state_dict, load_causal_lm, load_tokenizer, resolve_model_path

BACKENDS = ("hf", "vllm")


def build_10m_model(directory: Path) -> str:
    """A randomly initialised ~10M-parameter Qwen2 with the tiny model's tokenizer, saved to ``directory``."""
    import torch
    from transformers import AutoConfig, Qwen2Config, Qwen2ForCausalLM

    tiny = resolve_model_path("embedded:tiny-arith-qwen2")
    base = AutoConfig.from_pretrained(tiny)
    config = Qwen2Config(
        vocab_size=base.vocab_size,
        hidden_size=384,
        intermediate_size=1792,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=base.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    load_tokenizer(tiny).save_pretrained(directory)
    return str(directory)


def recipe(model: str, backend: str, new_tokens: int) -> MasterConfig:
    """The default recipe on ``model`` with ``backend``, long enough for ``new_tokens``."""
    return load_config(
        DEFAULT_RECIPE,
        [f"policy.model_name={model}", f"policy.generation.backend={backend}", f"policy.max_total_sequence_length={64 + new_tokens}"],
    )


def make_backend(cfg: MasterConfig, tokenizer):
    """The generation facade for ``cfg``'s backend (one Ray actor)."""
    from nemo_like.models.engines import build_generation
    from nemo_like.models.loading import end_of_sequence_ids

    return build_generation(cfg, tokenizer.pad_token_id, end_of_sequence_ids(tokenizer, cfg.policy.model_name))


def measure(cfg: MasterConfig, prompts: list[list[int]], new_tokens: int, repeats: int, state_refs: list) -> dict[str, float]:
    """Best tokens/s over ``repeats`` batches and median refit seconds for one backend."""
    tokenizer = load_tokenizer(cfg.policy.model_name)
    start = time.perf_counter()
    gen = make_backend(cfg, tokenizer)
    params = SamplingParams(max_new_tokens=new_tokens)
    try:
        gen.generate(prompts, params, seed=0)  # warm-up (waits for the actor to start)
        startup = time.perf_counter() - start
        rates = []
        for i in range(repeats):
            t0 = time.perf_counter()
            samples = gen.generate(prompts, params, seed=1 + i)
            rates.append(sum(len(s.response_ids) for s in samples) / (time.perf_counter() - t0))
        refits = [gen.refit(ref, version) for version, ref in enumerate(state_refs, start=1)]
    finally:
        gen.shutdown()
    return {"tok_s": max(rates), "refit_s": statistics.median(refits), "startup_s": startup}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64, help="sequences per batch (the default recipe's 8 prompts x 8)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    init_ray(ClusterConfig(num_cpus=2, object_store_memory_mb=512))
    results: dict[tuple[str, str], dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = {"tiny (1M)": "embedded:tiny-arith-qwen2", "10M": build_10m_model(Path(tmp) / "qwen2-10m")}
        for label, model in models.items():
            base = recipe(model, "hf", args.new_tokens)
            tokenizer = load_tokenizer(model)
            prompts = [r.prompt_token_ids for r in build_prompt_dataset(base.data, tokenizer, "validation", 64)[: args.prompts]]
            state = full_state_dict(load_causal_lm(model))
            state_refs = [ray.put((version, state)) for version in (1, 2, 3)]  # as the policy actor publishes it
            for backend in BACKENDS:
                results[(label, backend)] = measure(
                    recipe(model, backend, args.new_tokens), prompts, args.new_tokens, args.repeats, state_refs
                )
    report(results, args)
    ray.shutdown()


def report(results: dict[tuple[str, str], dict[str, float]], args: argparse.Namespace) -> None:
    """Print one line per model and backend, then the vLLM/HF ratios."""
    import os

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\n{args.prompts} sequences x up to {args.new_tokens} new tokens, fp32, 1 actor, best of {args.repeats}")
    print(f"{os.cpu_count()} CPUs, load average {load} (1/5/15 min): other processes on the machine slow every figure")
    print(f"{'model':<10} {'backend':<7} {'tokens/s':>10} {'refit s':>9} {'start s':>8}")
    for (model, backend), r in results.items():
        print(f"{model:<10} {backend:<7} {r['tok_s']:>10.0f} {r['refit_s']:>9.3f} {r['startup_s']:>8.1f}")
    for model in dict.fromkeys(m for m, _ in results):
        v, h = results[(model, "vllm")], results[(model, "hf")]
        print(f"{model}: vLLM/HF tokens/s = {v['tok_s'] / h['tok_s']:.2f}, refit time vLLM/HF = {v['refit_s'] / h['refit_s']:.2f}")


if __name__ == "__main__":
    main()
