"""GPU figures on CUDA (utilisation, memory) for `/metrics` and the console's trend chart.

On a machine without CUDA there is nothing to read: `read_gpus()` returns [] and the
console says so. torch is imported when first asked (the engine has loaded it by then).
Utilisation comes from NVML through `torch.cuda.utilization`; without the `nvidia-ml-py`
package it is unknown (None) and only memory is reported.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from common.background import BackgroundThread

log = logging.getLogger(__name__)

TREND_POINTS = 360  # one hour at the default 10 s period
NO_CUDA = "No CUDA device: this replica runs its models on the CPU, so there are no GPU figures."


@dataclass(frozen=True)
class GpuSample:
    device: str  # "cuda:0"
    name: str
    utilization: float | None  # 0..1 over NVML's last sample period; None without NVML
    memory_used_bytes: int  # the whole device's, every process (what can run out)
    memory_total_bytes: int
    torch_allocated_bytes: int  # this process's tensors


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard requirement
        return False
    return bool(torch.cuda.is_available())


def read_gpus() -> list[GpuSample]:
    """One sample per visible CUDA device; [] on the CPU."""
    if not cuda_available():
        return []
    import torch

    samples = []
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        try:
            utilization: float | None = torch.cuda.utilization(index) / 100.0
        except Exception:  # no NVML (nvidia-ml-py not installed, or the driver refuses)
            utilization = None
        samples.append(GpuSample(
            device=f"cuda:{index}", name=torch.cuda.get_device_name(index), utilization=utilization,
            memory_used_bytes=int(total - free), memory_total_bytes=int(total),
            torch_allocated_bytes=int(torch.cuda.memory_allocated(index)),
        ))  # fmt: skip
    return samples


class DeviceMonitor:
    """Samples the GPUs every `period_s` into a bounded trend (the console's chart). On the CPU
    it starts no thread. Owned by the composition root; `close()` is idempotent."""

    def __init__(
        self, *, period_s: float = 10.0, reader: Callable[[], list[GpuSample]] = read_gpus,
        cuda: Callable[[], bool] = cuda_available,
    ) -> None:  # fmt: skip
        self._cuda = cuda
        self._period_s = period_s
        self._reader = reader
        self._trend: deque[tuple[float, list[GpuSample]]] = deque(maxlen=TREND_POINTS)
        self._worker = BackgroundThread("gpu-monitor", self._sample, period_s=period_s, join_s=5, logger=log)
        self.enabled = False

    def start(self) -> DeviceMonitor:
        if not self._cuda():
            log.info("GPU: none (models on the CPU); no GPU figures")
            return self
        self.enabled = True
        self._sample()
        self._worker.start()
        return self

    def _sample(self) -> None:
        try:
            self._trend.append((time.time(), self._reader()))
        except Exception:  # telemetry: a failed read leaves a gap in the chart, never a crash
            log.warning("GPU figures could not be read", exc_info=True)

    def trend(self) -> list[dict[str, Any]]:
        """[{"at": unix s, "gpus": [GpuSample as dict, ...]}, ...], oldest first."""
        return [{"at": at, "gpus": [asdict(s) for s in samples]} for at, samples in list(self._trend)]

    def close(self) -> None:
        self._worker.close()
