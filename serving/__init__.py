"""The served models on a model serving engine (NVIDIA Triton, KServe's Triton runtime): the
model repository this app's models export to (`repository`, run with the app's venv:
`make triton-repository DIR=..`) and a real tritonserver serving one (`triton_serve.py`, run
with the Triton venv's Python: `make triton-serve DIR=.. PORT=..`; it and `triton_common.py`
import nothing of this project, so that venv needs none of the app's packages).

On the composition root's floor: the repository loads the models exactly as the app does.

May import: runtime, engine.models, settings, process_setup.
"""
