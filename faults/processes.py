"""The app processes the suite starts, stops and kills, and what it reads of them from /proc."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from faults.config import APP_SETTINGS, REFRESH_S, ROOT, SOCKET_TIMEOUT_S, TOKEN
from storage.redis.embedded import free_port


def die_with_parent() -> None:  # in the child between fork and exec: no orphans if we crash
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class AppProcess:
    """One `python app.py` with its own port and DATA_DIR, sharing the suite's Redis."""

    def __init__(self, name: str, *, data_dir: Path, redis_url: str, database_url: str | None = None) -> None:
        self.name = name
        self.database_url = database_url  # None: SQLite under DATA_DIR
        self.port = free_port()
        self.data_dir = data_dir
        self.redis_url = redis_url
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def sqlite_path(self) -> Path:
        return self.data_dir / "requests.sqlite3"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "app.log"

    def start(self) -> None:
        """Must run on the main thread: the child dies with the thread that started it."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in APP_SETTINGS}
        env.update(
            PORT=str(self.port),
            HOST="127.0.0.1",
            DATA_DIR=str(self.data_dir),
            REDIS_URL=self.redis_url,
            ADMIN_TOKEN=TOKEN,
            REDIS_SOCKET_TIMEOUT_S=str(SOCKET_TIMEOUT_S),
            GENERATION_REFRESH_S=str(REFRESH_S),
            GRADIO_TEMP_DIR=str(self.data_dir / "uploads"),
            GRADIO_ANALYTICS_ENABLED="False",
            PYTHONUNBUFFERED="1",
        )
        if self.database_url is not None:
            env["DATABASE_URL"] = self.database_url
        self.starts += 1
        with open(self.log_path, "ab") as log:
            log.write(f"\n---- start #{self.starts} ----\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                [sys.executable, "app.py"],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )

    def wait_ready(self, timeout_s: float = 240.0, l2: str | None = "up") -> None:
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"app {self.name} exited at start-up:\n{self.log_tail()}")
            try:
                response = httpx.get(self.url + "/readyz", timeout=2.0)
                body = response.json()
                last = f"{response.status_code} {body}"
                if response.status_code == 200 and (l2 is None or body.get("l2") == l2):
                    return
            except (httpx.HTTPError, ValueError) as exc:
                last = repr(exc)
            time.sleep(0.2)
        raise RuntimeError(f"app {self.name} not ready within {timeout_s:.0f}s ({last}):\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL: no clean-up of any kind."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def stop(self, grace_s: float = 10.0) -> float | None:
        """SIGTERM; SIGKILL after `grace_s`. Seconds it took to exit, None if it had to be killed."""
        if self.process is None or self.process.poll() is not None:
            return 0.0
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
            return time.monotonic() - started
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


def peak_rss_mb(pid: int | None) -> float | None:
    """The process's peak resident memory (VmHWM), after resetting it to the current size."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        return next(int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return None


def rss_mb(pid: int | None) -> float | None:
    """The process's resident memory now (VmRSS)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        return next(int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return None


def reset_peak_rss(pid: int | None) -> bool:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # Linux: reset VmHWM to the current RSS
        return True
    except OSError:
        return False
