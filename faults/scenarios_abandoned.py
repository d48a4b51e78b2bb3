"""What anonymous clients can send to Gradio's routes (issue 34): calls posted and never
fetched, and every event of the page with wrong values.

Both run in the frame of `faults.hostile.under_attack` (normal clients on A and B, A's
/healthz watched through quiet and attacked windows, peak memory and logs judged after), with
a visitor of its own beside the normal clients: another address sending a new message every
VISITOR_PAUSE_S, each answer judged as usual (a 503 or 429 would fail the scenario). Their
attackers make the model work, so the quiet windows carry ordinary work of the same kind
(`control`): the same calls fetched, or ordinary new messages; /healthz is judged against that.
Afterwards each waits for A's queue to empty (calls nobody fetches still run).

- `abandoned_calls`: attackers behind the trusted loopback proxy (`X-Forwarded-For`) post
  two-step calls of every kind and never fetch them: cached and new messages, a session of
  their own through `queue/join`, photos uploaded then called, inputs refused as invalid;
  half from one address, half from many. Each post must be answered (200), or refused as the
  queue's share or the miss budget says (503, 429), never a 5xx.
- `traceback_probes`: attackers walk every function of `/config`, front-end-only ones
  included, with wrong values on each input, through `queue/join` (reading the session's
  event stream to its end) and through `/gradio_api/call/<api_name>`; each must be refused
  (4xx) or end in Gradio's error event or an answer, and no traceback may reach the log.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx

from bench.workload.inputs import make_images
from engine.capacity.admission import CONTENDED_WINDOW_S
from faults.client import FaultClient
from faults.harness import Run
from faults.hostile import Attacker, Replies, Reply, status_outcome, under_attack
from faults.processes import rss_mb
from testing.gradio_http import FILE_META

ONE_ADDRESS = "198.51.100.34"
MANY_ADDRESSES = 200  # 203.0.113.1 ... .200
VISITOR = "192.0.2.77"
VISITOR_PAUSE_S = 1.0  # within the miss budget's burst for the whole scenario
DRAIN_S = 60.0
# Wrong values for any input of any event: of the wrong type, outside a choice's list, a
# file the server holds but was never uploaded, characters a JSON stream cannot carry.
WRONG_VALUES: list[Any] = [
    None, "not one of the choices", 123456789, -1, 0.5, True, [], {}, ["x", 1], {"a": [1]},
    {"path": "/etc/hostname", "meta": dict(FILE_META)}, "\x00", "\ud800",
]  # fmt: skip
STREAM_TIMEOUT_S = 30.0
# Between one prober's calls: a few probes a second each, as someone poking at a Space would;
# many of them run a callback (a console refresh, a classification), so back to back they
# would measure the callbacks' cost, not the refusals' (the walk of every value is the
# fuzz test's).
PROBE_PAUSE_S = 0.1


def _post_json(http: httpx.Client, path: str, body: dict[str, Any], source: str) -> httpx.Response:
    # ensure_ascii: a lone surrogate travels as a \udXXX escape, as a browser's JSON sends it.
    return http.post(path, content=json.dumps(body, ensure_ascii=True).encode("ascii"),
                     headers={"content-type": "application/json", "x-forwarded-for": source})  # fmt: skip


def _call_reply(kind: str, response: httpx.Response, started: float) -> Reply:
    if response.status_code in (429, 503) and "Traceback" not in response.text:
        outcome = "refused"  # the miss budget, or the client's share of the queue
    else:
        outcome = status_outcome(response.status_code, response.text)
    return Reply(kind, outcome, response.status_code, seconds=time.monotonic() - started,
                 detail=response.text[:300])  # fmt: skip


class _Visitor:
    """Another client (VISITOR, its own address behind the proxy) sending a new message every
    VISITOR_PAUSE_S to A and B in turn, each answer judged by the run."""

    def __init__(self, run: Run) -> None:
        self._run = run
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="visitor", daemon=True)
        self.sent = 0

    def _loop(self) -> None:
        ctx = self._run.ctx
        clients = [FaultClient(app.url, timeout_s=ctx.sizes.request_timeout_s,
                               headers={"x-forwarded-for": VISITOR}) for app in ctx.apps]  # fmt: skip
        try:
            while not self._stop.wait(VISITOR_PAUSE_S):
                case, replica = ctx.probe_case(), self.sent % len(clients)
                sent_at = time.monotonic()
                self._run.record(case, replica, sent_at, clients[replica].classify(case.task, case.raw), 0)
                self.sent += 1
        finally:
            for client in clients:
                client.close()

    def __enter__(self) -> _Visitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self._run.ctx.sizes.request_timeout_s * 2)


def _drain(run: Run, url: str) -> None:
    """Wait for A's queue to empty: calls nobody fetches still run, and must not weigh on the
    next scenario."""
    deadline = time.monotonic() + DRAIN_S
    waiting = -1
    while time.monotonic() < deadline:
        waiting = httpx.get(url + "/gradio_api/queue/status", timeout=10).json().get("queue_size", 0)
        if waiting == 0:
            time.sleep(CONTENDED_WINDOW_S + 1.0)  # the last ones run, and stop counting as contention
            return
        time.sleep(0.5)
    run.figure("calls still queued on A after the scenario", waiting)


def _judge_posts(run: Run, replies: Replies, what: str) -> None:
    counts = Counter(f"{r.kind}: {r.status or r.outcome}" for r in replies.items)
    run.figure(f"{what} posts", dict(sorted(counts.items())))
    wrong = [r for r in replies.items if r.outcome not in ("accepted", "refused")]
    for reply in wrong[:6]:
        run.result.problems.append(f"{reply.kind}: {reply.outcome} {reply.status}: {reply.detail[:160]!r}")
    run.check(f"every {what} post answered or refused (200, 4xx, 503), never a 5xx or a traceback",
              bool(replies.items) and not wrong, f"{len(wrong)} of {len(replies.items)} not")  # fmt: skip


# ---- abandoned_calls -------------------------------------------------------------------


def _abandoning_kinds(
    photos: list[bytes], text_fn_index: int
) -> dict[str, Callable[[httpx.Client, str, int], httpx.Response]]:
    """Ways to post a call and walk away, each (http, source address, n) -> the post's reply."""

    def cached_text(http: httpx.Client, source: str, n: int) -> httpx.Response:
        return _post_json(http, "/gradio_api/call/classify_text", {"data": ["Where is my parcel?"]}, source)

    def new_text(http: httpx.Client, source: str, n: int) -> httpx.Response:
        body = {"data": [f"abandoned {uuid.uuid4().hex} {n}"]}
        return _post_json(http, "/gradio_api/call/classify_text", body, source)

    def own_session(http: httpx.Client, source: str, n: int) -> httpx.Response:
        body = {"data": [f"joined {uuid.uuid4().hex}"], "fn_index": text_fn_index,
                "session_hash": uuid.uuid4().hex[:11]}  # fmt: skip
        return _post_json(http, "/gradio_api/queue/join", body, source)

    def new_photo(http: httpx.Client, source: str, n: int) -> httpx.Response:
        files = {"files": ("p.png", photos[n % len(photos)], "image/png")}
        upload = http.post("/gradio_api/upload", files=files, headers={"x-forwarded-for": source})
        if upload.status_code != 200:
            return upload
        ref = {"path": upload.json()[0], "meta": dict(FILE_META)}
        return _post_json(http, "/gradio_api/call/classify_image", {"data": [ref]}, source)

    def invalid_photo(http: httpx.Client, source: str, n: int) -> httpx.Response:
        files = {"files": ("p.png", b"not a picture %d" % n, "image/png")}
        upload = http.post("/gradio_api/upload", files=files, headers={"x-forwarded-for": source})
        if upload.status_code != 200:
            return upload
        ref = {"path": upload.json()[0], "meta": dict(FILE_META)}
        return _post_json(http, "/gradio_api/call/classify_image", {"data": [ref]}, source)

    return {"cached text": cached_text, "new text": new_text, "own session": own_session,
            "new photo": new_photo, "invalid photo": invalid_photo}  # fmt: skip


Post = Callable[[httpx.Client], httpx.Response]


def _stream_end(http: httpx.Client, queued: httpx.Response) -> str:
    """Fetch a queued call's result: how its event stream ends (an answer, an error event, or
    not at all)."""
    request = queued.request
    if request.url.path.endswith("/queue/join"):
        session_hash = json.loads(request.content)["session_hash"]
        stream = http.get("/gradio_api/queue/data", params={"session_hash": session_hash},
                          timeout=STREAM_TIMEOUT_S)  # fmt: skip
        messages = [json.loads(line[5:]) for line in stream.text.splitlines() if line.startswith("data:")]
        done = [m for m in messages if m.get("msg") == "process_completed"]
        if not done:
            return "no end"
        return "answered" if done[-1].get("success") else "error event"
    stream = http.get(f"{request.url.path}/{queued.json()['event_id']}", timeout=STREAM_TIMEOUT_S)
    if "event: complete" in stream.text:
        return "answered"
    return "error event" if "event: error" in stream.text else "no end"


def _poster(run: Run, next_post: Callable[[int, int], tuple[str, Post]], *, fetch: bool,
            ends: Counter[str], pause_s: float = 0.0) -> Attacker:  # fmt: skip
    """An attacker posting `next_post(index, n)` in turn to A, fetching each result or not,
    pausing `pause_s` after each."""
    url, timeout_s = run.ctx.apps[0].url, run.ctx.sizes.request_timeout_s
    lock = threading.Lock()

    def attacker(index: int, deadline: float, replies: Replies) -> None:
        with httpx.Client(base_url=url, timeout=timeout_s) as http:
            for n in itertools.count():
                if time.monotonic() >= deadline:
                    return
                kind, post = next_post(index, n)
                started = time.monotonic()
                try:
                    queued = post(http)
                    reply = _call_reply(kind, queued, started)
                    end = _stream_end(http, queued) if fetch and queued.status_code == 200 else None
                except httpx.HTTPError as exc:
                    replies.add(Reply(kind, "no answer", detail=repr(exc)[:200]))
                    continue
                if end == "no end":
                    reply = Reply(kind, "no answer", 200, detail="the event stream ended without a result")
                replies.add(reply)
                with lock:
                    ends[end or f"{'refused' if fetch else 'not fetched'} {queued.status_code}"] += 1
                time.sleep(pause_s)

    return attacker


def abandoned_calls(run: Run) -> None:
    """Attackers post two-step calls of every kind and never fetch them; in the quiet windows
    the same calls are posted and fetched (the baseline of A's /healthz)."""
    url = run.ctx.apps[0].url
    dependencies = httpx.get(url + "/config", timeout=30).json()["dependencies"]
    text_fn_index = next(d["id"] for d in dependencies if d.get("api_name") == "classify_text")
    kinds = list(_abandoning_kinds(make_images(16, seed=34), text_fn_index).items())
    attackers = run.ctx.sizes.attackers

    def next_post(index: int, n: int) -> tuple[str, Post]:
        n = n * attackers + index
        name, post = kinds[n % len(kinds)]
        source = ONE_ADDRESS if n % 2 else f"203.0.113.{n % MANY_ADDRESSES + 1}"
        return name, lambda http: post(http, source, n)

    fetched: Counter[str] = Counter()
    visitor = _Visitor(run)
    abandoning = _poster(run, next_post, fetch=False, ends=Counter())
    replies = under_attack(run, abandoning, unrefused_bytes=None, beside=visitor,
                           control=_poster(run, next_post, fetch=True, ends=fetched))  # fmt: skip
    app = run.ctx.apps[0]
    run.figure("A's resident memory after the attack", f"{rss_mb(app.pid):,.0f} MB")
    run.figure("the same calls fetched, in the quiet windows", dict(fetched))
    run.figure("visitor's new messages during the scenario", visitor.sent)
    _judge_posts(run, replies, "abandoned")
    _drain(run, url)


# ---- traceback_probes ------------------------------------------------------------------


def _walk(http: httpx.Client) -> list[tuple[str, dict[str, Any]]]:
    """(route, body) of every function of /config with every wrong value on its inputs."""
    walk: list[tuple[str, dict[str, Any]]] = []
    for dependency in http.get("/config").json()["dependencies"]:
        inputs = max(len(dependency["inputs"]), 1)
        for n, wrong in enumerate(WRONG_VALUES):
            body: dict[str, Any] = {"data": [wrong] * inputs, "fn_index": dependency["id"]}
            if n % 2:
                body["trigger_id"] = dependency["targets"][0][0] if dependency["targets"] else 10**9
            walk.append(("/gradio_api/queue/join", body))
            if dependency.get("api_name") and dependency.get("backend_fn", True):
                walk.append((f"/gradio_api/call/{dependency['api_name']}", {"data": body["data"]}))
    return walk


def traceback_probes(run: Run) -> None:
    """Attackers walk every function of /config with wrong values on every input, reading each
    result; in the quiet windows they send new messages instead (the baseline of /healthz)."""
    url = run.ctx.apps[0].url
    with httpx.Client(base_url=url, timeout=run.ctx.sizes.request_timeout_s) as http:
        walk = _walk(http)
    run.figure("calls in one walk of /config", len(walk))
    attackers = run.ctx.sizes.attackers

    def probe(index: int, n: int) -> tuple[str, Post]:
        route, body = walk[(n * attackers + index) % len(walk)]
        if "fn_index" in body:
            body = {**body, "session_hash": f"probe-{index}-{n}-{uuid.uuid4().hex[:8]}"}
        kind = f"{route.rsplit('/', 1)[-1]} fn {body.get('fn_index', '')}".strip()
        return kind, lambda http: _post_json(http, route, body, ONE_ADDRESS)

    def message(index: int, n: int) -> tuple[str, Post]:
        body = {"data": [f"an ordinary question {uuid.uuid4().hex}"]}
        return "message", lambda http: _post_json(http, "/gradio_api/call/classify_text", body, ONE_ADDRESS)

    ends: Counter[str] = Counter()
    probing = _poster(run, probe, fetch=True, ends=ends, pause_s=PROBE_PAUSE_S)
    asking = _poster(run, message, fetch=True, ends=Counter(), pause_s=PROBE_PAUSE_S)
    replies = under_attack(run, probing, unrefused_bytes=None, beside=_Visitor(run), control=asking)
    run.figure("how the probes ended", dict(ends))
    _judge_posts(run, replies, "probe")
    _drain(run, url)
