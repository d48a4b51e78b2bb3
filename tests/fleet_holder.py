"""A replica that takes a lease and never finishes: `python -m tests.fleet_holder REDIS_URL PREFIX
DATA_DIR TEXT LEASE_S`. Its model sleeps for a minute, so the test kills it (SIGKILL) while it
holds the lease for TEXT's key, as a replica dying mid-computation would."""

from __future__ import annotations

import sys
from pathlib import Path

from runtime import build_runtime
from settings import Settings
from tests.conftest import CountingTextModel


def main(argv: list[str]) -> None:
    url, prefix, data_dir, text, lease_s = argv
    settings = Settings.from_env({}).changed(
        redis__url=url, cache__prefix=prefix, server__data_dir=Path(data_dir),
        server__replica_id="doomed-holder", fleet__generation_refresh_s=0.1, fleet__heartbeat_s=0.1,
        fleet__flight_lease_max_s=float(lease_s), server__admin_token="holder-token",
    )  # fmt: skip
    with build_runtime(settings, models={"text": CountingTextModel(delay_s=60.0)}) as runtime:
        runtime.engine.classify("text", text)  # killed long before it returns


if __name__ == "__main__":
    main(sys.argv[1:])
