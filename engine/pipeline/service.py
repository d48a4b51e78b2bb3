"""The one pipeline every request goes through: `InferenceEngine.classify(task, raw)`.

    raw input -> raw key (alias or remembered rejection?) -> canonical form -> key
      -> L1 -> [single-flight: L1 again -> L2 -> model] -> written to L2 and L1

Redis failures never reach the caller: L2 is skipped and the model answers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from functools import partial
from typing import Any

from engine.cache.codec import CachedAlias, CachedRejection, CachedResult, ValueCodec
from engine.cache.entries import EntryReport, EvictResult, entry_key, inspect_entry
from engine.cache.generation import LocalGeneration, RedisGeneration
from engine.cache.keys import CacheKey, digest_parts, raw_digest
from engine.cache.singleflight import SingleFlight
from engine.cache.tiers import CacheTiers, L2Budget
from engine.cache.write_batch import L2Write
from engine.capacity.admission import ContendedShare
from engine.capacity.fairness import MissBudget
from engine.capacity.passes import ModelPasses
from engine.errors import InvalidInputError, ModelError, OverBudgetError, RemoteUnavailableError
from engine.fleet.flight import FleetFlight
from engine.models.base import Classifier, model_state
from engine.pipeline.request_events import RequestEvents
from engine.pipeline.results import (  # re-exported: the engine's public types
    CachePolicy,
    ClassifyResult,
    EngineCounters,
    FlushResult,
    ProbeMiss,
    RequestListener,
    RequestRecord,  # noqa: F401
)
from engine.quality.shadow import ShadowVerifier
from storage.memory import MemoryStore
from storage.redis.store import RedisStore

log = logging.getLogger(__name__)

# `defer(function, *args)`: runs the function later, in order (an event loop's `call_soon`).
Defer = Callable[..., object]


class InferenceEngine:
    """Classifies through the tiered cache. Thread-safe; one per process."""

    def __init__(
        self,
        *,
        models: Mapping[str, Classifier],
        l1: MemoryStore,
        l2: RedisStore | None,
        generation: LocalGeneration | RedisGeneration,
        policy: CachePolicy,
        l2_notice: str | None = None,
        clock: Callable[[], float] = time.time,
        batch_max_size: int = 1,
        miss_concurrency: Mapping[str, int] | None = None,
        codec: ValueCodec | None = None,
        shadow_sample_rate: float = 0.0,
        fleet_flight: FleetFlight | None = None,
        miss_budget: MissBudget | None = None,
    ) -> None:
        self._models = dict(models)
        # Across replicas, a miss takes a Redis lease first (engine.fleet.flight).
        self._fleet_flight = fleet_flight
        self._fleet: Any = None  # engine.fleet.member.FleetMember, attached by the composition root
        self._answer_hooks: list[Callable[[str, ClassifyResult, Any], None]] = []  # add_answer_hook
        self._codec = codec or ValueCodec()  # unsigned (checksum) unless given signing keys
        # A miss's way to the model: batched or in a pass slot, waiting misses round-robin
        # across clients, each client's misses within its budget (engine.capacity: passes, fairness).
        self._passes = ModelPasses(
            self._models, batch_max_size=batch_max_size, miss_concurrency=miss_concurrency,
            on_pass=self._count_pass, miss_budget=miss_budget,
        )  # fmt: skip
        self._swap_lock = threading.Lock()
        self._l1 = l1
        self._l2 = l2
        self._tiers = CacheTiers(l1=l1, l2=l2, codec=self._codec, policy=policy, count=self._count)
        self._generation = generation
        self._policy = policy
        self._l2_notice = l2_notice
        self._clock = clock
        self._flights: SingleFlight[tuple[CachedResult, str, float | None]] = SingleFlight()
        self._counters = EngineCounters(
            model_calls={task: 0 for task in self._models},
            model_seconds={task: 0.0 for task in self._models},
            batch_sizes={task: {} for task in self._models},
        )
        self._counter_lock = threading.Lock()
        self._events = RequestEvents(clock)  # request records for the log, metrics, console
        # (task, key, value, tier): the sizing curves' sampler
        self._key_observer: Callable[[str, str, Any, str], None] | None = None
        # Entries of an old generation can never be read again: free their memory.
        generation.subscribe(lambda _old, _new: self._l1.clear())
        # A sample of hits recomputed off the request path while no request is inside.
        self._shadow: ShadowVerifier | None = None
        if shadow_sample_rate > 0:
            self._shadow = ShadowVerifier(
                rate=shadow_sample_rate, model_for=lambda task: self._models.get(task), evict=self.evict,
                idle=self.idle,
            )  # fmt: skip
            self._shadow.start()

    # ---- public API -------------------------------------------------------

    @property
    def models(self) -> Mapping[str, Classifier]:
        return self._models

    @property
    def generation(self) -> int:
        return self._generation.current

    def replace_model(self, task: str, model: Classifier) -> Classifier:
        """Serve `model` for `task` from now on (a live reload, engine.lifecycle.reload) and return the
        old one. One assignment swaps it: a request that already took the old model finishes
        on it (its key carries the old version), every later one takes the new model."""
        with self._swap_lock:
            old = self._models.get(task)
            if old is None:
                raise InvalidInputError("unknown_task", f"Unknown task {task!r}.")
            self._passes.set_model(task, model)  # before the model: the batcher checks which it serves
            self._models[task] = model
        log.info("%s: model %s replaced by %s", task, old.version, model.version)
        return old

    def admission_limit(self, task: str) -> int:
        """How many requests of a task may be inside the engine at once so that its
        misses use the model fully: its concurrent passes, or a full batch to share one."""
        return self._passes.admission_limit(task)

    def add_listener(self, listener: RequestListener) -> None:
        self._events.add_listener(listener)

    def observe_keys(self, observer: Callable[[str, str, Any, str], None]) -> None:
        """`observer(task, key, value, tier)` on every answered use of a result key, `tier` the
        ClassifyResult's (engine.sizing.key_sampler)."""
        self._key_observer = observer

    def footprint(self, key: str, value: Any) -> tuple[int, int, int]:
        """What one answered use of result `key` holds in L1 and in L2 (bytes, as each counts
        them), and the Redis keys those are, for the sizing curves: the result entry and the
        raw-input alias `_classify` reads before it (and writes on its first use) in L1, and in
        Redis where aliases go there (a task whose canonicalizing is not cheap), each as Redis's
        memory accounting sees it."""
        from engine.sizing.key_sampler import redis_entry_bytes

        blob = len(self._tiers.codec.encode(value, key=key))
        task, version, generation, digest = key[len(self._policy.prefix) + 1 :].rsplit(":", 3)
        raw_key = str(CacheKey(self._policy.prefix, f"{task}-raw", version, int(generation), digest))
        alias = len(self._tiers.codec.encode(CachedAlias(digest), key=raw_key))
        model = self._models.get(task)
        l2, keys = redis_entry_bytes(len(key), blob), 1
        if model is not None and not getattr(model, "cheap_canonicalize", False):
            l2, keys = l2 + redis_entry_bytes(len(raw_key), alias), 2
        return blob + len(key) + alias + len(raw_key), l2, keys

    def classify(
        self, task: str, raw: Any, *, probe: bool = False, route: str = "gradio", client: str | None = None
    ) -> ClassifyResult:
        """Answer one request. Raises InvalidInputError (user's fault), ModelError,
        OverBudgetError (a miss past `client`'s budget; engine.capacity.fairness), or ProbeMiss (probe
        mode only, when the answer is not cached). `route` names the front door (gradio, rest)
        in the request log and metrics; `client` (engine.capacity.fairness.client_id) who asked, None
        for the app's own requests (no budget)."""
        started = time.perf_counter()
        model = self._models.get(task)
        if model is None:
            raise InvalidInputError("unknown_task", f"Unknown task {task!r}.")
        generation = self._generation.current
        budget = self._tiers.budget()
        self._tiers.enter()
        try:
            result = self._classify(task, model, raw, generation, probe, started, budget, client=client)
        except ProbeMiss:
            raise
        except OverBudgetError as exc:
            self._count("refused")
            if exc.first and client is not None:
                log.warning("client %s is over its miss budget while other clients wait for the %s model: "
                            "its extra misses are refused, hits still served",
                            self._events.label(client), task)  # fmt: skip
            self._failed(task, model, generation, started, "refused", "over_budget", route, client)
            raise
        except InvalidInputError as exc:
            # A probe's failure is not an answer: the queued retry logs and counts it.
            if not probe:
                self._count("invalid")
                self._failed(task, model, generation, started, "invalid", exc.code, route, client)
            raise
        except Exception as exc:
            if probe:
                raise
            self._count("errors")
            self._failed(task, model, generation, started, "error", type(exc).__name__, route, client)
            if isinstance(exc, ModelError):
                raise
            log.exception("unexpected failure classifying %s input", task)
            raise ModelError("The model failed on this input. Please try again.") from exc
        finally:
            self._tiers.leave(budget)
        self._answered(task, result, raw, route, client)
        return result

    def warm(self, task: str, raw: Any) -> str:
        """A warm-up's request (engine.lifecycle.warmup): answered like `classify` so its result is cached
        for the version and generation served now, but seen by no listener (never in the request
        log or the metrics) and counted in no tier. Returns the tier ("l1", "l2", "miss"...)."""
        model = self._models.get(task)
        if model is None:
            raise InvalidInputError("unknown_task", f"Unknown task {task!r}.")
        budget = self._tiers.budget()
        self._tiers.enter()
        try:
            result = self._classify(task, model, raw, self._generation.current, False, time.perf_counter(),
                                    budget, quiet=True)  # fmt: skip
        finally:
            self._tiers.leave(budget)
        return result.tier

    def idle(self) -> bool:
        """Whether no request is inside the engine now (background work waits for this)."""
        return self._tiers.in_flight == 0

    def attach_warm_set(self, warm_set: Any) -> None:
        """engine.lifecycle.warmup.WarmSet: every answered request is noted (its key and raw input)."""
        self.add_answer_hook(lambda task, result, raw: warm_set.note(task, result.key, raw))

    def add_answer_hook(self, hook: Callable[[str, ClassifyResult, Any], None]) -> None:
        """`hook(task, result, raw)` after every answered request (engine.quality.hard_examples); it must
        be cheap and never raise: it runs on the request path."""
        self._answer_hooks.append(hook)

    def classify_from_memory(
        self, task: str, raw: Any, *, route: str, client: str | None = None, defer: Defer | None = None
    ) -> ClassifyResult | None:
        """The answer when this replica's memory (L1) holds it, else None; never blocks (no
        Redis, no model, no decode), so an event loop may call it for a small input. A hit
        is logged and counted as `classify` would; anything else is left to `classify`.

        `defer(function, *args)` (an event loop's `call_soon`), when given, takes the hit's
        bookkeeping (its count, the key sampler, shadow verification, the request record for
        the log, metrics and console, the answer hooks): it then runs once the caller has
        sent the answer, so the client waits for the lookup alone."""
        started = time.perf_counter()
        model = self._models.get(task)
        if model is None:
            return None
        generation = self._generation.current
        # An unavailable budget keeps every lookup in L1; a probe never writes L2, so the
        # write batch (whose last request out sends the waiting writes) is not entered.
        try:
            result = self._classify(task, model, raw, generation, True, started, L2Budget(False), defer=defer)
        except (ProbeMiss, InvalidInputError):
            return None
        if defer is None:
            self._answered(task, result, raw, route, client)
        else:
            defer(self._answered, task, result, raw, route, client)
        return result

    def close(self) -> None:
        """Stop the write timer and send the L2 writes still waiting (before the store closes)."""
        if self._shadow is not None:
            self._shadow.close()
        self._tiers.close()

    def bump_generation(self) -> int:
        """Make every cached entry unreachable at once (all replicas sharing the Redis)."""
        return self._generation.bump()

    def flush(self, tier: str) -> FlushResult:
        """Remove cached entries: tier is "l1", "l2" or "all". Scoped to this app's prefix."""
        return self._tiers.flush(tier)

    def entry_key(self, task: str, raw: Any) -> str:
        """The canonical key a request for `raw` would use now (raises InvalidInputError)."""
        model = self._models.get(task)
        if model is None:
            raise InvalidInputError("unknown_task", f"Unknown task {task!r}.")
        return entry_key(task, model, raw, prefix=self._policy.prefix, generation=self._generation.current)

    def check_input(self, task: str, raw: Any) -> None:
        """Raise InvalidInputError where `raw` is not an input the task's model can take (an
        upload that is not an image it can read, an empty message); caches nothing."""
        self.entry_key(task, raw)

    def inspect(self, task: str, raw: Any) -> EntryReport:
        """What each tier holds for `raw` now; changes nothing (see engine.cache.entries)."""
        key = self.entry_key(task, raw)
        return inspect_entry(task=task, key=key, model=self._models[task], generation=int(key.split(":")[-2]),
                             l1=self._l1, l2=self._l2, codec=self._codec, clock=self._clock)  # fmt: skip

    def evict(self, key: str) -> EvictResult:
        """Remove one entry from this replica's L1 and from L2. The one place an eviction
        happens (operator, shadow verification): a fleet-wide L1 eviction hooks in here."""
        removed_l1, removed_l2, error = self._tiers.delete(key)
        if self._fleet is not None:  # every other replica's L1 too (not waited for here)
            self._fleet.broadcast_l1({"op": "evict", "keys": [key]}, wait=False)
        log.warning("evicted %s: l1=%s l2=%s %s", key, removed_l1, removed_l2, error or "")
        return EvictResult(key, removed_l1, removed_l2, error)

    @property
    def shadow(self) -> ShadowVerifier | None:
        """The shadow verifier (None when SHADOW_SAMPLE_RATE is 0): stats() for the console."""
        return self._shadow

    @property
    def signed(self) -> bool:
        """Whether L2 values are signed (CACHE_SIGNING_KEY(S))."""
        return self._codec.signed

    def cache_state(self) -> dict[str, Any]:
        """Live state for the UI, /readyz and the console."""
        tiers = self._tiers.state(self._l2_notice)
        return {
            "generation": self._generation.current, "l1": tiers["l1"],
            "models": {t: model_state(m) for t, m in self._models.items()},
            "batches": self.batch_summary(), "l2": tiers["l2"],
        }  # fmt: skip

    def batch_summary(self) -> dict[str, dict[str, Any]]:
        """Per task: forward passes so far, inputs per pass (mean, largest), and the limits."""
        with self._counter_lock:
            sizes = {task: dict(by_size) for task, by_size in self._counters.batch_sizes.items()}
        summary = {}
        for task, by_size in sizes.items():
            passes = sum(by_size.values())
            inputs = sum(size * n for size, n in by_size.items())
            summary[task] = {
                "passes": passes,
                "mean_size": round(inputs / passes, 3) if passes else None,
                "max_size": max(by_size, default=None),
                **self._passes.limits(task),
            }
        return summary

    # ---- the fleet (engine.fleet.member) ------------------------------------------

    def attach_fleet(self, fleet: Any) -> None:
        """The FleetMember through which evictions reach the other replicas."""
        self._fleet = fleet

    def drop_local(self, tier: str) -> int:
        """A flush made through another replica, applied here: this process's L1 (tiers
        l1, all) and its L2 writes still waiting (l2, all), which must not land after it."""
        return self._tiers.drop_local(tier)

    def evict_local(self, keys: list[str]) -> int:
        return sum(self._l1.delete(key) for key in keys)

    def replica_state(self) -> dict[str, Any]:
        """What this replica's heartbeat tells the registry."""
        mem = self._l1.stats()
        c = self.counters()
        hits = c.hits_l1 + c.hits_l2 + c.coalesced
        answered = hits + c.misses
        return {
            "models": {t: m.version for t, m in self._models.items()},
            "l1_entries": mem.entries, "l1_bytes": mem.bytes, "requests": answered,
            "hit_rate": round(hits / answered, 4) if answered else None,
            "l2": self._l2.stats().state if self._l2 is not None else "disabled",
        }  # fmt: skip

    def counters(self) -> EngineCounters:
        with self._counter_lock:
            snapshot = EngineCounters(**asdict(self._counters))
        return snapshot

    def l2_store(self) -> RedisStore | None:
        return self._l2

    def fairness_state(self) -> dict[str, Any]:
        """The miss budget (None when off), clients limited now, and waits for a forward pass
        by (task, misses already waiting on arrival) as (count, seconds) (engine.capacity.fairness)."""
        return self._passes.fairness_state()

    def contended_share(self, client: str) -> ContendedShare:
        """`client`'s inputs in the passes that ran while others also wanted the model, against
        its fair share of them (engine.capacity.admission; benchmarks and the fault suite)."""
        return self._passes.contended_share(client)

    # ---- the pipeline -----------------------------------------------------

    def _classify(
        self,
        task: str,
        model: Classifier,
        raw: Any,
        generation: int,
        probe: bool,
        started: float,
        budget: L2Budget,
        *,
        quiet: bool = False,  # a warm-up's request: no hit/miss counted, no shadow sample
        client: str | None = None,
        defer: Defer | None = None,  # classify_from_memory's
    ) -> ClassifyResult:
        raw_key = str(CacheKey(self._policy.prefix, f"{task}-raw", model.version, generation,
                               raw_digest(raw)))  # fmt: skip
        # Raw-input aliases (and remembered rejections) go to Redis only where canonicalizing
        # is real work (decoding an image). For text it costs microseconds, less than the two
        # Redis round trips an alias would add to every miss and one to every L2 hit.
        cheap = getattr(model, "cheap_canonicalize", False)
        alias_budget = None if cheap else budget
        remembered, _ = self._tiers.lookup(raw_key, (CachedAlias, CachedRejection), alias_budget)
        canonical = None
        pending_alias: L2Write | None = None
        if isinstance(remembered, CachedRejection):
            if probe:  # a probe only answers positive hits; the queued call reports errors
                raise ProbeMiss()
            self._count("negative_hits")
            raise InvalidInputError(remembered.code, remembered.message)
        if isinstance(remembered, CachedAlias):
            digest = remembered.digest
        else:
            if probe and not cheap:
                raise ProbeMiss()
            if probe:
                try:
                    canonical = model.canonicalize(raw)
                except InvalidInputError:
                    raise ProbeMiss() from None
            else:
                canonical = self._canonicalize(model, raw, raw_key, alias_budget)
            digest = digest_parts(canonical.fingerprint_parts())
            blob = self._tiers.store(
                raw_key, CachedAlias(digest), self._policy.l2_ttl_s, self._policy.l1_ttl_s, None
            )
            if alias_budget is not None:
                # Its L2 write waits for the result's, to share that round trip on a miss.
                pending_alias = L2Write(raw_key, blob, self._policy.l2_ttl_s)

        key = str(CacheKey(self._policy.prefix, task, model.version, generation, digest))
        # Outside probe mode L2 is read inside the flight, so N concurrent misses cost
        # one Redis read; a probe has no flight and must look at L2 itself.
        cached, tier = self._tiers.lookup(key, (CachedResult,), budget if probe else None)
        if cached is None:
            if probe:
                raise ProbeMiss()
            known = canonical

            def canonical_input() -> Any:
                # Reached through the raw alias, the input is decoded only if L2 misses too.
                return known if known is not None else self._canonicalize(model, raw, raw_key, alias_budget)

            compute = partial(self._compute, key, model, canonical_input, budget, pending_alias, client)
            while True:
                try:
                    (cached, tier, model_ms), shared = self._flights.run(key, compute)
                    break
                except OverBudgetError as exc:
                    if exc.client == client:
                        raise
                    # Another client's refusal, met by joining its flight: take a turn of our own.
            if shared:
                tier, model_ms = "coalesced", None
        else:
            model_ms = None
        if pending_alias is not None and not pending_alias.sent:
            self._tiers.write_l2([pending_alias], budget)
        if not quiet:  # a warm-up's request is neither sampled nor counted as a hit or a miss
            if defer is None:
                self._note_use(task, key, cached, tier, raw, canonical)
            else:
                defer(self._note_use, task, key, cached, tier, raw, canonical)
        now = self._clock()
        return ClassifyResult(
            prediction=cached.prediction,
            tier=tier,
            key=key,
            model=model.name,
            model_version=model.version,
            generation=generation,
            latency_ms=(time.perf_counter() - started) * 1000.0,
            device=model.device,
            age_s=0.0 if tier == "miss" else max(0.0, now - cached.created_at),
            model_ms=model_ms,
            backend=getattr(model, "backend", "torch"),
        )

    def _canonicalize(self, model: Classifier, raw: Any, raw_key: str, budget: L2Budget | None) -> Any:
        try:
            return model.canonicalize(raw)
        except InvalidInputError as exc:
            # Remember the rejection briefly: a repeat costs a lookup, not a decode.
            rejection = CachedRejection(exc.code, exc.message, self._clock())
            ttl = self._policy.negative_ttl_s
            self._tiers.store(raw_key, rejection, ttl, min(float(ttl), self._policy.l1_ttl_s), budget)
            raise

    def _compute(
        self,
        key: str,
        model: Classifier,
        canonical_input: Callable[[], Any],
        budget: L2Budget,
        pending_alias: L2Write | None,
        client: str | None = None,
    ) -> tuple[CachedResult, str, float | None]:
        task = model.task
        # Inside the flight: another flight for this key may have just filled L1.
        cached, tier = self._tiers.lookup(key, (CachedResult,), budget)
        if cached is not None:
            return cached, tier, None  # type: ignore[return-value]
        # A real miss: admitted (the client's budget; engine.capacity.admission) until its pass is done.
        with self._passes.admitted(task, client):
            turn = None
            if self._fleet_flight is not None and budget.available and self._l2 is not None:
                turn = self._fleet_flight.take_turn(
                    model.task, key, look=lambda: self._tiers.lookup(key, (CachedResult,), budget)[0],
                    usable=lambda: budget.available,
                )  # fmt: skip
                if turn.found is not None:  # computed by another replica meanwhile
                    return turn.found, "coalesced", None  # type: ignore[return-value]
            canonical = canonical_input()
            model_started = time.perf_counter()
            elapsed, share = None, 1.0  # the pass (without the wait for it) and this input's share of it
            try:
                prediction, elapsed, share = self._passes.run(model, canonical, client)
            except (InvalidInputError, RemoteUnavailableError):  # the latter: 503 with Retry-After, said
                raise
            except Exception as exc:
                # Not the input's fault: never cached, reported as a model error.
                log.exception("%s model failed", model.name)
                raise ModelError(f"The {model.task} model failed: {exc.__class__.__name__}.") from exc
            finally:
                if elapsed is None:  # failed: the pass and its wait, which cannot be told apart here
                    elapsed = time.perf_counter() - model_started
                with self._counter_lock:
                    self._counters.model_calls[task] += 1
                    self._counters.model_seconds[task] += elapsed * share
            if turn is not None:
                turn.succeeded()
            result = CachedResult(prediction, model.version, self._clock())
            l2_ttl_s = getattr(model, "ttl_s", None) or self._policy.l2_ttl_s  # MODELS_CONFIG's ttl_s
            blob = self._tiers.store(key, result, l2_ttl_s, min(self._policy.l1_ttl_s, float(l2_ttl_s)), None)
            # The result first: a replica that finds the alias then finds what it points to.
            result_write = L2Write(key, blob, l2_ttl_s)
            self._tiers.write_l2([result_write] + ([pending_alias] if pending_alias else []), budget)
            return result, "miss", elapsed * 1000.0

    # ---- bookkeeping ------------------------------------------------------

    def _note_use(self, task: str, key: str, cached: Any, tier: str, raw: Any, canonical: Any) -> None:
        """One answered use of `key`: offered to shadow verification, observed, counted."""
        if self._shadow is not None and tier in ("l1", "l2"):
            self._shadow.offer(task, key, cached, raw, canonical)  # a random draw unless sampled
        if self._key_observer is not None:
            self._key_observer(task, key, cached, tier)
        self._count({"l1": "hits_l1", "l2": "hits_l2", "miss": "misses", "coalesced": "coalesced"}[tier])

    def _count_pass(self, task: str, size: int) -> None:
        with self._counter_lock:
            sizes = self._counters.batch_sizes[task]
            sizes[size] = sizes.get(size, 0) + 1

    def _count(self, name: str, n: int = 1) -> None:
        with self._counter_lock:
            setattr(self._counters, name, getattr(self._counters, name) + n)

    def _answered(self, task: str, result: ClassifyResult, raw: Any, route: str, client: str | None) -> None:
        self._events.answered(task, result, route, client)
        for hook in self._answer_hooks:  # the warm set, hard examples
            hook(task, result, raw)

    def _failed(
        self, task: str, model: Classifier, generation: int, started: float, status: str, error: str,
        route: str, client: str | None,
    ) -> None:  # fmt: skip
        self._events.failed(task, model.version, generation, started, status=status, error=error, route=route,
                            client=client)  # fmt: skip
