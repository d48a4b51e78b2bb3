"""Fault injection and hostile input against the running app, with every answer checked.

The suite starts its own `redis-server` (loopback, a free port) and two app processes
(`python app.py`, each with its own DATA_DIR) sharing that Redis, then runs one
scenario per fault. Load comes from a known set of inputs (crops of scikit-image's
photos, support messages) whose reference answers were computed beforehand with the
real models in this process (`predict_batch([canonicalize(raw)])`, batch 1, exactly
what the app runs), and every response is compared with its reference: the top label
and every score exactly, the model version, and where it matters the generation.

Clients speak Gradio's HTTP API (`/gradio_api/upload`, `/gradio_api/call/<api>`), the
same protocol `gradio_client` uses, and behave like a load balancer: a request that
cannot reach a replica (connection refused or dropped) is retried on the other one.
A request counts as

- succeeded: the reference answer, or for a bad input the same clear message the
  engine gives when called directly;
- failed: a valid input without its answer (an error, a 500, a hang past the request
  timeout, no replica reachable), or an input error worded like a server fault;
- wrong: an answer that differs from the reference, or that carries an old
  generation or another model version.

    .venv/bin/python -m bench.faults [--quick] [--only NAME[,NAME...]] [--list]

The last line is `SUMMARY scenarios=N failed_requests=F wrong_results=W`; the exit
status is 0 only when both are zero and every scenario's checks hold.
`tests/test_faults.py` runs the same scenarios with smaller sizes (`pytest -m faults`).
Needs `redis-server` on PATH. It touches no Redis and no process it did not start.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import io
import json
import os
import pickle
import random
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import msgpack
import redis
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from bench.models import MESSAGES, PHOTOS, SCORE_TOLERANCE, format_table, load_photos, photo_dir
from engine.codec import ALIAS_SCHEMA, RESULT_SCHEMA
from engine.errors import InvalidInputError
from engine.keys import raw_digest
from engine.models.base import Classifier
from settings import Settings
from storage.embedded_redis import EmbeddedRedis, find_redis_server, free_port

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "infcache"  # the app's default CACHE_PREFIX
TOKEN = "faults-suite-operator-token"
SOCKET_TIMEOUT_S = 0.25  # REDIS_SOCKET_TIMEOUT_S given to the apps (the default)
REFRESH_S = 0.5  # GENERATION_REFRESH_S given to the apps (the default)
REDIS_MAXMEMORY_MB = 256
# An input error worded like this is a server fault reaching the user, not a verdict on the input.
SERVER_FAULT_WORDS = ("Traceback", "Something went wrong", "model failed", "Internal Server Error")
# The settings each app gets from us; inherited values of these are dropped.
APP_SETTINGS = (
    "PORT",
    "HOST",
    "DEVICE",
    "HALF_PRECISION",
    "REDIS_URL",
    "DATA_DIR",
    "DATABASE_URL",
    "ADMIN_TOKEN",
    "CACHE_PREFIX",
    "CACHE_L1_MAX_BYTES",
    "CACHE_L1_TTL_S",
    "CACHE_TTL_S",
    "CACHE_NEGATIVE_TTL_S",
    "REDIS_SOCKET_TIMEOUT_S",
    "REDIS_MAXMEMORY_MB",
    "BREAKER_FAILURE_THRESHOLD",
    "BREAKER_RESET_S",
    "GENERATION_REFRESH_S",
    "MAX_UPLOAD_BYTES",
    "MAX_IMAGE_PIXELS",
    "MAX_TEXT_CHARS",
    "LOG_RETENTION_DAYS",
    "LOG_MAX_ROWS",
    "GRADIO_TEMP_DIR",
)


# ---- sizes -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    label: str
    images: int = 40  # distinct image inputs in the load pool
    texts: int = 160  # distinct text inputs in the load pool
    threads: int = 4  # concurrent clients
    phase_s: float = 4.0  # load before and after a fault
    outage_s: float = 4.0  # Redis down
    pause_s: float = 5.0  # CLIENT PAUSE
    lock_s: float = 8.0  # SQLite held by another writer
    bumps: int = 5
    corrupt_inputs: int = 48
    malformed_images: int = 2400
    hostile_texts: int = 400
    brute_attempts: int = 60
    flight_callers: int = 200  # in one engine
    flight_http_callers: int = 200  # over HTTP, to one app
    edge_photos: int = 4  # photos behind the valid edge-case files (x14 formats)
    gradio_client_cases: int = 200  # of the malformed inputs, also sent through gradio_client
    request_timeout_s: float = 60.0
    recovery_limit_s: float = 10.0  # L2 back in use after Redis returns
    restart_between: bool = True  # restart a stopped app when more scenarios follow


FULL = Sizes("full")
QUICK = Sizes(
    "quick",
    images=16,
    texts=60,
    phase_s=2.0,
    outage_s=2.0,
    pause_s=3.0,
    lock_s=4.0,
    bumps=2,
    corrupt_inputs=24,
    malformed_images=300,
    hostile_texts=80,
    gradio_client_cases=60,
    brute_attempts=30,
)
CI = Sizes(
    "ci",
    images=8,
    texts=24,
    threads=3,
    phase_s=1.5,
    outage_s=1.5,
    pause_s=2.5,
    lock_s=3.5,
    bumps=1,
    corrupt_inputs=18,
    malformed_images=150,
    hostile_texts=50,
    brute_attempts=20,
    flight_http_callers=50,
    edge_photos=1,
    gradio_client_cases=20,
    restart_between=False,
)


# ---- processes -----------------------------------------------------------------------------


def _die_with_parent() -> None:  # in the child between fork and exec: no orphans if we crash
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class AppProcess:
    """One `python app.py` with its own port and DATA_DIR, sharing the suite's Redis."""

    def __init__(self, name: str, *, data_dir: Path, redis_url: str) -> None:
        self.name = name
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
                preexec_fn=_die_with_parent,
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


# ---- talking to the app ----------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str  # "answer" | "input_error" | "failure" | "unreachable"
    label: dict[str, Any] | None = None
    info: dict[str, Any] | None = None
    message: str | None = None
    status: int | None = None


@dataclass(frozen=True)
class ForgedPath:
    """An image "upload" that names a path on the server instead of uploading a file."""

    path: str


_TRANSPORT_ERRORS = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class RestClient:
    """Gradio's HTTP API for one replica: upload, then call, then read the event stream."""

    def __init__(self, base_url: str, *, timeout_s: float, source_ip: str | None = None) -> None:
        transport = httpx.HTTPTransport(local_address=source_ip) if source_ip else None
        self._http = httpx.Client(base_url=base_url, timeout=timeout_s, transport=transport)

    def close(self) -> None:
        self._http.close()

    def classify(self, task: str, raw: Any, name: str = "upload.png") -> Outcome:
        try:
            if task == "text":
                return self._call("classify_text", [raw])
            if isinstance(raw, ForgedPath):
                return self._call(
                    "classify_image", [{"path": raw.path, "meta": {"_type": "gradio.FileData"}}]
                )
            uploaded = self._http.post(
                "/gradio_api/upload", files={"files": (name, raw, "application/octet-stream")}
            )
            if uploaded.status_code >= 500:
                return Outcome(
                    "failure", message=f"upload: HTTP {uploaded.status_code}", status=uploaded.status_code
                )
            if uploaded.status_code != 200:  # refused at the door (e.g. 413): a clear input error
                return Outcome(
                    "input_error", message=uploaded.text.strip()[:300], status=uploaded.status_code
                )
            path = uploaded.json()[0]
            file_data = {"path": path, "meta": {"_type": "gradio.FileData"}, "orig_name": name}
            return self._call("classify_image", [file_data])
        except _TRANSPORT_ERRORS as exc:
            return Outcome("unreachable", message=f"{type(exc).__name__}: {exc}")
        except httpx.TimeoutException as exc:
            return Outcome("failure", message=f"no answer within the request timeout ({type(exc).__name__})")
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            return Outcome("failure", message=f"{type(exc).__name__}: {exc}"[:300])

    def _call(self, api: str, data: list[Any]) -> Outcome:
        # ensure_ascii: lone surrogates travel as \udXXX escapes, as a browser's JSON would send them.
        body = json.dumps({"data": data}, ensure_ascii=True).encode("ascii")
        joined = self._http.post(
            f"/gradio_api/call/{api}", content=body, headers={"content-type": "application/json"}
        )
        if 400 <= joined.status_code < 500:  # refused before queueing: the client's mistake
            return Outcome("input_error", message=joined.text.strip()[:300], status=joined.status_code)
        if joined.status_code != 200:
            return Outcome(
                "failure",
                message=f"call: HTTP {joined.status_code} {joined.text[:200]}",
                status=joined.status_code,
            )
        event_id = joined.json()["event_id"]
        stream = self._http.get(f"/gradio_api/call/{api}/{event_id}")
        if stream.status_code != 200:
            return Outcome("failure", message=f"result: HTTP {stream.status_code}", status=stream.status_code)
        return parse_events(stream.text)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return self._http.get(path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return self._http.post(path, **kwargs)


def parse_events(text: str) -> Outcome:
    """The last `complete` or `error` event of a Gradio result stream."""
    event, final = None, None
    for line in text.splitlines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:") and event in ("complete", "error"):
            final = (event, line[5:].strip())
    if final is None:
        return Outcome("failure", message=f"no result event in the stream: {text[:200]!r}")
    event, data = final
    if event == "complete":
        values = json.loads(data)
        label, info = values[0], values[1]
        if not isinstance(label, dict) or not isinstance(info, dict):
            return Outcome("failure", message=f"malformed answer: {data[:200]}")
        return Outcome("answer", label=label, info=info)
    error = json.loads(data) if data and data != "null" else None
    message = error.get("error") if isinstance(error, dict) else None
    if not isinstance(message, str) or not message.strip():
        return Outcome("failure", message=f"error without a message: {data[:200]}")
    if any(word in message for word in SERVER_FAULT_WORDS):
        return Outcome("failure", message=message[:300])
    return Outcome("input_error", message=message)


def http_json(
    client: RestClient | httpx.Client,
    method: str,
    path: str,
    *,
    token: str | None = TOKEN,
    body: dict[str, Any] | None = None,
    headers: dict[str, Any] | None = None,
) -> tuple[int, Any]:
    sent = dict(headers or {})
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    if method == "GET":
        response = client.get(path, headers=sent)
    else:
        response = client.post(
            path,
            content=json.dumps(body or {}).encode(),
            headers={**sent, "content-type": "application/json"},
        )
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, response.text


def read_metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url + "/metrics", timeout=10.0).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(
        value
        for (sample, sample_labels), value in samples.items()
        if sample in (name, name + "_total") and set(labels.items()) <= set(sample_labels)
    )


# ---- inputs and their reference answers ------------------------------------------------------


@dataclass(frozen=True)
class Expect:
    kind: str  # "answer" | "error" (this message) | "any_error" (a clear refusal) | "any" (either)
    labels: tuple[tuple[str, float], ...] = ()
    message: str | None = None
    model_s: float = 0.0  # the reference's forward time, here


@dataclass(frozen=True)
class Case:
    id: str
    task: str
    raw: Any
    expect: Expect
    name: str = "upload.png"
    group: str = ""


class Oracle:
    """Reference answers from the real models, computed the way the engine computes a miss."""

    def __init__(self, models: dict[str, Classifier]) -> None:
        self.models = models
        self.versions = {task: model.version for task, model in models.items()}
        self._lock = threading.Lock()

    def expect(self, task: str, raw: Any) -> Expect:
        model = self.models[task]
        if task == "text":
            # What the callback receives: the JSON round trip, then Textbox's str(), None as "".
            raw = json.loads(json.dumps(raw))
            raw = "" if raw is None else str(raw)
        try:
            canonical = model.canonicalize(raw)
        except InvalidInputError as exc:
            return Expect("error", message=exc.message)
        with self._lock:
            started = time.perf_counter()
            prediction = model.predict_batch([canonical])[0]
            elapsed = time.perf_counter() - started
        return Expect("answer", labels=prediction.labels, model_s=elapsed)

    def case(self, case_id: str, task: str, raw: Any, *, name: str = "upload.png", group: str = "") -> Case:
        return Case(case_id, task, raw, self.expect(task, raw), name=name, group=group)


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def image_variants(count: int, seed: int, side: int = 112) -> list[tuple[str, bytes]]:
    """Distinct small PNGs: random square crops of the bundled photos."""
    rng = random.Random(seed)
    photos = {name: Image.open(io.BytesIO(data)).convert("RGB") for name, data in load_photos().items()}
    seen: set[bytes] = set()
    out = []
    while len(out) < count:
        name = PHOTOS[len(out) % len(PHOTOS)]
        photo = photos[name]
        width, height = photo.size
        crop = rng.randint(min(width, height) // 3, min(width, height))
        x, y = rng.randint(0, width - crop), rng.randint(0, height - crop)
        data = _png(photo.crop((x, y, x + crop, y + crop)).resize((side, side)))
        if data not in seen:
            seen.add(data)
            out.append((f"{Path(name).stem}-{len(out)}.png", data))
    return out


TEXT_SUFFIXES = (
    "",
    " Thanks.",
    " Order {n}.",
    " It's urgent!",
    " (ticket #{n})",
    " Please help.",
    " Ref {n}",
    " I have been waiting {n} days.",
    " Can you check?",
    " My account is {n}.",
)


def text_variants(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    extra = (
        "My parcel never arrived",
        "How do I reset my password?",
        "I want my money back",
        "The app keeps crashing on login",
        "Do you ship to Canada?",
        "Thank you so much, bye",
    )
    stems = list(MESSAGES) + list(extra)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < count:
        text = rng.choice(stems) + rng.choice(TEXT_SUFFIXES).format(n=rng.randint(1, 99_999))
        if text.lower() not in seen:
            seen.add(text.lower())
            out.append(text)
    return out


def probe_texts() -> Iterator[str]:
    """Texts never sent before (a counter in each), for recovery probes."""
    stems = [*MESSAGES, "My parcel never arrived", "How do I reset my password?"]
    for n in range(10**9):
        yield f"{stems[n % len(stems)]} (probe {n})"


# ---- malformed inputs ------------------------------------------------------------------------


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """libtiff prints warnings for broken TIFFs straight to fd 2; keep them out of the report."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _base_images(seed: int, photos: int = 4) -> list[tuple[str, bytes]]:
    """Small valid files in every accepted format and in awkward modes."""
    rng = random.Random(seed)
    photos = load_photos(("chelsea.png", "coffee.png", "rocket.jpg", "astronaut.png")[:photos])
    out: list[tuple[str, bytes]] = []
    for index, data in enumerate(photos.values()):
        photo = Image.open(io.BytesIO(data)).convert("RGB")
        crop = photo.resize((96 + 8 * index, 80 + 8 * index))

        def save(image: Image.Image, fmt: str, **params: Any) -> bytes:
            buffer = io.BytesIO()
            image.save(buffer, fmt, **params)
            return buffer.getvalue()

        exif = Image.Exif()
        exif[0x0112] = 6  # orientation: rotate 90
        rgba = crop.convert("RGBA")
        rgba.putalpha(Image.new("L", crop.size, rng.randint(40, 255)))
        palette = crop.convert("P", palette=Image.Palette.ADAPTIVE, colors=32)
        palette.info["transparency"] = 0
        grey16 = crop.convert("I").point(lambda v: v * 256)
        frames = [crop, crop.rotate(90)]
        gif = io.BytesIO()
        frames[0].save(gif, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
        out += [
            ("png", save(crop, "PNG")),
            ("png-rgba", save(rgba, "PNG")),
            ("png-palette", save(palette, "PNG", transparency=0)),
            ("png-16bit", save(grey16.convert("I;16"), "PNG")),
            ("jpeg", save(crop, "JPEG", quality=85)),
            ("jpeg-progressive", save(crop, "JPEG", quality=80, progressive=True)),
            ("jpeg-cmyk", save(crop.convert("CMYK"), "JPEG")),
            ("jpeg-exif-rotated", save(crop, "JPEG", exif=exif)),
            ("bmp", save(crop, "BMP")),
            ("gif-animated", gif.getvalue()),
            ("webp-lossless", save(crop, "WEBP", lossless=True)),
            ("webp", save(crop, "WEBP", quality=70)),
            ("tiff", save(crop, "TIFF")),
            ("tiff-lzw", save(crop, "TIFF", compression="tiff_lzw")),
        ]
    return out


MAGICS = (
    b"\x89PNG\r\n\x1a\n",
    b"\xff\xd8\xff\xe0",
    b"GIF89a",
    b"BM",
    b"RIFF\x00\x00\x00\x00WEBP",
    b"II*\x00",
    b"MM\x00*",
    b"%PDF-1.4",
    b"PK\x03\x04",
    b"\x7fELF",
    b"<svg xmlns='http://www.w3.org/2000/svg'>",
    b"<html>",
    b"\x00\x00\x01\x00",
    b"8BPS",
    b"\x00\x00\x00\x0cjP  ",
    b"#!/bin/sh\n",
)


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_with_size(width: int, height: int, *, fix_crc: bool = True, body: bytes | None = None) -> bytes:
    """A PNG header declaring any size, with a tiny (or given) body."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = _png_chunk(b"IHDR", ihdr)
    if not fix_crc:
        chunk = chunk[:-4] + b"\0\0\0\0"
    idat = body if body is not None else zlib.compress(b"\0" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def png_bomb(side: int) -> bytes:
    """A real 1-bit PNG of `side` x `side` zeros: a few kB on disk, side^2 pixels decoded."""
    row = b"\0" + b"\0" * ((side + 7) // 8)
    compressor = zlib.compressobj(9)
    idat = b"".join(compressor.compress(row) for _ in range(side)) + compressor.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", idat)
        + _png_chunk(b"IEND", b"")
    )


# Declared sizes: every one is either over the pixel limit (refused from the header) or empty.
# (Thin images under the limit are a separate, measured case: see `thin_image_cost`.)
HUGE_SIZES = (
    (65_535, 65_535), (100_000, 100_000), (2**31 - 1, 2**31 - 1), (50_000, 50_000), (65_535, 10_000),
    (10_000, 65_535), (2**31 - 1, 1), (1, 2**31 - 1), (0, 0), (0, 500), (500, 0),
)  # fmt: skip


def _declare_huge(fmt: str, data: bytes, rng: random.Random) -> bytes | None:
    """Patch the declared dimensions of a valid file; None when the format has no simple field."""
    width, height = rng.choice(HUGE_SIZES)
    w16, h16 = min(width, 65_535), min(height, 65_535)
    if 0 < w16 * h16 <= 40_000_000:  # 16-bit fields cannot say 2**31: keep it over the limit
        w16 = h16 = 65_535
    out = bytearray(data)
    if fmt.startswith("png"):  # a new IHDR (8-bit RGB of the declared size), the original chunks after it
        return png_with_size(width, height, fix_crc=rng.random() < 0.8)[:33] + data[33:]
    if fmt.startswith("gif"):
        out[6:10] = struct.pack("<HH", w16, h16)
        return bytes(out)
    if fmt == "bmp":
        out[18:26] = struct.pack(
            "<ii", min(width, 2**31 - 1), -min(height, 2**31 - 1) if rng.random() < 0.3 else height
        )
        return bytes(out)
    if fmt.startswith("jpeg"):
        for marker in (b"\xff\xc0", b"\xff\xc2"):
            at = data.find(marker)
            if at > 0:
                out[at + 5 : at + 9] = struct.pack(">HH", h16, w16)
                return bytes(out)
    return None


def declared_size(data: bytes) -> tuple[int, int] | None:
    """Width and height from the header alone, or None when Pillow cannot even open it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data)) as image:
                return image.size
    except Exception:  # anything Pillow raises on garbage
        return None


def thin(data: bytes, max_pixels: int = 40_000_000, max_ratio: float = 20.0) -> bool:
    """Accepted by the pixel limit but far from square: costs far more than its pixels (see
    `thin_image_cost`), so random mutations that happen to produce one are left out."""
    size = declared_size(data)
    if size is None or min(size) <= 0 or size[0] * size[1] > max_pixels:
        return False
    return max(size) / min(size) > max_ratio


def mutate(fmt: str, data: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One mutation of a valid file: truncation, flipped bytes, a wrong header or a huge size."""
    kind = rng.choice(
        (
            "truncate",
            "truncate",
            "flip",
            "flip",
            "flip-header",
            "magic",
            "magic",
            "huge",
            "huge",
            "junk",
            "splice",
            "zero",
        )
    )
    out = bytearray(data)
    if kind == "truncate":
        cut = rng.choice(
            (
                1,
                2,
                7,
                8,
                16,
                33,
                64,
                len(data) // 4,
                len(data) // 2,
                len(data) - 1,
                rng.randrange(1, len(data)),
            )
        )
        return kind, bytes(out[: max(1, min(cut, len(data) - 1))])
    if kind in ("flip", "flip-header"):
        span = min(len(data), 96) if kind == "flip-header" else len(data)
        for _ in range(rng.choice((1, 1, 2, 4, 16))):
            out[rng.randrange(span)] ^= rng.randrange(1, 256)
        return kind, bytes(out)
    if kind == "magic":
        magic = rng.choice(MAGICS)
        return kind, (magic + bytes(out[len(magic) :])) if rng.random() < 0.7 else magic + bytes(out)
    if kind == "huge":
        patched = _declare_huge(fmt, data, rng)
        if patched is not None:
            return kind, patched
        kind = "junk"
    if kind == "junk":
        junk = rng.randbytes(rng.choice((1, 16, 4096)))
        return kind, (junk + data) if rng.random() < 0.5 else (data + junk)
    if kind == "splice":
        at = rng.randrange(1, len(data))
        return kind, data[:at] + rng.randbytes(rng.randint(1, 64)) + data[at:]
    return kind, bytes(len(data)) if rng.random() < 0.5 else rng.randbytes(len(data))


def hostile_texts(count: int, seed: int) -> list[tuple[str, Any]]:
    """Fixed nasty messages (empty, 1 MB, controls, lone surrogates, bidi overrides...) and random ones."""
    rng = random.Random(seed)
    fixed: list[tuple[str, Any]] = [
        ("empty", ""),
        ("spaces", "   \t\n "),
        ("nul", "\x00"),
        ("nuls", "\x00" * 500),
        ("nul-inside", "wh\x00ere is my order"),
        ("1MB", "x" * 1_000_000),
        ("1MB-rlo", "\u202e" * 1_000_000),
        ("16001", "a" * 16_001),
        ("limit", "b" * 2000),
        ("limit+1", "b" * 2001),
        ("limit-words", "refund " * 285),
        ("nfkc-expands", "\ufdfa" * 2000),
        ("nfkc-expands-short", "\ufdfa" * 40),
        ("rlo", "\u202eredro ym si erehw"),
        ("rlo-mixed", "refund \u202eplease\u202c now \u2066x\u2069"),
        ("lone-high", "\ud800"),
        ("lone-low", "hi \udfff there"),
        ("surrogates-only", "\ud800\udc00\udbff"),
        ("controls", "".join(chr(c) for c in range(32)) + "cancel my order\x7f\x85\x9f"),
        ("ansi", "\x1b[31mrefund\x1b[0m now"),
        ("zero-width", "\u200b" * 300 + "hello"),
        ("bom", "\ufeffwhere is my order"),
        ("separators", "order\u2028status\u2029please"),
        ("zalgo", "h\u0336\u0337\u0338e\u0300\u0301\u0302l\u0303\u0304p" * 20),
        ("combining-only", "\u0301" * 800),
        ("emoji-zwj", "\U0001f468\u200d\U0001f469\u200d\U0001f467" * 150),
        ("emoji", "\U0001f642" * 1999),
        ("rtl", "\u05d0\u05d9\u05e4\u05d4 \u05d4\u05d4\u05d6\u05de\u05e0\u05d4 \u05e9\u05dc\u05d9?"),
        ("arabic", "\u0623\u064a\u0646 \u0637\u0644\u0628\u064a\u061f \u200f"),
        ("private-use", "\ue000" * 50),
        ("tags", "\U000e0001\U000e0068\U000e0069 hi"),
        ("html", "<script>alert(1)</script> refund"),
        ("sql", "'; DROP TABLE request_log; --"),
        ("format", "%s%s%n {0} {{7*7}} ${x}"),
        ("cjk", "\u6211\u7684\u8ba2\u5355\u5728\u54ea\u91cc" * 10),
        ("ideographic-space", "\u3000" * 100),
        ("none", None),
        ("int", 12345),
        ("float", 3.5),
        ("bool", True),
        ("list", ["a", "b"]),
        ("dict", {"x": 1}),
    ]
    alphabet = (
        [chr(c) for c in range(32, 127)] * 3
        + [chr(c) for c in range(0, 32)]
        + ["\x7f", "\x85", "\x9f"]
        + [chr(c) for c in (0xD800, 0xDBFF, 0xDC00, 0xDFFF)]
        + list("\u202a\u202b\u202c\u202d\u202e\u2066\u2069")
        + list("\u200b\u200c\u200d\u200e\u200f\ufeff")
        + [chr(c) for c in range(0x300, 0x310)]
        + list("\u00e9\u00df\u0130\ufb01\ufdfa\u2126\u212b\uff21")
        + ["\U0001f600", "\U0001f468\u200d"]
        + ["\u4e2d", "\u05d0", "\u0627", " ", " ", "\n", "\t"]
    )
    out = list(fixed)
    while len(out) < count:
        length = rng.choice((0, 1, 3, 10, 40, 200, 1000, 1999, 2001, 5000, 16_500))
        out.append((f"random-{len(out)}", "".join(rng.choice(alphabet) for _ in range(length))))
    return out


# ---- verdicts --------------------------------------------------------------------------------


def judge(case: Case, outcome: Outcome, versions: dict[str, str]) -> tuple[str, str]:
    """("ok" | "failed" | "wrong", reason)."""
    expect = case.expect
    if outcome.kind in ("failure", "unreachable"):
        return "failed", outcome.message or outcome.kind
    if expect.kind == "answer":
        if outcome.kind != "answer":
            return "failed", f"input refused: {outcome.message}"
        return compare_answer(case, outcome, versions)
    if expect.kind == "any":  # no reference: an answer or a clear refusal are both fine
        return "ok", ""
    if outcome.kind == "answer":
        top = (outcome.label or {}).get("label")
        return "wrong", f"answered {top!r} where the engine refuses the input"
    if expect.kind == "error" and outcome.message != expect.message:
        return "wrong", f"message {outcome.message!r} instead of {expect.message!r}"
    return "ok", ""


def compare_answer(case: Case, outcome: Outcome, versions: dict[str, str]) -> tuple[str, str]:
    label, info = outcome.label or {}, outcome.info or {}
    try:
        got = {item["label"]: item["confidence"] for item in label["confidences"]}
    except (KeyError, TypeError):
        return "wrong", f"malformed label {str(label)[:120]}"
    expected = dict(case.expect.labels)
    # Within SCORE_TOLERANCE, not bit for bit; the labels may not differ.
    agree = got.keys() == expected.keys() and all(
        abs(got[name] - score) <= SCORE_TOLERANCE for name, score in expected.items()
    )
    if label.get("label") != case.expect.labels[0][0] or not agree:
        return "wrong", f"answer {label.get('label')!r} {got} differs from {expected}"
    if info.get("model_version") != versions[case.task]:
        return "wrong", f"model version {info.get('model_version')} instead of {versions[case.task]}"
    return "ok", ""


# ---- one scenario's bookkeeping ----------------------------------------------------------------


@dataclass
class Observation:
    case: Case
    replica: int
    sent_at: float  # time.monotonic()
    done_at: float
    outcome: Outcome
    retries: int
    verdict: str = "ok"
    reason: str = ""


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class ScenarioResult:
    name: str
    title: str
    sent: int = 0
    succeeded: int = 0
    failed: int = 0
    wrong: int = 0
    retried: int = 0
    recovery_s: float | None = None
    duration_s: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def checks_failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    @property
    def passed(self) -> bool:
        return self.failed == 0 and self.wrong == 0 and not self.checks_failed and self.error is None


class Run:
    """Collects one scenario's observations, figures and checks."""

    def __init__(self, ctx: Context, name: str, title: str) -> None:
        self.ctx = ctx
        self.result = ScenarioResult(name, title)
        self.observations: list[Observation] = []
        self.extra: Counter[str] = Counter()  # non-classify requests (admin calls): sent/ok/failed/wrong
        self._lock = threading.Lock()

    # -- requests
    def record(self, case: Case, replica: int, sent_at: float, outcome: Outcome, retries: int) -> Observation:
        verdict, reason = judge(case, outcome, self.ctx.oracle.versions)
        observation = Observation(case, replica, sent_at, time.monotonic(), outcome, retries, verdict, reason)
        with self._lock:
            self.observations.append(observation)
        return observation

    def send(self, case: Case, replica: int, *, failover: bool = False) -> Observation:
        router = Router(self.ctx, [replica, *([1 - replica] if failover else [])])
        try:
            sent_at = time.monotonic()
            outcome, used, retries = router.send(case)
            return self.record(case, used, sent_at, outcome, retries)
        finally:
            router.close()

    def send_many(self, cases: Sequence[Case], replicas: Sequence[int], threads: int) -> list[Observation]:
        """Every case once, spread over the replicas by `threads` concurrent clients."""
        queue = list(reversed(cases))
        lock = threading.Lock()
        done: list[Observation] = []

        def worker(index: int) -> None:
            router = Router(self.ctx, list(replicas), start=index)
            try:
                while True:
                    with lock:
                        if not queue:
                            return
                        case = queue.pop()
                    sent_at = time.monotonic()
                    outcome, used, retries = router.send(case)
                    observation = self.record(case, used, sent_at, outcome, retries)
                    with lock:
                        done.append(observation)
            finally:
                router.close()

        workers = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return done

    @contextlib.contextmanager
    def load(
        self,
        cases: Sequence[Case],
        replicas: Sequence[int],
        threads: int | None = None,
        failover: bool = True,
    ) -> Iterator[None]:
        """Concurrent clients sending random cases until the block ends."""
        stop = threading.Event()

        def worker(index: int) -> None:
            rng = random.Random(index * 7919 + len(self.observations))
            router = Router(self.ctx, list(replicas), start=index, failover=failover)
            try:
                while not stop.is_set():
                    case = rng.choice(cases)
                    sent_at = time.monotonic()
                    outcome, used, retries = router.send(case)
                    self.record(case, used, sent_at, outcome, retries)
            finally:
                router.close()

        workers = [
            threading.Thread(target=worker, args=(i,), daemon=True)
            for i in range(threads or self.ctx.sizes.threads)
        ]
        for w in workers:
            w.start()
        try:
            yield
        finally:
            stop.set()
            for w in workers:
                w.join(timeout=self.ctx.sizes.request_timeout_s * 3)

    def downgrade(self, observation: Observation, verdict: str, reason: str) -> None:
        if observation.verdict == "ok":
            observation.verdict, observation.reason = verdict, reason

    def count_extra(self, verdict: str, reason: str = "") -> None:
        self.extra["sent"] += 1
        self.extra[verdict] += 1
        if verdict != "ok" and len(self.result.problems) < 12:
            self.result.problems.append(f"{verdict}: {reason}")

    # -- figures and checks
    def figure(self, name: str, value: Any) -> None:
        self.result.figures[name] = value

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.result.checks.append(Check(name, bool(ok), detail))
        return bool(ok)

    def between(self, start: float, end: float) -> list[Observation]:
        return [o for o in self.observations if start <= o.sent_at < end]

    def finish(self) -> ScenarioResult:
        result = self.result
        result.sent = len(self.observations) + self.extra["sent"]
        result.succeeded = sum(o.verdict == "ok" for o in self.observations) + self.extra["ok"]
        result.failed = sum(o.verdict == "failed" for o in self.observations) + self.extra["failed"]
        result.wrong = sum(o.verdict == "wrong" for o in self.observations) + self.extra["wrong"]
        result.retried = sum(o.retries > 0 for o in self.observations)
        reasons = Counter(
            f"{o.verdict}: {o.case.group or o.case.task} {o.case.id}: {o.reason}"[:300]
            for o in self.observations
            if o.verdict != "ok"
        )
        for reason, count in reasons.most_common(12 - len(result.problems)):
            result.problems.append(reason + (f"  (x{count})" if count > 1 else ""))
        return result


class Router:
    """A client-side load balancer: tries the replicas in turn, moving on when one is unreachable."""

    def __init__(self, ctx: Context, replicas: list[int], *, start: int = 0, failover: bool = True) -> None:
        self.ctx = ctx
        self.replicas = replicas
        self.next = start % len(replicas)
        self.failover = failover
        self._clients: dict[int, RestClient] = {}

    def client(self, replica: int) -> RestClient:
        if replica not in self._clients:
            self._clients[replica] = RestClient(
                self.ctx.apps[replica].url, timeout_s=self.ctx.sizes.request_timeout_s
            )
        return self._clients[replica]

    def send(self, case: Case) -> tuple[Outcome, int, int]:
        first = self.next
        self.next = (self.next + 1) % len(self.replicas)
        attempts = 2 * len(self.replicas) if self.failover else 1
        outcome, replica = Outcome("failure", message="not sent"), self.replicas[first]
        for attempt in range(attempts):
            replica = self.replicas[(first + attempt) % len(self.replicas)]
            outcome = self.client(replica).classify(case.task, case.raw, case.name)
            if outcome.kind != "unreachable":
                return outcome, replica, attempt
            # A dead keep-alive connection, or the replica is down: a fresh connection next time.
            self._clients.pop(replica).close()
            time.sleep(0.05 * (attempt + 1))
        return Outcome("failure", message=f"no replica reachable: {outcome.message}"), replica, attempts - 1

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()


# ---- the shared set-up -------------------------------------------------------------------------


@dataclass
class Context:
    sizes: Sizes
    work: Path
    redis_server: EmbeddedRedis
    apps: list[AppProcess]
    oracle: Oracle
    pool: list[Case]  # the load's inputs, with references
    probes: Iterator[str]  # fresh texts, never sent before
    log: Callable[[str], None] = print
    remaining: int = 0  # scenarios still to run after the current one

    @property
    def direct(self) -> redis.Redis:
        """Our own connection to our own Redis (for faults and for looking at keys)."""
        return redis.Redis.from_url(self.redis_server.url, socket_timeout=5.0)

    def admin(self, replica: int, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        with httpx.Client(base_url=self.apps[replica].url, timeout=30.0) as client:
            status, data = http_json(client, method, path, body=body)
        if status != 200:
            raise RuntimeError(f"admin {method} {path} on {self.apps[replica].name}: {status} {data}")
        return data

    def probe_case(self) -> Case:
        return self.oracle.case(f"probe-{time.monotonic_ns()}", "text", next(self.probes), group="probe")

    def wait_l2_up(self, timeout_s: float = 20.0) -> None:
        for app in self.apps:
            if app.process is not None and app.process.poll() is None:
                app.wait_ready(timeout_s=timeout_s)

    def reset(self) -> None:
        """Between scenarios: Redis configured as at start, every cache tier empty."""
        with contextlib.closing(self.direct) as direct:
            direct.config_set("maxmemory-policy", "allkeys-lru")
            direct.config_set("maxmemory", f"{REDIS_MAXMEMORY_MB}mb")
        self.wait_l2_up()
        live = [
            i for i, app in enumerate(self.apps) if app.process is not None and app.process.poll() is None
        ]
        for n, replica in enumerate(live):
            self.admin(replica, "POST", "/admin/api/flush", {"tier": "all" if n == 0 else "l1"})

    def close(self) -> None:
        for app in self.apps:
            app.stop(grace_s=5.0)
        self.redis_server.close()


def build_context(
    sizes: Sizes,
    work: Path,
    *,
    models: dict[str, Classifier] | None = None,
    log: Callable[[str], None] = print,
) -> Context:
    """Redis, two apps and the reference answers. The apps load while we compute references."""
    if find_redis_server() is None:
        raise RuntimeError("redis-server is not installed: `apt-get install -y redis-server`")
    started = time.monotonic()
    server = EmbeddedRedis(
        data_dir=work / "redis", maxmemory_mb=REDIS_MAXMEMORY_MB, port=free_port(), save=False
    )
    server.start()
    apps = [AppProcess(name, data_dir=work / f"app-{name}", redis_url=server.url) for name in ("A", "B")]
    try:
        for app in apps:
            app.start()
        if models is None:
            from engine.runtime import load_models

            _quiet()
            models = load_models(replace(Settings.from_env({}), device="auto"))
        oracle = Oracle(dict(models))
        pool = [
            oracle.case(name, "image", data, name=name, group="pool")
            for name, data in image_variants(sizes.images, seed=1)
        ]
        pool += [
            oracle.case(f"text-{i}", "text", text, group="pool")
            for i, text in enumerate(text_variants(sizes.texts, seed=2))
        ]
        probes = probe_texts()
        for app in apps:
            app.wait_ready()
    except BaseException:
        for app in apps:
            app.kill()
        server.close()
        raise
    log(
        f"set-up: Redis {server.url}, apps A (pid {apps[0].pid}) and B (pid {apps[1].pid}) ready, "
        f"{len(pool)} reference answers, in {time.monotonic() - started:.1f}s"
    )
    return Context(sizes, work, server, apps, oracle, pool, probes, log=log)


def _quiet() -> None:
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


# ---- helpers shared by scenarios ---------------------------------------------------------------


def split(cases: Sequence[Case], fraction: float) -> tuple[list[Case], list[Case]]:
    images = [c for c in cases if c.task == "image"]
    texts = [c for c in cases if c.task == "text"]
    ni, nt = max(1, int(len(images) * fraction)), max(1, int(len(texts) * fraction))
    return images[:ni] + texts[:nt], images[ni:] + texts[nt:]


def key_of(observation: Observation) -> str | None:
    return (observation.outcome.info or {}).get("key")


def alias_key(case: Case, version: str, generation: int) -> str:
    return f"{PREFIX}:{case.task}-raw:{version}:{generation}:{raw_digest(case.raw)}"


def wait_l2_in_use(run: Run, since: float, limit_s: float) -> float | None:
    """Seconds after `since` until each replica writes a fresh answer to Redis and the other
    replica reads it from there (tier "l2"); None if that does not happen within `limit_s`."""
    ctx = run.ctx
    pending = {(0, 1), (1, 0)}
    with contextlib.closing(ctx.direct) as direct:
        while pending and time.monotonic() - since < limit_s:
            for writer, reader in sorted(pending):
                probe = ctx.probe_case()
                written = run.send(probe, writer)
                key = key_of(written)
                try:
                    stored = key is not None and bool(direct.exists(key))
                except redis.RedisError:
                    stored = False
                if stored and (run.send(probe, reader).outcome.info or {}).get("tier") == "l2":
                    pending.discard((writer, reader))
            if pending:
                time.sleep(0.1)
    return None if pending else time.monotonic() - since


def latency_ms(observation: Observation) -> float:
    return float((observation.outcome.info or {}).get("latency_ms", 0.0))


def fmt_s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}s"


def tiers(observations: Sequence[Observation]) -> dict[str, int]:
    return dict(Counter((o.outcome.info or {}).get("tier", o.outcome.kind) for o in observations))


# ---- scenarios -----------------------------------------------------------------------------------


def redis_killed(run: Run) -> None:
    """SIGKILL the Redis under load, keep it down, start it again on the same port (empty)."""
    ctx, sizes = run.ctx, run.ctx.sizes
    pids = [app.pid for app in ctx.apps]
    errors_before = sum(metric(read_metrics(app.url), "infcache_l2_errors") for app in ctx.apps)
    with run.load(ctx.pool, [0, 1]):
        time.sleep(sizes.phase_s)
        killed_at = time.monotonic()
        ctx.redis_server.kill()
        time.sleep(sizes.outage_s)
        ctx.redis_server.start()
        restarted_at = time.monotonic()
        recovery = wait_l2_in_use(run, restarted_at, sizes.recovery_limit_s)
        time.sleep(sizes.phase_s)
    during = run.between(killed_at, restarted_at)
    errors = sum(metric(read_metrics(app.url), "infcache_l2_errors") for app in ctx.apps) - errors_before
    run.result.recovery_s = recovery
    run.figure("requests while Redis was down", f"{len(during)} ({tiers(during)})")
    run.figure("slowest answer while down", fmt_s(max((o.done_at - o.sent_at for o in during), default=None)))
    run.figure("L2 errors counted by the apps", int(errors))
    run.check("requests were sent while Redis was down", len(during) > 0)
    run.check("the apps noticed (L2 errors counted)", errors > 0, f"{errors:.0f}")
    run.check(
        f"L2 written and read again within {sizes.recovery_limit_s:.0f}s of the restart",
        recovery is not None,
        f"recovery {fmt_s(recovery)}",
    )
    run.check("no app restarted", [app.pid for app in ctx.apps] == pids)


def redis_paused(run: Run) -> None:
    """CLIENT PAUSE (all commands) for longer than the socket timeout. Replica B is under load;
    on replica A one client sends new messages one after the other, so that each one's time
    end to end is the engine's and not a wait in Gradio's queue behind other requests."""
    ctx, sizes = run.ctx, run.ctx.sizes
    warm, _ = split(ctx.pool, 0.5)
    run.send_many(warm, [0, 1], sizes.threads)

    def model_seconds() -> float:
        return metric(read_metrics(ctx.apps[0].url), "infcache_model_seconds", task="text")

    def timed_send() -> tuple[Observation, float]:
        """A new message to A, and its time outside the model: on a busy CPU the forward pass
        alone varies by hundreds of milliseconds, which is not what this scenario measures.
        A serves nobody else, so the change in its model seconds is this request's."""
        before = model_seconds()
        observation = run.send(ctx.probe_case(), 0)
        return observation, (observation.done_at - observation.sent_at) - (model_seconds() - before)

    # What a new message costs on A outside the model when Redis answers (HTTP, Gradio's
    # queue, the machine's noise): the slowest of 8 before the pause and 8 after it.
    baseline = [timed_send() for _ in range(8)]
    timed: list[tuple[Observation, float]] = []
    with run.load(ctx.pool, [1]):
        time.sleep(sizes.phase_s)
        with contextlib.closing(ctx.direct) as direct:
            direct.execute_command("CLIENT", "PAUSE", str(int(sizes.pause_s * 1000)), "ALL")
        paused_at = time.monotonic()
        while time.monotonic() < paused_at + sizes.pause_s - 0.3:
            timed.append(timed_send())
        time.sleep(max(0.0, paused_at + sizes.pause_s - time.monotonic()) + sizes.phase_s)
        baseline += [timed_send() for _ in range(8)]
    base_s = max(outside for _, outside in baseline)
    # The promise: at most one socket timeout on top of what a request costs anyway.
    bound_s = SOCKET_TIMEOUT_S + base_s + 0.15
    for o, outside in timed:
        if outside > bound_s:
            run.downgrade(
                o,
                "failed",
                f"{outside:.2f}s outside the model during the pause ({o.done_at - o.sent_at:.2f}s end to "
                f"end, engine {latency_ms(o) / 1000:.2f}s): more than one socket timeout "
                f"({SOCKET_TIMEOUT_S}s) over the {base_s:.2f}s it takes with Redis answering",
            )
    # Under load (B), requests also queue behind each other; in the engine each one must
    # still stay within one timeout plus the model (3x its reference time on a busy CPU).
    during = [o for o in run.between(paused_at, paused_at + sizes.pause_s) if o.replica == 1]
    worst_engine, worst_wall = 0.0, 0.0
    for o in during:
        engine_bound_s = SOCKET_TIMEOUT_S + 3 * o.case.expect.model_s + 1.0
        engine_s = latency_ms(o) / 1000.0
        worst_engine, worst_wall = max(worst_engine, engine_s), max(worst_wall, o.done_at - o.sent_at)
        if engine_s > engine_bound_s:
            run.downgrade(o, "failed", f"{engine_s:.2f}s in the engine during the pause")
    slow = [outside for _, outside in timed]
    over = [f"{t:.2f}s" for t in slow if t > bound_s]
    run.figure("pause", f"{sizes.pause_s:.1f}s (socket timeout {SOCKET_TIMEOUT_S}s)")
    run.figure(
        "A, one client, new messages, time outside the model: usual / bound",
        f"{base_s:.3f}s / {bound_s:.3f}s",
    )
    run.figure(
        "A during the pause",
        f"{len(timed)} requests, slowest {max(slow, default=0):.3f}s outside the model, "
        f"{len(over)} over the bound" + (f" ({', '.join(over)})" if over else ""),
    )
    run.figure("B under load during the pause", f"{len(during)} ({tiers(during)})")
    run.figure("B slowest: engine / end to end", f"{worst_engine:.3f}s / {worst_wall:.3f}s")
    run.check("requests were sent during the pause", len(timed) > 0 and len(during) > 0)
    run.check("no request waited for the pause to end", worst_wall < sizes.pause_s, f"{worst_wall:.2f}s")
    recovery = wait_l2_in_use(run, time.monotonic(), sizes.recovery_limit_s)
    run.result.recovery_s = recovery
    run.check("L2 in use again after the pause", recovery is not None, fmt_s(recovery))


def redis_connections_dropped(run: Run) -> None:
    """CLIENT KILL every normal connection (as a proxy or a failover would), repeatedly, under load."""
    ctx, sizes = run.ctx, run.ctx.sizes
    killed = 0
    with run.load(ctx.pool, [0, 1]):
        time.sleep(sizes.phase_s / 2)
        with contextlib.closing(ctx.direct) as direct:
            for _ in range(5):
                # SKIPME yes: our own connection survives to send the next kill.
                killed += int(direct.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"))
                time.sleep(sizes.phase_s / 5)
        time.sleep(sizes.phase_s / 2)
    recovery = wait_l2_in_use(run, time.monotonic(), sizes.recovery_limit_s)
    run.figure("connections killed", killed)
    run.figure("answers by tier", tiers(run.observations))
    run.check("connections were killed", killed > 0, str(killed))
    run.check("L2 in use afterwards", recovery is not None, fmt_s(recovery))


def redis_noeviction(run: Run) -> None:
    """Redis over `maxmemory` with `noeviction`: every write refused (OOM), reads still served."""
    ctx, sizes = run.ctx, run.ctx.sizes
    warm, fresh = split(ctx.pool, 0.5)
    run.send_many(warm, [0], sizes.threads)  # into L2
    with contextlib.closing(ctx.direct) as direct:
        direct.config_set("maxmemory-policy", "noeviction")
        direct.config_set("maxmemory", "1")  # far below what is used: no write fits
        try:
            direct.set(f"{PREFIX}-faults:probe", b"x")
            refused = "write accepted"
        except redis.ResponseError as exc:  # redis-py turns "-OOM ..." into OutOfMemoryError
            refused = f"{type(exc).__name__}: {exc}"
    for replica in (0, 1):
        ctx.admin(replica, "POST", "/admin/api/flush", {"tier": "l1"})  # reads must go to Redis
    before = [read_metrics(app.url) for app in ctx.apps]
    started = time.monotonic()
    with run.load(warm + fresh, [0, 1]):
        time.sleep(2 * sizes.phase_s)
    during = run.between(started, time.monotonic())
    after = [read_metrics(app.url) for app in ctx.apps]
    errors = sum(
        metric(a, "infcache_l2_errors") - metric(b, "infcache_l2_errors")
        for a, b in zip(after, before, strict=True)
    )
    l2_reads = sum((o.outcome.info or {}).get("tier") == "l2" for o in during)
    computed = sum((o.outcome.info or {}).get("tier") == "miss" for o in during)
    with contextlib.closing(ctx.direct) as direct:
        direct.config_set("maxmemory", f"{REDIS_MAXMEMORY_MB}mb")
        direct.config_set("maxmemory-policy", "allkeys-lru")
    recovery = wait_l2_in_use(run, time.monotonic(), sizes.recovery_limit_s)
    run.figure("a write to the full Redis", refused)
    run.figure("answers during the fault", f"{len(during)} ({tiers(during)})")
    run.figure("write errors counted (infcache_l2_errors)", int(errors))
    run.check("Redis refused writes", refused.startswith("OutOfMemoryError"), refused)
    run.check("reads continued: answers served from L2 during the fault", l2_reads > 0, str(l2_reads))
    run.check("new inputs answered by the model", computed > 0, str(computed))
    run.check("write errors counted", errors > 0, f"{errors:.0f}")
    run.check("writes resume once memory is back", recovery is not None, fmt_s(recovery))


class _Tripwire:
    """Unpickling this creates a file: proof that a value went through pickle."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.path, "w"))


def unpack_value(valid: bytes) -> tuple[dict[str, Any], bytes]:
    """A stored value's msgpack map, and whatever follows it (a checksum, in the current format)."""
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(valid)
    doc = next(unpacker)
    return doc, valid[unpacker.tell() :]


def _flip(value: bytes, at: int, mask: int) -> bytes:
    return value[:at] + bytes([value[at] ^ mask]) + value[at + 1 :]


def bit_rot(valid: bytes, kind: str) -> list[tuple[str, bytes]]:
    """One flipped bit that leaves the msgpack well-formed: what a bad disk, a bad DIMM or a
    buggy proxy does to the stored bytes. Only a checksum can tell these from the real thing."""
    doc, _ = unpack_value(valid)
    out = []
    if kind == "result":
        label, score = doc["p"][0]
        at = valid.find(label.encode())
        if at >= 0:  # one bit of the top label's first letter (ASCII stays ASCII)
            out.append(("one bit of the top label", _flip(valid, at, 0x01)))
        packed = b"\xcb" + struct.pack(">d", score)
        at = valid.find(packed)
        if at >= 0:  # the last bit of the top score's mantissa
            out.append(("one bit of the top score", _flip(valid, at + len(packed) - 1, 0x01)))
    else:
        digest = doc["d"]
        digit = next((i for i, c in enumerate(digest) if c.isdigit()), None)
        at = valid.find(digest.encode())
        if digit is not None and at >= 0:  # a digit of the digest becomes another digit
            out.append(("one bit of the alias digest", _flip(valid, at + digit, 0x01)))
    return out


def corruptions(
    valid: bytes, kind: str, rng: random.Random, tripwire: Path, neighbour: bytes | None
) -> list[tuple[str, bytes]]:
    """Values a cache key must never serve: damaged copies of its value, the value of another
    live key of the same kind (`neighbour`), and values in foreign formats."""
    flipped = bytearray(valid)
    flipped[rng.randrange(len(flipped))] ^= rng.randrange(1, 256)
    doc, tail = unpack_value(valid)
    foreign = dict(doc, s=doc["s"].rsplit("/", 1)[0] + "/2")
    other_kind = (
        {"s": ALIAS_SCHEMA, "d": "0" * 32}
        if kind == "result"
        else {"s": RESULT_SCHEMA, "p": [["tabby", 0.9]], "v": "x", "t": 1.0}
    )
    wrong_types = {**doc, "t": "yesterday"} if kind == "result" else {**doc, "d": "../../etc"}

    def framed(document: Any) -> bytes:  # in the store's framing, with the original trailer
        return msgpack.packb(document, use_bin_type=True) + tail

    moved = [("another live key's value", neighbour)] if neighbour is not None and neighbour != valid else []
    return [
        *bit_rot(valid, kind),
        *moved,
        ("random byte flipped", bytes(flipped)),
        ("truncated", valid[: rng.randrange(1, len(valid))]),
        ("random bytes", rng.randbytes(rng.randint(1, 200))),
        ("empty", b""),
        ("pickle", pickle.dumps(_Tripwire(str(tripwire)))),
        ("json", json.dumps(doc).encode()),
        ("next schema version", framed(foreign)),
        ("other kind of entry", framed(other_kind)),
        ("a list", framed([doc.get("s"), 1, 2])),
        ("fields of the wrong type", framed(wrong_types)),
    ]


def corrupt_values(run: Run) -> None:
    """Damaged and foreign values written under live keys (results and raw-input aliases)."""
    ctx = run.ctx
    images = [c for c in ctx.pool if c.task == "image"]
    texts = [c for c in ctx.pool if c.task == "text"]
    per_task = max(2, ctx.sizes.corrupt_inputs // 2)
    cases = images[:per_task] + texts[:per_task]
    tripwire = ctx.work / "unpickled-tripwire"
    rng = random.Random(5)
    warmed = {o.case.id: o for o in run.send_many(cases, [0], 2)}
    planted: list[tuple[Case, str, str, str, bytes]] = []  # case, key kind, key, corruption, value
    seen: Counter[str] = Counter()
    previous: dict[str, bytes] = {}  # the last valid value of each kind of key
    with contextlib.closing(ctx.direct) as direct:
        for index, case in enumerate(cases):
            observation = warmed[case.id]
            if observation.verdict != "ok":
                continue
            generation = int(observation.outcome.info["generation"])  # type: ignore[index]
            # Only uploads have their raw-input alias in Redis (text aliases stay in process).
            kind = "alias" if case.task == "image" and index % 2 == 0 else "result"
            key = (
                key_of(observation)
                if kind == "result"
                else alias_key(case, ctx.oracle.versions[case.task], generation)
            )
            valid = direct.get(key) if key else None
            if valid is None:
                run.check(f"{case.id}: its {kind} key is in Redis", False, str(key))
                continue
            options = corruptions(valid, kind, rng, tripwire, previous.get(kind))
            previous[kind] = valid
            name, value = options[seen[kind] % len(options)]  # each kind of key cycles through its list
            seen[kind] += 1
            direct.set(key, value, ex=3600)
            planted.append((case, kind, key, name, value))
    for replica in (0, 1):
        ctx.admin(replica, "POST", "/admin/api/flush", {"tier": "l1"})
    before = [read_metrics(app.url) for app in ctx.apps]
    served: list[str] = []
    left: list[str] = []
    with contextlib.closing(ctx.direct) as direct:
        for index, (case, kind, key, name, value) in enumerate(planted):
            observation = run.send(case, index % 2)
            tier = (observation.outcome.info or {}).get("tier")
            if kind == "result" and key_of(observation) == key and tier == "l2":
                served.append(f"{case.id} ({name})")
            if observation.verdict != "ok":
                observation.reason = f"{kind} key planted with {name}: {observation.reason}"
            if direct.get(key) == value:
                left.append(f"{case.id} {kind} ({name})")
    after = [read_metrics(app.url) for app in ctx.apps]
    detected = sum(
        metric(a, "infcache_l2_corrupt_values") - metric(b, "infcache_l2_corrupt_values")
        for a, b in zip(after, before, strict=True)
    )
    by_kind = Counter(name for _, _, _, name, _ in planted)
    run.figure("values planted", f"{len(planted)} ({dict(by_kind)})")
    run.figure("detected and deleted by the apps", int(detected))
    run.figure("planted result values served as cache hits", len(served))
    run.check("every planted value was planted", len(planted) == len(cases), f"{len(planted)}/{len(cases)}")
    run.check("nothing was unpickled", not tripwire.exists())
    run.check("no planted result value was served", not served, ", ".join(served[:6]))
    run.check("no planted value left in place", not left, ", ".join(left[:6]))


def single_flight(run: Run) -> None:
    """200 concurrent requests for one new input: in one engine (threads), then over HTTP."""
    ctx, callers = run.ctx, run.ctx.sizes.flight_callers
    from engine.runtime import build_runtime

    settings = replace(
        Settings.from_env({}),
        data_dir=ctx.work / "single-flight",
        redis_url=ctx.redis_server.url,
        cache_prefix=f"{PREFIX}-flight",
        admin_token=TOKEN,
    )
    images = image_variants(ctx.sizes.images + 4, seed=1)[-4:]  # never sent before
    fresh = [
        ctx.oracle.case("flight-image", "image", images[0][1], group="flight"),
        ctx.oracle.case("flight-text", "text", next(ctx.probes), group="flight"),
        ctx.oracle.case("flight-http-image", "image", images[1][1], group="flight-http"),
        ctx.oracle.case("flight-http-text", "text", next(ctx.probes), group="flight-http"),
    ]
    with build_runtime(settings, models=ctx.oracle.models) as runtime:
        engine = runtime.engine
        for case in fresh[:2]:
            before = engine.counters().model_calls[case.task]
            barrier = threading.Barrier(callers)
            found: list[Any] = [None] * callers

            def call(
                i: int, case: Case = case, barrier: threading.Barrier = barrier, found: list = found
            ) -> None:
                barrier.wait()
                try:
                    found[i] = engine.classify(case.task, case.raw)
                except Exception as exc:  # reported as a failed request below
                    found[i] = exc

            threads = [threading.Thread(target=call, args=(i,)) for i in range(callers)]
            sent_at = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            calls = engine.counters().model_calls[case.task] - before
            took = time.monotonic() - sent_at
            for result in found:
                if isinstance(result, Exception) or result is None:
                    outcome = Outcome("failure", message=repr(result))
                else:
                    labels = result.prediction.labels
                    label = {
                        "label": result.prediction.top_label,
                        "confidences": [{"label": n, "confidence": s} for n, s in labels],
                    }
                    outcome = Outcome("answer", label=label, info=result.cache_info())
                run.record(case, -1, sent_at, outcome, 0)
            mix = tiers([o for o in run.observations if o.case is case])
            run.figure(
                f"in-process {case.task}: {callers} callers", f"{calls} model call, {mix}, {took:.1f}s"
            )
            run.check(f"in-process {case.task}: one model call", calls == 1, str(calls))
    callers = ctx.sizes.flight_http_callers
    for case in fresh[2:]:
        before = metric(read_metrics(ctx.apps[0].url), "infcache_model_calls", task=case.task)
        barrier = threading.Barrier(callers)
        started = time.monotonic()

        def http_call(case: Case = case, barrier: threading.Barrier = barrier) -> None:
            client = RestClient(ctx.apps[0].url, timeout_s=ctx.sizes.request_timeout_s)
            try:
                barrier.wait()
                sent_at = time.monotonic()
                run.record(case, 0, sent_at, client.classify(case.task, case.raw, "flight.png"), 0)
            finally:
                client.close()

        threads = [threading.Thread(target=http_call) for _ in range(callers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        calls = metric(read_metrics(ctx.apps[0].url), "infcache_model_calls", task=case.task) - before
        mix = tiers([o for o in run.observations if o.case is case])
        run.figure(
            f"over HTTP {case.task}: {callers} callers",
            f"{calls:.0f} model call, {mix}, {time.monotonic() - started:.1f}s",
        )
        run.check(f"over HTTP {case.task}: one model call", calls == 1, f"{calls:.0f}")


def app_killed(run: Run) -> None:
    """SIGKILL app A under load; B takes the traffic; A restarts and answers from L2."""
    ctx, sizes = run.ctx, run.ctx.sizes
    warm = ctx.pool
    run.send_many(warm, [0, 1], sizes.threads)  # every input now in L2
    a = ctx.apps[0]
    with run.load(warm, [0, 1], threads=max(2, sizes.threads // 2)):
        time.sleep(sizes.phase_s)
        killed_at = time.monotonic()
        a.kill()
        a.start()
        a.wait_ready()
        ready_at = time.monotonic()
        time.sleep(sizes.phase_s)
    # Only inputs already in L2 were sent, so the new process must never have run its model.
    first_from_new: dict[str, Observation] = {}
    for o in sorted(run.observations, key=lambda o: o.done_at):
        # After the kill, whatever A answered was answered by the new process.
        answered = o.outcome.kind != "unreachable"
        if o.replica == 0 and o.sent_at >= killed_at and answered and o.case.id not in first_from_new:
            first_from_new[o.case.id] = o
    for case in warm:
        if case.id not in first_from_new:
            first_from_new[case.id] = run.send(case, 0)
    new_tiers = Counter((o.outcome.info or {}).get("tier", o.outcome.kind) for o in first_from_new.values())
    model_calls = metric(read_metrics(a.url), "infcache_model_calls")
    run.result.recovery_s = ready_at - killed_at
    down = run.between(killed_at, ready_at)
    run.figure("replacement ready after", fmt_s(ready_at - killed_at))
    run.figure("requests while A was down", f"{len(down)}, {sum(o.retries > 0 for o in down)} retried on B")
    run.figure("first answer of each input from the new A", dict(new_tiers))
    run.figure("model calls in the new A", int(model_calls))
    run.check(
        "the new process answered every input from L2 (or L1 after it)",
        set(new_tiers) <= {"l2", "l1", "coalesced"} and new_tiers["l2"] > 0,
        str(dict(new_tiers)),
    )
    run.check("the new process never ran its model", model_calls == 0, f"{model_calls:.0f}")


def version_bump(run: Run) -> None:
    """Bump the cache generation through A's admin API while A and B both serve traffic."""
    ctx, sizes = run.ctx, run.ctx.sizes
    acks: list[tuple[float, int, float]] = []  # (acknowledged at, generation, seconds the call took)
    with run.load(ctx.pool, [0, 1]):
        for _ in range(sizes.bumps):
            time.sleep(sizes.phase_s)
            asked = time.monotonic()
            answer = ctx.admin(0, "POST", "/admin/api/bump-version", {"note": "faults suite"})
            acked = time.monotonic()
            run.check(f"bump to {answer.get('generation')} acknowledged", bool(answer.get("ok")), str(answer))
            acks.append((acked, int(answer["generation"]), acked - asked))
        time.sleep(sizes.phase_s)
    stale = 0
    for o in run.observations:
        floor = max((g for at, g, _ in acks if at <= o.sent_at), default=None)
        generation = (o.outcome.info or {}).get("generation")
        if floor is not None and o.outcome.kind == "answer" and (generation is None or generation < floor):
            stale += 1
            run.downgrade(
                o,
                "wrong",
                f"generation {generation} in a request sent after generation {floor} "
                f"was acknowledged (replica {ctx.apps[o.replica].name})",
            )
    after = [o for o in run.observations if acks and o.sent_at >= acks[0][0]]
    generations = [httpx.get(app.url + "/readyz", timeout=5).json()["generation"] for app in ctx.apps]
    run.figure("bumps", ", ".join(f"-> {g} in {took:.2f}s" for _, g, took in acks))
    run.figure("answers after the first acknowledgement", f"{len(after)} on A and B")
    run.figure("answers with an older generation after an acknowledgement", stale)
    run.check("both replicas on the last generation", generations == [acks[-1][1]] * 2, str(generations))
    run.check(
        "a bump waits for the replicas (>= 2 refresh periods)",
        all(took >= 2 * REFRESH_S for _, _, took in acks),
    )


def log_locked(run: Run) -> None:
    """Another writer holds A's SQLite request log (BEGIN EXCLUSIVE) for seconds, under load on A."""
    ctx, sizes = run.ctx, run.ctx.sizes
    a = ctx.apps[0]
    base = ctx.admin(0, "GET", "/admin/api/stats?window=5m")["log_writer"]
    blocker = sqlite3.connect(a.sqlite_path, timeout=10.0)
    with run.load(ctx.pool, [0], failover=False):
        time.sleep(sizes.phase_s / 2)
        blocker.execute("BEGIN EXCLUSIVE")
        locked_at = time.monotonic()
        time.sleep(sizes.lock_s)
        blocker.rollback()
        released_at = time.monotonic()
        time.sleep(sizes.phase_s / 2)
    blocker.close()
    sent_to_a = sum(1 for o in run.observations if o.replica == 0 and o.outcome.kind != "unreachable")
    deadline, stats = time.monotonic() + 60, base
    while time.monotonic() < deadline:
        stats = ctx.admin(0, "GET", "/admin/api/stats?window=5m")["log_writer"]
        accounted = stats["written"] - base["written"] + stats["dropped"] - base["dropped"]
        if stats["queued"] == 0 and accounted >= sent_to_a:
            break
        time.sleep(0.5)
    written = stats["written"] - base["written"]
    dropped = stats["dropped"] - base["dropped"]
    during = run.between(locked_at, released_at)
    worst = max((o.done_at - o.sent_at for o in during), default=0.0)
    worst_engine = max((latency_ms(o) / 1000 for o in during), default=0.0)
    for o in during:
        if latency_ms(o) / 1000 > 1.5:
            run.downgrade(
                o, "failed", f"took {latency_ms(o) / 1000:.2f}s in the engine while the log was locked"
            )
    run.figure("lock held", f"{released_at - locked_at:.1f}s")
    run.figure(
        "requests while locked",
        f"{len(during)} (slowest {worst:.2f}s end to end, {worst_engine:.3f}s engine)",
    )
    run.figure("log rows: requests / written / dropped", f"{sent_to_a} / {written} / {dropped}")
    run.figure("failed write attempts (retried)", stats["failed_batches"] - base["failed_batches"])
    run.check("requests were served while the log was locked", len(during) > 0)
    run.check("the writer met the lock", stats["failed_batches"] > base["failed_batches"])
    run.check(
        "every request's row written or counted as dropped",
        written + dropped == sent_to_a,
        f"{written} + {dropped} vs {sent_to_a}",
    )


def malformed_cases(ctx: Context) -> list[Case]:
    """Mutated images, awkward valid ones, huge ones, forged paths and hostile texts, with references."""
    sizes = ctx.sizes
    rng = random.Random(11)
    bases = _base_images(seed=12, photos=sizes.edge_photos)
    cases: list[Case] = []
    seen: set[bytes] = set()
    for fmt, data in bases:
        cases.append(
            ctx.oracle.case(
                f"valid-{fmt}-{len(cases)}", "image", data, name=f"x.{fmt[:4]}", group="valid edge"
            )
        )
    while sum(c.group.startswith("mutated") for c in cases) < sizes.malformed_images:
        fmt, data = rng.choice(bases)
        kind, mutated = mutate(fmt, data, rng)
        if mutated in seen or thin(mutated):
            continue
        seen.add(mutated)
        cases.append(
            ctx.oracle.case(
                f"{fmt}-{kind}-{len(cases)}",
                "image",
                mutated,
                name=rng.choice(("photo.png", "photo.jpg", "x", "a.gif", "..png")),
                group=f"mutated {kind}",
            )
        )
    specials = [
        ("bomb-400MP", png_bomb(20_000)),
        ("declared-100000x100000", png_with_size(100_000, 100_000)),
        ("declared-zero", png_with_size(0, 0)),
        ("over-upload-limit", _png(Image.new("RGB", (8, 8))) + bytes(21 * 2**20)),
    ]
    if sizes.label != "ci":
        specials.append(("bomb-36MP-valid", png_bomb(6_000)))
    for name, data in specials:
        cases.append(ctx.oracle.case(f"special-{name}", "image", data, name="big.png", group="special"))
    cases.append(
        Case(
            "special-over-gradio-limit",
            "image",
            bytes(41 * 2**20),
            Expect("any_error"),
            "huge.png",
            "special",
        )
    )
    # An "upload" that names a file on the server instead: never read it, refuse clearly.
    # (The photo outside every folder Gradio allows is added by the scenario itself.)
    for name, path in (
        (
            "server-photo",
            str(Path(__file__).resolve().parent.parent / "docs" / "console.png"),
        ),  # under the working directory
        ("example-photo", str(photo_dir() / "rocket.jpg")),  # one the app offers as an example
        ("system-file", "/etc/hostname"),
        ("missing", "/nonexistent/x.png"),
        ("directory", tempfile.gettempdir()),
    ):
        cases.append(
            Case(f"forged-{name}", "image", ForgedPath(path), Expect("any_error"), group="forged path")
        )
    for name, text in hostile_texts(sizes.hostile_texts, seed=13):
        cases.append(ctx.oracle.case(f"text-{name}", "text", text, group="hostile text"))
    return cases


def malformed_inputs(run: Run) -> None:
    """Mutated images and hostile texts: each gets its answer or the engine's clear message."""
    ctx, sizes = run.ctx, run.ctx.sizes
    prepared = time.monotonic()
    with quiet_stderr(), warnings.catch_warnings():  # libtiff's and Pillow's complaints about broken files
        warnings.simplefilter("ignore")
        cases = malformed_cases(ctx)
    prepared = time.monotonic() - prepared
    repeats = [c for c in cases if c.expect.kind == "error"][:50]  # the remembered rejection answers these
    # A photo that was never uploaded, outside the working directory, the temp directory and
    # the apps' upload folders: by Gradio's rules for inputs only the upload folder may be read.
    # (Those rules never run for an app mounted with gr.mount_gradio_app: Blocks.has_launched
    # stays false, so processing_utils._check_allowed returns at once.)
    outside = Path(
        tempfile.mkdtemp(prefix="infcache-faults-", dir="/var/tmp" if Path("/var/tmp").is_dir() else None)
    )
    try:
        photo = outside / "never-uploaded.png"
        photo.write_bytes(load_photos(("coffee.png",))["coffee.png"])
        forged = Case(
            "forged-outside", "image", ForgedPath(str(photo)), Expect("any_error"), group="forged path"
        )
        cases.append(forged)
        started = time.monotonic()
        run.send_many(cases + repeats, [0, 1], sizes.threads)
        # The official client too: an input error must surface as AppError with the message, nothing else.
        picked = [
            c for c in cases if c.group.startswith(("mutated", "hostile", "valid")) and encodable(c.raw)
        ]
        step = max(1, len(picked) // max(1, sizes.gradio_client_cases))
        via_gradio_client(run, picked[::step][: sizes.gradio_client_cases], replica=1)
        elapsed = time.monotonic() - started
    finally:
        shutil.rmtree(outside, ignore_errors=True)
    groups: dict[str, Counter[str]] = {}
    for o in run.observations:
        group = o.case.group
        if "mutated " in group:  # one line for all mutations (they are counted by kind below)
            group = group[: group.index("mutated") + len("mutated")]
        outcome = "answered" if o.outcome.kind == "answer" else "refused"
        groups.setdefault(group, Counter())[outcome if o.verdict == "ok" else o.verdict] += 1
    mutated = sum(c.group.startswith("mutated") for c in cases)
    for o in run.observations:
        if o.case.group == "forged path":
            said = o.outcome.message or (o.outcome.label or {}).get("label")
            run.figure(f"  {o.case.id} ({o.case.raw.path})", f"{o.outcome.kind}: {str(said)[:90]}")
    run.figure(
        "inputs",
        f"{len(cases)} ({mutated} mutated images, {sizes.hostile_texts} hostile texts) "
        f"+ {len(repeats)} repeats; references {prepared:.0f}s, requests {elapsed:.0f}s",
    )
    for group, counts in groups.items():
        run.figure(f"  {group}", dict(counts))
    run.figure(
        "mutations", dict(Counter(c.group.split()[-1] for c in cases if c.group.startswith("mutated")))
    )
    slowest = sorted(run.observations, key=lambda o: o.sent_at - o.done_at)[:3]
    run.figure(
        "slowest",
        ", ".join(
            f"{o.done_at - o.sent_at:.2f}s ({o.case.id} on {ctx.apps[o.replica].name}, "
            f"{o.sent_at - started:.0f}s in)"
            for o in slowest
        ),
    )
    run.check(f"at least {sizes.malformed_images} mutated images", mutated >= sizes.malformed_images)
    thin_image_cost(run)


def peak_rss_mb(pid: int | None) -> float | None:
    """The process's peak resident memory (VmHWM), after resetting it to the current size."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        return next(int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return None


def reset_peak_rss(pid: int | None) -> bool:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # Linux: reset VmHWM to the current RSS
        return True
    except OSError:
        return False


def thin_image_cost(run: Run) -> None:
    """A few hundred bytes of PNG, 20000 x 5 pixels: far under the pixel limit, but resizing its
    short side to 256 makes it 1,024,000 x 256. Compared with a square image of as many pixels,
    on the same replica, one after the other: the memory each request adds to the app's peak
    (VmHWM, reset before each) and its time. An upload's cost must follow its pixel count."""
    ctx = run.ctx
    pid = ctx.apps[0].pid
    colour = (90, 140, 200)
    measured = {}
    for name, size in (("square", (316, 316)), ("thin", (20_000, 5))):
        case = Case(f"{name}-{size[0]}x{size[1]}", "image", _png(Image.new("RGB", size, colour)),
                    Expect("any"), f"{name}.png", "pixel cost")  # fmt: skip
        rss_before = peak_rss_mb(pid) if reset_peak_rss(pid) else None
        observation = run.send(case, 0)
        rss_after = peak_rss_mb(pid)
        grown = None if rss_before is None or rss_after is None else rss_after - rss_before
        measured[name] = (case, observation, observation.done_at - observation.sent_at, grown)
    (_, square_o, square_s, square_mb), (thin_case, thin_o, thin_s, thin_mb) = measured.values()
    if thin_mb is not None and square_mb is not None:
        bound, ok = f"{max(4 * square_mb, 100):.0f} MB", thin_mb <= max(4 * square_mb, 100)
        detail = (
            f"peak memory +{max(0.0, thin_mb):.0f} MB vs +{max(0.0, square_mb):.0f} MB, "
            f"{thin_s:.1f}s vs {square_s:.2f}s"
        )
    else:  # no /proc: time only
        bound, ok = f"{max(10 * square_s, 1.0):.1f}s", thin_s <= max(10 * square_s, 1.0)
        detail = f"{thin_s:.1f}s vs {square_s:.2f}s"
    if not ok:
        run.downgrade(thin_o, "failed", f"a {len(thin_case.raw)}-byte 20000x5 PNG: {detail}")
    run.figure(
        "pixel cost, 316x316 vs 20000x5 (as many pixels)",
        f"{square_o.outcome.kind} in {square_s:.2f}s, peak memory +{max(0.0, square_mb or 0):.0f} MB / "
        f"{thin_o.outcome.kind} in {thin_s:.2f}s, peak memory +{max(0.0, thin_mb or 0):.0f} MB "
        f"({len(thin_case.raw)} bytes uploaded)",
    )
    run.check(f"a thin image costs about what a square one of as many pixels costs (<= {bound})", ok, detail)


def encodable(raw: Any) -> bool:
    """gradio_client sends UTF-8 JSON: it cannot carry lone surrogates (it fails before sending)."""
    if isinstance(raw, bytes):
        return True  # a file to upload
    try:
        json.dumps(raw, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, TypeError):
        return False
    return True


def via_gradio_client(run: Run, cases: Sequence[Case], replica: int) -> None:
    from gradio_client import Client, handle_file
    from gradio_client.exceptions import AppError

    folder = run.ctx.work / "gradio-client-uploads"
    folder.mkdir(exist_ok=True)
    client = Client(run.ctx.apps[replica].url + "/", verbose=False)
    try:
        for index, case in enumerate(cases):
            case = replace(case, group=f"gradio_client {case.group}")
            sent_at = time.monotonic()
            try:
                if case.task == "text":
                    label, info = client.predict(case.raw, api_name="/classify_text")
                else:
                    path = folder / f"{index}-{case.name}"
                    path.write_bytes(case.raw)
                    label, info = client.predict(handle_file(str(path)), api_name="/classify_image")
                outcome = Outcome("answer", label=label, info=info)
            except AppError as exc:
                message = str(exc)
                faulty = not message or any(word in message for word in SERVER_FAULT_WORDS)
                outcome = Outcome("failure" if faulty else "input_error", message=message)
            except Exception as exc:  # anything but AppError is not a clear input error
                outcome = Outcome("failure", message=f"{type(exc).__name__}: {exc}"[:300])
            run.record(case, replica, sent_at, outcome, 0)
    finally:
        client.close()


def admin_bruteforce(run: Run) -> None:
    """Wrong admin tokens from one client (127.0.0.2): all refused, locked out, nothing changed."""
    ctx, sizes = run.ctx, run.ctx.sizes
    a = ctx.apps[0]
    cached = ctx.probe_case()
    run.send(cached, 0)
    run.send(cached, 0)

    def state() -> dict[str, Any]:
        with contextlib.closing(ctx.direct) as direct:
            keys = sum(1 for _ in direct.scan_iter(match=f"{PREFIX}:*", count=500))
        with contextlib.closing(sqlite3.connect(f"file:{a.sqlite_path}?mode=ro", uri=True)) as db:
            audit = db.execute("SELECT COUNT(*) FROM admin_audit").fetchone()[0]
        generations = [httpx.get(app.url + "/readyz", timeout=5).json()["generation"] for app in ctx.apps]
        return {"redis keys": keys, "audit rows": audit, "generations": generations}

    before = state()
    # Authorization header values (bytes: some are not ASCII), all wrong.
    wrong: list[bytes] = [
        b"Bearer x",
        f"Bearer {TOKEN[:-1]}".encode(),
        f"Bearer {TOKEN}x".encode(),
        f"Bearer {TOKEN.upper()}".encode(),
        f"Bearer {TOKEN[::-1]}".encode(),
        f"Basic {TOKEN}".encode(),
        f"Token {TOKEN}".encode(),
        f"Bearer{TOKEN}".encode(),
        b"Bearer null",
        b"Bearer " + b"a" * 10_000,
        f"Bearer {TOKEN.replace('-', '_')}".encode(),
        b"Bearer ' OR '1'='1",
        f"Bearer {TOKEN}\u00e9".encode(),
        b"Bearer \xff\xfe",
        b"",
    ]
    endpoints = [
        ("POST", "/admin/api/flush", {"tier": "all"}),
        ("POST", "/admin/api/bump-version", {}),
        ("GET", "/admin/api/stats", None),
    ]
    statuses: list[int] = []
    attacker = httpx.Client(
        base_url=a.url, timeout=30.0, transport=httpx.HTTPTransport(local_address="127.0.0.2")
    )
    with attacker:
        for i in range(sizes.brute_attempts):
            method, path, body = endpoints[i % len(endpoints)]
            authorization = wrong[i % len(wrong)]
            headers: dict[str, Any] = {"Authorization": authorization} if authorization else {}
            if i % 2:  # a forged client address must not reset the count
                headers["X-Forwarded-For"] = f"10.{i % 250}.0.1"
            try:
                status, _ = http_json(attacker, method, path, token=None, body=body, headers=headers)
            except httpx.HTTPError as exc:
                run.count_extra("failed", f"attempt {i}: {exc!r}")
                continue
            statuses.append(status)
            if status == 200:
                run.count_extra("wrong", f"attempt {i} ({authorization[:30]!r}) accepted: {method} {path}")
            elif status >= 500:
                run.count_extra("failed", f"attempt {i} ({authorization[:30]!r}): HTTP {status}")
            else:
                run.count_extra("ok")
        right_while_locked, _ = http_json(attacker, "GET", "/admin/api/stats")
    with httpx.Client(base_url=a.url, timeout=30.0) as client:
        operator, _ = http_json(client, "GET", "/admin/api/stats?window=5m")
    after = state()
    hit = run.send(cached, 0)
    first_429 = next((i + 1 for i, s in enumerate(statuses) if s == 429), None)
    run.figure("attempts", f"{len(statuses)}: {dict(Counter(statuses))}")
    run.figure("first 429 at attempt", first_429)
    run.figure("state before / after", f"{before} / {after}")
    run.check("no wrong token accepted", 200 not in statuses)
    run.check(
        "rate limiting engaged within 5 attempts", first_429 is not None and first_429 <= 5, str(first_429)
    )
    run.check(
        "every attempt after the first 429 refused with 429",
        first_429 is not None and set(statuses[first_429 - 1 :]) == {429},
    )
    run.check(
        "the right token from the locked-out client is refused too",
        right_while_locked == 429,
        str(right_while_locked),
    )
    run.check("the operator on another address is unaffected", operator == 200, str(operator))
    run.check("no state changed (keys, audit log, generation)", before == after, f"{before} -> {after}")
    run.check("cached entry still served from memory", (hit.outcome.info or {}).get("tier") == "l1")


def graceful_stop(run: Run) -> None:
    """SIGTERM app A (a deploy) while a browser tab keeps its event stream open, under load."""
    ctx, sizes = run.ctx, run.ctx.sizes
    a = ctx.apps[0]
    wall_start = time.time()
    stop_stream = threading.Event()

    def browser_tab() -> None:  # what an open page holds: Gradio's heartbeat stream
        with (
            contextlib.suppress(httpx.HTTPError),
            httpx.stream("GET", f"{a.url}/gradio_api/heartbeat/faults-suite-tab", timeout=None) as stream,
        ):
            for _ in stream.iter_lines():
                if stop_stream.is_set():
                    return

    tab = threading.Thread(target=browser_tab, daemon=True)
    tab.start()
    grace_s = 10.0
    with run.load(ctx.pool, [0, 1]):
        time.sleep(sizes.phase_s)
        exit_s = a.stop(grace_s=grace_s)
        time.sleep(sizes.phase_s / 2)
    stop_stream.set()
    answered_by_a = sum(1 for o in run.observations if o.replica == 0 and o.outcome.kind != "unreachable")
    with contextlib.closing(sqlite3.connect(f"file:{a.sqlite_path}?mode=ro", uri=True)) as db:
        rows = db.execute("SELECT COUNT(*) FROM request_log WHERE at >= ?", (wall_start,)).fetchone()[0]
    run.figure(
        "exit after SIGTERM",
        f"did not exit: SIGKILL after {grace_s:.0f}s" if exit_s is None else f"{exit_s:.2f}s",
    )
    run.figure("A's answers / its log rows", f"{answered_by_a} / {rows}")
    run.check(
        f"exits within {grace_s:.0f}s of SIGTERM with a client connected", exit_s is not None, fmt_s(exit_s)
    )
    run.check(
        "every answer of A has its log row", rows >= answered_by_a, f"{rows} rows, {answered_by_a} answers"
    )
    if ctx.remaining and sizes.restart_between:
        a.start()
        a.wait_ready()


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    run: Callable[[Run], None]


SCENARIOS = (
    Scenario("redis_killed", "Redis killed (SIGKILL) under load, then restarted", redis_killed),
    Scenario("redis_paused", "Redis paused (CLIENT PAUSE) longer than the socket timeout", redis_paused),
    Scenario(
        "redis_connections_dropped",
        "Redis drops every client connection (CLIENT KILL)",
        redis_connections_dropped,
    ),
    Scenario("redis_noeviction", "Redis at maxmemory with noeviction: writes refused", redis_noeviction),
    Scenario("corrupt_values", "Corrupt and foreign-schema values under live keys", corrupt_values),
    Scenario("single_flight", "200 concurrent requests for one new input", single_flight),
    Scenario("version_bump", "Cache version bump while two processes serve", version_bump),
    Scenario("log_locked", "SQLite request log locked by another writer", log_locked),
    Scenario("malformed_inputs", "Malformed uploads and hostile texts", malformed_inputs),
    Scenario("admin_bruteforce", "Admin API brute force", admin_bruteforce),
    Scenario("app_killed", "App process killed (SIGKILL) under load, then restarted", app_killed),
    Scenario("graceful_stop", "App stopped (SIGTERM) with a browser connected", graceful_stop),
)


def run_scenario(ctx: Context, scenario: Scenario) -> ScenarioResult:
    run = Run(ctx, scenario.name, scenario.title)
    started = time.monotonic()
    try:
        ctx.reset()
        scenario.run(run)
    except Exception as exc:  # a crash of the scenario itself: reported, and the suite goes on
        where = traceback.extract_tb(exc.__traceback__)[-3:]
        trail = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(where))
        run.result.error = f"{type(exc).__name__}: {exc} (at {trail})"[:2000]
    result = run.finish()
    result.duration_s = time.monotonic() - started
    return result


# ---- report --------------------------------------------------------------------------------------


def describe(result: ScenarioResult) -> str:
    lines = [f"== {result.name}: {result.title} ({result.duration_s:.1f}s)"]
    lines.append(
        f"   requests: sent {result.sent}, succeeded {result.succeeded}, failed {result.failed}, "
        f"wrong {result.wrong}, retried on the other replica {result.retried}"
        + (f", recovery {fmt_s(result.recovery_s)}" if result.recovery_s is not None else "")
    )
    for name, value in result.figures.items():
        lines.append(f"   {name}: {value}")
    for check in result.checks:
        lines.append(
            f"   [{'ok' if check.ok else 'FAIL'}] {check.name}"
            + (f" ({check.detail})" if check.detail else "")
        )
    for problem in result.problems:
        lines.append(f"   ! {problem}")
    if result.error:
        lines.append(f"   ! the scenario crashed: {result.error}")
    return "\n".join(lines)


def table(results: Sequence[ScenarioResult]) -> str:
    rows = [
        [
            r.name,
            str(r.sent),
            str(r.succeeded),
            str(r.failed),
            str(r.wrong),
            str(r.retried),
            "n/a" if r.recovery_s is None else f"{r.recovery_s:.2f}",
            f"{sum(c.ok for c in r.checks)}/{len(r.checks)}" + (" crashed" if r.error else ""),
        ]
        for r in results
    ]
    headers = ["scenario", "sent", "succeeded", "failed", "wrong", "retried", "recovery s", "checks"]
    return format_table(headers, rows)


def summary_line(results: Sequence[ScenarioResult]) -> str:
    failed = sum(r.failed for r in results)
    wrong = sum(r.wrong for r in results)
    return f"SUMMARY scenarios={len(results)} failed_requests={failed} wrong_results={wrong}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="every scenario, briefly (a few minutes)")
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (app logs)")
    args = parser.parse_args(argv)
    if args.list:
        for scenario in SCENARIOS:
            print(f"{scenario.name:28} {scenario.title}")
        return 0
    chosen = [s for s in SCENARIOS if not args.only or s.name in args.only.split(",")]
    if not chosen:
        parser.error(f"no scenario named {args.only!r}; see --list")
    sizes = QUICK if args.quick else FULL
    # SIGTERM (a CI timeout, `kill`): unwind normally, so the apps and Redis are stopped and the
    # work directory is removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="infcache-faults-"))
    print(
        f"fault suite ({sizes.label}): {len(chosen)} scenarios, {os.cpu_count()} CPUs, work dir {work}",
        flush=True,
    )
    started = time.monotonic()
    results: list[ScenarioResult] = []
    ctx = build_context(sizes, work, log=lambda line: print(line, flush=True))
    try:
        for index, scenario in enumerate(chosen):
            ctx.remaining = len(chosen) - index - 1
            result = run_scenario(ctx, scenario)
            results.append(result)
            print(describe(result), flush=True)
    finally:
        ctx.close()
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(results))
    checks_failed = [(r.name, c) for r in results for c in r.checks_failed]
    crashed = [r.name for r in results if r.error]
    passed = sum(len(r.checks) for r in results) - len(checks_failed)
    print(
        f"\nchecks: {passed} passed, {len(checks_failed)} failed"
        + (f"; crashed: {', '.join(crashed)}" if crashed else "")
        + f"; {time.monotonic() - started:.0f}s in all"
    )
    for name, check in checks_failed:
        print(f"  FAIL {name}: {check.name}" + (f" ({check.detail})" if check.detail else ""))
    print(summary_line(results))
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
