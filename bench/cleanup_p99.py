"""Live p99 of L2 hits with and without a background clean-up of old versions (engine.lifecycle.cleanup),
side by side in one run: `python -m bench.cleanup_p99 [--old 200000] [--seconds 5] [--rounds 4]`.

A private redis-server holds `--old` entries of an old model version; an engine whose L1 keeps
nothing (so every hit is an L2 round trip) answers a loop of cached messages from 4 threads.
Phases alternate, `--rounds` times: baseline, then the same load while a clean-up job deletes old
entries at its default rate (cancelled at the end of the phase; the next one goes on where the
deleted keys end). Each side's samples are pooled over its rounds, so drift of a shared machine
falls on both sides alike. Prints both p99s and their ratio (the target: at most 1.10).
"""

from __future__ import annotations

from collections.abc import Callable

from bench.live_load import FixedTextModel, l2_bench, live_latencies, paired_phases, phase_args, print_p99s
from engine.lifecycle.cleanup import CleanupJob

PREFIX = "bench-cleanup"


def main() -> None:
    args = phase_args(__doc__.splitlines()[0], seconds=5.0, rounds=4,
                      rounds_help="baseline/clean-up phase pairs",
                      count=("--old", 200_000, "old entries to delete"))  # fmt: skip
    with l2_bench(FixedTextModel("v-new"), prefix=PREFIX, maxmemory_mb=1024) as (store, engine):
        client = store.client
        with client.pipeline(transaction=False) as pipe:
            for n in range(args.old):
                pipe.set(f"{PREFIX}:text:v-old:0:{n:032x}", b"old entry value " * 8, ex=3600)
                if n % 10_000 == 9_999:
                    pipe.execute()
            pipe.execute()
        texts = [f"cached message {n}" for n in range(500)]
        for text in texts:
            engine.classify("text", text)
        live_latencies(engine, texts, 1.0)  # warm
        jobs: list[CleanupJob] = []

        def clean_up(_round: int) -> Callable[[], None]:
            jobs.append(CleanupJob(store, prefix=PREFIX, current=lambda: ({"text": "v-new"}, 0),
                                   dry_run=False).start())  # fmt: skip
            return jobs[-1].cancel

        baseline, during = paired_phases(engine, texts, rounds=args.rounds, seconds=args.seconds,
                                         background=clean_up)  # fmt: skip
        deleted = sum(job.snapshot()["deleted"] for job in jobs)
        print_p99s(baseline, during, without="L2-hit p99 without clean-up: ",
                   with_="L2-hit p99 during clean-up:  ",
                   note=f"{deleted:,} old entries deleted meanwhile")  # fmt: skip


if __name__ == "__main__":
    main()
