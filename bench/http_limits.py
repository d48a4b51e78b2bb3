"""What the request-head limits (ui.limits) cost on the hit path.

The same app is served three times, each in its own process with the real text model and
no Redis: uvicorn's httptools protocol as it comes (`plain`, no limits), the app's
`LimitedHttpToolsProtocol` (`limited`, what `python app.py` serves), and uvicorn's h11
protocol with its incomplete-event limit at the same size (`h11`, the other way to get a
limit). Each round sends, one at a time on a keep-alive connection, cached REST text answers
(`POST /v2/models/text/infer`) and cached Gradio calls (`POST /gradio_api/call/classify_text`
and its `GET`, answered by the cached-call shortcut) to each server in turn; the rounds are
interleaved so that a busy machine weighs on all three alike. Reported per server and path:
the median over rounds of the server's CPU time per request (its process's user + system
time over the batch; the clock ticks in 10 ms, so batches are large) and of client requests
per second. First, in process, what parsing one request costs with and without the limits
(the protocol alone, the app left out: what the limits add, free of the servers' noise).

    python -m bench.http_limits [--requests 400] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil

from storage.redis.embedded import free_port
from testing.gradio_http import GradioHttpClient
from testing.oip_http import OipHttpClient

VARIANTS = ("plain", "limited", "h11")
MESSAGE = "Where is my parcel? It has been a week."


# What httpx sends for a REST infer call: the head a cached answer's request has to pass.
REQUEST = (
    b"POST /v2/models/text/infer HTTP/1.1\r\nHost: 127.0.0.1:7860\r\nAccept: */*\r\n"
    b"Accept-Encoding: gzip, deflate\r\nConnection: keep-alive\r\nUser-Agent: python-httpx/0.29.0\r\n"
    b"Content-Length: 2\r\nContent-Type: application/json\r\n\r\n{}"
)


def parse_cost(rounds: int = 30, requests: int = 5_000) -> dict[str, float]:
    """Microseconds to parse one request (head and body) with each httptools protocol, the
    app left out: the fastest of `rounds` interleaved runs of `requests` requests on one
    keep-alive connection (the minimum is the run the machine disturbed least)."""
    import asyncio
    import timeit

    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.server import ServerState

    from ui.limits import HeaderLimits, limited_http_protocol

    class Transport(asyncio.Transport):
        def write(self, data: object) -> None: ...
        def is_closing(self) -> bool:
            return False

        def get_extra_info(self, name: str, default: object = None) -> object:
            return ("127.0.0.1", 7860) if name in ("peername", "sockname") else default

    async def app(scope: object, receive: object, send: object) -> None: ...

    loop = asyncio.new_event_loop()
    parse: dict[str, Callable[[], None]] = {}
    for name, protocol in (("plain", HttpToolsProtocol), ("limited", limited_http_protocol(HeaderLimits()))):
        config = uvicorn.Config(app, http=protocol, log_level="warning")
        config.load()
        connection = protocol(config=config, server_state=ServerState(), app_state={}, _loop=loop)
        connection.connection_made(Transport())
        connection._start_asgi_task = lambda cycle, app: None  # the app is not what is measured

        def one(connection: HttpToolsProtocol = connection) -> None:
            connection.data_received(REQUEST)
            connection.cycle = None  # answered: the next request is not a pipelined one

        parse[name] = one
    best = dict.fromkeys(parse, float("inf"))
    for _ in range(rounds):
        for name, one in parse.items():
            best[name] = min(best[name], timeit.timeit(one, number=requests) / requests * 1e6)
    loop.close()
    return best


def serve(variant: str, port: int) -> None:
    """The child: the app on `port` with `variant`'s HTTP protocol, until killed."""
    import uvicorn

    from engine.models.config import DEFAULT_SPECS
    from engine.models.loader import load_all
    from runtime import build_runtime, load_options
    from settings import Settings
    from ui.limits import HeaderLimits, limited_http_protocol
    from ui.server import build_app
    from ui.startup import ServingApp

    data_dir = Path(tempfile.mkdtemp(prefix=f"http-limits-{variant}-"))
    settings = Settings.from_env({}).changed(
        server__port=port, server__host="127.0.0.1", redis__url="off", server__data_dir=data_dir,
        quality__shadow_sample_rate=0.0, fairness__client_miss_rate=0.0,
    )  # fmt: skip
    models = load_all(tuple(s for s in DEFAULT_SPECS if s.task == "text"), load_options(settings))
    runtime = build_runtime(settings, models=models)
    limits = HeaderLimits.from_settings(settings)
    http: dict[str, object] = {
        "plain": {"http": "httptools"},
        "limited": {"http": limited_http_protocol(limits)},
        "h11": {"http": "h11", "h11_max_incomplete_event_size": limits.max_bytes},
    }[variant]  # type: ignore[assignment]
    serving = ServingApp(settings, build_runtime=lambda _s: runtime, build_app=build_app, close_runtime=False)
    config = uvicorn.Config(serving, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                            **http)  # type: ignore[arg-type]  # fmt: skip
    uvicorn.Server(config).run()


class Server:
    def __init__(self, variant: str) -> None:
        self.variant = variant
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "bench.http_limits", "--serve", variant, "--port", str(self.port)]
        self.child = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.process = psutil.Process(self.child.pid)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.child.poll() is not None:
                raise RuntimeError(f"the {self.variant} server exited")
            time.sleep(0.5)
        raise RuntimeError(f"the {self.variant} server did not become ready")

    def cpu_s(self) -> float:
        times = self.process.cpu_times()
        return times.user + times.system

    def close(self) -> None:
        self.child.terminate()
        self.child.wait(timeout=30)


def batch(server: Server, send: Callable[[], object], requests: int) -> tuple[float, float]:
    """(server CPU microseconds per request, client requests per second) over `requests` sends."""
    cpu, start = server.cpu_s(), time.perf_counter()
    for _ in range(requests):
        send()
    wall = time.perf_counter() - start
    return (server.cpu_s() - cpu) / requests * 1e6, requests / wall


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=400, help="per path, server and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--serve", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return
    costs = parse_cost()
    print(f"parse one request: plain {costs['plain']:.2f} us, limited {costs['limited']:.2f} us "
          f"(+{costs['limited'] - costs['plain']:.2f} us)")  # fmt: skip
    servers = [Server(variant) for variant in VARIANTS]
    try:
        for server in servers:
            server.wait_ready()
        sends = {}
        for server in servers:
            rest, gradio = OipHttpClient(server.url), GradioHttpClient(server.url)
            sends[("rest", server.variant)] = lambda rest=rest: rest.infer("text", MESSAGE)
            sends[("gradio", server.variant)] = lambda g=gradio: g.call("classify_text", [MESSAGE]).outputs
        for send in sends.values():  # the miss, then warm-up hits
            for _ in range(50):
                send()
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for _ in range(args.rounds):
            for server in servers:
                for path in ("rest", "gradio"):
                    measured = batch(server, sends[(path, server.variant)], args.requests)
                    results.setdefault((path, server.variant), []).append(measured)
    finally:
        for server in servers:
            server.close()
    load = os.getloadavg()
    print(f"{args.rounds} rounds x {args.requests} requests per path and server; load {load[0]:.1f}")
    # "vs plain": the median over rounds of each round's ratio (the servers ran side by side in it).
    print(f"{'path':8} {'server':8} {'CPU us/req':>11} {'req/s':>8} {'CPU vs plain':>13}")
    for path in ("rest", "gradio"):
        plain = [cpu for cpu, _ in results[(path, "plain")]]
        for variant in VARIANTS:
            cpus = [cpu for cpu, _ in results[(path, variant)]]
            rate = statistics.median(r for _, r in results[(path, variant)])
            ratio = statistics.median(c / p for c, p in zip(cpus, plain, strict=True))
            print(f"{path:8} {variant:8} {statistics.median(cpus):11.0f} {rate:8.0f} {ratio:13.3f}")


if __name__ == "__main__":
    main()
