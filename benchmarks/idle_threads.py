"""Do idle actors steal CPU from the running phase? CPU-seconds an idle process burns right after work.

Usage: python benchmarks/idle_threads.py [--threads 2]

In the sync loop the phases run one after the other, so the automatic thread split gives every
phase all the cores (docs/guides/scaling.md#threads-per-worker). That is only right if an actor
that just finished its phase does not keep its OpenMP threads spinning. This measures, in one
process with ``--threads`` threads: a torch matmul loop (the policy's case) and an in-process vLLM
CPU engine generating a batch (the generation engine's case, as our Ray actor runs it), each
followed by 3 idle seconds; it prints the CPU-seconds used during the idle seconds.
"""

from __future__ import annotations

import argparse
import os
import time


def idle_cpu_seconds(seconds: float = 3.0) -> float:
    start = time.process_time()
    time.sleep(seconds)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    os.environ.update(
        OMP_NUM_THREADS=str(args.threads), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="ERROR"
    )
    import torch

    torch.set_num_threads(args.threads)
    a = torch.randn(256, 256)
    for _ in range(2000):
        a @ a
    print(f"torch, {args.threads} threads: {idle_cpu_seconds():.4f} CPU-s in the 3 idle seconds after 2000 matmuls")

    from vllm import LLM, SamplingParams

    from nemo_like.models.loading import resolve_model_path

    llm = LLM(model=resolve_model_path("embedded:tiny-arith-qwen2"), dtype="float32", enforce_eager=True, max_model_len=64, seed=0)
    for _ in range(2):
        llm.generate(["1+1="] * 64, SamplingParams(max_tokens=16), use_tqdm=False)
    print(f"vLLM CPU engine, {args.threads} threads: {idle_cpu_seconds():.4f} CPU-s in the 3 idle seconds after generating 64 x 16 tokens")


if __name__ == "__main__":
    main()
