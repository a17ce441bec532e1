"""Per-prompt seeds (``generate(prompts, params, seed=[...])``): each row samples what it samples alone with its seed,
whatever else is in the batch; an int seed samples exactly as before. On the shipped tiny tool model."""

from __future__ import annotations

import importlib.util
from dataclasses import asdict

import pytest
import torch

from nemo_like.algorithms.loss_functions import ClippedPGLossFn
from nemo_like.config.loss import ClippedPGLossConfig
from nemo_like.config.schema import OptimizerConfig
from nemo_like.models.generation.hf_worker import HFGenerationWorker
from nemo_like.models.generation.interface import SamplingParams, chunk_seeds, prompt_seeds
from nemo_like.models.generation.lean_decoder import (
    RACE_MAX_VOCAB,
    RowNoise,
    draw,
    draw_per_row,
    inverse_cdf_tokens,
    sample_with_params,
    uniforms,
)
from nemo_like.models.loading import load_causal_lm, load_tokenizer
from nemo_like.models.policy.inline import InlineGeneration
from nemo_like.models.policy.worker import PolicyWorker
from nemo_like.models.processed_logprobs import SamplingDistribution

MODEL = "embedded:tiny-tool-qwen2"
TEXTS = ["What is 347 times 28?", "12 * 5", "Compute 9 times 81 please, then add 4"]
HOT = SamplingParams(max_new_tokens=10, temperature=3.0, top_k=50, top_p=0.95)  # a flat distribution: seeds matter


@pytest.fixture(scope="module")
def tiny():
    tokenizer = load_tokenizer(MODEL)
    model = load_causal_lm(MODEL, "float32").eval()
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    return model, tokenizer, prompts


def run(tiny, prompts, params, seed):
    model, tokenizer, _ = tiny
    drawn = sample_with_params(model, prompts, params, [tokenizer.eos_token_id], tokenizer.pad_token_id, seed)
    return drawn.sample_dicts(prompts, 0)


def test_an_int_seed_samples_exactly_as_before(tiny) -> None:
    _, _, prompts = tiny
    batch = [*prompts, prompts[0]]
    # Recorded with the committed sampler before per-prompt seeds existed (63b715c): the int path is unchanged.
    assert [s["response_ids"] for s in run(tiny, batch, HOT, 1234)] == [
        [25, 19, 21, 27, 22, 314, 20, 24, 18, 27],
        [2],
        [24, 201, 20, 24, 19, 20, 25, 22, 2],
        [21, 2],
    ]


def test_each_row_samples_what_it_samples_alone_with_its_seed(tiny) -> None:
    _, _, prompts = tiny
    batch, seeds = [*prompts, prompts[0]], [11, 22, 33, 44]  # the last row: the first prompt again, another seed
    hot = run(tiny, batch, HOT, seeds)
    for prompt, seed, row in zip(batch, seeds, hot):
        (alone,) = run(tiny, [prompt], HOT, [seed])
        assert row["response_ids"] == alone["response_ids"] and row["truncated"] == alone["truncated"]
        torch.testing.assert_close(row["response_logprobs"], alone["response_logprobs"], rtol=0, atol=1e-5)
    (alone_int,) = run(tiny, [batch[2]], HOT, seeds[2])  # one row: [s] and s are the same draw
    assert alone_int["response_ids"] == hot[2]["response_ids"]
    assert hot[0]["response_ids"] != hot[3]["response_ids"]  # the same prompt with another seed: another draw
    assert [s["response_ids"] for s in run(tiny, batch[::-1], HOT, seeds[::-1])] == [s["response_ids"] for s in hot][::-1]
    with pytest.raises(ValueError, match="3 seeds for 4 prompts"):
        run(tiny, batch, HOT, seeds[:3])


def test_the_per_row_draw_is_torch_multinomial_row_by_row() -> None:
    torch.manual_seed(0)
    probs = torch.softmax(3 * torch.randn(5, 315), dim=-1)
    seeds = [3, 1, 4, 1, 5]
    expected = [int(torch.multinomial(probs[i : i + 1], 1, generator=torch.Generator().manual_seed(s))) for i, s in enumerate(seeds)]
    assert draw_per_row(probs, [torch.Generator().manual_seed(s) for s in seeds]).tolist() == expected


def test_row_noise_draws_what_a_call_per_step_draws() -> None:
    """The sampler draws each row's race noise a block of steps at a time: step t's values must be those one
    ``exponential_`` call per step gives (then every seeded draw is what it was), across blocks and a last short one,
    and the large-vocabulary path draws the same uniforms from the same generators."""
    seeds, vocab, steps = [3, 1, 4], 315, 37  # blocks of 16, 16 and 5 steps
    noise = RowNoise([torch.Generator().manual_seed(s) for s in seeds], steps)
    per_step = [torch.Generator().manual_seed(s) for s in seeds]
    probs = torch.full((len(seeds), vocab), 1.0 / vocab)
    for _ in range(steps):
        expected = torch.empty(len(seeds), vocab)
        for row, generator in zip(expected, per_step):
            row.exponential_(generator=generator)
        assert torch.equal(noise.next(probs), expected)
    assert noise._noise.shape[1] == 5  # the last block stopped at the call's last step
    logits = torch.randn(len(seeds), RACE_MAX_VOCAB + 10, generator=torch.Generator().manual_seed(0))
    dist = SamplingDistribution(1.0, None, 1.0)
    wrapped = draw(logits, dist, False, RowNoise([torch.Generator().manual_seed(s) for s in seeds], 4))[0]
    assert torch.equal(wrapped, draw(logits, dist, False, [torch.Generator().manual_seed(s) for s in seeds])[0])


def test_a_rows_uniform_is_its_own_generators_draw_alone() -> None:
    seeds = [3, 1, 4, 1, 5]
    cpu = torch.device("cpu")
    batch = uniforms([torch.Generator().manual_seed(s) for s in seeds], len(seeds), cpu)
    alone = torch.cat([uniforms(torch.Generator().manual_seed(s), 1, cpu) for s in seeds])
    assert torch.equal(batch, alone) and batch.dtype == torch.float64
    assert batch[1] == batch[3] and len(set(batch.flatten().tolist())) == 4  # equal seeds, equal draws; others differ


def test_a_large_vocabulary_row_draws_what_it_draws_alone_and_one_seed_in_a_list_is_that_int_seed() -> None:
    logits = 2 * torch.randn(4, RACE_MAX_VOCAB + 1000, generator=torch.Generator().manual_seed(0))  # inverse-CDF draws
    dist, seeds = SamplingDistribution(1.0, None, 1.0), [7, 8, 9, 7]
    batch, batch_logprobs = draw(logits, dist, False, [torch.Generator().manual_seed(s) for s in seeds])
    u = uniforms([torch.Generator().manual_seed(s) for s in seeds], len(seeds), torch.device("cpu"))
    assert torch.equal(batch, inverse_cdf_tokens(torch.log_softmax(logits, dim=-1).exp(), u))  # not the race
    for i, seed in enumerate(seeds):
        alone, alone_logprob = draw(logits[i : i + 1], dist, False, [torch.Generator().manual_seed(seed)])
        assert alone.item() == batch[i].item() and torch.allclose(alone_logprob, batch_logprobs[i : i + 1])
    as_int, _ = draw(logits[:1], dist, False, torch.Generator().manual_seed(7))
    assert as_int.item() == batch[0].item()
    assert len(set(batch.tolist())) > 1


def test_seed_lists_follow_their_prompts_through_chunks_and_shards(tiny) -> None:
    assert prompt_seeds(7, 3) == [7, 8, 9] and prompt_seeds([5, 1], 2) == [5, 1]
    assert chunk_seeds(7, 4, 8) == 11 and chunk_seeds([1, 2, 3, 4], 2, 4) == [3, 4]
    with pytest.raises(ValueError, match="one per prompt"):
        prompt_seeds([1, 2], 3)
    model, tokenizer, prompts = tiny
    worker = HFGenerationWorker(0, 1, MODEL, "float32", 1, tokenizer.pad_token_id, [tokenizer.eos_token_id], max_batch_size=2)
    fields = {"max_new_tokens": 10, "temperature": 3.0, "top_k": 50, "top_p": 0.95}
    chunked = worker.generate(prompts, fields, [11, 22, 33])  # chunks of 2 and 1: each keeps its prompts' seeds
    expected = [s["response_ids"] for s in run(tiny, prompts, HOT, [11, 22, 33])]
    assert [s["response_ids"] for s in chunked] == expected
    # The inline engine (the policy's own worker samples): the same seeds, the same draws; an int seed as before.
    policy = PolicyWorker(
        rank=0, world_size=1, model_name=MODEL, precision="float32", temperature=1.0, num_threads=1, seed=0,
        loss_fn=ClippedPGLossFn(ClippedPGLossConfig()), optimizer=OptimizerConfig(), max_grad_norm=None, train_micro_batch_size=4,
    )  # fmt: skip
    inline = policy.generate(prompts, fields, [11, 22, 33], tokenizer.pad_token_id, [tokenizer.eos_token_id])
    assert [s["response_ids"] for s in inline] == expected and InlineGeneration.PER_PROMPT_SEEDS
    by_int = policy.generate(prompts, fields, 7, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    assert [s["response_ids"] for s in by_int] == [s["response_ids"] for s in run(tiny, prompts, HOT, 7)]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="generate builds vLLM's request objects")
def test_vllm_requests_are_seeded_with_the_per_prompt_seeds() -> None:
    from nemo_like.models.generation.vllm_worker import VLLMGenerationWorker

    class Engine:  # records the requests' seeds and finishes none (the worker then refuses the call)
        def __init__(self) -> None:
            self.seeds, self.llm_engine = [], self

        def enqueue(self, requests, params, **kwargs) -> None:
            self.seeds.append([p.seed for p in params])

        def has_unfinished_requests(self) -> bool:
            return False

    engine = Engine()

    class Worker(VLLMGenerationWorker):
        def _start_engine(self, *args):
            return engine

    worker = Worker(0, 1, MODEL, "float32", 64, 0, pad_token_id=0, eos_token_ids=[1])
    for seed in (5, [9, 4, 7]):
        with pytest.raises(RuntimeError, match="finished 0 requests for 3 prompts"):
            worker.generate([[5, 6], [7], [8, 9]], {"max_new_tokens": 4}, seed)
    assert engine.seeds == [[5, 6, 7], [9, 4, 7]]  # an int: request i seeded seed + i (as before); a list: its own


def test_an_hf_engine_call_runs_on_the_engines_thread_count_in_whatever_thread_calls_it() -> None:
    """torch's thread count is per calling thread: a kept threaded engine (max_concurrency 2, re-initialised with a
    new count in one of Ray's threads) ran calls in its other thread on the last run's count."""
    import threading

    tok = load_tokenizer(MODEL)
    worker = HFGenerationWorker(0, 1, MODEL, "float32", 1, tok.pad_token_id, [tok.eos_token_id])
    seen = []

    def call() -> None:
        torch.set_num_threads(2)  # this thread's count from an earlier run
        worker.generate([[5, 6, 7]], asdict(SamplingParams(max_new_tokens=2)), 0)
        seen.append(torch.get_num_threads())

    caller = threading.Thread(target=call)
    caller.start()
    caller.join(60)
    assert seen == [1]
