"""The HTTP layer: FastAPI routes, the API-key check and OpenAI-shaped errors.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``POST /v1/sessions``,
``POST /v1/sessions/{id}/end``. Every request must carry ``Authorization: Bearer <key>`` (checked in constant time
before the body is read); every failure answers ``{"error": {...}}`` (:mod:`.errors`), and an unexpected exception is a
500 for that request only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse as StarletteJSON
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from nemo_like.serving.errors import ServingError, bad_request, error_body, unauthorized
from nemo_like.serving.protocol import ChatCompletionRequest, CompletionRequest
from nemo_like.serving.responses import chat_response, completion_response, models_response
from nemo_like.serving.service import CompletionService

log = logging.getLogger("nemo_like.serving")


class JSONResponse(StarletteJSON):
    """A JSON answer that can echo any string the client sent. Text with a lone UTF-16 surrogate is valid JSON
    (``"\\ud800"``: a client that cut a string inside an emoji) but cannot be UTF-8 encoded, so such an answer is
    written with ASCII escapes instead: it was a 500 (an unknown model's name in the message, a session id), after
    the call had taken effect (a session opened, a call recorded)."""

    def render(self, content: Any) -> bytes:  # noqa: D102
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


class AnswerFailures:
    """ASGI middleware: an unexpected error in a route becomes a 500 ``server_error`` answer here, the connection kept.
    Starlette's catch-all (where an ``Exception`` handler runs) answers, then re-raises, and uvicorn closes the
    connection: a client's next call on that keep-alive connection could be reset (the shipped agent does not retry)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:
            if started:  # part of an answer is out: nothing to do but end the connection
                raise
            log.exception("rollout server: %s %s failed", scope.get("method"), scope.get("path"))
            body = error_body(f"The server failed on this request: {type(exc).__name__}: {exc}", "server_error")
            await JSONResponse(body, status_code=500)(scope, receive, send)


SESSION_HEADER = "X-Session-Id"
#: What a call whose client left answers (nginx's "client closed request"): nobody reads it; uvicorn drops it.
CLIENT_CLOSED_REQUEST = 499
T = TypeVar("T")


class ClientLeft(Exception):
    """The client closed its connection before its call was answered: the call was cancelled, nothing recorded."""


async def _client_left(request: Request) -> None:
    """Return once the client has closed the connection (its body is already read: the next ASGI message the server
    sends is ``http.disconnect``, when the client leaves or once the response is sent)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(request: Request, call: Awaitable[T]) -> T:
    """``call``'s result, or :class:`ClientLeft` once the client disconnects first, with ``call`` cancelled.

    A sampled completion is recorded in its session and trained on: one whose client timed out (and may retry) was
    never seen by the agent, so it must not be recorded. Cancelling the call drops it from the generation queue if it
    has not been sampled yet (:meth:`~nemo_like.serving.batching.GenerationQueue.submit`), returns its session's
    token reservation (once its engine call ends, if one is sampling it: the engine cannot stop it) and counts it
    (``Session.abandoned_calls``); a completion finished at the very moment the client left is recorded, as nothing
    tells the two apart."""
    work, left = asyncio.ensure_future(call), asyncio.ensure_future(_client_left(request))
    try:
        await asyncio.wait({work, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        if not work.done():  # the client left, or this handler itself is cancelled (the server stopping)
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise ClientLeft
    return work.result()


class EndSessionRequest(BaseModel):
    """``POST /v1/sessions/{id}/end``: the session's reward (0.0 when omitted)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    reward: float | None = Field(None, allow_inf_nan=False)


class OpenSessionRequest(BaseModel):
    """``POST /v1/sessions``: an optional id (a random one otherwise) and metadata."""

    model_config = ConfigDict(extra="forbid", strict=True)
    session_id: str | None = None
    metadata: dict[str, Any] | None = None


def _param(loc: list[Any]) -> str | None:
    """The ``param`` of a validation error at ``loc``: the field and its list indices (``prompt[2]``), without the union
    branch pydantic tried (``prompt.str``, ``stop.list[str]``) or a dict key."""
    if not loc:
        return None
    return str(loc[0]) + "".join(f"[{part}]" for part in loc[1:] if isinstance(part, int))


def _validation_error(exc: RequestValidationError, content_type: str = "application/json") -> ServingError:
    """Malformed JSON and schema violations as OpenAI's 400s (the first problem, with its parameter); ``content_type``:
    the request's (a body sent as form data, ``curl -d``, is never parsed as JSON)."""
    first = exc.errors()[0] if exc.errors() else {}
    raw_loc = [p for p in first.get("loc", ()) if p != "body"]
    kind, loc = first.get("type", ""), [str(p) for p in raw_loc]
    if not loc and kind in ("missing", "dict_type", "model_attributes_type"):  # no body, or one that is not an object
        if "json" not in content_type:
            return bad_request("Send the body as JSON with the header 'Content-Type: application/json'.")
        return bad_request("The request body must be a JSON object.")
    if kind == "json_invalid":
        return bad_request("We could not parse the JSON body of your request. The body must be valid JSON.")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {'.'.join(loc)}", param=".".join(loc) or None)
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{'.'.join(loc)}'.", param=".".join(loc) or None)
    param = _param(raw_loc)
    return bad_request(f"Invalid value for '{param}': {first.get('msg', 'invalid')}.", param=param)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServingError)
    async def serving_error(request: Request, exc: ServingError) -> JSONResponse:
        # The openai client retries every 409 (OpenAI's lock timeouts) unless told not to; ours are final (an ended session)
        headers = {"x-should-retry": "false"} if 400 <= exc.status < 500 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = _validation_error(exc, request.headers.get("content-type", ""))
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(ClientLeft)
    async def client_left(request: Request, exc: ClientLeft) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)


class RequireKey:
    """ASGI middleware: answer 401 unless ``Authorization: Bearer <key>`` matches (constant-time), before any route
    or body parsing runs (a plain ASGI layer: no per-request task as in Starlette's ``BaseHTTPMiddleware``)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                error = unauthorized()
                response = JSONResponse(error.body(), status_code=error.status, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(service: CompletionService, api_key: str) -> FastAPI:
    """The server's ASGI app over ``service``; every route requires ``api_key``."""
    if not api_key:
        raise ValueError("the rollout server needs a non-empty API key")
    app = FastAPI(title="nemo_like rollout server", docs_url=None, redoc_url=None, openapi_url=None, default_response_class=JSONResponse)
    _install_error_handlers(app)
    app.add_middleware(AnswerFailures)  # inside the key check: an unauthorised call never reaches a route
    app.add_middleware(RequireKey, api_key=api_key)
    created = int(time.time())
    sessions = service.sessions

    def decode_token(token_id: int) -> str:
        return service.renderer.decode_continuation([token_id])

    # The answers are JSON-native dicts, returned as a JSONResponse: a returned dict would go through FastAPI's
    # response-model validation and jsonable_encoder, ~0.15 ms a call for ids and logprobs that are already plain lists.
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> JSONResponse:
        call = await unless_client_leaves(request, service.chat(body, request.headers.get(SESSION_HEADER)))
        return JSONResponse(chat_response(call, body, f"chatcmpl-{uuid.uuid4().hex}", decode_token, service.renderer.token_bytes))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> JSONResponse:
        call = await unless_client_leaves(request, service.complete(body, request.headers.get(SESSION_HEADER)))
        return JSONResponse(completion_response(call, body, f"cmpl-{uuid.uuid4().hex}", decode_token, service.renderer.token_bytes))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return models_response(service.limits.model_name, created, service.limits.max_context)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        (served,) = models_response(service.limits.model_name, created, service.limits.max_context)["data"]
        if model_id != served["id"]:
            raise ServingError(
                404, f"The model '{model_id}' does not exist; this server serves '{served['id']}'.",
                type="not_found_error", code="model_not_found", param="model",
            )  # fmt: skip
        return served

    @app.post("/v1/sessions")
    async def open_session(body: OpenSessionRequest | None = None) -> dict[str, Any]:
        body = body or OpenSessionRequest()
        try:
            session_id = sessions.open(body.session_id, body.metadata, make_room=False)
        except ValueError as exc:
            raise ServingError(409, str(exc), code="session_exists", param="session_id") from None
        if sessions.room_pending:  # past the cap (max_kept_results): end the least recently used, off the event loop
            await asyncio.to_thread(sessions.make_room)
        return {"id": session_id, "object": "session"}

    @app.post("/v1/sessions/{session_id:path}/end")
    async def end_session(session_id: str, body: EndSessionRequest | None = None) -> dict[str, Any]:
        # Off the event loop: building a long session's rows takes a while (a 400-call one ~0.9 s), and ending one the
        # run is ending too waits for it; every other request had waited with it.
        result = await asyncio.to_thread(sessions.end, session_id, body.reward if body else None)
        return {
            "id": session_id, "object": "session", "reward": result.reward, "num_calls": result.num_calls,
            "rows": len(result.rows), "branched": result.branched, "rejected": result.rejected,
        }  # fmt: skip

    return app
