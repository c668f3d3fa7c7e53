"""Typed API errors and the one place that turns them into responses, in each API's style.

TGI-style paths answer ``{"error": str, "error_type": str}``; ``/v1/*`` paths answer OpenAI's
envelope ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    status_code = 500
    error_type = "internal"  # TGI's error_type
    openai_type = "server_error"
    openai_code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers


class InputValidationError(APIError):
    status_code = 422
    error_type = "validation"
    openai_type = "invalid_request_error"


class MediaError(APIError):
    """A request's image breaks a declared limit or cannot be read: 400, ``param`` naming the option."""

    status_code = 400
    error_type = "validation"
    openai_type = "invalid_request_error"
    openai_code = "invalid_image"


class AuthenticationError(APIError):
    status_code = 401
    error_type = "authentication"
    openai_type = "invalid_request_error"
    openai_code = "invalid_api_key"


class BodyTooLargeError(APIError):
    status_code = 413
    error_type = "payload_too_large"
    openai_type = "invalid_request_error"
    openai_code = "request_too_large"


class ForbiddenError(APIError):
    status_code = 403
    error_type = "forbidden"
    openai_type = "invalid_request_error"
    openai_code = "forbidden"


class RequestTimeoutError(APIError):
    status_code = 408
    error_type = "timeout"
    openai_type = "invalid_request_error"
    openai_code = "request_timeout"


class ModelNotFoundError(APIError):
    status_code = 404
    error_type = "model_not_found"
    openai_type = "invalid_request_error"
    openai_code = "model_not_found"


class ConflictError(APIError):
    status_code = 409
    error_type = "conflict"
    openai_type = "invalid_request_error"
    openai_code = "conflict"


class OverloadedError(APIError):
    status_code = 429
    error_type = "overloaded"
    openai_type = "rate_limit_exceeded"
    openai_code = "overloaded"


class UnavailableError(APIError):
    status_code = 503
    error_type = "unavailable"
    openai_type = "service_unavailable"


class GenerationError(APIError):
    status_code = 500
    error_type = "generation"


def is_openai_path(path: str) -> bool:
    return path.startswith("/v1/")


def error_status(exc: APIError, path: str) -> int:
    # OpenAI answers invalid requests with 400 where TGI answers 422.
    if is_openai_path(path) and isinstance(exc, InputValidationError):
        return 400
    return exc.status_code


def error_body(exc: APIError, path: str) -> dict:
    if is_openai_path(path):
        return {"error": {"message": exc.message, "type": exc.openai_type, "param": exc.param,
                          "code": exc.openai_code}}
    return {"error": exc.message, "error_type": exc.error_type}


def error_response(exc: APIError, path: str) -> JSONResponse:
    return JSONResponse(error_body(exc, path), status_code=error_status(exc, path), headers=exc.headers)


def describe_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable message for pydantic's errors, and the first offending parameter."""
    parts, param = [], None
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        param = param or loc or None
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "invalid request", param


def register_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's own: 400 for a body it cannot decode (invalid UTF-8), 404, 405.
        if exc.status_code == 400:
            return error_response(InputValidationError(f"malformed request body: {exc.detail}"), request.url.path)
        error = APIError(str(exc.detail), headers=getattr(exc, "headers", None))
        error.status_code = exc.status_code
        error.error_type = error.openai_type = "not_found" if exc.status_code == 404 else "http_error"
        return error_response(error, request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # a bug, not the request's fault: still the API's JSON envelope (the server logs the traceback)
        return error_response(APIError(f"internal error: {type(exc).__name__}: {exc}"), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(exc)
        return error_response(InputValidationError(message, param=param), request.url.path)
