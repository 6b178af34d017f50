"""Who a request is: its API key checked (--api-key, --api-keys), and the tenant it counts
against for fairness."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from fastapi import Request

from pdserve.router.fairness import RateLimits
from pdserve.router.openai_api.errors import APIError


@dataclass(frozen=True)
class Auth:
    api_key: str | None = None  # --api-key: the one accepted key
    limits: RateLimits | None = None  # --api-keys: the accepted keys and their rate limits

    def check(self, request: Request) -> str | None:
        """The request's API key once accepted (None when no key is required)."""
        if self.api_key is None and self.limits is None:
            return None
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        keys = [self.api_key] if self.api_key is not None else []
        keys += list(self.limits.rates) if self.limits is not None else []
        # compare with every key (no early exit), so the time taken does not tell which matched
        if not sum(hmac.compare_digest(given.encode(), k.encode()) for k in keys):
            raise APIError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        return given

    @staticmethod
    def tenant_of(request: Request, user: str | None, key: str | None) -> str:
        """Who the request counts against for fairness: its API key (never shown: a hash),
        else the X-Tenant header, else the `user` field, else "anonymous"."""
        if key:
            return "key-" + hashlib.sha256(key.encode()).hexdigest()[:10]
        return request.headers.get("x-tenant") or user or "anonymous"
