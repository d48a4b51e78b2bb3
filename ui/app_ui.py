"""The Gradio Blocks: a tab per served task (image or text), How it works, Admin.
Callbacks translate widgets <-> engine only."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import gradio as gr
from gradio.caching import CacheMissError

from engine.capacity.fairness import client_id
from engine.errors import InvalidInputError, ModelError, OverBudgetError, RemoteUnavailableError
from engine.models.base import takes_image
from engine.pipeline.service import ClassifyResult, InferenceEngine, ProbeMiss
from ui.components import UploadedImage

log = logging.getLogger(__name__)

TIER_WORDS = {
    "l1": "served from memory",
    "l2": "served from Redis",
    "coalesced": "joined an identical request in flight",
}


def in_queue_probe() -> bool:
    """True while Gradio's queue runs a callback as a cache probe (see gradio/queueing.py):
    then only an already-cached answer may be returned; anything else must raise
    CacheMissError so the request takes its place in the queue."""
    try:
        from gradio.caching import _probe_mode_active
    except ImportError:  # a Gradio without the probe: every call is a real call
        return False
    return bool(_probe_mode_active.get())


@contextmanager
def user_errors(probe: bool) -> Iterator[None]:
    """The one place engine errors become what Gradio shows the user."""
    try:
        yield
    except ProbeMiss:
        raise CacheMissError() from None
    except InvalidInputError as exc:
        if probe:
            raise CacheMissError() from None
        raise gr.Error(exc.message, print_exception=False) from None
    except RemoteUnavailableError as exc:  # a remote model's server is down, slow or refused
        if probe:
            raise CacheMissError() from None
        raise gr.Error(exc.message, title="Model server unavailable", print_exception=False) from None
    except ModelError as exc:
        if probe:
            raise CacheMissError() from None
        raise gr.Error(str(exc), print_exception=False) from None
    except OverBudgetError as exc:  # the client's miss budget (engine.capacity.fairness); never a probe's
        raise gr.Error(exc.message, title="Please slow down", print_exception=False) from None
    except gr.Error:
        raise
    except Exception:
        if probe:
            raise CacheMissError() from None
        log.exception("unexpected error in a UI callback")
        raise gr.Error("Something went wrong on our side. Please try again.", print_exception=False) from None


class AnswerErrors:
    """The last error each session's classify call raised, so that the page can show it where
    the answer was (the event's failure listener reads it back by the session's hash): at most
    `capacity` sessions, the oldest dropped. Gradio's toast says it too, and fades."""

    def __init__(self, capacity: int = 4096) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._errors: OrderedDict[str, str] = OrderedDict()

    def put(self, session: str | None, message: str) -> None:
        if not session:
            return
        with self._lock:
            self._errors[session] = message
            self._errors.move_to_end(session)
            while len(self._errors) > self._capacity:
                self._errors.popitem(last=False)

    def pop(self, session: str | None) -> str | None:
        with self._lock:
            return self._errors.pop(session, None) if session else None


@contextmanager
def noted(errors: AnswerErrors | None, request: gr.Request | None) -> Iterator[None]:
    """Keep the message of a gr.Error raised inside for the session's answer area."""
    try:
        yield
    except gr.Error as exc:
        if errors is not None:
            errors.put(getattr(request, "session_hash", None), str(exc.message))
        raise


NOT_CLASSIFIED = "**Not classified.** "


def failure_view(errors: AnswerErrors) -> Callable[[gr.Request], tuple[str, None, None]]:
    """The answer area after a failed classify call: the reason in the badge's place, the
    previous answer (label, cache_info) cleared."""

    def show_failure(request: gr.Request) -> tuple[str, None, None]:
        message = errors.pop(getattr(request, "session_hash", None))
        return NOT_CLASSIFIED + (message or "The request failed; please try again."), None, None

    return show_failure


def unreadable_text(exc: InvalidInputError) -> str:
    """What the answer area says of a chosen file the model cannot take."""
    if exc.code == "not_an_image":  # the engine's sentence says it already
        return f"**{exc.message}**"
    return f"**This file is not an image this app can read** ({exc.message})"


def badge_text(info: dict[str, Any] | None) -> str:
    """One plain sentence saying where the answer came from and how long it took."""
    if not isinstance(info, dict) or "tier" not in info:  # what a client sent, on the API
        return ""
    ms = float(info.get("latency_ms", 0.0))
    duration = f"{ms:.2f} ms" if ms < 10 else f"{ms:.0f} ms"
    tier = info["tier"]
    if tier == "miss":
        sentence = f"computed on {info.get('device', '?')} in {duration}"
    else:
        sentence = f"{TIER_WORDS.get(tier, tier)} in {duration}"
    version = f"{info.get('model')} `{info.get('model_version')}`"
    return f"**{sentence[0].upper() + sentence[1:]}** · {version} · generation {info.get('generation')}"


def _respond(result: ClassifyResult) -> tuple[dict[str, Any], dict[str, Any]]:
    return result.prediction.as_label_value(), result.cache_info()


def read_upload(path: Path, max_upload_bytes: int) -> bytes:
    """The uploaded file's bytes; the size is checked before reading it."""
    try:
        size = path.stat().st_size
        if size > max_upload_bytes:
            raise InvalidInputError(
                "file_too_large",
                f"The file is {size / 1e6:.1f} MB; the limit is {max_upload_bytes / 1e6:.1f} MB.",
            )
        return path.read_bytes()
    except OSError:  # gone, a directory, unreadable: nothing a model could be given
        raise InvalidInputError(
            "upload_unreadable", "The uploaded file could not be read. Please upload it again."
        ) from None


def make_callbacks(
    engine: InferenceEngine, *, max_upload_bytes: int, errors: AnswerErrors | None = None
) -> dict[str, Callable[..., Any]]:
    """One callback per served task, named by its API name `classify_<task>`; the message of
    each error it raises is kept in `errors` for the session's answer area."""
    callbacks: dict[str, Callable[..., Any]] = {}
    for task, model in engine.models.items():
        if takes_image(model):
            callback = _upload_callback(engine, task, max_upload_bytes, errors)
        else:
            callback = _message_callback(engine, task, errors)
        callback.__name__ = f"classify_{task}"
        # Gradio's queue probes callbacks that carry a `cache` attribute before queueing
        # them: a cached answer returns at once instead of waiting behind misses.
        callback.cache = True  # type: ignore[attr-defined]
        callbacks[f"classify_{task}"] = callback
    return callbacks


def request_client(request: gr.Request | None) -> str:
    """Who sent a Gradio event (engine.capacity.fairness.client_id): the address of the connection that
    queued it, as the forwarding step left it (engine.capacity.forwarding: the X-Forwarded-For client
    of a trusted proxy)."""
    client = getattr(request, "client", None)
    return client_id(getattr(client, "host", None))


def _upload_callback(
    engine: InferenceEngine, task: str, max_upload_bytes: int, errors: AnswerErrors | None = None
) -> Callable[..., Any]:
    def classify_image(image: str | None, request: gr.Request) -> tuple[dict[str, Any], dict[str, Any]]:
        """Classify one image. Returns the label and cache_info."""
        probe = in_queue_probe()
        with noted(errors, request), user_errors(probe):
            if not image:
                raise InvalidInputError("no_image", "Please upload an image first.")
            data = read_upload(Path(image), max_upload_bytes)
            return _respond(engine.classify(task, data, probe=probe, client=request_client(request)))

    return classify_image


def _message_callback(
    engine: InferenceEngine, task: str, errors: AnswerErrors | None = None
) -> Callable[..., Any]:
    def classify_text(message: str | None, request: gr.Request) -> tuple[dict[str, Any], dict[str, Any]]:
        """Classify one message. Returns the label and cache_info."""
        probe = in_queue_probe()
        client = request_client(request)
        with noted(errors, request), user_errors(probe):
            return _respond(engine.classify(task, message if message is not None else "", probe=probe,
                                            client=client))  # fmt: skip

    return classify_text


def upload_check(
    engine: InferenceEngine, task: str, max_upload_bytes: int
) -> Callable[[str | None], tuple[str, None, None]]:
    """The answer area when a file is chosen: the previous answer cleared, and a file the
    model cannot take named as such at once (before Classify is pressed)."""

    def check_upload(image: str | None) -> tuple[str, None, None]:
        if not image:
            return "", None, None
        with user_errors(False):
            try:
                engine.check_input(task, read_upload(Path(image), max_upload_bytes))
            except InvalidInputError as exc:
                return unreadable_text(exc), None, None
        return "", None, None

    return check_upload


EXAMPLE_PHOTOS = ("chelsea.png", "coffee.png", "rocket.jpg")


def example_photos() -> list[Path]:
    """scikit-image's sample photos offered as examples (none when it is not installed)."""
    try:
        import skimage
    except ImportError:
        return []
    folder = Path(skimage.__file__).parent / "data"
    return [folder / name for name in EXAMPLE_PHOTOS if (folder / name).is_file()]


# Variants of one message (case, spacing) share a cache entry: try them one after the other.
TEXT_EXAMPLES = [
    "Where is my order? It was supposed to arrive on Monday.",
    "where is my ORDER?   It was supposed to arrive on monday.",
    "I was charged twice for the same order",
    "I was charged  TWICE for the same order",
    "Can I talk to a real person please?",
    "The blender arrived with a cracked jar",
    "I forgot my password and can't log in",
]

HOW_IT_WORKS = """
### How it works

1. **Canonical input.** An upload is decoded to RGB pixels after EXIF rotation, so the same
   picture as PNG, BMP or lossless WebP is one input; a message is Unicode-normalised, its
   spacing collapsed and its case folded. A cheaper key on the raw upload skips decoding
   when the very same file comes back.
2. **Key.** `prefix:task:model_version:generation:b3 + BLAKE3-128(canonical input)`. The model
   version is a digest of the weights (and the intent set), so new weights never meet old
   answers; the generation is bumped by an operator to retire every entry at once.
3. **Tiers.** Process memory (L1, LRU by bytes) answers in microseconds; Redis (L2), shared by
   every replica, in about a millisecond; only then does the model run — once, however
   many identical requests arrive together. Hits skip Gradio's queue.
"""


def live_stats_text(engine: InferenceEngine) -> str:
    counters = engine.counters()
    hits = counters.hits_l1 + counters.hits_l2 + counters.coalesced
    answered = hits + counters.misses
    rate = f"{100 * hits / answered:.1f}%" if answered else "no requests yet"
    return (
        f"**This process:** {answered:,} answers, hit rate {rate} "
        f"(memory {counters.hits_l1:,} · Redis {counters.hits_l2:,} · joined {counters.coalesced:,} "
        f"· computed {counters.misses:,}) · cache generation {engine.generation}"
    )


# Misses of one task let into the engine beyond its admission limit: they wait for a forward
# pass there, served round-robin across clients (engine.capacity.fairness), where Gradio's own queue
# would serve them first come, first served. Each holds one of Gradio's 40 worker threads.
FAIR_WAITING = 12


def _miss_lane(engine: InferenceEngine, task: str) -> dict[str, Any]:
    """Gradio queue settings for a task's event: as many at once as the engine admits
    (concurrent passes, or a full batch) and FAIR_WAITING more, in a lane of its own so
    image misses never hold text ones back. Hits never queue: the queue's cache probe
    answers them first."""
    if task not in engine.models:
        return {}
    limit = engine.admission_limit(task) + FAIR_WAITING
    return {"concurrency_limit": limit, "concurrency_id": f"classify_{task}"}


# Gradio hides the footer's "Use via API" link at widths up to 640 px (a phone): the API page
# is how a developer who found the app on a phone learns to call it, so it stays. Not in an
# @media rule: Gradio scopes those of the app's CSS to its `.contain` box, outside which the
# footer lies (a plain rule it keeps as written too); at other widths the link is shown anyway.
PHONE_CSS = """
footer .show-api { display: flex !important; }
"""


def _tab_title(task: str) -> str:
    return {"image": "Image", "text": "Text"}.get(task, task.replace("_", " ").replace("-", " ").capitalize())


def _model_note(model: Any) -> str:
    note = f"<small>{model.name} · version `{model.version}` · {model.device}"
    intents = getattr(model, "intent_names", ())
    return note + (f"<br>Intents: {', '.join(intents)}" if intents else "") + "</small>"


def _image_tab(
    engine: InferenceEngine, task: str, model: Any, callback: Callable[..., Any], ui: dict[str, Any]
) -> None:
    photos = example_photos() if model.name == "efficientnet-lite0" else []  # ImageNet photos: the built-in's
    with gr.Row():
        with gr.Column():
            image_in = UploadedImage(
                label="Photo", type="filepath", sources=["upload", "webcam", "clipboard"],
                elem_id=f"{task}-input",
            )  # fmt: skip
            if photos:  # the API page's example: a file that exists where the app runs
                image_in.example_path = str(photos[0])
            button = gr.Button("Classify image", variant="primary", elem_id=f"{task}-submit")
        with gr.Column():
            badge = gr.Markdown(elem_id=f"{task}-badge")
            label = gr.Label(
                num_top_classes=getattr(model, "top_k", 5), label="Top classes", elem_id=f"{task}-label"
            )
            info = gr.JSON(label="cache_info", elem_id=f"{task}-info")
            gr.Markdown(_model_note(model))
    if photos:
        gr.Examples(examples=[str(p) for p in photos], inputs=image_in)
    event = button.click(
        callback, inputs=image_in, outputs=[label, info], api_name=f"classify_{task}",
        **_miss_lane(engine, task),
    )  # fmt: skip
    _answer_area(event, ui["errors"], badge, label, info)
    check = upload_check(engine, task, ui["max_upload_bytes"])
    image_in.change(check, inputs=image_in, outputs=[badge, label, info], api_visibility="private",
                    queue=False)  # fmt: skip


def _answer_area(event: Any, errors: AnswerErrors, badge: Any, label: Any, info: Any) -> None:
    """After a classify call: where the answer came from, or why there is none."""
    event.success(badge_text, inputs=info, outputs=badge, api_visibility="private", queue=False)
    event.failure(failure_view(errors), outputs=[badge, label, info], api_visibility="private",
                  queue=False)  # fmt: skip


def _text_tab(
    engine: InferenceEngine, task: str, model: Any, callback: Callable[..., Any], ui: dict[str, Any]
) -> None:
    builtin = bool(getattr(model, "intent_names", ()))  # the support-intents model has its examples
    with gr.Row():
        with gr.Column():
            text_in = gr.Textbox(label="Support message" if builtin else "Message", lines=3,
                                 elem_id=f"{task}-input")  # fmt: skip
            button = gr.Button("Classify message", variant="primary", elem_id=f"{task}-submit")
            if builtin:
                gr.Examples(examples=[[t] for t in TEXT_EXAMPLES], inputs=text_in)
        with gr.Column():
            badge = gr.Markdown(elem_id=f"{task}-badge")
            label = gr.Label(num_top_classes=getattr(model, "top_k", 5), elem_id=f"{task}-label",
                             label="Top intents" if builtin else "Top classes")  # fmt: skip
            info = gr.JSON(label="cache_info", elem_id=f"{task}-info")
            gr.Markdown(_model_note(model))
    event = gr.on(
        [button.click, text_in.submit], callback, inputs=text_in, outputs=[label, info],
        api_name=f"classify_{task}", **_miss_lane(engine, task),
    )  # fmt: skip
    _answer_area(event, ui["errors"], badge, label, info)


def build_demo(
    engine: InferenceEngine,
    *,
    max_upload_bytes: int,
    admin_tab: Callable[[], None] | None = None,
) -> gr.Blocks:
    """A tab per served task (MODELS_CONFIG order), then How it works and the Admin tab."""
    errors = AnswerErrors()
    callbacks = make_callbacks(engine, max_upload_bytes=max_upload_bytes, errors=errors)
    ui = {"errors": errors, "max_upload_bytes": max_upload_bytes}
    state = engine.cache_state()
    notice = state["l2"].get("notice")

    with gr.Blocks(title="Inference cache") as demo:
        gr.Markdown(
            "# Inference result cache\n"
            "Classify a photo or a message. Repeats are answered from memory or "
            "Redis in well under a millisecond instead of re-running the network."
        )
        if notice:
            gr.Markdown(f"> **Cache notice:** {notice}", elem_id="cache-notice")
        with gr.Tabs():
            for task, model in engine.models.items():
                with gr.Tab(_tab_title(task), id=task):
                    make_tab = _image_tab if takes_image(model) else _text_tab
                    make_tab(engine, task, model, callbacks[f"classify_{task}"], ui)
            with gr.Tab("How it works", id="how"):
                gr.Markdown(HOW_IT_WORKS)
                live = gr.Markdown(elem_id="live-stats")
                timer = gr.Timer(5.0)
            if admin_tab is not None:
                admin_tab()
        refresh_live = partial(live_stats_text, engine)
        gr.on([demo.load, timer.tick], refresh_live, outputs=live, api_visibility="private", queue=False)
    return demo
