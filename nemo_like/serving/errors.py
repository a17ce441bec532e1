"""Errors the rollout server answers with, in OpenAI's format.

Every failure becomes ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status an OpenAI client
maps to its exception classes (400 ``BadRequestError``, 401 ``AuthenticationError``, 404 ``NotFoundError``,
409 ``ConflictError``, 422 ``UnprocessableEntityError``, 500 ``InternalServerError``).
"""

from __future__ import annotations

from typing import Any


class ServingError(Exception):
    """A request the server refuses: ``status`` is the HTTP status, the rest fills the OpenAI error body."""

    def __init__(
        self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI's API returns for this error."""
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """``{"error": {...}}`` as OpenAI's API writes it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ServingError:
    """A 400 ``invalid_request_error``."""
    return ServingError(400, message, param=param, code=code)


def unsupported(param: str, detail: str = "") -> ServingError:
    """A 400 for a parameter this server does not implement (rather than silently ignoring it)."""
    extra = f" ({detail})" if detail else ""
    return ServingError(400, f"The parameter '{param}' is not supported by this server{extra}.", param=param, code="unsupported_parameter")


def unauthorized() -> ServingError:
    """A 401 for a missing or wrong API key (the key itself is never echoed)."""
    return ServingError(
        401,
        "Incorrect or missing API key. Pass the run's key as 'Authorization: Bearer <key>'.",
        code="invalid_api_key",
    )


def session_not_found(session_id: str) -> ServingError:
    """A 404 for a session id this server does not know."""
    return ServingError(
        404, f"Session {session_id!r} does not exist.", type="not_found_error", code="session_not_found", param="session_id"
    )


def session_ended(session_id: str) -> ServingError:
    """A 409 for a call in a session that already ended (its rows are built; a new call cannot join them)."""
    return ServingError(409, f"Session {session_id!r} has ended; start a new session.", code="session_ended", param="session_id")


def session_reward_conflict(session_id: str, first: float, second: float) -> ServingError:
    """A 409 for a second end of a session with another reward than its first end's (the first one stands)."""
    return ServingError(
        409,
        f"Session {session_id!r} already ended with reward {first}; a second end cannot change it to {second}.",
        code="session_ended",
        param="reward",
    )
