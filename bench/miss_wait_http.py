"""A text miss through REST with the micro-batcher's companion wait and without it, side by side.

One app (onnxruntime, REDIS_URL=off, no miss budget) serves `/v2/models/text/infer` on loopback;
a client process sends new messages (every request a whole miss) from `--clients` keep-alive
connections. The same server answers alternating chunks with `COMPANION_WAIT_S` at its value
(engine.capacity.batching) and at 0, the order rotating, so the machine's noise falls on both
alike. Server CPU is the server process's CPU time per miss (the client is another process);
latency is each request's wall time at the client. It also prints the passes' sizes.

    .venv/bin/python -m bench.miss_wait_http [--inputs 6000] [--chunk 400] [--clients 4]
"""

from __future__ import annotations

import argparse
import multiprocessing
import secrets
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import httpx


def client_chunk(url: str, messages: Sequence[str], clients: int) -> list[float]:
    """Each message sent once over `clients` connections at once; each request's ms."""
    latencies: list[float] = []
    lock = threading.Lock()

    def send(part: Sequence[str]) -> None:
        with httpx.Client(timeout=60) as client:
            for message in part:
                body = {"inputs": [{"name": "input", "shape": [1], "datatype": "BYTES", "data": [message]}]}
                started = time.perf_counter()
                response = client.post(url, json=body)
                elapsed = 1000 * (time.perf_counter() - started)
                if response.status_code != 200:
                    raise SystemExit(f"{response.status_code}: {response.text[:200]}")
                with lock:
                    latencies.append(elapsed)

    threads = [threading.Thread(target=send, args=(messages[k::clients],)) for k in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies


def main(argv: Sequence[str] | None = None) -> None:
    from bench.workload.inputs import make_messages
    from engine.capacity import batching
    from engine.models.config import DEFAULT_SPECS
    from engine.models.loader import load_all
    from process_setup import resume_collector
    from runtime import build_runtime, load_options
    from settings import Settings
    from storage.redis.embedded import free_port
    from ui.server import serve_runtime

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=6000, help="new messages in all (default 6000)")
    parser.add_argument("--chunk", type=int, default=400, help="messages a turn, half each way (default 400)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent connections (default 4)")
    args = parser.parse_args(argv)
    waits = {"with the wait": batching.COMPANION_WAIT_S, "without": 0.0}
    sizes: Counter[int] = Counter()
    run_pass = batching.MicroBatcher._run

    def counted(self: batching.MicroBatcher, batch: Sequence[object], competing: list[str]) -> None:
        sizes[len(batch)] += 1
        run_pass(self, batch, competing)  # type: ignore[arg-type]

    batching.MicroBatcher._run = counted  # type: ignore[method-assign]  # this process's batchers only
    with tempfile.TemporaryDirectory(prefix="miss-wait-") as tmp:
        settings = Settings.from_env({}).changed(
            models__device="cpu", models__inference_backend="onnxruntime", redis__url="off",
            server__admin_token=secrets.token_urlsafe(24), server__data_dir=Path(tmp),
            quality__shadow_sample_rate=0.0, fairness__client_miss_rate=0.0,
        )  # fmt: skip
        models = load_all([spec for spec in DEFAULT_SPECS if spec.task == "text"], load_options(settings))
        runtime = build_runtime(settings, models=models)
        server = serve_runtime(runtime, port=free_port())
        resume_collector()  # as app.py once ready
        try:
            url = server.url.rstrip("/") + "/v2/models/text/infer"
            messages = make_messages(args.inputs + args.chunk, 27)
            totals = {name: [0.0, []] for name in waits}
            order = list(waits)
            with multiprocessing.get_context("spawn").Pool(1) as client:
                client.apply(client_chunk, (url, messages[: args.chunk], args.clients))  # warm-up
                for start in range(args.chunk, args.inputs + args.chunk, args.chunk):
                    order = order[::-1]
                    for k, name in enumerate(order):
                        batching.COMPANION_WAIT_S = waits[name]
                        part = messages[start : start + args.chunk][k::2]
                        time.sleep(0.2)  # the previous turn's tail: not this one's
                        cpu = time.process_time()
                        latencies = client.apply(client_chunk, (url, part, args.clients))
                        time.sleep(0.05)
                        totals[name][0] += time.process_time() - cpu
                        totals[name][1] += latencies
        finally:
            server.close()
            runtime.close()
    print(f"{args.inputs} new messages over REST, {args.clients} connections; passes by size: "
          f"{dict(sorted(sizes.items()))}")  # fmt: skip
    for name, (cpu_s, latencies) in totals.items():
        latencies.sort()
        p90 = latencies[int(0.9 * (len(latencies) - 1))]
        print(f"{name:14s} server CPU {1000 * cpu_s / len(latencies):.2f} ms a miss, p50 "
              f"{statistics.median(latencies):.1f} ms, p90 {p90:.1f} ms")


if __name__ == "__main__":
    main()
