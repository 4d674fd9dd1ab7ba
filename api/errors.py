"""Errors as the router's HTTP clients expect them: OpenAI's error JSON with the right status.

Every failure a router replica reports — bad input, admin auth, unknown route, prompt too long,
all workers busy, a bug — leaves as ``{"error": {"message", "type", "param", "code"}}`` so that
OpenAI SDKs surface the message instead of a parse failure. The one exception is the "all workers
busy" 503, whose body is copied byte-for-byte from the Dynamo docs the product was specified
from (a flat ``{"message", "type", "code"}``), because clients written against Dynamo match on it.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from errors.root import JetrouterError

log = logging.getLogger(__name__)

# The error "type" each status gets when the caller does not name one.
DEFAULT_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}

SERVICE_UNAVAILABLE_MESSAGE = (
    "Service temporarily unavailable: All workers are busy, please retry later"
)

# Exactly the 503 body of Dynamo's request-rejection docs ("Client Retry Strategy"); clients
# match on it. Do not reshape it.
SERVICE_UNAVAILABLE_BODY: dict[str, Any] = {
    "message": SERVICE_UNAVAILABLE_MESSAGE,
    "type": "service_unavailable",
    "code": 503,
}


def default_type(status: int) -> str:
    """The OpenAI-style error type for a status: known ones from the table, else by class."""
    known = DEFAULT_TYPES.get(status)
    if known is not None:
        return known
    return "internal_error" if status >= 500 else "invalid_request_error"


class ApiError(JetrouterError):
    """A failure to report to the HTTP client; raise it anywhere under a request handler.

    ``type`` defaults to the conventional type for ``status`` (400 invalid_request_error, 401
    authentication_error, 403 permission_error, 404 not_found_error, 503 service_unavailable...).
    A 503 of type ``service_unavailable`` renders in Dynamo's flat shape (see module doc).
    """

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type if type is not None else default_type(status)
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        if self.status == 503 and self.type == "service_unavailable":
            return {"message": self.message, "type": self.type, "code": 503}
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def __repr__(self) -> str:
        return (f"ApiError({self.status}, {self.message!r}, type={self.type!r}, "
                f"param={self.param!r}, code={self.code!r})")


def error_response(status: int, message: str, *, type: str | None = None,
                   param: str | None = None, code: str | int | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """An OpenAI-shaped error response without raising."""
    return ApiError(status, message, type=type, param=param, code=code,
                    headers=headers).response()


def encoded_error_body(status: int, message: str, *, type: str | None = None,
                       code: str | int | None = None) -> bytes:
    """The body of :meth:`ApiError.body`, encoded: for code below the app (the HTTP protocol
    guards) and for errors that travel inside a stream."""
    return msgspec.json.encode(ApiError(status, message, type=type, code=code).body())


def upstream_error_body(message: str, status: int = 502) -> bytes:
    """The encoded body for an engine's failure that the router passes on: type
    ``upstream_error`` and the HTTP status repeated as ``code``."""
    return encoded_error_body(status, message, type="upstream_error", code=status)


def sse_error(message: str, status: int = 502) -> bytes:
    """The same error as one SSE event: how a stream already under way (status 200 sent) tells
    the client it failed."""
    return b"data: " + upstream_error_body(message, status) + b"\n\n"


def sse_internal_error(message: str) -> bytes:
    """A fault of the router itself in a stream already under way, as one SSE event (OpenAI's
    ``server_error`` with status 500): the client reads an error, not a cut body."""
    return b"data: " + encoded_error_body(500, message, type="server_error", code=500) + b"\n\n"


def retry_after_header(retry_after: float) -> str:
    # HTTP's Retry-After takes whole seconds; round up so clients never come back too early.
    return str(max(1, math.ceil(retry_after)))


def overloaded_response(retry_after: float | None = None) -> JSONResponse:
    """503 "all workers are busy" with Dynamo's exact body, and Retry-After when given."""
    headers = None if retry_after is None else {"Retry-After": retry_after_header(retry_after)}
    return JSONResponse(dict(SERVICE_UNAVAILABLE_BODY), status_code=503, headers=headers)


def _validation_param(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) for FastAPI's own body/query validation failures."""
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path")]
    if first.get("type") == "json_invalid":
        return ("We could not parse the JSON body of your request. Please make sure the body "
                "is valid JSON."), None
    param = ".".join(loc) or None
    msg = str(first.get("msg", "Invalid request."))
    return (f"Invalid value for '{param}': {msg}" if param else msg), param


async def _on_api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _on_validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = _validation_param(exc)
    return error_response(400, message, param=param)


async def _on_http_exception(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    if status == 404 and exc.detail == "Not Found":
        message = "Unknown request URL. Please check the URL and method."
    elif status == 405:
        message = "Method not allowed for this URL."
    else:
        message = str(exc.detail)
    headers = dict(exc.headers) if exc.headers else None
    return error_response(status, message, headers=headers)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # The traceback goes to the log, never to the client.
    log.error("unhandled error serving %s %s", request.method, request.url.path,
              exc_info=(type(exc), exc, exc.__traceback__))
    return error_response(500, "The server had an error while processing your request.",
                          type="internal_error")


def install_error_handlers(app: FastAPI) -> None:
    """Make every error ``app`` returns OpenAI-shaped (see module doc)."""
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    app.add_exception_handler(Exception, _on_unexpected)
