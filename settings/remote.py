"""The remote backend's settings (a MODELS_CONFIG entry with `backend: remote`): how long a call to
the serving cluster may take and how its breaker backs off. The defaults serve without tuning."""

from __future__ import annotations

from settings.base import Float, Group, Int, var


class Remote(Group):
    """Models served by an Open Inference Protocol v2 server (Triton, KServe): timeouts and backoff."""

    heading = "Remote models"

    # A server that does not accept a connection within this is down for this call.
    connect_timeout_s: Float = var(
        "REMOTE_CONNECT_TIMEOUT_S", 1.0, ge=0.01, shown="`1.0`",
        description="Seconds to connect to a remote model's server (`backend: remote` in `MODELS_CONFIG`).",
    )  # fmt: skip
    # One forward pass of a batch on the server, queueing there included; a miss waits at most this
    # long (plus the connection) before it is refused with 503 and Retry-After.
    timeout_s: Float = var(
        "REMOTE_TIMEOUT_S", 5.0, ge=0.01, shown="`5.0`",
        description="Seconds one remote forward pass (a batch of misses) may take before it is given up: "
        "those misses get 503 with `Retry-After`, hits are still served.",
    )  # fmt: skip
    breaker_failure_threshold: Int = var(
        "REMOTE_BREAKER_FAILURES", 2, ge=1, shown="`2`",
        description="Failed remote calls in a row (timeouts, refused connections, garbage answers) before "
        "the remote is skipped and checked again in the background.",
    )  # fmt: skip
    breaker_reset_s: Float = var(
        "REMOTE_BREAKER_RESET_S", 1.0, ge=0.01, shown="`1.0`",
        description="First delay before a skipped remote is checked again (jittered, doubling).",
    )  # fmt: skip
    breaker_max_s: Float = var(
        "REMOTE_BREAKER_MAX_S", 30.0, ge=0.01, shown="`30.0`",
        description="Longest delay between checks of a remote that is down or failed its check.",
    )  # fmt: skip
