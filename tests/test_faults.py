"""The fault-injection suite, short: every scenario of `faults/` with small sizes.

Two app processes (`python app.py`) share a Redis the fixture starts; each scenario
injects one fault under load and checks every answer against the models' own. A
scenario passes with zero failed requests, zero wrong results and all its checks.
Run alone with `pytest -m faults`; full figures: `python -m faults`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from faults import config, harness, report, scenarios

pytestmark = [pytest.mark.faults, pytest.mark.redis]


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, redis_binary: str, real_models: dict[str, Any]
) -> Iterator[harness.Context]:
    work: Path = tmp_path_factory.mktemp("faults")
    context = harness.build_context(config.CI, work, models=real_models, log=print)
    yield context
    context.close()


@pytest.mark.parametrize("scenario", scenarios.SCENARIOS, ids=[s.name for s in scenarios.SCENARIOS])
def test_scenario(fleet: harness.Context, scenario: scenarios.Scenario) -> None:
    fleet.remaining = len(scenarios.SCENARIOS) - scenarios.SCENARIOS.index(scenario) - 1
    result = scenarios.run_scenario(fleet, scenario)
    described = report.describe(result)
    print(described)
    assert result.error is None, described
    assert result.failed == 0, described
    assert result.wrong == 0, described
    assert not result.checks_failed, described
