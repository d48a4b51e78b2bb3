#!/usr/bin/env bash
# The Triton venv of bench.triton_peer and serving/triton_serve.py: nvidia-pytriton 0.7.0 (it ships
# tritonserver 2.51, which runs on a CPU), numpy < 2 and onnxruntime (the app's version, which runs on
# numpy 1.x too: the exported graphs are served with it), in .venv-triton/ (or $TRITON_VENV). Idempotent: a second run
# checks the stamp and the imports and returns at once. pip only, from PyPI.
# It must be Debian's /usr/bin/python3 (3.11): Triton's Python-backend stub links the system
# libpython3.11.so, and a venv of another Python 3.11 build (pyenv, the app's) makes the stub
# fail at start (`_recursion_count`). Prints the venv's python on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${TRITON_VENV:-.venv-triton}
python=${TRITON_PYTHON:-/usr/bin/python3}
pins=("nvidia-pytriton==0.7.0" "numpy<2" "onnxruntime==1.31.1")
stamp="$venv/.triton-installed"

fail() { echo "triton_venv: $*" >&2; exit 1; }

check() {
  "$venv/bin/python" -c 'import numpy, onnxruntime, pytriton.triton, tritonclient.http' 2>/dev/null \
    && [[ -x "$("$venv/bin/python" -c 'import pathlib, pytriton; print(pathlib.Path(pytriton.__file__).parent / "tritonserver/bin/tritonserver")')" ]]
}

if [[ -f "$stamp" ]] && [[ "$(cat "$stamp")" == "${pins[*]}" ]] && check; then
  echo "$venv/bin/python"
  exit 0
fi
[[ -x "$python" ]] || fail "$python not found: install Debian's python3 (3.11) and python3-venv"
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[[ "$version" == "3.11" ]] || fail "$python is Python $version; the stub needs the system Python 3.11"
base=$("$python" -c 'import sys; print(sys.base_prefix)')
[[ "$base" == "/usr" ]] || fail "$python is a Python 3.11 from $base, not the system's (/usr): Triton's \
Python stub links /usr's libpython3.11 and fails at start with another build's (_recursion_count)"
ldconfig -p 2>/dev/null | grep -q 'libpython3.11.so.1.0' \
  || fail "libpython3.11.so.1.0 is not installed (apt-get install libpython3.11): Triton's Python stub links it"
if [[ ! -x "$venv/bin/python" ]]; then
  "$python" -m venv "$venv" || fail "could not create $venv with $python -m venv (apt-get install python3-venv)"
fi
"$venv/bin/python" -m pip install --quiet "${pins[@]}" >&2 \
  || fail "pip install ${pins[*]} into $venv failed (see above)"
check || fail "$venv has nvidia-pytriton but its imports or its tritonserver binary are missing"
echo "${pins[*]}" > "$stamp"
echo "$venv/bin/python"
