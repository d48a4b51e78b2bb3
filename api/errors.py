"""The one error the REST layer raises for a request it refuses before the engine sees it.

Engine errors (InvalidInputError, ModelError) are translated next to this one, in
`api.oip._refusal`, so every HTTP status of the API is chosen in one place.
"""

from __future__ import annotations

# Messages quote what the caller sent (a name, a datatype); bounded, so a 20 MB name is not
# echoed back whole, nor written to the log.
MAX_MESSAGE_CHARS = 500


class RequestRefused(Exception):
    """The request cannot be served as sent. `message` is safe to show the caller."""

    def __init__(self, status: int, message: str) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 1] + "…"
        super().__init__(message)
        self.status = status
        self.message = message
