"""Scenarios of hostile HTTP (issue 23): a request built to freeze a replica, an endless
request head, a huge Gradio body, and a cache-key collision pair planted through the APIs.

Each runs in the frame of `faults.hostile.under_attack`: normal clients on A and B,
A's /healthz watched through quiet and attacked windows in turn, memory and logs read after.
The attacks are those of issue 23; against the code before its fixes each scenario fails
(a 9.4 s /healthz p99 and 500s; heads accepted; +2.9 GB; B answered from A's key).
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from bench.collisions import bmp_upload_pair, png_pair, text_pair
from bench.models import SCORE_TOLERANCE
from faults.client import FaultClient, Outcome
from faults.harness import Case, Observation, Run, key_of, tiers
from faults.hostile import MIB, ROUNDS, Attacker, Replies, exchange, post_outcome, under_attack
from testing.oip_http import OipError, OipHttpClient

INFER_PATH = "/v2/models/text/infer"
BIG_DIM = 2**62 + 1  # fits 64 bits, so a fast JSON parser takes it; 60,000 of them are 1.26 MB
# Between one attacker's requests: a few attackers each sending a few requests a second
# (three send ~10 MB/s of shapes), enough for any request that freezes the server to show,
# not a flood whose bytes alone keep the CPUs busy (each refusal of a 1.26 MB body costs the
# server ~5 ms; at 25 MB/s A's /healthz p99 rose by 20-40 ms on this 2-CPU machine).
PAUSE_S = 0.25


# ---- shape_freeze ---------------------------------------------------------------------


def _infer_json(shape: Any, **tensor: Any) -> bytes:
    return json.dumps({"inputs": [{"name": "input", "shape": shape, "datatype": "BYTES", **tensor}]}).encode()


def _shape_bodies() -> list[tuple[str, bytes, dict[str, str]]]:
    """REST infer bodies whose shapes would make the server compute huge products."""
    as_json = {"content-type": "application/json"}
    binary_header = _infer_json([BIG_DIM] * 60_000, parameters={"binary_data_size": 5})
    as_binary = {"content-type": "application/octet-stream",
                 "inference-header-content-length": str(len(binary_header))}  # fmt: skip
    return [
        ("60,000 dims of 2**62+1", _infer_json([BIG_DIM] * 60_000, data=["x"]), as_json),
        ("[10**2200, 10**2200]", _infer_json([10**2200, 10**2200], data=["x"]), as_json),
        ("300,000 dims of 2", _infer_json([2] * 300_000, data=["x"]), as_json),
        ("60,000 dims, binary extension", binary_header + struct.pack("<I", 1) + b"x", as_binary),
    ]


def shape_freeze(run: Run) -> None:
    """Attackers send REST infer requests with shapes of enormous products, again and again."""
    bodies = _shape_bodies()
    url = run.ctx.apps[0].url
    run.figure("bodies", ", ".join(f"{name} ({len(body) / 1e3:,.1f} kB)" for name, body, _ in bodies))

    def attacker(index: int, deadline: float, replies: Replies) -> None:
        with httpx.Client(base_url=url, timeout=run.ctx.sizes.request_timeout_s) as http:
            for n in range(10**9):
                if time.monotonic() >= deadline:
                    return
                kind, body, headers = bodies[(index + n) % len(bodies)]
                replies.add(post_outcome(http, kind, INFER_PATH, body, headers))
                time.sleep(PAUSE_S)

    under_attack(run, attacker)


# ---- header_stream --------------------------------------------------------------------


def _endless(piece: bytes) -> Iterator[bytes]:
    while True:
        yield piece


def _numbered_headers() -> Iterator[bytes]:
    """Short headers, 512 (~8 kB) a piece: as many bytes a second as the X-Big trickle."""
    for n in range(10**9):
        yield b"".join(b"X-H-%d: v\r\n" % (n * 512 + i) for i in range(512))


def header_stream(run: Run) -> None:
    """Raw connections that never finish their request head: one `X-Big:` header trickled
    8 kB every 2 ms (over 1 MiB a second: the code before its fix was still reading after a
    second), many headers trickled alike, or a complete head of thousands of headers.
    Each attacker opens a new connection whenever the server refuses or closes one."""
    app = run.ctx.apps[0]
    address = ("127.0.0.1", app.port)
    start = f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{app.port}\r\n".encode()
    burst = start + b"".join(b"X-H-%d: v\r\n" % i for i in range(5_000)) + b"\r\n"
    # (name, head, body): the exchange stops an endless one when the server refuses, or at the end.
    kinds: list[tuple[str, bytes, Callable[[], Iterator[bytes]]]] = [
        ("one endless X-Big header", start + b"X-Big: ", lambda: _endless(b"a" * 8192)),
        ("endless numbered headers", start, _numbered_headers),
        ("5,000 headers in one head", burst, lambda: iter(())),
    ]

    def attacker(index: int, deadline: float, replies: Replies) -> None:
        for n in range(10**9):
            if time.monotonic() >= deadline:
                return
            kind, head, body = kinds[(index + n) % len(kinds)]
            replies.add(exchange(address, kind, head, body(), until=deadline, pace_s=0.002))

    under_attack(run, attacker, unrefused_bytes=MIB)


# ---- huge_gradio_body -----------------------------------------------------------------


def _fn_index(url: str, api_name: str) -> int:
    """The Gradio event index of `api_name` (what /queue/join takes), from the app's config."""
    try:
        config = httpx.get(url + "/config", timeout=10.0).json()
        return next(d["id"] for d in config["dependencies"] if d.get("api_name") == api_name)
    except (httpx.HTTPError, ValueError, KeyError, StopIteration, TypeError):
        return 0


def _json_string_body(prefix: bytes, size: int) -> tuple[int, Iterator[bytes]]:
    """A JSON body `prefix + "aaa…" + "]}"` of `size` bytes, generated 64 kB at a time."""
    suffix = b'"]}'
    filler = size - len(prefix) - len(suffix)
    piece = b"a" * 65536

    def pieces() -> Iterator[bytes]:
        yield prefix
        for _ in range(filler // len(piece)):
            yield piece
        yield piece[: filler % len(piece)] + suffix

    return size, pieces()


def _chunked(pieces: Iterator[bytes]) -> Iterator[bytes]:
    for piece in pieces:
        if piece:
            yield b"%x\r\n%s\r\n" % (len(piece), piece)
    yield b"0\r\n\r\n"


def huge_gradio_body(run: Run) -> None:
    """Hundreds of MB of JSON (one endless string) to `/gradio_api/call/classify_text` and
    `/gradio_api/queue/join`, with a declared length or chunked, never read back: the call's
    result is never fetched. Each body is generated as it is sent."""
    app = run.ctx.apps[0]
    address = ("127.0.0.1", app.port)
    size = run.ctx.sizes.huge_body_mb * MIB
    fn_index = _fn_index(app.url, "classify_text")
    call = ("/gradio_api/call/classify_text", b'{"data": ["')
    join = ("/gradio_api/queue/join", b'{"fn_index": %d, "session_hash": "hostile", "data": ["' % fn_index)
    kinds = [(f"{path} {how}", path, prefix, how)
             for path, prefix in (call, join) for how in ("content-length", "chunked")]  # fmt: skip

    def attacker(index: int, deadline: float, replies: Replies) -> None:
        for n in range(10**9):
            if time.monotonic() >= deadline:
                return
            kind, path, prefix, how = kinds[(index + n) % len(kinds)]
            length, pieces = _json_string_body(prefix, size)
            framing = f"Content-Length: {length}" if how == "content-length" else "Transfer-Encoding: chunked"
            head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{app.port}\r\n"
                    f"Content-Type: application/json\r\n{framing}\r\n\r\n").encode()  # fmt: skip
            body = pieces if how == "content-length" else _chunked(pieces)
            replies.add(exchange(address, kind, head, body, until=deadline))
            time.sleep(PAUSE_S)

    run.figure("each body", f"{size / MIB:,.0f} MiB, declared or chunked (/queue/join: fn_index {fn_index})")
    under_attack(run, attacker, unrefused_bytes=8 * MIB)


# ---- collision_pair -------------------------------------------------------------------


def _rest_outcome(http: OipHttpClient, task: str, raw: Any) -> Outcome:
    try:
        answer = http.infer(task, raw)
    except OipError as exc:
        kind = "failure" if exc.status >= 500 else "input_error"
        return Outcome(kind, message=exc.message, status=exc.status)
    except httpx.HTTPError as exc:
        return Outcome("failure", message=f"{type(exc).__name__}: {exc}"[:300])
    confidences = [{"label": name, "confidence": score} for name, score in answer.labels]
    label = {"label": answer.labels[0][0] if answer.labels else None, "confidences": confidences}
    return Outcome("answer", label=label, info=answer.cache_info)


def _differ(a: Case, b: Case) -> bool:
    """Whether two references can be told apart: another top class or a score past the tolerance."""
    la, lb = dict(a.expect.labels), dict(b.expect.labels)
    return la.keys() != lb.keys() or any(abs(la[n] - lb[n]) > SCORE_TOLERANCE for n in la)


Leg = tuple[str, Case, Case, list[Observation]]  # transport, A, B, the answers (A, B on B, B on A)


def _legs(run: Run, *, collide: bool) -> list[Leg]:
    """Pairs through each transport: xxh3 collision pairs, or (`collide` False) as many pairs
    of the same kinds and sizes that never collided, for the quiet windows' ordinary misses."""
    built: list[tuple[str, str, str, tuple[Any, Any], str]] = []
    for n, transport in enumerate(("gradio", "rest")):
        filler = ("please help me with my account ", "where is the refund for my order ")[n]
        if collide:
            texts, pngs, bmps = text_pair(filler), png_pair(seed=n + 1), bmp_upload_pair(seed=n + 1)
        else:  # the first of two pairs each: unrelated inputs of the same kind and size
            texts = (text_pair(filler + "today ")[0], text_pair(filler + "now ")[0])
            pngs = (png_pair(seed=n + 5)[0], png_pair(seed=n + 7)[0])
            bmps = (bmp_upload_pair(seed=n + 5)[0], bmp_upload_pair(seed=n + 7)[0])
        built += [
            (transport, "text", "text raw key", texts, "m.txt"),
            (transport, "image", "PNG canonical key", pngs, "pair.png"),
            (transport, "image", "BMP upload key", bmps, "pair.bmp"),
        ]
    legs: list[Leg] = []
    for transport, task, what, (raw_a, raw_b), name in built:
        label = f"{what} via {transport}" + ("" if collide else " (control)")
        group = "collision" if collide else "collision control"
        a = run.ctx.oracle.case(f"{label} A", task, raw_a, name=name, group=group)
        b = run.ctx.oracle.case(f"{label} B", task, raw_b, name=name, group=group)
        legs.append((transport, a, b, []))
    return legs


def _planter(run: Run, legs: list[Leg]) -> Attacker:
    """Sends A to replica A, then B to replica B and to A again, for a share of `legs` in each
    of the frame's windows."""
    ctx, todo = run.ctx, list(legs)
    share = -(-len(legs) // ROUNDS)

    def plant(index: int, deadline: float, replies: Replies) -> None:
        gradio = [FaultClient(app.url, timeout_s=ctx.sizes.request_timeout_s) for app in ctx.apps]
        rest = [OipHttpClient(app.url, timeout_s=ctx.sizes.request_timeout_s) for app in ctx.apps]
        mine, todo[:] = todo[:share], todo[share:]
        try:
            for transport, a, b, observed in mine:
                for case, replica in ((a, 0), (b, 1), (b, 0)):
                    sent_at = time.monotonic()
                    if transport == "gradio":
                        outcome = gradio[replica].classify(case.task, case.raw, case.name)
                    else:
                        outcome = _rest_outcome(rest[replica], case.task, case.raw)
                    observed.append(run.record(case, replica, sent_at, outcome, 0))
        finally:
            for client in (*gradio, *rest):
                client.close()

    return plant


def collision_pair(run: Run) -> None:
    """Pairs of inputs whose keys used to collide (xxh3-128, bench/collisions.py): A is sent
    first to replica A, then B to replica B and to replica A again, through Gradio's HTTP API
    and through REST. Every answer to B must be B's own (its reference), under its own key.
    The quiet windows carry as many ordinary new pairs (the same kinds and sizes), so /healthz
    is compared with the cost of ordinary misses."""
    ctx = run.ctx
    planted, control = _legs(run, collide=True), _legs(run, collide=False)
    alike = [a.id.removesuffix(" A") for _, a, b, _ in planted if not _differ(a, b)]
    run.figure("pairs whose own answers cannot be told apart (judged by key alone)", alike or "none")
    plant, ordinary = _planter(run, planted), _planter(run, control)
    under_attack(run, plant, attackers=1, unrefused_bytes=None, control=ordinary)
    shared = []
    for _, a, _, observed in planted:
        keys = [key_of(o) for o in observed]
        if len(keys) < 3 or None in keys or keys[0] in keys[1:]:
            shared.append(f"{a.id.removesuffix(' A')}: keys {keys}")
    bs = [o for *_, observed in planted for o in observed[1:]]
    run.figure("B's answers by tier", tiers(bs))
    run.check("every pair planted: A, then B on the other replica and on the same one",
              all(len(observed) == 3 for *_, observed in planted), f"{len(planted)} pairs")  # fmt: skip
    run.check("B never answered under A's key", not shared, "; ".join(shared)[:600])
    wrong = [f"{o.case.id} on {ctx.apps[o.replica].name}: {o.reason}" for o in bs if o.verdict != "ok"]
    run.check("every answer to B is B's own (its reference)", not wrong, "; ".join(wrong)[:600])
