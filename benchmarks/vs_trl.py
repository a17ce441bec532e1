"""Side-by-side: TRL's GRPOTrainer against ours on the same workload, alternating step by step in one invocation.

Usage (from the repository root, our venv; TRL lives in its own venv, see below):

    make bench-trl-venv                      # once: .venv-trl with torch 2.13.0 (CPU) + trl 1.16 (benchmark only)
    python benchmarks/vs_trl.py              # defaults: W1 and W2, our default backend (auto: inline on CPU here)
    python benchmarks/vs_trl.py --workloads W2 --backends vllm,hf --steps 6

Defaults: ``--workloads W1,W2 --backends default --warmup 2 --steps 5 --trl-python .venv-trl/bin/python``;
about 110 s on an idle 2-core machine (three invocations on 2026-12-03), longer under load.

Workloads (the issue's):

* **W1**: a ~1M-param Qwen2 (hidden 128, 4 layers), 1 prompt x 8 completions x 16 tokens per step;
* **W2**: a ~10M-param Qwen2 (hidden 384, intermediate 1792, 4 layers), 8 prompts x 8 completions x 64 tokens;
* **W3** (``--workloads W3``, not a default: ~7 minutes): a ~35M-param Qwen2 (hidden 768, intermediate 3072, 4 layers,
  inside ``benchmarks/scaling.py``'s range), 8 prompts x 8 completions x 128 tokens.

The same workload: both sides load the same Hugging Face model directory (random init, the shipped tiny
model's tokenizer), whose stop token is never sampled (its logit sits 86 / 84 / 46 nats below the mean of the
others in W1 / W2 / W3: ``python benchmarks/stop_token_gap.py W1 W2 W3``; see :func:`build_model`), so every completion
on both sides runs exactly ``max_new_tokens`` tokens (the script checks both: "all completions full length", ours / TRL;
a pair whose TRL step stopped early says so: its model drifted to the stop token, seen at W3 with the 11 nats of
:data:`STOP_OFFSET` 2).
Both train on the same prompts in the same order (the first ``PROMPT_SET`` = 64 of our arithmetic training prompts, chat
template applied, in the order our loader draws them; TRL takes them in that order with ``shuffle_dataset=False``, and
the script checks that every pair's two steps drew the same prompts: "same prompts each pair"), beta 0 (no
reference model), one optimizer step per rollout over the whole batch, temperature 1, sync, fp32 (``--precision
bfloat16``: both sides compute in bf16 over float32 weights, TRL's own default, and the matmul probe runs in bf16;
docs/guides/performance.md, "bfloat16 on a CPU").
TRL runs with its own defaults otherwise (HF ``generate``; note that TRL 1.x defaults to
``gradient_checkpointing=True``, which recomputes the forward in the backward, work ours does not do:
``--trl-no-gradient-checkpointing`` turns it off, see docs/guides/performance.md). Ours runs with the
recipe's defaults.

How it alternates: TRL runs in a subprocess of ``--trl-python`` (its ``train()`` loop is held between
steps by a callback that waits for a line on stdin); ours runs in this process (Ray actors, driven step
by step through the sync loop's own step function). Each pair runs one TRL step and one of ours (in
alternating order), so both sides see the same machine load. The first ``--warmup`` pairs are left out.

Output: per workload and backend, each side's steady-state median s/step, the ratio pair by pair
(ours/TRL), our phase breakdown (medians), the 1-minute load average around each pair, and the
training FLOP floor (6 x params x trained tokens at ``--peak-gflops``; generation's: 2 x params x
processed tokens). The machine's matmul rate moves during the day (by a third on the same day here), so the script
also probes it between pairs (0.3 s of 1024^2 matmuls in ``--precision``, 2 threads) and prints our training phase against the
floor at that probed rate. The floors count every sequence's tokens (what TRL's forward computes); our forward runs each
group's prompt once (``policy.shared_prompt_forward``), so the script also prints the tokens it ran per sequence token
(``performance/training_forward_tokens_per_token``) and our training against the floor of those.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORKLOADS = {
    "W1": dict(size="1m", prompts=1, generations=8, new_tokens=16),
    "W2": dict(size="10m", prompts=8, generations=8, new_tokens=64),
    "W3": dict(size="35m", prompts=8, generations=8, new_tokens=128),  # larger, from the scaling range; not a default
}
SIZES = {
    "1m": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
    "10m": dict(hidden_size=384, intermediate_size=1792, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2),
    "35m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=4),
}
PROMPT_BUDGET = 32  # prompt tokens the sequence length allows (our arithmetic prompts are ~21)
PROMPT_SET = 64  # both sides draw their steps from the first this many of our arithmetic training prompts
TAG = "@@vs_trl@@"  # marks the TRL worker's own lines on its stdout (TRL prints its logs there too)
OUR_PHASES = ("refit", "generation", "reward", "prev_logprobs", "policy_training")


# ---------------------------------------------------------------------------------------------------
# TRL side: runs inside --trl-python (imports only torch, transformers, datasets, trl)
# ---------------------------------------------------------------------------------------------------
def trl_worker(spec: dict) -> None:
    """Build TRL's GRPOTrainer on ``spec`` and run steps on demand: before each step it reads a line from stdin
    (``go`` or ``stop``), after each step it prints ``{"trl_step_s": ...}`` as one JSON line."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    batch = spec["prompts"] * spec["generations"]
    rows = [{"prompt": text, "answer": str(answer)} for text, answer in spec["dataset"]]

    step_prompts: list[str] = []  # the distinct prompts of the step in flight, for the driver's same-prompts check
    step_tokens: list[int] = []  # its completions' token counts, for the driver's full-length check

    def reward(completions, answer, prompts, **kwargs):
        """1 if the last integer is the answer: rewards that never depend on the (fixed) length."""
        step_prompts.extend(p for p in prompts if p not in step_prompts)
        step_tokens.extend(len(ids) for ids in kwargs["completion_ids"])
        out = []
        for c, a in zip(completions, answer):
            nums = re.findall(r"-?\d+", c if isinstance(c, str) else c[-1]["content"])
            out.append(1.0 if nums and nums[-1] == a else 0.0)
        return out

    class Gate(TrainerCallback):
        def __init__(self) -> None:
            self.start = 0.0

        def on_step_begin(self, args, state, control, **kw):
            if sys.stdin.readline().strip() != "go":
                os._exit(0)  # the driver is done with us
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            seconds = time.perf_counter() - self.start
            print(TAG + json.dumps({"trl_step_s": seconds, "prompts": step_prompts, "tokens": sum(step_tokens)}), flush=True)
            step_prompts.clear()
            step_tokens.clear()

    cfg = GRPOConfig(
        output_dir=os.path.join(spec["tmp"], "trl-out"),
        use_cpu=True,
        bf16=spec["precision"] == "bfloat16",  # TRL's own default is True: autocast over float32 weights, as ours
        fp16=False,
        use_vllm=False,
        report_to="none",
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=spec["generations"],
        max_completion_length=spec["new_tokens"],
        temperature=1.0,
        beta=0.0,
        learning_rate=1e-4,
        max_steps=10_000,
        save_strategy="no",
        seed=0,
        shuffle_dataset=False,  # the rows come in our loader's order (prompt_rows): both sides' steps draw the same prompts
        dataloader_num_workers=0,
        gradient_checkpointing=spec["gradient_checkpointing"],
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=[reward], args=cfg, train_dataset=Dataset.from_list(rows))
    trainer.add_callback(Gate())
    print(
        TAG
        + json.dumps(
            {"ready": True, "threads": torch.get_num_threads(), "gradient_checkpointing": cfg.gradient_checkpointing, "bf16": cfg.bf16}
        ),
        flush=True,
    )
    trainer.train()


class TRLProcess:
    """The TRL side: a subprocess that runs one GRPO step per :meth:`step` call."""

    def __init__(self, python: str, spec: dict) -> None:
        self.proc = subprocess.Popen(
            [python, __file__, "--trl-worker", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": "", "WANDB_MODE": "disabled", "HF_DATASETS_OFFLINE": "1"},
        )
        self.info = self._read()

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the TRL worker exited (code {self.proc.wait()}); see its stderr above")
            if line.startswith(TAG):
                return json.loads(line[len(TAG) :])

    def step(self) -> tuple[float, list[str], int]:
        """``(seconds, the step's distinct prompt texts, its completions' tokens)`` of one TRL step."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        result = self._read()
        return result["trl_step_s"], result["prompts"], result["tokens"]

    def close(self) -> None:
        try:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ---------------------------------------------------------------------------------------------------
# Shared: the model directory and the prompts
# ---------------------------------------------------------------------------------------------------
def build_model(directory: Path, size: str) -> tuple[str, int]:
    """A random Qwen2 of ``size`` (:data:`SIZES`): :func:`save_random_qwen2`."""
    return save_random_qwen2(directory, **SIZES[size])


#: The constant in every input embedding's dimension 0 (the stop token's negated) of :func:`save_random_qwen2`.
STOP_OFFSET = 4.0


def save_random_qwen2(directory: Path, **shape) -> tuple[str, int]:
    """A random Qwen2 of ``shape`` (``Qwen2Config`` fields; the vocabulary, special tokens and, unless given,
    ``max_position_embeddings`` are the shipped tiny model's) with its tokenizer, whose stop token is never sampled;
    returns its directory and parameter count.

    Every input embedding gets the constant :data:`STOP_OFFSET` in dimension 0 except the stop token's, which gets its
    negative.
    With the tied head every ordinary token's logit gains about the same from dimension 0 after the final RMSNorm
    (little effect on their relative probabilities) and the stop token's loses it: measured at the sampled positions
    (``benchmarks/stop_token_gap.py``) it sits 86 (1M) / 84 (10M) / 46 (35M) nats below the mean of the others (the
    gap shrinks as the random layers' own contribution to the residual stream grows; with 2, 39 / 23 / 11 nats, and at
    W3 TRL's model drifted to the stop token within a few steps), and no completion ends early
    (checked on every run). The FLOPs are those of a plain random model."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    base, tok = tiny_model_config(), tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=base.vocab_size,
        max_position_embeddings=shape.pop("max_position_embeddings", base.max_position_embeddings),
        tie_word_embeddings=True,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
        **shape,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[:, 0] = STOP_OFFSET
        emb[tok.eos_token_id, 0] = -STOP_OFFSET
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return str(directory), sum(p.numel() for p in model.parameters())


def tiny_model_config():
    """The shipped tiny model's ``config.json`` (its vocabulary and heads size the benchmark models)."""
    from transformers import AutoConfig

    from nemo_like.models.loading import resolve_model_path

    return AutoConfig.from_pretrained(resolve_model_path("embedded:tiny-arith-qwen2"))


def tiny_tokenizer():
    """The shipped tiny model's tokenizer."""
    from nemo_like.models.loading import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path("embedded:tiny-arith-qwen2"))


def prompt_rows(model_dir: str, count: int, per_step: int, steps: int) -> list[tuple[str, int]]:
    """``(prompt text with the chat template applied, answer)`` of the prompts our loader draws from our first ``count``
    arithmetic training prompts in ``steps`` steps of ``per_step`` (the recipe's seed and shuffle, reshuffled each
    epoch), in that order: TRL takes them unshuffled, so every pair's two steps draw the same prompts (a single epoch's
    order, which TRL repeats, differed from the second epoch on)."""
    from nemo_like.config import DEFAULT_RECIPE, load_config
    from nemo_like.data.prompts import PromptDataLoader, build_prompt_dataset

    cfg = load_config(DEFAULT_RECIPE, [f"data.train.num_problems={count}"])
    records = build_prompt_dataset(cfg.data, tokenizer(model_dir), "train", PROMPT_BUDGET)
    loader = PromptDataLoader(records, per_step, cfg.grpo.seed, cfg.data.shuffle)
    drawn = [record for _ in range(steps) for record in loader.next_batch()]
    return [(prompt_text(model_dir, r.prompt_token_ids), r.metadata["answer"]) for r in drawn]


def prompt_text(model_dir: str, ids: list[int]) -> str:
    """A prompt's text as TRL gets it (special tokens kept: the chat template's markers)."""
    return tokenizer(model_dir).decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------------------------------------------
# Our side
# ---------------------------------------------------------------------------------------------------
class OurRun:
    """Our sync GRPO loop on the workload, one step per :meth:`step` call (the loop's own step function)."""

    def __init__(self, model_dir: str, work: dict, backend: str, log_dir: str, extra: list[str]) -> None:
        from recipe_runs import quiet_config

        from nemo_like.algorithms.grpo import SyncSteps
        from nemo_like.algorithms.setup import setup_grpo

        overrides = [
            f"policy.model_name={model_dir}",
            f"grpo.num_prompts_per_step={work['prompts']}",
            f"grpo.num_generations_per_prompt={work['generations']}",
            f"policy.generation.max_new_tokens={work['new_tokens']}",
            f"policy.max_total_sequence_length={PROMPT_BUDGET + work['new_tokens']}",
            "loss_fn.reference_policy_kl_penalty=0",  # beta 0, as TRL's default
            f"data.train.num_problems={PROMPT_SET}",  # TRL's prompt set (prompt_rows): the same texts on both sides
            *([f"policy.generation.backend={backend}"] if backend != "default" else []),
            *extra,
        ]
        self.cfg = quiet_config(log_dir, overrides)
        self.parts = setup_grpo(self.cfg)
        self.steps = SyncSteps(self.parts)
        self.steps.start(0, None)
        from nemo_like.plan.backend import resolve_backend

        self.backend = resolve_backend(self.parts.cfg)[0]  # what "auto" resolved to
        self.precision = self.parts.cfg.policy.precision  # --precision, or an --ours override of it
        self.model_dir = model_dir
        self.count = 0

    def step(self) -> tuple[float, dict[str, float], float, float, list[str]]:
        """``(seconds, phase seconds, generated tokens, training forward tokens per token, prompt texts)`` of one sync
        step."""
        from nemo_like.utils.timer import StepTimer

        upcoming = copy.deepcopy(self.parts.train_loader).next_batch()  # the prompts this step draws (outside the timing)
        prompts = [prompt_text(self.model_dir, r.prompt_token_ids) for r in upcoming]
        self.count += 1
        timer = StepTimer()
        start = time.perf_counter()
        metrics = self.steps.step(self.count, timer)
        seconds = time.perf_counter() - start
        forward_share = metrics["performance/training_forward_tokens_per_token"]
        return seconds, dict(timer.seconds), metrics["performance/num_generated_tokens"], forward_share, prompts

    def close(self) -> None:
        self.parts.shutdown()


def trl_spec(
    model_dir: str, tmp: str, rows: list, work: dict, threads: int | None, gradient_checkpointing: bool, precision: str
) -> dict[str, Any]:
    """What :func:`trl_worker` reads: the model, a scratch folder, the prompt rows in order, the workload and TRL's
    settings (torch threads, None: torch's default; gradient checkpointing; precision)."""
    return {
        "model_dir": model_dir,
        "tmp": tmp,
        "dataset": rows,
        "threads": threads,
        "gradient_checkpointing": gradient_checkpointing,
        "precision": precision,
        **work,
    }


def load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def print_pair(label: str, i: int, warmup: int, text: str) -> None:
    """One pair's line (pair ``i``, counted from 0; the first ``warmup`` are marked)."""
    print(f"  [{label}] pair {i + 1}: {text}" + ("  (warm-up)" if i < warmup else ""), flush=True)


def one_pair(i: int, trl: TRLProcess, ours: Callable[[], Any]) -> tuple[tuple[float, list[str], int], Any, float]:
    """Pair ``i``: one TRL step and one of ``ours``, TRL first in even pairs (both sides see the same load); returns what
    TRL's step returned, what ``ours`` returned and the mean 1-minute load around the pair."""
    load_before = load1()
    if i % 2 == 0:
        t_trl = trl.step()
        result = ours()
    else:
        result = ours()
        t_trl = trl.step()
    return t_trl, result, (load_before + load1()) / 2


def run_pairs(name: str, work: dict, backend: str, args, tmp: str, model_dir: str, n_params: int, rows) -> dict:
    """Alternate TRL and our steps on one workload; returns the figures."""
    from nemo_like.utils.flops import measure_matmul_flops

    spec = trl_spec(model_dir, tmp, rows, work, args.trl_threads, not args.trl_no_gradient_checkpointing, args.precision)
    trl = TRLProcess(args.trl_python, spec)
    ours = OurRun(model_dir, work, backend, f"{tmp}/ours-{name}-{backend}", [f"policy.precision={args.precision}", *args.ours])
    pairs, probes = [], []
    batch = work["prompts"] * work["generations"]
    expected = batch * work["new_tokens"]  # generated tokens a step of either side should run
    if ours.precision != args.precision:
        print(
            f"  note: ours runs {ours.precision} (an --ours override), TRL and the matmul probe {args.precision}: "
            "the floors are at the probe's rate",
            flush=True,
        )
    try:
        for i in range(args.warmup + args.steps):
            (t_trl, trl_prompts, trl_tokens), (t_ours, phases, tokens, forward_share, our_prompts), load = one_pair(i, trl, ours.step)
            pairs.append(
                {
                    "trl": t_trl,
                    "ours": t_ours,
                    "phases": phases,
                    "tokens": tokens,
                    "trl_tokens": trl_tokens,
                    "forward": forward_share,
                    "load": load,
                    "same_prompts": set(trl_prompts) == set(our_prompts),
                }
            )
            probes.append(measure_matmul_flops(args.precision, seconds=0.3, threads=2))  # the machine's matmul rate now
            print_pair(
                f"{name} {ours.backend}",
                i,
                args.warmup,
                f"TRL {t_trl:.3f}s  ours {t_ours:.3f}s  ratio {t_ours / t_trl:.2f}  load {load:.2f}"
                + ("" if trl_tokens == expected else f"  (TRL's completions stopped early: {trl_tokens} of {expected} tokens)"),
            )
    finally:
        trl.close()
        ours.close()
    steady = pairs[args.warmup :]
    # Over every prompt both sides draw in the pairs (the first step's prompts alone put W1's floor 9% high)
    mean_prompt = statistics.mean(len_tokens(model_dir, r[0]) for r in rows)
    trained_tokens = batch * (mean_prompt + work["new_tokens"])
    peak = args.peak_gflops * 1e9
    return {
        "workload": name,
        "backend": ours.backend,
        "precisions": f"{'bfloat16' if trl.info['bf16'] else 'float32'} / {ours.precision}",
        "trl_info": trl.info,
        "trl": statistics.median(p["trl"] for p in steady),
        "ours": statistics.median(p["ours"] for p in steady),
        "ratios": [p["ours"] / p["trl"] for p in steady],
        "phases": {k: statistics.median(p["phases"].get(k, 0.0) for p in steady) for k in OUR_PHASES},
        "tokens_ok": f"{all(p['tokens'] == expected for p in pairs)} / {all(p['trl_tokens'] == expected for p in pairs)}",
        "same_prompts": all(p["same_prompts"] for p in pairs),
        "load": [p["load"] for p in steady],
        "params": n_params,
        "train_floor": 6 * n_params * trained_tokens / peak,
        "gen_floor": 2 * n_params * (batch * mean_prompt + expected) / peak,
        "probed_gflops": statistics.median(probes[args.warmup :]) / 1e9,
        "train_floor_probed": 6 * n_params * trained_tokens / statistics.median(probes[args.warmup :]),
        "gen_floor_probed": 2 * n_params * (batch * mean_prompt + expected) / statistics.median(probes[args.warmup :]),
        # our sampler runs each distinct prompt once, then one token per row a step (the last token is never fed back)
        "gen_computed_share": (work["prompts"] * mean_prompt + batch * (work["new_tokens"] - 1)) / (batch * mean_prompt + expected),
        "forward_share": statistics.median(p["forward"] for p in steady),
    }


def len_tokens(model_dir: str, text: str) -> int:
    return len(tokenizer(model_dir)(text, add_special_tokens=False)["input_ids"])


@functools.cache
def tokenizer(model_dir: str):
    from nemo_like.models.loading import load_tokenizer

    return load_tokenizer(model_dir)


def report(results: list[dict]) -> str:
    lines = [
        "",
        "| workload | backend | precision (TRL / ours) | TRL s/step | ours s/step | ours/TRL (pairs) | median ratio | load (1 min) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratios = " ".join(f"{x:.2f}" for x in r["ratios"])
        load = f"{min(r['load']):.1f}-{max(r['load']):.1f}"
        lines.append(
            f"| {r['workload']} | {r['backend']} | {r['precisions']} | {r['trl']:.3f} | {r['ours']:.3f} | {ratios} | "
            f"**{statistics.median(r['ratios']):.2f}** | {load} |"
        )
    lines += ["", "Our phases (median s) and FLOP floors (6 x params x trained tokens, 2 x params x generated+prompt tokens):", ""]
    lines.append(
        "| workload | backend | "
        + " | ".join(OUR_PHASES)
        + " | training floor | generation floor | all completions full length (ours / TRL) "
        "| same prompts each pair | matmul GFLOP/s probed between pairs | training / floor at the probed rate | training forward tokens per token "
        "| training / floor of the tokens computed, probed rate | generation / floor at the probed rate "
        "| generation / floor of the tokens computed, probed rate | step / both floors at the probed rate |"
    )
    lines.append("|---|---|" + "---|" * len(OUR_PHASES) + "---|" * 11)
    for r in results:
        phases = " | ".join(f"{r['phases'][k]:.3f}" for k in OUR_PHASES)
        lines.append(
            f"| {r['workload']} ({r['params'] / 1e6:.1f}M) | {r['backend']} | {phases} | {r['train_floor']:.3f} | "
            f"{r['gen_floor']:.3f} | {r['tokens_ok']} | {r['same_prompts']} | {r['probed_gflops']:.0f} | "
            f"{r['phases']['policy_training'] / r['train_floor_probed']:.2f}x | {r['forward_share']:.2f} | "
            f"{r['phases']['policy_training'] / (r['train_floor_probed'] * r['forward_share']):.2f}x | "
            f"{r['phases']['generation'] / r['gen_floor_probed']:.2f}x | "
            f"{r['phases']['generation'] / (r['gen_floor_probed'] * r['gen_computed_share']):.2f}x | "
            f"{r['ours'] / (r['train_floor_probed'] + r['gen_floor_probed']):.2f}x |"
        )
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--trl-worker":
        trl_worker(json.loads(sys.argv[2]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="W1,W2")
    p.add_argument("--backends", default="default", help="comma list of default, vllm, hf (default: the recipe's choice)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--trl-python", default=".venv-trl/bin/python")
    p.add_argument("--trl-threads", type=int, default=None, help="torch threads of the TRL process (default: torch's)")
    p.add_argument("--trl-no-gradient-checkpointing", action="store_true")
    p.add_argument(
        "--peak-gflops",
        type=float,
        default=178.0,
        help="fixed matmul GFLOP/s of the floors (178: this machine's fp32 rate once; the rate is also probed between pairs)",
    )
    p.add_argument(
        "--precision",
        default="float32",
        choices=["float32", "bfloat16"],
        help="both sides' compute dtype over float32 weights (ours: policy.precision; TRL: bf16, its own default); "
        "the matmul probe runs in it too",
    )
    p.add_argument("--ours", nargs="*", default=[], help="extra key=value overrides for our side")
    args = p.parse_args()
    if not Path(args.trl_python).exists():
        print(f"error: no TRL python at {args.trl_python}; run `make bench-trl-venv` first (or pass --trl-python)", file=sys.stderr)
        return 2
    random.seed(0)
    results = []
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmp:
        for name in args.workloads.split(","):
            work = WORKLOADS[name]
            model_dir, n_params = build_model(Path(tmp) / f"model-{work['size']}", work["size"])
            rows = prompt_rows(model_dir, PROMPT_SET, work["prompts"], args.warmup + args.steps)
            for backend in args.backends.split(","):
                print(f"[{name}] {n_params / 1e6:.2f}M params, {work}, backend {backend}, --precision {args.precision}", flush=True)
                results.append(run_pairs(name, work, backend, args, tmp, model_dir, n_params, rows))
                print(report(results[-1:]), flush=True)
    print("\n=== vs TRL: all runs ===" + report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
