"""A private `redis-server` child process: the default L2 when REDIS_URL is unset.

It listens on a unix socket under the data directory (no TCP port), keeps RDB
snapshots there, evicts with allkeys-lru at `maxmemory`, and dies with the app.
"""

from __future__ import annotations

import ctypes
import logging
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_MAX_UNIX_PATH = 100  # sun_path is 108 bytes on Linux


REDIS_SUBDIR = "redis"  # under DATA_DIR: the socket's folder and the RDB snapshot


class EmbeddedRedisError(RuntimeError):
    """The private redis-server could not be started."""


def free_port() -> int:
    """A loopback TCP port free right now, for `EmbeddedRedis(port=...)` in tests and benchmarks."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def find_redis_server() -> str | None:
    return shutil.which("redis-server")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class EmbeddedRedis:
    """Owns one redis-server child. `start()` once, `close()` (idempotent) to stop."""

    def __init__(
        self,
        *,
        data_dir: Path,
        maxmemory_mb: int,
        binary: str | None = None,
        startup_timeout_s: float = 10.0,
        port: int | None = None,
        save: bool = True,
    ) -> None:
        """`port=None`: a unix socket only (the app's default). A port: loopback TCP
        on 127.0.0.1 instead (tests and benchmarks, which kill and restart it)."""
        self._data_dir = Path(data_dir).resolve()
        self._maxmemory_mb = maxmemory_mb
        self._binary = binary or find_redis_server()
        self._startup_timeout_s = startup_timeout_s
        self._port = port
        self._save = save
        self._process: subprocess.Popen[bytes] | None = None
        self._socket_dir: str | None = None
        self.socket_path: Path | None = None

    @property
    def url(self) -> str:
        if self._port is not None:
            return f"redis://127.0.0.1:{self._port}/0"
        if self.socket_path is None:
            raise EmbeddedRedisError("embedded redis-server is not started")
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> str:
        if self._binary is None:
            raise EmbeddedRedisError("redis-server is not installed")
        if self._process is not None:
            return self.url
        redis_dir = self._data_dir / REDIS_SUBDIR
        redis_dir.mkdir(parents=True, exist_ok=True)
        if self._port is not None:
            return self._start_tcp(redis_dir)
        socket_path = redis_dir / "redis.sock"
        if len(str(socket_path)) > _MAX_UNIX_PATH:
            self._socket_dir = tempfile.mkdtemp(prefix="infcache-redis-")
            socket_path = Path(self._socket_dir) / "redis.sock"
        if socket_path.exists():
            if answers_ping(unix_socket_path=str(socket_path)):
                raise EmbeddedRedisError(
                    f"another redis-server already serves {socket_path}; "
                    "is a second copy of the app using the same DATA_DIR? "
                    "Give each copy its own DATA_DIR or share one REDIS_URL."
                )
            socket_path.unlink()
        command = [
            *self._base_command(redis_dir),
            "--port", "0",
            "--unixsocket", str(socket_path),
            "--unixsocketperm", "700",
        ]  # fmt: skip
        self._spawn(command)
        assert self._process is not None
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            if socket_path.exists() and answers_ping(unix_socket_path=str(socket_path)):
                self.socket_path = socket_path
                log.info("started private redis-server (pid %s) at %s", self._process.pid, socket_path)
                return self.url
            time.sleep(0.02)
        self.close()
        raise EmbeddedRedisError("redis-server did not answer within the start-up timeout")

    def _start_tcp(self, redis_dir: Path) -> str:
        command = [*self._base_command(redis_dir), "--bind", "127.0.0.1", "--port", str(self._port)]
        self._spawn(command)
        assert self._process is not None
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            # Ours, not another process's server that took the port first (a race between
            # free_port() callers): then ours exits, and `_check_alive` says why.
            if answers_ping(host="127.0.0.1", port=self._port, pid=self._process.pid):
                log.info("started redis-server (pid %s) on 127.0.0.1:%s", self._process.pid, self._port)
                return self.url
            time.sleep(0.02)
        self.close()
        raise EmbeddedRedisError("redis-server did not answer within the start-up timeout")

    def _base_command(self, redis_dir: Path) -> list[str]:
        assert self._binary is not None
        return [
            self._binary,
            "--dir", str(redis_dir),
            "--dbfilename", "cache.rdb",
            "--save", "300 1 60 1000" if self._save else "",
            "--appendonly", "no",
            "--maxmemory", f"{self._maxmemory_mb}mb",
            "--maxmemory-policy", "allkeys-lru",
            "--daemonize", "no",
            "--loglevel", "warning",
            "--logfile", str(redis_dir / "redis.log"),
        ]  # fmt: skip

    def _spawn(self, command: list[str]) -> None:
        self._process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            # Dies with the thread that started it, so a crashed app leaves no orphan.
            preexec_fn=_die_with_parent,
        )

    def _check_alive(self) -> None:
        assert self._process is not None
        if self._process.poll() is not None:
            stderr = self._process.stderr
            err = stderr.read().decode(errors="replace") if stderr else ""
            self._process = None
            raise EmbeddedRedisError(f"redis-server exited at start-up: {err.strip()[:500]}")

    def kill(self) -> None:
        """SIGKILL, no snapshot: for fault tests. `start()` brings it back."""
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.wait(timeout=10)
            if process.stderr is not None:
                process.stderr.close()

    def close(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()  # SIGTERM: redis saves its RDB snapshot, then exits
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        if process is not None and process.stderr is not None:
            process.stderr.close()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None
        self.socket_path = None

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def answers_ping(*, pid: int | None = None, **where: object) -> bool:
    """True when a Redis at `where` (host/port or unix_socket_path) answers PING quickly
    (and, given `pid`, is that process)."""
    client = redis.Redis(**where, socket_timeout=0.2, socket_connect_timeout=0.2)  # type: ignore[arg-type]
    try:
        if pid is not None and int(client.info("server").get("process_id", -1)) != pid:
            return False
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()
