#!/usr/bin/env python
"""Deterministically rebuild the shipped tiny arithmetic model ``nemo_like/assets/tiny-arith-qwen2``.

Steps (CPU only, no network, ~3-4 minutes on 2 cores):
  1. train a byte-level BPE tokenizer (every digit its own token) on synthetic chat text from
     the arithmetic generator and wrap it as ``PreTrainedTokenizerFast`` with a Qwen-style chat
     template;
  2. build a small ``Qwen2ForCausalLM`` (fp32, tied embeddings), seeded;
  3. warm-start it with a supervised pass on TRAIN problems (loss only on the answer tokens and
     the closing ``<|im_end|>``), fully seeded and single-process, in two phases:
       * clean phase: plain cross-entropy, until the model computes most answers correctly;
       * softening phase (the last ``--smooth-steps`` steps, at the decayed learning rate):
         cross-entropy with label smoothing *restricted to the answer alphabet* (the ten digits
         and ``<|im_end|>``). The model keeps ranking the right token first (greedy accuracy
         stays high) but spreads probability over wrong digits and wrong lengths, so sampling
         at T=1.0 is right only ~15-35% of the time. The errors stay inside the answer format,
         which is exactly what GRPO sharpens quickly in the demo;
  4. measure greedy and sampled (T=1.0, no top-k/top-p) exact-match accuracy on validation
     problems with HF ``generate``, and save model, tokenizer, generation config and
     ``build_info.json``.

Usage:
  python scripts/build_tiny_model.py [--out DIR] [--sft-steps N] [--seed S]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from nemo_like.data.arithmetic import (  # noqa: E402
    DEFAULT_SYSTEM_PROMPT,
    ArithmeticProblem,
    format_messages,
    format_response,
    make_arithmetic_problems,
)
from nemo_like.environments.arithmetic_reward import score_response  # noqa: E402

SCRIPT_VERSION = "1.0"
DEFAULT_OUT = REPO_ROOT / "nemo_like" / "assets" / "tiny-arith-qwen2"

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, EOS_TOKEN]  # ids 0, 1, 2
VOCAB_SIZE = 384  # upper bound; the closed-domain corpus runs out of merges before it
MAX_POSITIONS = 256

#: Split pattern of transformers' ``Qwen2Tokenizer`` (copied so the trained pipeline matches it).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MODEL_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}

EVAL_SEED = 1234
EVAL_N = 256
MAX_NEW_TOKENS = 8


# ----------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------
def _tokenizer_corpus(seed: int) -> list[str]:
    """Synthetic chat text (train problems only, some with the default system prompt)."""
    texts = []
    for i, p in enumerate(make_arithmetic_problems(4000, seed, "train")):
        system = DEFAULT_SYSTEM_PROMPT if i % 4 == 0 else None
        turns = format_messages(p, system) + [{"role": "assistant", "content": format_response(p)}]
        texts.append("".join(f"{IM_START}{m['role']}\n{m['content']}{EOS_TOKEN}\n" for m in turns))
    return texts


def build_tokenizer(
    seed: int,
    corpus: list[str] | None = None,
    vocab_size: int = VOCAB_SIZE,
    chat_template: str = CHAT_TEMPLATE,
    extra_tokens: tuple[str, ...] = (),
) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer and wrap it with the chat template and specials.

    The normalizer and pre-tokenizer are exactly the ones ``Qwen2Tokenizer`` installs, because
    ``AutoTokenizer`` loads any ``qwen2`` model dir as ``Qwen2Tokenizer`` and replaces them: with
    the same pipeline here, the tokenizer used for the warm start and the one every consumer
    loads agree token for token (checked after saving). Its split pattern isolates every digit
    (``\\p{N}``), the same as a ``Digits(individual_digits=True)`` step, so numbers are
    sequences of single-digit tokens.

    The defaults build this model's tokenizer; ``scripts/build_tiny_tool_model.py`` passes its own
    corpus, vocabulary bound, template and ``extra_tokens`` (added as whole, non-special tokens).
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus if corpus is not None else _tokenizer_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",
        additional_special_tokens=[IM_START],
        model_max_length=MAX_POSITIONS,
    )
    if extra_tokens:
        fast.add_tokens(list(extra_tokens))
    fast.chat_template = chat_template
    return fast


def check_saved_tokenizer(out: Path, tok: PreTrainedTokenizerFast) -> None:
    """Raise if the tokenizer reloaded from ``out`` encodes task text differently from ``tok``."""
    loaded = AutoTokenizer.from_pretrained(out)
    for p in make_arithmetic_problems(200, 0, "validation"):
        text = tok.apply_chat_template(format_messages(p), add_generation_prompt=True, tokenize=False)
        text += format_response(p) + EOS_TOKEN
        if loaded(text, add_special_tokens=False)["input_ids"] != tok(text, add_special_tokens=False)["input_ids"]:
            raise RuntimeError(f"saved tokenizer in {out} encodes {text!r} differently")
    if loaded.eos_token_id != tok.eos_token_id or loaded.pad_token_id != tok.pad_token_id:
        raise RuntimeError("saved tokenizer has different eos/pad ids")


# ----------------------------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------------------------
def build_model(tok: PreTrainedTokenizerFast, seed: int) -> Qwen2ForCausalLM:
    """A freshly initialised fp32 Qwen2ForCausalLM with tied embeddings (seeded)."""
    cfg = Qwen2Config(
        vocab_size=len(tok),
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **MODEL_SHAPE,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        max_new_tokens=MAX_NEW_TOKENS,
    )
    return model


# ----------------------------------------------------------------------------------------------
# supervised warm start
# ----------------------------------------------------------------------------------------------
def encode_example(tok: PreTrainedTokenizerFast, problem: ArithmeticProblem) -> tuple[list[int], int]:
    """Token ids of prompt + answer + ``<|im_end|>``, and the prompt length (loss starts there)."""
    prompt = tok.apply_chat_template(format_messages(problem), add_generation_prompt=True, tokenize=False)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    answer_ids = tok.encode(format_response(problem), add_special_tokens=False)
    return prompt_ids + answer_ids + [tok.eos_token_id], len(prompt_ids)


def collate(examples: list[tuple[list[int], int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch for training; ``labels`` is -100 outside the answer tokens."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for row, (ids, prompt_len) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        labels[row, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def answer_alphabet_ids(tok: PreTrainedTokenizerFast) -> torch.Tensor:
    """Token ids of ``0``..``9`` and ``<|im_end|>``: the tokens an answer is made of."""
    ids = [tok.convert_tokens_to_ids(str(d)) for d in range(10)] + [tok.eos_token_id]
    if len(set(ids)) != 11 or tok.unk_token_id in ids:
        raise RuntimeError(f"digits are not single tokens: {ids}")
    return torch.tensor(ids)


def sft_loss(logits: torch.Tensor, labels: torch.Tensor, alphabet: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Mean next-token loss over the answer tokens: ``(1 - smoothing) * NLL(target) +
    smoothing * mean_{t in alphabet} NLL(t)`` (plain cross-entropy when ``smoothing == 0``)."""
    targets = labels[:, 1:]
    mask = targets != -100
    logprobs = torch.log_softmax(logits[:, :-1][mask].float(), dim=-1)  # [n_answer_tokens, V]
    nll = -logprobs.gather(-1, targets[mask].unsqueeze(-1)).squeeze(-1)
    if smoothing == 0.0:
        return nll.mean()
    spread = -logprobs[:, alphabet].mean(-1)
    return ((1.0 - smoothing) * nll + smoothing * spread).mean()


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of ``peak`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def sft(model: Qwen2ForCausalLM, tok: PreTrainedTokenizerFast, args: argparse.Namespace) -> None:
    """Supervised warm start on train problems: clean phase, then the softening phase."""
    problems = make_arithmetic_problems(args.sft_steps * args.batch_size, args.seed, "train")
    alphabet = answer_alphabet_ids(tok)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.98))
    model.train()
    start = time.perf_counter()
    for step in range(args.sft_steps):
        chunk = problems[step * args.batch_size : (step + 1) * args.batch_size]
        batch = collate([encode_example(tok, p) for p in chunk], tok.pad_token_id)
        labels = batch.pop("labels")
        smoothing = args.smoothing if step >= args.sft_steps - args.smooth_steps else 0.0
        for group in optim.param_groups:
            group["lr"] = lr_at(step, args.sft_steps, args.lr, args.warmup)
        loss = sft_loss(model(**batch).logits, labels, alphabet, smoothing)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == args.sft_steps - 1:
            print(
                f"sft step {step:5d}/{args.sft_steps} loss {loss.item():.4f} smoothing {smoothing:.2f} "
                f"lr {optim.param_groups[0]['lr']:.2e} ({time.perf_counter() - start:.0f}s)",
                flush=True,
            )
        if args.eval_every and (step + 1) % args.eval_every == 0:
            _print_eval(model, tok, step + 1)
            model.train()
    model.eval()


# ----------------------------------------------------------------------------------------------
# evaluation
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(
    model: Qwen2ForCausalLM, tok: PreTrainedTokenizerFast, problems: list[ArithmeticProblem], do_sample: bool, seed: int = 0
) -> float:
    """Exact-match accuracy of one response per problem: greedy, or sampled at T=1.0 with no
    top-k/top-p (``top_k=0`` overrides the HF default of 50)."""
    prompts = [tok.apply_chat_template(format_messages(p), add_generation_prompt=True, tokenize=False) for p in problems]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    if do_sample:
        out = model.generate(**enc, max_new_tokens=MAX_NEW_TOKENS, do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
    else:
        out = model.generate(**enc, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(score_response(t, p.answer) for t, p in zip(texts, problems)) / len(problems)


def _print_eval(model: Qwen2ForCausalLM, tok: PreTrainedTokenizerFast, step: int) -> None:
    """Print greedy and sampled validation accuracy (``--eval-every``; leaves the RNG untouched)."""
    model.eval()
    rng_state = torch.get_rng_state()
    val = make_arithmetic_problems(EVAL_N, EVAL_SEED, "validation")
    greedy = evaluate(model, tok, val, do_sample=False)
    sampled = evaluate(model, tok, val, do_sample=True, seed=EVAL_SEED)
    torch.set_rng_state(rng_state)
    print(f"  eval @ step {step}: greedy {greedy:.3f} sampled {sampled:.3f}", flush=True)


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (the defaults build the shipped model)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output model dir (default: the shipped one)")
    p.add_argument("--sft-steps", type=int, default=1650, help="total SFT steps (both phases)")
    p.add_argument("--smooth-steps", type=int, default=150, help="the last N steps use answer-alphabet smoothing")
    p.add_argument("--smoothing", type=float, default=0.36, help="label smoothing mass of the softening phase")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--log-every", type=int, default=150)
    p.add_argument(
        "--eval-every", type=int, default=0, help="also print validation accuracy every N SFT steps (tuning aid; changes no weights)"
    )
    args = p.parse_args(argv)
    if not 0 <= args.smooth_steps <= args.sft_steps:
        p.error("--smooth-steps must be between 0 and --sft-steps")
    return args


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_info(args: argparse.Namespace, tok: PreTrainedTokenizerFast, n_params: int, greedy: float, sampled: float) -> dict:
    """The contents of ``build_info.json`` (no timings, so rebuilding gives the same file)."""
    return {
        "script": "scripts/build_tiny_model.py",
        "script_version": SCRIPT_VERSION,
        "seed": args.seed,
        "sft_steps": args.sft_steps,
        "smooth_steps": args.smooth_steps,
        "smoothing": args.smoothing,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "warmup": args.warmup,
        "weight_decay": args.weight_decay,
        "num_params": n_params,
        "model_shape": MODEL_SHAPE,
        "vocab_size": len(tok),
        "special_tokens": {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS},
        "eval": {
            "split": "validation",
            "n": EVAL_N,
            "problems_seed": EVAL_SEED,
            "max_new_tokens": MAX_NEW_TOKENS,
            "greedy_accuracy": greedy,
            "sampled_accuracy_t1": sampled,
        },
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
    }


def main(argv: list[str] | None = None) -> int:
    """Build, warm-start, evaluate and save the tiny model."""
    args = parse_args(argv)
    t0 = time.perf_counter()
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    random.seed(args.seed)

    tok = build_tokenizer(args.seed)
    model = build_model(tok, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tokenizer: vocab {len(tok)}; model: {n_params:,} params", flush=True)

    sft(model, tok, args)
    t_sft = time.perf_counter() - t0
    val = make_arithmetic_problems(EVAL_N, EVAL_SEED, "validation")
    greedy = evaluate(model, tok, val, do_sample=False)
    sampled = evaluate(model, tok, val, do_sample=True, seed=EVAL_SEED)
    print(f"validation ({EVAL_N} problems): greedy accuracy {greedy:.3f}, sampled (T=1.0) accuracy {sampled:.3f}")

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    check_saved_tokenizer(args.out, tok)
    info = build_info(args, tok, n_params, greedy, sampled)
    (args.out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(
        f"saved to {args.out}; SFT {t_sft:.0f}s, total {time.perf_counter() - t0:.0f}s; "
        f"model.safetensors sha256 {sha256_of(args.out / 'model.safetensors')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
