"""The app served over real HTTP for the hostile-input tests (tests/test_hostile_http.py,
tests/test_fuzz_gradio.py): a handle on it, a /healthz watcher, the process's memory."""

from __future__ import annotations

import ctypes
import gc
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil

from runtime import Runtime, build_runtime
from settings import Settings
from storage.redis.embedded import free_port
from ui.server import serve_runtime


class Served:
    """A served app: its URL, host and port, its runtime, and a keep-alive client."""

    def __init__(self, url: str, runtime: Runtime | None) -> None:
        self.url = url
        self.runtime = runtime
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.http = httpx.Client(base_url=url, timeout=30)


@contextmanager
def served_app(
    settings: Settings, models: dict[str, Any], data_dir: Path, **overrides: Any
) -> Iterator[Served]:
    """The app as `make run` serves it (ui.server.serve_runtime), closed on exit."""
    runtime = build_runtime(settings.changed(server__data_dir=data_dir, **overrides), models=models)
    server = serve_runtime(runtime, port=free_port())
    served = Served(server.url, runtime)
    try:
        yield served
    finally:
        served.http.close()
        server.close()
        runtime.close()


class HealthWatch:
    """Polls /healthz from a thread while in use; keeps every latency and any failure."""

    def __init__(self, url: str, *, every_s: float = 0.05) -> None:
        self._url = url
        self._every_s = every_s
        self._stop = threading.Event()
        self.latencies_s: list[float] = []
        self.failures: list[str] = []
        self._thread = threading.Thread(target=self._run, name="healthz-watch", daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as http:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    status = http.get(self._url + "/healthz").status_code
                    if status != 200:
                        self.failures.append(f"status {status}")
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                self.latencies_s.append(time.perf_counter() - start)
                self._stop.wait(self._every_s)

    @property
    def slowest_s(self) -> float:
        return max(self.latencies_s, default=0.0)

    @property
    def p99_s(self) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[int(0.99 * (len(ordered) - 1))] if ordered else 0.0

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def rss_bytes() -> int:
    """This process's resident memory (the app is served in a thread of it), after garbage
    collection and after glibc hands its free heap back: what is left is what is held, so
    a leak shows and the allocator's fragmentation (many threads decoding large images)
    does not."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    return psutil.Process().memory_info().rss


def _load_libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018  (glibc only)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()
