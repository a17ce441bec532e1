"""The OpenAI-compatible rollout server: agents written against the OpenAI client sample from the run's engine, and
every call is recorded token for token in a session that ends as training rows (``docs/guides/agents.md``)."""

from nemo_like.serving.server import RolloutServer, ServerConfig
from nemo_like.serving.sessions import SessionStore
from nemo_like.serving.trajectory import CallRecord, SessionRows, TrainingRow, session_rows

__all__ = ["CallRecord", "RolloutServer", "ServerConfig", "SessionRows", "SessionStore", "TrainingRow", "session_rows"]
