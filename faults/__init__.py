"""Fault injection and hostile input against the running app, with every answer checked.

The suite starts its own `redis-server` (loopback, a free port) and two app processes
(`python app.py`, each with its own DATA_DIR) sharing that Redis, then runs one
scenario per fault. Load comes from a known set of inputs (crops of scikit-image's
photos, support messages) whose reference answers were computed beforehand with the
real models in this process (`predict_batch([canonicalize(raw)])`, batch 1, exactly
what the app runs), and every response is compared with its reference: the labels, every
score within `bench.models.SCORE_TOLERANCE` (1e-5: concurrent text misses may share a
batch), the model version, and where it matters the generation.

Clients speak Gradio's HTTP API (`/gradio_api/upload`, `/gradio_api/call/<api>`, through
`testing.gradio_http`), the same protocol `gradio_client` uses, and behave like a load balancer: a request
that cannot reach a replica (connection refused or dropped) is retried on the other one.
A request counts as

- succeeded: the reference answer, or for a bad input the same clear message the
  engine gives when called directly;
- failed: a valid input without its answer (an error, a 500, a hang past the request
  timeout, no replica reachable), or an input error worded like a server fault;
- wrong: an answer that differs from the reference, or that carries an old
  generation or another model version.

    .venv/bin/python -m faults [--quick] [--only NAME[,NAME...]] [--list]

The last line is `SUMMARY scenarios=N failed_requests=F wrong_results=W`; the exit
status is 0 only when both are zero and every scenario's checks hold.
`tests/test_faults.py` runs the same scenarios with smaller sizes (`pytest -m faults`).
Needs `redis-server` on PATH. It touches no Redis and no process it did not start.

Modules: `config` (what the apps are given, sizes), `processes` (the app processes),
`client` (Gradio calls sorted into outcomes, admin calls, /metrics), `inputs` (the load and
its reference answers), `mutations` (hostile files, texts and stored values), `harness`
(verdicts, the load, the router, the shared set-up), `hostile` (the frame of an attack: quiet
and attacked windows, judged by what the attack costs everyone else) with `healthz` (its
/healthz poller, a process of its own), `scenarios_redis`, `scenarios_fleet`,
`scenarios_input`, `scenarios_ops`, `scenarios_hostile` (the scenarios by area), `scenarios`
(the list, and running one), `report`, `cli`. A new scenario is a function `(run: Run) -> None`
in the module of its area, listed in `scenarios.SCENARIOS`.
"""
