"""Every error leaves the router as OpenAI's nested body `{"error": {message, type, param, code}}`.

FastAPI's 422 for a request that fails validation becomes a 400, as vLLM and SGLang answer; an
unknown path or method keeps its status but gets the same body. `code` is the HTTP status.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error the router answers with `status` and OpenAI's error body."""

    status: int = 500

    def __init__(self, message: str, param: str | None = None, status: int | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.headers = message, param, headers
        if status is not None:
            self.status = status

    def info(self) -> ErrorInfo:
        return error_info(self.status, self.message, self.param)


class BadRequestError(APIError):
    status = 400


class NotFoundError(APIError):
    status = 404


class AuthenticationError(APIError):
    status = 401


class ServiceUnavailableError(APIError):
    """No replica could serve the request within the failover bounds."""

    status = 503


def error_info(status: int, message: str, param: str | None = None) -> ErrorInfo:
    return ErrorInfo(message=message, type=ERROR_TYPES.get(status, "APIError"), param=param,
                     code=status)


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=error_info(status, message, param))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def unknown_model(name: str) -> NotFoundError:
    return NotFoundError(f"The model `{name}` does not exist.", param="model")


def error_text(err: Any) -> str:
    """One pydantic error as pydantic prints it: the message, then its type and input (clients
    match on the type, e.g. `greater_than_equal`, as vLLM's messages carry it)."""
    text = f"{err.get('msg', 'invalid')} [type={err.get('type', 'value_error')}"
    if "input" in err and not isinstance(err["input"], dict | list):
        text += f", input_value={err['input']!r}, input_type={type(err['input']).__name__}"
    return text + "]"


def _validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """A readable message and the first offending field, from pydantic's error list."""
    parts, param = [], None
    for err in errors:
        if err.get("type") == "json_invalid":  # loc holds a character offset, not a field
            where = [p for p in err.get("loc", ()) if isinstance(p, int)]
            at = f" at character {where[0]}" if where else ""
            reason = (err.get("ctx") or {}).get("error", err.get("msg", "invalid"))
            parts.append(f"the body is not valid JSON{at}: {reason}")
            continue
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        field = ".".join(loc)
        param = param or (loc[0] if loc else None)  # the request field, not union members
        parts.append(f"{field}: {error_text(err)}" if field else error_text(err))
    return "; ".join(parts) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(list(exc.errors()))
        return error_response(400, message, param)

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else exc.headers
        return error_response(exc.status, exc.message, exc.param, headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers) if exc.headers else None
        return error_response(exc.status_code, str(exc.detail), None, headers)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return error_response(500, f"{type(exc).__name__}: {exc}")
