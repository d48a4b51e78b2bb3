"""ui.simple_request and the protocol's whole-read answer (ui.limits): a plain request read in
one pass is taken apart as the parser would, anything else goes to the parser, and a server
answers every request the same either way."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from runtime import Runtime
from testing.raw_http import exchange
from tests.conftest import CountingTextModel, free_port
from ui import simple_request
from ui.limits import LimitedHttpToolsProtocol
from ui.server import serve_runtime
from ui.simple_request import SimpleRequestReader, read_simple_request

BODY = json.dumps({"inputs": [{"name": "input", "shape": [1], "datatype": "BYTES",
                               "data": ["read whole"]}]}).encode()  # fmt: skip
LIMITS = {"max_head_bytes": 32 * 1024, "max_url_bytes": 8 * 1024, "max_headers": 100, "max_body_bytes": 4096}


def post(path: bytes = b"/v2/models/text/infer", *, headers: bytes = b"", body: bytes = BODY,
         length: bytes | None = None, version: bytes = b"HTTP/1.1") -> bytes:  # fmt: skip
    declared = b"%d" % len(body) if length is None else length
    return (b"POST %b %b\r\nHost: x\r\nContent-Type: application/json\r\n%bContent-Length: %b\r\n\r\n%b"
            % (path, version, headers, declared, body))  # fmt: skip


def test_a_plain_request_is_read_as_the_parser_reads_it() -> None:
    request = read_simple_request(
        post(headers=b"X-Forwarded-For:   10.0.0.7 \t\r\nAccept:\r\nUser-Agent: a b\tc\r\n"), **LIMITS
    )
    assert request is not None
    assert (request.method, request.path, request.body) == ("POST", "/v2/models/text/infer", BODY)
    assert request.headers == [
        (b"host", b"x"), (b"content-type", b"application/json"), (b"x-forwarded-for", b"10.0.0.7"),
        (b"accept", b""), (b"user-agent", b"a b\tc"), (b"content-length", b"%d" % len(BODY)),
    ]  # fmt: skip
    path = "/gradio_api/call/classify_text/abc123"
    get = read_simple_request(b"GET %b HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode(), **LIMITS)
    assert get is not None and (get.method, get.path, get.body) == ("GET", path, b"")


@pytest.mark.parametrize(
    "data",
    [
        post(version=b"HTTP/1.0"),
        post(b"/v2/models/text/infer?x=1"),
        post(b"/v2/models/te%78t/infer"),
        post(b"/v2/health/ready"),
        post(b"/admin/api/flush"),
        post(headers=b"Transfer-Encoding: chunked\r\n"),
        post(headers=b"Expect: 100-continue\r\n"),
        post(headers=b"Connection: close\r\n"),
        post(headers=b"Connection: Upgrade\r\nUpgrade: h2c\r\n"),
        post(headers=b"Content-Length: 5\r\n"),  # twice
        post(headers=b"X-Folded: a\r\n b\r\n"),  # obs-fold
        post(headers=b"X-Name: caf\xc3\xa9\r\n"),  # not ASCII
        post(headers=b"X-Ctl: a\x01b\r\n"),
        post(headers=b"Bad Name: x\r\n"),
        post(headers=b": empty name\r\n"),
        post(length=b"-1"),
        post(length=b"+12"),
        post(length=b"1" * 8),
        post(length=b"10"),  # shorter than the body: the rest is a second request
        post(body=BODY, length=b"%d" % (len(BODY) + 5)),  # the body is not all here
        post() + post(),  # two requests in one read
        post(body=b"x" * 5000),  # over the body this path takes
        post(b"/v2/models/" + b"a" * 9000 + b"/infer"),  # over the URL limit
        post(headers=b"".join(b"X-H%d: v\r\n" % i for i in range(120))),  # over the header count
        post()[:-1],
        post().replace(b"\r\n\r\n", b"\r\n"),  # no end of head
        b"PUT /v2/models/text/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
        b"GET /gradio_api/call/f/1 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
        b"GET /gradio_api/call/f/1 HTTP/1.1\r\nHost: x\r\n\r\nGET /gradio_api/call/f/1 HTTP/1.1\r\n\r\n",
        b"POST  /v2/models/text/infer HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
        b"POST /v2/models/text/infer HTTP/1.1 \r\nContent-Length: 0\r\n\r\n",
        b"POST /v2/models/text/infer HTTP/1.1\r\n\r\n",  # no Content-Length
    ],
)  # fmt: skip
def test_anything_else_goes_to_the_parser(data: bytes) -> None:
    assert read_simple_request(data, **LIMITS) is None
    reader = SimpleRequestReader(**LIMITS)  # after a simple request, whose head it keeps
    assert reader.read(post()) is not None and reader.read(data) is None


def test_a_repeated_head_is_taken_apart_once_and_every_body_checked(monkeypatch) -> None:
    heads = []
    real = simple_request._read_head

    def counted(*args: Any, **kwargs: Any) -> Any:
        heads.append(args[0][:40])
        return real(*args, **kwargs)

    monkeypatch.setattr(simple_request, "_read_head", counted)
    reader = SimpleRequestReader(**LIMITS)
    data = post(headers=b"X-Forwarded-For: 10.0.0.7\r\n")
    first, second = reader.read(data), reader.read(data)
    assert first is not None and first == second == read_simple_request(data, **LIMITS)
    assert len(heads) == 2  # once by the reader, once by read_simple_request
    assert first.headers is not second.headers  # each request's scope has a list of its own
    same_length = BODY.replace(b"read whole", b"read other")
    same_head = post(headers=b"X-Forwarded-For: 10.0.0.7\r\n", body=same_length)
    assert reader.read(same_head).body == same_length
    assert reader.read(data[:-1]) is None  # the same head, a body short of its length
    assert reader.read(data + b"x") is None  # or longer
    assert len(heads) == 2
    other = post(b"/v2/models/other/infer")
    assert reader.read(other).path == "/v2/models/other/infer"
    assert reader.read(data) == first and len(heads) == 4  # another head, then the first again
    get = b"GET /gradio_api/call/f/1 HTTP/1.1\r\nHost: x\r\n\r\n"
    assert reader.read(get).method == "GET" and reader.read(get + b"{}") is None
    # A long head is read, but not kept: an idle connection holds a few hundred bytes at most.
    long_head = post(headers=b"X-Padding: %b\r\n" % (b"p" * 3000))
    heads.clear()
    assert [reader.read(long_head) is not None for _ in range(2)] == [True, True] and len(heads) == 2
    assert reader.read(get) is not None and len(heads) == 2  # the short head kept before it


@pytest.fixture
def served(make_runtime) -> Iterator[tuple[str, Runtime]]:
    runtime = make_runtime(models={"text": CountingTextModel()})
    server = serve_runtime(runtime, port=free_port())  # as `make run` serves
    try:
        yield server.url, runtime
    finally:
        server.close()


def _comparable(answer: tuple[list[bytes], bytes]) -> tuple[list[bytes], Any]:
    lines, body = answer
    kept = [line for line in lines if not line.lower().startswith((b"date:", b"content-length:"))]
    try:
        document = json.loads(body)
    except ValueError:
        return kept, body
    parameters = document.get("parameters", {})
    for info in [parameters, *json.loads(parameters.pop("cache_info", "[]"))]:
        info.pop("latency_ms", None), info.pop("age_s", None)
    return kept, document


def requests(message: str) -> list[bytes]:
    body = BODY.replace(b"read whole", message.encode())
    return [
        post(body=body),  # a miss, then hits
        post(body=body),
        post(headers=b"X-Forwarded-For: 10.1.2.3\r\n", body=body),
        post(b"/v2/models/text/versions/nope/infer"),
        post(b"/v2/models/nope/infer"),
        post(body=b'{"inputs": []}'),
        post(body=b"{not json"),
        post(headers=b"Connection: close\r\n"),
    ]


def test_a_server_answers_each_request_alike_read_whole_or_parsed(served, monkeypatch) -> None:
    url, runtime = served
    host, port = url.removeprefix("http://").split(":")
    taken: list[bool] = []
    real = SimpleRequestReader.read

    def spy(reader: SimpleRequestReader, data: bytes) -> Any:
        request = real(reader, data)
        taken.append(request is not None)
        return request

    monkeypatch.setattr(SimpleRequestReader, "read", spy)
    answers: dict[bool, list[Any]] = {}
    for at_once in (True, False):
        monkeypatch.setattr(LimitedHttpToolsProtocol, "answer_at_once", at_once)
        answers[at_once] = []
        runtime.engine.flush("all")  # the same misses and hits in each round
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            for request in requests("read whole"):
                answers[at_once].append(_comparable(exchange(sock, request)))
    count = len(answers[True])
    assert taken[:3] == [True, True, True] and not any(taken[count:])  # the parser alone when off
    assert answers[True] == answers[False]
    tiers = [answer[1]["parameters"]["tier"] for answer in answers[True][:3]]
    assert tiers == ["miss", "l1", "l1"]
    statuses = [answer[0][0] for answer in answers[True]]
    assert statuses[3:7] == [b"HTTP/1.1 404 Not Found"] * 2 + [b"HTTP/1.1 400 Bad Request"] * 2


def _read_answer(reader: Any) -> tuple[bytes, dict[str, Any]]:
    status, length = reader.readline(), 0
    while (line := reader.readline()) != b"\r\n":
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return status, json.loads(reader.read(length))


def test_a_pipelined_or_split_request_is_parsed_and_answered_in_order(served) -> None:
    host, port = served[0].removeprefix("http://").split(":")
    request = post()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        reader = sock.makefile("rb")
        sock.sendall(request)
        assert _read_answer(reader)[1]["parameters"]["tier"] == "miss"
        sock.sendall(request + request)  # two in one read
        sock.sendall(request[:20])  # and one in two reads
        time.sleep(0.1)
        sock.sendall(request[20:])
        for _ in range(3):
            status, answer = _read_answer(reader)
            assert status.startswith(b"HTTP/1.1 200"), status
            assert answer["parameters"]["tier"] == "l1", answer
