"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, with the
right HTTP status, and the exception handlers that produce them.

User input can only produce 4xx: validation errors and the pipeline's typed errors
(invalid_request, prompt_too_long -> 400; overloaded -> 429) are mapped here. 500 is kept for
genuine internal failures (the pipeline's `internal` code, or a bug caught by the catch-all).
"""

from __future__ import annotations

import logging
from http import HTTPStatus

import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from baton.client import ServerError
from baton.messages import ErrorCode

logger = logging.getLogger(__name__)

# Status -> (OpenAI error type, default code).
ERROR_KINDS = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("authentication_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    431: ("invalid_request_error", "headers_too_large"),
    429: ("rate_limit_error", "overloaded"),
    500: ("server_error", "internal"),
    503: ("server_error", "unavailable"),
}
SERVER_ERROR_STATUS: dict[ErrorCode, int] = {
    "invalid_request": 400,
    "prompt_too_long": 400,
    "overloaded": 429,
    "unavailable": 503,
}
# Seconds a client should wait before retrying a 429 or 503: a queue slot frees within a few
# decode steps on a busy server, a restarting pipeline takes longer, but polling once a second
# costs nothing.
RETRY_AFTER_S = 1
# nginx's "client closed request": nobody reads it, but logs show why the request ended.
CLIENT_CLOSED_STATUS = 499
# Union branches show up in pydantic's error locations ("str", "list[int]"): not field names.
_TYPE_NAMES = {"str", "int", "float", "bool", "none", "dict", "list"}
MAX_REPORTED_ERRORS = 3


class OpenAIError(Exception):
    """An error to return to the client as OpenAI's error JSON with `status`."""

    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type, default_code = ERROR_KINDS.get(status, ("server_error", "internal"))
        self.code = code or default_code
        self.param = param

    def payload(self) -> dict[str, dict[str, str | None]]:
        """The `{"error": {...}}` body."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> Response:
        """The error as an HTTP response; 429 and 503 say when to retry (`Retry-After`)."""
        response = json_response(self.payload(), self.status)
        if self.status in (429, 503):
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response


class ClientGone(Exception):
    """The client disconnected before its response was ready; its requests were aborted."""


def json_response(body: object, status: int = 200) -> Response:
    """A JSON response encoded with msgspec (cheaper than pydantic or json for plain dicts)."""
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


def from_server_error(error: ServerError) -> OpenAIError:
    """The HTTP error for a pipeline error; unknown codes count as internal."""
    status = SERVER_ERROR_STATUS.get(error.code, 500)
    return OpenAIError(status, error.message, code=error.code)


def from_validation_error(error: ValidationError | RequestValidationError) -> OpenAIError:
    """A 400 naming the offending fields, e.g. "temperature: Input should be ... >= 0"."""
    lines: list[str] = []
    first_param: str | None = None
    for detail in error.errors():
        path = ".".join(str(part) for part in detail["loc"] if not _is_branch_tag(part))
        if path and first_param is None:
            first_param = path
        line = f"{path}: {detail['msg']}" if path else detail["msg"]
        if line not in lines:
            lines.append(line)
    message = "; ".join(lines[:MAX_REPORTED_ERRORS]) or "invalid request body"
    return OpenAIError(400, message, param=first_param)


def _is_branch_tag(part: int | str) -> bool:
    """Whether a location part names a union branch rather than a field ("body" is FastAPI's)."""
    if isinstance(part, int):
        return False
    return "[" in part or part in _TYPE_NAMES or part == "body"


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception the app can raise to an OpenAI error response."""

    async def openai_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, OpenAIError)
        return error.response()

    async def server_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, ServerError)
        mapped = from_server_error(error)
        if mapped.status >= 500:
            logger.error("pipeline error on %s: %s", request.url.path, error)
        return mapped.response()

    async def validation_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, ValidationError | RequestValidationError)
        return from_validation_error(error).response()

    async def http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        message = error.detail or HTTPStatus(error.status_code).phrase
        if error.status_code == 404:
            message = f"{request.method} {request.url.path} is not a route of this server"
        return OpenAIError(error.status_code, str(message)).response()

    async def client_gone(request: Request, error: Exception) -> Response:
        return Response(status_code=CLIENT_CLOSED_STATUS)

    async def unexpected(request: Request, error: Exception) -> Response:
        # Starlette re-raises after this response, so the server logs the traceback too.
        logger.error("unexpected error on %s: %r", request.url.path, error)
        return OpenAIError(500, "internal server error").response()

    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(ServerError, server_error)
    app.add_exception_handler(ValidationError, validation_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(ClientGone, client_gone)
    app.add_exception_handler(Exception, unexpected)
