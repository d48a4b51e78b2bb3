"""Is caching worth it (admin.insights.verdict) and the CSV downloads (admin.console.exports), from the
request log on SQLite and on PostgreSQL, through the admin API over HTTP."""

from __future__ import annotations

import csv
import io
import urllib.error
import urllib.request

import pytest

from admin.console.exports import _cell
from admin.insights.verdict import duration, window_name
from storage.redis.embedded import EmbeddedRedis
from tests.conftest import CountingTextModel
from tests.test_sizing import TOKEN, get


def get_text(url: str, token: str | None = TOKEN) -> tuple[int, str, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers.get("content-disposition", ""), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, "", exc.read().decode()


def test_worth_verdict_and_csv_from_the_request_log(
    serve, redis_server: EmbeddedRedis, database_url: str
) -> None:
    url, runtime = serve(
        models={"text": CountingTextModel(delay_s=0.05)}, redis__url=redis_server.url,
        server__admin_token=TOKEN, log__database_url=database_url, console__model_cost_per_hour=36.0,
    )  # fmt: skip
    for message in ["a", "a", "a", "b", "b", "c"]:
        runtime.engine.classify("text", message)
    status, body = get(url + "/admin/api/worth?window=24h")
    assert status == 200, body
    text = body["tasks"]["text"]
    figures = (text["requests"], text["distinct_inputs"], text["repeat_ratio"], text["hit_ratio"])
    assert figures == (6, 3, 0.5, 0.5)
    assert text["model_seconds_saved"] == pytest.approx(0.15, abs=0.05)  # 3 hits x ~50 ms a miss
    assert text["cost_saved"] == pytest.approx(text["model_seconds_saved"] / 100, abs=1e-4)  # 36 an hour
    assert body["overall"]["verdict"].startswith(
        "50 % of requests repeat an earlier input; the cache answered 50 % and saved 0 s of model time in 1 d"
    ), body["overall"]["verdict"]
    assert "Caching pays here." in body["overall"]["verdict"]
    assert get(url + "/admin/api/worth?window=-5")[0] == 400
    assert get(url + "/admin/api/worth", token=None)[0] == 401

    status, disposition, content = get_text(url + "/admin/api/requests.csv?window=1h")
    assert status == 200 and 'filename="requests-' in disposition
    rows = list(csv.DictReader(io.StringIO(content)))
    assert [r["tier"] for r in rows] == ["miss", "l1", "l1", "miss", "l1", "miss"]
    assert {r["task"] for r in rows} == {"text"} and all(r["time_utc"].endswith("+00:00") for r in rows)
    assert "a" not in {r["key_digest"] for r in rows}  # digests, never inputs
    assert get_text(url + "/admin/api/requests.csv?window=soon")[0] == 400
    assert get_text(url + "/admin/api/requests.csv", token=None)[0] == 401

    runtime.admin.flush("l1", actor="csv-test")
    status, disposition, content = get_text(url + "/admin/api/audit.csv")
    audit = list(csv.DictReader(io.StringIO(content)))
    assert status == 200 and [(r["action"], r["actor"]) for r in audit] == [("flush", "csv-test")]


def test_verdicts_in_plain_words() -> None:
    assert (duration(41), duration(41 * 60), duration(3 * 3600)) == ("41 s", "41 min", "3.0 h")
    assert (window_name(86400), window_name(3600), window_name(300)) == ("1 d", "1 h", "5 min")
    assert _cell("=HYPERLINK(1)") == "'=HYPERLINK(1)" and _cell("tabby") == "tabby" and _cell(None) == ""


def test_low_repeat_says_caching_gains_little(make_runtime, database_url: str) -> None:
    runtime = make_runtime(
        models={"text": CountingTextModel()}, redis__url="off", log__database_url=database_url,
    )
    before = runtime.insights.worth("1h")["overall"]["verdict"]
    assert before.startswith("No answered requests in the last 1 h")
    for i in range(20):
        runtime.engine.classify("text", f"unique message {i}")
    runtime.engine.classify("text", "unique message 0")
    worth = runtime.insights.worth("1h")["overall"]
    assert worth["repeat_ratio"] == pytest.approx(1 / 21, abs=1e-3)
    assert "Inputs rarely repeat here" in worth["verdict"]
