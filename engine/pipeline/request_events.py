"""What the engine tells its listeners (request log, metrics, the console's clients) of each
request: one RequestRecord, with the client as a label that never holds its address."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from engine.capacity.fairness import ClientLabels
from engine.pipeline.results import ClassifyResult, RequestListener, RequestRecord

log = logging.getLogger(__name__)

LABELS_KEPT = 4096


class RequestEvents:
    """The engine's listeners and the records it sends them. Listeners are added at start-up
    (the composition root), before requests arrive."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._listeners: list[RequestListener] = []
        self._labels = ClientLabels()
        # The labels of the clients seen lately, read without ClientLabels' lock (on every
        # request); emptied when it reaches LABELS_KEPT, ClientLabels still holding them.
        self._known: dict[str, str] = {}

    def add_listener(self, listener: RequestListener) -> None:
        self._listeners.append(listener)

    def label(self, client: str | None) -> str | None:
        """What may be shown of a client (engine.capacity.fairness.ClientLabels); None: the app itself."""
        if client is None:
            return None
        known = self._known.get(client)
        if known is None:
            if len(self._known) >= LABELS_KEPT:
                self._known = {}
            known = self._known[client] = self._labels.label(client)
        return known

    def answered(self, task: str, result: ClassifyResult, route: str, client: str | None) -> None:
        if not self._listeners:
            return
        record = RequestRecord(
            at=self._clock(), task=task, tier=result.tier, latency_ms=result.latency_ms,
            status="ok", error_code=None, key_digest=result.key.rsplit(":", 1)[-1][:16],
            model_version=result.model_version, generation=result.generation,
            top_label=result.prediction.top_label, model_ms=result.model_ms, route=route,
            client=self.label(client),
        )  # fmt: skip
        self._notify(record)

    def failed(
        self,
        task: str,
        model_version: str,
        generation: int,
        started: float,
        *,
        status: str,
        error: str,
        route: str,
        client: str | None,
    ) -> None:
        """A request that got no answer: `status` invalid, error or refused."""
        if not self._listeners:
            return
        record = RequestRecord(
            at=self._clock(), task=task, tier=None,
            latency_ms=(time.perf_counter() - started) * 1000.0, status=status, error_code=error,
            key_digest=None, model_version=model_version, generation=generation, top_label=None,
            route=route, client=self.label(client),
        )  # fmt: skip
        self._notify(record)

    def _notify(self, record: RequestRecord) -> None:
        for listener in self._listeners:
            try:
                listener(record)
            except Exception:  # a logging problem must never fail a request
                log.exception("request listener failed")
