"""Abandoned calls: what two-step calls nobody fetches leave in memory, and whether another
visitor is served meanwhile.

The app is served in this process (real models, default settings, no Redis). First an
ordinary load: new messages posted and fetched by 32 clients at once, so the model's working
memory at full concurrency (ONNX Runtime's arena, the allocator's heaps) is taken before
"before" is read: that memory is the price of serving misses at all, not of abandoning them.
Then, from one address and then from many (loopback addresses in turn), `--calls` abandoned
calls of each kind: `POST /gradio_api/call/classify_text` of a cached message and of new ones,
`POST /gradio_api/queue/join` each with a session of its own, and photos uploaded then called.
Meanwhile a visitor on another address sends a cached and a new message every 0.2 s and
fetches the answers. Reported: resident memory (after garbage collection and `malloc_trim`)
against "before" after each kind, the session tables, the visitor's answers and refusals;
then the one-shot sessions' age limit is shortened to let them expire, and memory read again.

    python -m bench.abandoned_calls [--calls 3000]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.workload.inputs import make_images
from runtime import build_runtime, load_models
from settings import Settings
from storage.redis.embedded import free_port
from ui.lean_sessions import SWEEP_EVERY_S
from ui.server import serve_runtime

CALL = "/gradio_api/call/classify_text"
VISITOR = "127.0.0.250"
MANY_ADDRESSES = 200


def rss_mb() -> float:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS as it is
        pass
    return psutil.Process().memory_info().rss / 2**20


def _client(url: str, source: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=60, transport=httpx.HTTPTransport(local_address=source))


class Visitor:
    """Another person's calls during the flood: a cached and a new message, fetched."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._stop = threading.Event()
        self.outcomes: Counter[str] = Counter()
        self._thread = threading.Thread(target=self._run, name="visitor", daemon=True)

    def _run(self) -> None:
        with _client(self._url, VISITOR) as http:
            while not self._stop.wait(0.2):
                for text in ("Where is my parcel?", f"A new question {uuid.uuid4().hex}"):
                    post = http.post(CALL, json={"data": [text]})
                    if post.status_code != 200:
                        self.outcomes[f"refused {post.status_code}"] += 1
                        continue
                    stream = http.get(f"{CALL}/{post.json()['event_id']}").text
                    self.outcomes["answered" if "event: complete" in stream else "error event"] += 1

    def __enter__(self) -> Visitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


def _kinds(url: str, fn_index: int, photos: list[bytes]) -> dict[str, Callable[[httpx.Client, int], int]]:
    def cached(http: httpx.Client, n: int) -> int:
        return http.post(CALL, json={"data": ["Where is my parcel?"]}).status_code

    def new(http: httpx.Client, n: int) -> int:
        return http.post(CALL, json={"data": [f"abandoned {uuid.uuid4().hex} {n}"]}).status_code

    def session(http: httpx.Client, n: int) -> int:
        body = {"data": [f"joined {uuid.uuid4().hex}"], "fn_index": fn_index,
                "session_hash": uuid.uuid4().hex[:11]}  # fmt: skip
        return http.post("/gradio_api/queue/join", json=body).status_code

    def photo(http: httpx.Client, n: int) -> int:
        files = {"files": ("p.png", photos[n % len(photos)], "image/png")}
        upload = http.post("/gradio_api/upload", files=files)
        if upload.status_code != 200:
            return upload.status_code
        ref = {"path": upload.json()[0], "meta": {"_type": "gradio.FileData"}}
        return http.post("/gradio_api/call/classify_image", json={"data": [ref]}).status_code

    return {"cached text": cached, "new text": new, "own session": session, "new photo": photo}


def _addresses(many: bool) -> Iterator[str]:
    n = 0
    while True:
        yield f"127.0.1.{n % MANY_ADDRESSES + 1}" if many else "127.0.0.9"
        n += 1


def _flood(url: str, kind: Callable[[httpx.Client, int], int], calls: int, many: bool) -> Counter[int]:
    statuses: Counter[int] = Counter()
    clients: dict[str, httpx.Client] = {}
    try:
        for n, source in zip(range(calls), _addresses(many), strict=False):
            http = clients.get(source) or clients.setdefault(source, _client(url, source))
            statuses[kind(http, n)] += 1
    finally:
        for http in clients.values():
            http.close()
    return statuses


def _ordinary_load(url: str, calls: int) -> None:
    def one(n: int) -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            post = http.post(CALL, json={"data": [f"ordinary {uuid.uuid4().hex} {n}"]})
            http.get(f"{CALL}/{post.json()['event_id']}")

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(one, range(calls)))


@contextmanager
def _served() -> Iterator[Any]:
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings.from_env({}).changed(
            server__data_dir=Path(tmp) / "data", redis__url="off", models__onnx_export_dir=Path(tmp) / "onnx",
        )  # fmt: skip
        runtime = build_runtime(settings, models=load_models(settings))
        server = serve_runtime(runtime, port=free_port())
        try:
            yield server
        finally:
            server.close()
            runtime.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000, help="abandoned calls of each kind, per source")
    args = parser.parse_args()
    photos = make_images(64, seed=7)
    with _served() as server:
        url = server.url
        blocks = server.app._gradio.get_blocks()  # ui.startup.ServingApp's mounted Gradio app
        holder, queue = blocks.state_holder, blocks._queue
        fn_index = next(i for i, fn in blocks.fns.items() if fn.api_name == "classify_text")
        _ordinary_load(url, args.calls)
        before = rss_mb()
        print(f"before (after {args.calls} ordinary calls, 32 at once): {before:,.0f} MB")
        header = ("source", "kind", "statuses", "RSS", "one-shot", "sessions", "queues")
        print("{:<15} {:<12} {:<22} {:>9} {:>9} {:>9} {:>7}".format(*header))
        with Visitor(url) as visitor:
            for many in (False, True):
                for name, kind in _kinds(url, fn_index, photos).items():
                    statuses = _flood(url, kind, args.calls, many)
                    shown = ", ".join(f"{code}: {n}" for code, n in sorted(statuses.items()))
                    queues = queue.pending_messages_per_session
                    tables = (len(holder.one_shot), len(holder.session_data), len(queues))
                    print(f"{'many addresses' if many else 'one address':<15} {name:<12} {shown:<22} "
                          f"{rss_mb() - before:>+7.0f}MB {tables[0]:>9} {tables[1]:>9} {tables[2]:>7}",
                          flush=True)  # fmt: skip
        print(f"visitor meanwhile: {dict(visitor.outcomes)}")
        holder.one_shot_max_age_s = 1.0  # every abandoned one-shot call now expired
        time.sleep(SWEEP_EVERY_S + 2)  # no call comes: the app's sweep timer drops them
        print(f"after expiry: {rss_mb() - before:+.0f} MB, one-shot sessions {len(holder.one_shot)}")


if __name__ == "__main__":
    main()
