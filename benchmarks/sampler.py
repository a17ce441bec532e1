"""The sampler's cost per decode step: our inverse-CDF draw against the exponential race, side by side in one run.

Usage: python benchmarks/sampler.py [--repeats 5] [--threads 2] [--tokens 16]

Both draws take the same logits through temperature, log-softmax and exp, then:

* **race**: our draw up to 2ff72c5: a non-finite check over every probability, then ``torch.multinomial(probs, 1)``,
  which draws one Exp(1) variate per vocabulary entry and takes ``argmax(p / q)`` (transformers' ``generate``
  samples this way);
* **ours** (:func:`nemo_like.models.generation.lean_decoder.draw`): the non-finite check on each row's sum, then,
  above ``RACE_MAX_VOCAB`` (4096) tokens, one uniform per row and cumulative sums
  (:func:`~nemo_like.models.generation.lean_decoder.inverse_cdf_tokens`); up to it, the same race as before (so the
  small models' seeded draws are unchanged; the 359-token rows measure the non-finite check alone).

Table 1 times one draw at 8 and 64 rows of the tiny tokenizer's vocabulary (359, every benchmark workload here) and
of Qwen2's (151,936). Table 2 times a whole ``sample`` call (64 rows, ``--tokens`` new tokens) of a random Qwen2 with
hidden size 128, 2 layers and Qwen2's vocabulary, with each draw; the model's forward is the same in both. Each cell
is the median over ``--repeats`` interleaved repeats.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from nemo_like.models.generation import lean_decoder
from nemo_like.models.processed_logprobs import SamplingDistribution

QWEN2_VOCAB = 151_936


def race_draw(
    logits: torch.Tensor, dist: SamplingDistribution, greedy: bool, generator: torch.Generator | list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our draw as it was up to 2ff72c5 (one generator for the batch, no truncation)."""
    assert not greedy and isinstance(generator, torch.Generator) and not dist.truncates
    logprobs = torch.log_softmax(logits.float() / dist.temperature, dim=-1)
    probs = logprobs.exp()
    broken = ~torch.isfinite(probs).all(dim=-1)
    if bool(broken.any()):
        probs[broken] = 1.0
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


DRAWS: dict[str, Callable] = {"race": race_draw, "ours": lean_decoder.draw}


def seconds(fn: Callable[[], object], calls: int) -> float:
    """Mean seconds of ``calls`` calls of ``fn``."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def draw_table(repeats: int) -> None:
    dist = SamplingDistribution(1.0, None, 1.0)
    print("| rows | vocabulary | race ms/draw | ours ms/draw | race / ours |\n|---|---|---|---|---|")
    for rows, vocab in [(8, 359), (64, 359), (8, QWEN2_VOCAB), (64, QWEN2_VOCAB)]:
        logits = 3 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
        calls = 200 if vocab < 1000 else 5
        times: dict[str, list[float]] = {name: [] for name in DRAWS}
        for _ in range(repeats):
            for name, draw in DRAWS.items():
                generator = torch.Generator().manual_seed(1)
                draw(logits, dist, False, generator)  # warm
                times[name].append(seconds(functools.partial(draw, logits, dist, False, generator), calls))
        race, ours = (statistics.median(times[n]) for n in DRAWS)
        print(f"| {rows} | {vocab} | {race * 1e3:.3f} | {ours * 1e3:.3f} | {race / ours:.2f} |", flush=True)


def sample_table(repeats: int, tokens: int) -> None:
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=QWEN2_VOCAB, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    model = Qwen2ForCausalLM(cfg).eval()
    prompts = [[11 + i, 22, 33, 44, 55, 66, 77, 88] for i in range(8)] * 8  # 8 prompts x 8 completions
    dist = SamplingDistribution(1.0, None, 1.0)
    times: dict[str, list[float]] = {name: [] for name in DRAWS}
    for r in range(repeats + 1):
        for name, draw in DRAWS.items():
            lean_decoder.draw = draw
            start = time.perf_counter()
            lean_decoder.sample(model, prompts, tokens, dist, [], 0, seed=r)
            if r:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    lean_decoder.draw = DRAWS["ours"]
    race, ours = (statistics.median(times[n]) for n in DRAWS)
    print(
        f"\n`sample`: 64 rows x {tokens} tokens, Qwen2 vocabulary, hidden 128, 2 layers: race {race:.2f} s, ours {ours:.2f} s "
        f"(race / ours {race / ours:.2f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    draw_table(args.repeats)
    sample_table(args.repeats, args.tokens)


if __name__ == "__main__":
    main()
