"""Steps per second of the same recipe run sync and async (``grpo.async_grpo.enabled``), in interleaved pairs of runs.

Usage: python benchmarks/async_vs_sync.py [--steps 20] [--pairs 3] [--setting tiny|generation-heavy|both] [overrides ...]

Settings:
* ``tiny``: the shipped recipe as is (training is the larger share of a sync step);
* ``generation-heavy``: the same recipe on an *untrained* copy of the tiny architecture (random
  weights, so it rarely samples the stop token) with up to 64 new tokens and 4 samples per prompt: responses run
  ~57 tokens, decoding is up to 64 sequential engine steps, and generation becomes about half of a sync step while
  training stays cheap. (Rewards are ~0 there: it measures throughput, not learning.)

The headline is async against the sync loop a user runs without it: the same recipe with its default engine
(``policy.generation.backend=auto``: inline generation on a CPU cluster, see docs/guides/generation.md). A single pair
of runs moves by 0.1-0.3 with the machine's speed, so ``--pairs`` pairs run alternately, sync first in odd pairs and
async first in even ones (a machine that speeds up or slows down during the invocation favours neither side), and the
script prints each pair's ratio and their median [min, max]. When async's engine differs from sync's default (the HF
engine actor on a CPU cluster), one more sync run on async's engine follows the pairs, so that the loop can be told
apart from the engine.

Then, over every measured step of the async runs: where an async step's time went (the trainer waiting for data,
the trainer waiting for the batch in flight before a refit, the collector's generation seconds, pause for refit and
wait for pacing; medians), and the best ratio the two sides' busy times allow (a sync step / the busier side's seconds
per async step). The first ``--warmup`` steps of each run (actor warm-up) are left out. Threads per worker are the
automatic split unless overridden (``policy.num_threads_per_worker=N``; docs/guides/scaling.md), and the split each
mode used is printed.
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


def compare(name: str, steps: int, warmup: int, extra: list[str], pairs: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [*SETTINGS[name], *extra]
        if name == "generation-heavy":
            overrides.insert(0, f"policy.model_name={build_untrained_tiny(Path(tmp) / 'untrained-tiny')}")
        # The headline compares async with the sync loop a user runs without it (its default engine: inline on a CPU
        # cluster), in interleaved pairs; sync on async's own engine runs once after them when the two engines differ.
        engine = resolve_backend(load_config(DEFAULT_RECIPE, [*SETTINGS[name], *extra, *ASYNC], warn=False))[0]
        default = resolve_backend(load_config(DEFAULT_RECIPE, [*SETTINGS[name], *extra], warn=False))[0]
        runs: dict[str, list[list[dict]]] = {"sync": [], "async": []}
        for pair in range(pairs):
            order = ("sync", "async") if pair % 2 == 0 else ("async", "sync")  # ABBA: a drifting machine cancels out
            for mode in order:
                history = run([*overrides, *(ASYNC if mode == "async" else [])], steps, f"{tmp}/{mode}{pair}")[warmup:]
                runs[mode].append(history)
        same_engine = (
            run([*overrides, f"policy.generation.backend={engine}"], steps, f"{tmp}/sync_engine")[warmup:] if default != engine else None
        )
    sync_runs, async_runs = runs["sync"], runs["async"]
    ratios = [steps_per_second(a) / steps_per_second(s) for s, a in zip(sync_runs, async_runs)]
    sync, async_ = [h for r in sync_runs for h in r], [h for r in async_runs for h in r]  # every measured step, pooled
    print(f"== {name} ({len(sync_runs[0])} steps measured of {steps} per run; {pairs} interleaved pair(s) of runs) ==")
    gen_share = median(sync, "timing/train/generation") / median(sync, "timing/train/total_step_time")
    print(
        f"sync ({default} engine, the default): " + " ".join(f"{steps_per_second(r):.3f}" for r in sync_runs) + " steps/s "
        f"(median step {median(sync, 'timing/train/total_step_time'):.3f}s; generation {median(sync, 'timing/train/generation'):.3f}s "
        f"= {gen_share:.0%} of it, training {median(sync, 'timing/train/policy_training'):.3f}s, "
        f"mean response {median(sync, 'train/mean_response_length'):.1f} tokens)"
    )
    print(
        f"async ({engine} engine): " + " ".join(f"{steps_per_second(r):.3f}" for r in async_runs) + " steps/s "
        f"(median step {median(async_, 'timing/train/total_step_time'):.3f}s; training {median(async_, 'timing/train/policy_training'):.3f}s)"
    )
    print(
        f"async/sync({default}) per pair: "
        + " ".join(f"{r:.3f}" for r in ratios)
        + f"; median {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"
    )
    if same_engine is not None:
        print(
            f"sync on async's engine ({engine}), one run after the pairs: {steps_per_second(same_engine):.3f} steps/s (median step "
            f"{median(same_engine, 'timing/train/total_step_time'):.3f}s; generation {median(same_engine, 'timing/train/generation'):.3f}s); "
            f"async (pooled) / it: {steps_per_second(async_) / steps_per_second(same_engine):.3f}"
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
        f"async/sync({default}) if the two overlapped perfectly at these thread counts: {bound:.2f}"
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
    parser.add_argument("--pairs", type=int, default=3, help="interleaved (sync, async) pairs of runs per setting")
    parser.add_argument("overrides", nargs="*", help="recipe overrides applied to both runs")
    args = parser.parse_args()
    if args.pairs < 1 or args.steps <= args.warmup:
        parser.error(
            f"--pairs must be at least 1 and --steps above --warmup (got --pairs {args.pairs}, --steps {args.steps}, --warmup {args.warmup})"
        )
    for name in SETTINGS if args.setting == "both" else [args.setting]:
        compare(name, args.steps, args.warmup, args.overrides, args.pairs)


if __name__ == "__main__":
    main()
