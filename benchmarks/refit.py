"""Refit time: the object-store path (pickled buckets) against the shared-memory path, same actors, alternating.

Usage: python benchmarks/refit.py [--size 10m|1m] [--backend vllm|hf] [--refits 8]

Builds the model of ``benchmarks/vs_trl.py`` (random init, the tiny model's tokenizer) in a temporary
directory, starts one policy worker and one generation worker as a run would, then refits
``--refits`` times through each path (``Policy.weight_buckets(shared_memory=False/True)`` followed by
``generation.refit``), alternating which goes first. Prints the median of each path (the first refit of
each, which maps or allocates, is left out), split into the policy's export and the engine's load, and the
1-minute load average.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from vs_trl import build_model, load1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=("1m", "10m"), default="10m")
    p.add_argument("--backend", choices=("vllm", "hf"), default="vllm")
    p.add_argument("--refits", type=int, default=8)
    args = p.parse_args()

    from nemo_like.algorithms.loss_functions import ClippedPGLossFn
    from nemo_like.config import DEFAULT_RECIPE, load_config
    from nemo_like.distributed.ray_init import init_ray
    from nemo_like.models.engines import build_generation
    from nemo_like.models.loading import end_of_sequence_ids, load_tokenizer
    from nemo_like.models.policy.policy import Policy

    with tempfile.TemporaryDirectory(prefix="refit_") as tmp:
        model_dir, n_params = build_model(Path(tmp) / "model", args.size)
        cfg = load_config(
            DEFAULT_RECIPE,
            [
                f"policy.model_name={model_dir}",
                "loss_fn.reference_policy_kl_penalty=0",
                f"policy.generation.backend={args.backend}",
                f"logger.log_dir={tmp}/logs",
            ],
        )
        init_ray(cfg.cluster)
        tok = load_tokenizer(model_dir)
        policy = Policy(cfg, "policy", loss_fn=ClippedPGLossFn(cfg.loss_fn))
        generation = build_generation(cfg, tok.pad_token_id, end_of_sequence_ids(tok, model_dir), policy)
        seconds: dict[str, list[float]] = {"object store": [], "shared memory": []}
        exports: dict[str, list[float]] = {"object store": [], "shared memory": []}
        loads = []
        try:
            for i in range(args.refits):
                order = [("object store", False), ("shared memory", True)]
                for name, shared in order if i % 2 == 0 else order[::-1]:
                    start = time.perf_counter()
                    buckets = policy.weight_buckets(shared_memory=shared)
                    exported = time.perf_counter()
                    generation.refit(buckets, policy.weight_version)
                    seconds[name].append(time.perf_counter() - start)
                    exports[name].append(exported - start)
                loads.append(load1())
        finally:
            generation.shutdown()
            policy.shutdown()
    print(
        f"{args.size} ({n_params / 1e6:.1f}M params, {4 * n_params / 2**20:.0f} MiB fp32), backend {args.backend}, load {min(loads):.1f}-{max(loads):.1f}"
    )
    for name, values in seconds.items():
        export = statistics.median(exports[name][1:])
        load = statistics.median([t - e for t, e in zip(values[1:], exports[name][1:])])
        print(
            f"  {name}: median {statistics.median(values[1:]):.4f} s (export {export:.4f} + load {load:.4f})"
            f"  ({' '.join(f'{v:.4f}' for v in values)})"
        )


if __name__ == "__main__":
    main()
