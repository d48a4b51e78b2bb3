"""Operator actions on the hard examples (engine.quality.hard_examples), shared by the JSON API and the
console panel: list a task's kept examples, label one (a class of the model, "none of these"),
skip or delete it, and export the labelled set (admin.hard_examples.export).

Every label, deletion and export is audited (who, when, the example's digest: never its
input). Errors are InvalidInputError with a code the boundaries map to a status:
`unknown_task` and `unknown_example` 404, `hard_examples_off` 409, anything else 400.
"""

from __future__ import annotations

import base64
import io
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from admin.hard_examples.export import rows, to_folder_zip, to_parquet
from engine.cache.keys import DIGEST_PATTERN
from engine.errors import CacheUnavailableError, InvalidInputError
from engine.models.base import takes_image
from engine.pipeline.service import InferenceEngine
from engine.quality.hard_examples import NONE_OF_THESE, STATES, HardExamples, model_classes

log = logging.getLogger(__name__)

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # a decoded pair is one code point: these are alone
ACTIONS = ("label", "none", "skip", "delete")
FORMATS = ("parquet", "imagefolder")
THUMBNAIL_PX = 96
DEFAULT_LIMIT = 100  # examples per listing (an image's thumbnail is decoded for each)
MAX_LIMIT = 1000
Audit = Callable[[str, dict[str, Any], dict[str, Any], str], None]


def _text(value: bytes) -> str:
    """A kept message (b"t" + its UTF-8, lone surrogates included, as typed) as text that JSON,
    Parquet and the browser can carry: an unpaired surrogate becomes U+FFFD."""
    return _LONE_SURROGATE.sub("\ufffd", value[1:].decode("utf-8", "surrogatepass"))


def _unavailable(exc: CacheUnavailableError) -> InvalidInputError:
    return InvalidInputError("redis_unavailable", f"Redis did not answer: {exc}")


# HardExampleCounters fields that count hard answers by what became of them on this replica.
OUTCOMES = ("kept", "evicted", "refused", "overflow", "over_budget", "too_large")


class HardExamplesCollector(Collector):
    """/metrics: what collection did on this replica (counts only: no input, no digest)."""

    def __init__(self, collector: HardExamples) -> None:
        self._collector = collector

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        counters = self._collector.counters()
        yield CounterMetricFamily("infcache_hard_examples_candidates", "Answers the model was unsure of "
                                  "(or shadow found wrong), noted by this replica",
                                  value=counters["candidates"])  # fmt: skip
        outcomes = CounterMetricFamily(
            "infcache_hard_examples", "Hard examples by outcome: kept (stored), evicted (made room), "
            "refused (set full of higher-ranked), overflow / over_budget (not held: memory bound, CPU "
            "budget), too_large", labels=["outcome"],
        )  # fmt: skip
        for outcome in OUTCOMES:
            outcomes.add_metric([outcome], counters[outcome])
        yield outcomes
        yield CounterMetricFamily("infcache_hard_examples_flush_cpu_seconds", "CPU seconds the flushes "
                                  "spent (bounded by HARD_EXAMPLES_CPU_SHARE)",
                                  value=counters["flush_cpu_s"])  # fmt: skip
        yield CounterMetricFamily("infcache_hard_examples_redis_errors", "Flushes skipped: Redis did not "
                                  "answer", value=counters["redis_errors"])  # fmt: skip
        yield GaugeMetricFamily("infcache_hard_examples_held", "New hard examples held in memory until "
                                "the next flush", value=counters["held"])  # fmt: skip


class HardExampleAdmin:
    def __init__(self, *, collector: HardExamples | None, engine: InferenceEngine, audit: Audit,
                 clock: Callable[[], float]) -> None:  # fmt: skip
        self._collector = collector
        self._engine = engine
        self._audit = audit
        self._clock = clock

    @property
    def enabled(self) -> bool:
        return self._collector is not None

    def _require(self, task: str | None) -> HardExamples:
        if not task or task not in self._engine.models:
            known = ", ".join(self._engine.models)
            raise InvalidInputError("unknown_task", f"Unknown task {task!r}; the tasks are: {known}.")
        if self._collector is None:
            raise InvalidInputError(
                "hard_examples_off", "Hard examples are off (HARD_EXAMPLES_SIZE=0, or no Redis)."
            )
        return self._collector

    def classes(self, task: str) -> list[str]:
        model = self._engine.models.get(task)
        return model_classes(model) if model is not None else []

    def takes_image(self, task: str) -> bool:
        model = self._engine.models.get(task)
        return model is not None and takes_image(model)

    def summary(self) -> dict[str, Any]:
        """Settings and this replica's counters (no inputs)."""
        if self._collector is None:
            return {"enabled": False}
        c = self._collector
        return {"enabled": True, "size": c.size, "ttl_s": c.ttl_s, "max_score": c.max_score,
                "min_margin": c.min_margin, "counters": c.counters()}  # fmt: skip

    def listing(self, task: str | None, *, state: str = "all", limit: int = DEFAULT_LIMIT,
                thumbnails: bool = True) -> dict[str, Any]:  # fmt: skip
        """The kept examples of `task` in `state` (`total` of them): pending first, then by times
        asked and recency, the first `limit`. Text inline; an image as a PNG thumbnail (base64)."""
        collector = self._require(task)
        if state != "all" and state not in STATES:
            raise InvalidInputError("bad_state", f"state must be 'all' or one of {', '.join(STATES)}")
        if not 1 <= limit <= MAX_LIMIT:
            raise InvalidInputError("bad_limit", f"limit must be between 1 and {MAX_LIMIT}")
        assert task is not None
        try:
            records = collector.store.records(task)
            states = {name: sum(1 for r in records if r["state"] == name) for name in STATES}
            if state != "all":
                records = [r for r in records if r["state"] == state]
            total = len(records)
            records.sort(key=lambda r: (r["state"] != "pending", -r["asked"], -(r["last_seen"] or 0)))
            records = records[:limit]
            inputs = collector.store.inputs(task, [r["id"] for r in records])
        except CacheUnavailableError as exc:
            raise _unavailable(exc) from None
        for record in records:
            value = inputs.get(record["id"], b"")
            if value[:1] == b"t":
                record["text"] = _text(value)
            elif value[:1] == b"i" and thumbnails:
                record["thumbnail_png_base64"] = base64.b64encode(_thumbnail(value[1:])).decode()
        return {"task": task, "classes": self.classes(task), "none_label": NONE_OF_THESE,
                "size": collector.size, "states": states, "total": total, "examples": records}  # fmt: skip

    def image(self, task: str, ident: str) -> bytes | None:
        """The whole PNG of one kept image (the console shows it while labelling)."""
        try:
            value = self._require(task).store.inputs(task, [ident]).get(ident, b"")
        except CacheUnavailableError as exc:
            raise _unavailable(exc) from None
        return value[1:] if value[:1] == b"i" else None

    def act(self, task: str | None, ident: str, *, action: str | None, label: str | None,
            actor: str) -> dict[str, Any]:  # fmt: skip
        """Label (`label` a class of the model), "none" (none of these), "skip" or "delete".
        Audited with the example's digest, the action and the label."""
        collector = self._require(task)
        assert task is not None
        if not DIGEST_PATTERN.match(ident or ""):
            shown = ident[:80] if isinstance(ident, str) else ident
            raise InvalidInputError("unknown_example", f"No hard example {shown!r} (ids are key digests).")
        action = action or ("none" if label == NONE_OF_THESE else "label")
        if action not in ACTIONS:
            raise InvalidInputError("bad_action", f"action must be one of {', '.join(ACTIONS)}")
        if action == "label":
            classes = self.classes(task)
            if label == NONE_OF_THESE:
                action = "none"
            elif not isinstance(label, str) or not label or (classes and label not in classes):
                shown = ", ".join(classes[:20]) + (" …" if len(classes) > 20 else "")
                got = label[:80] if isinstance(label, str) else label
                raise InvalidInputError("bad_label", f"label must be one of the model's classes ({shown}) "
                                                     f"or {NONE_OF_THESE!r}; got {got!r}")  # fmt: skip
        now = self._clock()
        params = {"task": task, "id": ident, "action": action}
        if action == "label":
            params["label"] = label
        try:
            if action == "delete":
                found = collector.store.delete(task, ident)
                collector.forget(task, ident)
            else:
                state = {"label": "labelled", "none": "none", "skip": "skipped"}[action]
                record = {"state": state, "label": params.get("label"), "by": actor, "at": now}
                found = collector.store.set_label(task, ident, record, now=now)
        except CacheUnavailableError as exc:
            raise _unavailable(exc) from None
        if not found:
            raise InvalidInputError("unknown_example", f"No hard example {ident} is kept for {task!r} "
                                                       "(deleted, evicted or expired).")  # fmt: skip
        result = {"ok": True, **params, "by": actor, "at": now}
        self._audit("hard_example_" + action, params, {"ok": True}, actor)
        return result

    def export(
        self, task: str | None, *, fmt: str, include: str = "labelled", actor: str
    ) -> tuple[bytes, str, str]:
        """(file bytes, file name, media type). `include`: "labelled" (a class or "none of
        these") or "all" (pending and skipped too, with label -1)."""
        collector = self._require(task)
        assert task is not None
        if fmt not in FORMATS:
            raise InvalidInputError("bad_format", f"format must be one of {', '.join(FORMATS)}")
        if include not in ("labelled", "all"):
            raise InvalidInputError("bad_include", "include must be 'labelled' or 'all'")
        try:
            records = collector.store.records(task)
            if include == "labelled":
                records = [r for r in records if r["state"] in ("labelled", "none")]
            records.sort(key=lambda r: r.get("first_seen") or 0)
            inputs = collector.store.inputs(task, [r["id"] for r in records])
        except CacheUnavailableError as exc:
            raise _unavailable(exc) from None
        image = self.takes_image(task)
        kept = []
        for record in records:
            value = inputs.get(record["id"])
            if value is not None:
                decoded: Any = value[1:] if value[:1] == b"i" else _text(value)
                kept.append({**record, "input": decoded})
        classes = self.classes(task)
        table = rows(kept, classes)
        if fmt == "parquet":
            data, name = to_parquet(table, classes, image=image), f"hard-examples-{task}.parquet"
        else:
            data, name = to_folder_zip(table, task=task, image=image), f"hard-examples-{task}.zip"
        media = "application/vnd.apache.parquet" if fmt == "parquet" else "application/zip"
        self._audit("export_hard_examples", {"task": task, "format": fmt, "include": include},
                    {"ok": True, "examples": len(table), "bytes": len(data)}, actor)  # fmt: skip
        return data, name, media


def _thumbnail(png: bytes) -> bytes:
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        image.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX))
        out = io.BytesIO()
        image.save(out, format="PNG")
    return out.getvalue()
