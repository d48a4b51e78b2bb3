"""Model lifecycle under faults: a live reload (engine.lifecycle.reload) while two replicas serve.

Two in-process replicas (`runtime.build_runtime` with a MODELS_CONFIG of a tiny text
classifier the scenario saves with `save_pretrained`, on the suite's Redis under their own
prefix) answer a steady load; new weights are copied into the model's folder and replica A
reloads it, which reaches B through the fleet channel. Passes when no request fails, every
answer equals what the model version it names gives for that input (within 1e-5), and no
request sent after the reload's acknowledgement gets the old version.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.models import SCORE_TOLERANCE
from faults.config import PREFIX, TOKEN
from faults.harness import Run
from settings import Settings

TEXTS = tuple(f"order {n}: where is my parcel number {n * 37 % 101}?" for n in range(40))
# A replica's record outlives 3 missed beats: 0.9 s here. At 0.1 s (0.3 s) a heartbeat thread
# starved of the GIL by the in-process load (100,000 requests in a few seconds) let a live
# replica's record expire mid-reload, and the acknowledgement named it as left.
FAST = {"fleet__generation_refresh_s": 0.1, "fleet__heartbeat_s": 0.3, "fleet__generation_confirm_s": 0.5}


@dataclass
class ReloadReport:
    sent: int = 0
    failed: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    stale_after_ack: list[str] = field(default_factory=list)  # old version, sent after the acknowledgement
    reload: dict[str, Any] = field(default_factory=dict)
    ack_s: float = 0.0  # from the reload call to its acknowledgement by every replica
    versions: dict[str, int] = field(default_factory=dict)  # answers per model version


def _own_answers(folder: Path) -> dict[str, dict[str, float]]:
    """What the model in `folder` gives for each text, computed without the app."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(str(folder), local_files_only=True).eval()
    answers = {}
    with torch.inference_mode():
        for text in TEXTS:
            probs = torch.softmax(model(**tokenizer(text, return_tensors="pt")).logits, dim=1)[0]
            answers[text] = {model.config.id2label[i]: float(p) for i, p in enumerate(probs)}
    return answers


def reload_under_load(
    redis_url: str, work: Path, *, prefix: str, load_s: float = 1.5, threads: int = 4
) -> ReloadReport:
    from runtime import build_runtime, load_models
    from testing.tiny_models import make_text_model, write_config

    folder = make_text_model(work / "model", seed=0)
    fresh = make_text_model(work / "fresh", seed=1)
    config = write_config(work / "models.yaml", [
        {"task": "support", "kind": "text-classification", "source": "transformers", "path": str(folder)},
    ])  # fmt: skip
    report = ReloadReport()
    expected: dict[str, dict[str, dict[str, float]]] = {}  # version -> text -> scores
    lock = threading.Lock()
    stop = threading.Event()
    observations: list[tuple[float, str, str]] = []  # (sent_at, text, version)

    with contextlib.ExitStack() as stack:
        replicas = []
        for name in ("A", "B"):
            settings = Settings.from_env({}).changed(
                server__data_dir=work / name, redis__url=redis_url, cache__prefix=prefix,
                server__admin_token=TOKEN, server__replica_id=f"models-{name}", models__models_config=config,
                quality__shadow_sample_rate=0.0, **FAST,
            )  # fmt: skip
            replicas.append(stack.enter_context(build_runtime(settings, model_factory=load_models)))
        old_version = replicas[0].engine.models["support"].version
        expected[old_version] = _own_answers(folder)

        def worker(index: int) -> None:
            rng = random.Random(index)
            while not stop.is_set():
                text, replica = rng.choice(TEXTS), replicas[rng.randrange(2)]
                sent_at = time.monotonic()
                try:
                    result = replica.engine.classify("support", text)
                except Exception as exc:  # judged as a failed request
                    with lock:
                        report.failed.append(f"{text!r}: {exc!r}")
                    continue
                with lock:
                    observations.append((sent_at, text, result.model_version))
                    answers = expected.get(result.model_version)
                if answers is None:
                    with lock:
                        report.wrong.append(f"{text!r}: unknown version {result.model_version}")
                    continue
                served = result.prediction.as_label_value()
                own = answers[text]
                if any(abs(score - own[label]) > SCORE_TOLERANCE for label, score in served.items()):
                    with lock:
                        report.wrong.append(f"{text!r}: {served} is not {own} ({result.model_version})")

        workers = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
        for w in workers:
            w.start()
        try:
            time.sleep(load_s / 2)
            shutil.copy(fresh / "model.safetensors", folder / "model.safetensors")  # the operator's copy
            new_answers = _own_answers(folder)
            started = time.monotonic()
            # The new version is known only once loaded: answers named by it are judged
            # against the new files' own answers (a version the loader computes from them).
            from engine.models.hf import folder_digest

            new_version = folder_digest(folder, "text-classification", "top_k=5", "fp32")
            with lock:
                expected[new_version] = new_answers
            assert replicas[0].admin is not None
            report.reload = replicas[0].admin.reload_model(
                "support", actor="fault-suite", note="reload_under_load"
            )
            acked_at = time.monotonic()
            report.ack_s = acked_at - started
            time.sleep(load_s / 2)
        finally:
            stop.set()
            for w in workers:
                w.join(timeout=30)
        report.sent = len(observations) + len(report.failed)
        for sent_at, text, version in observations:
            report.versions[version] = report.versions.get(version, 0) + 1
            if sent_at >= acked_at and version == old_version:
                report.stale_after_ack.append(f"{text!r} at +{sent_at - acked_at:.3f} s")
        with contextlib.suppress(Exception):  # leave nothing under our prefix
            store = replicas[0].engine.l2_store()
            if store is not None:
                store.clear()
    return report


def reload_under_load_scenario(run: Run) -> None:
    ctx = run.ctx
    work = ctx.work / run.result.name
    work.mkdir(parents=True, exist_ok=True)
    report = reload_under_load(
        ctx.redis_server.url, work, prefix=f"{PREFIX}-models", load_s=ctx.sizes.phase_s
    )
    for problem in (report.failed + report.wrong + report.stale_after_ack)[:12]:
        run.result.problems.append(problem)
    run.extra["sent"] += report.sent
    run.extra["failed"] += len(report.failed)
    run.extra["wrong"] += len(report.wrong) + len(report.stale_after_ack)
    run.extra["ok"] += report.sent - len(report.failed) - len(report.wrong) - len(report.stale_after_ack)
    fleet = report.reload.get("fleet", {})
    run.figure("reload acknowledged by both (s)", round(report.ack_s, 3))
    run.figure("answers per version", report.versions)
    run.check(
        "the reload swapped a new version in", bool(report.reload.get("changed")), str(report.reload)[:300]
    )
    both = bool(fleet.get("complete")) and len(fleet.get("confirmed", [])) == 2
    run.check("both replicas confirmed the new version", both, str(fleet))
    run.check("no old-version answer after the acknowledgement", not report.stale_after_ack)
    run.check("both versions answered under load", len(report.versions) == 2, str(report.versions))
