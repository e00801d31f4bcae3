"""Replace and debounce with real ``dramatiq`` worker processes
(2 processes x 4 threads), on the Redis broker and on RabbitMQ.

* Burst: 100 sends of one key as fast as the client goes, under
  ``debounce=500``: exactly one run, of the last send's arguments,
  starting at least 500 ms after the last send; no lock left.
* Starvation: a send every 200 ms for 6 s under ``debounce=500,
  debounce_max=2000``: a run at least every ~2 s, each with the newest
  arguments, none overlapping (``until_and_while_executing``).
* Retries: a superseded message that failed once and waits in Retries
  never runs again; the replacing message runs once.

Each prints what it measured (run with ``-s`` to see it).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import dramatiq
import pytest
import redis

from tests.apps import newest
from tests.conftest import wait_for
from tests.procs import WorkerGroup

#: The key suffixes of locks and waiters; ``:superseded`` and message
#: records (``:m:<id>``) expire on their own.
LOCK_SUFFIXES = (":queue", ":run", ":wait", ":bodies")


@dataclass
class Rig:
    kind: str
    namespace: str
    broker: dramatiq.Broker
    actors: dict[str, Any]
    records: redis.Redis

    def runs(self, actor: str, key: str) -> list[dict[str, Any]]:
        found = [json.loads(raw) for raw in self.records.lrange(f"{self.namespace}:runs", 0, -1)]
        return sorted((r for r in found if r["actor"] == actor and r["key"] == key), key=lambda r: r["start"])

    def lock_keys(self, key: str = "") -> list[str]:
        names = [name.decode() for name in self.records.scan_iter(match=f"{self.namespace}:*", count=1000)]
        return [name for name in names if name.endswith(LOCK_SUFFIXES)]


@pytest.fixture(scope="module", params=["redis", "rabbitmq"])
def rig(request: pytest.FixtureRequest, redis_url: str) -> Iterator[Rig]:
    kind = request.param
    namespace = f"newest-{uuid.uuid4().hex[:8]}"
    env = {"NEWEST_BROKER": kind, "NEWEST_REDIS_URL": redis_url, "NEWEST_NAMESPACE": namespace,
           "NEWEST_RABBITMQ_URL": "", "dramatiq_worker_timeout": "100"}
    if kind == "rabbitmq":
        env["NEWEST_RABBITMQ_URL"] = request.getfixturevalue("rabbitmq_url")
    broker, actors = newest.build(env)
    records = redis.Redis.from_url(redis_url)
    workers = WorkerGroup("tests.apps.newest:broker", processes=2, threads=4, env=env)
    try:
        with workers:
            workers.wait_booted(2)
            yield Rig(kind, namespace, broker, actors, records)
            assert workers.stop() == 0
    finally:
        if kind == "rabbitmq":
            for actor in actors.values():
                for queue in (actor.queue_name, f"{actor.queue_name}.DQ", f"{actor.queue_name}.XQ"):
                    broker.channel.queue_delete(queue)  # type: ignore[attr-defined]
        broker.close()
        names = list(records.scan_iter(match=f"{namespace}*", count=1000))
        if names:
            records.delete(*names)
        records.close()


def report(rig: Rig, figure: str, value: Any) -> None:
    print(f"\n[{rig.kind}] {figure} = {value}")


def settle(condition: Callable[[], bool], seconds: float, what: str) -> None:
    """Wait for ``condition``, then check it still holds ``seconds`` later."""
    wait_for(condition, timeout=20, what=what)
    time.sleep(seconds)
    assert condition(), what


def test_burst_runs_only_the_last_send_once(rig: Rig) -> None:
    burst = rig.actors["burst"]
    first = time.time()
    for n in range(100):
        last = time.time()
        burst.send("doc-1", n)
    took = time.time() - first
    wait_for(lambda: rig.runs("burst", "doc-1"), timeout=20, what="the run")
    # Every superseded copy was due before the last one; give the skips time to land.
    settle(lambda: not rig.lock_keys(), 1.0, "no lock or waiter key left")
    runs = rig.runs("burst", "doc-1")
    assert [r["n"] for r in runs] == [99]
    assert runs[0]["start"] >= last + 0.5
    record = rig.records.hgetall(f"{rig.namespace}:burst:{{{_digest(rig, 'burst', 'doc-1')}}}:queue:superseded")
    assert len(record) == 99  # every earlier send was superseded, and the record expires on its own
    report(rig, "burst: 100 sends took (ms)", round(took * 1000))
    report(rig, "burst: runs", len(runs))
    report(rig, "burst: run started after the last send (ms)", round((runs[0]["start"] - last) * 1000))


def test_starvation_runs_the_newest_every_debounce_max(rig: Rig) -> None:
    starve = rig.actors["starve"]
    sends: list[tuple[float, int]] = []
    first = time.time()
    for n in range(30):
        time.sleep(max(0.0, first + 0.2 * n - time.time()))
        sends.append((time.time(), n))
        starve.send("doc-2", n)
    wait_for(lambda: any(r["n"] == 29 for r in rig.runs("starve", "doc-2")), timeout=20, what="the last send's run")
    settle(lambda: not rig.lock_keys(), 0.5, "no lock or waiter key left")
    runs = rig.runs("starve", "doc-2")
    starts = [r["start"] for r in runs]
    gaps = [b - a for a, b in zip([first, *starts], starts)]
    # A burst is due debounce_max after its first send, which comes at
    # most one send interval (200 ms) after the previous run started.
    assert max(gaps[:-1]) <= 2.7, gaps
    for run in runs:
        newer = [n for t, n in sends if t < run["start"] - 0.1 and n > run["n"]]
        assert newer == [], f"run {run['n']} started after newer sends {newer}"
    spans = [(r["start"], r["end"]) for r in runs]
    assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:])), spans
    assert runs[-1]["n"] == 29 and runs[-1]["start"] >= sends[-1][0] + 0.5
    report(rig, "starvation: runs in 6 s", len(runs))
    report(rig, "starvation: gaps between run starts (ms)", [round(g * 1000) for g in gaps])
    report(rig, "starvation: arguments run", [r["n"] for r in runs])


def test_a_superseded_message_waiting_in_retries_never_runs_again(rig: Rig) -> None:
    flaky = rig.actors["flaky"]
    failing = flaky.send("doc-3", 1, True)
    wait_for(lambda: rig.runs("flaky", "doc-3"), timeout=20, what="the failing run")
    replacing = flaky.send("doc-3", 2, False)
    assert replacing.options["unique_replaced"] == failing.message_id
    retried_by = time.time() + newest.RETRY_DELAY / 1000
    wait_for(lambda: any(r["n"] == 2 for r in rig.runs("flaky", "doc-3")), timeout=20, what="the replacing run")
    wait_for(lambda: time.time() > retried_by and not rig.lock_keys(), timeout=20, what="the retry's skip")
    time.sleep(0.5)
    assert [r["n"] for r in rig.runs("flaky", "doc-3")] == [1, 2]
    assert not rig.lock_keys()


def _digest(rig: Rig, actor: str, key: str) -> str:
    from dramatiq_unique import digest_for

    return digest_for(rig.actors[actor], key, 0)
