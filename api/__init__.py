"""The REST inference API: the Open Inference Protocol v2 (KServe, Triton, MLServer) on the app's port.

Top floor: imports `engine/` only. `ui.server.build_app` includes the router.
"""

from api.body import oip_body_limit
from api.oip import DirectInfer, build_oip_router
from api.repeats import Repeats

__all__ = ["DirectInfer", "Repeats", "build_oip_router", "oip_body_limit"]
