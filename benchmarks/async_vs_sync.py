"""Steps per second of the same recipe run sync and async (``grpo.async_grpo.enabled``), one run each.

Usage: python benchmarks/async_vs_sync.py [--steps 20] [--setting tiny|generation-heavy|both] [overrides ...]

Settings:
* ``tiny``: the shipped recipe as is (training is the larger share of a sync step);
* ``generation-heavy``: the same recipe on an *untrained* copy of the tiny architecture (random
  weights, so it rarely samples the stop token) with up to 48 new tokens: every response runs ~48
  tokens, decoding is 48 sequential engine steps, and generation becomes the larger share of a sync
  step while training stays cheap. (Rewards are ~0 there: it measures throughput, not learning.)

Both loops run the engine async resolves to (``policy.generation.backend=auto``: the HF engine actor on a CPU
cluster), so the ratio measures the loop, not the engine; when a sync run's default engine differs (``inline`` on a CPU cluster, see
docs/guides/generation.md), that third run is printed too, with async's ratio to it.

For each setting it prints steps/s sync and async and their ratio, then where an async step's time
went: the trainer waiting for data, the trainer waiting for the batch in flight before a refit, and
the collector's generation seconds, pause for refit and wait for pacing (all per step, medians), and the
best ratio the two sides' busy times allow (sync step / the busier side's seconds per async step).
The first ``--warmup`` steps of each run (actor warm-up) are left out. Threads per worker are the
automatic split unless overridden (``policy.num_threads_per_worker=N``; docs/guides/scaling.md), and
the split each mode used is printed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from recipe_runs import run_recipe

from nemo_like.config import DEFAULT_RECIPE, load_config
from nemo_like.distributed.planning import plan_on_cluster
from nemo_like.models.loading import load_tokenizer, resolve_model_path
from nemo_like.plan.backend import resolve_backend

SETTINGS = {
    "tiny": [],
    "generation-heavy": [
        "policy.generation.max_new_tokens=64",
        "policy.max_total_sequence_length=112",
        "grpo.num_generations_per_prompt=4",
    ],
}


def build_untrained_tiny(directory: Path) -> str:
    """The shipped tiny model's architecture and tokenizer with fresh random weights, saved to ``directory``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tiny = resolve_model_path("embedded:tiny-arith-qwen2")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny)).save_pretrained(directory)
    load_tokenizer(tiny).save_pretrained(directory)
    return str(directory)


ASYNC = ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"]
IDLE_KEYS = (
    "idle/trainer_waiting_for_data",
    "idle/trainer_waiting_for_refit",
    "async/generation_seconds",
    "idle/generation_paused_for_refit",
    "idle/generation_waiting_for_pacing",
)


def run(overrides: list[str], steps: int, log_dir: str) -> list[dict]:
    # Both runs correct for the sampler, so the only difference is async itself.
    history = run_recipe(steps, log_dir, ["loss_fn.use_importance_sampling_correction=true", *overrides])
    return [h for h in history if "timing/train/total_step_time" in h]


def steps_per_second(history: list[dict]) -> float:
    return len(history) / sum(h["timing/train/total_step_time"] for h in history)


def median(history: list[dict], key: str) -> float:
    return statistics.median(h.get(key, 0.0) for h in history)


def compare(name: str, steps: int, warmup: int, extra: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [*SETTINGS[name], *extra]
        if name == "generation-heavy":
            overrides.insert(0, f"policy.model_name={build_untrained_tiny(Path(tmp) / 'untrained-tiny')}")
        # The loops are compared on the engine async uses; a sync run's default engine may differ (inline on CPU),
        # and that run is measured too when it does.
        engine = resolve_backend(load_config(DEFAULT_RECIPE, [*SETTINGS[name], *extra, *ASYNC], warn=False))[0]
        default = resolve_backend(load_config(DEFAULT_RECIPE, [*SETTINGS[name], *extra], warn=False))[0]
        sync = run([*overrides, f"policy.generation.backend={engine}"], steps, f"{tmp}/sync")[warmup:]
        async_ = run([*overrides, *ASYNC], steps, f"{tmp}/async")[warmup:]
        sync_default = run(overrides, steps, f"{tmp}/sync_default")[warmup:] if default != engine else None
    sync_rate, async_rate = steps_per_second(sync), steps_per_second(async_)
    print(f"== {name} ({len(sync)} steps measured of {steps}; both loops with the {engine} engine) ==")
    gen_share = median(sync, "timing/train/generation") / median(sync, "timing/train/total_step_time")
    print(
        f"sync : {sync_rate:.3f} steps/s (median step {median(sync, 'timing/train/total_step_time'):.3f}s; "
        f"generation {median(sync, 'timing/train/generation'):.3f}s = {gen_share:.0%} of it, "
        f"training {median(sync, 'timing/train/policy_training'):.3f}s, mean response {median(sync, 'train/mean_response_length'):.1f} tokens)"
    )
    print(
        f"async: {async_rate:.3f} steps/s (median step {median(async_, 'timing/train/total_step_time'):.3f}s; "
        f"training {median(async_, 'timing/train/policy_training'):.3f}s)"
    )
    print(f"ratio async/sync steps per second: {async_rate / sync_rate:.3f}")
    if sync_default is not None:
        default_rate = steps_per_second(sync_default)
        print(
            f"sync with its default engine ({default}): {default_rate:.3f} steps/s (median step "
            f"{median(sync_default, 'timing/train/total_step_time'):.3f}s; generation {median(sync_default, 'timing/train/generation'):.3f}s); "
            f"async/sync({default}) {async_rate / default_rate:.3f}"
        )
    for mode, extra_mode in (("sync", []), ("async", ASYNC)):
        print(
            f"{mode} {plan_on_cluster(load_config(DEFAULT_RECIPE, [*SETTINGS[name], *extra, *extra_mode], warn=False)).threads.describe()}"
        )
    print("async per-step medians: " + ", ".join(f"{k} {median(async_, k):.3f}s" for k in IDLE_KEYS))
    # With generation and training on separate threads, an async step can take no less than the busier side's
    # time: the trainer's step minus its wait for data, or the collector's generation seconds.
    trainer_busy = statistics.median(h["timing/train/total_step_time"] - h.get("idle/trainer_waiting_for_data", 0.0) for h in async_)
    collector_busy = median(async_, "async/generation_seconds")
    bound = median(sync, "timing/train/total_step_time") / max(trainer_busy, collector_busy)
    print(
        f"async busy per step: trainer {trainer_busy:.3f}s, collector {collector_busy:.3f}s; "
        f"async/sync if the two overlapped perfectly at these thread counts: {bound:.2f}"
    )
    print(
        f"async mean trajectory age: {statistics.mean(h['train/avg_trajectory_age'] for h in async_):.2f}; "
        f"samples refitted mid-sequence: {statistics.mean(h['async/refitted_mid_sequence_fraction'] for h in async_):.1%}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--setting", choices=[*SETTINGS, "both"], default="both")
    parser.add_argument("overrides", nargs="*", help="recipe overrides applied to both runs")
    args = parser.parse_args()
    for name in SETTINGS if args.setting == "both" else [args.setting]:
        compare(name, args.steps, args.warmup, args.overrides)


if __name__ == "__main__":
    main()
