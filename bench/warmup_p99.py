"""Live p99 with and without a warm-up running (engine.lifecycle.warmup), side by side in one run:
`python -m bench.warmup_p99 [--kept 200] [--seconds 3] [--rounds 4]`.

A private redis-server; an engine whose warm set keeps `--kept` hot inputs, then a new model
version swapped in (their entries are now missing). Live load: 4 threads, each sending an
L2-cached message then pausing 2 ms (a busy replica with idle moments). `--rounds` times: a new
model version is swapped in and the live messages cached under it, then a baseline phase, then
the same load while the warm-up recomputes the kept inputs (a 2 ms forward pass each); the
warm-up is left to finish between rounds. Each side's samples are pooled over the rounds, so
drift of a shared machine falls on both alike. Prints both p99s, their ratio (the target: at
most 1.10), and how the warm-ups went.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from bench.live_load import FixedTextModel, l2_bench, live_latencies, paired_phases, phase_args, print_p99s
from engine.lifecycle.warmup import WarmSet

PREFIX = "bench-warmup"


def main() -> None:
    args = phase_args(__doc__.splitlines()[0], seconds=3.0, rounds=4,
                      rounds_help="swap, baseline, warm-up rounds",
                      count=("--kept", 200, "hot inputs kept and warmed"))  # fmt: skip
    model = FixedTextModel("v1", forward_s=0.002)
    with l2_bench(model, prefix=PREFIX, maxmemory_mb=256) as (store, engine):
        warm = WarmSet(store, prefix=PREFIX, size=args.kept, ttl_s=3600, engine=engine, flush_s=3600).start()
        engine.attach_warm_set(warm)
        try:
            hot = [f"hot message {n}" for n in range(args.kept)]
            for _ in range(2):  # counted, then held once known hot: two flushes keep them all
                for text in hot:
                    engine.classify("text", text)
                warm.flush()
            kept = len(warm.stored("text"))
            texts = [f"cached message {n}" for n in range(500)]
            warmed_meanwhile: list[int] = []
            finished: list[str] = []

            def new_version(round_: int) -> None:
                # A new version: the kept inputs' entries are missing now; the live ones are cached.
                engine.replace_model("text", FixedTextModel(f"v{round_ + 2}", forward_s=0.002))
                for text in texts:
                    engine.classify("text", text)
                live_latencies(engine, texts, 0.5, pause_s=0.002)  # warm the process

            def warm_up(_round: int) -> Callable[[], None]:
                started = time.monotonic()
                warm.trigger(["text"])

                def end() -> None:
                    warmed_meanwhile.append(warm.progress()["done"])
                    while warm.progress()["running"] and time.monotonic() - started < 120:
                        time.sleep(0.05)
                    done = warm.progress()
                    finished.append(
                        f"{done['done']}/{done['total']} done, {done['computed']} computed, "
                        f"{done['failed']} failed, in {time.monotonic() - started:.1f} s"
                    )

                return end

            baseline, during = paired_phases(engine, texts, rounds=args.rounds, seconds=args.seconds,
                                             background=warm_up, prepare=new_version, pause_s=0.002)
            meanwhile = "/".join(str(n) for n in warmed_meanwhile)
            print_p99s(baseline, during, without="live L2-hit p99 without warm-up: ",
                       with_="live L2-hit p99 during warm-up:  ",
                       note=f"{meanwhile} of {kept} kept inputs warmed meanwhile per round")  # fmt: skip
            for n, line in enumerate(finished, 1):
                print(f"warm-up {n} finished: {line}")
        finally:
            warm.close()


if __name__ == "__main__":
    main()
