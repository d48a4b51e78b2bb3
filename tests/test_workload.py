"""The workload benchmark's machinery on a handful of requests, so `bench/workload/` cannot rot.

Nothing here is timed: the figures of a run this small mean nothing. What is checked: the inputs
are distinct and reproducible, every system answers exactly what the model answers on every
input (cold, warm and after a restart), and a whole run (every system, both workloads, the HTTP
run) gives the right counts and ends with a summary line that parses.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench import peers
from bench.workload import cli, config, inprocess, inputs, processes, replay, report
from bench.workload.over_http import HitCost, HttpRun
from engine.inputs import clean_text
from storage.redis.embedded import EmbeddedRedis

IMAGES, MESSAGES = 5, 5


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """As the benchmark runs its models (concurrent clients, one intra-op thread each): with
    torch's default, a busy machine slows these tests down tenfold."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(config.THREADS)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def jobs() -> list[config.Job]:
    return inputs.make_inputs(IMAGES, MESSAGES)


@pytest.fixture(scope="module")
def model_sets(real_models, torch_models) -> dict[str, dict[str, Any]]:
    """The benchmark's two model sets: the peers' plain torch, the app's own backend."""
    return {config.TORCH_MODELS: torch_models, config.APP_MODELS: real_models}


def expected_answers(models: dict[str, Any], jobs: list[config.Job]) -> list[config.Labels]:
    """What the model itself says about every input, decoded the engine's way."""
    answers = []
    for task, raw in jobs:
        model = models[task]
        answers.append(replay.labels_of(model.predict_batch([model.canonicalize(raw)])[0]))
    return answers


def test_inputs_are_distinct_uploads_and_messages_and_reproducible(jobs, real_models) -> None:
    assert [task for task, _ in jobs] == ["image"] * IMAGES + ["text"] * MESSAGES
    images = [raw for task, raw in jobs if task == "image"]
    assert inputs.make_images(IMAGES) == images  # the same seed, the same bytes
    assert any(raw.startswith(inputs.PNG_MAGIC) for raw in images)
    assert any(raw.startswith(b"\xff\xd8") for raw in images)  # JPEG
    pixels = {
        hashlib.sha256(real_models["image"].canonicalize(raw).pixels.tobytes()).digest() for raw in images
    }
    assert len(pixels) == IMAGES

    messages = inputs.make_messages(300)
    assert messages[:MESSAGES] == [raw for task, raw in jobs if task == "text"]
    assert len({clean_text(m, max_chars=2000).text.lower() for m in messages}) == 300


def test_streams_follow_their_workload() -> None:
    zipf = inputs.zipf_stream(1000, 5000)
    assert len(zipf) == 5000 and zipf.min() >= 0 and zipf.max() < 1000
    assert np.array_equal(zipf, inputs.zipf_stream(1000, 5000))
    counts = np.bincount(zipf, minlength=1000)
    assert counts.max() > 0.1 * len(zipf)  # the hottest input: about 16% of a Zipf(1.1) stream
    assert len(np.unique(zipf)) < 1000

    unique = inputs.unique_stream(1000, 400)
    assert len(unique) == len(np.unique(unique)) == 400
    streams = inputs.make_streams(1000, 5000)
    assert len(streams["unique"]) == inputs.unique_requests(5000, 1000) == 1000


@pytest.mark.redis
def test_every_system_answers_like_the_model_on_every_input(
    jobs, model_sets, redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    base_url = redis_server.url.rsplit("/", 1)[0]
    for db, name in enumerate(config.ALL_SYSTEMS):
        # Exactly the answers of the models the system runs (the app's backend agrees with
        # torch within 1e-5, not bit for bit: tests/test_onnx_backend.py).
        expected = expected_answers(model_sets[config.models_of(name)], jobs)
        models = peers.counting(model_sets[config.models_of(name)])
        system = inprocess.build_system(
            name, models, redis_url=f"{base_url}/{db}", data_dir=tmp_path / name, device="cpu"
        )
        try:
            for attempt in ("cold", "warm", "after a restart"):
                for index, (task, raw) in enumerate(jobs):
                    prediction, _ = system.classify(task, raw)
                    assert replay.labels_of(prediction) == expected[index], (name, attempt, index)
                if attempt == "warm":
                    system.restart()
        finally:
            system.close()
        calls = sum(m.calls for m in models.values())
        # nocache: every request; gr.cache and ours without Redis: again after the restart;
        # the others keep Redis.
        runs = {"nocache": 3, "nocache-app": 3, "nocache-twin": 3, "grcache": 2, "ours-l1": 2}.get(name, 1)
        assert calls == runs * len(jobs), name


@pytest.mark.redis
def test_a_small_run_counts_right_and_ends_with_the_summary(
    jobs, model_sets, redis_binary, tmp_path
) -> None:
    small = config.Config(
        requests=30, images=IMAGES, messages=MESSAGES, clients=4, segments=2, isolated=False, http=True,
        hit_samples=10, rss_calls=8, miss_inputs=2,
    )  # fmt: skip
    run = cli.run_benchmark(small, models=model_sets, log=lambda _: None, workdir=tmp_path)
    streams = inputs.make_streams(len(jobs), small.requests)
    expected = expected_answers(model_sets[config.TORCH_MODELS], jobs)  # within the tolerance: any set

    for name, stream in streams.items():
        by_system = run.results[name]
        assert list(by_system) == list(config.SYSTEMS)
        distinct = set(stream.tolist())
        for system, result in by_system.items():
            assert result.requests == len(stream), (name, system)
            assert np.all(result.latencies_ms > 0)
            assert result.wall_s > 0 and result.throughput > 0
            assert set(result.answers) == distinct
            # Within the tolerance: concurrent text misses may share a batch (engine.capacity.batching).
            assert all(replay.same_answer(result.answers[i], expected[i]) for i in distinct), (name, system)
            assert not result.disagreements
        assert by_system["nocache"].model_calls == len(stream)
        assert by_system["ours"].model_calls == len(distinct)  # L2 survives the restart; no duplicates
        assert sum(by_system["ours"].tiers.values()) == len(stream)
        assert by_system["ours"].redis_mib is not None and by_system["seed"].redis_mib is not None
    assert run.results["unique"]["ours"].hit_ratio == 0.0
    assert run.results["zipf-restart"]["ours"].restart_s is not None

    assert run.http is not None and set(run.http.results) == set(config.HTTP_SYSTEMS)
    zipf = streams["zipf-restart"]
    for system, result in run.http.results.items():
        assert result.requests == len(zipf)
        assert all(replay.same_answer(result.answers[i], expected[i]) for i in set(zipf.tolist())), system
        assert not result.disagreements
    for path in ("ours", "ours-rest"):  # this app's two front doors, each its own server and Redis
        assert run.http.results[path].model_calls == len(set(zipf.tolist())), path
        assert sum(run.http.results[path].tiers.values()) == len(zipf), path
    # Cached answers one at a time: Gradio with and without a session hash, REST without; every
    # one of this app's answers a hit (the inputs are the stream's hottest, all cached by then).
    cells = {(h.path, h.session, h.task): h for h in run.http.hits}
    assert set(cells) == {
        (path, session, task)
        for path, sessions in (("grcache", (True, False)), ("ours", (True, False)), ("ours-rest", (None,)))
        for session in sessions
        for task in ("text", "image")
    }
    for (path, _, _), hit in cells.items():
        assert hit.n == 10 and all(ms > 0 for ms in hit.latencies_ms)
        if path != "grcache":
            assert set(hit.tiers) <= {"l1", "l2"}, (path, hit.tiers)
    assert [m.path for m in run.http.memory] == list(config.HTTP_SYSTEMS)
    assert all(m.calls == 8 for m in run.http.memory)

    line = report.summary_line(run.values)
    values = report.parse_summary(line)
    assert set(values) == set(report.SUMMARY_KEYS)
    assert values["hit_ratio"] == pytest.approx(run.results["zipf-restart"]["ours"].hit_ratio, abs=1e-3)
    assert all(v > 0 for key, v in values.items() if key != "hit_ratio"), values  # every ratio measured
    gradio, rest = run.http.results["ours"], run.http.results["ours-rest"]
    assert values["rest_vs_grcache"] == pytest.approx(
        rest.throughput / run.http.results["grcache"].throughput, rel=0.01
    )
    assert values["gradio_vs_grcache"] * run.http.results["grcache"].throughput == pytest.approx(
        gradio.throughput, rel=0.01
    )
    assert values["rest_hit_p50_vs_gradio"] == pytest.approx(
        cells[("ours-rest", None, "text")].percentile(50) / cells[("ours", True, "text")].percentile(50),
        rel=0.01,
    )
    assert not any(" differ" in line for line in run.lines if line.startswith("answers"))

    written, chart = tmp_path / "REPORT.md", tmp_path / "chart.html"
    written.write_text(f"old table\n{config.NOTES_MARKER}\nkept notes\n")
    report.write_report(run, written, "python -m bench.workload --test")
    report.write_chart(run, chart)
    text = written.read_text()
    assert "old table" not in text and text.endswith(f"{config.NOTES_MARKER}\nkept notes\n")
    assert line in text and "python -m bench.workload --test" in text
    assert "plotly" in chart.read_text()


def test_the_command_line_prints_the_summary_last(model_sets, redis_binary, capsys) -> None:
    small = {
        "--requests": "10",
        "--images": "2",
        "--messages": "2",
        "--segments": "1",
        "--systems": "nocache,ours",
        "--miss-inputs": "0",
    }
    argv = [*(part for pair in small.items() for part in pair), "--no-inputs-cache"]
    assert cli.main(argv, models=model_sets) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    values = report.parse_summary(last)
    assert values["speedup_vs_nocache"] > 0 and np.isnan(values["speedup_vs_seed"])


def test_the_summary_line_is_strict() -> None:
    good = (
        "SUMMARY speedup_vs_nocache=7.10 speedup_vs_grcache=1.50 speedup_vs_seed=1.30 "
        "unique_vs_nocache=0.97 speedup_vs_nocache_app=4.20 miss_cpu_vs_torch_image=0.48 "
        "miss_cpu_vs_torch_text=0.41 hit_ratio=0.882 gradio_vs_grcache=1.62 rest_vs_grcache=5.40 "
        "rest_hit_p50_vs_gradio=0.120"
    )
    assert report.parse_summary(good)["hit_ratio"] == 0.882
    assert report.parse_summary(good)["rest_hit_p50_vs_gradio"] == 0.12
    assert report.summary_line(report.parse_summary(good)) == good
    without_http = good.split(" gradio_vs_grcache")[0]
    with pytest.raises(ValueError):  # every key, always: nan where it was not measured
        report.parse_summary(without_http)
    for bad in (good.replace("SUMMARY", "summary"), good + " extra=1", good.replace("=7.10", "=fast")):
        with pytest.raises(ValueError):
            report.parse_summary(bad)


def test_attribution_systems_are_opt_in_and_get_their_ratio_rows() -> None:
    def result(name: str, wall_s: float) -> replay.Result:
        result = replay.Result(name, "unique")
        result.add(replay.Segment(np.ones(10), wall_s, 0.1, Counter(miss=10), []))
        return result

    assert not set(config.ATTRIBUTION_SYSTEMS) & set(config.SYSTEMS)
    names = {"nocache": 1.0, "ours": 1.0, "ours-l1": 0.5, "ours-tcp": 4.0, "ours-nobatch": 5.0}
    names["nocache-twin"] = 2.0
    table = report.ratio_table({"unique": {name: result(name, wall) for name, wall in names.items()}})
    rows = {line.split("  ")[0]: line for line in table.splitlines()}
    assert "0.50x" in rows["unique: ours / ours-l1"]
    assert "0.50x" in rows["unique: nocache-twin / nocache"]
    assert "0.25x" in rows["unique: ours-tcp / ours"]
    assert "0.20x" in rows["unique: ours-nobatch / ours"]
    assert "1.00x" in rows["unique: ours / nocache"]


@pytest.mark.redis
@pytest.mark.parametrize("tcp", [False, True])
def test_the_benchmarks_redis_is_like_the_apps_private_one(redis_binary, tmp_path, tcp) -> None:
    import redis

    with processes.fresh_redis(tmp_path / "redis", tcp=tcp) as server:
        assert server.url.startswith("redis://127.0.0.1:" if tcp else "unix://")
        client = redis.Redis.from_url(server.url, decode_responses=True)
        try:
            found = client.config_get("*")
            assert int(found["maxmemory"]) == config.REDIS_MAXMEMORY_MB * 1024 * 1024
            assert found["maxmemory-policy"] == "allkeys-lru"
            assert (found["port"] != "0") == tcp and bool(found["unixsocket"]) != tcp
        finally:
            client.close()


def _stream_result(system: str, requests: int, cpu_ms: float, model_calls: int) -> replay.Result:
    return replay.Result(system, "zipf-restart (HTTP)", latencies_ms=np.ones(requests),
                  cpu_s=cpu_ms * requests / 1000, model_calls=model_calls)  # fmt: skip


def _hit(path: str, session: bool | None, task: str, cpu_ms: float) -> HitCost:
    return HitCost(path, session, task, latencies_ms=[1.0] * 10, cpu_s=cpu_ms * 10 / 1000)


def test_the_report_shows_the_ceiling_each_http_target_meets() -> None:
    # 1,000 requests, 900 hits; text hits cost 1 ms and image hits 3 ms through Gradio (the
    # stream half of each): ours 5 ms a request = 0.9 x 2 ms + 3.2 ms of the rest; grcache 15 ms.
    http = HttpRun(
        results={"grcache": _stream_result("grcache", 1000, 15.0, 150),
                 "ours": _stream_result("ours", 1000, 5.0, 100),
                 "ours-rest": _stream_result("ours-rest", 1000, 2.0, 100)},
        hits=[_hit("ours", True, "text", 0.8), _hit("ours", False, "text", 1.2),
              _hit("ours", True, "image", 3.0), _hit("ours", False, "image", 3.0),
              _hit("ours-rest", None, "text", 0.2), _hit("ours-rest", None, "image", 0.6)],
        memory=[], sessions="half", task_share={"text": 0.5, "image": 0.5},
    )  # fmt: skip
    gradio, rest = report.ceiling_lines(http)
    assert "ours 5.00 ms = hits 0.900 x 2.00 ms + the rest (misses, queueing) 3.20 ms" in gradio
    assert "with free hits 4.69x" in gradio and "the target needs hits <= 2.00 ms" in gradio
    # REST: 2.0 - 0.9 x 0.4 = 1.64 ms of the rest; 15 / 8 = 1.875 leaves 0.26 ms a hit.
    assert "the rest (misses, queueing) 1.64 ms" in rest and "the target needs hits <= 0.26 ms" in rest
    slower_misses = HttpRun({**http.results, "ours-rest": _stream_result("ours-rest", 1000, 2.5, 100)},
                            http.hits, [], "half", http.task_share)  # fmt: skip
    assert "out of reach even with free hits" in report.ceiling_lines(slower_misses)[1]
