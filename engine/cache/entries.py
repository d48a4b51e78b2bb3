"""One cache entry, looked at or removed by an operator: inspect and evict.

An operator who learns that one answer is wrong should not have to flush everything:
the input gives its canonical key (as a request would compute it now), and from there
what each tier holds. Inspecting changes nothing: a value that fails its checks is
reported, not deleted (the next request deletes it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.cache.codec import CachedResult, ForgedValue, UndecodableValue, ValueCodec
from engine.cache.keys import CacheKey, digest_parts
from engine.errors import CacheUnavailableError
from engine.models.base import Classifier
from storage.memory import MemoryStore
from storage.redis.store import RedisStore


@dataclass(frozen=True)
class EntryReport:
    task: str
    key: str
    model_version: str
    generation: int
    in_l1: bool
    # "valid" | "absent" | "forged" | "corrupt" | "unavailable" (Redis down) | "disabled" (no L2)
    l2: str
    age_s: float | None  # of the stored answer (L1's copy, else L2's)
    l2_ttl_s: float | None  # time left before Redis expires it
    answer: list[list[Any]] | None  # the stored answer: [[label, score], ...], best first
    answer_model_version: str | None  # as recorded in the stored value
    l2_problem: str | None = None  # why an L2 value was refused, when it was


@dataclass(frozen=True)
class EvictResult:
    key: str
    l1_removed: bool
    l2_removed: bool | None  # None: no L2, or it could not be reached
    l2_error: str | None = None


def entry_key(task: str, model: Classifier, raw: Any, *, prefix: str, generation: int) -> str:
    """The canonical key a request for `raw` uses now (raises InvalidInputError)."""
    canonical = model.canonicalize(raw)
    digest = digest_parts(canonical.fingerprint_parts())
    return str(CacheKey(prefix, task, model.version, generation, digest))


def inspect_entry(
    *,
    task: str,
    key: str,
    model: Classifier,
    generation: int,
    l1: MemoryStore,
    l2: RedisStore | None,
    codec: ValueCodec,
    clock: Callable[[], float],
) -> EntryReport:
    local = l1.peek(key)
    stored: CachedResult | None = local if isinstance(local, CachedResult) else None
    ttl_s = problem = None
    if l2 is None:
        state = "disabled"
    else:
        try:
            raw, ttl_s = l2.get_with_ttl(key)
        except CacheUnavailableError as exc:
            raw, state, problem = None, "unavailable", str(exc)
        else:
            state = "absent" if raw is None else "valid"
        if raw is not None:
            try:
                value = codec.decode(raw, key=key)
                if not isinstance(value, CachedResult):
                    raise UndecodableValue(f"a {type(value).__name__} under a result key")
                stored = stored or value
            except ForgedValue as exc:
                state, problem = "forged", str(exc)
            except UndecodableValue as exc:
                state, problem = "corrupt", str(exc)
    return EntryReport(
        task=task, key=key, model_version=model.version, generation=generation,
        in_l1=stored is not None and local is not None, l2=state,
        age_s=None if stored is None else max(0.0, clock() - stored.created_at),
        l2_ttl_s=ttl_s, answer=None if stored is None else stored.prediction.to_plain(),
        answer_model_version=None if stored is None else stored.model_version, l2_problem=problem,
    )  # fmt: skip
