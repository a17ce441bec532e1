"""``nemo-like serve --config RECIPE [overrides]``: the rollout server without training, on the recipe's model.

Serves ``eval.model_path`` when set (a model directory, a checkpoint step directory or a checkpoint directory's latest
step), else ``policy.model_name``, in this process (:class:`~.local_engine.LocalGeneration`), on 127.0.0.1, with a
random key, so an agent can be written and debugged against the model before a run trains it (any session id works:
sessions are created by their first call). Prints the base URL and the key, serves until Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from nemo_like.config.errors import ConfigError
from nemo_like.models.generation.lean_decoder import model_sampling_problem
from nemo_like.models.loading import (
    check_context_length,
    check_generative,
    check_stop_token_ids,
    end_of_sequence_ids,
    eval_tokenizer,
    model_vocab_size,
    resolve_checkpoint_model,
)
from nemo_like.serving.local_engine import LocalGeneration
from nemo_like.serving.server import RolloutServer, ServerConfig
from nemo_like.serving.service import run_sampling
from nemo_like.utils.stop_signals import (
    STOP_SIGNALS,
    call_handling_signals,
    command_stop,
    restore_handlers,
    wait_handling_signals,
)

STANDALONE_KEPT_RESULTS = 1000  # ended sessions whose result a repeated end still returns


def served_model(cfg: Any) -> str:
    """The model to serve: ``eval.model_path`` (resolved as ``nemo-like eval`` resolves it: a checkpoint's ``policy/``
    weights or LoRA adapters, a checkpoint directory's latest valid step) or ``policy.model_name``."""
    model_path = getattr(cfg.eval, "model_path", None)
    return cfg.policy.model_name if model_path is None else resolve_checkpoint_model(model_path, "eval.model_path")


def build_server(cfg: Any, port: int = 0) -> RolloutServer:
    """The server over the recipe's model (not started): the recipe's tokenizer, context (``policy.max_total_sequence_length``)
    and seed; sessions are created by their first call."""
    model = served_model(cfg)
    key = "policy.model_name" if getattr(cfg.eval, "model_path", None) is None else "eval.model_path"
    check_context_length(model, cfg.policy.max_total_sequence_length)  # the server's context
    check_stop_token_ids(model, cfg.policy.generation.stop_token_ids)
    check_generative(model, key)  # a reward model's score head was served as random logits
    if problem := model_sampling_problem(model):  # every request failed with the sampler's refusal
        raise ConfigError(f"{key}={model!r}: nemo-like serve samples with the HF sampler, which cannot sample {problem}")
    tokenizer, _ = eval_tokenizer(cfg, model)  # as nemo-like eval: the model directory's own, checked against its rows
    eos_ids = end_of_sequence_ids(tokenizer, model)
    engine = LocalGeneration.load(model, tokenizer.pad_token_id, eos_ids, cfg.policy.precision, tokenizer)
    config = ServerConfig(
        port=port,
        max_context=cfg.policy.max_total_sequence_length,
        seed=cfg.grpo.seed,
        run_sampling=run_sampling(cfg.policy.generation, enforce=False),  # the recipe's as defaults: an agent is free
        vocab_size=model_vocab_size(model),
        max_kept_results=STANDALONE_KEPT_RESULTS,  # nothing takes them: memory would grow with every session ended
    )
    return RolloutServer(engine, tokenizer, config, eos_token_ids=eos_ids)


def unused_settings(cfg: Any) -> list[str]:
    """The recipe's settings a user may expect ``serve`` to follow that it does not: ``eval.*`` keys besides
    ``model_path`` set away from their defaults (``nemo-like eval``'s), a generation backend other than the in-process
    HF sampler it always runs. One line each, for a warning."""
    lines = []
    defaults = type(cfg.eval)().model_dump()
    changed = [k for k, v in cfg.eval.model_dump().items() if k != "model_path" and v != defaults[k]]
    if changed:
        keys = ", ".join(f"eval.{k}" for k in changed)
        lines.append(
            f"{keys} {'has' if len(changed) == 1 else 'have'} no effect in nemo-like serve (nemo-like eval's; an agent's request sets its own sampling)"
        )
    if (backend := cfg.policy.generation.backend) not in ("auto", "hf"):
        lines.append(
            f"policy.generation.backend={backend} has no effect in nemo-like serve: it samples in its own process with the HF sampler"
        )
    return lines


def serve(cfg: Any, port: int = 0, stop: threading.Event | None = None) -> int:
    """Serve until Ctrl-C or SIGTERM (or ``stop`` is set); prints ``base_url`` and ``api_key`` lines to stdout first.
    Returns 0, or 130 / 143 when a signal stopped it (after the server's stop: it serves what was queued, up to a
    minute). A second signal while the server stops exits at once with its status (it raised out of the stop with a
    traceback)."""
    for line in unused_settings(cfg):
        print(f"warning: {line}", file=sys.stderr, flush=True)
    server = build_server(cfg, port).start()
    try:  # a Ctrl-C from here on stops the server
        print(f"base_url: {server.base_url}", flush=True)
        print(f"api_key: {server.api_key}", flush=True)
        print(f"model: {server.config.model_name} (serving {served_model(cfg)}); Ctrl-C stops", file=sys.stderr, flush=True)
        wait_handling_signals(stop or threading.Event())
        status = 0
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM under the CLI (CommandStopped): the server stops as asked
        stopped = command_stop(exc)
        status = stopped.status
        print(f"stopping the server ({stopped.signal.name}; send it again to exit at once)", file=sys.stderr, flush=True)
    finally:
        with interrupt_exits_at_once():
            call_handling_signals(server.stop)
    return status


def _exit_at_once(signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    print(f"stopped at once (a second {name})", file=sys.stderr, flush=True)
    os._exit(128 + signum)


@contextlib.contextmanager
def interrupt_exits_at_once() -> Iterator[None]:
    """Inside, SIGINT and SIGTERM end the process at once with status 130 / 143 and one line, no traceback (restored
    after); only where this is the main thread (only it can set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _exit_at_once) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        restore_handlers(previous)
