"""Quiet when unused: a broker with UniqueMiddleware whose actors declare
no lock is left exactly as it was, once a real worker has booted: the
middleware order stays, and no filter goes onto Dramatiq's loggers.
With one locked actor, declared after the middleware was added, boot
still places the middleware before AgeLimit and quiets its skips.
"""

from __future__ import annotations

import logging
from typing import Iterator

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker

from dramatiq_unique.compat import WORKER_THREAD_LOGGER
from dramatiq_unique.worker.take import QuietSkips
from tests.conftest import make_worker, unique

#: The loggers the middleware's boot hook used to touch.
LOGGERS = (WORKER_THREAD_LOGGER, "dramatiq", "dramatiq.worker", "dramatiq.worker.Worker", "dramatiq_unique")


@pytest.fixture
def no_quiet_filter() -> Iterator[None]:
    """Dramatiq's loggers without the process-wide QuietSkips an earlier
    test may have installed; put back afterwards.
    """
    removed = []
    for name in LOGGERS:
        logger = logging.getLogger(name)
        for existing in [f for f in logger.filters if isinstance(f, QuietSkips)]:
            logger.removeFilter(existing)
            removed.append((logger, existing))
    yield
    for name in LOGGERS:
        logger = logging.getLogger(name)
        for existing in [f for f in logger.filters if isinstance(f, QuietSkips)]:
            logger.removeFilter(existing)
    for logger, existing in removed:
        logger.addFilter(existing)


def filters() -> dict[str, list[logging.Filter]]:
    return {name: list(logging.getLogger(name).filters) for name in LOGGERS}


def boot(broker: StubBroker) -> None:
    worker = make_worker(broker, threads=1)
    worker.stop()


def test_with_no_locked_actor_boot_changes_nothing(stub_broker: StubBroker, no_quiet_filter: None) -> None:
    # Given UniqueMiddleware added last, and actors declared after it, none with a lock
    stub_broker.add_middleware(unique())
    dramatiq.actor(lambda key: None, broker=stub_broker, actor_name="plain")
    dramatiq.actor(lambda key: None, broker=stub_broker, actor_name="retried", max_retries=3)
    before, logged = list(stub_broker.middleware), filters()
    # When a real worker boots
    boot(stub_broker)
    # Then the stack keeps its order (Dramatiq 2.x's Worker adds a middleware of its own), and no logger got a filter
    kept = [m for m in stub_broker.middleware if any(m is b for b in before)]
    assert [type(m).__name__ for m in kept] == [type(m).__name__ for m in before]
    assert filters() == logged


def test_a_locked_actor_declared_after_the_middleware_still_places_it(
    stub_broker: StubBroker, no_quiet_filter: None
) -> None:
    # Given UniqueMiddleware added last, then one locked actor beside an unlocked one
    stub_broker.add_middleware(unique())
    dramatiq.actor(lambda key: None, broker=stub_broker, actor_name="plain")
    dramatiq.actor(lambda key: None, broker=stub_broker, actor_name="locked", lock="while_executing")
    names = [type(m).__name__ for m in stub_broker.middleware]
    assert names.index("UniqueMiddleware") > names.index("AgeLimit")
    # When a real worker boots
    boot(stub_broker)
    # Then the middleware runs before AgeLimit, and the worker threads' logger drops our skips
    names = [type(m).__name__ for m in stub_broker.middleware]
    assert names.index("UniqueMiddleware") < names.index("AgeLimit")
    assert any(isinstance(f, QuietSkips) for f in logging.getLogger(WORKER_THREAD_LOGGER).filters)
