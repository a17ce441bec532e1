#!/usr/bin/env python
"""Deterministically build ``nemo_like/assets/tiny-tool-qwen2``: the tiny Qwen2 model warm-started on the
``tool-arith`` task (3-digit x 2-digit products) in the calculator tool's format, for the multi-turn demo.

Same architecture as ``tiny-arith-qwen2`` (``scripts/build_tiny_model.py``, whose tokenizer and model
builders this reuses); what differs:

1. tokenizer: BPE trained on tool trajectories, with ``<tool_call>``, ``</tool_call>`` and the calculator call's
   fixed JSON (``{"name": "calculator", "arguments": {"expression": "`` and ``"}}``) as whole (non-special)
   tokens so a call is about 10 tokens; its chat template puts no newline after ``<|im_end|>``, so the
   conversation the rollout concatenates turn by turn (sampled ids up to ``<|im_end|>``, then the next turn's
   ``<|im_start|>...`` tokens) is exactly what the template renders;
2. supervised warm start (loss on assistant tokens only, each turn's ``<|im_end|>`` included) on a mix:
   a ``--tool-fraction`` share of tool trajectories::

       user: What is 347 times 28?
       assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "347*28"}}</tool_call>
       tool: 9716
       assistant: 9716

   and direct answers (``assistant: 9716``) for the rest. A 1M-parameter model cannot multiply, so direct
   answers are almost always wrong while the tool path is a copy task it learns well. The first assistant
   token is the decision (call or answer); it is trained on only part of the tool trajectories, so the
   decisions the model sees choose the tool at ``--tool-rate`` while the copy skill trains on
   ``--tool-fraction`` of the examples: the starting model calls the tool on about ``--tool-rate`` of
   samples, and RL can raise that share;
3. evaluation with HF ``generate`` and the real :class:`~nemo_like.environments.tools.environment.ToolEnvironment`
   in a two-turn driver loop (greedy and sampled at T=1.0), recorded in ``build_info.json``.

Usage:
  python scripts/build_tiny_tool_model.py [--out DIR] [--sft-steps N] [--tool-fraction F] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

import build_tiny_model as base  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2ForCausalLM  # noqa: E402

from nemo_like.data.multiturn_tasks import make_multiply_problems  # noqa: E402
from nemo_like.environments.tools.environment import ToolEnvironment  # noqa: E402
from nemo_like.environments.tools.parsing import CLOSE_TAG, OPEN_TAG, format_tool_call  # noqa: E402

SCRIPT_VERSION = "1.0"
DEFAULT_OUT = base.REPO_ROOT / "nemo_like" / "assets" / "tiny-tool-qwen2"
VOCAB_SIZE = 512
#: The tiny-arith template without the newline after ``<|im_end|>`` (see the module docstring).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MAX_NEW_TOKENS = 16
#: Whole tokens for the calculator call's fixed JSON, so a call is ~10 tokens (the tags, this prefix, the
#: expression's characters, the suffix).
CALL_PREFIX = '{"name": "calculator", "arguments": {"expression": "'
CALL_SUFFIX = '"}}'

EVAL_N = 256
EVAL_SEED = 1234


def trajectory(problem: dict[str, str], use_tool: bool) -> list[dict[str, str]]:
    """The chat messages of one warm-start example (user turn first)."""
    messages = [{"role": "user", "content": problem["problem"]}]
    if use_tool:
        a, b = [int(t) for t in problem["problem"].replace("?", " ").replace(".", " ").split() if t.isdigit()]
        messages += [
            {"role": "assistant", "content": format_tool_call("calculator", {"expression": f"{a}*{b}"})},
            {"role": "tool", "content": problem["answer"]},
        ]
    return messages + [{"role": "assistant", "content": problem["answer"]}]


def encode(tok: PreTrainedTokenizerFast, messages: list[dict[str, str]], train_decision: bool = True) -> tuple[list[int], list[int]]:
    """Token ids of the conversation turn by turn (each turn tokenised once), and the loss mask:
    1 on assistant contents and their ``<|im_end|>``, 0 elsewhere; with ``train_decision=False`` also 0 on the
    first assistant token (the choice between calling the tool and answering)."""
    ids: list[int] = []
    mask: list[int] = []
    for message in messages:
        header = tok.encode(f"<|im_start|>{message['role']}\n", add_special_tokens=False)
        body = tok.encode(message["content"], add_special_tokens=False) + [tok.eos_token_id]
        body_mask = [1 if message["role"] == "assistant" else 0] * len(body)
        if message["role"] == "assistant" and not train_decision and 1 not in mask:
            body_mask[0] = 0
        ids += header + body
        mask += [0] * len(header) + body_mask
    return ids, mask


def decision_keep_probability(tool_fraction: float, tool_rate: float) -> float:
    """Share of tool trajectories whose first token (the decision) is trained, so that the trained decisions
    choose the tool at ``tool_rate`` while the copy skill sees ``tool_fraction`` of the examples:
    ``f q / (f q + 1 - f) = r``."""
    if tool_rate >= tool_fraction:
        return 1.0
    return tool_rate * (1 - tool_fraction) / (tool_fraction * (1 - tool_rate))


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Right-padded inputs and labels (-100 where the mask is 0)."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for row, (ids, mask) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        labels[row, : len(ids)] = torch.where(torch.tensor(mask) == 1, torch.tensor(ids), torch.tensor(-100))
    return {"input_ids": input_ids, "attention_mask": attention}, labels


def build_tool_tokenizer(seed: int) -> PreTrainedTokenizerFast:
    """BPE over tool trajectories and direct answers, with the call tags as whole tokens."""
    problems = make_multiply_problems(4000, seed, "train")
    corpus = [
        "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>" for m in trajectory(p, i % 2 == 0)) for i, p in enumerate(problems)
    ]
    for whole in (OPEN_TAG, CALL_PREFIX, CALL_SUFFIX, CLOSE_TAG):  # added as whole tokens below
        corpus = [text.replace(whole, " ") for text in corpus]
    return base.build_tokenizer(seed, corpus, VOCAB_SIZE, CHAT_TEMPLATE, (OPEN_TAG, CALL_PREFIX, CALL_SUFFIX, CLOSE_TAG))


def sft(model: Qwen2ForCausalLM, tok: PreTrainedTokenizerFast, args: argparse.Namespace) -> None:
    """Supervised warm start on the mix (see the module docstring), seeded and single-process."""
    problems = make_multiply_problems(args.sft_steps * args.batch_size, args.seed, "train")
    rng = random.Random(f"tool-mix/{args.seed}")
    keep = decision_keep_probability(args.tool_fraction, args.tool_rate)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.98))
    model.train()
    start = time.perf_counter()
    for step in range(args.sft_steps):
        chunk = problems[step * args.batch_size : (step + 1) * args.batch_size]
        examples = []
        for problem in chunk:
            use_tool = rng.random() < args.tool_fraction
            train_decision = not use_tool or rng.random() < keep
            examples.append(encode(tok, trajectory(problem, use_tool), train_decision))
        batch, labels = collate(examples, tok.pad_token_id)
        for group in optim.param_groups:
            group["lr"] = base.lr_at(step, args.sft_steps, args.lr, args.warmup)
        logits = model(**batch).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == args.sft_steps - 1:
            print(f"sft step {step:5d}/{args.sft_steps} loss {loss.item():.4f} ({time.perf_counter() - start:.0f}s)", flush=True)
    model.eval()


@torch.no_grad()
def _generate(model, tok, conversations: list[list[dict[str, str]]], do_sample: bool) -> list[str]:
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    kwargs = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0} if do_sample else {"do_sample": False}
    out = model.generate(**enc, max_new_tokens=MAX_NEW_TOKENS, **kwargs)
    return tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def evaluate(model, tok, problems: list[dict[str, str]], do_sample: bool, seed: int = 0, max_turns: int = 2) -> dict[str, float]:
    """Run up to ``max_turns`` model turns per problem against a real ToolEnvironment; returns the mean
    reward, the share of samples that called the tool, and the reward of tool users and of direct answers."""
    torch.manual_seed(seed)
    env = ToolEnvironment(tools=["calculator"])
    logs = [[{"role": "user", "content": p["problem"]}] for p in problems]
    metas = [{"answer": p["answer"]} for p in problems]
    rewards, used, active = [0.0] * len(problems), [False] * len(problems), list(range(len(problems)))
    for _ in range(max_turns):
        if not active:
            break
        texts = _generate(model, tok, [logs[i] for i in active], do_sample)
        for i, text in zip(active, texts):
            logs[i].append({"role": "assistant", "content": text})
        steps = env.step([logs[i] for i in active], [metas[i] for i in active])
        still = []
        for i, step in zip(active, steps):
            rewards[i] += step.reward
            if step.observation is not None:
                used[i] = True
                logs[i].append(step.observation)
            if not step.terminated:
                still.append(i)
        active = still
    n_tool = sum(used)
    return {
        "reward": sum(rewards) / len(problems),
        "tool_use_rate": n_tool / len(problems),
        # a mean over no sample is undefined (None), not 0.0: a greedy run that always calls the tool has no direct answer
        "reward_with_tool": sum(r for r, u in zip(rewards, used) if u) / n_tool if n_tool else None,
        "reward_direct": sum(r for r, u in zip(rewards, used) if not u) / (len(problems) - n_tool) if n_tool < len(problems) else None,
        "num_with_tool": n_tool,
        "num_direct": len(problems) - n_tool,
    }


def check_saved_tokenizer(out: Path, tok: PreTrainedTokenizerFast) -> None:
    """Raise if the reloaded tokenizer encodes trajectories differently or splits the call tags."""
    loaded = AutoTokenizer.from_pretrained(out)
    for p in make_multiply_problems(100, 0, "validation"):
        text = loaded.apply_chat_template(trajectory(p, True), tokenize=False)
        if loaded(text, add_special_tokens=False)["input_ids"] != tok(text, add_special_tokens=False)["input_ids"]:
            raise RuntimeError(f"saved tokenizer in {out} encodes {text!r} differently")
    for tag in (OPEN_TAG, CLOSE_TAG):
        if len(loaded.encode(tag, add_special_tokens=False)) != 1 or loaded.decode(loaded.encode(tag), skip_special_tokens=True) != tag:
            raise RuntimeError(f"{tag} is not one kept token")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (the defaults build the shipped model)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--sft-steps", type=int, default=400)
    p.add_argument("--tool-fraction", type=float, default=0.6, help="share of warm-start examples that use the tool (copy skill)")
    p.add_argument("--tool-rate", type=float, default=0.25, help="share of trained first-token decisions that call the tool")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the shipped build used 1)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Build, warm-start, evaluate and save the tiny tool model."""
    args = parse_args(argv)
    t0 = time.perf_counter()
    torch.set_num_threads(args.threads)  # part of the recipe: float sums depend on the thread count
    torch.use_deterministic_algorithms(True)
    random.seed(args.seed)
    tok = build_tool_tokenizer(args.seed)
    model = base.build_model(tok, args.seed)
    model.generation_config.max_new_tokens = MAX_NEW_TOKENS
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tokenizer: vocab {len(tok)}; model: {n_params:,} params", flush=True)
    sft(model, tok, args)
    val = make_multiply_problems(EVAL_N, EVAL_SEED, "validation")
    greedy = evaluate(model, tok, val, do_sample=False)
    sampled = evaluate(model, tok, val, do_sample=True, seed=EVAL_SEED)
    print(f"validation ({EVAL_N} problems): greedy {greedy}\n  sampled (T=1.0) {sampled}")
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    check_saved_tokenizer(args.out, tok)
    info = {
        "script": "scripts/build_tiny_tool_model.py",
        "script_version": SCRIPT_VERSION,
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("out", "log_every")},
        "num_params": n_params,
        "model_shape": base.MODEL_SHAPE,
        "vocab_size": len(tok),
        "eval": {"split": "validation", "n": EVAL_N, "problems_seed": EVAL_SEED, "max_turns": 2, "greedy": greedy, "sampled_t1": sampled},
        "versions": {"torch": torch.__version__, "transformers": base.transformers.__version__, "tokenizers": base.tokenizers.__version__},
    }
    (args.out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"saved to {args.out}; total {time.perf_counter() - t0:.0f}s; sha256 {base.sha256_of(args.out / 'model.safetensors')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
