"""Every sampling seed of a run, derived in one place from ``grpo.seed`` and where the sample is drawn.

A run is reproducible because each batch's seed depends only on *what* it samples (step, batch, turn, worker,
offset in a chunk), never on timing or on which process happened to ask: the async loop with
``max_trajectory_age_steps: 0`` draws exactly the sync loop's samples, a resumed run the uninterrupted run's, and a
re-dispatched batch the lost one's. Change a formula here and every seed of that kind changes with it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

#: Multipliers that keep seeds of different steps and validation rounds apart (primes).
STEP_STRIDE = 1_000_003
BATCH_STRIDE = 101
VALIDATION_STRIDE = 10_000_019


def _hashed_seed(key: str) -> int:
    """A 31-bit seed hashed from ``key`` (the keys below are fixed: a changed key changes every seed of its kind)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little") & 0x7FFFFFFF


def rollout_seed(seed: int, step: int, batch_index: int = 0) -> int:
    """The sampling seed of training step ``step``'s ``batch_index``-th generation batch (the sync loop and the async
    collector use the same, so an async run with ``max_trajectory_age_steps: 0`` reproduces the sync run).

    A batch's request ``i < BATCH_STRIDE`` samples with this seed + ``i`` (:func:`chunk_seed`), so consecutive seeds for the refill
    batches of dynamic sampling would make refill ``b + 1``'s request ``i`` repeat batch ``b``'s request ``i + 1``: the
    same sample again wherever a prompt comes back within the step. Refills take a hash instead."""
    if batch_index == 0:
        return (seed * STEP_STRIDE + step) * BATCH_STRIDE
    return _hashed_seed(f"refill/{seed}/{step}/{batch_index}")


def serving_seed(seed: int, call_index: int) -> int:
    """The seed of the rollout server's ``call_index``-th engine call for unseeded requests (and of each unseeded prompt
    of a mixed batch). Engines seed a call's request ``i`` with the call's seed + ``i`` (:func:`chunk_seed`), so a
    counter (seed, seed + 1, ...) made call ``c + 1``'s first request draw exactly call ``c``'s second: independent
    requests, or a group's sessions, came out identical. A hash per call instead."""
    return _hashed_seed(f"serve/{seed}/{call_index}")


def validation_seed(step: int) -> int:
    """The sampling seed of the validation run after training step ``step`` (0: before training)."""
    return VALIDATION_STRIDE * (step + 1)


def eval_seed(seed: int) -> int:
    """The sampling seed of ``nemo-like eval`` with ``eval.seed`` (or ``grpo.seed``) = ``seed``. A batch's request ``i``
    samples with its seed + ``i`` (:func:`chunk_seed`) and a prompt's samples are consecutive requests, so seed ``s + 1``
    used as it is would redraw sample ``j + 1`` of seed ``s`` as its sample ``j``: evals over seeds 0, 1, 2 shared
    (n - 1)/n of their samples. A hash instead."""
    return _hashed_seed(f"eval/{seed}")


def turn_seed(seed: int, turn: int, group: int) -> int:
    """A multi-turn rollout's generation call ``group`` of turn ``turn``: the first call uses ``seed`` itself (a
    one-turn rollout reproduces a single-turn one); later calls a hash of the three."""
    if turn == 0 and group == 0:
        return seed
    return _hashed_seed(f"{seed}/{turn}/{group}")


def judge_seed(seed: int, prompt_ids: list[int] | tuple[int, ...]) -> int:
    """The seed a sampled LLM judge (``greedy: false``) reads one judge prompt with: a hash of its ids and the judge's
    ``seed``, so a verdict depends only on what is judged. ``seed + (call counter)`` lived in the environment actor: a
    resumed run, or a replaced actor, restarted it and judged the same samples with other numbers (the resumed run's
    rewards were not the uninterrupted run's), and call ``c + 1``'s request ``i`` drew call ``c``'s request ``i + 1``."""
    return _hashed_seed(f"judge/{seed}/{','.join(map(str, prompt_ids))}")


def worker_seed(seed: int, rank: int) -> int:
    """The seed of generation worker ``rank``'s shard of a batch sampled with ``seed``: rank 0's is ``seed`` itself (one
    worker samples as the batch's seed says), another rank's a hash. ``seed + 1,000,003 x rank`` met the step seeds:
    1,000,003 = 2 mod 101, so rank r at step s drew rank 0's numbers at step s + 9,901 r (offset + 2r)."""
    return seed if rank == 0 else _hashed_seed(f"rank/{seed}/{rank}")


def chunk_seed(seed: int, offset: int) -> int:
    """The seed of the chunk (or request) that starts at prompt ``offset`` of a worker's batch sampled with ``seed``.

    ``seed + offset`` below :data:`BATCH_STRIDE`, where consecutive steps' batch seeds stay apart; past it, ``seed +
    offset`` would be the next step's seed for offset ``offset - BATCH_STRIDE`` (step ``s + 1``'s request ``j`` drew
    step ``s``'s request ``j + 101``'s numbers: 80% of a 512-request vLLM batch), so those offsets take a hash."""
    if offset < BATCH_STRIDE:
        return seed + offset
    return _hashed_seed(f"chunk/{seed}/{offset}")


def agent_session_seed(seed: int, sample: int) -> int:
    """The seed of the agent session that rolls out sample ``sample`` (its index in the batch) of a batch sampled with
    ``seed``: every call of the session derives its own from it and its prompt (:func:`agent_call_seed`)."""
    return _hashed_seed(f"agent/{seed}/{sample}")


def agent_call_seed(session_seed: int, prompt_ids: Sequence[int], repeat: int = 0, settings: str = "") -> int:
    """The sampling seed of a call of the session seeded ``session_seed`` whose prompt is ``prompt_ids`` and sampling
    settings ``settings`` (text), the ``repeat``-th call of that session with exactly these (0 for the first).

    A seed follows *what* the call samples, not when it arrived: call k in arrival order made an agent's concurrent calls
    (``asyncio.gather``) swap seeds whenever their requests raced the other way, so a deterministic agent sampled
    differently on a rerun. Calls with identical prompts are interchangeable, so counting them in arrival order keeps
    them apart without losing that; a sequential agent's calls, and so its samples, are the same on every rerun."""
    digest = hashlib.sha256(struct.pack(f"<{len(prompt_ids)}q", *prompt_ids)).hexdigest()
    if settings:  # calls counted apart by their settings must not share a seed (one would replay the other's start)
        digest = hashlib.sha256(f"{digest}/{settings}".encode()).hexdigest()
    return _hashed_seed(f"agent-call/{session_seed}/{digest}/{repeat}")
