"""A real Triton Inference Server for the tests and the benchmarks, in its own venv and process.

`triton_python()` makes the Triton venv on demand (scripts/triton_venv.sh: nvidia-pytriton 0.7.0
with its tritonserver 2.51, numpy < 2, onnxruntime) and returns its Python. `TritonProcess` runs
one of the Triton venv's scripts (serving/triton_serve.py, bench/triton_server.py), waits for
its `{"ready": true}` line and speaks their JSON-line protocol (serving/triton_common.py).

    with TritonRepositoryServer(repo_dir) as server:  # a repository from serving.repository
        server.http_url, server.grpc_url            # "http://127.0.0.1:P", "grpc://127.0.0.1:G"
        server.calls()                              # {"text": rows that reached the callable, ...}
        server.batches()                            # {"text": callable invocations (batches), ...}
        server.kill(); server.start()               # killed (SIGKILL), started again on the same ports
        server.stop()                               # a clean stop (SIGTERM): its exit status
        server.set_delay(0.5)                       # each batch sleeps first
        server.set_garbage("nan")                   # "nan" | "shape" | None: what the callable answers
    TritonRepositoryServer(repo_dir, response_cache_mb=64)  # Triton's own response cache on every model

Free loopback ports, a temp dir (PyTriton's workspace, the server's log), everything killed
and removed on exit (shared memory included). A venv that cannot be made or a server that does
not start raises TritonSetupError with the script's message or the server log's tail.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Self

import psutil

from storage.redis.embedded import free_port

ROOT = Path(__file__).resolve().parent.parent
VENV_SCRIPT = ROOT / "scripts" / "triton_venv.sh"
SERVE_SCRIPT = ROOT / "serving" / "triton_serve.py"
STAND_IN = Path(__file__).resolve().parent / "triton_onnx_stand_in.py"
START_TIMEOUT_S = 180.0  # tritonserver and the Python-backend stubs start in ~5-20 s on 2 busy cores
COMMAND_TIMEOUT_S = 30.0


class TritonSetupError(RuntimeError):
    """The Triton side could not be set up; the message says what happened."""


def triton_python() -> Path:
    """The Triton venv's python, made by scripts/triton_venv.sh if missing (a clear error if it fails)."""
    done = subprocess.run(["bash", str(VENV_SCRIPT)], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise TritonSetupError(f"{VENV_SCRIPT.name} failed (exit {done.returncode}):\n"
                               f"{(done.stderr or done.stdout).strip()[-3000:]}")  # fmt: skip
    return ROOT / done.stdout.strip().splitlines()[-1]


def _lines(stream: IO[str], into: queue.Queue[str | None]) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


class TritonProcess:
    """One Triton venv script in its own process group, started and ready when constructed."""

    def __init__(self, python: Path, script: Path, args: Sequence[str], log_path: Path,
                 *, start_timeout_s: float = START_TIMEOUT_S) -> None:  # fmt: skip
        self.script = script
        self.log_path = log_path
        self._log = log_path.open("a")
        self._lock = threading.Lock()
        self.left_behind: set[Path] = set()
        # Its own session: kill() reaches tritonserver and its stubs, not only PyTriton's process.
        self.process = subprocess.Popen(
            [str(python), str(script), *args], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, text=True, start_new_session=True,
        )  # fmt: skip
        assert self.process.stdout is not None
        self._answers: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_lines, args=(self.process.stdout, self._answers), daemon=True).start()
        try:
            ready = self._receive(start_timeout_s)
            if not ready.get("ready"):
                raise TritonSetupError(f"unexpected first line from {script.name}: {ready}")
        except BaseException:
            self.kill()
            raise
        self.ready = ready

    def _receive(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            raise TritonSetupError(f"{self.script.name} said nothing within {timeout_s:.0f} s; its log "
                                   f"({self.log_path}) ends:\n{self.log_tail()}") from None  # fmt: skip
        if line is None:
            self.process.wait(timeout=30)
            raise TritonSetupError(f"{self.script.name} exited ({self.process.returncode}); its log "
                                   f"({self.log_path}) ends:\n{self.log_tail()}")  # fmt: skip
        return json.loads(line)

    def request(self, command: dict[str, Any]) -> dict[str, Any]:
        """One command line on stdin, its answer line (raises TritonSetupError on an error answer)."""
        with self._lock:
            assert self.process.stdin is not None
            self.process.stdin.write(json.dumps(command) + "\n")
            self.process.stdin.flush()
            answer = self._receive(COMMAND_TIMEOUT_S)
        if "error" in answer:
            raise TritonSetupError(f"{self.script.name} refused {command}: {answer['error']}")
        return answer

    def log_tail(self, lines: int = 25) -> str:
        if not self._log.closed:
            self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def running(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL to the whole process group (a crash, not a stop), then the shared memory its
        processes had mapped is removed: PyTriton's and the Python backend's segments in /dev/shm
        outlive a killed process (a clean stop removes them)."""
        self._end(self.shared_memory(), self._members())

    def _end(self, segments: set[Path], members: list[psutil.Process]) -> None:
        try:  # the group even when its leader is gone: tritonserver may outlive PyTriton's process
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait(timeout=30)
        psutil.wait_procs(members, timeout=30)  # gone, their ports free, before a start on them
        for path in segments:
            path.unlink(missing_ok=True)
        self._close_pipes()

    def _members(self) -> list[psutil.Process]:
        """The script's process and its descendants (tritonserver, the stubs, their helpers)."""
        try:
            leader = psutil.Process(self.process.pid)
            return [leader, *leader.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def shared_memory(self) -> set[Path]:
        """The /dev/shm files the process group has mapped or open now."""
        found: set[Path] = set()
        for member in self._members():
            try:
                found.update(
                    Path(m.path) for m in member.memory_maps(grouped=True) if m.path.startswith("/dev/shm/")
                )
                found.update(Path(f.path) for f in member.open_files() if f.path.startswith("/dev/shm/"))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    def close(self) -> None:
        """End of stdin: the script stops tritonserver and exits (killed if it does not in 60 s)."""
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.close()
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()  # whatever is left of the group (a stub that outlived its server)

    def terminate(self, timeout_s: float = 60) -> int | None:
        """SIGTERM to the script (what an orchestrator sends); its exit status, None if it did not
        exit in time (then it is killed). `left_behind`: the shared memory its processes held
        that still existed once they had all exited by themselves (then it is removed)."""
        segments, members = self.shared_memory(), self._members()
        code: int | None = None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                code = self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        else:
            code = self.process.returncode
        if code is not None:  # helpers (multiprocessing's resource tracker) end after their parent
            psutil.wait_procs(members, timeout=10)
            self.left_behind = {path for path in segments if path.exists()}
        self._end(segments, members)
        return code

    def _close_pipes(self) -> None:
        for stream in (self.process.stdin, self.process.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        self._log.close()


class _Server:
    """What the servers here share: started on entering (closed if that fails), closed on
    exiting, a temp dir of their own."""

    _dir: Path | None = None

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _remove_dir(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class TritonRepositoryServer(_Server):
    """serving/triton_serve.py serving `repository` on free loopback ports (see the module doc)."""

    def __init__(self, repository: Path, *, threads: int = 1, python: Path | None = None,
                 response_cache_mb: int = 0) -> None:  # fmt: skip
        self.repository = Path(repository)
        self.threads = threads
        self.response_cache_mb = response_cache_mb  # Triton's own response cache on every model (0: off)
        self._python = python
        self.ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
        self.http_url = f"http://127.0.0.1:{self.ports['http']}"
        self.grpc_url = f"grpc://127.0.0.1:{self.ports['grpc']}"
        self._dir: Path | None = None
        self._process: TritonProcess | None = None
        self._starts = 0

    # tritonclient takes host:port without a scheme
    @property
    def http_address(self) -> str:
        return f"127.0.0.1:{self.ports['http']}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    @property
    def log_path(self) -> Path:
        assert self._dir is not None, "start() first"
        return self._dir / "tritonserver.log"

    def start(self) -> None:
        """Start (again, after kill()) on the same ports; returns once the models are served."""
        if self._process is not None and self._process.running():
            raise RuntimeError("the Triton server is already running")
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="triton-server-"))
        if self._python is None:
            self._python = triton_python()
        self._starts += 1
        workspace = self._dir / f"workspace-{self._starts}"  # PyTriton removes it on a clean stop only
        args = ["--repository", str(self.repository), "--control", "--threads", str(self.threads),
                "--http-port", str(self.ports["http"]), "--grpc-port", str(self.ports["grpc"]),
                "--metrics-port", str(self.ports["metrics"]), "--workspace", str(workspace),
                "--response-cache-mb", str(self.response_cache_mb)]  # fmt: skip
        self._process = TritonProcess(self._python, SERVE_SCRIPT, args, self.log_path)

    def kill(self) -> None:
        """The server dies at once (SIGKILL to it, tritonserver and the stubs)."""
        if self._process is not None:
            self._process.kill()

    def running(self) -> bool:
        return self._process is not None and self._process.running()

    @property
    def pid(self) -> int | None:
        """PyTriton's process (tritonserver and its stubs run under it)."""
        return self._process.process.pid if self._process is not None else None

    def stop(self) -> int | None:
        """A clean stop (SIGTERM, as `make triton-serve` is stopped): the exit status."""
        return self._process.terminate() if self._process is not None else None

    def shared_memory(self) -> set[Path]:
        """The /dev/shm segments the server's processes hold now."""
        return self._process.shared_memory() if self._process is not None else set()

    def left_behind(self) -> set[Path]:
        """What the last clean stop() left in /dev/shm (removed since)."""
        return self._process.left_behind if self._process is not None else set()

    def counts(self) -> dict[str, dict[str, int]]:
        """{"rows": {...}, "requests": {...}, "batches": {...}} per model since this start."""
        return self._live().request({"op": "calls"})

    def calls(self) -> dict[str, int]:
        """Rows (inputs) that reached each model's callable since this start."""
        return self.counts()["rows"]

    def batches(self) -> dict[str, int]:
        """Times each model's callable ran (one per dynamic batch) since this start."""
        return self.counts()["batches"]

    def set_delay(self, seconds: float) -> None:
        self._live().request({"op": "delay", "seconds": seconds})

    def set_garbage(self, mode: str | None) -> None:
        self._live().request({"op": "garbage", "mode": mode})

    def log_tail(self, lines: int = 25) -> str:
        return self._process.log_tail(lines) if self._process is not None else ""

    def _live(self) -> TritonProcess:
        if self._process is None or not self._process.running():
            raise RuntimeError("the Triton server is not running (start() it)")
        return self._process

    def close(self) -> None:
        """Killed, its shared memory removed (a clean stop costs 5-7 s of unloading, which no test
        needs: stop() is the clean one), and its temp dir removed."""
        if self._process is not None:
            self._process.kill()
            self._process = None
        self._remove_dir()


# What the bare server needs of the Triton venv: where PyTriton keeps tritonserver and its libraries.
_LAYOUT = """
import pathlib, sys, pytriton
from pytriton.utils.distribution import get_libs_path
print(pathlib.Path(pytriton.__file__).parent / "tritonserver")
print(get_libs_path())
print("%d.%d" % sys.version_info[:2])
"""


class BareTritonServer(_Server):
    """tritonserver itself (the one nvidia-pytriton ships) loading `repository` exactly as written,
    with testing/triton_onnx_stand_in.py as its `onnxruntime` backend (it ships only the Python
    backend): the check that the repository's configs are what Triton takes. HTTP only, on a free
    loopback port; stopped with SIGTERM (killed if it does not stop) and its temp dir removed."""

    def __init__(self, repository: Path, *, python: Path | None = None) -> None:
        self.repository = Path(repository)
        self._python = python
        self.port = free_port()
        self.http_address = f"127.0.0.1:{self.port}"
        self._dir: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        assert self._dir is not None, "start() first"
        return self._dir / "tritonserver.log"

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        python = self._python or triton_python()
        layout = subprocess.run([str(python), "-c", _LAYOUT], capture_output=True, text=True, timeout=60)
        if layout.returncode != 0:
            raise TritonSetupError(f"the Triton venv has no PyTriton server: {layout.stderr.strip()[-2000:]}")
        server, libs, version = (Path(line) for line in layout.stdout.split())
        self._dir = Path(tempfile.mkdtemp(prefix="tritonserver-"))
        backends = self._dir / "backends"
        # Copies, not links: Triton refuses a backend library whose real path is outside its directory.
        (backends / "python").mkdir(parents=True)
        python_backend = server / "backends" / "python"
        stub = server / "python_backend_stubs" / str(version) / "triton_python_backend_stub"
        for source in (
            python_backend / "libtriton_python.so",
            python_backend / "triton_python_backend_utils.py",
            stub,
        ):
            shutil.copy2(source, backends / "python" / source.name)
        (backends / "onnxruntime").mkdir()
        shutil.copy2(STAND_IN, backends / "onnxruntime" / "model.py")
        # The stub finds its Python (the Triton venv's packages) through PATH, as PyTriton sets it.
        path = f"{python.parent}:{os.environ.get('PATH', '')}"
        env = {**os.environ, "PATH": path, "LD_LIBRARY_PATH": str(libs)}
        command = [str(server / "bin" / "tritonserver"), f"--model-repository={self.repository}",
                   f"--backend-directory={backends}", "--http-address=127.0.0.1", f"--http-port={self.port}",
                   "--allow-grpc=false", "--allow-metrics=false", "--exit-on-error=true",
                   "--exit-timeout-secs=5"]  # fmt: skip
        with self.log_path.open("w") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True)  # fmt: skip
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        assert self._process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise TritonSetupError(f"tritonserver exited ({self._process.returncode}) loading "
                                       f"{self.repository}; its log ends:\n{self.log_tail()}")  # fmt: skip
            try:
                url = f"http://{self.http_address}/v2/health/ready"
                with urllib.request.urlopen(url, timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise TritonSetupError(f"tritonserver was not ready within {timeout_s:.0f} s; its log ends:\n"
                               f"{self.log_tail()}")  # fmt: skip

    def log_tail(self, lines: int = 25) -> str:
        if self._dir is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            try:  # the stubs too, if the server left any
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            process.wait(timeout=30)
        self._remove_dir()
