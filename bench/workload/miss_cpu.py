"""Server CPU per miss on the app's backend against plain torch, per task: the SUMMARY's
`miss_cpu_vs_torch_image` and `miss_cpu_vs_torch_text` (bench.miss_cost's measurement, on this
run's inputs and model sets, sequential)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.workload.config import APP_MODELS, TORCH_MODELS, Job
from bench.workload.processes import ModelSets

TASKS = ("image", "text")


def miss_cpu_ratios(sets: ModelSets, jobs: Sequence[Job], inputs: int, workdir: Path) -> dict[str, float]:
    """Per task: CPU per miss of an engine on the app's models over one on the torch models,
    each answering the same `inputs` new inputs (after a warm-up chunk) in interleaved chunks."""
    from bench.miss_cost import runtimes, side_by_side

    chunk = max(1, min(10, inputs // 4))
    ratios = {}
    with runtimes(workdir, {name: sets[name] for name in (TORCH_MODELS, APP_MODELS)}) as built:
        for task in TASKS:
            items = [raw for kind, raw in jobs if kind == task][: chunk + inputs]
            totals = side_by_side(built, task, items, chunk=chunk, clients=1)
            ratios[task] = totals[APP_MODELS].row()[0] / totals[TORCH_MODELS].row()[0]
    return ratios
