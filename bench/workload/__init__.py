"""Workload benchmark: the cache against no cache, the common recipe and gr.cache, in one run.

Inputs (fixed seed): 2,000 distinct images derived from scikit-image's bundled
photos (crops, flips, small colour shifts; PNG and JPEG bytes, as uploads arrive)
and 2,000 distinct support messages (templated variations).

Workloads, each replayed by 4 concurrent clients:

- zipf-restart: a Zipf stream (s = 1.1) over all the inputs (a seeded
  permutation gives each input its rank), with one restart of the serving
  process at the halfway point: whatever lives in process memory is lost,
  whatever lives in Redis is kept.
- unique: every request a new input (min(requests / 5, inputs) requests): all
  misses, so the cache can only cost here.

Systems, around the same loaded models and the same decoding of uploaded bytes
(the engine's `canonicalize`):

- nocache: decode, then the model.
- seed: the common recipe: preprocess to the model's input tensor (image: the
  float tensor; text: token ids), key = MD5 of `tensor.cpu().numpy().tobytes()`,
  `functools.lru_cache(maxsize=128)`, Redis L2 with pickled values, 1-hour TTL.
- grcache: `gr.cache(fn, max_size=0, max_memory=<our L1 budget>)` around a
  classify function taking decoded pixels (what `gr.Image(type="numpy")` hands
  a callback) or the message.
- ours: `InferenceEngine.classify(task, raw)` from `build_runtime` at default
  settings (L1 in process, L2 on Redis, request log and metrics listeners).

Every system runs in its own child process (so its peak RSS is its own) with
its own fresh redis-server when it uses one (on a unix socket, as the app's
private redis-server when REDIS_URL is unset); all four are alive at once and the
stream is replayed in segments, the systems taking turns segment by segment (in
a rotating order), so that load from other processes spreads over all of them.
Restart time (and model loading) is not part of the wall time.

Measured per system and workload: wall time, throughput, p50/p95/p99 latency,
hit ratio (1 - model calls / requests), model calls, CPU per request (the
process plus its redis-server), peak RSS during the replay and its growth,
Redis memory; the ratios of ours to each peer; whether every system gave the
model's answers.

`--http` (and `--quick`) adds what users get: the same Zipf stream (with a real restart of
every server halfway) sent over HTTP by 4 keep-alive clients per path, through three paths
side by side, each its own server process: `ours` (this app through Gradio's API, half the
clients with a session hash and half without, as curl sends), `ours-rest` (this app through
its Open Inference Protocol REST API) and `grcache` (a minimal Gradio app with gr.cache).
Then cached answers one at a time per path and session mode (p50 latency, server CPU per
answer) and the servers' memory over calls without a session hash (`bench.workload.over_http`).

The last line printed is the machine-readable summary (`nan` for what the run did not measure):

    SUMMARY speedup_vs_nocache=X speedup_vs_grcache=Y speedup_vs_seed=Z unique_vs_nocache=W
            hit_ratio=H gradio_vs_grcache=G rest_vs_grcache=R rest_hit_p50_vs_gradio=P

(on one line). The default run (20,000 requests) writes bench/REPORT.md and
bench/workload_chart.html; `--quick` (2,000 requests in process, 1,000 over HTTP) writes
nothing unless asked; `--http-only` skips the in-process workloads.

    .venv/bin/python -m bench.workload [--quick] [--http | --no-http | --http-only] [--requests N]
                                       [--http-requests N] [--http-sessions mixed|with|without]
                                       [--threads N] [--device auto|cpu|cuda] [--in-process]

Needs `redis-server` on PATH (the script starts and stops its own, one per
system that uses Redis, on unix sockets in temp dirs; it touches no other Redis).

Modules: `config` (systems, sizes, targets), `inputs` (inputs and streams), `replay`
(concurrent clients, results), `processes` (child processes, Redis, CPU and memory),
`inprocess` (the systems called in process), `servers` and `over_http` (the HTTP run),
`report` (tables, SUMMARY, REPORT.md, chart), `cli`. The peer systems are `bench.peers`;
the HTTP clients `testing.gradio_http` and `testing.oip_http`.
"""
