"""The composition root, on the top floor beside `app.py` (the one module that knows every
package): builds every long-lived resource from Settings, owns them, and closes them in
reverse order. `app.py`, tests and benchmarks all start here."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field

from sqlalchemy.engine import Engine as SqlEngine

from admin.auth import AdminAuth, generate_token
from admin.clients.service import ClientActivity, FairnessCollector
from admin.console.service import AdminService, record_to_row
from admin.hard_examples.service import HardExamplesCollector
from admin.insights.service import Insights
from admin.monitoring.device_health import DeviceMonitor
from admin.monitoring.metrics import Metrics
from common.startup_clock import phase
from engine.cache.codec import ValueCodec
from engine.cache.generation import LocalGeneration, RedisGeneration
from engine.cache.l1_gate import GatedMemoryStore, GenerationConfirmations
from engine.capacity.fairness import MissBudget
from engine.capacity.forwarding import Forwarding
from engine.fleet.flight import FleetFlight
from engine.fleet.member import FleetMember
from engine.lifecycle.cleanup import Cleanup
from engine.lifecycle.reload import ModelLifecycle
from engine.lifecycle.warmup import WarmSet
from engine.models.base import Classifier
from engine.models.config import DEFAULT_SPECS, ModelSpec, load_config
from engine.models.loader import LoadOptions, build_model, load_all
from engine.models.onnx_backend import TorchThreads
from engine.models.remote import RemoteOptions
from engine.pipeline.service import CachePolicy, InferenceEngine
from engine.quality.hard_examples import HardExamples
from engine.sizing.key_sampler import KeySampler
from process_setup import thaw_collector
from settings import Settings, usable_cores
from storage.breaker import CircuitBreaker
from storage.errors import CacheUnavailableError
from storage.log_writer import RequestLogWriter
from storage.memory import MemoryStore
from storage.redis.buckets import RedisBuckets
from storage.redis.clients import make_nodes
from storage.redis.embedded import EmbeddedRedis, EmbeddedRedisError, find_redis_server
from storage.redis.fleet import FleetKeys, FleetRedis
from storage.redis.hard_examples import HardExampleStore
from storage.redis.store import RedisStore
from storage.sql import make_engine, migrate

log = logging.getLogger(__name__)

ModelFactory = Callable[[Settings], Mapping[str, Classifier]]


def model_specs(settings: Settings) -> tuple[ModelSpec, ...]:
    """What MODELS_CONFIG lists (raises ModelConfigError naming a bad entry); unset: the built-ins."""
    return load_config(settings.models.models_config) if settings.models.models_config else DEFAULT_SPECS


def load_options(settings: Settings) -> LoadOptions:
    return LoadOptions(
        device=settings.models.device, half_precision=settings.models.half_precision,
        max_upload_bytes=settings.limits.max_upload_bytes, max_image_pixels=settings.limits.max_image_pixels,
        max_text_chars=settings.limits.max_text_chars, backend=settings.models.inference_backend,
        export_dir=settings.export_dir, cpu_cores=usable_cores(),
        miss_concurrency_cpu=settings.models.miss_concurrency_cpu,
        remote=RemoteOptions(
            connect_timeout_s=settings.remote.connect_timeout_s, timeout_s=settings.remote.timeout_s,
            breaker_failures=settings.remote.breaker_failure_threshold,
            breaker_reset_s=settings.remote.breaker_reset_s, breaker_max_s=settings.remote.breaker_max_s,
        ),
    )  # fmt: skip


def load_models(settings: Settings) -> dict[str, Classifier]:
    """The configured models, loaded once and each checked with a forward pass (import is
    cheap; this is not)."""
    with phase("models"):
        return load_all(model_specs(settings), load_options(settings))


class ModelsLoading:
    """The configured models, loading in a thread from construction on, while the rest of the
    start goes on (gradio's import, the private redis-server, the SQL migration): a
    `model_factory` for `build_runtime`, which waits for them. A failure is raised there."""

    def __init__(self, settings: Settings, factory: ModelFactory = load_models) -> None:
        self._settings = settings
        self._result: Mapping[str, Classifier] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._load, args=(factory,), name="models-loading",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def _load(self, factory: ModelFactory) -> None:
        try:
            self._result = factory(self._settings)
        except BaseException as exc:  # raised in the thread that asks for the models
            self._error = exc

    def __call__(self, settings: Settings) -> Mapping[str, Classifier]:
        if settings is not self._settings:
            raise ValueError("the models were loading for other settings")
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


@dataclass
class Runtime:
    """Everything the app runs on. Use as a context manager, or call close()."""

    settings: Settings
    engine: InferenceEngine
    l2_url: str | None
    admin: AdminService
    auth: AdminAuth
    metrics: Metrics
    log_writer: RequestLogWriter
    _stack: ExitStack = field(repr=False)
    fleet: FleetMember | None = None  # with Redis: this replica in the fleet (engine.fleet.member)
    lifecycle: ModelLifecycle | None = None  # live model reloads (engine.lifecycle.reload)
    warm_set: WarmSet | None = None  # WARM_SET_SIZE > 0 with Redis: warm-up (engine.lifecycle.warmup)
    torch_threads: TorchThreads | None = None  # torch's pool for the models served (onnx_backend)
    client_activity: ClientActivity | None = None  # the console's Busiest clients (admin.clients.service)
    # Who a request is from behind proxies (engine.capacity.forwarding); ServingApp applies it to each
    # request.
    forwarding: Forwarding | None = None
    # HARD_EXAMPLES_SIZE > 0 with Redis (engine.quality.hard_examples)
    hard_examples: HardExamples | None = None
    insights: Insights | None = None  # sizing, worth, Redis/GPU health, CSV (admin.insights.service)

    def close(self) -> None:
        self._stack.close()

    def wait_for_l2(self, timeout_s: float, *, poll_s: float = 0.25) -> bool:
        """Whether Redis answered within `timeout_s` (True at once without L2). Start-up
        readiness waits on this; afterwards a Redis outage is the breaker's business."""
        store = self.engine.l2_store()
        if store is None:
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if store.ping():
                    return True
            except CacheUnavailableError:
                pass
            if time.monotonic() >= deadline:
                log.warning("Redis did not answer within %.1f s of start-up: ready without L2 for now",
                            timeout_s)  # fmt: skip
                return False
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _generated_token() -> str:
    token = generate_token()
    # Printed once, to the server log only: whoever can read it is local to the server.
    log.warning("ADMIN_TOKEN is not set; this run's admin token is: %s", token)
    return token


def _redacted(url: str) -> str:
    if "@" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


def build_runtime(
    settings: Settings,
    *,
    models: Mapping[str, Classifier] | None = None,
    model_factory: ModelFactory = load_models,
    model_loader: Callable[[str], Classifier] | None = None,
) -> Runtime:
    """`model_loader(task)`: a live reload's fresh model (engine.lifecycle.reload); by default the
    task's MODELS_CONFIG entry loaded again, when the models came from the config."""
    stack = ExitStack()
    try:
        # Redis and the SQL schema first: they need no model, and models may still be loading
        # in another thread (ModelsLoading).
        settings.server.data_dir.mkdir(parents=True, exist_ok=True)
        with phase("L2 (Redis)"):
            l2_url, notice = _resolve_l2(settings, stack)
        with phase("SQL engine and migration"):
            db = make_engine(settings.effective_database_url)
            stack.callback(db.dispose)
            migrate(db)
        with phase("models (what is left to wait for)"):
            loaded = dict(models) if models is not None else dict(model_factory(settings))
        # What this runtime loaded it owns (a remote model's client and check thread are closed last);
        # models given to it are the caller's.
        given = {id(m) for m in models.values()} if models is not None else set()

        def release(model: Classifier) -> None:
            if id(model) not in given:
                _release(model)

        served: Mapping[str, Classifier] = loaded  # the engine's models once it is built (swaps included)
        stack.callback(lambda: [release(m) for m in list(served.values())])
        if model_loader is None and models is None:
            specs = {spec.task: spec for spec in model_specs(settings)}
            options = load_options(settings)
            model_loader = lambda task: build_model(specs[task], options)  # noqa: E731

        # With a shared Redis, L1 is served only while the generation is confirmed (engine.cache.l1_gate).
        confirmations = GenerationConfirmations(bound_s=settings.fleet.generation_confirm_s)
        l1_sizes = {"max_bytes": settings.cache.l1_max_bytes, "default_ttl_s": settings.cache.l1_ttl_s}
        l1 = (MemoryStore(**l1_sizes) if l2_url is None
              else GatedMemoryStore(confirmations=confirmations, **l1_sizes))  # fmt: skip
        l2: RedisStore | None = None
        fleet_redis: FleetRedis | None = None
        flight: FleetFlight | None = None
        generation: LocalGeneration | RedisGeneration
        if l2_url is None:
            generation = LocalGeneration()
        else:
            def breaker() -> CircuitBreaker:  # one per primary: a dead cluster node costs only its slots
                return CircuitBreaker(
                    failure_threshold=settings.redis.breaker_failure_threshold,
                    reset_s=settings.redis.breaker_reset_s,
                )

            nodes = make_nodes(l2_url, socket_timeout_s=settings.redis.socket_timeout_s)
            l2 = RedisStore(nodes, prefix=settings.cache.prefix, breaker=breaker(), breaker_factory=breaker)
            stack.callback(l2.close)
            fleet_redis = FleetRedis(l2, keys=FleetKeys(settings.cache.prefix))
            generation = RedisGeneration(
                l2, key=fleet_redis.keys.generation, refresh_s=settings.fleet.generation_refresh_s
            )
            flight = FleetFlight(
                fleet_redis, owner=settings.server.replica_id, max_wait_s=settings.fleet.flight_lease_max_s
            )
        policy = CachePolicy(
            prefix=settings.cache.prefix,
            l1_ttl_s=settings.cache.l1_ttl_s,
            l2_ttl_s=settings.cache.ttl_s,
            negative_ttl_s=settings.cache.negative_ttl_s,
        )
        engine = InferenceEngine(
            models=loaded, l1=l1, l2=l2, generation=generation, policy=policy, l2_notice=notice,
            batch_max_size=settings.models.batch_max_size,
            miss_concurrency={
                task: settings.models.miss_concurrency_for(m.device) for task, m in loaded.items()
            },
            codec=(codec := ValueCodec([key.encode() for key in settings.cache.signing_keys])),
            shadow_sample_rate=settings.quality.shadow_sample_rate, fleet_flight=flight,
            miss_budget=_miss_budget(settings, l2, policy),
        )  # fmt: skip
        served = engine.models
        stack.callback(engine.close)  # its waiting L2 writes go out before the store closes
        warm_set = _warm_set(settings, engine, l2)
        if warm_set is not None:
            stack.callback(warm_set.close)  # stops before the engine and the store it uses
        hard_examples = _hard_examples(settings, engine, l2)
        if hard_examples is not None:
            stack.callback(hard_examples.close)  # its last flush before the store closes
        torch_threads = TorchThreads()
        torch_threads.apply(loaded.values())
        stack.callback(torch_threads.restore)

        def on_swap(task: str, old: Classifier, _new: Classifier) -> None:
            torch_threads.apply(engine.models.values())  # the new model may run on torch
            release(old)  # a remote model's client and check thread
            thaw_collector()  # the old model's reference cycles must be collectable (process_setup)
            if warm_set is not None:
                warm_set.trigger([task])

        lifecycle = ModelLifecycle(engine=engine, load=model_loader, on_swap=on_swap)
        cleanup = Cleanup(l2, prefix=settings.cache.prefix, current=lambda: (
            {task: model.version for task, model in engine.models.items()}, engine.generation))  # fmt: skip
        stack.callback(cleanup.close)  # its job stops before the store closes
        if isinstance(generation, RedisGeneration):
            generation.start()
        stack.callback(generation.close)  # closed before the store it polls
        if warm_set is not None:  # subscribed after start-up's first read: only a later bump warms
            generation.subscribe(lambda _old, _new: warm_set.trigger(list(engine.models)))
        fleet: FleetMember | None = None
        if fleet_redis is not None and isinstance(generation, RedisGeneration):
            fleet = FleetMember(
                redis=fleet_redis, replica_id=settings.server.replica_id, engine=engine,
                generation=generation, confirmations=confirmations, heartbeat_s=settings.fleet.heartbeat_s,
                refresh_s=settings.fleet.generation_refresh_s, ack_timeout_s=settings.fleet.ack_timeout_s,
                on_peers=flight.set_peers if flight is not None else None,
            )  # fmt: skip
            fleet.start()
            stack.callback(fleet.close)  # leaves the registry before the store closes
            engine.attach_fleet(fleet)
            lifecycle.attach_fleet(fleet)  # a reload here reaches every replica

        writer = RequestLogWriter(
            db, to_row=record_to_row, retention_days=settings.log.retention_days,
            max_rows=settings.log.max_rows, replica=settings.server.replica_id,
        )  # fmt: skip
        stack.callback(writer.close)  # flushes queued rows before the database goes
        engine.add_listener(writer.submit)
        metrics = Metrics(engine, writer)
        engine.add_listener(metrics.observe)
        forwarding = Forwarding(
            settings.fairness.forwarded_allow_ips, settings.fairness.forwarded_trusted_hops,
        )
        # Busiest clients, untrusted proxies; refusals and queue waits in /metrics
        client_activity = ClientActivity(forwarding)
        engine.add_listener(client_activity.observe)
        metrics.registry.register(FairnessCollector(engine, client_activity))
        if hard_examples is not None:
            metrics.registry.register(HardExamplesCollector(hard_examples))
        admin = AdminService(engine=engine, db=db, writer=writer, replica_id=settings.server.replica_id,
                             fleet=fleet, lifecycle=lifecycle, cleanup=cleanup, warm_set=warm_set,
                             hard_examples=hard_examples)  # fmt: skip
        auth = AdminAuth(settings.server.admin_token or _generated_token())
        insights = _insights(settings, engine, codec, stack, db=db, writer=writer, admin=admin)
        _log_components(settings, l2_url, fleet is not None)
        return Runtime(
            settings=settings, engine=engine, l2_url=l2_url, admin=admin, auth=auth, metrics=metrics,
            log_writer=writer, _stack=stack, fleet=fleet, lifecycle=lifecycle, warm_set=warm_set,
            torch_threads=torch_threads, client_activity=client_activity, hard_examples=hard_examples,
            insights=insights, forwarding=forwarding,
        )  # fmt: skip
    except BaseException:
        stack.close()
        raise


def _release(model: Classifier) -> None:
    """Close what a model holds beyond memory (a remote model's client and check thread)."""
    close = getattr(model, "close", None)
    if callable(close):
        close()


def _miss_budget(settings: Settings, l2: RedisStore | None, policy: CachePolicy) -> MissBudget | None:
    """CLIENT_MISS_RATE > 0: each client's misses spend from one bucket for the fleet (in
    Redis, under the prefix's meta keys, which a flush keeps), or this process's own."""
    if settings.fairness.client_miss_rate <= 0:
        return None
    shared = RedisBuckets(l2, prefix=f"{policy.meta_prefix}miss-budget:") if l2 is not None else None
    return MissBudget(
        rate=settings.fairness.client_miss_rate, burst=settings.fairness.client_miss_burst, shared=shared,
    )


def _log_components(settings: Settings, l2_url: str | None, in_fleet: bool) -> None:
    """One start-up line per component the models' and Redis's own lines do not cover."""
    log.info("L1: in-process LRU of %.0f MiB, entries kept %.0f s", settings.cache.l1_max_bytes / 2**20,
             settings.cache.l1_ttl_s)  # fmt: skip
    if l2_url is not None:
        log.info("L2: Redis %s, entries kept %d s%s", _redacted(l2_url), settings.cache.ttl_s,
                 f", replica {settings.server.replica_id} of a fleet" if in_fleet else "")  # fmt: skip
    log.info("request log: %s (kept %g days, at most %d rows)", _redacted(settings.effective_database_url),
             settings.log.retention_days, settings.log.max_rows)  # fmt: skip
    sizing = (f"up to {settings.console.sizing_max_keys} keys a task" if settings.console.sizing_max_keys
              else "off")  # fmt: skip
    log.info("operator console: the Admin tab, /admin/api/* (Bearer ADMIN_TOKEN), /metrics; "
             "sizing samples %s", sizing)  # fmt: skip


def _insights(
    settings: Settings, engine: InferenceEngine, codec: ValueCodec, stack: ExitStack, *,
    db: SqlEngine, writer: RequestLogWriter, admin: AdminService,
) -> Insights:  # fmt: skip
    """The operator's questions (admin.insights.service): the key-stream sampler behind the sizing
    curves (SIZING_MAX_KEYS=0: none) and, on CUDA, the GPU trend's sampler thread."""
    sampler = None
    if settings.console.sizing_max_keys > 0:
        sampler = KeySampler(
            sizer=engine.footprint,  # a use's bytes in L1 and in L2, as each counts them
            max_keys=settings.console.sizing_max_keys, l1_ttl_s=settings.cache.l1_ttl_s,
            l2_ttl_s=settings.cache.ttl_s, cpu_share=settings.console.sizing_cpu_share,
        )  # fmt: skip
        engine.observe_keys(sampler.observe)
        sampler.start()
        stack.callback(sampler.close)
    devices = DeviceMonitor().start()
    stack.callback(devices.close)
    return Insights(
        engine=engine, db=db, writer=writer, window_s=admin.window_s, sampler=sampler,
        l1_max_bytes=settings.cache.l1_max_bytes, cost_per_hour=settings.console.model_cost_per_hour,
        devices=devices,
    )  # fmt: skip


def _warm_set(settings: Settings, engine: InferenceEngine, l2: RedisStore | None) -> WarmSet | None:
    """WARM_SET_SIZE > 0: the hottest inputs kept in Redis and recomputed after a swap or a bump.
    Closed (registered by the caller's stack) before the engine and the store."""
    if settings.warmup.size <= 0:
        return None
    if l2 is None:
        log.warning("WARM_SET_SIZE=%s needs Redis (L2 is off): no warm-up", settings.warmup.size)
        return None
    warm_set = WarmSet(l2, prefix=settings.cache.prefix, size=settings.warmup.size,
                       ttl_s=settings.warmup.ttl_s, engine=engine).start()  # fmt: skip
    engine.attach_warm_set(warm_set)
    return warm_set


def _hard_examples(settings: Settings, engine: InferenceEngine, l2: RedisStore | None) -> HardExamples | None:
    """HARD_EXAMPLES_SIZE > 0: inputs the model was unsure of kept in Redis for an operator to
    label. Closed (registered by the caller's stack) before the engine and the store."""
    if settings.quality.hard_examples_size <= 0:
        return None
    if l2 is None:
        log.warning("HARD_EXAMPLES_SIZE=%s needs Redis (L2 is off): no hard examples",
                    settings.quality.hard_examples_size)  # fmt: skip
        return None
    collector = HardExamples(
        HardExampleStore(l2, prefix=settings.cache.prefix), size=settings.quality.hard_examples_size,
        ttl_s=settings.quality.hard_examples_ttl_s, max_score=settings.quality.hard_example_max_score,
        min_margin=settings.quality.hard_example_min_margin, models=lambda: engine.models,
        cpu_share=settings.quality.hard_examples_cpu_share,
    ).start()  # fmt: skip
    engine.add_answer_hook(collector.note)
    if engine.shadow is not None:
        engine.shadow.add_mismatch_listener(collector.note_disagreement)
    return collector


def _resolve_l2(settings: Settings, stack: ExitStack) -> tuple[str | None, str | None]:
    """Returns (redis URL or None, a notice for operators when L2 is not in use)."""
    if settings.redis.l2_disabled:
        return None, "L2 is disabled (REDIS_URL=off): answers are cached in this process only."
    if settings.redis.url:
        log.info("L2: Redis at %s", _redacted(settings.redis.url))
        return settings.redis.url, None
    if find_redis_server() is None:
        notice = (
            "redis-server is not installed and REDIS_URL is not set: running with the "
            "in-process cache only. Install redis-server or set REDIS_URL to share results."
        )
        log.warning(notice)
        return None, notice
    embedded = EmbeddedRedis(data_dir=settings.server.data_dir, maxmemory_mb=settings.redis.maxmemory_mb)
    try:
        url = embedded.start()
    except EmbeddedRedisError as exc:
        notice = f"the private redis-server did not start ({exc}); in-process cache only."
        log.warning(notice)
        return None, notice
    stack.callback(embedded.close)
    return url, None
