"""GPU check: the engine on CUDA, in one short run (issue 18, part 6; bench/README.md).

1. Both real models built through `runtime.build_runtime` on the device.
2. Miss throughput: `predict_batch` at batch 1 against batches of 8-32 distinct inputs
   (decoded beforehand), warm-ups, CUDA synchronised around timings; the network alone beside it.
3. One in-process Zipf run through the engine (L1 only), concurrent clients.
4. fp16 against fp32 top-1 through `engine.classify`: the image model with the app's own
   HALF_PRECISION; the text model has no fp16 setting, so its transformer is cast here.

Last line: SUMMARY gpu=<name> image_batched_vs_1=X text_batched_vs_1=Y fp16_top1_agreement=Z
(the agreement is the image model's). Without CUDA it exits 1 with one line; `--device cpu`
is a dry run of the same steps at tiny sizes (the image model cast to fp16 by hand).

    scripts/gpu_check.sh [--device cpu] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.models import (
    MESSAGES,
    PHOTOS,
    format_table,
    image_batch,
    image_forward,
    load_photos,
    positive_int,
    set_threads,
    synchronizer,
    text_forward,
    tokenize,
)
from bench.workload.inputs import make_images, make_messages, zipf_stream
from engine.models.image import ImageClassifier
from engine.models.text import TextClassifier
from runtime import Runtime, build_runtime
from settings import Settings

Job = tuple[str, Any]  # (task, raw input as a user sends it)
SEED = 18_06


@dataclass(frozen=True)
class Profile:
    images: int  # distinct derived images timed per pass (a multiple of the largest batch)
    messages: int  # distinct messages timed per pass
    batch_sizes: tuple[int, ...]  # batched sizes compared with batch 1; the last one is the summary's
    rounds: int  # timed passes per batch size (median)
    photos: int  # original photos in the fp16 set
    variants: int  # derived images added to them
    fp16_messages: int  # generated messages added to bench.models.MESSAGES
    zipf_inputs: int  # per task
    zipf_requests: int
    clients: int


GPU = Profile(images=96, messages=256, batch_sizes=(8, 16, 32), rounds=5, photos=len(PHOTOS),
              variants=40, fp16_messages=56, zipf_inputs=256, zipf_requests=4000, clients=4)  # fmt: skip
CPU_DRY = Profile(images=4, messages=4, batch_sizes=(4,), rounds=1, photos=2, variants=2,
                  fp16_messages=2, zipf_inputs=8, zipf_requests=80, clients=2)  # fmt: skip


def say(text: str = "") -> None:
    print(text, flush=True)


def open_runtime(device: str, data_dir: Path, *, half: bool) -> Runtime:
    settings = Settings.from_env({}).changed(
        models__device=device, models__half_precision=half, redis__url="off", server__data_dir=data_dir,
        server__admin_token="gpu-check-token",
    )
    return build_runtime(settings)


def models_of(runtime: Runtime) -> tuple[ImageClassifier, TextClassifier]:
    image, text = runtime.engine.models["image"], runtime.engine.models["text"]
    assert isinstance(image, ImageClassifier) and isinstance(text, TextClassifier)
    return image, text


# ---- 2. miss throughput ---------------------------------------------------------------------


def chunks(items: Sequence[Any], size: int) -> list[list[Any]]:
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def rate(calls: Sequence[Callable[[], object]], items: int, sync: Callable[[], None]) -> float:
    """Items per second over one pass of `calls`, the device idle before and after."""
    sync()
    started = time.perf_counter()
    for call in calls:
        call()
    sync()
    return items / (time.perf_counter() - started)


def throughput(
    predict: Callable[[list[Any]], object],
    network: Callable[[list[Any]], Callable[[], object]],
    inputs: Sequence[Any],
    profile: Profile,
    sync: Callable[[], None],
) -> dict[int, tuple[float, float]]:
    """Batch size -> (predict_batch items/s, network-only items/s), medians over rounds.
    `network(chunk)` prepares a batch on the host and returns the forward call alone."""
    plans = {}
    for size in (1, *profile.batch_sizes):
        parts = chunks(inputs, size)
        plans[size] = ([lambda p=p: predict(p) for p in parts], [network(p) for p in parts])
        for calls in plans[size]:
            calls[0]()  # warm-up for this shape (kernels, allocator)
    samples: dict[int, list[tuple[float, float]]] = {size: [] for size in plans}
    for _ in range(profile.rounds):  # interleaved, so drift spreads over every size
        for size, (predicts, forwards) in plans.items():
            samples[size].append((rate(predicts, len(inputs), sync), rate(forwards, len(inputs), sync)))
    return {size: (statistics.median(s[0] for s in runs), statistics.median(s[1] for s in runs))
            for size, runs in samples.items()}  # fmt: skip


def measure_throughput(
    runtime: Runtime, images: Sequence[bytes], messages: Sequence[str], profile: Profile
) -> dict[str, dict[int, tuple[float, float]]]:
    image, text = models_of(runtime)
    sync = synchronizer(image.device)
    pixels = [image.canonicalize(raw) for raw in images]
    texts = [text.canonicalize(raw) for raw in messages]

    def image_net(chunk: list[Any]) -> Callable[[], object]:
        batch = image_batch(image, chunk)
        return lambda: image_forward(image, batch)

    def text_net(chunk: list[Any]) -> Callable[[], object]:
        encoded = tokenize(text, [item.text for item in chunk])
        return lambda: text_forward(text, encoded)

    return {
        "image": throughput(image.predict_batch, image_net, pixels, profile, sync),
        "text": throughput(text.predict_batch, text_net, texts, profile, sync),
    }


def throughput_table(figures: dict[str, dict[int, tuple[float, float]]]) -> str:
    rows = []
    for task, by_size in figures.items():
        one = by_size[1]
        for size, (predict, net) in by_size.items():
            rows.append([f"{task} batch {size}", f"{predict:.1f}", f"{predict / one[0]:.2f}x",
                         f"{net:.1f}", f"{net / one[1]:.2f}x"])  # fmt: skip
    headers = ["miss throughput", "predict_batch items/s", "vs batch 1", "network only items/s", "vs batch 1"]
    return format_table(headers, rows)


# ---- 4. fp16 against fp32 -------------------------------------------------------------------


def cast_to_fp16(runtime: Runtime) -> list[str]:
    """Makes both models of an fp16 runtime run in fp16; says what was cast by hand here."""
    image, text = models_of(runtime)
    notes = []
    if image._dtype != torch.float16:  # the app's HALF_PRECISION applies on CUDA only
        image._model.half()
        image._dtype = torch.float16
        notes.append("image: HALF_PRECISION is CUDA-only in the app; network cast to fp16 for this dry run")
    text._model.half()  # the app has no fp16 setting for the text model
    text._centroids = text._build_centroids()  # intent centroids from the fp16 encoder too
    notes.append("text: no fp16 setting in the app; transformer cast to fp16 here, centroids rebuilt")
    return notes


def top1(runtime: Runtime, jobs: Sequence[Job]) -> list[tuple[str, float]]:
    return [runtime.engine.classify(task, raw).prediction.labels[0] for task, raw in jobs]


def agreement(a: Sequence[tuple[str, float]], b: Sequence[tuple[str, float]]) -> tuple[float, float]:
    """Share of equal top-1 labels, and the largest top-1 probability difference where they agree."""
    same = [abs(x[1] - y[1]) for x, y in zip(a, b, strict=True) if x[0] == y[0]]
    return len(same) / len(a), max(same, default=0.0)


def fp16_agreement(
    runtime: Runtime, workdir: Path, photos: Sequence[bytes], texts: Sequence[str]
) -> dict[str, float]:
    """Top-1 of the fp32 `runtime` against a second runtime built with HALF_PRECISION=1."""
    jobs = {"image": [("image", raw) for raw in photos], "text": [("text", raw) for raw in texts]}
    runtime.engine.flush("l1")  # every fp32 answer a fresh miss, one at a time, like the fp16 ones
    fp32 = {task: top1(runtime, task_jobs) for task, task_jobs in jobs.items()}
    with open_runtime(runtime.settings.models.device, workdir / "fp16", half=True) as half_runtime:
        for note in cast_to_fp16(half_runtime):
            say(note)
        fp16 = {task: top1(half_runtime, task_jobs) for task, task_jobs in jobs.items()}
    rows, shares = [], {}
    for task in jobs:
        shares[task], diff = agreement(fp32[task], fp16[task])
        rows.append([task, str(len(jobs[task])), f"{shares[task]:.3f}", f"{diff:.2e}"])
    say(format_table(["fp16 vs fp32", "inputs", "top-1 agreement", "max |dp top-1| where equal"], rows))
    return shares


# ---- 3. Zipf run ----------------------------------------------------------------------------


def zipf_run(runtime: Runtime, jobs: Sequence[Job], profile: Profile) -> dict[str, Any]:
    engine = runtime.engine
    engine.flush("l1")
    stream = zipf_stream(len(jobs), profile.zipf_requests, seed=SEED)
    calls_before = sum(engine.counters().model_calls.values())
    tiers: Counter[str] = Counter()
    devices: set[str] = set()
    latencies: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client(indices: Sequence[int]) -> None:
        try:
            for i in indices:
                result = engine.classify(*jobs[i])
                with lock:
                    tiers[result.tier] += 1
                    devices.add(result.device)
                    latencies.append(result.latency_ms)
        except BaseException as exc:  # reported after the join
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(stream[k :: profile.clients],))
               for k in range(profile.clients)]  # fmt: skip
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    calls = sum(engine.counters().model_calls.values()) - calls_before
    return {"requests": len(stream), "wall_s": wall, "req_s": len(stream) / wall,
            "hit_ratio": 1 - calls / len(stream), "model_calls": calls, "tiers": dict(tiers),
            "devices": sorted(devices), "p50_ms": statistics.median(latencies)}  # fmt: skip


# ---- the run --------------------------------------------------------------------------------


def gpu_name(device: str) -> str:
    if device != "cuda":
        return "cpu_dry_run"
    return torch.cuda.get_device_name(0).replace(" ", "_")


def describe_device(device: str) -> str:
    if device != "cuda":
        return f"device: cpu (dry run) | torch {torch.__version__}, {torch.get_num_threads()} threads"
    props = torch.cuda.get_device_properties(0)
    return (
        f"device: {props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)"
        f" | torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"
    )


def run(device: str, profile: Profile, workdir: Path) -> str:
    started = time.perf_counter()

    def step(name: str) -> None:
        say(f"\n== {name} (at {time.perf_counter() - started:.1f} s)")

    say(describe_device(device))
    n_images = max(profile.images, profile.variants, profile.zipf_inputs)
    n_messages = max(profile.messages, profile.fp16_messages, profile.zipf_inputs)
    images, messages = make_images(n_images, SEED), make_messages(n_messages, SEED)
    step("1. engine on the device (build_runtime, REDIS_URL=off)")
    with open_runtime(device, workdir / "fp32", half=False) as runtime:
        for model in models_of(runtime):
            say(f"{model.task}: {model.name} {model.version} on {model.device}")
            if not model.device.startswith(device):
                raise SystemExit(f"gpu_check: the {model.task} model is on {model.device}, not {device}")
        step("2. miss throughput, batch 1 against batched")
        figures = measure_throughput(runtime, images[: profile.images], messages[: profile.messages], profile)
        say(throughput_table(figures))
        step(f"3. Zipf run in process: {profile.zipf_requests} requests, {profile.clients} clients, L1 only")
        zipf_jobs = [("image", raw) for raw in images[: profile.zipf_inputs]]
        zipf_jobs += [("text", raw) for raw in messages[: profile.zipf_inputs]]
        zipf = zipf_run(runtime, zipf_jobs, profile)
        say(format_table(["Zipf run", "requests", "req/s", "hit ratio", "model calls", "p50 ms", "tiers"],
                         [["engine.classify, L1 only", str(zipf["requests"]), f"{zipf['req_s']:.1f}",
                           f"{zipf['hit_ratio']:.3f}", str(zipf["model_calls"]), f"{zipf['p50_ms']:.3f}",
                           " ".join(f"{k}={v}" for k, v in sorted(zipf["tiers"].items()))]]))  # fmt: skip
        say(f"answered on: {', '.join(zipf['devices'])}")
        photos = list(load_photos(PHOTOS[: profile.photos]).values()) + images[: profile.variants]
        texts = list(MESSAGES) + messages[: profile.fp16_messages]
        step("4. fp16 against fp32, top-1 through engine.classify (HALF_PRECISION=1)")
        shares = fp16_agreement(runtime, workdir, photos, texts)
    if device == "cuda":
        say(f"\npeak CUDA memory allocated: {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
    say(f"total {time.perf_counter() - started:.1f} s")
    image_ratio = figures["image"][profile.batch_sizes[-1]][0] / figures["image"][1][0]
    text_ratio = figures["text"][profile.batch_sizes[-1]][0] / figures["text"][1][0]
    return (f"SUMMARY gpu={gpu_name(device)} image_batched_vs_1={image_ratio:.2f} "
            f"text_batched_vs_1={text_ratio:.2f} fp16_top1_agreement={shares['image']:.3f}")  # fmt: skip


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default); cpu: a dry run of the same steps at small sizes")  # fmt: skip
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch intra-op threads (default: torch's; 1 for --device cpu)")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: CUDA is not available (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda or 'none'}, no GPU visible); run it on a GPU machine, "
              "or pass --device cpu for a dry run", file=sys.stderr)  # fmt: skip
        return 1
    # The dry run is a logic check: one thread keeps it short on a busy shared CPU.
    set_threads(args.threads if args.threads is not None or args.device == "cuda" else 1)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
        summary = run(args.device, CPU_DRY if args.device == "cpu" else GPU, Path(workdir))
    say()
    say(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
