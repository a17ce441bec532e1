"""The rollout server: an OpenAI-compatible HTTP endpoint over a generation engine, run by uvicorn on a thread.

Security model (``docs/guides/agents.md``): it binds to ``127.0.0.1`` unless told otherwise, and a non-loopback host
must be allowed explicitly (``allow_remote``); every request needs the per-run random API key
(``Authorization: Bearer``); the key is never logged or echoed, only handed to the agents the run starts.
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import socket
import threading
from dataclasses import dataclass
from typing import Any

import uvicorn

from nemo_like.models.generation.interface import GenerationInterface
from nemo_like.serving.app import create_app
from nemo_like.serving.batching import GenerationQueue
from nemo_like.serving.rendering import Renderer
from nemo_like.serving.service import CompletionService, Limits, RunSampling
from nemo_like.serving.sessions import SessionStore
from nemo_like.serving.tool_parsers import TOOL_PARSERS

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ServerConfig:
    """How the server listens and what it allows (``port`` 0: a free port; ``api_key`` None: a random one)."""

    host: str = LOOPBACK
    port: int = 0
    api_key: str | None = None
    allow_remote: bool = False  # required for a host that is not a loopback address
    model_name: str = "policy"
    max_context: int | None = None  # None: the tokenizer's model_max_length
    max_n: int = 16
    tool_parser: str = "hermes"
    chat_template: str | None = None  # jinja text overriding the tokenizer's template
    require_session: bool = False
    auto_create_sessions: bool = True
    max_batch: int = 64
    batch_window_s: float = 0.0
    seed: int = 0
    run_sampling: RunSampling | None = None  # the run's temperature / top_p / top_k (defaults; enforced in a training run)
    # The model's rows (models.loading.model_vocab_size); None: the tokenizer's ids. A model padded past its tokenizer
    # samples the padding ids too: a session holding one was refused whole (its tokens untrained, failure_reward).
    vocab_size: int | None = None
    # Ended sessions' results kept for a repeated end (None: until taken, as a training run takes them; the standalone
    # server, whose results nobody takes, keeps the newest few).
    max_kept_results: int | None = None


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _max_context(tokenizer: Any, configured: int | None) -> int:
    if configured is not None:
        return configured
    limit = getattr(tokenizer, "model_max_length", None)
    if not isinstance(limit, int) or limit <= 0 or limit > 10_000_000:
        raise ValueError("the tokenizer does not state its context length; set ServerConfig.max_context")
    return limit


class RolloutServer:
    """Serve ``engine`` over HTTP: ``start()`` (or ``with``), then point agents at :attr:`base_url` with :attr:`api_key`;
    the calls are recorded in :attr:`sessions` (``sessions.end(id, reward)`` -> the session's training rows)."""

    def __init__(
        self, engine: GenerationInterface, tokenizer: Any, config: ServerConfig = ServerConfig(), eos_token_ids: list[int] | None = None
    ) -> None:
        if not is_loopback(config.host) and not config.allow_remote:
            raise ValueError(f"refusing to listen on {config.host!r}: not a loopback address; set allow_remote=True to expose the server")
        self.config = config
        self.api_key = config.api_key or secrets.token_urlsafe(32)
        eos = eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id]
        max_context = _max_context(tokenizer, config.max_context)
        self.queue = GenerationQueue(engine, config.seed, config.max_batch, config.batch_window_s, max_span=max_context)
        vocab = max(len(tokenizer), config.vocab_size or 0)
        self.sessions = SessionStore(
            auto_create=config.auto_create_sessions, vocab_size=vocab, on_end=self.queue.forget, max_kept_results=config.max_kept_results
        )
        minimum = getattr(engine, "MIN_TEMPERATURE", 0.0)
        limits = Limits(config.model_name, max_context, config.max_n, config.require_session, config.run_sampling, minimum)
        renderer = Renderer(tokenizer, config.chat_template)
        self.service = CompletionService(renderer, self.queue, self.sessions, limits, eos, TOOL_PARSERS.get(config.tool_parser))
        self.app = create_app(self.service, self.api_key)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    @property
    def base_url(self) -> str:
        """``http://host:port/v1``: what an OpenAI client takes as ``base_url``."""
        if self.port is None:
            raise RuntimeError("the server is not started")
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self.port}/v1"

    def expect_calls(self, session_id: str) -> None:
        """The agent of ``session_id`` starts now: the engine waits briefly for its first call, so sessions that start
        together are sampled together (:class:`~nemo_like.serving.batching.GenerationQueue`); ending the session
        withdraws it."""
        self.queue.expect(session_id)

    def start(self, timeout_s: float = 30.0) -> RolloutServer:
        """Bind (a free port for ``port`` 0), serve on a daemon thread, and return once it accepts connections."""
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # proto set: asyncio then sets TCP_NODELAY
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.config.host, self.config.port))
            self.port = sock.getsockname()[1]
            config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5)
            self._server = uvicorn.Server(config)
            self._thread = threading.Thread(
                target=lambda: asyncio.run(self._server.serve(sockets=[sock])), name="rollout-server", daemon=True
            )
            self._thread.start()
            ready = threading.Event()
            for _ in range(int(timeout_s / 0.01)):
                if self._server.started or not self._thread.is_alive():
                    ready.set()
                    break
                ready.wait(0.01)
            if not self._server.started:
                raise RuntimeError(f"the rollout server did not start on {self.config.host}:{self.port}")
        except BaseException:  # a port in use, a server that never came up: release the socket and the engine thread
            self.stop()
            sock.close()
            raise
        return self

    def stop(self) -> None:
        """Stop serving and the engine thread (the engine itself belongs to the caller)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.queue.close()

    def __enter__(self) -> RolloutServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
