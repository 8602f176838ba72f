"""The one error shape of the service: every error it returns, HAProxy's own 429/503 bodies included, is OpenAI's
`ErrorBody`, `{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`. Client strings quoted in a
message (field names included) are cut to `QUOTE_CHARS`, so an error never echoes unbounded input."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

QUOTE_CHARS = 64  # a client string quoted in an error message is cut to this many characters
MAX_MESSAGE_CHARS = 512  # and no error message is longer than this


class ErrorInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    message: str
    type: str  # invalid_request_error | authentication_error | rate_limit_error | server_error
    param: str | None  # the request field to blame, if one is
    code: str | None  # a stable machine-readable reason, e.g. model_not_found, context_length_exceeded


class ErrorBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    error: ErrorInfo


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status."""
    if status >= 500:
        return "server_error"
    return {401: "authentication_error", 429: "rate_limit_error"}.get(status, "invalid_request_error")


def clip(text: str, limit: int = QUOTE_CHARS) -> str:
    """A client string made fit to quote: at most `limit` characters, lone surrogates escaped (always encodable)."""
    cut = len(text) > limit
    text = text[:limit].encode("utf-8", "backslashreplace").decode("utf-8")
    return text[: limit - 1] + "…" if cut or len(text) > limit else text


class ApiError(Exception):
    """Any answer but success: the HTTP status, OpenAI's error object and extra headers (Retry-After, …)."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = clip(message, MAX_MESSAGE_CHARS)
        self.code = code
        self.param = None if param is None else clip(param)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=error_type(self.status), param=self.param, code=self.code)
        return ErrorBody(error=info).model_dump()

    def json(self) -> bytes:
        """The body as sent, compact; HAProxy's own 429/503 bodies are this for their status and message."""
        return json.dumps(self.body(), ensure_ascii=False, separators=(",", ":")).encode()


def invalid(param: str | None, message: str, *, code: str | None = None) -> ApiError:
    """400 for an invalid request; the message starts with the field to blame."""
    return ApiError(400, f"{clip(param)}: {message}" if param else message, code=code, param=param)
