"""The ``replace`` send row of the harness: one lock round trip per
send, beside an ``until_executed`` send's one round trip for its lock
and its enqueue together.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest
import redis

from .replace_cost import send_costs
from .server import BenchmarkError, PrivateRedis, connect


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    try:
        server = PrivateRedis().start()
    except BenchmarkError as e:
        pytest.fail(str(e))
    yield server.url
    server.stop()


def test_a_replace_send_costs_one_lock_round_trip_and_an_until_executed_send_one_in_all(redis_url: str) -> None:
    client: redis.Redis = connect(redis_url)
    try:
        costs = send_costs(client, redis_url, calls=40, chunk=10)
    finally:
        client.close()
    names = [cost.name for cost in costs]
    assert names == [
        "`until_executed` send of a new key (1 round trip: the lock and dispatch.lua in send.lua)",
        "`replace` send superseding the holder (1 lock round trip + dispatch.lua)",
    ]
    assert all(cost.wall > 0 and cost.server is not None and cost.server > 0 for cost in costs)
