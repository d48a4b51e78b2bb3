"""Process-wide set-up, done once by the entry point (`app.py`) before anything starts threads.

Python's cyclic garbage collector is paused for the start-up (`pause_collector`): the imports
(torch, gradio, transformers) and the models build about 700,000 long-lived objects, and each
full collection walks all of them again; there were ten at a second start, 1.5 s of CPU under
the GIL (up to 0.34 s each), with almost nothing to free (about 20,000 objects). Once the app
is ready, `resume_collector` freezes what start-up built (`gc.freeze`: kept out of every later
scan, so a full collection walks only what serving made, not the whole heap) and turns the
collector on again. A second start: 7.23 → 6.21 s to /readyz, medians of five side by side
(bench/README.md, "Cold start"). A replaced model may be held in reference cycles (torch's
modules are), so a model swap thaws the frozen objects (`thaw_collector`): from then on the
collector works as Python's default does, and frees the old model.

glibc gives each thread that allocates its own malloc arena, up to 8 per core. A server
whose requests hop between many threads (uvicorn's, anyio's worker pool, Gradio's queue,
torch) then scatters short-lived buffers (uploads, decoded images, tensors) over a dozen
arenas, which fragment and are rarely returned to the system: RSS climbed ~200 MB over a
30-minute mixed soak (`make soak`) although nothing leaked. Two arenas keep it flat (+21 MB
against +174 MB in the same 6-minute load, side by side) at no measurable cost in speed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)
DEFAULT_MALLOC_ARENAS = 2


def limit_malloc_arenas(max_arenas: int = DEFAULT_MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas at `max_arenas` unless MALLOC_ARENA_MAX says otherwise
    (glibc reads that itself at start-up). False where there is no glibc (musl, macOS)."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return True  # the operator's choice, already applied by glibc
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    applied = mallopt(M_ARENA_MAX, max_arenas) == 1
    if not applied:
        log.warning("could not limit malloc arenas to %d", max_arenas)
    return applied


def pause_collector() -> None:
    """The cyclic collector off until `resume_collector` (app.py, before the heavy imports)."""
    gc.disable()


def resume_collector() -> int:
    """Start-up is over: what it built is frozen out of the collector's scans and the collector
    runs again. Returns how many objects were frozen (app.py logs it at debug)."""
    gc.freeze()
    gc.enable()
    return gc.get_freeze_count()


def thaw_collector() -> None:
    """After a model swap: the frozen objects (the old model among them) are the collector's
    again, as without a freeze. Nothing to do in a process that froze nothing (tests)."""
    if gc.get_freeze_count():
        gc.unfreeze()


# Libraries whose INFO lines drown the app's own start-up story (Alembic prints a line per
# plugin and per migration step; storage.sql says in one line where the schema stands).
THIRD_PARTY_LOGGERS = ("alembic", "httpx", "httpcore", "urllib3", "gradio", "gradio_client", "matplotlib",
                       "PIL", "transformers", "huggingface_hub", "onnxruntime", "filelock", "asyncio",
                       "multipart", "python_multipart", "sqlalchemy", "torch", "uvicorn")  # fmt: skip
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: int = logging.INFO) -> None:
    """The server log a newcomer can read: the app's own lines (one per component as it
    starts, then warnings) at `level`, every third-party library at WARNING, no progress bars."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
    for name in THIRD_PARTY_LOGGERS:
        logging.getLogger(name).setLevel(max(level, logging.WARNING))
    # transformers draws a progress bar while loading weights unless huggingface_hub's are off
    # (it asks once, when imported: after this).
    try:
        from huggingface_hub.utils import disable_progress_bars
    except ImportError:  # pragma: no cover - installed with transformers
        return
    disable_progress_bars()
