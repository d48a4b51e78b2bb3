"""Local Redis Cluster and Sentinel set-ups for tests, benchmarks and the fault suite.

Each class owns the `redis-server` processes it starts (loopback only, in a temporary
folder) and stops them on `close()`. Nothing here is used by the app itself.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from storage.redis.embedded import answers_ping

CLUSTER_BUS_OFFSET = 10000  # Redis Cluster's bus port is the data port + 10000
MAX_CLUSTER_PORT = 65535 - CLUSTER_BUS_OFFSET


class LocalRedisError(RuntimeError):
    """A local Redis set-up could not be started."""


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise LocalRedisError(
            f"{name} is not installed: run `make test` (installs it) or `apt-get install -y redis-server`"
        )
    return path


def free_ports(count: int, *, below: int = MAX_CLUSTER_PORT) -> list[int]:
    """`count` loopback ports free now, each below `below` with its bus port (+10000) free too."""
    ports: list[int] = []
    held: list[socket.socket] = []
    try:
        while len(ports) < count:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            held.append(sock)
            if port >= below or port in ports:
                continue
            with socket.socket() as bus:
                try:
                    bus.bind(("127.0.0.1", port + CLUSTER_BUS_OFFSET))
                except OSError:
                    continue
            ports.append(port)
    finally:
        for sock in held:
            sock.close()
    return ports


def _ping(port: int, pid: int | None = None) -> bool:
    """The server on `port` answers (and, given `pid`, is that process: not another
    process's server that took the port first)."""
    return answers_ping(pid=pid, host="127.0.0.1", port=port)


def _wait(predicate: object, timeout_s: float, what: str, *, poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(poll_s)
    raise LocalRedisError(f"{what} within {timeout_s:.0f} s")


class _Servers:
    """Redis child processes by port, in one temporary folder."""

    def __init__(self, prefix: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=prefix))
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self.args: dict[int, list[str]] = {}

    def spawn(self, port: int, args: list[str]) -> None:
        node_dir = self.dir / str(port)
        node_dir.mkdir(exist_ok=True)
        self.args[port] = args
        self.processes[port] = subprocess.Popen(
            args, cwd=node_dir, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def restart(self, port: int) -> None:
        self.spawn(port, self.args[port])

    def answers(self, port: int) -> bool:
        """Our server on `port` is up (not another process's that took the port first)."""
        process = self.processes.get(port)
        return process is not None and _ping(port, process.pid)

    def signal(self, port: int, sig: signal.Signals) -> None:
        process = self.processes.get(port)
        if process is not None and process.poll() is None:
            process.send_signal(sig)

    def kill(self, port: int) -> None:
        process = self.processes.pop(port, None)
        if process is not None:
            process.kill()
            process.wait(timeout=10)

    def close(self) -> None:
        for port in list(self.processes):
            process = self.processes.pop(port)
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=5)
        shutil.rmtree(self.dir, ignore_errors=True)


def _node_args(binary: str, port: int, maxmemory_mb: int) -> list[str]:
    return [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--maxmemory", f"{maxmemory_mb}mb", "--maxmemory-policy", "allkeys-lru", "--loglevel", "warning",
        "--logfile", "redis.log", "--daemonize", "no",
    ]  # fmt: skip


class LocalCluster:
    """A Redis Cluster of `primaries` primary nodes (no replicas) on loopback.

    `cluster-require-full-coverage no`: when one primary is down, the others keep serving
    their slots (the shape the `cluster_node_down` scenario tests).
    """

    def __init__(self, *, primaries: int = 3, maxmemory_mb: int = 64, node_timeout_ms: int = 2000) -> None:
        self.ports = free_ports(primaries)
        self._servers = _Servers("infcache-cluster-")
        self._maxmemory_mb = maxmemory_mb
        self._node_timeout_ms = node_timeout_ms

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self) -> LocalCluster:
        binary = _binary("redis-server")
        cli = _binary("redis-cli")
        try:
            for port in self.ports:
                self._servers.spawn(port, [
                    *_node_args(binary, port, self._maxmemory_mb), "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(self._node_timeout_ms),
                    "--cluster-require-full-coverage", "no",
                ])  # fmt: skip
            for port in self.ports:
                _wait(lambda p=port: self._servers.answers(p), 10, f"cluster node {port} did not answer")
            created = subprocess.run(
                [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                 "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            if created.returncode != 0:
                raise LocalRedisError(
                    f"redis-cli --cluster create failed: {created.stdout[-500:]}{created.stderr}"
                )
            _wait(self._ok, 20, "the cluster did not reach cluster_state:ok")
        except BaseException:
            self.close()
            raise
        return self

    def _ok(self) -> bool:
        for port in self.alive_ports():
            client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5)
            try:
                info = client.execute_command("CLUSTER", "INFO")
            except redis.RedisError:
                return False
            finally:
                client.close()
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in text:
                return False
        return True

    def owner(self, key: str) -> int:
        """The port of the primary that owns `key`'s slot (asked of a live node)."""
        from redis.crc import key_slot

        slot = key_slot(key.encode())
        for port in self.alive_ports():
            client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5)
            try:
                for start, end, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
                    if int(start) <= slot <= int(end):
                        return int(primary[1])
            except redis.RedisError:
                continue
            finally:
                client.close()
        raise LocalRedisError(f"no live node knows who owns slot {slot}")

    def alive_ports(self) -> list[int]:
        return [p for p in self.ports if p in self._servers.processes]

    def kill(self, port: int) -> None:
        """SIGKILL one primary (its slots become unreachable)."""
        self._servers.kill(port)

    def restart(self, port: int) -> None:
        """Start a killed node again with its nodes.conf: it rejoins with its slots (empty)."""
        self._servers.restart(port)
        _wait(lambda: self._servers.answers(port), 10, f"cluster node {port} did not come back")
        _wait(self._ok, 20, "the cluster did not heal")

    def close(self) -> None:
        self._servers.close()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalSentinel:
    """A primary, one replica and one Sentinel (quorum 1) watching them, on loopback."""

    SERVICE = "infcache"

    def __init__(self, *, maxmemory_mb: int = 64, down_after_ms: int = 1000) -> None:
        self.primary_port, self.replica_port, self.sentinel_port = free_ports(3)
        self._servers = _Servers("infcache-sentinel-")
        self._maxmemory_mb = maxmemory_mb
        self._down_after_ms = down_after_ms

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{self.SERVICE}/0"

    def start(self) -> LocalSentinel:
        binary = _binary("redis-server")
        try:
            self._servers.spawn(self.primary_port, _node_args(binary, self.primary_port, self._maxmemory_mb))
            self._servers.spawn(self.replica_port, [
                *_node_args(binary, self.replica_port, self._maxmemory_mb),
                "--replicaof", "127.0.0.1", str(self.primary_port),
            ])  # fmt: skip
            for port in (self.primary_port, self.replica_port):
                _wait(lambda p=port: self._servers.answers(p), 10, f"redis-server {port} did not answer")
            _wait(self._replica_synced, 15, "the replica did not sync")
            conf = self._servers.dir / "sentinel.conf"
            conf.write_text(
                f"port {self.sentinel_port}\nbind 127.0.0.1\ndaemonize no\nlogfile sentinel.log\n"
                f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.primary_port} 1\n"
                f"sentinel down-after-milliseconds {self.SERVICE} {self._down_after_ms}\n"
                f"sentinel failover-timeout {self.SERVICE} 10000\n"
                f"sentinel parallel-syncs {self.SERVICE} 1\n"
            )
            self._servers.spawn(self.sentinel_port, [binary, str(conf), "--sentinel"])
            _wait(lambda: self._sentinel_sees_replica(), 15, "the sentinel did not see the replica")
        except BaseException:
            self.close()
            raise
        return self

    def _sentinel(self) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1", port=self.sentinel_port, socket_timeout=0.5, decode_responses=True
        )

    def _replica_synced(self) -> bool:
        client = redis.Redis(
            host="127.0.0.1", port=self.replica_port, socket_timeout=0.5, decode_responses=True
        )
        try:
            return client.info("replication").get("master_link_status") == "up"
        except redis.RedisError:
            return False
        finally:
            client.close()

    def _sentinel_sees_replica(self) -> bool:
        client = self._sentinel()
        try:
            # Linked and in sync: only then will SENTINEL FAILOVER find a replica to promote.
            return any(
                set(str(r.get("flags", "")).split(",")) == {"slave"} and r.get("master-link-status") == "ok"
                for r in client.sentinel_slaves(self.SERVICE)
            )
        except redis.RedisError:
            return False
        finally:
            client.close()

    def primary_address(self) -> tuple[str, int]:
        client = self._sentinel()
        try:
            host, port = client.sentinel_get_master_addr_by_name(self.SERVICE)
            return host, int(port)
        finally:
            client.close()

    def failover(self, *, timeout_s: float = 20.0) -> tuple[int, int]:
        """`SENTINEL FAILOVER`; returns (old primary port, new primary port) once the new one
        is a writable primary and the sentinel names it."""
        old = self.primary_address()[1]

        def started() -> bool:
            client = self._sentinel()
            try:
                client.execute_command("SENTINEL", "FAILOVER", self.SERVICE)
                return True
            except redis.ResponseError as exc:  # NOGOODSLAVE until the sentinel's view is fresh
                if "NOGOODSLAVE" not in str(exc) and "INPROG" not in str(exc):
                    raise
                return False
            finally:
                client.close()

        _wait(started, timeout_s, "SENTINEL FAILOVER found no replica to promote", poll_s=0.2)

        def switched() -> bool:
            try:
                port = self.primary_address()[1]
            except redis.RedisError:
                return False
            if port == old:
                return False
            node = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5, decode_responses=True)
            try:
                return node.info("replication").get("role") == "master"
            except redis.RedisError:
                return False
            finally:
                node.close()

        _wait(switched, timeout_s, "the failover did not complete", poll_s=0.1)
        return old, self.primary_address()[1]

    def close(self) -> None:
        self._servers.close()

    def __enter__(self) -> LocalSentinel:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
