"""Fixtures of the fault suite, and the figures it measures.

Every measured figure is printed at the end of the run under
"dramatiq-unique fault figures", so CI logs carry the numbers that
``docs/reliability.md`` quotes.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable, Iterator

import pytest
import redis

from tests.faults.harness import Harness, RedisServer


def pytest_terminal_summary(terminalreporter: Any) -> None:
    # Read from the tests' reports, not from a list in this process: in a
    # parallel run (setup.cfg's -n) the tests, and the figures they
    # record, are in the worker processes, whose reports come here.
    figures = [(report.nodeid.split("::")[-1], name, value)
               for reports in terminalreporter.stats.values() for report in reports
               if getattr(report, "when", None) == "call" for name, value in getattr(report, "user_properties", ())]
    if not figures:
        return
    terminalreporter.section("dramatiq-unique fault figures")
    for test, name, value in figures:
        terminalreporter.write_line(f"{test}: {name} = {value}")


@pytest.fixture
def figure(record_property: Callable[[str, Any], None]) -> Callable[[str, Any], None]:
    """Record one measured figure of this test."""
    return record_property


@pytest.fixture
def lock_server() -> Iterator[RedisServer]:
    """A Redis for locks only, that the test may stop and restart."""
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def make_harness(
    redis_url: str, redis_client: redis.Redis, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Harness]]:
    """Build a :class:`Harness`: ``make_harness(broker="rabbitmq",
    FAULTS_LEASE="3000", ...)``.  Its workers are killed and its queues
    deleted at teardown.
    """
    made: list[Harness] = []

    def make(broker: str = "redis", **env: str) -> Harness:
        base = {"FAULTS_NAMESPACE": f"faults-{uuid.uuid4().hex[:10]}", "FAULTS_RECORD_URL": redis_url,
                "FAULTS_BROKER": broker}
        if broker == "rabbitmq":
            base["FAULTS_RABBITMQ_URL"] = request.getfixturevalue("rabbitmq_url")
        harness = Harness(redis_client, {**base, **env})
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.close()
