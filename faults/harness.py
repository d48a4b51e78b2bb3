"""One scenario's bookkeeping and the shared set-up: verdicts, the load, the client-side router,
Redis and the two apps."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from bench.models import SCORE_TOLERANCE
from engine.cache.keys import raw_digest
from engine.models.base import Classifier
from faults.client import FaultClient, Outcome, http_json
from faults.config import PREFIX, REDIS_MAXMEMORY_MB, Sizes
from faults.inputs import Case, Oracle, image_variants, probe_texts, text_variants
from faults.processes import AppProcess
from settings import Settings
from storage.redis.embedded import EmbeddedRedis, find_redis_server, free_port
from testing.postgres_server import PostgresServer


def judge(case: Case, outcome: Outcome, versions: dict[str, str]) -> tuple[str, str]:
    """("ok" | "failed" | "wrong", reason)."""
    expect = case.expect
    if outcome.kind in ("failure", "unreachable"):
        return "failed", outcome.message or outcome.kind
    if expect.kind == "answer":
        if outcome.kind != "answer":
            return "failed", f"input refused: {outcome.message}"
        return compare_answer(case, outcome, versions)
    if expect.kind == "any":  # no reference: an answer or a clear refusal are both fine
        return "ok", ""
    if outcome.kind == "answer":
        top = (outcome.label or {}).get("label")
        return "wrong", f"answered {top!r} where the engine refuses the input"
    if expect.kind == "error" and outcome.message != expect.message:
        return "wrong", f"message {outcome.message!r} instead of {expect.message!r}"
    return "ok", ""


def compare_answer(case: Case, outcome: Outcome, versions: dict[str, str]) -> tuple[str, str]:
    label, info = outcome.label or {}, outcome.info or {}
    try:
        got = {item["label"]: item["confidence"] for item in label["confidences"]}
    except (KeyError, TypeError):
        return "wrong", f"malformed label {str(label)[:120]}"
    expected = dict(case.expect.labels)
    # Within SCORE_TOLERANCE, not bit for bit; the labels may not differ.
    agree = got.keys() == expected.keys() and all(
        abs(got[name] - score) <= SCORE_TOLERANCE for name, score in expected.items()
    )
    if label.get("label") != case.expect.labels[0][0] or not agree:
        return "wrong", f"answer {label.get('label')!r} {got} differs from {expected}"
    if info.get("model_version") != versions[case.task]:
        return "wrong", f"model version {info.get('model_version')} instead of {versions[case.task]}"
    return "ok", ""


@dataclass
class Observation:
    case: Case
    replica: int
    sent_at: float  # time.monotonic()
    done_at: float
    outcome: Outcome
    retries: int
    verdict: str = "ok"
    reason: str = ""


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class ScenarioResult:
    name: str
    title: str
    sent: int = 0
    succeeded: int = 0
    failed: int = 0
    wrong: int = 0
    retried: int = 0
    recovery_s: float | None = None
    duration_s: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def checks_failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    @property
    def passed(self) -> bool:
        return self.failed == 0 and self.wrong == 0 and not self.checks_failed and self.error is None


class Run:
    """Collects one scenario's observations, figures and checks."""

    def __init__(self, ctx: Context, name: str, title: str) -> None:
        self.ctx = ctx
        self.result = ScenarioResult(name, title)
        self.observations: list[Observation] = []
        self.extra: Counter[str] = Counter()  # non-classify requests (admin calls): sent/ok/failed/wrong
        self._lock = threading.Lock()

    # -- requests
    def record(self, case: Case, replica: int, sent_at: float, outcome: Outcome, retries: int) -> Observation:
        verdict, reason = judge(case, outcome, self.ctx.oracle.versions)
        observation = Observation(case, replica, sent_at, time.monotonic(), outcome, retries, verdict, reason)
        with self._lock:
            self.observations.append(observation)
        return observation

    def send(self, case: Case, replica: int, *, failover: bool = False) -> Observation:
        router = Router(self.ctx, [replica, *([1 - replica] if failover else [])])
        try:
            sent_at = time.monotonic()
            outcome, used, retries = router.send(case)
            return self.record(case, used, sent_at, outcome, retries)
        finally:
            router.close()

    def send_many(self, cases: Sequence[Case], replicas: Sequence[int], threads: int) -> list[Observation]:
        """Every case once, spread over the replicas by `threads` concurrent clients."""
        queue = list(reversed(cases))
        lock = threading.Lock()
        done: list[Observation] = []

        def worker(index: int) -> None:
            router = Router(self.ctx, list(replicas), start=index)
            try:
                while True:
                    with lock:
                        if not queue:
                            return
                        case = queue.pop()
                    sent_at = time.monotonic()
                    outcome, used, retries = router.send(case)
                    observation = self.record(case, used, sent_at, outcome, retries)
                    with lock:
                        done.append(observation)
            finally:
                router.close()

        workers = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return done

    @contextlib.contextmanager
    def load(
        self,
        cases: Sequence[Case],
        replicas: Sequence[int],
        threads: int | None = None,
        failover: bool = True,
        pause_s: float = 0.0,
    ) -> Iterator[None]:
        """Concurrent clients sending random cases until the block ends, each waiting
        `pause_s` after every answer (0: as fast as the replicas answer)."""
        stop = threading.Event()

        def worker(index: int) -> None:
            rng = random.Random(index * 7919 + len(self.observations))
            router = Router(self.ctx, list(replicas), start=index, failover=failover)
            try:
                while not stop.is_set():
                    case = rng.choice(cases)
                    sent_at = time.monotonic()
                    outcome, used, retries = router.send(case)
                    self.record(case, used, sent_at, outcome, retries)
                    if pause_s:
                        stop.wait(pause_s)
            finally:
                router.close()

        workers = [
            threading.Thread(target=worker, args=(i,), daemon=True)
            for i in range(threads or self.ctx.sizes.threads)
        ]
        for w in workers:
            w.start()
        try:
            yield
        finally:
            stop.set()
            for w in workers:
                w.join(timeout=self.ctx.sizes.request_timeout_s * 3)

    def downgrade(self, observation: Observation, verdict: str, reason: str) -> None:
        if observation.verdict == "ok":
            observation.verdict, observation.reason = verdict, reason

    def count_extra(self, verdict: str, reason: str = "") -> None:
        self.extra["sent"] += 1
        self.extra[verdict] += 1
        if verdict != "ok" and len(self.result.problems) < 12:
            self.result.problems.append(f"{verdict}: {reason}")

    # -- figures and checks
    def figure(self, name: str, value: Any) -> None:
        self.result.figures[name] = value

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.result.checks.append(Check(name, bool(ok), detail))
        return bool(ok)

    def between(self, start: float, end: float) -> list[Observation]:
        return [o for o in self.observations if start <= o.sent_at < end]

    def finish(self) -> ScenarioResult:
        result = self.result
        result.sent = len(self.observations) + self.extra["sent"]
        result.succeeded = sum(o.verdict == "ok" for o in self.observations) + self.extra["ok"]
        result.failed = sum(o.verdict == "failed" for o in self.observations) + self.extra["failed"]
        result.wrong = sum(o.verdict == "wrong" for o in self.observations) + self.extra["wrong"]
        result.retried = sum(o.retries > 0 for o in self.observations)
        reasons = Counter(
            f"{o.verdict}: {o.case.group or o.case.task} {o.case.id}: {o.reason}"[:300]
            for o in self.observations
            if o.verdict != "ok"
        )
        for reason, count in reasons.most_common(12 - len(result.problems)):
            result.problems.append(reason + (f"  (x{count})" if count > 1 else ""))
        return result


class Router:
    """A client-side load balancer: tries the replicas in turn, moving on when one is unreachable."""

    def __init__(self, ctx: Context, replicas: list[int], *, start: int = 0, failover: bool = True) -> None:
        self.ctx = ctx
        self.replicas = replicas
        self.next = start % len(replicas)
        self.failover = failover
        self._clients: dict[int, FaultClient] = {}

    def client(self, replica: int) -> FaultClient:
        if replica not in self._clients:
            self._clients[replica] = FaultClient(
                self.ctx.apps[replica].url, timeout_s=self.ctx.sizes.request_timeout_s
            )
        return self._clients[replica]

    def send(self, case: Case) -> tuple[Outcome, int, int]:
        first = self.next
        self.next = (self.next + 1) % len(self.replicas)
        attempts = 2 * len(self.replicas) if self.failover else 1
        outcome, replica = Outcome("failure", message="not sent"), self.replicas[first]
        for attempt in range(attempts):
            replica = self.replicas[(first + attempt) % len(self.replicas)]
            outcome = self.client(replica).classify(case.task, case.raw, case.name)
            if outcome.kind != "unreachable":
                return outcome, replica, attempt
            # A dead keep-alive connection, or the replica is down: a fresh connection next time.
            self._clients.pop(replica).close()
            time.sleep(0.05 * (attempt + 1))
        return Outcome("failure", message=f"no replica reachable: {outcome.message}"), replica, attempts - 1

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()


@dataclass
class Context:
    sizes: Sizes
    work: Path
    redis_server: EmbeddedRedis
    apps: list[AppProcess]
    oracle: Oracle
    pool: list[Case]  # the load's inputs, with references
    probes: Iterator[str]  # fresh texts, never sent before
    log: Callable[[str], None] = print
    remaining: int = 0  # scenarios still to run after the current one
    # The PostgreSQL server holding B's request log (A keeps SQLite): both backends under faults.
    postgres: PostgresServer | None = None

    @property
    def direct(self) -> redis.Redis:
        """Our own connection to our own Redis (for faults and for looking at keys)."""
        return redis.Redis.from_url(self.redis_server.url, socket_timeout=5.0)

    def admin(
        self,
        replica: int,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        accept: tuple[int, ...] = (200,),
    ) -> Any:
        """The admin API's answer; any status outside `accept` raises (202: a fleet action
        some replica did not confirm, which a scenario must expect by name)."""
        with httpx.Client(base_url=self.apps[replica].url, timeout=30.0) as client:
            status, data = http_json(client, method, path, body=body)
        if status not in accept:
            raise RuntimeError(f"admin {method} {path} on {self.apps[replica].name}: {status} {data}")
        return data

    def probe_case(self) -> Case:
        return self.oracle.case(f"probe-{time.monotonic_ns()}", "text", next(self.probes), group="probe")

    def wait_l2_up(self, timeout_s: float = 20.0) -> None:
        for app in self.apps:
            if app.process is not None and app.process.poll() is None:
                app.wait_ready(timeout_s=timeout_s)

    def reset(self) -> None:
        """Between scenarios: Redis configured as at start, every cache tier empty."""
        with contextlib.closing(self.direct) as direct:
            direct.config_set("maxmemory-policy", "allkeys-lru")
            direct.config_set("maxmemory", f"{REDIS_MAXMEMORY_MB}mb")
        self.wait_l2_up()
        live = [
            i for i, app in enumerate(self.apps) if app.process is not None and app.process.poll() is None
        ]
        for n, replica in enumerate(live):
            self.admin(replica, "POST", "/admin/api/flush", {"tier": "all" if n == 0 else "l1"})

    def close(self) -> None:
        for app in self.apps:
            app.stop(grace_s=5.0)
        self.redis_server.close()
        if self.postgres is not None:
            self.postgres.close()


def build_context(
    sizes: Sizes,
    work: Path,
    *,
    models: dict[str, Classifier] | None = None,
    log: Callable[[str], None] = print,
) -> Context:
    """Redis, two apps and the reference answers. The apps load while we compute references."""
    if find_redis_server() is None:
        raise RuntimeError("redis-server is not installed: `apt-get install -y redis-server`")
    started = time.monotonic()
    server = EmbeddedRedis(
        data_dir=work / "redis", maxmemory_mb=REDIS_MAXMEMORY_MB, port=free_port(), save=False
    )
    server.start()
    try:
        postgres = PostgresServer().start()
        database_url = postgres.create_database("infcache")
    except BaseException:
        server.close()
        raise
    apps = [
        AppProcess(
            name,
            data_dir=work / f"app-{name}",
            redis_url=server.url,
            database_url=database_url if name == "B" else None,
        )
        for name in ("A", "B")
    ]
    try:
        for app in apps:
            app.start()
        if models is None:
            from runtime import load_models

            _quiet()
            models = load_models(Settings.from_env({}).changed(models__device="auto"))
        oracle = Oracle(dict(models))
        pool = [
            oracle.case(name, "image", data, name=name, group="pool")
            for name, data in image_variants(sizes.images, seed=1)
        ]
        pool += [
            oracle.case(f"text-{i}", "text", text, group="pool")
            for i, text in enumerate(text_variants(sizes.texts, seed=2))
        ]
        probes = probe_texts()
        for app in apps:
            app.wait_ready()
    except BaseException:
        for app in apps:
            app.kill()
        server.close()
        postgres.close()
        raise
    log(
        f"set-up: Redis {server.url}, PostgreSQL :{postgres.port} (B's request log), "
        f"apps A (pid {apps[0].pid}) and B (pid {apps[1].pid}) ready, "
        f"{len(pool)} reference answers, in {time.monotonic() - started:.1f}s"
    )
    return Context(sizes, work, server, apps, oracle, pool, probes, log=log, postgres=postgres)


def _quiet() -> None:
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def split(cases: Sequence[Case], fraction: float) -> tuple[list[Case], list[Case]]:
    images = [c for c in cases if c.task == "image"]
    texts = [c for c in cases if c.task == "text"]
    ni, nt = max(1, int(len(images) * fraction)), max(1, int(len(texts) * fraction))
    return images[:ni] + texts[:nt], images[ni:] + texts[nt:]


def key_of(observation: Observation) -> str | None:
    return (observation.outcome.info or {}).get("key")


def alias_key(case: Case, version: str, generation: int) -> str:
    return f"{PREFIX}:{case.task}-raw:{version}:{generation}:{raw_digest(case.raw)}"


def wait_l2_in_use(run: Run, since: float, limit_s: float) -> float | None:
    """Seconds after `since` until each replica writes a fresh answer to Redis and the other
    replica reads it from there (tier "l2"); None if that does not happen within `limit_s`."""
    ctx = run.ctx
    pending = {(0, 1), (1, 0)}
    with contextlib.closing(ctx.direct) as direct:
        while pending and time.monotonic() - since < limit_s:
            for writer, reader in sorted(pending):
                probe = ctx.probe_case()
                written = run.send(probe, writer)
                key = key_of(written)
                try:
                    stored = key is not None and bool(direct.exists(key))
                except redis.RedisError:
                    stored = False
                if stored and (run.send(probe, reader).outcome.info or {}).get("tier") == "l2":
                    pending.discard((writer, reader))
            if pending:
                time.sleep(0.1)
    return None if pending else time.monotonic() - since


def latency_ms(observation: Observation) -> float:
    return float((observation.outcome.info or {}).get("latency_ms", 0.0))


def fmt_s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}s"


def tiers(observations: Sequence[Observation]) -> dict[str, int]:
    return dict(Counter((o.outcome.info or {}).get("tier", o.outcome.kind) for o in observations))
