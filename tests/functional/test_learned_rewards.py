"""Learned rewards with real actors: the tiny model as an LLM judge (template, parse failures, a deadline, the
cache, the counters; the judge recovers after the deadline) and a real GRPO run whose reward is composed of four
sources, each logged on its own in metrics.jsonl."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
from functional.helpers import REPO, TINY_OVERRIDES, read_metrics

from nemo_like.config import load_config
from nemo_like.environments.judge import JudgeEnvironment
from nemo_like.environments.score_normalization import ScoreNormalization
from nemo_like.train import train

pytestmark = pytest.mark.slow

JUDGE = "embedded:tiny-arith-qwen2"
TEMPLATE = "What is {response} + {answer}?"  # the tiny model answers sums: a one-digit sum parses, a longer one fails
PATTERN = r"^(\d)$"


def plain_greedy_verdict(model, tok, text: str) -> str:
    """The judge's verdict computed without the environment: chat template + transformers greedy generate."""
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    input_ids = tok(ids, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids, max_new_tokens=8, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True)


def test_tiny_model_as_judge_template_parse_failure_deadline_and_cache(ray_cluster, capfd) -> None:
    from nemo_like.models.loading import load_causal_lm, load_tokenizer

    env = JudgeEnvironment(
        model_name=JUDGE,
        template=TEMPLATE,
        parser="regex",
        parser_options={"pattern": PATTERN},
        normalize={"scale": 0.1},
        parse_failure_reward=-1.0,
        max_new_tokens=8,
    )
    try:
        responses = ["3", "30", "3", "2", "30", "3"]  # duplicates: judged once each
        metadata = [{"answer": 4, "task_name": "t"}] * 5 + [{"answer": 5, "task_name": "t"}]
        model, tok = load_causal_lm(JUDGE), load_tokenizer(JUDGE)
        verdicts = [plain_greedy_verdict(model, tok, TEMPLATE.format(response=r, answer=m["answer"])) for r, m in zip(responses, metadata)]
        assert verdicts[0].isdigit() and len(verdicts[0]) == 1 and len(verdicts[1]) > 1  # one parses, one does not
        expected = [0.1 * int(v) if len(v) == 1 and v.isdigit() else -1.0 for v in verdicts]
        rewards = env.score(responses, metadata)
        assert rewards == pytest.approx(expected)
        counters = env.metrics()
        assert counters["judged"] == 4 and counters["cache_hits"] == 2  # (3,4) x3, (30,4) x2, (2,4), (3,5)
        assert counters["parse_failures"] == sum(r == -1.0 for r in expected) and counters["timeouts"] == 0
        assert counters["scored"] + counters["parse_failures"] == len(responses)

        # A stuck judge: its actor (one call at a time) sleeps, so the next verdicts queue behind the sleep and miss the
        # deadline whatever the machine's load. (A sub-millisecond deadline is no such guarantee: Ray waits in whole
        # milliseconds, and a descheduled driver can find a fast judge's answer already there.)
        env.engine.group.workers[0].__ray_call__.remote(lambda worker: time.sleep(120))
        env.cfg.deadline_s = 0.5  # every sample times out, nothing raises, the stuck actor is killed and a new one loads
        assert env.score(responses, metadata) == [-1.0] * len(responses)
        counters = env.metrics()
        assert counters["timeouts"] == len(responses) and counters["scored"] == 0 and counters["parse_failures"] == 0
        assert counters["engine_restarts"] == 1  # per sample: the cached ones lost their verdict too

        # The restarted engine loads while the run goes on (a new process importing torch and loading the model:
        # seconds). A call that finds it still loading times out but leaves the load running: each such call had killed
        # and restarted it, so a judge whose load outlasted deadline_s timed out on every call after its first timeout.
        env.cfg.deadline_s = 0.2
        assert env.score(responses, metadata) == [-1.0] * len(responses)
        counters = env.metrics()
        assert counters["timeouts"] == len(responses) and counters["engine_restarts"] == 0
        # Loaded before the next call, and stuck in it: a stuck judge like any other, killed at once (no call had seen
        # it loaded, so it was kept as "loading" one call more, that call's verdicts lost behind the stuck one)
        env.engine.group.wait_started()
        env.engine.group.workers[0].__ray_call__.remote(lambda worker: time.sleep(120))
        env.cfg.deadline_s = 0.5
        assert env.score(responses, metadata) == [-1.0] * len(responses)
        assert env.metrics()["engine_restarts"] == 1
        env.cfg.deadline_s = 60.0  # the run goes on: the restarted engine judges as before
        assert env.score(responses, metadata) == pytest.approx(expected)
        counters = env.metrics()
        assert counters["engine_restarts"] == 0 and counters["timeouts"] == 0 and counters["judged"] == 4

        # A finite verdict that normalises past float range (9 x 1e308) is a counted parse failure: it was an inf reward,
        # which stops the run in the environment worker
        env.cfg.normalize = ScoreNormalization(scale=1e308)
        big = [1e308 * int(v) if len(v) == 1 and v.isdigit() and int(v) < 2 else -1.0 for v in verdicts]
        assert env.score(responses, metadata) == pytest.approx(big)
        assert env.metrics()["parse_failures"] == sum(r == -1.0 for r in big)

        # A verdict outside score_range is unreadable: it was the reward a number outside the asked-for scale gives
        env.cfg.normalize, env.cfg.score_range = ScoreNormalization(scale=0.1), (int(verdicts[0]), int(verdicts[0]))
        digits = [v for v in verdicts if len(v) == 1 and v.isdigit()]
        in_range = [0.1 * int(v) if v == verdicts[0] else -1.0 for v in verdicts]
        assert env.score(responses, metadata) == pytest.approx(in_range)
        counters = env.metrics()
        assert counters["out_of_range"] == sum(v != verdicts[0] for v in digits) and counters["scored"] == digits.count(verdicts[0])

        # A sampled judge (greedy: false) reads each judge prompt with a seed of its own ids: the same verdict in any
        # call, batch or order (its seed was seed + a call counter kept in the actor: a resumed run, or a replaced actor,
        # judged the same samples with other numbers); another judge seed draws others
        env.params = replace(env.params, greedy=False, temperature=1.0)
        sampled = [str(n) for n in range(12)]
        sums = [{"answer": 7, "task_name": "t"}] * len(sampled)
        first = env.verdicts(sampled, sums)
        assert env.verdicts(sampled[::-1], sums)[::-1] == first and env.verdicts(sampled[5:], sums[5:]) == first[5:]
        env.cfg.seed += 1
        assert env.verdicts(sampled, sums) != first

        # A failed call (its actor died) is printed: a judge failing every call showed only in the metrics (last: the
        # engine it restarts loads while the environment shuts down)
        import ray

        capfd.readouterr()
        ray.kill(env.engine.group.workers[0])
        assert env.score(["4"], [{"answer": 9, "task_name": "t"}]) == [-1.0]  # not cached: judged now, lost
        assert env.metrics()["engine_errors"] == 1
        err = capfd.readouterr().err
        assert err.count("[judge] warning: the judge 'embedded:tiny-arith-qwen2' failed a call (") == 1, err
    finally:
        env.close()


def test_a_run_logs_each_reward_source_of_a_composed_reward(ray_cluster, tmp_path) -> None:
    recipe = REPO / "examples" / "configs" / "grpo_tiny_rewards_cpu.yaml"
    overrides = [*TINY_OVERRIDES, "grpo.max_num_steps=1", "loss_fn.reference_policy_kl_penalty=0"]  # no reference actor
    cfg = load_config(recipe, [*overrides, f"logger.log_dir={tmp_path / 'logs'}"])
    train(cfg)
    record = next(r for r in read_metrics(tmp_path / "logs") if "env/arithmetic/correct/reward" in r)
    weights = {"correct": 1.0, "rm": 0.1, "length": 1.0, "judge": 0.1}
    for source in weights:
        assert record[f"env/arithmetic/{source}/num_samples"] == 16.0  # 4 prompts x 4 samples, one actor
    composed = sum(w * record[f"env/arithmetic/{s}/reward"] for s, w in weights.items())
    assert record["env/arithmetic/reward"] == pytest.approx(composed, abs=1e-5)  # the mean of a weighted sum
    assert record["env/arithmetic/judge/judged"] + record["env/arithmetic/judge/cache_hits"] == 16.0
    assert record["env/arithmetic/rm/scored"] == 16.0 and record["env/arithmetic/judge/timeouts"] == 0.0
