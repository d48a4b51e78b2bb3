"""This replica as a member of the fleet that shares one Redis.

One owned background thread ("fleet-member") does three things:

- **heartbeats** into the replica registry (id, host, start time, model versions,
  generation, flush epoch, L1 size, hit rate, last seen), every `heartbeat_s`, under a key
  that expires after `3 x heartbeat_s` unless renewed, so a dead replica leaves the list of
  live ones by itself;
- **listens** on the fleet channel: a bump (a generation) or an L1 operation (flush,
  evict) from any replica is applied here at once and acknowledged by an immediate
  heartbeat carrying the new generation and epoch;
- **polls** the shared generation and the operation epoch every `refresh_s`: a message
  missed (a dropped connection) is caught up from the epoch (the whole L1 dropped, since
  what was missed is unknown), and each successful read confirms the generation for the L1
  gate (engine.cache.l1_gate).

An operator's action (admin/console/service.py) goes through `broadcast_*`/`announce_generation`,
which return a `FleetAck`: which live replicas confirmed, and by name those that did not
within `ack_timeout_s`, those that left the registry meanwhile, and those whose heartbeat
had already stopped.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.background import BackgroundThread
from engine.cache.generation import RedisGeneration
from engine.cache.l1_gate import GenerationConfirmations
from engine.errors import CacheUnavailableError
from storage.redis.fleet import FleetRedis

log = logging.getLogger(__name__)

RECORD_TTL_BEATS = 3  # a live record outlives this many missed heartbeats
FORGET_AFTER_S = 600.0  # a stopped or lost replica stays listed this long, then is forgotten
ACK_POLL_FIRST_S = 0.005  # waiting for acknowledgements: first look, then doubling...
ACK_POLL_MAX_S = 0.1  # ...up to this
RESUBSCRIBE_S = 1.0  # after the channel's connection broke, try again after this long


class MemberEngine(Protocol):
    """What the member needs of the engine (engine.pipeline.service.InferenceEngine)."""

    def drop_local(self, tier: str) -> int: ...
    def evict_local(self, keys: list[str]) -> int: ...
    def replica_state(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class FleetAck:
    """How far an operator's action reached."""

    confirmed: tuple[str, ...] = ()  # live replicas that applied it
    unconfirmed: tuple[str, ...] = ()  # live replicas that did not confirm within the timeout
    left: tuple[str, ...] = ()  # live when the action started; their record expired meanwhile
    lost: tuple[str, ...] = ()  # already without a heartbeat (dead, or cut off from Redis)
    waited_s: float = 0.0
    timeout_s: float = 0.0
    error: str | None = None  # the fleet could not be told at all

    @property
    def complete(self) -> bool:
        return self.error is None and not self.unconfirmed and not self.left

    def as_dict(self) -> dict[str, Any]:
        return {
            "complete": self.complete, "confirmed": list(self.confirmed),
            "unconfirmed": list(self.unconfirmed), "left": list(self.left), "lost": list(self.lost),
            "waited_s": round(self.waited_s, 4), "timeout_s": self.timeout_s, "error": self.error,
        }  # fmt: skip


@dataclass
class _Epoch:
    applied: int | None = None  # None until the first successful poll
    gap_since: float | None = None  # when a poll first saw Redis ahead of `applied`
    lock: threading.Lock = field(default_factory=threading.Lock)


class FleetMember:
    def __init__(
        self,
        *,
        redis: FleetRedis,
        replica_id: str,
        engine: MemberEngine,
        generation: RedisGeneration,
        confirmations: GenerationConfirmations,
        heartbeat_s: float,
        refresh_s: float,
        ack_timeout_s: float,
        on_peers: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._redis = redis
        self.replica_id = replica_id
        self._engine = engine
        self._generation = generation
        self._confirmations = confirmations
        self._heartbeat_s = heartbeat_s
        self._refresh_s = refresh_s
        self.ack_timeout_s = ack_timeout_s
        self._on_peers = on_peers
        self._clock = clock
        self._wall = wall
        self._host = socket.gethostname()
        self._started_at = wall()
        self._epoch = _Epoch()
        self._beat_lock = threading.Lock()
        # After a failure the loop rests `refresh_s`: it is the fleet's ear, it must stay alive.
        self._worker = BackgroundThread("fleet-member", self._step, period_s=0, after_error_s=refresh_s,
                                        join_s=5, logger=log, what="fleet member loop")  # fmt: skip
        self._next_poll = self._next_beat = 0.0  # the clock's
        self._pubsub: Any = None
        self._subscribe_after = 0.0
        self.missed_caught_up = 0  # epochs caught up from a poll (messages missed)
        self._handlers: dict[str, Callable[[dict[str, Any]], None]] = {}  # add_handler

    # ---- life -----------------------------------------------------------------------

    def start(self) -> None:
        if self._worker.started:
            return
        self._subscribe()  # before the first poll: nothing published after it is missed
        self._poll()
        self._beat()
        self._count_peers()
        self._next_poll = self._clock() + self._refresh_s
        self._next_beat = self._clock() + self._heartbeat_s
        self._worker.start()

    def close(self) -> None:
        """Stop the thread and leave the registry (marked stopped, not lost). Idempotent."""
        if self._worker.stopping:
            return
        self._worker.close()
        self._close_pubsub()
        try:
            self._redis.mark_stopped(self.replica_id, self._record())
        except CacheUnavailableError:
            pass  # its live record expires by itself

    # ---- what the rest of the replica asks ------------------------------------------

    def l1_readable(self) -> bool:
        return self._confirmations.fresh()

    def replicas(self) -> list[dict[str, Any]]:
        """Every replica the registry knows: live ones, stopped ones, lost ones (for a while)."""
        now = self._wall()
        entries = self._redis.read_records()
        forgotten = [
            e.record["id"]
            for e in entries
            if not e.live and now - float(e.record.get("last_seen", 0)) > FORGET_AFTER_S
        ]
        if forgotten:
            self._redis.forget(forgotten)
        listed = []
        for entry in entries:
            if entry.record["id"] in forgotten:
                continue
            state = "live" if entry.live else ("stopped" if entry.record.get("stopped") else "lost")
            record = {k: v for k, v in entry.record.items() if k != "stopped"}
            seen_s_ago = round(max(0.0, now - float(record.get("last_seen", now))), 3)
            listed.append({**record, "state": state, "self": record["id"] == self.replica_id,
                           "seen_s_ago": seen_s_ago})  # fmt: skip
        return sorted(listed, key=lambda r: (r["state"] != "live", r["id"]))

    def broadcast_l1(self, operation: dict[str, Any], *, wait: bool = True) -> FleetAck:
        """Apply an L1 operation here and on every live replica: {"op": "flush", "tier": ...}
        or {"op": "evict", "keys": [...]}. The caller has already done the shared part (the
        L2 side) so that no replica refills its L1 from what was just removed. `wait`: for
        the live replicas' acknowledgements (else an empty FleetAck comes back at once)."""
        try:
            self._lift_epoch()
            epoch = self._redis.next_epoch()
        except CacheUnavailableError as exc:
            self._apply(operation)  # at least here
            return FleetAck(error=f"the fleet was not told (Redis unreachable: {exc})",
                            timeout_s=self.ack_timeout_s)  # fmt: skip
        self._apply_epoch(epoch, operation)
        self._beat()
        self._publish({**operation, "epoch": epoch})
        if not wait:
            return FleetAck(timeout_s=0.0)
        return self._await(lambda r: _number(r, "flush_epoch") >= epoch)

    def announce_generation(self, generation: int) -> FleetAck:
        """After a bump here: tell every replica, and wait for their acknowledgements."""
        self._confirmations.confirm()  # the bump itself read the shared value
        self._beat()
        self._publish({"op": "generation", "generation": generation})
        return self._await(lambda r: _number(r, "generation") >= generation)

    def add_handler(self, op: str, handler: Callable[[dict[str, Any]], None]) -> None:
        """Another kind of fleet message (engine.lifecycle.reload's model reload). The handler runs on
        this member's thread, so it must return at once (long work goes to a thread of its own),
        and it acknowledges by calling `beat_now()` when done."""
        self._handlers[op] = handler

    def beat_now(self) -> None:
        """Write this replica's record now (an acknowledgement of work done off this thread)."""
        self._beat()

    def broadcast(self, message: dict[str, Any], *, satisfied: Callable[[dict[str, Any]], bool],
                  timeout_s: float) -> FleetAck:  # fmt: skip
        """Publish a message for the handlers of every replica (`add_handler`), already applied
        here, and wait up to `timeout_s` for each live replica's record to satisfy `satisfied`."""
        self._beat()
        self._publish(message)
        return self._await(satisfied, timeout_s=timeout_s)

    # ---- the thread -----------------------------------------------------------------

    def _step(self) -> None:
        now = self._clock()
        if self._pubsub is None and now >= self._subscribe_after:
            self._subscribe()
        wait = max(0.0, min(self._next_poll, self._next_beat) - now)
        if self._pubsub is not None:
            self._listen(wait)
        else:
            self._worker.wait(wait)
        now = self._clock()
        if now >= self._next_poll:
            self._next_poll = now + self._refresh_s
            self._poll()
        if now >= self._next_beat:
            self._next_beat = now + self._heartbeat_s
            self._beat()
            self._count_peers()

    def _subscribe(self) -> None:
        try:
            self._pubsub = self._redis.subscribe()
        except CacheUnavailableError:
            self._pubsub = None
            self._subscribe_after = self._clock() + RESUBSCRIBE_S

    def _close_pubsub(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            try:
                pubsub.close()
            except Exception:  # a broken connection may fail to close; it is dropped either way
                log.debug("closing the fleet channel failed", exc_info=True)

    def _listen(self, wait_s: float) -> None:
        """Messages for up to `wait_s`; a broken connection is dropped and re-made later."""
        deadline = self._clock() + wait_s
        while not self._worker.stopping:
            try:
                message = self._pubsub.get_message(timeout=max(0.0, min(0.1, deadline - self._clock())))
            except Exception as exc:  # redis errors and a connection closed under us alike
                log.warning("fleet channel lost (%s); catching up from the epoch", exc.__class__.__name__)
                self._close_pubsub()
                self._subscribe_after = self._clock() + RESUBSCRIBE_S
                return
            if message is not None and message.get("type") == "message":
                self._handle(message.get("data"))
            if self._clock() >= deadline:
                return

    def _handle(self, data: Any) -> None:
        try:
            message = json.loads(data)
            op = message["op"]
        except (TypeError, ValueError, KeyError):
            log.warning("ignoring an unreadable fleet message")
            return
        if op == "generation":
            self._generation.observe(int(message["generation"]))
            self._confirmations.confirm()  # Redis had it when the message was sent
        elif op in ("flush", "evict"):
            self._apply_epoch(int(message["epoch"]), message)
        elif op in self._handlers:
            try:
                self._handlers[op](message)
            except Exception:  # a handler's failure must not stop this thread
                log.exception("fleet handler for %r failed", op)
            return  # the handler acknowledges when its work is done
        else:
            log.warning("ignoring a fleet message of unknown kind %r", op)
            return
        self._beat()  # the acknowledgement

    # ---- applying operations ----------------------------------------------------------

    def _apply(self, operation: dict[str, Any]) -> None:
        if operation.get("op") == "evict":
            self._engine.evict_local([str(k) for k in operation.get("keys", [])])
        else:
            self._engine.drop_local(str(operation.get("tier", "all")))

    def _apply_epoch(self, epoch: int, operation: dict[str, Any] | None) -> None:
        with self._epoch.lock:
            applied = self._epoch.applied
            if applied is not None and epoch <= applied:
                return  # done already (ours, or caught up)
            if applied is not None and epoch == applied + 1 and operation is not None:
                self._apply(operation)
            else:  # something was missed (or we start): what it was is unknown, so drop it all
                self._engine.drop_local("all")
                if applied is not None:
                    self.missed_caught_up += 1
            self._epoch.applied = epoch
            self._epoch.gap_since = None

    def _poll(self) -> None:
        try:
            shared_generation, epoch = self._redis.read_counters()
        except CacheUnavailableError:
            return
        local = self._generation.current
        try:
            if shared_generation < local:  # Redis lost it: put it back rather than go back
                log.warning("shared generation %s is behind this replica's %s: lifting it",
                            shared_generation, local)  # fmt: skip
                self._redis.raise_counter(self._redis.keys.generation, local)
            else:
                self._generation.observe(shared_generation)
            self._confirmations.confirm()
            applied = self._epoch.applied
            if applied is None or (epoch > applied and self._gap_waited()):
                self._apply_epoch(epoch, None)
                if applied is not None:
                    self._beat()
            elif epoch < applied:
                self._redis.raise_counter(self._redis.keys.epoch, applied)
        except CacheUnavailableError:
            return

    def _gap_waited(self) -> bool:
        """Redis is ahead of what this replica applied: the message may be on its way, so
        catch up only if the gap is still there one poll later."""
        now = self._clock()
        with self._epoch.lock:
            if self._epoch.gap_since is None:
                self._epoch.gap_since = now
                return False
            return now - self._epoch.gap_since >= self._refresh_s * 0.9

    def _lift_epoch(self) -> None:
        _, epoch = self._redis.read_counters()
        applied = self._epoch.applied
        if applied is not None and epoch < applied:
            self._redis.raise_counter(self._redis.keys.epoch, applied)

    # ---- heartbeats and acknowledgements ------------------------------------------------

    def _record(self) -> dict[str, Any]:
        state = self._engine.replica_state()
        return {
            "id": self.replica_id, "host": self._host, "pid": os.getpid(),
            "started_at": round(self._started_at, 3), "last_seen": round(self._wall(), 3),
            "generation": self._generation.current, "flush_epoch": self._epoch.applied,
            "l1_readable": self._confirmations.fresh(), **state,
        }  # fmt: skip

    def _beat(self) -> None:
        with self._beat_lock:
            try:
                ttl_ms = int(self._heartbeat_s * RECORD_TTL_BEATS * 1000)
                self._redis.write_record(self.replica_id, self._record(), ttl_ms=ttl_ms)
            except CacheUnavailableError:
                pass  # the record expires if this goes on; the poll tells the L1 gate

    def _count_peers(self) -> None:
        if self._on_peers is None:
            return
        try:
            entries = self._redis.read_records()
        except CacheUnavailableError:
            return
        self._on_peers(sum(e.live for e in entries if e.record["id"] != self.replica_id))

    def _publish(self, message: dict[str, Any]) -> None:
        try:
            self._redis.publish({**message, "from": self.replica_id})
        except CacheUnavailableError:
            pass  # the others catch up from the epoch or the generation at their next poll

    def _await(
        self, satisfied: Callable[[dict[str, Any]], bool], *, timeout_s: float | None = None
    ) -> FleetAck:
        timeout_s = self.ack_timeout_s if timeout_s is None else timeout_s
        started = self._clock()
        deadline = started + timeout_s
        expected: set[str] | None = None  # live when the action started
        delay = ACK_POLL_FIRST_S
        while True:
            try:
                entries = self._redis.read_records()
            except CacheUnavailableError as exc:
                if self._clock() >= deadline:
                    waited = self._clock() - started
                    return FleetAck(error=f"acknowledgements unreadable: {exc}", waited_s=waited,
                                    timeout_s=timeout_s)  # fmt: skip
            else:
                live = {e.record["id"]: e.record for e in entries if e.live}
                stopped = {e.record["id"] for e in entries if not e.live and e.record.get("stopped")}
                if expected is None:
                    expected = set(live)
                confirmed = tuple(sorted(i for i, r in live.items() if satisfied(r)))
                waiting = tuple(sorted(set(live) - set(confirmed)))
                if not waiting or self._clock() >= deadline:
                    left = expected - set(live) - stopped
                    lost = {e.record["id"] for e in entries if not e.live} - stopped - left
                    return FleetAck(confirmed, waiting, tuple(sorted(left)), tuple(sorted(lost)),
                                    self._clock() - started, timeout_s)  # fmt: skip
            time.sleep(delay)
            delay = min(delay * 2, ACK_POLL_MAX_S)


def _number(record: dict[str, Any], name: str) -> int:
    """A counter of a registry record; -1 when absent (not known yet)."""
    value = record.get(name)
    return int(value) if isinstance(value, int | float) else -1
