"""Scenarios of hostile input: malformed uploads, hostile texts, forged paths, thin images."""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from PIL import Image

from bench.models import load_photos, photo_dir
from faults.client import ForgedPath, Outcome
from faults.config import ROOT, SERVER_FAULT_WORDS
from faults.harness import (
    Case,
    Context,
    Run,
)
from faults.inputs import Expect, png_bytes
from faults.mutations import (
    base_images,
    hostile_texts,
    mutate,
    png_bomb,
    png_with_size,
    quiet_stderr,
    thin,
)
from faults.processes import peak_rss_mb, reset_peak_rss


def malformed_cases(ctx: Context) -> list[Case]:
    """Mutated images, awkward valid ones, huge ones, forged paths and hostile texts, with references."""
    sizes = ctx.sizes
    rng = random.Random(11)
    bases = base_images(seed=12, photos=sizes.edge_photos)
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
    ]
    if sizes.label != "ci":
        specials.append(("bomb-36MP-valid", png_bomb(6_000)))
    for name, data in specials:
        cases.append(ctx.oracle.case(f"special-{name}", "image", data, name="big.png", group="special"))
    # Over MAX_UPLOAD_BYTES: refused by the upload route's body limit (413) before Gradio or
    # the engine reads it, so the message is the limit's, not the engine's.
    cases.append(
        Case(
            "special-over-upload-limit",
            "image",
            png_bytes(Image.new("RGB", (8, 8))) + bytes(21 * 2**20),
            Expect("any_error"),
            "big.png",
            "special",
        )
    )
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
        ("server-photo", str(ROOT / "docs" / "console.png")),  # under the working directory
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
        case = Case(f"{name}-{size[0]}x{size[1]}", "image", png_bytes(Image.new("RGB", size, colour)),
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
