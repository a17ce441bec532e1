"""Multi-turn rollouts with the real tiny model, tokenizer and HF generation worker, in-process (no Ray).

Token exactness is checked against what the engine actually returned (every generate call is recorded)
and against hand-written Qwen template text; logprob alignment against a fresh forward pass."""

from __future__ import annotations

import copy
import json
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from custom_envs import CountdownEnv

from nemo_like.config.errors import ConfigError
from nemo_like.config.schema import EMBEDDED_MODEL, MasterConfig
from nemo_like.data.collate import collate_samples
from nemo_like.data.prompts import PromptRecord, build_prompt_dataset
from nemo_like.environments.arithmetic import ArithmeticEnvironment
from nemo_like.environments.interface import FINAL_TURN, RESERVED_STEP_METRICS, EnvironmentStep
from nemo_like.environments.tools.environment import ToolEnvironment
from nemo_like.environments.worker import check_step
from nemo_like.experience.multi_turn import (
    TurnEnds,
    apply_stop_strings,
    continuation,
    episode_totals,
    local_stepper,
    multi_turn_metrics,
    rewriting_template_warning,
    run_multi_turn,
    stop_string_cut,
    template_warnings,
    trimming_template_warning,
    turn_ends,
    writes_back,
)
from nemo_like.experience.replay_buffer import ReplayBuffer, ReplayBufferError, TrajectoryGroup
from nemo_like.experience.rollouts import Rollout
from nemo_like.models.generation.hf_worker import HFGenerationWorker
from nemo_like.models.generation.interface import GeneratedSample, SamplingParams, StopStringWatch
from nemo_like.models.loading import decode_exact, load_causal_lm, load_tokenizer, render_chat, resolve_model_path
from nemo_like.models.logprobs import SamplingDistribution, processed_token_logprobs
from nemo_like.plan.multi_turn import MultiTurnSettings, multi_turn_settings
from nemo_like.serving.trajectory import CallRecord, unsampled_positions

EOS = 2  # <|im_end|> of the tiny model's Qwen-style template
SHORTEST_OBSERVATION = 4  # what the template appends after a turn's <|im_end|> with no message: "\n<|im_start|>assistant\n"


#: Qwen3's rule for reasoning: an assistant turn keeps the <think> block it wrote until a user message follows it.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}{%- for m in messages -%}{%- if m['role'] == 'user' -%}"
    "{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}{%- for m in messages -%}"
    "{%- set c = m['content'] -%}{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in c -%}"
    "{%- set c = c.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EMBEDDED_MODEL)


@pytest.fixture(scope="module")
def worker(tokenizer):
    return HFGenerationWorker(0, 1, EMBEDDED_MODEL, "float32", 1, tokenizer.pad_token_id, [tokenizer.eos_token_id])


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Eight samples whose Countdown episodes last 1, 2 or 3 turns (``1 + answer % 3``)."""
    records = build_prompt_dataset(MasterConfig().data, tokenizer, "train", 100)[:40]
    by_length = [[r for r in records if r.metadata["answer"] % 3 == k] for k in range(3)]
    return by_length[0][:2] + by_length[1][:3] + by_length[2][:3]


class RecordingGeneration:
    """The real HF worker behind the GenerationInterface; records every call's inputs and outputs.
    ``refit_after_calls``: bump the weight version (same weights) after that many calls (in-flight-like)."""

    def __init__(self, worker, refit_after_calls: int | None = None) -> None:
        self.worker, self.calls, self.refit_after_calls = worker, [], refit_after_calls
        self.worker.weight_version = 0
        self.weight_version = 0

    def generate(self, prompts, params, seed):
        out = [GeneratedSample(**d) for d in self.worker.generate(prompts, asdict(params), seed)]
        self.calls.append((copy.deepcopy(prompts), copy.deepcopy(out), params))
        if self.refit_after_calls is not None and len(self.calls) == self.refit_after_calls:
            self.worker.weight_version += 1
        return out


def run(worker, tokenizer, prompts, env, max_turns=3, max_total=128, max_new_tokens=6, seed=7, generation=None):
    generation = generation or RecordingGeneration(worker)
    settings = MultiTurnSettings(max_turns, max_total, (tokenizer.eos_token_id,))
    result = run_multi_turn(
        generation, local_stepper({"arithmetic": env}), tokenizer, prompts, SamplingParams(max_new_tokens=max_new_tokens), seed, settings
    )
    return result, generation


def sampled_turns(generation: RecordingGeneration, prompt_ids: list[int]) -> list[tuple[list[int], GeneratedSample]]:
    """Every (input, output) the engine produced for inputs that start with ``prompt_ids``."""
    return [(p, s) for inputs, outs, _ in generation.calls for p, s in zip(inputs, outs) if p[: len(prompt_ids)] == prompt_ids]


@pytest.fixture(scope="module")
def three_turns(worker, tokenizer, prompts):
    return run(worker, tokenizer, prompts, CountdownEnv(turns=3))


def test_every_trained_sample_is_prompt_plus_sampled_plus_observation_ids(tokenizer, prompts, three_turns):
    result, generation = three_turns
    samples = result.samples
    assert {s.num_turns for s in samples} >= {1, 2, 3}  # the data gives every episode length
    batch = collate_samples(samples, tokenizer.pad_token_id)
    model = load_causal_lm(EMBEDDED_MODEL).eval()
    for row, (sample, prompt) in enumerate(zip(samples, prompts)):
        # Walk the sequence turn by turn: each turn's input is the sequence so far (token in), its sampled
        # ids are appended unchanged (token out), then the observation's ids as the template writes them.
        expected, mask, logprobs = list(prompt.prompt_token_ids), [], []
        for turn in range(sample.num_turns):
            matches = [(p, s) for p, s in sampled_turns(generation, prompt.prompt_token_ids) if p == expected]
            assert matches, f"sample {row} turn {turn}: no generate call saw the sequence so far"
            out = matches[0][1]
            if turn < sample.num_turns - 1 or not sample.truncated:  # each finished assistant turn ends with end-of-turn
                assert out.response_ids[-1] == EOS and not out.truncated
            expected += out.response_ids
            mask += [1] * len(out.response_ids)
            logprobs += out.response_logprobs
            if turn < sample.num_turns - 1:
                remaining = 1 + prompt.metadata["answer"] % 3 - (turn + 1)
                obs_text = f"\n<|im_start|>tool\n{remaining} left<|im_end|>\n<|im_start|>assistant\n"  # hand-written Qwen markers
                obs_ids = tokenizer(obs_text, add_special_tokens=False)["input_ids"]
                expected += obs_ids
                mask += [0] * len(obs_ids)
                logprobs += [0.0] * len(obs_ids)
        p = len(prompt.prompt_token_ids)
        assert sample.prompt_ids + sample.response_ids == expected
        assert sample.response_mask == mask and sample.response_logprobs == logprobs
        n = len(expected)
        assert batch["input_ids"][row, :n].tolist() == expected
        assert batch["token_mask"][row, :n].tolist() == [0.0] * p + [float(m) for m in mask]
        assert batch["token_mask"][row, n:].sum() == 0
        eos_positions = [p + i for i, t in enumerate(sample.response_ids) if t == EOS and mask[i]]
        assert len(eos_positions) == sample.num_turns - sample.truncated and all(batch["token_mask"][row, i] == 1 for i in eos_positions)
        # The generation logprobs line up with the sampled tokens: a fresh forward pass over the whole
        # multi-turn sequence gives the same value at every sampled position.
        with torch.no_grad():
            logits = model(torch.tensor([expected])).logits[:, :-1]
        fresh = processed_token_logprobs(logits, torch.tensor([expected[1:]]), SamplingDistribution())[0]
        sampled = torch.tensor(mask, dtype=torch.bool)
        torch.testing.assert_close(batch["generation_logprobs"][row, p:n][sampled], fresh[p - 1 : n - 1][sampled], atol=2e-4, rtol=0)
        assert torch.all(batch["generation_logprobs"][row, p:n][~sampled] == 0)
    # The environment saw each turn's text (no end-of-turn token) and rewarded the final one.
    turns = [s.messages for s in samples]
    assert all(m["role"] in ("assistant", "tool") and "<|im_end|>" not in m["content"] for t in turns for m in t)
    assert result.env_metrics == {"env/arithmetic/steps": float(sum(s.num_turns for s in samples))}
    assert sum(s.num_turns > 1 and not s.truncated for s in samples) >= 3
    metrics = multi_turn_metrics(samples, result.rewards)
    assert metrics["multi_turn/turns_per_sample_max"] == 3.0
    assert metrics["multi_turn/turns_per_sample_mean"] == sum(s.num_turns for s in samples) / len(samples)
    # Per-sample step metrics: one "observations" per non-final step of the episode (1 + answer % 3 steps long).
    observations = [float(min(s.num_turns, p.metadata["answer"] % 3)) for s, p in zip(samples, prompts)]
    assert [(s.step_metrics or {}).get("observations", 0.0) for s in samples] == observations
    assert metrics["multi_turn/observations_per_sample"] == pytest.approx(sum(observations) / len(samples))
    assert metrics["multi_turn/observations_sample_fraction"] == sum(o > 0 for o in observations) / len(samples)
    for k in (1, 2, 3):
        with_k = [r for s, r in zip(samples, result.rewards.tolist()) if s.num_turns == k]
        assert metrics[f"multi_turn/reward_turns_{k}"] == pytest.approx(sum(with_k) / len(with_k))
        assert metrics[f"multi_turn/fraction_turns_{k}"] == len(with_k) / len(samples)
    # observation tokens: the response's tokens the policy did not sample (mask 0), here > 0
    observed = sum(s.response_mask.count(0) for s in samples) / len(samples)
    assert observed > 0 and metrics["multi_turn/observation_tokens_per_sample"] == pytest.approx(observed)


def test_each_turn_is_a_prefix_of_the_next_and_one_turn_is_the_single_turn_rollout(worker, tokenizer, prompts, three_turns):
    runs = {2: run(worker, tokenizer, prompts, CountdownEnv(turns=3), max_turns=2)[0], 3: three_turns[0]}
    # One turn of a single-turn environment (default step) = today's rollout.
    arithmetic = ArithmeticEnvironment()
    runs[1] = run(worker, tokenizer, prompts, arithmetic, max_turns=1)[0]
    for k in (1, 2):
        for short, long in zip(runs[k].samples, runs[k + 1].samples):
            ids_k, ids_next = short.prompt_ids + short.response_ids, long.prompt_ids + long.response_ids
            assert ids_next[: len(ids_k)] == ids_k
            assert long.response_mask[: len(short.response_mask)] == short.response_mask
    # One turn = today's single-turn rollout: the same sampled ids and the environment's score() as reward.
    single = [GeneratedSample(**d) for d in worker.generate([p.prompt_token_ids for p in prompts], asdict(SamplingParams(6)), 7)]
    assert [s.response_ids for s in runs[1].samples] == [s.response_ids for s in single]
    texts = tokenizer.batch_decode([s.response_ids for s in single], skip_special_tokens=True)
    assert runs[1].rewards.tolist() == arithmetic.score(texts, [p.metadata for p in prompts])


def assert_rows_trained_as_sampled(result, calls: list[tuple[list[int], GeneratedSample]]) -> None:
    """Every row masks in only tokens sampled in exactly that context, with their logprobs (the rollout server's check,
    ``unsampled_positions``), every token the engine returned is masked in exactly once, and an episode's rows are
    adjacent and share its reward."""
    records = [CallRecord(tuple(p), tuple(s.response_ids), tuple(s.response_logprobs), 0, 0) for p, s in calls]
    logprobs = {r.full_ids: r.logprobs for r in records}
    for sample in result.samples:
        ids, mask = sample.prompt_ids + sample.response_ids, [0] * len(sample.prompt_ids) + sample.sampled_mask
        assert unsampled_positions(ids, mask, records) == []
        ends = [i + 1 for i, m in enumerate(mask) if m and (i + 1 == len(mask) or not mask[i + 1])]  # each turn's end
        trained = [lp for lp, m in zip(sample.response_logprobs, sample.sampled_mask) if m]
        assert trained == [lp for end in ends for lp in logprobs[tuple(ids[:end])]]
    assert sum(s.num_sampled_tokens for s in result.samples) == sum(len(s.response_ids) for _, s in calls)
    owners = result.session_of_row
    assert owners == sorted(owners) and len(owners) == len(result.samples)
    for owner in set(owners):
        assert len({result.rewards[i].item() for i, o in enumerate(owners) if o == owner}) == 1


def assert_branches_restart_from_the_rendering(result, tokenizer, prompts) -> None:
    """A branched episode's later row's prompt is the template's whole rendering of the conversation up to the
    observation that followed the earlier row's last turn (masked out), as the rollout server feeds it: where the
    rendering keeps the earlier row up to its last turn (a trimmed turn, a foreign end), its ids as sampled (the
    server reuses them; tokenised afresh, a turn sampled in a non-canonical split lost its ids), else tokenised whole."""
    owners = result.session_of_row
    for i in range(1, len(owners)):
        if owners[i] != owners[i - 1]:
            continue
        before, row, prompt = result.samples[i - 1], result.samples[i], prompts[owners[i]]
        history = [*prompt.messages, *row.messages[: len(before.messages) + 1]]  # the observation that branched it
        rendering = render_chat(tokenizer, history, tools=prompt.tools, add_generation_prompt=True)
        assert decode_exact(tokenizer, row.prompt_ids) == rendering
        mask = [0] * len(before.prompt_ids) + before.sampled_mask
        last_turn = max(j for j, m in enumerate(mask) if m and not mask[j - 1])
        kept = (before.prompt_ids + before.response_ids)[:last_turn]
        if rendering.startswith(decode_exact(tokenizer, kept)):
            assert row.prompt_ids[: len(kept)] == kept
        else:
            assert row.prompt_ids == tokenizer(rendering, add_special_tokens=False)["input_ids"]


def test_a_template_that_rewrites_earlier_turns_branches_each_episode_into_rows_trained_as_sampled(worker, tokenizer, prompts):
    """Like Qwen3's and DeepSeek-R1's templates, which drop earlier turns' reasoning: assistant turns before the last
    one render empty, so no observation can extend the sequence. Each such turn branches its episode (it stopped the
    run): a new row whose prompt is the whole rendering, the earlier turns' sampled ids trained in the rows they were
    sampled in, the episode's turns and reward unchanged (the real tiny model and HF worker, every call recorded)."""
    rewriting = copy.deepcopy(tokenizer)
    rewriting.chat_template = (
        "{% for message in messages %}{% if message['role'] == 'assistant' and not loop.last %}"
        "{{ '<|im_start|>assistant\n<|im_end|>\n' }}{% else %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    assert "template_rewrite" in rewriting_template_warning(rewriting)
    result, generation = run(worker, rewriting, prompts, CountdownEnv(turns=3), max_turns=3)
    assert_rows_trained_as_sampled(result, [(p, s) for inputs, outs, _ in generation.calls for p, s in zip(inputs, outs)])
    assert_branches_restart_from_the_rendering(result, rewriting, prompts)
    episodes = episode_totals(result.samples, result.rewards, result.session_of_row)
    assert len(episodes) == len(prompts) and max(e.rows for e in episodes) == 3  # the data has three-turn episodes
    # An episode branches after every turn the environment answers whose rendering the template changed (not an empty
    # one, which renders as it was): one row more each.
    last_rows = dict(zip(result.session_of_row, result.samples)).values()  # each episode's last row: all its messages
    rewritten = [sum(1 for m in row.messages[:-1] if m["role"] == "assistant" and m["content"]) for row in last_rows]
    assert [e.rows - 1 for e in episodes] == rewritten == [e.step_metrics.get("template_rewrite", 0) for e in episodes]
    assert sum(rewritten) >= len(prompts)
    metrics = multi_turn_metrics(result.samples, result.rewards, session_of_row=result.session_of_row)
    assert metrics["multi_turn/rows_per_sample"] == pytest.approx(sum(e.rows for e in episodes) / len(prompts))
    assert metrics["multi_turn/turns_per_sample_max"] == 3.0


def test_a_turn_ended_on_an_end_token_the_template_does_not_write_branches_its_episode(tokenizer, prompts):
    """<|endoftext|> as an end-of-turn id beside <|im_end|> (Qwen2.5-Instruct's generation_config; a base model's eos):
    the template writes the turn back with <|im_end|>, so the next observation cannot extend the sequence (two-turn
    episodes here). The episode goes on in a new row, counted (it raised TemplateRewriteError for the whole rollout, then
    ended the episode); a turn ended on <|im_end|> goes on in its row."""
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert eot != EOS
    calls = []

    class Scripted:
        weight_version = 0

        def generate(self, batch, params, seed):  # the first sample's turns end on <|endoftext|>, the others' on <|im_end|>
            out = [GeneratedSample(list(q), [11, 12, eot if i == 0 else EOS], [-0.1, -0.2, -0.3], False, 0) for i, q in enumerate(batch)]
            calls.extend(zip(batch, out))
            return out

    settings = MultiTurnSettings(2, 128, (EOS, eot))
    rows = prompts[2:5]
    result = run_multi_turn(
        Scripted(), local_stepper({"arithmetic": CountdownEnv(turns=3)}), tokenizer, rows, SamplingParams(max_new_tokens=4), 0, settings
    )
    turns = [sum(1 for a, b in zip([0, *s.response_mask], s.response_mask) if b and not a) for s in result.samples]
    assert result.session_of_row == [0, 0, 1, 2] and turns == [1, 1, 2, 2] == [s.num_turns for s in result.samples]
    assert_rows_trained_as_sampled(result, calls)
    assert_branches_restart_from_the_rendering(result, tokenizer, rows)
    metrics = multi_turn_metrics(result.samples, result.rewards, session_of_row=result.session_of_row)
    assert metrics["multi_turn/foreign_end_of_turn_sample_fraction"] == 1 / 3 and metrics["multi_turn/rows_per_sample"] == 4 / 3
    # The branched episode's observation counts too (it read 0: the observation is in its new row's prompt): its
    # content's tokens (its role markers are in an unbranched row's count, not in a branch's)
    branched, unbranched, _ = episode_totals(result.samples, result.rewards, result.session_of_row)
    content = len(tokenizer("1 left", add_special_tokens=False)["input_ids"])
    assert branched.observation_tokens == content and unbranched.observation_tokens > content


def test_a_full_row_whose_reply_would_branch_into_a_row_with_room_is_not_the_final_turn(tokenizer):
    """A long reasoning turn leaves no room in its row for even the shortest continuation, but a user's reply makes a
    Qwen3-style template drop that reasoning and start a new, short row: the environment was told the turn was final
    and the episode ended length-truncated with no reward; it goes on in the new row. A tool's reply keeps the
    reasoning (it follows the last user message), so for an environment that replies as a tool the full row stays
    final (probing a user's reply there had run its tool for an observation dropped for length)."""
    from nemo_like.plan.multi_turn import ANY_REPLY_ROLES

    think = copy.deepcopy(tokenizer)  # Qwen3's rule: a turn keeps its <think> block until a user message follows it
    think.chat_template = QWEN3_TEMPLATE
    encode = lambda text: think(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    long_turn = encode("<think>\n" + "9 " * 60 + "</think>\n\n7") + [EOS]
    cases = (("user", ("user",), False), ("tool", ("tool",), True), ("tool", ANY_REPLY_ROLES, False))
    for role, reply_roles, final in cases:
        prompt = chat_prompt(think, "What is 3 + 4?", {"answer": 7, "task_name": "arithmetic"})  # two turns
        told_final: list[list[bool]] = []
        step_countdown = local_stepper({"arithmetic": CountdownEnv(turns=3, observation_role=role)})

        def stepper(prompts, message_logs, metadata, step=step_countdown, told=told_final):
            told.append([m[FINAL_TURN] for m in metadata])
            return step(prompts, message_logs, metadata)

        limit = len(prompt.prompt_token_ids) + len(long_turn) + 3  # the row: 3 tokens left, under the shortest 4
        settings = MultiTurnSettings(3, limit, (EOS,), reply_roles=(("arithmetic", reply_roles),))
        result = run_multi_turn(
            ScriptedTurns([long_turn, encode("7") + [EOS]]), stepper, think, [prompt], SamplingParams(max_new_tokens=256), 0, settings
        )
        assert told_final[0] == [final], (role, reply_roles)
        rows = 1 if role == "tool" else 2
        assert len(result.samples) == rows and result.samples[-1].length_truncated == (role == "tool")
        assert result.rewards.tolist() == [0.0 if role == "tool" else 1.0] * rows
        # told "not final" though its reply could not fit: the observation was built for nothing, and counted
        dropped = (result.samples[-1].step_metrics or {}).get("observation_dropped_for_length", 0.0)
        assert dropped == (1.0 if role == "tool" and not final else 0.0)


class ScriptedTurns:
    """Hands out fixed turns in order, one per row per call (logprobs -0.1 each)."""

    weight_version = 0

    def __init__(self, turns: list[list[int]]) -> None:
        self.turns, self.calls = list(turns), []

    def generate(self, batch, params, seed):
        out = [GeneratedSample(list(q), (ids := self.turns.pop(0)), [-0.1] * len(ids), False, 0) for q in batch]
        self.calls.extend(zip(batch, out))
        return out


def sentencepiece_tokenizer(legacy: bool, special_tokens: list[str], chat_template: str):
    """The SentencePiece (Llama-type) fixture tokenizer with ``special_tokens`` added and ``chat_template``."""
    from transformers import LlamaTokenizerFast

    fixture = Path(__file__).parents[2] / "fixtures" / "tiny_sentencepiece"
    sp = LlamaTokenizerFast.from_pretrained(
        fixture, add_bos_token=False, legacy=legacy, pad_token="<pad>", additional_special_tokens=special_tokens
    )
    sp.chat_template = chat_template
    return sp


def chat_prompt(tokenizer, content: str, metadata: dict, prompt_id: str = "p0") -> PromptRecord:
    messages = [{"role": "user", "content": content}]
    ids = tokenizer(render_chat(tokenizer, messages, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    return PromptRecord(id=prompt_id, messages=messages, prompt_token_ids=ids, metadata=metadata)


def test_a_recipe_stop_id_stays_in_the_message_unless_the_template_writes_it_back():
    """policy.generation.stop_token_ids=[</tool_call>] (stop at a call's end): the id is the call's closing tag, so the
    message keeps it and the tool runs (it was taken for an end-of-turn token: the tool read an unclosed call and the
    episode ended as a foreign end, reward 0). <|im_end|> as a stop id beside a base tokenizer's <|endoftext|> eos is the
    turn's end the template writes back: left out of the message, as before."""
    tool_tokenizer = load_tokenizer("embedded:tiny-tool-qwen2")
    encode = lambda text: tool_tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    close, im_end = tool_tokenizer.convert_tokens_to_ids(["</tool_call>", "<|im_end|>"])
    eot = tool_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "347*28"}}</tool_call>'
    assert encode(call)[-1] == close
    cfg = MasterConfig.model_validate({"grpo": {"max_rollout_turns": 3}, "policy": {"generation": {"stop_token_ids": [close, im_end]}}})
    settings = multi_turn_settings(cfg, (eot,))
    assert settings.recipe_stop_ids == (close, im_end) and settings.eos_token_ids == (eot, close, im_end)
    prompt = chat_prompt(tool_tokenizer, "What is 347 times 28?", {"answer": "9716", "task_name": "tool"})
    generation = ScriptedTurns([encode(call), encode("9716") + [im_end]])
    result = run_multi_turn(
        generation, local_stepper({"tool": ToolEnvironment()}), tool_tokenizer, [prompt], SamplingParams(max_new_tokens=40), 0, settings
    )
    (sample,) = result.samples
    assert [m["content"] for m in sample.messages if m["role"] == "assistant"] == [call, "9716"]
    assert turn_ends(tool_tokenizer, settings) == TurnEnds(removed=frozenset({eot, im_end}), foreign=frozenset({eot}))
    # A tag that opens the next turn is no turn's end (Phi-3 lists <|assistant|> among its eos ids): counting its text
    # anywhere in the rendering took it for one, and a turn ended on it failed the whole rollout.
    im_start = tool_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert writes_back(tool_tokenizer, im_end) and not writes_back(tool_tokenizer, im_start)
    assert result.rewards.tolist() == [1.0] and sample.num_turns == 2
    assert sample.step_metrics.get("tool_errors") == 0.0 and "foreign_end_of_turn" not in sample.step_metrics
    assert sample.response_ids[-1] == im_end and sample.response_mask[-1] == 1  # the sampled end, trained


#: The tiny tool model's ChatML template, with a system turn listing the tools first when given some (as Qwen 2.5's does).
TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools:' }}{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}"
    "{{ '<|im_end|>' }}{% endif %}" + load_tokenizer("embedded:tiny-tool-qwen2").chat_template
)


def test_a_prompts_tools_are_in_its_rendering_and_in_every_later_turns():
    """A tool task's prompts are rendered with the environment's tool schemas (env.<task>.tools_in_prompt), so a template
    that lists tools shows them to the model; each observation is cut from a rendering of the whole conversation, which
    must list them again (without, the prompt's own ids were not the template's rendering: the rollout refused it)."""
    tool_tokenizer = load_tokenizer("embedded:tiny-tool-qwen2")
    tool_tokenizer.chat_template = TOOLS_TEMPLATE
    encode = lambda text: tool_tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    schemas = ToolEnvironment.prompt_tools({"tools": ["calculator"]})
    data = MasterConfig.model_validate({"data": {"dataset_name": "tool-arith"}}).data
    records = build_prompt_dataset(data, tool_tokenizer, "train", 1000, lambda task: schemas if task == "tool" else None)[:1]
    (record,) = records
    assert record.tools == schemas and record.metadata["task_name"] == "tool"
    text = tool_tokenizer.decode(record.prompt_token_ids)
    assert text.startswith("<|im_start|>system\nTools:\n{") and '"name": "calculator"' in text and '"expression"' in text
    # what the model reads of each argument: the tool's own docstring
    assert "The expression to evaluate" in text
    operands = [int(x) for x in re.findall(r"\d+", record.messages[-1]["content"])[:2]]
    call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{operands[0]}*{operands[1]}"}}}}</tool_call>'
    im_end = tool_tokenizer.convert_tokens_to_ids("<|im_end|>")
    generation = ScriptedTurns([encode(call) + [im_end], encode(str(record.metadata["answer"])) + [im_end]])
    settings = MultiTurnSettings(2, 1000, (im_end,))
    result = run_multi_turn(
        generation, local_stepper({"tool": ToolEnvironment()}), tool_tokenizer, records, SamplingParams(max_new_tokens=40), 0, settings
    )
    (sample,) = result.samples
    assert result.rewards.tolist() == [1.0] and sample.num_turns == 2
    conversation = record.messages + sample.messages
    whole = render_chat(tool_tokenizer, conversation, tools=schemas)
    assert tool_tokenizer.decode(sample.prompt_ids + sample.response_ids) == whole  # the template's own rendering, tools and all


def test_a_runs_prompts_list_its_tool_environments_tools_and_a_template_that_cannot_is_warned_about(tmp_path, capsys):
    """training_data (what a run and its validation load): the tool task's prompts carry the schemas the template
    rendered; a template that renders no tools leaves the prompts as they were and says the model sees none."""
    from nemo_like.algorithms.setup import training_data
    from nemo_like.config import load_config

    recipe = Path(__file__).parents[3] / "examples" / "configs" / "grpo_multiturn_tiny_cpu.yaml"
    tool_tokenizer = load_tokenizer("embedded:tiny-tool-qwen2")
    tool_tokenizer.chat_template = TOOLS_TEMPLATE
    tool_tokenizer.save_pretrained(tmp_path / "tok")
    with pytest.raises(ConfigError, match=r"has \d+ tokens \(with the tool list its template renders: env.tool.tools_in_prompt\)"):
        training_data(load_config(recipe, ["env.tool.tools_in_prompt=true", f"policy.tokenizer_name={tmp_path / 'tok'}"]))
    # the tool list does not fit the shipped model's 256 positions: the same model, configured with 1024
    model = tmp_path / "model"
    shutil.copytree(resolve_model_path("embedded:tiny-tool-qwen2"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    common = [f"policy.model_name={model}", "policy.max_total_sequence_length=1024", "grpo.max_val_samples=4"]
    listed = training_data(load_config(recipe, [*common, "env.tool.tools_in_prompt=true", f"policy.tokenizer_name={tmp_path / 'tok'}"]))
    schemas = ToolEnvironment.prompt_tools({"tools": ["calculator"]})
    for record in (listed.train[0], listed.val[0]):
        assert record.tools == schemas and '"name": "calculator"' in listed.tokenizer.decode(record.prompt_token_ids)
    assert "does not render tools" not in capsys.readouterr().err
    shipped = training_data(load_config(recipe, common))  # tools_in_prompt: false
    unlisted = training_data(load_config(recipe, [*common, "env.tool.tools_in_prompt=true"]))
    err = capsys.readouterr().err
    assert err.count("[config] warning: env.tool: the chat template of") == 1 and "does not render tools" in err
    assert shipped.train[0].tools is None and unlisted.train[0].tools == schemas
    assert [r.prompt_token_ids for r in unlisted.train] == [r.prompt_token_ids for r in shipped.train]
    # a checkpoint written without the tool lists (before they were rendered): the refusal says what changed
    with pytest.raises(ConfigError, match=r"or the tool lists rendered into them \(env.<task>.tools_in_prompt; a checkpoint"):
        listed.loader.check_resumable(shipped.loader.state_dict())
    with pytest.raises(ConfigError) as refused:  # prompts without tool lists: the data alone is blamed
        shipped.loader.check_resumable(listed.loader.state_dict())
    assert "tools_in_prompt" not in str(refused.value)


def test_a_template_that_drops_earlier_reasoning_is_named_before_the_run_starts(tokenizer):
    """A Qwen3-style template renders earlier assistant turns without their reasoning block once a user message
    follows: a multi-turn run (guess_number replies as a user) stopped at its first rollout's second turn, after every
    actor had started, with nothing said at start-up. Now such episodes branch, and the start-up line says so."""
    think = copy.deepcopy(tokenizer)
    think.chat_template = (Path(__file__).resolve().parents[2] / "fixtures" / "qwen3_style_think.jinja").read_text()
    assert "it drops the reasoning block its generation prompt opens" in rewriting_template_warning(think)
    writes = copy.deepcopy(tokenizer)  # its generation prompt opens nothing; the model's own <think> is dropped later
    writes.chat_template = think.chat_template.replace(
        "'<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' -}}{%- endif", "'<|im_start|>assistant\\n' -}}{%- endif"
    )
    assert writes.chat_template != think.chat_template
    assert "it drops a reasoning block the model writes" in rewriting_template_warning(writes)
    assert template_warnings(tokenizer) == []  # the shipped ChatML template keeps every turn as sampled
    (line,) = template_warnings(think)
    assert line.startswith("the chat template renders an earlier assistant turn or the prompt otherwise than the sequence")
    # This template drops a reasoning block the model writes whoever replies: a tool's reply is affected too (the line
    # said it was not, from the first case alone); a template that keeps the block until a user replies (Qwen3's) spares it
    assert "replying as a tool" not in line
    qwen3 = copy.deepcopy(tokenizer)
    qwen3.chat_template = QWEN3_TEMPLATE
    (spared,) = template_warnings(qwen3)
    assert "it drops a reasoning block the model writes" in spared and "an environment replying as a tool is not affected" in spared
    # What the line says is what the loop does: a user reply branches the episode (a new row whose prompt renders the
    # first turn without its empty reasoning block), a tool reply after a turn with no reasoning extends the row.
    encode = lambda text: think(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    for role, rows in (("user", 2), ("tool", 1)):
        prompt = chat_prompt(think, "What is 3 + 4?", {"answer": 7, "task_name": "arithmetic"})  # two turns
        turns = ScriptedTurns([encode("7") + [EOS], encode("7") + [EOS]])
        result = run_multi_turn(
            turns, local_stepper({"arithmetic": CountdownEnv(turns=3, observation_role=role)}), think, [prompt],
            SamplingParams(max_new_tokens=8), 0, MultiTurnSettings(3, 256, (EOS,)),
        )  # fmt: skip
        assert len(result.samples) == rows and result.rewards.tolist() == [1.0] * rows
        assert_rows_trained_as_sampled(result, turns.calls)
        assert_branches_restart_from_the_rendering(result, think, [prompt])
        assert decode_exact(think, result.samples[-1].prompt_ids + result.samples[-1].response_ids).count("<think>") == 3 - rows
    # Mistral's style moves the system message before the last user message: a prompt with one stopped the run, unwarned
    moving = copy.deepcopy(tokenizer)
    moving.chat_template = (Path(__file__).resolve().parents[2] / "fixtures" / "system_before_last_user.jinja").read_text()
    assert "it moves the system message" in rewriting_template_warning(moving)
    # a space the template adds before the content (Llama 2, Mistral v0.3) is a whitespace rewrite: the episode ends,
    # counted; it was warned of as a run that stops
    spaced = copy.deepcopy(tokenizer)
    spaced.chat_template = tokenizer.chat_template.replace("message['content']", "' ' + message['content']")
    assert spaced.chat_template != tokenizer.chat_template and rewriting_template_warning(spaced) is None


def test_a_turn_a_trimming_template_rewrites_branches_its_episode_and_the_run_warns(tokenizer, prompts):
    """Llama 3.x and Gemma templates render ``message['content'] | trim``: a turn that ends (or begins) with whitespace is
    written back without it, so the next observation cannot extend the sequence. That episode goes on in a new row,
    counted by cause (it raised TemplateRewriteError for the whole rollout, then ended the episode); the probe warns.
    So does any other rewrite (an earlier turn upper-cased, reasoning dropped), counted apart."""
    trimming = copy.deepcopy(tokenizer)
    trimming.chat_template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    assert trimming_template_warning(tokenizer) is None
    assert "template_whitespace_rewrite" in trimming_template_warning(trimming)
    encode = lambda text: trimming(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rows = [chat_prompt(trimming, "What is 3 + 4?", {"answer": 7, "task_name": "arithmetic"}, f"p{i}") for i in range(3)]
    generation = ScriptedTurns([encode("7\n") + [EOS], encode(" 7") + [EOS], encode("7") + [EOS]] + [encode("7") + [EOS]] * 3)
    step_countdown = local_stepper({"arithmetic": CountdownEnv(turns=3)})
    told_final: list[list[bool]] = []

    def stepper(prompts, message_logs, metadata):  # records what the environment was told
        told_final.append([m[FINAL_TURN] for m in metadata])
        return step_countdown(prompts, message_logs, metadata)

    result = run_multi_turn(generation, stepper, trimming, rows, SamplingParams(max_new_tokens=8), 0, MultiTurnSettings(3, 128, (EOS,)))
    assert result.session_of_row == [0, 0, 1, 1, 2] and [s.num_turns for s in result.samples] == [1, 1, 1, 1, 2]  # answer 7: two turns
    assert told_final == [[False, False, False], [False, False, False]] and result.rewards.tolist() == [1.0] * 5
    assert [s.step_metrics.get("template_whitespace_rewrite", 0.0) for s in result.samples] == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert_rows_trained_as_sampled(result, generation.calls)
    assert_branches_restart_from_the_rendering(result, trimming, rows)
    metrics = multi_turn_metrics(result.samples, result.rewards, session_of_row=result.session_of_row)
    assert metrics["multi_turn/template_whitespace_rewrite_sample_fraction"] == 2 / 3 and metrics["multi_turn/turns_per_sample_mean"] == 2
    # The branch keeps the turns before the rewritten one as sampled, as the rollout server does: "What" sampled as
    # Wh + at (tokenised afresh it became What, a spelling the model did not produce, in every later turn's context)
    split = [trimming.convert_tokens_to_ids("Wh"), trimming.convert_tokens_to_ids("at")]
    assert encode("What") == [trimming.convert_tokens_to_ids("What")] != split
    three = chat_prompt(trimming, "What is 4 + 4?", {"answer": 8, "task_name": "arithmetic"})  # three turns
    spelled = ScriptedTurns([[*split, EOS], encode("8\n") + [EOS], encode("8") + [EOS]])
    kept = run_multi_turn(
        spelled, step_countdown, trimming, [three], SamplingParams(max_new_tokens=8), 0, MultiTurnSettings(3, 128, (EOS,))
    )
    assert [s.num_turns for s in kept.samples] == [2, 1] and kept.samples[1].prompt_ids[len(three.prompt_token_ids) :][:3] == [*split, EOS]
    assert_rows_trained_as_sampled(kept, spelled.calls)
    assert_branches_restart_from_the_rendering(kept, trimming, [three])
    # An episode the environment ends there anyway (answer 9: one turn) is not one the template ended: not counted.
    single = run_multi_turn(
        ScriptedTurns([encode("9\n") + [EOS]]), local_stepper({"arithmetic": CountdownEnv(turns=3)}), trimming,
        [chat_prompt(trimming, "What is 4 + 5?", {"answer": 9, "task_name": "arithmetic"})], SamplingParams(max_new_tokens=8), 0,
        MultiTurnSettings(3, 128, (EOS,)),
    )  # fmt: skip
    assert single.rewards.tolist() == [1.0] and "template_whitespace_rewrite" not in single.samples[0].step_metrics
    # A turn both trimmed and ended on a foreign end token (<|endoftext|>) branches as a foreign end.
    eot = trimming.convert_tokens_to_ids("<|endoftext|>")
    both = run_multi_turn(
        ScriptedTurns([encode("7\n") + [eot], encode("7") + [EOS], encode("7") + [EOS], encode("7") + [EOS]]),
        local_stepper({"arithmetic": CountdownEnv(turns=3)}), trimming, rows[:2], SamplingParams(max_new_tokens=8), 0,
        MultiTurnSettings(3, 128, (EOS, eot)),
    )  # fmt: skip
    assert both.session_of_row == [0, 0, 1] and [s.num_turns for s in both.samples] == [1, 1, 2]
    assert [s.step_metrics or {} for s in both.samples] == [{"foreign_end_of_turn": 1.0, "observations": 1.0}, {}, {"observations": 1.0}]
    # A template that also rewrites an earlier turn once a later one exists rewrites more than the last turn's
    # whitespace, trimmed last turn or not: counted as a template rewrite.
    rewriting = copy.deepcopy(trimming)
    rewriting.chat_template = (
        "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'assistant' %}{% set ns.last = loop.index0 %}"
        "{% endif %}{% endfor %}{% for m in messages %}{% set c = m['content'] | trim %}"
        "{% if m['role'] == 'assistant' and loop.index0 < ns.last %}{% set c = c | upper %}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    three_turns = chat_prompt(rewriting, "What is 4 + 4?", {"answer": 8, "task_name": "arithmetic"})  # 1 + 8 % 3 turns
    upper = run_multi_turn(
        ScriptedTurns([encode("eight") + [EOS], encode("eight\n") + [EOS], encode("8") + [EOS]]),
        local_stepper({"arithmetic": CountdownEnv(turns=3)}), rewriting, [three_turns], SamplingParams(max_new_tokens=8), 0,
        MultiTurnSettings(3, 128, (EOS,)),
    )  # fmt: skip
    assert [s.num_turns for s in upper.samples] == [2, 1] and upper.rewards.tolist() == [1.0, 1.0]
    assert episode_totals(upper.samples, upper.rewards, upper.session_of_row)[0].step_metrics == {
        "observations": 2.0,
        "template_rewrite": 1.0,
    }
    # A template that drops the turn's reasoning (DeepSeek-R1's split on </think>) also drops a leading newline; that
    # rewrite is more than trimming (it ended the episode as a trimmed turn): a template rewrite.
    reasoning = copy.deepcopy(trimming)
    reasoning.chat_template = (
        "{% for m in messages %}{% set c = m['content'] %}{% if '</think>' in c %}{% set c = c.split('</think>')[-1] %}"
        "{% endif %}{{ '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    thinking = ScriptedTurns([encode("\n<think>a</think>7") + [EOS], encode("7") + [EOS]])
    reasoned = chat_prompt(reasoning, "What is 3 + 4?", {"answer": 7, "task_name": "arithmetic"})
    dropped = run_multi_turn(
        thinking, local_stepper({"arithmetic": CountdownEnv(turns=3)}), reasoning, [reasoned], SamplingParams(max_new_tokens=16), 0,
        MultiTurnSettings(3, 128, (EOS,)),
    )  # fmt: skip
    assert [s.step_metrics for s in dropped.samples] == [{"observations": 1.0, "template_rewrite": 1.0}, {}]
    assert "<think>" not in decode_exact(reasoning, dropped.samples[1].prompt_ids)  # the rendering the model sees next
    assert_rows_trained_as_sampled(dropped, thinking.calls)
    assert_branches_restart_from_the_rendering(dropped, reasoning, [reasoned])


def test_an_environment_is_told_which_step_ends_its_sample(worker, tokenizer, prompts):
    """``metadata[FINAL_TURN]`` is True exactly on the steps after which the loop ends the sample whatever the
    environment answers: the last allowed turn, a turn cut by its token budget, a sequence with no room for an
    observation and one more token (the tool environment then does not run the calls); an environment that returns
    the metadata it got does not carry the flag into the next step."""
    longest = max(len(p.prompt_token_ids) for p in prompts)
    kinds = set()
    for max_total in (512, longest + 4):  # the second leaves the longest prompts room for one short turn only
        seen: dict[str, list[tuple[bool, bool, int]]] = {}  # prompt id -> (final_turn, terminated, steps before) per step
        inner = local_stepper({"arithmetic": CountdownEnv(turns=3)})  # episodes of 1-3 turns; returns {**metadata, ...}

        def stepper(records, logs, metadata, seen=seen, inner=inner):
            steps, counters = inner(records, logs, metadata)
            for record, meta, step in zip(records, metadata, steps):
                seen.setdefault(record.id, []).append((meta[FINAL_TURN], step.terminated, meta.get("steps", 0)))
            return steps, counters

        settings = MultiTurnSettings(2, max_total, (tokenizer.eos_token_id,))
        params = SamplingParams(max_new_tokens=3)
        result = run_multi_turn(RecordingGeneration(worker), stepper, tokenizer, prompts, params, 7, settings)
        for sample, prompt in zip(result.samples, prompts):
            steps = seen[prompt.id]
            assert [n for *_, n in steps] == list(range(len(steps)))  # the env's metadata went on, one step each
            assert all(not final and not terminated for final, terminated, _ in steps[:-1])  # every earlier step went on
            final, terminated, _ = steps[-1]
            # else the observation the environment chose did not fit: an end that depends on its answer
            assert final or terminated or sample.length_truncated, (max_total, prompt.id, steps)
            if final:
                # A final step before the last turn, not cut by its budget: no room for the shortest observation (the
                # environment may end the episode itself then, so the sample need not be length_truncated).
                early = len(steps) < 2 and not sample.truncated
                kind = "length" if sample.length_truncated or early else "budget" if sample.truncated else "last turn"
                if early:
                    assert len(sample.prompt_ids) + len(sample.response_ids) + SHORTEST_OBSERVATION >= max_total
                kinds.add(kind)
    assert kinds == {"last turn", "budget", "length"}  # each end occurs here (3-turn episodes; 3-token turns)


def test_length_limit_truncates_and_counts(worker, tokenizer, prompts):
    limit = max(len(p.prompt_token_ids) for p in prompts) + 12
    result, _ = run(worker, tokenizer, prompts, CountdownEnv(turns=3), max_turns=3, max_total=limit)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in result.samples]
    assert max(lengths) <= limit
    cut = [s for s in result.samples if s.length_truncated]
    # truncated keeps its one meaning, the last turn cut before its stop: a turn that stopped and left no room for the
    # observation is length_truncated only (it was counted in train/truncated_fraction too)
    assert cut and all(s.truncated == (s.response_ids[-1] != EOS) for s in cut)
    assert all(s.response_mask[-1] == 1 for s in result.samples)  # a sample never ends on observation tokens
    frac = multi_turn_metrics(result.samples, result.rewards)["multi_turn/truncated_by_length_fraction"]
    assert frac == len(cut) / len(result.samples)


def test_the_stop_cut_is_the_shortest_prefix_and_costs_log_n_decodes(tokenizer):
    """The cut decoded every prefix of a response (0.65 s for one 2,000-token response on the driver, quadratic in its
    length); a binary search must find the same shortest prefix, against a scan of every prefix, in log2(n)+1 decodes."""
    import random

    from nemo_like.models.generation.interface import stop_string_prefix

    rng = random.Random(0)
    vocab = sorted(set(tokenizer("0123456789+-=<x> ab", add_special_tokens=False)["input_ids"]))
    for _ in range(200):
        ids = [rng.choice(vocab) for _ in range(rng.randint(1, 60))]
        stops = rng.choice([["<x>"], ["1"], ["99", "+-"], ["zz"], ["= "]])
        scan = next((i for i in range(1, len(ids) + 1) if any(s in tokenizer.decode(ids[:i]) for s in stops)), None)
        assert stop_string_cut(tokenizer, ids, stops) == scan, (ids, stops)
    decodes = []
    ids = tokenizer("7" * 2000 + "<x>", add_special_tokens=False)["input_ids"]
    cut = stop_string_prefix(ids, lambda prefix: decodes.append(len(prefix)) or tokenizer.decode(prefix), ["<x>"])
    assert tokenizer.decode(ids[:cut]).endswith("<x>") and len(decodes) <= len(ids).bit_length() + 1


def test_stop_strings_cut_at_a_token_boundary(tokenizer):
    ids = tokenizer("12<x>34", add_special_tokens=False)["input_ids"]
    cut = stop_string_cut(tokenizer, ids, ["<x>"])
    assert tokenizer.decode(ids[:cut]) == "12<x>" and stop_string_cut(tokenizer, ids, ["zz"]) is None
    sample = GeneratedSample([1], ids, [-0.5] * len(ids), truncated=True, weight_version=0)
    cut_sample = apply_stop_strings(tokenizer, sample, ["<x>"])  # policy.generation.stop_strings, single-turn too
    assert cut_sample.response_ids == ids[:cut] and cut_sample.response_logprobs == [-0.5] * cut and not cut_sample.truncated
    assert (cut_sample.num_sampled_tokens, cut_sample.num_decoded_tokens, sample.num_decoded_tokens) == (cut, len(ids), len(ids))


def segments(sample: GeneratedSample) -> list[tuple[int, list[int]]]:
    """``(mask value, ids)`` runs of a multi-turn response: sampled turns (1) and observations (0)."""
    runs: list[tuple[int, list[int]]] = []
    for token, m in zip(sample.response_ids, sample.response_mask):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(token)
        else:
            runs.append((m, [token]))
    return runs


def test_a_steps_stop_strings_end_the_next_turn_on_whole_tokens(worker, tokenizer, prompts):
    result, generation = run(worker, tokenizer, prompts[2:], CountdownEnv(turns=3, stop_strings=["1"]), max_new_tokens=8)
    cut = 0
    for sample in result.samples:
        # Generation's cost counts the tokens the engine decoded past each cut (performance/num_generated_tokens).
        decoded = sum(len(out.response_ids) for _, out in sampled_turns(generation, sample.prompt_ids))
        assert sample.num_decoded_tokens == decoded >= sample.num_sampled_tokens
        turns = [ids for m, ids in segments(sample) if m == 1]
        for ids in turns[1:]:  # turns after a step that set the stop string
            text = tokenizer.decode(ids, skip_special_tokens=False)
            if "1" in text:
                assert text.endswith("1") and "1" not in tokenizer.decode(ids[:-1]) and ids[-1] != EOS
                cut += 1
    assert cut >= 1
    assert any(s.num_decoded_tokens > s.num_sampled_tokens for s in result.samples)
    # What performance/num_generated_tokens sums (both loops): every token the engine decoded, the cut ones too.
    n = len(result.samples)
    rollout = Rollout(prompts[2:][:n], torch.arange(n), result.samples, [""] * n, torch.zeros(n))
    decoded = sum(len(out.response_ids) for _, outputs, _ in generation.calls for out in outputs)  # every engine output
    assert rollout.decoded_tokens == decoded > float(rollout.response_lengths.sum())


def test_a_sample_is_as_old_as_its_first_turn(worker, tokenizer, prompts):
    # The weights change after the first generate call: samples with later turns keep the first turn's version.
    generation = RecordingGeneration(worker, refit_after_calls=1)
    result, _ = run(worker, tokenizer, prompts, CountdownEnv(turns=3), generation=generation)
    later = [s for s in result.samples if s.num_turns > 1]
    assert later and all(s.weight_version == 0 and s.final_weight_version == 1 for s in later)
    # The buffer's staleness bound counts from there: trained at version 2 with bound 1 -> age 2, refused.
    buffer = ReplayBuffer(groups_per_step=1, max_age=1)
    buffer.push([TrajectoryGroup(1, prompts[0], later[:1], ["x"], [0.0])])
    with pytest.raises(ReplayBufferError, match="ages 2..2"):
        buffer.take(1, trainer_version=2)
    worker.weight_version = 0


def test_malformed_environment_steps_are_rejected_with_the_reason():
    check_step(EnvironmentStep(1.0, False, {"role": "tool", "content": "x"}, {"a": 1}, ["</x>"]), "w")
    for bad, reason in [
        (EnvironmentStep(float("nan")), "finite"),
        (EnvironmentStep(0.0, False, {"role": "tool"}), "observation"),
        (EnvironmentStep(0.0, False, None, None, "</x>"), "stop_strings"),
        (EnvironmentStep(0.0, metrics={"calls": float("inf")}), "metrics"),
        # the loop's own per-episode names: an environment's "rows" replaced multi_turn/rows_per_sample, its
        # "template_rewrite" added to the loop's branch count
        (EnvironmentStep(0.0, metrics={"calls": 1.0, "rows": 4.0}), r"metrics name 'rows', which the turn loop logs itself"),
        (EnvironmentStep(0.0, metrics={"template_rewrite": 1.0}), "rename it"),
        (EnvironmentStep("1.0"), "finite"),
        (EnvironmentStep(torch.ones(2)), "finite"),
        ((0.0, True), "EnvironmentStep"),
    ]:
        with pytest.raises(ValueError, match=reason):
            check_step(bad, "env 'x' step")
    # numpy and one-element torch numbers are numbers (score() took them; step() refused a numpy float32 reward)
    import numpy as np

    from nemo_like.environments.worker import as_python_numbers

    # every name the loop logs per sample of its own is reserved (a new one must be added to RESERVED_STEP_METRICS)
    sample = GeneratedSample([1], [2, 3], [-0.5, -0.5], truncated=False, weight_version=0, num_turns=1, step_metrics={"calls": 1.0})
    logged = multi_turn_metrics([sample], torch.zeros(1))
    own = {key.removeprefix("multi_turn/").removesuffix("_per_sample") for key in logged if key.endswith("_per_sample")}
    assert own - {"calls"} == {"rows", "observation_tokens"} and own - {"calls"} <= RESERVED_STEP_METRICS
    step = EnvironmentStep(np.float32(0.5), metrics={"calls": np.int64(2), "t": torch.tensor(1.5)})
    check_step(step, "w")
    step = as_python_numbers(step)
    assert type(step.reward) is float and step.reward == 0.5 and step.metrics == {"calls": 2.0, "t": 1.5}
    assert all(type(v) is float for v in step.metrics.values())


def test_turns_and_environment_kind_disagreeing_is_a_warning():
    from nemo_like.algorithms.setup import multi_turn_warnings
    from nemo_like.config import load_config
    from nemo_like.environments.registry import resolve_environments

    def warnings_for(turns: int) -> list[str]:
        cfg = load_config(
            "examples/configs/grpo_tiny_cpu.yaml",
            [f"grpo.max_rollout_turns={turns}", "policy.max_total_sequence_length=96", "+env.count.class=custom_envs:CountdownEnv"],
        )
        return multi_turn_warnings(cfg, resolve_environments(cfg.env_sections))

    assert warnings_for(1) == [
        "env.count is a multi-turn environment (it overrides step) but grpo.max_rollout_turns=1: the run scores single responses "
        "with its score(); set grpo.max_rollout_turns > 1 to use its turns"
    ]
    (line,) = warnings_for(3)
    assert line.startswith("grpo.max_rollout_turns=3 has no effect for env.arithmetic")
    # An environment's own no-effect lines (EnvironmentInterface.config_warnings) join them
    cfg = load_config(
        "examples/configs/grpo_tiny_cpu.yaml",
        ["grpo.max_rollout_turns=2", "policy.max_total_sequence_length=96", "+env.game.class=guess_number"],
    )
    assert any(
        w.startswith("env.game.max_guesses=7 has no effect") for w in multi_turn_warnings(cfg, resolve_environments(cfg.env_sections))
    )


def test_a_turn_with_no_room_for_the_shortest_observation_is_the_final_one(tokenizer):
    """The loop had told the environment "not final" whenever one more token fit, though every observation appends at
    least the turn's end and the next generation prompt: guess_number then built a hint the length limit threw away,
    and the unsolved game landed in none of its outcome counters (its docs promise ``turn_limit``)."""
    from nemo_like.data.prompts import PromptRecord
    from nemo_like.environments.games.guess_number import GuessNumberEnvironment

    messages = [{"role": "user", "content": "Guess my number between 1 and 100."}]
    ids = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)[
        "input_ids"
    ]
    guess = tokenizer("50", add_special_tokens=False)["input_ids"] + [EOS]

    class Guesses:
        weight_version = 0

        def generate(self, prompts, params, seed):
            return [GeneratedSample(list(p), guess, [-0.1] * len(guess), False, 0, 0) for p in prompts]

    prompt = PromptRecord(id="0", messages=messages, prompt_token_ids=ids, metadata={"task_name": "guess", "answer": 7})
    shortest = len(tokenizer("\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])  # after the sampled end
    assert shortest == SHORTEST_OBSERVATION
    for room, final in ((len(guess) + shortest, True), (len(guess) + shortest + 1, False)):
        seen = []
        inner = local_stepper({"guess": GuessNumberEnvironment(max_guesses=7)})

        def stepper(records, logs, metadata, seen=seen, inner=inner):
            seen.extend(m[FINAL_TURN] for m in metadata)
            return inner(records, logs, metadata)

        settings = MultiTurnSettings(4, len(ids) + room, (EOS,))
        result = run_multi_turn(Guesses(), stepper, tokenizer, [prompt], SamplingParams(max_new_tokens=8), 0, settings)
        assert seen[0] is final, room
        dropped = multi_turn_metrics(result.samples, result.rewards).get("multi_turn/observation_dropped_for_length_per_sample", 0.0)
        if final:  # the unsolved game is counted where its docs say, and only there (it was counted as dropped too)
            assert result.env_metrics["env/guess/turn_limit"] == 1.0 and result.samples[0].num_turns == 1
            assert dropped == 0.0 and result.samples[0].length_truncated
        else:  # told "not final", the game wrote a hint that does not fit: dropped, and counted as such
            assert result.samples[0].length_truncated and result.env_metrics["env/guess/turn_limit"] == 0.0
            assert dropped == 1.0


def test_a_rewritten_turn_with_no_room_left_is_a_length_cut_and_an_earlier_turn_re_trimmed_is_a_template_rewrite(tokenizer):
    """A turn ended on a foreign end id (or rewritten in its whitespace) with no room left for the branch's row is a
    length cut, not counted as a branch (it was counted besides the cut). A template that trims an earlier turn only
    once a later one exists rewrites more than the last turn's whitespace: a template rewrite, not a whitespace one."""
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    row = chat_prompt(tokenizer, "What is 3 + 4?", {"answer": 7, "task_name": "arithmetic"})
    turn = encode("7") + [eot]
    result = run_multi_turn(
        ScriptedTurns([turn]), local_stepper({"arithmetic": CountdownEnv(turns=3)}), tokenizer, [row],
        SamplingParams(max_new_tokens=8), 0, MultiTurnSettings(3, len(row.prompt_token_ids) + len(turn) + 1, (EOS, eot)),
    )  # fmt: skip
    (sample,) = result.samples
    assert sample.length_truncated and "foreign_end_of_turn" not in (sample.step_metrics or {})
    retrimming = copy.deepcopy(tokenizer)
    retrimming.chat_template = (
        "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'assistant' %}{% set ns.last = loop.index0 %}"
        "{% endif %}{% endfor %}{% for m in messages %}{% set c = m['content'] %}"
        "{% if m['role'] == 'assistant' and loop.index0 < ns.last %}{% set c = c | trim %}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    three_turns = chat_prompt(retrimming, "What is 4 + 4?", {"answer": 8, "task_name": "arithmetic"})
    retrimmed = run_multi_turn(
        ScriptedTurns([encode("8\n") + [EOS], encode("8") + [EOS], encode("8") + [EOS]]),
        local_stepper({"arithmetic": CountdownEnv(turns=3)}), retrimming, [three_turns], SamplingParams(max_new_tokens=8), 0,
        MultiTurnSettings(3, 256, (EOS,)),
    )  # fmt: skip
    assert [s.step_metrics.get("template_rewrite") for s in retrimmed.samples] == [1.0, None]
    assert (
        "template_whitespace_rewrite" not in episode_totals(retrimmed.samples, retrimmed.rewards, retrimmed.session_of_row)[0].step_metrics
    )


def test_end_ids_are_judged_where_the_conversation_goes_on(tokenizer):
    """An end id is the turn's end where its text follows an assistant turn's content when another message follows
    (whitespace between allowed): Llama 2 writes ``' ' + content + ' </s>'`` (its </s> was taken for foreign: every
    episode ended after one turn), gpt-oss ends a final message with ``<|return|>`` and one that goes on with
    ``<|end|>`` (here <|endoftext|> and <|im_end|>: <|return|> was taken for a turn's end, and a turn ended on it
    failed the rollout)."""
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    spaced, final_only = copy.deepcopy(tokenizer), copy.deepcopy(tokenizer)
    spaced.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ '<|im_start|>' + m['content'] }}"
        "{% else %}{{ ' ' + m['content'] | trim + ' <|im_end|>' }}{% endif %}{% endfor %}"
    )
    final_only.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
        "{% if m['role'] == 'assistant' and loop.last and not add_generation_prompt %}{{ '<|endoftext|>' }}"
        "{% else %}{{ '<|im_end|>\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    assert writes_back(spaced, EOS) and not writes_back(spaced, eot)
    assert writes_back(final_only, EOS) and not writes_back(final_only, eot)


@pytest.mark.parametrize("legacy", [False, True])
def test_a_sentencepiece_turn_keeps_the_space_of_its_first_token(legacy):
    """Mistral's template writes an answer as ``[/INST] 7</s>``; the model samples ``▁7``. Decoded alone a SentencePiece
    tokenizer drops that first ``▁``, so the sequence's text read ``[/INST]7</s>`` and every turn failed the whole
    rollout as a template rewrite. Each turn is decoded after the sequence's last id (``decode_in_context``); a turn
    with a trailing newline, or without the space the template writes, branches its episode as a trimmed one."""
    sp = sentencepiece_tokenizer(
        legacy,
        ["[INST]", "[/INST]"],
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + '[/INST]' }}"
        "{% else %}{{ ' ' + m['content'] | trim + '</s>' }}{% endif %}{% endfor %}",
    )
    row = chat_prompt(sp, "What is 3 + 4?", {"answer": 7, "task_name": "arithmetic"})
    answer = sp(render_chat(sp, row.messages, add_generation_prompt=True) + " 7</s>", add_special_tokens=False)["input_ids"]
    answer = answer[len(row.prompt_token_ids) :]  # the ids the template's own rendering has for the answer turn
    assert sp.convert_ids_to_tokens(answer[0]) == "▁" or sp.convert_ids_to_tokens(answer[0]).startswith("▁")
    newline = sp.encode("\n", add_special_tokens=False)[-1:]
    unspaced = [sp.convert_tokens_to_ids("7"), sp.eos_token_id]  # the template writes a space the model did not sample
    result = run_multi_turn(
        ScriptedTurns([answer, answer[:-1] + newline + answer[-1:], unspaced, answer, answer, answer]),
        local_stepper({"arithmetic": CountdownEnv(turns=3, observation_role="user")}), sp, [row, row, row],
        SamplingParams(max_new_tokens=8), 0, MultiTurnSettings(3, 256, (sp.eos_token_id,)),
    )  # fmt: skip
    assert result.session_of_row == [0, 1, 1, 2, 2] and [s.num_turns for s in result.samples] == [2, 1, 1, 1, 1]
    assert result.rewards.tolist() == [1.0] * 5
    assert [m["content"] for m in result.samples[0].messages if m["role"] == "assistant"] == [" 7", " 7"]
    assert result.texts[0] == " 7</s>[INST] 1 left[/INST] 7</s>"  # what was trained on (decoded alone it lost the space)
    # A stop string led by a space ends the turn where its text has it (decoded alone, the first '▁7' had no space)
    said = sp(render_chat(sp, row.messages, add_generation_prompt=True) + " 7 is it 7</s>", add_special_tokens=False)
    said = said["input_ids"][len(row.prompt_token_ids) :]
    cut = run_multi_turn(
        ScriptedTurns([said]), local_stepper({"arithmetic": CountdownEnv(turns=1, observation_role="user")}), sp, [row],
        SamplingParams(max_new_tokens=16, stop_strings=[" 7"]), 0, MultiTurnSettings(1, 256, (sp.eos_token_id,)),
    )  # fmt: skip
    assert cut.texts == [" 7"] and cut.samples[0].messages[0]["content"] == " 7"
    assert [s.step_metrics.get("template_whitespace_rewrite") for s in result.samples] == [None, 1.0, None, 1.0, None]


def test_a_response_is_decoded_after_its_context_whole_characters_only():
    """decode_in_context after a byte-fallback id (the tail byte of a multi-byte character) read the response's own
    bytes into it ('������ 7' for '日本 7'): it decodes alone there. A single-turn stop-string cut decodes the response
    after its prompt too (a SentencePiece ' 7' stop was found only at the second '▁7', 9 ids in)."""
    from nemo_like.experience.multi_turn import decode_in_context
    from nemo_like.experience.rollouts import generate_rollout

    sp = sentencepiece_tokenizer(False, [], "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    context = sp("Réponse é", add_special_tokens=False)["input_ids"]
    ids = sp("Réponse é日本 7", add_special_tokens=False)["input_ids"][len(context) :]
    assert sp.convert_ids_to_tokens(context[-1]) == "<0xA9>" and decode_in_context(sp, context[-1:], ids) == "日本 7"
    prompt = PromptRecord(id="p", messages=[], prompt_token_ids=sp("Say:", add_special_tokens=False)["input_ids"], metadata={})
    said = sp("Say: 7 is it 7", add_special_tokens=False)["input_ids"][len(prompt.prompt_token_ids) :]
    assert sp.convert_ids_to_tokens(said[0]).startswith("▁")
    _, _, samples, texts = generate_rollout(ScriptedTurns([said]), sp, [prompt], 1, SamplingParams(16, stop_strings=[" 7"]), 0)
    assert decode_in_context(sp, prompt.prompt_token_ids, samples[0].response_ids) == " 7" and texts == ["7"]
    # The cut's binary search read a prefix ending inside a character as all U+FFFD (the byte-fallback decoder blanks
    # the whole byte run, '日' before it too): the cut landed 6 tokens late, or (a response cut mid-character) never.
    spelled = sp("日本語 7", add_special_tokens=False)["input_ids"]
    assert sp.convert_ids_to_tokens(spelled[1:4]) == ["<0xE6>", "<0x97>", "<0xA5>"]
    assert stop_string_cut(sp, spelled, ["日"]) == 4 and stop_string_cut(sp, spelled[:5], ["日"]) == 4
    # A genuine U+FFFD (bytes EF BF BD) before an unfinished emoji: each text read while stepping back counts
    genuine = sp.convert_tokens_to_ids(["<0xC3>", "<0xA9>", "<0xEF>", "<0xBF>", "<0xBD>", "<0xF0>", "<0x9F>", "<0x91>", "<0x8D>"])
    assert stop_string_cut(sp, genuine, ["é"]) == 2 and stop_string_cut(sp, genuine[:7], ["é"]) == 2
    # The engine's watch decodes a window of the last tokens: one starting inside a byte run blanked the stop string
    watch = StopStringWatch(lambda ids: decode_exact(sp, ids), ["日"])
    row = sp("本語日" + "本語" * 10, add_special_tokens=False)["input_ids"]
    engine_stop = next((i + 1 for i in range(len(row)) if watch.can_end(row[i]) and watch.holds(row[: i + 1])), None)
    assert engine_stop == stop_string_cut(sp, row, ["日"]) == 10
    # A stray byte blanks the whole run in the row's text: the window's clean part held 日 and stopped the engine where
    # the driver's cut finds no stop; a hit is confirmed on the whole row now.
    stray = sp("a", add_special_tokens=False)["input_ids"] + sp.convert_tokens_to_ids(
        ["<0x80>", *[f"<0x{b:02X}>" for b in "本語日".encode()]]
    )
    watch = StopStringWatch(lambda ids: decode_exact(sp, ids), ["日"])
    assert not any(watch.can_end(stray[i]) and watch.holds(stray[: i + 1]) for i in range(len(stray)))
    assert stop_string_cut(sp, stray, ["日"]) is None
    # The U+FFFD of an unfinished character is no text: a stop string holding U+FFFD does not match it (a response cut
    # mid-character was cut there, and marked stopped)
    qwen = load_tokenizer(EMBEDDED_MODEL)
    unfinished = qwen("日本", add_special_tokens=False)["input_ids"][:-1]
    assert stop_string_cut(qwen, unfinished, ["\ufffd"]) is None


@pytest.mark.parametrize("legacy", [False, True])
def test_a_sentencepiece_observation_holds_the_ids_it_has_in_the_whole_rendering(legacy):
    """Peer pitfall (NeMo-RL#2844): an observation tokenised on its own by a SentencePiece tokenizer starts with a
    ``▁`` word marker the whole conversation's rendering does not hold, so every tool turn trained on a token the model
    never sees at deployment (``legacy=False``; a legacy tokenizer puts the ``▁`` after every special token, in the whole
    rendering too, so there the observation keeps it). The rollout appends the observation's ids in context: the ids the
    whole rendering has after the sequence so far, tokenised from the sequence's last added token on."""
    from nemo_like.experience.multi_turn import Conversation, render

    sp = sentencepiece_tokenizer(
        legacy,
        ["<|im_start|>", "<|im_end|>"],
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    )
    messages = [{"role": "user", "content": "what is 2+2"}]
    prompt = PromptRecord(id="0", messages=messages, prompt_token_ids=[], metadata={})
    conv = Conversation(prompt, [*messages, {"role": "assistant", "content": "call it"}], {}, render(sp, messages) + "call it<|im_end|>")
    for observation in ({"role": "tool", "content": "4"}, {"role": "tool", "content": " leading space, then more"}):
        follows = continuation(sp, conv, observation)
        assert follows.branch is None
        text, ids = follows.text, follows.ids
        before = sp(conv.text, add_special_tokens=False)["input_ids"]
        whole = sp(conv.text + text, add_special_tokens=False)["input_ids"]
        assert whole[: len(before)] == before  # the observation starts after a special token: nothing merges across
        assert ids == whole[len(before) :], (sp.convert_ids_to_tokens(ids)[:4], sp.convert_ids_to_tokens(whole[len(before) :])[:4])
