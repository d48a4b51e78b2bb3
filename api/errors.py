"""The one error the REST layer raises for a request it refuses before the engine sees it.

Engine errors (InvalidInputError, ModelError) are translated next to this one, in
`api.oip._refusal`, so every HTTP status of the API is chosen in one place.
"""

from __future__ import annotations

from typing import Any

# Messages quote what the caller sent (a name, a datatype); bounded, so a 20 MB name is not
# echoed back whole, nor written to the log.
MAX_MESSAGE_CHARS = 500
# What one quoted value may take of a message: enough to recognise a name or a datatype.
QUOTE_CHARS = 80
_JSON_KINDS = {dict: "an object", list: "a list", str: "a string", float: "a number", bool: "a boolean"}


def quote(value: Any) -> str:
    """`value` (any JSON value the caller sent) for a refusal message: repr() of a short string
    or number, a cut string, else its kind. Never a huge int's digits, nor a deep list's repr
    (which recurses), nor a lone surrogate (repr escapes it, so the message stays UTF-8)."""
    if isinstance(value, str):
        cut = value if len(value) <= QUOTE_CHARS else value[:QUOTE_CHARS] + "…"
        return repr(cut)
    if value is None or isinstance(value, bool | float):
        return repr(value)
    if isinstance(value, int):
        # Digits only up to 66 bits (20 digits: any real count or size). bit_length() costs
        # nothing, while Python refuses to turn an int of over 4,300 digits into text at all.
        return repr(value) if value.bit_length() <= 66 else f"an integer of about {_digits(value)} digits"
    return _JSON_KINDS.get(type(value), type(value).__name__)


def _digits(value: int) -> int:
    return int(abs(value).bit_length() * 0.30103) + 1


class RequestRefused(Exception):
    """The request cannot be served as sent. `message` is safe to show the caller."""

    def __init__(self, status: int, message: str) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 1] + "…"
        super().__init__(message)
        self.status = status
        self.message = message
