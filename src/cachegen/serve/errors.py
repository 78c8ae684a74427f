"""Errors as HTTP responses with OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from starlette.responses import JSONResponse

from cachegen.store.url import redact

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """Raised by request handling; becomes an HTTP error response."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.headers = status, message, code, param, headers


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    return {
        "error": {"message": redact(message), "type": TYPES.get(status, "server_error"), "param": param, "code": code}
    }


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.status, e.message, e.code, e.param), status_code=e.status, headers=e.headers)
