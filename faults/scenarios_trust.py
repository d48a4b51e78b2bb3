"""Scenarios of trust in a cached answer: forged values, a planted wrong answer (valid
signature), signing-key rotation, and the generation key evicted by Redis.

The first three run replicas in this process (`runtime.build_runtime` on the suite's Redis
and real models, as `single_flight` does): each needs its own signing keys, and starting
app processes for each would cost minutes. The last runs against apps A and B over HTTP.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import redis

from engine.cache.codec import CHECKSUM_CODEC, CachedResult, ValueCodec
from engine.models.base import Prediction
from engine.pipeline.service import ClassifyResult, InferenceEngine
from faults.client import Outcome
from faults.config import PREFIX, REDIS_MAXMEMORY_MB, REFRESH_S, TOKEN
from faults.harness import Case, Observation, Run, fmt_s, tiers
from settings import Settings

K1 = "faults-signing-key-one-" + "1" * 24
K2 = "faults-signing-key-two-" + "2" * 24
FOREIGN = "faults-signing-key-not-ours-" + "3" * 24
GENERATION_KEY = f"{PREFIX}:meta:generation"


@contextlib.contextmanager
def _replicas(run: Run, *specs: tuple[tuple[str, ...], float]) -> Iterator[list[InferenceEngine]]:
    """In-process replicas on the suite's Redis under their own prefix: (signing keys, shadow rate)."""
    from runtime import build_runtime

    ctx = run.ctx
    with contextlib.ExitStack() as stack:
        engines = []
        for index, (keys, rate) in enumerate(specs):
            settings = Settings.from_env({}).changed(
                server__data_dir=ctx.work / f"{run.result.name}-{index}", redis__url=ctx.redis_server.url,
                cache__prefix=f"{PREFIX}-trust", server__admin_token=TOKEN, cache__signing_keys=keys,
                quality__shadow_sample_rate=rate,
            )  # fmt: skip
            engines.append(stack.enter_context(build_runtime(settings, models=ctx.oracle.models)).engine)
        try:
            yield engines
        finally:
            with contextlib.closing(ctx.direct) as direct:  # leave nothing under our prefix
                for batch in _chunks(list(direct.scan_iter(match=f"{PREFIX}-trust:*", count=1000)), 500):
                    direct.unlink(*batch)


def _ask(
    run: Run, engine: InferenceEngine, case: Case, replica: int
) -> tuple[Observation, ClassifyResult | None]:
    sent_at = time.monotonic()
    try:
        result: ClassifyResult | None = engine.classify(case.task, case.raw)
    except Exception as exc:  # judged as a failed request
        return run.record(case, replica, sent_at, Outcome("failure", message=repr(exc)), 0), None
    labels = result.prediction.labels
    label = {"label": result.prediction.top_label,
             "confidences": [{"label": n, "confidence": s} for n, s in labels]}  # fmt: skip
    outcome = Outcome("answer", label=label, info=result.cache_info())
    return run.record(case, replica, sent_at, outcome, 0), result


def _cases(run: Run, per_task: int) -> list[Case]:
    images = [c for c in run.ctx.pool if c.task == "image"]
    texts = [c for c in run.ctx.pool if c.task == "text"]
    return images[:per_task] + texts[:per_task]


def _wrong(prediction: Prediction) -> Prediction:
    """Another well-formed answer: the first two classes swapped, scores and all."""
    labels = list(prediction.labels)
    labels[0], labels[1] = (labels[1][0], labels[0][1]), (labels[0][0], labels[1][1])
    return Prediction(tuple(labels))


def _forged_total(engines: Sequence[InferenceEngine]) -> int:
    return sum(e.counters().forged_values for e in engines)


def forged_values(run: Run) -> None:
    """Replicas signing with one key; values planted under live keys without that key's
    signature: unsigned (a valid checksum), signed with another secret, a valid value of
    another key. Each must be refused, deleted, counted and recomputed, never served."""
    cases = _cases(run, max(2, run.ctx.sizes.corrupt_inputs // 4))
    kinds = ("unsigned, another answer", "signed with another secret", "moved from another key")
    with _replicas(run, ((K1,), 0.0), ((K1,), 0.0)) as (a, b), contextlib.closing(run.ctx.direct) as direct:
        warmed = [(case, result) for case in cases for _, result in [_ask(run, a, case, 0)] if result]
        planted: list[tuple[Case, str, str, bytes]] = []
        for index, (case, result) in enumerate(warmed):
            kind = kinds[index % len(kinds)]
            wrong = CachedResult(_wrong(result.prediction), result.model_version, time.time())
            if kind == kinds[0]:
                value = CHECKSUM_CODEC.encode(wrong, key=result.key)
            elif kind == kinds[1]:
                value = ValueCodec([FOREIGN.encode()]).encode(wrong, key=result.key)
            else:
                other = warmed[(index + 1) % len(warmed)][1]
                value = direct.get(other.key) or b""
            direct.set(result.key, value, ex=600)
            planted.append((case, kind, result.key, value))
        for engine in (a, b):
            engine.flush("l1")
        before = _forged_total((a, b))
        served, left = [], []
        for index, (case, kind, key, value) in enumerate(planted):
            _, result = _ask(run, (a, b)[index % 2], case, index % 2)
            if result is not None and result.tier == "l2":
                served.append(f"{case.id} ({kind})")
            if direct.get(key) == value:
                left.append(f"{case.id} ({kind})")
        detected = _forged_total((a, b)) - before
    run.figure("values planted", f"{len(planted)} ({dict(Counter(kind for _, kind, _, _ in planted))})")
    run.figure("refused as forged (infcache_l2_forged_values)", detected)
    run.check("every planted value was refused as forged", len(planted) > 0 and detected == len(planted),
              f"{detected} of {len(planted)}")  # fmt: skip
    run.check("no planted value was served", not served, ", ".join(served[:6]))
    run.check("no planted value left in place", not left, ", ".join(left[:6]))


def key_rotation(run: Run) -> None:
    """CACHE_SIGNING_KEYS=new,old: a rotated replica reads what the old key signed and signs
    with the new one; a replica on the old key alone refuses those; once the old key is
    retired its values are refused. Every answer stays right."""
    cases = _cases(run, max(2, run.ctx.sizes.corrupt_inputs // 4))
    first, second = cases[::2], cases[1::2]
    with _replicas(run, ((K1,), 0.0), ((K2, K1), 0.0), ((K2,), 0.0)) as (old, rotated, retired):
        for case in first:
            _ask(run, old, case, 0)
        read = [r.tier for case in first for _, r in [_ask(run, rotated, case, 1)] if r]
        for case in second:
            _ask(run, rotated, case, 1)  # written with the new key
        refused_before = old.counters().forged_values
        by_old = [r.tier for case in second for _, r in [_ask(run, old, case, 0)] if r]
        refused_by_old = old.counters().forged_values - refused_before
        # `first` is still in Redis as the old key signed it: the rotated replica only read it.
        by_retired = [r.tier for case in first for _, r in [_ask(run, retired, case, 2)] if r]
        refused_by_retired = retired.counters().forged_values
    run.figure("rotated replica reading the old key's values", dict(Counter(read)))
    run.figure("old-key replica reading new-key values", f"{dict(Counter(by_old))}, refused {refused_by_old}")
    run.figure("new-key-only replica reading old-key values",
               f"{dict(Counter(by_retired))}, refused {refused_by_retired}")  # fmt: skip
    run.check("new,old reads the old key's values from L2", read == ["l2"] * len(first), str(read))
    # Each answer's value, and for an upload its raw-input alias too (also a signed L2 value).
    expected_old, expected_retired = _values(second), _values(first)
    run.check("the old key alone refuses new-key values", refused_by_old == expected_old,
              f"{refused_by_old} of {expected_old}")  # fmt: skip
    run.check("a retired key's values are refused", refused_by_retired == expected_retired,
              f"{refused_by_retired} of {expected_retired}")  # fmt: skip


def _values(cases: Sequence[Case]) -> int:
    return len(cases) + sum(case.task == "image" for case in cases)


def planted_wrong_answer(run: Run) -> None:
    """A well-formed wrong answer with a valid signature (what a canonicalisation bug or a
    holder of the key could store): served until shadow verification (rate 1 here) recomputes
    it while the model is idle, finds the mismatch and evicts it; the next request is right."""
    cases = _cases(run, min(6, max(2, run.ctx.sizes.corrupt_inputs // 6)))  # within the queue
    with _replicas(run, ((K1,), 1.0), ((K1,), 0.0)) as (a, b), contextlib.closing(run.ctx.direct) as direct:
        shadow = a.shadow
        assert shadow is not None
        planted: list[tuple[Case, str]] = []
        for case in cases:
            _, result = _ask(run, b, case, 1)
            if result is None:
                continue
            wrong = CachedResult(_wrong(result.prediction), result.model_version, time.time())
            direct.set(result.key, ValueCodec([K1.encode()]).encode(wrong, key=result.key), ex=600)
            planted.append((case, result.key))
        served_wrong = 0
        for case, _ in planted:  # not judged: serving it once, before the check, is the fault
            result = a.classify(case.task, case.raw)
            served_wrong += result.tier == "l2" and result.prediction != _expected(case)
        started = time.monotonic()
        done = shadow.wait_processed(len(planted), timeout_s=120)
        took = time.monotonic() - started
        stats = shadow.stats()
        left = [case.id for case, key in planted if direct.exists(key)]
        after = [_ask(run, a, case, 0)[0] for case, _ in planted]
    mismatches = sum(stats.mismatches.values())
    run.figure("wrong answers planted (valid signature)", len(planted))
    run.figure("served before their shadow check", served_wrong)
    run.figure("shadow checks / mismatches", f"{sum(stats.checks.values())} / {mismatches} in {fmt_s(took)}")
    if stats.recent:
        m = stats.recent[0]
        run.figure("a mismatch as logged", f"{m.key}: cached {m.cached[0]} ({m.cached_version}) vs "
                                          f"recomputed {m.fresh[0]} ({m.fresh_version})")  # fmt: skip
    run.figure("answers after eviction", tiers(after))
    run.check("every planted answer was checked", done, f"{sum(stats.checks.values())} of {len(planted)}")
    run.check("every planted answer was found out", mismatches == len(planted) > 0,
              f"{mismatches} of {len(planted)}")  # fmt: skip
    run.check("every planted answer was evicted from L2", not left, ", ".join(left[:6]))
    recomputed = all((o.outcome.info or {}).get("tier") == "miss" for o in after)
    run.check("the next answer was recomputed", recomputed, str(tiers(after)))


def _expected(case: Case) -> Prediction:
    return Prediction(tuple(case.expect.labels))


def generation_key_evicted(run: Run) -> None:
    """After a bump, Redis at maxmemory with allkeys-lru evicts the generation key (or, if
    the replicas' reads keep it too recent for LRU, it is deleted as a restart without data
    would). The replicas must write it back and never answer under generation 0 again."""
    ctx = run.ctx
    bumped = ctx.admin(0, "POST", "/admin/api/bump-version", {"note": "faults: before eviction"})
    acked = int(bumped["generation"])
    run.send_many(ctx.pool[: max(4, len(ctx.pool) // 4)], [0, 1], ctx.sizes.threads)
    how = "not evicted"
    with contextlib.closing(ctx.direct) as direct, run.load(ctx.pool, [0, 1]):
        lost_at = time.monotonic()
        how = _evict_generation_key(direct)
        restored_in = None
        while time.monotonic() - lost_at < 20 * REFRESH_S:
            if direct.get(GENERATION_KEY) == str(acked).encode():
                restored_in = time.monotonic() - lost_at
                break
            time.sleep(0.02)
        time.sleep(ctx.sizes.phase_s)
        at_end = direct.get(GENERATION_KEY)  # tells a slow write-back from none at all
    stale = 0
    for o in run.observations:
        generation = (o.outcome.info or {}).get("generation")
        if o.outcome.kind == "answer" and (generation is None or generation < acked):
            stale += 1
            run.downgrade(o, "wrong", f"generation {generation} after {acked} was acknowledged")
    during = [o for o in run.observations if o.sent_at >= lost_at]
    run.figure("generation before the loss", acked)
    run.figure("how the key went", how)
    run.figure("written back by a replica in", fmt_s(restored_in))
    run.figure("the key at the end of the load", at_end.decode() if at_end is not None else "absent")
    run.figure("answers after the loss", f"{len(during)} ({tiers(during)})")
    run.check("the generation key was gone", how != "not evicted", how)
    run.check(f"written back within {20 * REFRESH_S:.0f}s", restored_in is not None, fmt_s(restored_in))
    run.check("no answer under an older generation", stale == 0, str(stale))


def _evict_generation_key(direct: redis.Redis) -> str:
    used = int(direct.info("memory")["used_memory"])
    direct.config_set("maxmemory-policy", "allkeys-lru")
    direct.config_set("maxmemory", str(used + 2 * 1024 * 1024))
    junk, written = b"j" * 10_000, 0
    try:
        while direct.exists(GENERATION_KEY) and written < 20_000:
            with direct.pipeline(transaction=False) as pipe:
                for i in range(200):
                    pipe.set(f"faults-junk:{written + i}", junk, ex=60)
                pipe.execute()
            written += 200
    finally:
        direct.config_set("maxmemory", f"{REDIS_MAXMEMORY_MB}mb")
        for batch in _chunks(list(direct.scan_iter(match="faults-junk:*", count=1000)), 500):
            direct.unlink(*batch)
    if not direct.exists(GENERATION_KEY):
        return f"evicted by Redis (allkeys-lru) after {written} junk values"
    direct.delete(GENERATION_KEY)  # kept recent by the replicas' reads: gone as after a restart
    return f"deleted (LRU kept it through {written} junk values)"


def _chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
