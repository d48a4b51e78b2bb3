"""bench.triton_peer's Triton side: the venv script, a real tritonserver, and its response cache.

The venv (scripts/triton_venv.sh) is made on first use, a minute or two from PyPI; once made,
this test takes about 15 s. A failed venv or a missing tritonserver fails here with the
script's message: the bench could not run either.
"""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as triton

from bench.triton_peer import TritonPeer, TritonPeerError, cache_hits, request_of, triton_python


def test_a_repeated_request_is_a_cache_hit_that_never_reaches_the_callable(tmp_path) -> None:
    try:
        python = triton_python()
        peer = TritonPeer(python, tmp_path / "tritonserver.log")
    except TritonPeerError as exc:
        pytest.fail(f"the Triton peer did not start: {exc}")
    try:
        client = triton.InferenceServerClient(peer.url, network_timeout=60)
        inputs, outputs = request_of("binary", "Where is my parcel?")
        answers = [client.infer("text", inputs, outputs=outputs) for _ in range(3)]
        assert answers[0].as_numpy("label").shape == (1, 5)
        assert answers[0].as_numpy("score").dtype == np.float32
        assert all(a.as_numpy("label").tolist() == answers[0].as_numpy("label").tolist() for a in answers)
        # The first request ran the callable; the two repeats were Triton's cache hits.
        assert peer.callable_calls() == {"text": 1, "image": 0}
        assert cache_hits(client) == {"text": 2, "image": 0}
        # The same message as JSON tensors is the same input to Triton's cache: still one call.
        json_inputs, json_outputs = request_of("json", "Where is my parcel?")
        assert client.infer("text", json_inputs, outputs=json_outputs).as_numpy("label").shape == (1, 5)
        assert peer.callable_calls()["text"] == 1
        client.close()
    finally:
        peer.close()
    assert peer.process.returncode is not None
