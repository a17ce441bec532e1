"""Throughput and time shares of one training step, from its metrics (pure functions, no I/O).

Inputs (keys of the step's metrics dict):

* ``timing/train/<phase>`` seconds and ``timing/train/total_step_time``;
* ``performance/num_batch_tokens``: prompt + response tokens of the trained batch (no padding);
* ``performance/num_generated_tokens``: response tokens generated in the step, including the
  generation batches that dynamic sampling discarded and the tokens past a stop string's cut (they cost generation
  time too);
* ``performance/num_samples``: samples in the trained batch.
"""

from __future__ import annotations

from collections.abc import Mapping

TIMING_PREFIX = "timing/train/"
TOTAL_KEY = "timing/train/total_step_time"
SHARE_PREFIX = "timing/train/share/"

#: The phases every step records (0.0 where one did not run), in step order.
TIMED_PHASES = ("refit", "generation", "reward", "prev_logprobs", "reference_logprobs", "teacher_logprobs", "policy_training")
#: Every phase a step's time splits into, as the console's timing line and the plot's stacked panel show them: the
#: timed ones, an async trainer's waits, validation.
STEP_PHASES = (*TIMED_PHASES, "waiting_for_data", "waiting_for_refit", "validation")


#: The tokens of the optimizer steps that ran (fewer than num_batch_tokens when a step had no token to train on).
TRAINED_TOKENS = "performance/num_trained_tokens"


def trained_tokens(metrics: Mapping[str, float]) -> float:
    """The tokens the training forward and backward ran on (:data:`TRAINED_TOKENS`; a record without it: the batch's)."""
    return float(metrics.get(TRAINED_TOKENS, metrics.get("performance/num_batch_tokens", 0.0)))


def rate(amount: float, seconds: float) -> float:
    """``amount / seconds``, or 0.0 when no time was spent (the phase did not run)."""
    return amount / seconds if seconds > 0 else 0.0


def generation_seconds(metrics: Mapping[str, float]) -> float:
    """Seconds the engines generated this step: ``timing/train/generation`` (sync), else the collector's
    ``async/generation_seconds`` (async: the trainer does not generate)."""
    return float(metrics.get(f"{TIMING_PREFIX}generation", 0.0)) or float(metrics.get("async/generation_seconds", 0.0))


def training_seconds(metrics: Mapping[str, float]) -> float:
    """The step's seconds without its validation pass: what the rates and MFU divide by (a validation step's total
    holds validation's generation, whose tokens and FLOPs no rate counts; NeMo-RL's step time leaves it out too)."""
    return max(float(metrics.get(TOTAL_KEY, 0.0)) - float(metrics.get(f"{TIMING_PREFIX}validation", 0.0)), 0.0)


def phase_seconds(metrics: Mapping[str, float]) -> dict[str, float]:
    """``{phase: seconds}`` for every ``timing/train/<phase>`` key except the total and the shares."""
    return {
        key[len(TIMING_PREFIX) :]: float(value)
        for key, value in metrics.items()
        if key.startswith(TIMING_PREFIX) and key != TOTAL_KEY and not key.startswith(SHARE_PREFIX)
    }


def phase_shares(metrics: Mapping[str, float]) -> dict[str, float]:
    """``timing/train/share/<phase>``: each phase's fraction (0..1) of the total step time."""
    total = float(metrics.get(TOTAL_KEY, 0.0))
    return {f"{SHARE_PREFIX}{phase}": rate(seconds, total) for phase, seconds in phase_seconds(metrics).items()}


def throughput_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """Tokens and samples per second of one step, and the time share of each phase.

    * ``performance/tokens_per_sec``: batch tokens (prompt + response) / the step's time without validation
      (:func:`training_seconds`);
    * ``performance/generation_tokens_per_sec``: generated tokens / generation seconds (:func:`generation_seconds`:
      async steps take the collector's, it was 0 there);
    * ``performance/training_tokens_per_sec``: trained tokens (:func:`trained_tokens`) / policy_training seconds;
    * ``performance/samples_per_sec``: batch samples / the step's time without validation;
    * ``timing/train/share/<phase>``: see :func:`phase_shares`.

    A rate whose time is zero is reported as 0.0, so every step has the same keys.
    """
    work = training_seconds(metrics)
    batch_tokens = float(metrics.get("performance/num_batch_tokens", 0.0))
    return {
        "performance/tokens_per_sec": rate(batch_tokens, work),
        "performance/generation_tokens_per_sec": rate(
            float(metrics.get("performance/num_generated_tokens", 0.0)), generation_seconds(metrics)
        ),
        "performance/training_tokens_per_sec": rate(trained_tokens(metrics), float(metrics.get(f"{TIMING_PREFIX}policy_training", 0.0))),
        "performance/samples_per_sec": rate(float(metrics.get("performance/num_samples", 0.0)), work),
        **phase_shares(metrics),
    }
