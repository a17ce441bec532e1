"""The OpenAI-compatible rollout server: agents written against the OpenAI client sample from the run's engine, and
every call is recorded token for token in a session that ends as training rows (``docs/guides/agents.md``)."""

from nemo_like.serving.server import RolloutServer, ServerConfig
from nemo_like.serving.sessions import SessionStore
from nemo_like.serving.trajectory import CallRecord, RowBatch, SessionRows, TrainingRow, rows_for_training, session_rows

__all__ = [
    "CallRecord",
    "RolloutServer",
    "RowBatch",
    "ServerConfig",
    "SessionRows",
    "SessionStore",
    "TrainingRow",
    "rows_for_training",
    "session_rows",
]
