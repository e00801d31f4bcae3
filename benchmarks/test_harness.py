"""Checks of what the harness could get silently wrong: counting round
trips, and telling a correct run from a broken one.

Run with ``python -m pytest benchmarks``.  They use ``REDIS_URL`` when
it is set, else a private ``redis-server``.
"""

from __future__ import annotations

import math
import os
import random
import uuid
from typing import Any, Iterator

import pytest
import redis

from dramatiq_unique.backends.records import Copy
from dramatiq_unique.backends.redis import RedisBackend

from . import app, document, layers, throughput, trips
from .app import BARE, FLOOR_LOCK, FLOOR_ONE, FLOOR_RAW
from .report import (AT_FLOOR, AT_LOCK_FLOOR, FLOOR_MISSES, LOCK_FLOOR_MISSES, MET, NOT_MET, Results, figure_name,
                     median_interval, verdicts)
from .runs import Executions
from .server import BenchmarkError, PrivateRedis, cleanup, command_calls, connect


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


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    try:
        client = connect(redis_url)
    except BenchmarkError as e:
        pytest.fail(str(e))
    yield client
    client.close()


@pytest.fixture
def namespace(client: redis.Redis) -> Iterator[str]:
    namespace = f"bench-test-{uuid.uuid4().hex[:8]}"
    yield namespace
    cleanup(client, namespace)


@pytest.fixture
def counting() -> Iterator[None]:
    trips.reset()
    trips.install()
    yield
    trips.uninstall()


def test_a_pipeline_is_one_round_trip_and_scripts_are_told_apart(
    client: redis.Redis, namespace: str, counting: None
) -> None:
    # Given a lock backend on the same client, its script already loaded
    key = f"{namespace}:job:{{1}}:run"
    backend = RedisBackend(client=client)
    backend.acquire(key, "owner/0", ttl=1000)
    trips.reset()
    # When a transaction, a lock script and a plain command are sent
    with client.pipeline() as pipe:
        pipe.set(f"{key}:x", 1)
        pipe.get(f"{key}:x")
        pipe.execute()
    backend.acquire(key, "owner/1", ttl=1000)
    client.ping()
    # Then each is one round trip, named by what it carries
    counted = trips.counts()
    assert counted["MULTI+SET+GET+EXEC"] == 1
    assert counted["lock:acquire"] == 1
    assert counted["PING"] == 1
    assert trips.owner("lock:acquire") == "lock" and trips.owner("MULTI+SET+EXEC") == "mutex"


def test_a_run_lock_round_trip_is_named_by_what_it_carries(client: redis.Redis, namespace: str, counting: None) -> None:
    # Given a held run lock
    backend = RedisBackend(client=client)
    held, key = f"{namespace}:job:{{1}}:run", f"{namespace}:job:{{2}}:run"
    options: dict[str, Any] = {"ttl": 1000, "limit": 1, "lock": "while_executing", "copy": Copy(key, "b", 0, "")}
    for owner in ("z/0", "a/0"):
        backend.acquire(held, owner, ttl=1000, limit=2)
    backend.release_and_start([(held, "z/0")], f"{namespace}:job:{{3}}:run", "c/0", **options)  # loads the scripts
    trips.reset()
    # When a start carries the release of the held lock
    released, started = backend.release_and_start([(held, "a/0")], key, "b/0", **options)
    # Then it is one round trip, named as a start carrying releases
    assert trips.counts() == {"lock:start +releases": 1}
    assert trips.label([b"*1\r\n$4\r\nPING\r\n"]) == "PING"
    assert trips.owner("lock:start (grouped) +releases") == "lock"
    assert not isinstance(started, Exception) and started.acquisition.acquired
    assert [getattr(outcome, "held", None) for outcome in released] == [True]


def test_nothing_is_counted_once_uninstalled(client: redis.Redis, counting: None) -> None:
    trips.uninstall()
    client.ping()
    assert "PING" not in trips.counts()


def test_a_double_run_and_an_overlap_are_caught() -> None:
    # Given three sends
    serial = Executions(3, [(0, 0.0, 1.0), (1, 1.0, 2.0), (2, 2.5, 3.0)])
    twice = Executions(3, [(0, 0.0, 1.0), (1, 1.0, 2.0), (1, 2.5, 3.0)])
    overlapping = Executions(3, [(0, 0.0, 1.0), (1, 0.5, 2.0), (2, 2.5, 3.0)])
    # Then only the serial run passes
    assert serial.exactly_once and serial.overlaps == 0 and serial.seconds == 3.0
    assert not twice.exactly_once
    assert overlapping.exactly_once and overlapping.overlaps == 1


def test_the_median_interval_is_the_order_statistics_that_cover_the_median() -> None:
    # n = 9: the 2nd and 8th values cover the median with 96%, the 3rd and 7th with only 82%.
    assert median_interval([float(v) for v in range(9, 0, -1)]) == (2.0, 8.0)
    # n = 5: no narrower pair reaches 90%, so the whole range.
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0)
    assert median_interval([]) is None
    # Drawn from a skewed distribution, the interval holds the true median at least 90% of the time.
    draws = random.Random(7)
    true_median = math.log(2)  # of an exponential with rate 1
    covered = 0
    for _ in range(2000):
        low, high = median_interval([draws.expovariate(1.0) for _ in range(9)])  # type: ignore[misc]
        covered += low <= true_median <= high
    assert covered / 2000 >= 0.9


def _results(config: str, rounds: dict[str, list[float]]) -> Results:
    results = Results(meta={}, contenders=[])
    for contender, rates in rounds.items():
        for rate in rates:
            results.add(figure_name("process", config), contender, rate)
    return results


LEVEL_WITH = [85, 86, 84, 86, 85]


@pytest.mark.parametrize(
    "mine, raw, lock, verdict",
    [
        ([95, 96, 94, 97, 95], [90, 91, 89, 92, 90], [90] * 5, MET),  # at the target
        ([85, 86, 84, 86, 85], [84, 87, 83, 85, 86], [80] * 5, AT_FLOOR),  # level with a floor that misses it
        ([70, 71, 69, 72, 70], LEVEL_WITH, [80] * 5, FLOOR_MISSES),  # well under a floor that misses it
        ([80, 88, 79, 81, 80], LEVEL_WITH, [80] * 5, FLOOR_MISSES),  # one round level, the median 6% under
        ([85, 86, 84, 86, 85], [96, 97, 95, 98, 96], [96] * 5, NOT_MET),  # the floors meet it: only the lock misses
        (LEVEL_WITH, [96, 97, 95, 98, 96], [84, 87, 83, 85, 86], AT_LOCK_FLOOR),  # the lock floor misses it
        ([70, 71, 69, 72, 70], [96, 97, 95, 98, 96], LEVEL_WITH, LOCK_FLOOR_MISSES),  # and the lock is well under
    ],
)
def test_a_missed_fixed_target_is_at_a_floor_only_where_that_floor_misses_it_and_the_lock_is_level(
    mine: list[float], raw: list[float], lock: list[float], verdict: str
) -> None:
    results = _results("1 ms CPU job", {BARE: [100.0] * 5, "while_executing": mine, FLOOR_ONE: raw, FLOOR_RAW: raw,
                                        FLOOR_LOCK: lock})
    [found] = [v for v in verdicts(results) if "1 ms CPU job" in v.target]
    assert found.met == verdict


@pytest.mark.parametrize(
    "mine, one, lock, verdict",
    [
        ([70, 72, 69, 71, 70], [70, 71, 70, 70, 69], [80] * 5, MET),  # level with the 1-PING floor
        ([66, 67, 65, 66, 66], [70, 71, 70, 70, 69], [80] * 5, NOT_MET),  # the lock floor passes it
        ([66, 67, 65, 66, 66], [70, 71, 70, 70, 69], [66, 68, 65, 67, 66], AT_LOCK_FLOOR),  # the lock floor misses
        ([50, 51, 49, 50, 50], [70, 71, 70, 70, 69], [66, 68, 65, 67, 66], LOCK_FLOOR_MISSES),
    ],
)
def test_the_one_ping_target_is_blamed_on_the_lock_floor_only_where_that_floor_misses_it(
    mine: list[float], one: list[float], lock: list[float], verdict: str
) -> None:
    results = _results("prefetch 64", {BARE: [100.0] * 5, "while_executing": mine, FLOOR_ONE: one, FLOOR_LOCK: lock})
    [found] = [v for v in verdicts(results) if "prefetch 64" in v.target]
    assert found.met == verdict


def test_the_bare_socket_floor_makes_one_ping_per_job(redis_url: str, client: redis.Redis, namespace: str) -> None:
    broker, _ = app.build(FLOOR_RAW, redis_url=redis_url, namespace=namespace)
    floor = next(m for m in broker.middleware if isinstance(m, app.FloorRaw))
    before = command_calls(client)["ping"]
    for _ in range(5):
        floor.before_process_message(broker, None)
    assert command_calls(client)["ping"] - before == 5
    broker.close()


def test_the_lock_floor_takes_and_releases_the_lock_in_one_round_trip_a_job(
    redis_url: str, client: redis.Redis, namespace: str
) -> None:
    broker, actor = app.build(FLOOR_LOCK, redis_url=redis_url, namespace=namespace)
    floor = next(m for m in broker.middleware if isinstance(m, app.FloorLock))
    first, second = actor.message(7, 0), actor.message(7, 1)
    owners = [f"{first.message_id}/0".encode(), f"{second.message_id}/1".encode()]
    key = f"{namespace}:floor:{{7}}:run"
    floor.before_process_message(broker, first)
    assert owners[0] in client.hkeys(key)
    floor.after_process_message(broker, first)
    assert owners[0] in client.hkeys(key), "the release waits to ride with the thread's next start"
    calls = command_calls(client)
    floor.before_process_message(broker, second)
    assert command_calls(client)["evalsha"] - calls["evalsha"] == 2  # the release, then the start
    held = client.hkeys(key)
    assert owners[0] not in held and owners[1] in held
    # And a floor that could not run its script says so, rather than timing an error reply
    client.script_flush()
    with pytest.raises(Exception, match="NOSCRIPT"):
        floor.before_process_message(broker, actor.message(8, 2))
    broker.close()


@pytest.mark.parametrize("lock, blamed", [([70] * 5, "its client work"), ([64] * 5, "the lock floor itself")])
def test_what_stands_between_the_lock_and_the_one_ping_target_is_read_off_the_lock_floor(
    lock: list[float], blamed: str
) -> None:
    results = _results("prefetch 64", {BARE: [100.0] * 5, "while_executing": [63.0] * 5, FLOOR_ONE: [66.0] * 5,
                                       FLOOR_LOCK: lock})
    assert f"what stands between the lock and the target is {blamed}" in document._lock_floor_at_prefetch(results)


@pytest.mark.parametrize("contender", list(app.LAYER_SWITCHES))
def test_the_throughput_layer_switches_off_what_they_name(redis_url: str, client: redis.Redis, contender: str) -> None:
    # A real worker of 8 threads: without the releaser every release goes out on the worker thread in a
    # round trip of its own, and never rides with a start; without the group commit no round trip
    # carries two threads' starts.
    group_commit, in_background = app.LAYER_SWITCHES[contender]
    sent = 400
    _, run = throughput.audit(client, redis_url, contender, sent)
    assert run.exactly_once
    labels = set(run.worker_trips)
    if not group_commit:
        assert not any("(grouped)" in name for name in labels), run.worker_trips
        starts = sum(n for name, n in run.worker_trips.items() if name.startswith("lock:start"))
        assert starts == sent, run.worker_trips  # one round trip per start
    if not in_background:
        assert not any("+releases" in name for name in labels), run.worker_trips
        assert run.worker_trips.get("lock:release") == sent, run.worker_trips


def test_a_layers_run_replaces_its_own_section_and_nothing_else() -> None:
    page = "# Performance\n\n## How it measures\n\ntext\n\n## Notes\n\nnotes\n"
    first = layers.splice(page, f"{layers.HEADING}\n\nold figures\n")
    assert first == page.replace("## Notes", f"{layers.HEADING}\n\nold figures\n\n## Notes")
    second = layers.splice(first, f"{layers.HEADING}\n\nnew figures\n")
    assert second == first.replace("old figures", "new figures")


@pytest.mark.parametrize("without, verdict", [
    ([80.0, 82, 84, 86, 85, 83, 81, 84], layers.PAYS),  # 1.16-1.25 x: above 1 in every round
    ([80.0, 82, 110, 86, 105, 83, 120, 84], layers.PAYS_AT_MEDIAN),  # 1.16 at the median, below 1 in 3 rounds
    ([99.0, 98, 100, 97, 99, 98, 101, 99], layers.DOES_NOT_PAY),  # 1.01: under 3%
])
def test_a_piece_pays_where_taking_it_out_costs_3_percent_and_says_whether_the_rounds_show_it(
    without: list[float], verdict: str
) -> None:
    results = _results("default", {layers.SHIPPED: [100.0] * 8, app.NO_RELEASER: without})
    assert layers.pays(results, "releaser", "default") == verdict
    assert verdict in layers.gain_table(results)
