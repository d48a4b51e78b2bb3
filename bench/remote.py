"""Two replicas in front of one Triton server, next to the same replicas with local models and next
to Triton's own response cache: one Zipf stream over HTTP, side by side in one run.

`python -m bench.remote [--quick] [--requests N] [--images N] [--messages N] [--clients N]`
(`make bench-remote`):

1. The built-in models' Triton/KServe model repository is written into a temp dir by
   `python -m serving.repository` (what `make triton-repository` runs); the local replicas share
   its ONNX export dir, so they load the same graphs.
2. Two real tritonservers serve it (testing.triton_server: serving/triton_serve.py in the Triton
   venv, ONNX Runtime in the bound callables): `remote`, which the remote fleet calls, and
   `triton-cache`, the same with Triton's own local response cache on every model.
3. Three sides replay the same stream:
   - `remote`: two app replicas (`python app.py`, each its own process) sharing one redis-server
     (a temp dir, a free loopback port), MODELS_CONFIG `backend: remote` for both built-ins at the
     `remote` server's HTTP port;
   - `local`: the same two replicas on a redis-server of their own, with local models (the
     default backend: ONNX Runtime on a CPU);
   - `triton-cache`: no app; each client does what a Triton client must, this app's own
     preprocessing (a `backend: remote` model in this process), and sends the tensors through
     tritonclient to the `triton-cache` server, whose response cache answers the repeats.
   Both fleets run with shadow checks off (SHADOW_SAMPLE_RATE=0: they recompute a sample of hits,
   which the server would count beside the misses) and a 60 s remote timeout (a busy machine).
   Servers and replicas start at once; the stream waits until every replica lists the other as
   live and serves its models (a remote one in use). The replicas get the app's REST /v2
   (tritonclient.http, binary tensors), each client alternating between the two replicas, so
   that repeats in flight at once meet on different replicas. The sides take turns segment by
   segment, in a rotating order.

Printed: remote calls per unique input (rows that reached the `remote` server's callables during
the stream over the distinct inputs in it; 1.0 is the fleet's single flight), hit latency (p50,
p99 of the answers from L1 or L2) and the two replicas' CPU per request, remote and local side by
side, the servers' CPU per request, and the `triton-cache` server's calls per unique input and
the hits it served (its statistics API). The last line:

    SUMMARY remote_calls_per_unique=R hit_p50_remote_vs_local=P hit_p99_remote_vs_local=Q
            cpu_remote_vs_local=C triton_calls_per_unique=T triton_hit_share=H

(on one line). Needs `redis-server` on PATH; the Triton venv is made on first use
(scripts/triton_venv.sh).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import yaml

from bench.cached_routes import start_app
from bench.triton_peer import cache_hits, request_of, tree_cpu_s
from bench.workload.config import SEED, ZIPF_S, Job, Labels
from bench.workload.inputs import make_inputs, zipf_stream
from bench.workload.processes import fresh_redis, process_cpu_s
from bench.workload.replay import labels_of, replay, rotated, split_segments
from testing.triton_server import TritonRepositoryServer, TritonSetupError, triton_python

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("remote", "local", "triton-cache")
FLEETS = ("remote", "local")
REPLICAS = 2
TASKS = ("text", "image")
HIT_TIERS = frozenset({"l1", "l2"})
ADMIN_TOKEN = "bench-remote"
# A batch of image misses on a busy 2-core machine can take seconds; the default (5 s) would turn
# a slow moment into 503s, which is not what is measured here.
REMOTE_TIMEOUT_S = 60.0
# Both fleets' settings beyond the defaults. Shadow checks (SHADOW_SAMPLE_RATE, 1% of hits by
# default) recompute a sample of hits on the model, off the request path, once per entry: rows the
# server would count beside the misses. Off, so the server's rows are the misses'.
FLEET_ENV = {"ADMIN_TOKEN": ADMIN_TOKEN, "REMOTE_TIMEOUT_S": str(REMOTE_TIMEOUT_S), "SHADOW_SAMPLE_RATE": "0"}
READY_TIMEOUT_S = 120.0
CLIENT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Config:
    requests: int = 4_000
    images: int = 200
    messages: int = 200
    clients: int = 4
    segments: int = 8
    zipf_s: float = ZIPF_S
    seed: int = SEED
    response_cache_mb: int = 256


QUICK = Config(requests=240, images=12, messages=12, clients=3, segments=3)


@dataclass
class Side:
    """What one side measured over the stream."""

    name: str
    latencies_ms: list[float] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    front_cpu_s: float = 0.0  # the replicas' processes (none for triton-cache)
    server_cpu_s: float = 0.0  # the Triton server's process tree

    @property
    def requests(self) -> int:
        return len(self.latencies_ms)

    def hit_ms(self, q: float) -> float:
        hits = [ms for ms, tier in zip(self.latencies_ms, self.tiers, strict=True) if tier in HIT_TIERS]
        return float(np.percentile(hits, q)) if hits else float("nan")

    def all_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")

    def per_request_ms(self, cpu_s: float) -> float:
        return 1000 * cpu_s / self.requests if self.requests else float("nan")


@dataclass
class Report:
    config: Config
    unique: dict[str, int]  # distinct inputs in the stream, by task
    remote_rows: dict[str, int]  # rows that reached the `remote` server during the stream
    triton_rows: dict[str, int]  # ...the `triton-cache` server's callables
    triton_hits: dict[str, int]  # ...and its response-cache hits
    sides: dict[str, Side]
    disagreements: list[str]
    started_at: dt.datetime
    loads: tuple[float, float]

    @property
    def unique_total(self) -> int:
        return sum(self.unique.values())

    @property
    def remote_calls_per_unique(self) -> float:
        return sum(self.remote_rows.values()) / self.unique_total

    @property
    def triton_calls_per_unique(self) -> float:
        return sum(self.triton_rows.values()) / self.unique_total

    @property
    def triton_hit_share(self) -> float:
        return sum(self.triton_hits.values()) / self.sides["triton-cache"].requests

    def summary(self) -> dict[str, float]:
        remote, local = self.sides["remote"], self.sides["local"]
        return {
            "remote_calls_per_unique": self.remote_calls_per_unique,
            "hit_p50_remote_vs_local": remote.hit_ms(50) / local.hit_ms(50),
            "hit_p99_remote_vs_local": remote.hit_ms(99) / local.hit_ms(99),
            "cpu_remote_vs_local": remote.front_cpu_s / local.front_cpu_s,
            "triton_calls_per_unique": self.triton_calls_per_unique,
            "triton_hit_share": self.triton_hit_share,
        }


# ---- set-up ------------------------------------------------------------------------------


def export_repository(folder: Path, export_dir: Path, data_dir: Path) -> Path:
    """The built-in models' repository, by `python -m serving.repository` (make triton-repository)."""
    env = {**os.environ, "ONNX_EXPORT_DIR": str(export_dir), "DATA_DIR": str(data_dir), "REDIS_URL": "off"}
    env.pop("MODELS_CONFIG", None)  # the built-ins
    done = subprocess.run([sys.executable, "-m", "serving.repository", str(folder)], cwd=ROOT, env=env,
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        raise TritonSetupError(f"serving.repository failed:\n{done.stderr.strip()[-3000:]}")
    return folder


def models_config(path: Path, url: str) -> Path:
    """MODELS_CONFIG serving both built-ins from the server at `url`."""
    from engine.models.config import DEFAULT_SPECS

    entries = [{"task": s.task, "kind": s.kind, "source": s.source, "backend": "remote", "remote_url": url}
               for s in DEFAULT_SPECS]  # fmt: skip
    path.write_text(yaml.safe_dump({"models": entries}), encoding="utf-8")
    return path


@dataclass
class Fleet:
    """Two replicas of the app on one redis-server."""

    processes: list[subprocess.Popen[bytes]]
    urls: list[str]

    def cpu_s(self) -> float:
        return sum(process_cpu_s(p.pid) for p in self.processes)


def start_fleet(stack: ExitStack, workdir: Path, name: str, redis_url: str, env: dict[str, str]) -> Fleet:
    envs = [
        {**env, **FLEET_ENV, "REDIS_URL": redis_url, "REPLICA_ID": f"{name}-{k}"} for k in range(REPLICAS)
    ]
    with ThreadPoolExecutor(REPLICAS) as pool:
        started = list(pool.map(lambda k: start_app(workdir / f"{name}-{k}", env=envs[k]), range(REPLICAS)))
    for process, _ in started:
        stack.callback(_stop, process)
    return Fleet([p for p, _ in started], [url for _, url in started])


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()  # reaped by the interpreter at exit


def wait_until_serving(fleet: Fleet) -> None:
    """Until every replica lists the others as live (a replica alone skips the fleet's lease) and
    serves every model on its backend (a remote one in use), and one heartbeat more, by which each
    has counted the others."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    last = "none"
    while time.monotonic() < deadline:
        waiting = []
        for url in fleet.urls:
            replicas = httpx.get(url + "/admin/api/replicas", headers=headers, timeout=5).json()
            live = sum(r["state"] == "live" for r in replicas.get("replicas", ()))
            models = httpx.get(url + "/readyz", timeout=5).json().get("models", {})
            refused = {task: m.get("backend_reason") for task, m in models.items() if m.get("backend_reason")}
            if live < REPLICAS or refused or not models:
                waiting.append(url)
                last = f"{url}: {live} live replicas, models not served: {refused or models}"
        if not waiting:
            time.sleep(1.5)  # FLEET_HEARTBEAT_S (1 s) and a margin
            return
        time.sleep(0.2)
    raise RuntimeError(f"the replicas at {fleet.urls} were not serving within {READY_TIMEOUT_S:.0f} s "
                       f"(last: {last})")  # fmt: skip


@contextmanager
def triton_servers(repository: Path, response_cache_mb: int) -> Iterator[dict[str, TritonRepositoryServer]]:
    """`remote` and `triton-cache`, their ports chosen (start() them); closed on exit."""
    python = triton_python()
    servers = {"remote": TritonRepositoryServer(repository, python=python),
               "triton-cache": TritonRepositoryServer(repository, python=python,
                                                      response_cache_mb=response_cache_mb)}  # fmt: skip
    try:
        yield servers
    finally:
        for server in servers.values():
            server.close()


# ---- clients -----------------------------------------------------------------------------


class FleetClient:
    """One client of a fleet: a tritonclient.http client per replica, alternating between them.
    tritonclient's HTTP client belongs to the thread that made it (gevent), and the replay runs
    each segment on new threads: each thread makes its own."""

    def __init__(self, urls: Sequence[str], first: int) -> None:
        self._urls = [url.removeprefix("http://") for url in urls]
        self._next = first
        self._local = threading.local()

    def _clients(self) -> list[Any]:
        clients = getattr(self._local, "clients", None)
        if clients is None:
            import tritonclient.http as triton

            clients = self._local.clients = [
                triton.InferenceServerClient(url, network_timeout=CLIENT_TIMEOUT_S) for url in self._urls
            ]
        return clients

    def __call__(self, task: str, raw: str | bytes) -> tuple[Labels, str | None]:
        clients = self._clients()
        client = clients[self._next % len(clients)]
        self._next += 1
        inputs, outputs = request_of("binary", raw)
        result = client.infer(task, inputs, outputs=outputs)
        labels, scores = result.as_numpy("label")[0], result.as_numpy("score")[0]
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in labels]
        tier = result.get_response()["parameters"].get("tier")
        return tuple(zip(names, (float(s) for s in scores), strict=True)), tier


class TritonCacheClient:
    """One client of Triton's response cache: this app's preprocessing and remote forward pass
    (a `backend: remote` model per task, its own tritonclient) and postprocessing, no app cache."""

    def __init__(self, models: dict[str, Any]) -> None:
        self._models = models

    def __call__(self, task: str, raw: str | bytes) -> tuple[Labels, str | None]:
        model = self._models[task]
        return labels_of(model.predict_batch([model.canonicalize(raw)])[0]), None

    def close(self) -> None:
        for model in self._models.values():
            model.close()


def triton_cache_clients(url: str, export_dir: Path, count: int) -> list[TritonCacheClient]:
    from engine.models.config import DEFAULT_SPECS
    from engine.models.loader import build_model
    from engine.models.remote import RemoteOptions
    from runtime import load_options
    from settings import Settings

    settings = Settings.from_env().changed(redis__url="off", models__onnx_export_dir=export_dir)
    options = dataclasses.replace(load_options(settings), remote=RemoteOptions(timeout_s=REMOTE_TIMEOUT_S))
    specs = [dataclasses.replace(s, backend="remote", remote_url=url) for s in DEFAULT_SPECS]
    clients = []
    for _ in range(count):
        models = {spec.task: build_model(spec, options) for spec in specs}
        refused = {
            task: m.backend_reason for task, m in models.items() if m.backend != "remote" or m.backend_reason
        }
        if refused:
            raise TritonSetupError(f"the triton-cache server was refused: {refused}")
        clients.append(TritonCacheClient(models))
    return clients


# ---- the run -----------------------------------------------------------------------------


def run(config: Config, *, repository: Path | None = None, export_dir: Path | None = None,
        log: Callable[[str], None] = print) -> Report:  # fmt: skip
    """The whole bench; `repository` and `export_dir`: an exported repository and its ONNX export
    dir to use instead of exporting one (the tests')."""
    jobs = make_inputs(config.images, config.messages, config.seed)
    stream = zipf_stream(len(jobs), config.requests, config.zipf_s, config.seed)
    unique = Counter(jobs[i][0] for i in set(stream.tolist()))
    load_before, started_at = os.getloadavg()[0], dt.datetime.now(dt.UTC)
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-remote-")))
        if repository is None:
            export_dir = workdir / "onnx"
            log("exporting the repository (python -m serving.repository) ...")
            repository = export_repository(workdir / "repository", export_dir, workdir / "export-data")
        assert export_dir is not None, "an exported repository comes with its ONNX export dir"
        servers = stack.enter_context(triton_servers(repository, config.response_cache_mb))
        triton_server = {"remote": servers["remote"], "local": servers["remote"],
                         "triton-cache": servers["triton-cache"]}  # fmt: skip
        log(f"Triton: remote {servers['remote'].http_url}, triton-cache {servers['triton-cache'].http_url}")
        base = {"ONNX_EXPORT_DIR": str(export_dir)}
        remote_env = {**base, "MODELS_CONFIG": str(models_config(workdir / "models.yaml",
                                                                 servers["remote"].http_url))}  # fmt: skip
        # In this thread: a redis-server dies with the thread that started it (storage.redis.embedded).
        redis = {
            name: stack.enter_context(fresh_redis(workdir / f"{name}-redis", tcp=True)) for name in FLEETS
        }
        # Servers and replicas start at once (start-up is most of a quick run): a remote replica that
        # checks the server before it serves keeps checking, backing off, until it does.
        with ThreadPoolExecutor(4) as pool:
            serving = [pool.submit(server.start) for server in servers.values()]
            started = {name: pool.submit(start_fleet, stack, workdir, name, redis[name].url, env)
                       for name, env in (("remote", remote_env), ("local", base))}  # fmt: skip
            for future in serving:
                future.result()
            fleets = {name: future.result() for name, future in started.items()}
        for fleet in fleets.values():
            wait_until_serving(fleet)
        log(f"replicas: remote {fleets['remote'].urls}, local {fleets['local'].urls}")
        clients: dict[str, list[Any]] = {
            name: [FleetClient(fleet.urls, k) for k in range(config.clients)]
            for name, fleet in fleets.items()
        }
        clients["triton-cache"] = triton_cache_clients(
            servers["triton-cache"].http_url, export_dir, config.clients
        )
        for client in clients["triton-cache"]:
            stack.callback(client.close)  # a FleetClient's clients went with their threads
        import tritonclient.http as triton

        stats = triton.InferenceServerClient(servers["triton-cache"].http_address, network_timeout=60)
        stack.callback(stats.close)
        sides = {name: Side(name) for name in SIDES}
        answers: dict[int, Labels] = {}
        disagreements: list[str] = []
        remote_before, triton_before = servers["remote"].calls(), servers["triton-cache"].calls()
        hits_before = cache_hits(stats)
        for index, segment in enumerate(split_segments(stream, config.segments)):
            for name in rotated(SIDES, index):
                _replay_segment(sides[name], clients[name], jobs, segment, fleets.get(name),
                                triton_server[name], answers, disagreements)  # fmt: skip
            log(f"segment {index + 1}/{config.segments} done")
        remote_rows = _delta(servers["remote"].calls(), remote_before)
        triton_rows = _delta(servers["triton-cache"].calls(), triton_before)
        triton_hits = _delta(cache_hits(stats), hits_before)
    return Report(config, dict(unique), remote_rows, triton_rows, triton_hits, sides, disagreements,
                  started_at, (load_before, os.getloadavg()[0]))  # fmt: skip


def _replay_segment(side: Side, clients: list[Any], jobs: Sequence[Job], segment: list[int],
                    fleet: Fleet | None, server: TritonRepositoryServer, answers: dict[int, Labels],
                    disagreements: list[str]) -> None:  # fmt: skip
    """One side's turn: the segment by its clients; the replicas' and the server's CPU over it."""
    server_pid = psutil.Process(server.pid)
    front_before = fleet.cpu_s() if fleet is not None else 0.0
    server_before = tree_cpu_s(server_pid)
    done = replay(clients, jobs, segment, answers, disagreements)
    if done.errors:
        raise RuntimeError(f"{side.name}: {len(done.errors)} requests failed, first: {done.errors[0]}")
    side.server_cpu_s += tree_cpu_s(server_pid) - server_before
    side.front_cpu_s += (fleet.cpu_s() - front_before) if fleet is not None else 0.0
    side.latencies_ms += done.latencies_ms.tolist()
    side.tiers += done.tier_each
    side.wall_s += done.wall_s


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {task: after.get(task, 0) - before.get(task, 0) for task in TASKS}


# ---- the report --------------------------------------------------------------------------


def print_report(report: Report) -> None:
    config = report.config
    print()
    print(f"{report.started_at:%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs; load average before "
          f"{report.loads[0]:.2f}, after {report.loads[1]:.2f}")  # fmt: skip
    print(
        f"Zipf stream (s = {config.zipf_s}) of {config.requests} requests over {config.images} images and "
        f"{config.messages} messages: {report.unique_total} distinct inputs ({report.unique}); "
        f"{config.clients} concurrent clients per side, {config.segments} segments, sides in turn"
    )
    print()
    print("| side | requests | tiers | hit p50 ms | hit p99 ms | all p50 ms | replicas' CPU ms/request "
          "| Triton CPU ms/request | wall s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for side in report.sides.values():
        tiers = dict(Counter(side.tiers)) if side.name in FLEETS else "-"
        front = f"{side.per_request_ms(side.front_cpu_s):.3f}" if side.name in FLEETS else "-"
        hit = (f"{side.hit_ms(50):.2f}", f"{side.hit_ms(99):.2f}") if side.name in FLEETS else ("-", "-")
        print(f"| {side.name} | {side.requests} | {tiers} | {hit[0]} | {hit[1]} | {side.all_ms(50):.2f} "
              f"| {front} | {side.per_request_ms(side.server_cpu_s):.3f} | {side.wall_s:.1f} |")  # fmt: skip
    print()
    print(
        f"remote: rows that reached the Triton server {report.remote_rows} for {report.unique} distinct "
        f"inputs: {report.remote_calls_per_unique:.3f} remote calls per unique input (target 1.0)"
    )
    print(f"triton-cache: rows that reached its callables {report.triton_rows}, response-cache hits "
          f"{report.triton_hits} of {report.sides['triton-cache'].requests} requests: "
          f"{report.triton_calls_per_unique:.3f} calls per unique input")  # fmt: skip
    if report.disagreements:
        print(f"{len(report.disagreements)} inputs answered differently across sides, first: "
              f"{report.disagreements[0]}")  # fmt: skip
    else:
        print("every input got the same answer on every side (within the bench's score tolerance)")
    print("SUMMARY " + " ".join(f"{key}={value:.3f}" for key, value in report.summary().items()))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"a small run ({QUICK.requests} requests)")
    for name in ("requests", "images", "messages", "clients", "segments"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument(
        "--repository", type=Path, help="an exported repository of the built-ins (default: export)"
    )
    parser.add_argument(
        "--onnx-export-dir", type=Path, help="with --repository: the ONNX export dir it came from"
    )
    args = parser.parse_args(argv)
    if (args.repository is None) != (args.onnx_export_dir is None):
        parser.error("--repository and --onnx-export-dir go together")
    config = QUICK if args.quick else Config()
    given = {name: value for name in ("requests", "images", "messages", "clients", "segments")
             if (value := getattr(args, name)) is not None}  # fmt: skip
    config = dataclasses.replace(config, **given)
    try:
        report = run(config, repository=args.repository, export_dir=args.onnx_export_dir)
    except TritonSetupError as exc:
        print(f"bench.remote: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    print_report(report)


if __name__ == "__main__":
    main()
