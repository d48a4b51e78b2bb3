"""The project's exception tree. Boundaries (UI, HTTP) translate these in one place.

InferenceCacheError
 ├── InvalidInputError      the caller's input is unusable; safe to show, safe to cache
 ├── ModelError             the model failed on a valid input; never cached
 │    ├── RemoteUnavailableError  a remote model's server is down, slow or refused: 503 + Retry-After
 ├── OverBudgetError        a client's miss budget is spent (engine.capacity.fairness); hits still work
 │    └── ModelLoadError    weights missing or not matching the architecture
 └── CacheUnavailableError  a cache tier cannot be reached (handled inside the engine)
      └── CacheSkippedError  one cluster primary skipped by its breaker; the others may answer
"""

from __future__ import annotations

# The base and the cache error live on the bottom floor, where the stores raise them;
# they are the same classes here, so `except CacheUnavailableError` catches either import.
from storage.errors import CacheSkippedError, CacheUnavailableError, InferenceCacheError

__all__ = [
    "CacheSkippedError",
    "CacheUnavailableError",
    "InferenceCacheError",
    "InvalidInputError",
    "ModelError",
    "ModelLoadError",
    "OverBudgetError",
    "RemoteUnavailableError",
]


class InvalidInputError(InferenceCacheError):
    """The input cannot be classified. `message` is written for the end user.

    `code` is a stable machine-readable reason (e.g. ``"image_too_large"``) used in
    logs, metrics and negative cache entries.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, InvalidInputError) and other.code == self.code and other.message == self.message
        )

    def __hash__(self) -> int:
        return hash((self.code, self.message))


class ModelError(InferenceCacheError):
    """The model failed on an input that passed validation."""


class ModelLoadError(ModelError):
    """Weights could not be loaded onto the architecture."""


class OverBudgetError(InferenceCacheError):
    """A client started more misses than its budget allows (engine.capacity.fairness). `message` is
    written for the end user; `retry_after_s` is when its next miss will be accepted."""

    def __init__(self, client: str, retry_after_s: float) -> None:
        self.client = client
        self.retry_after_s = retry_after_s
        self.wait_s = max(1, int(-(-retry_after_s // 1)))  # whole seconds, rounded up
        self.first = False  # the client's first refusal in a while (one log line, not one per miss)
        self.message = (
            "Too many new inputs from your address at once while others wait for the model; answers "
            f"already cached still work; try again in {self.wait_s} s."
        )
        super().__init__(self.message)


class RemoteUnavailableError(ModelError):
    """A remote model (engine.models.remote) cannot answer a miss now: its server is down or slow,
    answered garbage or failed the exactness check. `message` is written for the end user (hits
    still work); `retry_after_s` is when the server is tried again."""

    def __init__(self, task: str, reason: str, retry_after_s: float) -> None:
        self.task = task
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.wait_s = max(1, int(-(-retry_after_s // 1)))  # whole seconds, rounded up
        self.message = (
            f"The {task} model's server is unavailable ({reason}); answers already cached still work; "
            f"try again in {self.wait_s} s."
        )
        super().__init__(self.message)
