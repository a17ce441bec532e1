"""``nemo-like serve --config RECIPE [overrides]``: the rollout server without training, on the recipe's model.

Serves ``eval.model_path`` when set (a model directory, a checkpoint step directory or a checkpoint directory's latest
step), else ``policy.model_name``, in this process (:class:`~.local_engine.LocalGeneration`), on 127.0.0.1, with a
random key, so an agent can be written and debugged against the model before a run trains it (any session id works:
sessions are created by their first call). Prints the base URL and the key, serves until Ctrl-C.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from nemo_like.models.loading import (
    check_context_length,
    check_stop_token_ids,
    end_of_sequence_ids,
    load_tokenizer,
    model_vocab_size,
    resolve_checkpoint_model,
)
from nemo_like.serving.local_engine import LocalGeneration
from nemo_like.serving.server import RolloutServer, ServerConfig
from nemo_like.serving.service import run_sampling

STANDALONE_KEPT_RESULTS = 1000  # ended sessions whose result a repeated end still returns


def served_model(cfg: Any) -> str:
    """The model to serve: ``eval.model_path`` (resolved as ``nemo-like eval`` resolves it: a checkpoint's ``policy/``
    weights or LoRA adapters, a checkpoint directory's latest valid step) or ``policy.model_name``."""
    model_path = getattr(cfg.eval, "model_path", None)
    return cfg.policy.model_name if model_path is None else resolve_checkpoint_model(model_path, "eval.model_path")


def build_server(cfg: Any, port: int = 0) -> RolloutServer:
    """The server over the recipe's model (not started): the recipe's tokenizer, context (``policy.max_total_sequence_length``)
    and seed; sessions are created by their first call."""
    tokenizer = load_tokenizer(cfg.policy.tokenizer_name or cfg.policy.model_name)
    model = served_model(cfg)
    check_context_length(model, cfg.policy.max_total_sequence_length)  # the server's context
    check_stop_token_ids(model, cfg.policy.generation.stop_token_ids)
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


def serve(cfg: Any, port: int = 0, stop: threading.Event | None = None) -> int:
    """Serve until Ctrl-C (or ``stop`` is set); prints ``base_url`` and ``api_key`` lines to stdout first."""
    server = build_server(cfg, port).start()
    print(f"base_url: {server.base_url}", flush=True)
    print(f"api_key: {server.api_key}", flush=True)
    print(f"model: {server.config.model_name} (serving {served_model(cfg)}); Ctrl-C stops", file=sys.stderr, flush=True)
    try:
        (stop or threading.Event()).wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
