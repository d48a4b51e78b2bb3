"""Admin POST bodies, read strictly: a JSON object of the endpoint's documented fields, each of
its documented type, or a 400 with `{"error": ...}` and nothing changes.

A fleet-wide flush, bump or eviction must never run on garbage: a body that is not JSON, not an
object, names a field the endpoint does not know, or gives one a value of another type is
refused. An empty body (nothing but whitespace) is accepted only by the endpoints whose fields
are all optional (bump, reload, cleanup); the others need theirs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidInputError

# JSON types by name, as the error names them.
_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "boolean": (bool,)}


@dataclass(frozen=True)
class BodySpec:
    """An endpoint's body: its fields' JSON types ("string", "boolean"), which it requires, and
    whether no body at all is accepted (as `{}`). An optional field may also be null."""

    fields: Mapping[str, str]
    required: tuple[str, ...] = ()
    empty_ok: bool = False


def parse_body(raw: bytes, spec: BodySpec) -> dict[str, Any]:
    """The body as a dict of documented fields, or InvalidInputError (code "bad_body")."""
    if not raw.strip():
        if spec.empty_ok:
            return {}
        needed = _names(spec.required or tuple(spec.fields))
        raise _bad(f"this endpoint needs a JSON object body with {needed}")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON or UTF-8, a huge integer; nested too deeply
        raise _bad("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise _bad(f"the body must be a JSON object, not {type(body).__name__}")
    unknown = sorted(name for name in body if name not in spec.fields)
    if unknown:
        known = _names(tuple(spec.fields)) if spec.fields else "no fields"
        raise _bad(f"unknown field {_names(tuple(unknown[:5]))}; this endpoint takes {known}")
    for name in spec.required:
        if name not in body:
            raise _bad(f'the body needs "{name}"')
    for name, kind in spec.fields.items():
        value = body.get(name)
        if value is None and name not in spec.required:
            continue
        if not isinstance(value, _TYPES[kind]):
            raise _bad(f'"{name}" must be a {kind}')
    return body


def _names(names: tuple[str, ...]) -> str:
    return ", ".join(f'"{name}"' for name in names)


def _bad(message: str) -> InvalidInputError:
    return InvalidInputError("bad_body", message)
