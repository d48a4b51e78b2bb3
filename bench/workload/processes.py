"""Where the systems run: child processes (their own memory) or this one; their Redis; CPU and RSS."""

from __future__ import annotations

import multiprocessing
import os
import re
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from bench.workload.config import APP_MODELS, REDIS_MAXMEMORY_MB, TORCH_MODELS
from storage.redis.embedded import free_port

# Loaded models shared by the systems of a run in one process: set name -> task -> model.
ModelSets = Mapping[str, Mapping[str, Any]]


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM), so the next reading covers only what follows."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> float:
    with open("/proc/self/status") as status:
        found = re.search(r"VmHWM:\s+(\d+) kB", status.read())
    return int(found.group(1)) / 1024 if found else float("nan")


def load_models(device: str, models: str = TORCH_MODELS) -> dict[str, Any]:
    """One model set (config.TORCH_MODELS or APP_MODELS) of both tasks."""
    from bench.models import load_real_models

    image, text = load_real_models(device, "torch" if models == TORCH_MODELS else "auto")
    return {"image": image, "text": text}


def load_model_sets(device: str) -> ModelSets:
    """Both sets, for a run whose systems share this process's models."""
    return {name: load_models(device, name) for name in (TORCH_MODELS, APP_MODELS)}


class Handle(Protocol):
    def send(self, command: str, *args: Any) -> None: ...

    def receive(self) -> Any: ...

    def close(self) -> None: ...


def _serve_commands(conn: Any, factory: Callable[[Any], Any], spec: Any) -> None:
    """A child process: builds `factory(spec)`, then runs the methods the parent asks for, one at a time."""
    try:
        served = factory(spec)
        while True:
            command, args = conn.recv()
            if command == "exit":
                return
            conn.send(("ok", getattr(served, command)(*args)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


class ChildHandle:
    """`factory(spec)` (a Worker, a server) in its own process (spawned: a fresh interpreter,
    its own memory); `factory` must be importable by name (a module-level class)."""

    def __init__(self, factory: Callable[[Any], Any], spec: Any) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self.process = context.Process(target=_serve_commands, args=(child_conn, factory, spec), daemon=True)
        self.process.start()
        child_conn.close()

    def send(self, command: str, *args: Any) -> None:
        self._conn.send((command, args))

    def receive(self) -> Any:
        while not self._conn.poll(1.0):
            if not self.process.is_alive():
                raise RuntimeError(
                    f"worker process {self.process.pid} died (exit code {self.process.exitcode})"
                )
        status, value = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"worker process failed:\n{value}")
        return value

    def call(self, command: str, *args: Any) -> Any:
        self.send(command, *args)
        return self.receive()

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send(("exit", ()))
            except OSError:
                pass
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=10)
        self._conn.close()


class LocalHandle:
    """A Worker in this process (tests, --in-process): shares the loaded models."""

    def __init__(self, worker: Any) -> None:
        self._worker = worker
        self._result: Any = None

    def send(self, command: str, *args: Any) -> None:
        self._result = getattr(self._worker, command)(*args)

    def receive(self) -> Any:
        result, self._result = self._result, None
        return result

    def call(self, command: str, *args: Any) -> Any:
        self.send(command, *args)
        return self.receive()

    def close(self) -> None:
        pass


@contextmanager
def fresh_redis(workdir: Path, *, tcp: bool = False) -> Iterator[Any]:
    """A private redis-server with the app's maxmemory and policy and no snapshots: on a unix
    socket as the app starts its own (REDIS_URL unset), or on a free loopback port (`tcp`)."""
    from storage.redis.embedded import EmbeddedRedis

    port = free_port() if tcp else None
    server = EmbeddedRedis(data_dir=workdir, maxmemory_mb=REDIS_MAXMEMORY_MB, port=port, save=False)
    server.start()
    try:
        yield server
    finally:
        server.close()


def redis_state(server: Any) -> tuple[float, float]:
    """(used memory MiB, CPU seconds so far) of a redis-server this script started."""
    import psutil
    import redis

    client = redis.Redis.from_url(server.url, socket_timeout=5)
    try:
        used = int(client.info("memory")["used_memory"]) / 2**20
    finally:
        client.close()
    cpu = psutil.Process(server.pid).cpu_times()
    return used, cpu.user + cpu.system


def process_cpu_s(pid: int) -> float:
    import psutil

    cpu = psutil.Process(pid).cpu_times()
    return cpu.user + cpu.system


def process_rss_mib(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20
