"""Live model reload: load a task's model again from its source, beside the one serving,
check it with one forward pass, then swap it in (engine.pipeline.service.InferenceEngine.replace_model).

- Requests already inside the engine finish on the old model (they hold it, and their keys
  carry its version); every request after the swap uses the new one. The new version is the
  digest of the new files, so no answer of the old model is ever served for it.
- A load or check that fails leaves the old model serving; the error says why.
- With a fleet (engine.fleet.member), the replica that reloads tells the others: each loads the task
  from its own copy of the source in a thread of its own, swaps, and acknowledges through its
  registry record (whose `models` carry the versions). The operator's answer says which
  replicas run the new version and names those that do not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.errors import InvalidInputError, ModelLoadError
from engine.models.base import Classifier

log = logging.getLogger(__name__)

FLEET_OP = "reload"
# How long an operator's reload waits for the other replicas to load and swap: loading the
# built-in models takes seconds, a large user model on a busy CPU can take a minute.
RELOAD_ACK_TIMEOUT_S = 120.0


class ReloadBusyError(Exception):
    """A reload of this task is already running here."""


class SwappableEngine(Protocol):
    @property
    def models(self) -> Any: ...
    def replace_model(self, task: str, model: Classifier) -> Classifier: ...


@dataclass(frozen=True)
class ReloadResult:
    task: str
    version_before: str
    version: str
    changed: bool  # False: the source holds what was already served (nothing swapped)
    load_s: float
    fleet: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": True, "task": self.task, "version_before": self.version_before, "version": self.version,
                "changed": self.changed, "load_s": round(self.load_s, 3), "fleet": self.fleet}  # fmt: skip


class ModelLifecycle:
    """Owns reloads for one engine. `load(task)` builds and checks a fresh model from the
    task's source (engine.models.loader.build_model) or raises ModelLoadError."""

    def __init__(
        self,
        *,
        engine: SwappableEngine,
        load: Callable[[str], Classifier] | None,
        on_swap: Callable[[str, Classifier, Classifier], None] | None = None,
    ) -> None:
        self._engine = engine
        self._load = load
        self._on_swap = on_swap  # (task, old, new): e.g. warm the new version
        self._busy: set[str] = set()
        self._lock = threading.Lock()
        self._fleet: Any = None
        self.remote_reloads = 0  # reloads asked by another replica and done here

    def attach_fleet(self, fleet: Any) -> None:
        """engine.fleet.member.FleetMember: reloads asked by other replicas are done here too."""
        self._fleet = fleet
        fleet.add_handler(FLEET_OP, self._on_fleet_message)

    def reload(self, task: str) -> ReloadResult:
        """Load `task` again here and swap it in (raises InvalidInputError for an unknown task,
        ReloadBusyError, or ModelLoadError with the reason; the old model keeps serving)."""
        old = self._engine.models.get(task)
        if old is None:
            raise InvalidInputError("unknown_task", f"Unknown task {task!r}.")
        if self._load is None:
            raise ModelLoadError(f"task {task!r} has no source to reload from")
        with self._lock:
            if task in self._busy:
                raise ReloadBusyError(f"a reload of {task!r} is already running")
            self._busy.add(task)
        try:
            started = time.perf_counter()
            new = self._load(task)  # beside the old one, which serves meanwhile; checked by the loader
            load_s = time.perf_counter() - started
            old = self._engine.models[task]
            if new.version == old.version and not _revives(old, new):
                close = getattr(new, "close", None)
                if callable(close):  # a remote model's client and check thread (engine.models.remote)
                    close()
                log.info("reload %s: the source holds version %s already; nothing swapped", task, old.version)
                return ReloadResult(task, old.version, new.version, False, load_s)
            self._engine.replace_model(task, new)
            if self._on_swap is not None:
                self._on_swap(task, old, new)
            return ReloadResult(task, old.version, new.version, True, load_s)
        finally:
            with self._lock:
                self._busy.discard(task)

    def reload_fleet(self, task: str, *, note: str = "") -> ReloadResult:
        """Reload here, then on every live replica, waiting for their acknowledgements."""
        result = self.reload(task)
        if self._fleet is None:
            return result
        version = result.version
        ack = self._fleet.broadcast(
            {"op": FLEET_OP, "task": task, "version": version, "note": note},
            satisfied=lambda record: (record.get("models") or {}).get(task) == version,
            timeout_s=RELOAD_ACK_TIMEOUT_S,
        )
        return ReloadResult(result.task, result.version_before, version, result.changed, result.load_s,
                            ack.as_dict())  # fmt: skip

    def _on_fleet_message(self, message: dict[str, Any]) -> None:
        task, version = str(message.get("task", "")), str(message.get("version", ""))
        model = self._engine.models.get(task)
        if model is None or model.version == version:
            self._fleet.beat_now()  # nothing to do (the sender itself, or done already)
            return
        threading.Thread(target=self._remote_reload, args=(task, version), name=f"reload-{task}",
                         daemon=True).start()  # fmt: skip

    def _remote_reload(self, task: str, version: str) -> None:
        try:
            result = self.reload(task)
            self.remote_reloads += 1
            if result.version != version:
                log.warning("reload %s asked by the fleet: this replica's source gives version %s, not %s",
                            task, result.version, version)  # fmt: skip
        except (ModelLoadError, ReloadBusyError, InvalidInputError) as exc:
            log.error("reload %s asked by the fleet failed here; the old model keeps serving: %s", task, exc)
        except Exception:
            log.exception("reload %s asked by the fleet failed here; the old model keeps serving", task)
        finally:
            self._fleet.beat_now()  # the acknowledgement: the record carries the version served now


def _revives(old: Classifier, new: Classifier) -> bool:
    """A remote model whose server is not used now, and a fresh one of the same version whose check
    passed: the swap brings the remote back at once rather than at its next background check."""
    before = getattr(old, "remote_state", lambda: None)()
    after = getattr(new, "remote_state", lambda: None)()
    return before is not None and after is not None and not before["usable"] and after["usable"]
