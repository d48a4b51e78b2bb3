"""The frame of a hostile-input scenario: attackers against replica A while normal clients
keep working and a poller watches A's /healthz; then what the attack cost, judged.

`under_attack` warms a share of the load's inputs (so the normal clients' answers are mostly
hits and the quiet and attacked windows carry the same work), starts the normal clients on A
and B and the /healthz poller on A (`faults.healthz`, a process of its own), then runs
ROUNDS rounds of a quiet window and an attack window, `attack_s` of attack in all, with
everything else still going. Checked afterwards:

- A's /healthz p99 in the attack windows within `HealthVerdict.bound_s` of its quiet p99;
- every attacker request refused (a 4xx, or the connection closed by the server), never a
  5xx, never accepted, never still being read past `unrefused_bytes`;
- each app's peak resident memory (VmHWM, reset when the rounds begin) less than
  `RSS_GROWTH_MB` above its resident memory then;
- both apps still running, no traceback in their logs, normal clients answered during the
  attack (every answer judged as usual by `Run.record`).

`exchange` is the attackers' raw HTTP/1.1 client: it writes a head and a body given as
pieces (generated, never held whole) while reading, so a refusal is seen the moment it comes.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx

from faults.harness import Run, split
from faults.healthz import HealthPoller, p99
from faults.processes import peak_rss_mb, reset_peak_rss, rss_mb

# The /healthz p99 bound: twice the quiet p99, and never below quiet + HEALTH_FLOOR_S. On the
# 2-CPU development machine, shared with other work, a quiet window's p99 was 7-120 ms and a
# window with no attack at all came out up to 43 ms above the quiet one before it, now and
# then; hence the floor, and a second measurement before a broken bound counts. What the
# bound is for costs far more: 12 s (a shape), every poll timing out (a header stream).
HEALTH_FLOOR_S = 0.025
HEALTH_RECHECK_BELOW_S = 1.0
# Peak resident memory an app may gain during an attack: the attacks of issue 23 cost +0.5 GB
# (headers) to +2.9 GB (Gradio bodies, measured here on the code before its fix); a bounded
# request costs at most its limit (1 MiB of Gradio body, 32 KB of head) per open connection.
RSS_GROWTH_MB = 100.0
LOAD_SHARE = 0.25  # of the pool, warmed, then sent by the normal clients
# Each normal client waits this long after each answer: a steady load (~15 requests a second
# per client) rather than one that saturates both CPUs, which would leave /healthz's quiet
# p99 at hundreds of ms and the 2x bound blind.
LOAD_PAUSE_S = 0.05
ROUNDS = 3  # quiet and attacked windows, interleaved
REPLY_WAIT_S = 10.0  # for an answer once every byte of a request is sent
MIB = 2**20


@dataclass(frozen=True)
class Reply:
    """What one attacker request got."""

    kind: str  # the attack variant
    outcome: str  # "refused" | "closed" | "accepted" | "server error" | "no answer" | "cut short"
    status: int | None = None
    sent: int = 0  # bytes
    seconds: float = 0.0
    detail: str = ""

    def judged(self, unrefused_bytes: int) -> str | None:
        """None when the server refused it properly; otherwise what went wrong."""
        if self.outcome in ("refused", "closed"):
            return None
        if self.outcome == "cut short" and self.sent <= unrefused_bytes:
            return None  # stopped by the attack's end, still within what the server may read
        what = {"cut short": "still being read (not refused)"}.get(self.outcome, self.outcome)
        status = f" {self.status}" if self.status is not None else ""
        return (f"{self.kind}: {what}{status} after {self.sent / MIB:.2f} MiB sent in {self.seconds:.1f}s"
                + (f": {self.detail[:160]!r}" if self.detail else ""))  # fmt: skip


def status_outcome(status: int, body: str) -> str:
    if status >= 500 or "Traceback" in body:
        return "server error"
    return "refused" if 400 <= status < 500 else "accepted"


class Replies:
    """The attackers' replies, from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.items: list[Reply] = []

    def add(self, reply: Reply) -> None:
        with self._lock:
            self.items.append(reply)


def exchange(
    address: tuple[str, int],
    kind: str,
    head: bytes,
    body: Iterable[bytes],
    *,
    until: float,
    pace_s: float = 0.0,
) -> Reply:
    """Send `head` then `body`'s pieces (sleeping `pace_s` between them) while reading, until
    the server answers or closes, or `until` passes (then the reply is "cut short"). Once
    every piece is sent, the answer is awaited for REPLY_WAIT_S more."""
    started = time.monotonic()
    sent, received = 0, b""

    def reply(outcome: str, status: int | None = None, detail: str = "") -> Reply:
        return Reply(kind, outcome, status, sent, time.monotonic() - started, detail)

    def answered() -> Reply:
        line, _, rest = received.partition(b"\r\n")
        try:
            status = int(line.split()[1])
        except (IndexError, ValueError):
            return reply("server error", None, f"not HTTP: {received[:120]!r}")
        text = rest.decode("latin-1")
        return reply(status_outcome(status, text), status, text.partition("\r\n\r\n")[2][:300])

    try:
        sock = socket.create_connection(address, timeout=5.0)
    except OSError as exc:
        return reply("server error", None, f"cannot connect: {exc!r}")
    pieces = itertools.chain([head], body)
    pending: bytes | None = b""
    with sock:
        sock.setblocking(False)
        try:
            wait_until = until
            while b"\r\n\r\n" not in received:
                if pending == b"":
                    if pace_s and sent:
                        time.sleep(pace_s)
                    pending = next(pieces, None)
                    if pending is None:  # all sent: the server owes an answer
                        wait_until = time.monotonic() + REPLY_WAIT_S
                if time.monotonic() > wait_until:
                    return reply("cut short" if pending is not None else "no answer")
                readable, writable, _ = select.select([sock], [sock] if pending else [], [], 0.05)
                if readable:
                    data = sock.recv(65536)
                    if not data:
                        return reply("closed")
                    received += data
                if writable and pending:
                    done = sock.send(pending[:65536])
                    sent, pending = sent + done, pending[done:]
            time.sleep(0.02)  # the rest of a short answer
            try:
                received += sock.recv(65536)
            except OSError:
                pass
            return answered()
        except OSError:  # reset or broken pipe: the server closed while we were sending
            return answered() if b"\r\n\r\n" in received else reply("closed")


def post_outcome(http: httpx.Client, kind: str, path: str, body: bytes, headers: dict[str, str]) -> Reply:
    """An ordinary POST (httpx) judged as an attacker's request."""
    started = time.monotonic()
    try:
        response = http.post(path, content=body, headers=headers)
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        return Reply(kind, "closed", seconds=time.monotonic() - started, detail=type(exc).__name__)
    except httpx.HTTPError as exc:
        return Reply(kind, "no answer", seconds=time.monotonic() - started, detail=repr(exc)[:200])
    return Reply(kind, status_outcome(response.status_code, response.text), response.status_code,
                 seconds=time.monotonic() - started, detail=response.text[:300])  # fmt: skip


Attacker = Callable[[int, float, Replies], None]  # (index, deadline, replies)


def under_attack(
    run: Run,
    attacker: Attacker,
    *,
    attackers: int | None = None,
    unrefused_bytes: int | None = 4 * MIB,
    control: Attacker | None = None,
    beside: contextlib.AbstractContextManager[object] | None = None,
) -> Replies:
    """Run `attackers` threads of `attacker` for `attack_s` in all, in the frame above: ROUNDS
    rounds of a quiet window then an attack window, each `attack_s / ROUNDS` long, so that the
    machine's own ups and downs weigh on both alike. Should /healthz break its bound by less
    than a second, the rounds are measured once more and that measurement decides (see
    HEALTH_FLOOR_S).
    `control`, if any, runs as the attackers do in the quiet windows: ordinary requests of
    the same work, the baseline for an attack made of ordinary-looking requests (a second
    measurement, if any, sends the attackers' next requests: new ones of the same kinds).
    `unrefused_bytes`
    None: the attackers' requests are answered, not refused (judged by the scenario).
    `beside`, if any, is entered with the normal clients, after the warm-up: another client's
    work, judged by the scenario."""
    ctx, sizes = run.ctx, run.ctx.sizes
    cases, _ = split(ctx.pool, LOAD_SHARE)
    run.send_many(cases, [0, 1], sizes.threads)  # the normal clients' inputs, now cached
    replies = Replies()
    marks = {app.name: _log_size(app.log_path) for app in ctx.apps}
    count = attackers or sizes.attackers
    attack_spans: list[tuple[float, float]] = []
    verdicts: list[HealthVerdict] = []

    def measure() -> HealthVerdict:
        quiet_spans, window_s = [], sizes.attack_s / ROUNDS
        for _ in range(ROUNDS):
            quiet_from = time.monotonic()
            if control is None:
                time.sleep(window_s)
            else:
                _threads(control, count, quiet_from + window_s, Replies(), sizes.request_timeout_s)
            started = time.monotonic()
            quiet_spans.append((quiet_from, started))
            _threads(attacker, count, started + window_s, replies, sizes.request_timeout_s)
            attack_spans.append((started, time.monotonic()))
        return HealthVerdict.of(health.windows(quiet_spans), health.windows(attack_spans[-ROUNDS:]))

    load = run.load(cases, [0, 1], pause_s=LOAD_PAUSE_S)
    with (
        HealthPoller(ctx.apps[0].url, ctx.work / f"{run.result.name}-healthz.txt") as health,
        load,
        beside or contextlib.nullcontext(),
    ):
        time.sleep(0.5)  # the clients' first requests and connections
        rss_before = {app.name: rss_mb(app.pid) if reset_peak_rss(app.pid) else None for app in ctx.apps}
        verdicts.append(measure())
        if verdicts[0].worth_a_second_look:
            verdicts.append(measure())
    peaks = {app.name: peak_rss_mb(app.pid) for app in ctx.apps}
    _judge_health(run, verdicts)
    if unrefused_bytes is not None:
        _judge_replies(run, replies.items, unrefused_bytes)
    _judge_memory(run, rss_before, peaks)
    during = [o for start, end in attack_spans for o in run.between(start, end)]
    slowest = max((o.done_at - o.sent_at for o in during), default=0.0)
    attacked_s = sum(end - start for start, end in attack_spans)
    run.figure(
        "attack", f"{count} attackers, {attacked_s:.1f}s in {len(attack_spans)} windows after quiet ones"
    )
    run.figure("normal clients during the attack", f"{len(during)} requests, slowest {slowest:.2f}s")
    run.check("normal clients were answered during the attack", any(o.verdict == "ok" for o in during),
              f"{len(during)} requests")  # fmt: skip
    alive = [app.name for app in ctx.apps if app.process is not None and app.process.poll() is None]
    run.check("both apps still running", len(alive) == len(ctx.apps), f"running: {alive}")
    _judge_logs(run, marks)
    return replies


def _threads(attacker: Attacker, count: int, deadline: float, replies: Replies, timeout_s: float) -> None:
    """`count` threads of `attacker` until `deadline`, and until they return."""
    threads = [
        threading.Thread(target=attacker, args=(i, deadline, replies), name=f"attacker-{i}", daemon=True)
        for i in range(count)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()) + timeout_s)


@dataclass(frozen=True)
class HealthVerdict:
    """/healthz's p99 in the quiet and the attacked windows of one measurement."""

    quiet_p99_s: float
    attacked_p99_s: float
    quiet_polls: int
    attacked_polls: int
    slowest_s: float
    failed: int

    @classmethod
    def of(cls, quiet: tuple[list[float], int], attacked: tuple[list[float], int]) -> HealthVerdict:
        (q, _), (a, failed) = quiet, attacked
        return cls(p99(q), p99(a), len(q), len(a), max(a, default=math.inf), failed)

    @property
    def bound_s(self) -> float:
        return max(2 * self.quiet_p99_s, self.quiet_p99_s + HEALTH_FLOOR_S)

    @property
    def ok(self) -> bool:
        polled = self.quiet_polls > 0 and self.attacked_polls > 0
        return polled and self.failed == 0 and self.attacked_p99_s <= self.bound_s

    @property
    def worth_a_second_look(self) -> bool:
        """Over the bound by as much as the machine's own noise (see HEALTH_FLOOR_S), no
        poll failed: measure again. A breach of a second or more is no noise."""
        return not self.ok and self.failed == 0 and self.attacked_p99_s < HEALTH_RECHECK_BELOW_S

    def __str__(self) -> str:
        ms = {name: f"{value * 1e3:.1f} ms" for name, value in vars(self).items() if name.endswith("_s")}
        text = (f"p99 {ms['attacked_p99_s']} over {self.attacked_polls} polls (slowest {ms['slowest_s']}, "
                f"{self.failed} failed) vs quiet p99 {ms['quiet_p99_s']} over {self.quiet_polls}: bound "
                f"{self.bound_s * 1e3:.1f} ms")  # fmt: skip
        if self.attacked_p99_s > self.bound_s:
            times = self.attacked_p99_s / max(self.quiet_p99_s, 1e-9)
            text += f", over by {(self.attacked_p99_s - self.bound_s) * 1e3:.0f} ms ({times:.1f}x quiet)"
        return text


def _judge_health(run: Run, verdicts: list[HealthVerdict]) -> None:
    shown = " / ".join(f"{v.quiet_p99_s * 1e3:.1f} / {v.attacked_p99_s * 1e3:.1f} ms" for v in verdicts)
    run.figure(
        "/healthz on A, quiet / attacked p99" + (" (measured twice)" if len(verdicts) > 1 else ""), shown
    )
    detail = str(verdicts[-1]) + (f"; first measurement: {verdicts[0]}" if len(verdicts) > 1 else "")
    floor_ms = HEALTH_FLOOR_S * 1e3
    run.check(f"A's /healthz p99 during the attack <= max(2 x quiet, quiet + {floor_ms:.0f} ms), none failed",
              verdicts[-1].ok, detail)  # fmt: skip


def _judge_replies(run: Run, replies: list[Reply], unrefused_bytes: int) -> None:
    counts = Counter(f"{r.kind}: {r.outcome}" + (f" {r.status}" if r.status else "") for r in replies)
    run.figure("attacker requests", dict(sorted(counts.items())))
    wrong = [problem for r in replies if (problem := r.judged(unrefused_bytes)) is not None]
    for problem, count in Counter(wrong).most_common(6):
        run.result.problems.append(problem + (f"  (x{count})" if count > 1 else ""))
    detail = f"{len(replies) - len(wrong)} of {len(replies)} refused"
    if wrong:
        detail += f"; {len(wrong)} not: {wrong[0]}"
    run.check(f"every attacker request refused (4xx or closed), none read past {unrefused_bytes / MIB:g} MiB",
              bool(replies) and not wrong, detail)  # fmt: skip


def _judge_memory(run: Run, before: dict[str, float | None], peaks: dict[str, float | None]) -> None:
    grown = {name: None if before[name] is None or peaks[name] is None else peaks[name] - before[name]
             for name in before}  # fmt: skip
    shown = ", ".join(f"{n} {'n/a' if g is None else f'{g:+.0f} MB'}" for n, g in grown.items())
    run.figure("peak RSS growth during the attack", shown)
    ok = all(g is not None and g < RSS_GROWTH_MB for g in grown.values())
    run.check(f"each app's peak RSS grew < {RSS_GROWTH_MB:.0f} MB", ok, shown)


def _judge_logs(run: Run, marks: dict[str, int]) -> None:
    tracebacks, refusals = {}, 0
    for app in run.ctx.apps:
        with open(app.log_path, "rb") as log:
            log.seek(marks[app.name])
            text = log.read().decode("utf-8", "replace")
        tracebacks[app.name] = text.count("Traceback")
        refusals += sum("refused" in line.lower() for line in text.splitlines())
    run.figure("app log lines saying 'refused'", refusals)
    run.check("no traceback in the apps' logs", not any(tracebacks.values()), str(tracebacks))


def _log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
