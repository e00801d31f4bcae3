"""A worker whose lock backend is wherever ``BOOT_LOCKS_URL`` says, for
the test of what a worker says at boot when it cannot reach it.

The broker is a ``StubBroker``: the worker process needs no server of
its own, so the lock backend is the only thing it could fail to reach.
"""

from __future__ import annotations

import os

import dramatiq
from dramatiq.brokers.stub import StubBroker

from dramatiq_unique import UniqueMiddleware
from dramatiq_unique.backends import from_url

broker = StubBroker()
broker.add_middleware(UniqueMiddleware(backend=from_url(os.environ["BOOT_LOCKS_URL"])))


@dramatiq.actor(broker=broker, lock="while_executing")
def sync_account_balance(account_id: int) -> None:
    pass
