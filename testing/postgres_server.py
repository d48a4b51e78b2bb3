"""A private PostgreSQL server for tests and the fault suite: Debian's server binaries
(`/usr/lib/postgresql/<version>/bin`), a cluster in a temporary folder, loopback TCP on a
free port, stopped and deleted by `close()`.

PostgreSQL refuses to run as root, so when this process is root, `initdb` and `pg_ctl` run
as the `postgres` user (`runuser`), in a folder that user owns. Authentication is `trust`
for 127.0.0.1 only: the cluster holds test data and listens on nothing else.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from storage.redis.embedded import free_port

SERVER_USER = "postgres"


class PostgresUnavailable(RuntimeError):
    """The PostgreSQL server binaries (or the user to run them as) are missing."""


def find_server_bin() -> Path:
    """The newest `/usr/lib/postgresql/<version>/bin` holding initdb, pg_ctl and postgres."""
    found = sorted(
        (Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")),
        key=lambda bin_dir: int(bin_dir.parent.name) if bin_dir.parent.name.isdigit() else 0,
    )
    for bin_dir in reversed(found):
        if (bin_dir / "pg_ctl").exists() and (bin_dir / "postgres").exists():
            return bin_dir
    raise PostgresUnavailable(
        "PostgreSQL server binaries not found under /usr/lib/postgresql/*/bin: these tests need a "
        "real server. Run `make test` (installs it as root) or `apt-get install -y postgresql`."
    )


class PostgresServer:
    """Owns one PostgreSQL cluster. `start()`, then `url(database)`; `stop()`/`start()` again
    restart it on the same port with the same data; `close()` (idempotent) removes it."""

    def __init__(self, *, port: int | None = None, startup_timeout_s: float = 60.0) -> None:
        self.bin_dir = find_server_bin()
        self.port = port or free_port()
        self._startup_timeout_s = startup_timeout_s
        self._as_root = os.geteuid() == 0
        if self._as_root:
            try:
                self._user = pwd.getpwnam(SERVER_USER)
            except KeyError:
                raise PostgresUnavailable(
                    f"running as root and there is no {SERVER_USER!r} user to run PostgreSQL as "
                    "(the Debian package `postgresql` creates it)"
                ) from None
        self._root = Path(tempfile.mkdtemp(prefix="infcache-pg-"))
        self.data_dir = self._root / "data"
        self.log_path = self._root / "server.log"
        self._initialised = False
        self._running = False
        self._closed = False

    # ---- commands ----------------------------------------------------------

    def _run(self, *args: str, timeout_s: float = 120.0) -> None:
        command = [str(self.bin_dir / args[0]), *args[1:]]
        if self._as_root:
            command = ["runuser", "-u", SERVER_USER, "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
        if done.returncode != 0:
            tail = self.log_path.read_text()[-2000:] if self.log_path.exists() else ""
            raise PostgresUnavailable(
                f"{args[0]} failed ({done.returncode}): {done.stderr.strip()[-1500:]}\n{tail}"
            )

    def _initdb(self) -> None:
        os.chmod(self._root, 0o755)
        if self._as_root:
            os.chown(self._root, self._user.pw_uid, self._user.pw_gid)
        self._run("initdb", "-D", str(self.data_dir), "-U", "postgres", "-A", "trust", "-E", "UTF8",
                  "--locale=C", "--no-sync")  # fmt: skip
        self._initialised = True

    def start(self) -> PostgresServer:
        if self._closed:
            raise RuntimeError("this PostgresServer is closed")
        if not self._initialised:
            self._initdb()
        # Test settings: loopback only, no unix socket, no fsync (only a machine crash could lose
        # data). Commits stay synchronous: a committed row survives a server crash (`stop("immediate")`),
        # as in production, so the fault suite can count rows exactly.
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' -c fsync=off "
            "-c full_page_writes=off -c max_connections=200"
        )
        self._run("pg_ctl", "-D", str(self.data_dir), "-l", str(self.log_path), "-o", options,
                  "-w", "-t", str(int(self._startup_timeout_s)), "start")  # fmt: skip
        self._running = True
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        while True:
            try:
                with psycopg.connect(self.dsn("postgres"), connect_timeout=2):
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self, mode: str = "fast") -> None:
        """`fast`: disconnect clients, shut down cleanly; `immediate`: as if it crashed."""
        if self._running:
            self._running = False
            self._run("pg_ctl", "-D", str(self.data_dir), "-m", mode, "-w", "stop")

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.stop("immediate")
        finally:
            self._closed = True
            shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- databases ---------------------------------------------------------

    def dsn(self, database: str) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={database}"

    def url(self, database: str = "postgres") -> str:
        """The SQLAlchemy URL the app takes as DATABASE_URL."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """A new empty database; returns its URL."""
        if not name.replace("_", "").isalnum():
            raise ValueError(f"database name {name!r}: letters, digits and _ only")
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)
