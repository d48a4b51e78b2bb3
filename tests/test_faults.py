"""The fault-injection suite, short: every scenario of `bench/faults.py` with small sizes.

Two app processes (`python app.py`) share a Redis the fixture starts; each scenario
injects one fault under load and checks every answer against the models' own. A
scenario passes with zero failed requests, zero wrong results and all its checks.
Run alone with `pytest -m faults`; full figures: `python -m bench.faults`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench import faults

pytestmark = [pytest.mark.faults, pytest.mark.redis]


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, redis_binary: str, real_models: dict[str, Any]
) -> Iterator[faults.Context]:
    work: Path = tmp_path_factory.mktemp("faults")
    context = faults.build_context(faults.CI, work, models=real_models, log=print)
    yield context
    context.close()


@pytest.mark.parametrize("scenario", faults.SCENARIOS, ids=[s.name for s in faults.SCENARIOS])
def test_scenario(fleet: faults.Context, scenario: faults.Scenario) -> None:
    fleet.remaining = len(faults.SCENARIOS) - faults.SCENARIOS.index(scenario) - 1
    result = faults.run_scenario(fleet, scenario)
    report = faults.describe(result)
    print(report)
    assert result.error is None, report
    assert result.failed == 0, report
    assert result.wrong == 0, report
    assert not result.checks_failed, report
