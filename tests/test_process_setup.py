"""Process set-up: malloc arenas limited before threads allocate (see process_setup)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# A child that (maybe) limits arenas, then lets 8 threads allocate at once and counts
# glibc's heaps (one per arena) in malloc_info's report.
CHILD = """
import ctypes, ctypes.util, sys, tempfile, threading
sys.path.insert(0, {root!r})
from process_setup import limit_malloc_arenas
if sys.argv[1] == "limit":
    assert limit_malloc_arenas(2)
barrier = threading.Barrier(8)
def work():
    barrier.wait()
    kept = [bytearray(40_000) for _ in range(50)]  # below the mmap threshold: arena memory
    barrier.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = (ctypes.c_char_p, ctypes.c_char_p)
libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
libc.fclose.argtypes = (ctypes.c_void_p,)
with tempfile.NamedTemporaryFile(suffix=".xml") as out:
    stream = libc.fopen(out.name.encode(), b"w")
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    print(open(out.name).read().count("<heap nr="))
"""


def heaps(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    result = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT)), mode], env=env,
                            capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    return int(result.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc arenas")
def test_malloc_arenas_are_limited_before_threads_allocate() -> None:
    assert heaps("free") > 2, "8 allocating threads should spread over more than 2 arenas by default"
    assert heaps("limit") <= 2


LOGGING_CHILD = """
import logging, sys
sys.path.insert(0, {root!r})
from process_setup import configure_logging
configure_logging()
logging.getLogger("alembic.runtime.plugins").info("setup plugin alembic.autogenerate.schemas")
logging.getLogger("uvicorn.error").info("Started server process")
logging.getLogger("httpx").warning("a library warning still shows")
logging.getLogger("runtime").info("L1: in-process LRU of 256 MiB")
from huggingface_hub.utils import are_progress_bars_disabled
print("bars off" if are_progress_bars_disabled() else "bars on")
"""


def test_start_up_log_is_the_app_s_lines_and_library_warnings_only() -> None:
    done = subprocess.run([sys.executable, "-c", LOGGING_CHILD.format(root=str(ROOT))], capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    assert "L1: in-process LRU of 256 MiB" in done.stderr and "a library warning still shows" in done.stderr
    assert "setup plugin" not in done.stderr and "Started server process" not in done.stderr
    assert done.stdout.strip() == "bars off"


# A process that starts as app.py does (the collector paused, then resumed with what start-up
# built frozen), with a runtime whose model is held in reference cycles (as torch's built-in
# classifiers are), then a live reload of that model: does a collection free the old one?
COLLECTOR_CHILD = """
import gc, sys, tempfile, weakref
from pathlib import Path
sys.path.insert(0, {root!r})
from process_setup import pause_collector, resume_collector
pause_collector()
from runtime import build_runtime
from settings import Settings
from tests.conftest import CountingTextModel

class CyclicModel(CountingTextModel):
    def __init__(self, version):
        super().__init__(version)
        self.itself = self  # freed only by the cyclic collector

work = Path(tempfile.mkdtemp())
settings = Settings.from_env({{}}).changed(server__data_dir=work, redis__url="off")
runtime = build_runtime(settings, models={{"text": CyclicModel("v1")}},
                        model_loader=lambda task: CyclicModel("v2"))
old = weakref.ref(runtime.engine.models["text"])
runtime.engine.classify("text", "where is my refund")
assert not gc.isenabled()
frozen = resume_collector()
assert runtime.lifecycle.reload("text").changed
gc.collect()
print(frozen, "freed" if old() is None else "kept")
runtime.close()
"""


def test_a_model_replaced_after_the_start_up_freeze_is_freed() -> None:
    done = subprocess.run([sys.executable, "-c", COLLECTOR_CHILD.format(root=str(ROOT))], capture_output=True,
                          text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    frozen, outcome = done.stdout.split()
    assert int(frozen) > 100_000  # the imports and the runtime: kept out of later scans
    assert outcome == "freed", "the old model stayed frozen: each reload would leak one"
