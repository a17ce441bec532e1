"""An eval in chunks of whole prompts: each chunk is sampled and scored by one call, its rows appended to
``results.partial.jsonl`` and its progress printed; the summary is built from every chunk's rows at the end.

A chunk starting at prompt ``p`` samples with ``chunk_seed(seed, p x n)``, the seed a single call gave its request
``p x n``: an eval of one chunk samples as one call did; with several, the samples depend on ``eval.samples_per_chunk``
(deterministic for it: a call's later requests take ``chunk_seed`` of the chunk's seed, hashed past an offset of 100)."""

from __future__ import annotations

import json
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_like.experience.multi_turn import EpisodeTotals, episode_totals
from nemo_like.experience.rollouts import add_batch_counters
from nemo_like.utils.logger import format_eta, format_seconds
from nemo_like.utils.seeds import chunk_seed

#: In ``eval.output_dir``: the rows of the chunks done so far (removed once ``results.jsonl`` is written).
PARTIAL_RESULTS = "results.partial.jsonl"


def prompt_chunks(num_prompts: int, samples_per_prompt: int, samples_per_chunk: int) -> list[tuple[int, int]]:
    """``(first, end)`` prompt ranges of at most ``samples_per_chunk`` samples each, at least one prompt."""
    size = max(1, samples_per_chunk // samples_per_prompt)
    return [(first, min(first + size, num_prompts)) for first in range(0, num_prompts, size)]


def seed_of_chunk(seed: int, first_prompt: int, samples_per_prompt: int) -> int:
    """The sampling seed of the chunk starting at prompt ``first_prompt`` (module docstring)."""
    return chunk_seed(seed, first_prompt * samples_per_prompt)


@dataclass
class EvalChunks:
    """What an eval has gathered so far: its rows, the environments' counters summed, and the multi-turn episodes'
    totals; it appends each chunk's rows to ``partial`` and prints a progress line."""

    partial: Path
    num_prompts: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    env_metrics: dict[str, float] = field(default_factory=dict)
    episodes: list[EpisodeTotals] = field(default_factory=list)
    done: int = 0
    started: float = field(default_factory=time.perf_counter)
    _writable: bool = True

    def __post_init__(self) -> None:
        self._write("", "w")  # an earlier eval's partial rows go

    def add(self, end_prompt: int, rollout: Any, rows: list[dict[str, Any]], multi_turn: bool) -> None:
        """Keep a chunk's rows and counters (the rollout's samples are not kept), append its rows, print progress."""
        self.rows.extend(rows)
        add_batch_counters(self.env_metrics, rollout.env_metrics)  # sums, but the agents' per-session means
        if multi_turn:
            self.episodes.extend(episode_totals(rollout.samples, rollout.rewards, rollout.session_of_row))
        self.done = end_prompt
        self._write("".join(json.dumps(row) + "\n" for row in rows), "a")
        print(self.progress_line(), file=sys.stderr, flush=True)

    def progress_line(self) -> str:
        elapsed = time.perf_counter() - self.started
        eta = elapsed / self.done * (self.num_prompts - self.done) if self.done else None
        return (
            f"[eval] {self.done:,}/{self.num_prompts:,} prompts ({len(self.rows):,} rows) | "
            f"elapsed {format_seconds(elapsed)} {format_eta(eta)}"
        )

    def stopped_line(self) -> str:
        """What a stopped eval kept (printed before the stop's own line)."""
        where = f"in {self.partial}" if self._writable else f"lost ({self.partial} could not be written)"
        earlier = (self.partial.parent / "summary.json").is_file()  # an earlier eval's, which this one was to replace
        summary = "the summary.json and results.jsonl there are an earlier eval's" if earlier else "no summary.json"
        return f"[eval] stopped after {self.done:,} of {self.num_prompts:,} prompts: their {len(self.rows):,} rows are {where} ({summary})"

    def finish(self) -> None:
        """``results.jsonl`` is written: the partial rows go."""
        self.partial.unlink(missing_ok=True)

    def _write(self, text: str, mode: str) -> None:
        if not self._writable:
            return
        try:
            with open(self.partial, mode, encoding="utf-8") as f:
                f.write(text)
        except OSError as exc:  # a convenience: the eval goes on, its results are written at the end
            self._writable = False
            warnings.warn(
                f"cannot write {self.partial} ({exc.strerror or exc}): a stopped eval will keep no rows", RuntimeWarning, stacklevel=2
            )
