"""Operator authentication: one bearer token, compared in constant time, with a
per-client lockout after repeated failures."""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


class AuthOutcome(enum.StrEnum):
    OK = "ok"
    UNAUTHORIZED = "unauthorized"  # HTTP 401
    RATE_LIMITED = "rate_limited"  # HTTP 429


def token_fingerprint(token: str) -> str:
    """What the audit log records as "who": never the token itself."""
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:12]


def generate_token() -> str:
    return secrets.token_urlsafe(24)


@dataclass
class _Failures:
    count: int
    window_start: float
    locked_until: float


class AdminAuth:
    """`check(client, presented)`: OK, UNAUTHORIZED, or RATE_LIMITED after
    `max_failures` wrong tokens from one client within `window_s` (for `lockout_s`)."""

    def __init__(
        self,
        token: str,
        *,
        max_failures: int = 5,
        window_s: float = 60.0,
        lockout_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        max_clients: int = 10_000,
    ) -> None:
        if len(token) < 8:
            raise ValueError("ADMIN_TOKEN must be at least 8 characters")
        self._token = token.encode()
        self.fingerprint = token_fingerprint(token)
        self._max_failures = max_failures
        self._window_s = window_s
        self._lockout_s = lockout_s
        self._clock = clock
        self._max_clients = max_clients
        self._lock = threading.Lock()
        self._failures: dict[str, _Failures] = {}

    def check(self, client: str, presented: str | None) -> AuthOutcome:
        now = self._clock()
        with self._lock:
            record = self._failures.get(client)
            if record is not None and record.locked_until > now:
                return AuthOutcome.RATE_LIMITED
        # Constant time whatever the presented length or content.
        if presented is not None and hmac.compare_digest(presented.encode(), self._token):
            with self._lock:
                self._failures.pop(client, None)
            return AuthOutcome.OK
        with self._lock:
            record = self._failures.get(client)
            if record is None or now - record.window_start > self._window_s:
                if len(self._failures) >= self._max_clients:  # bounded memory under a spray
                    self._failures.pop(next(iter(self._failures)))
                record = _Failures(0, now, 0.0)
                self._failures[client] = record
            record.count += 1
            if record.count >= self._max_failures:
                record.locked_until = now + self._lockout_s
                return AuthOutcome.RATE_LIMITED
        return AuthOutcome.UNAUTHORIZED


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None
