"""APIError: an OpenAI-style error object with its HTTP status."""

from __future__ import annotations


class APIError(Exception):
    """Becomes an OpenAI-style error object with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.type = "invalid_request_error" if status < 500 else "server_error"

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
