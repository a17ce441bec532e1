"""In-process sampling speed: transformers ``generate`` against our lean loop (inline generation), same model and batch.

Usage: python benchmarks/lean_generation.py [--size 1m|10m] [--repeats 9] [--threads 2]

Builds the model of ``benchmarks/vs_trl.py`` (random init, stop token never sampled, so every row runs the full
length) and samples the workload's batch (``1m``: W1, 1 prompt x 8 samples x 16 tokens; ``10m``: W2, 8 prompts x 8 x
64) three ways, alternating, after one warm-up each: HF ``generate`` with a KV cache (what TRL and our ``hf`` engine
run), :func:`nemo_like.models.generation.lean_decoder.sample` with the fused Llama-family step (what ``inline`` runs),
and the same loop on the model's own forward (what ``inline`` runs for other architectures). Prints the median
milliseconds of each and the ratios to HF ``generate``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from vs_trl import WORKLOADS, build_model

from nemo_like.models.generation.lean_decoder import left_padded, sample
from nemo_like.models.logprobs import SamplingDistribution


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=("1m", "10m"), default="1m")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    work = WORKLOADS["W1" if args.size == "1m" else "W2"]
    with tempfile.TemporaryDirectory() as tmp:
        name, _ = build_model(Path(tmp), args.size)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval()
    prompts = [[5 + (i * 7 + j) % 300 for j in range(21)] for i in range(work["prompts"])] * work["generations"]
    new_tokens, stop = work["new_tokens"], model.config.eos_token_id
    dist = SamplingDistribution()

    @torch.no_grad()
    def hf_generate() -> None:
        ids, mask = left_padded(prompts, 0)
        model.generate(
            input_ids=ids, attention_mask=mask.long(), do_sample=True, top_k=0, max_new_tokens=new_tokens,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=stop,
        )  # fmt: skip

    def lean_fused() -> None:
        sample(model, prompts, new_tokens, dist, [stop], 0, seed=0)

    def lean_model_forward() -> None:
        sample(model, prompts, new_tokens, dist, [stop], 0, seed=0, fused=False)

    runs = {"hf generate": hf_generate, "lean loop, fused step (inline)": lean_fused, "lean loop, model forward": lean_model_forward}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():
        fn()  # warm-up
    for _ in range(args.repeats):
        for key, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    base = statistics.median(times["hf generate"])
    print(f"{args.size}: {len(prompts)} rows x {new_tokens} tokens, {args.threads} threads, median of {args.repeats}")
    for key, values in times.items():
        med = statistics.median(values)
        print(f"  {key:32s} {med * 1000:8.1f} ms   {med / base:.2f}x hf generate")


if __name__ == "__main__":
    main()
