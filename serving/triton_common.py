"""What the two Triton venv scripts share (serving/triton_serve.py, bench/triton_server.py): the
protocol channel to the process that started them, the ports, and PyTriton's server config.

Runs in the Triton venv (scripts/triton_venv.sh): it imports nothing of this project.

The protocol, one JSON object a line: the script prints `{"ready": true, ...ports}` on its
protocol channel once the models are loaded and answers each command line on stdin there; end
of stdin stops it. PyTriton prints tritonserver's log to stdout, so the protocol channel is the
original stdout and stdout itself (fd 1 and sys.stdout) goes to stderr (`take_protocol_channel`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import IO, Any


class Protocol:
    """The protocol channel: `emit` writes one JSON line and flushes."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def emit(self, payload: dict[str, Any]) -> None:
        self._stream.write(json.dumps(payload) + "\n")
        self._stream.flush()


def take_protocol_channel() -> Protocol:
    """The original stdout as the protocol channel; stdout to stderr from now on (before
    anything starts: tritonserver inherits fd 1)."""
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return Protocol(channel)


def add_port_arguments(parser: argparse.ArgumentParser, *, http_default: int | None = None) -> None:
    """--http-port, --grpc-port and --metrics-port (the latter two default to HTTP's + 1, + 2)."""
    parser.add_argument("--http-port", type=int, required=http_default is None, default=http_default)
    parser.add_argument("--grpc-port", type=int, help="default: the HTTP port + 1")
    parser.add_argument("--metrics-port", type=int, help="default: the HTTP port + 2")
    parser.add_argument("--address", default="127.0.0.1", help="listen address (0.0.0.0: every interface)")
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver's --log-verbose")


def ports(args: argparse.Namespace) -> dict[str, int]:
    http = args.http_port
    return {"http_port": http, "grpc_port": args.grpc_port or http + 1,
            "metrics_port": args.metrics_port or http + 2}  # fmt: skip


def triton_config(args: argparse.Namespace, **extra: Any) -> Any:
    """PyTriton's TritonConfig for the ports and address in `args` (`extra`: more of its fields)."""
    from pytriton.triton import TritonConfig

    chosen = ports(args)
    address = args.address
    return TritonConfig(
        http_address=address, http_port=chosen["http_port"], grpc_address=address,
        grpc_port=chosen["grpc_port"], metrics_address=address, metrics_port=chosen["metrics_port"],
        log_verbose=args.log_verbose, exit_timeout_secs=5, **extra,
    )  # fmt: skip
