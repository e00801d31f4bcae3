"""Dramatiq's own metrics and logs under contention, as deployed: real
``dramatiq`` worker processes with Dramatiq's ``Prometheus`` middleware,
scraped from its multiprocess exposition, in either ``add_middleware``
order, and the workers' own log.

The worker processes import ``tests.apps.contended``; this module does
not import ``prometheus_client`` at the top, for the reason given in
``tests/test_prometheus.py``.
"""

from __future__ import annotations

import re
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

import pytest
import redis

from tests.apps.contended import build
from tests.conftest import free_port, wait_for
from tests.procs import WorkerGroup

#: Four messages for account 1, two for account 2, on 2 processes x 2 threads.
SENDS = [1, 1, 1, 1, 2, 2]
STALE = 2
INPROGRESS = "dramatiq_messages_inprogress"
TOTAL = "dramatiq_messages_total"
EVENTS = "dramatiq_unique_lock_events_total"


def total(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


@dataclass
class Run:
    """What one contended run left: every scrape's in-progress gauge,
    the final scrape, the worker log and the recorded runs.
    """

    order: str
    gauges: list[float] = field(default_factory=list)
    final: str = ""
    log: str = ""
    runs: int = 0
    stale_ran: int = 0


def contended_run(order: str, redis_url: str, tmp: Any) -> Run:
    namespace, port = f"contended-{uuid.uuid4().hex[:8]}", free_port()
    env = {"CONTENDED_NAMESPACE": namespace, "CONTENDED_REDIS_URL": redis_url, "CONTENDED_ORDER": order,
           "dramatiq_prom_db": str(tmp / "db"), "dramatiq_prom_lock": str(tmp / "prom.lock"),
           "dramatiq_prom_host": "127.0.0.1", "dramatiq_prom_port": str(port)}
    (tmp / "db").mkdir()
    client = redis.Redis.from_url(redis_url)
    broker, hold, stale = build(env, metrics=False)
    for account in SENDS:
        hold.send(account)
    for _ in range(STALE):
        stale.send_with_options(max_age=1)
    result = Run(order)
    url = f"http://127.0.0.1:{port}/metrics"

    def scrape() -> str:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                text: str = response.read().decode()
        except OSError:
            return ""
        if text:
            result.gauges.append(total(text, INPROGRESS))
        return text

    def drained() -> bool:
        scrape()
        pending = sum(client.hlen(f"{namespace}:{queue}.msgs") for queue in (namespace, f"{namespace}.DQ"))
        return client.llen(f"{namespace}:runs") == len(SENDS) and pending == 0

    try:
        with WorkerGroup("tests.apps.contended:broker", processes=2, threads=2, env=env, extra=("-v",)) as workers:
            workers.wait_booted(2)
            wait_for(drained, timeout=60, interval=0.02, what=f"{len(SENDS)} runs and empty queues")
            wait_for(lambda: scrape() != "", timeout=10, what="a scrape")
            result.final = scrape()
            assert workers.stop() == 0
            result.log = workers.output()
        result.runs = client.llen(f"{namespace}:runs")
        result.stale_ran = client.llen(f"{namespace}:stale-ran")
    finally:
        broker.close()
        for key in client.scan_iter(match=f"{namespace}*"):
            client.delete(key)
        client.close()
    return result


@pytest.fixture(scope="module", params=["prometheus_first", "unique_first"])
def contended(request: pytest.FixtureRequest, redis_url: str, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[Run]:
    yield contended_run(request.param, redis_url, tmp_path_factory.mktemp(request.param))


def test_inprogress_gauge_is_never_negative_and_returns_to_zero(contended):
    rescheduled = total(contended.final, EVENTS, actor_name="hold", event="rescheduled")
    print(f"{contended.order}: {len(contended.gauges)} scrapes, in-progress min {min(contended.gauges)}, "
          f"max {max(contended.gauges)}, final {total(contended.final, INPROGRESS)}; "
          f"{TOTAL} {total(contended.final, TOTAL, actor_name='hold')} for {contended.runs} runs "
          f"and {rescheduled} reschedules; dramatiq_delayed_messages_inprogress "
          f"{total(contended.final, 'dramatiq_delayed_messages_inprogress')}")
    assert rescheduled >= 1, "the run was not contended"
    assert min(contended.gauges) >= 0
    assert max(contended.gauges) >= 1, "no scrape saw a message in progress"
    assert total(contended.final, INPROGRESS) == 0


def test_messages_total_counts_each_delivery(contended):
    # Every delivery taken off the queue counts once: the runs, each
    # rescheduled delivery, and at most one superseded copy per reschedule.
    counted = total(contended.final, TOTAL, actor_name="hold")
    rescheduled = total(contended.final, EVENTS, actor_name="hold", event="rescheduled")
    assert contended.runs == len(SENDS)
    assert total(contended.final, EVENTS, actor_name="hold", event="locked") == len(SENDS)
    assert len(SENDS) + rescheduled <= counted <= len(SENDS) + 2 * rescheduled


def test_rescheduled_deliveries_log_no_skip_warning(contended):
    # Ours stays, at DEBUG; Dramatiq's WARNING for a reschedule is gone.
    assert len(re.findall(r"Rescheduled hold\(\d\): run lock", contended.log)) >= 1
    assert re.findall(r"Message hold\(\d\) was skipped", contended.log) == []


def test_a_skip_by_another_middleware_still_warns(contended):
    # AgeLimit skips the stale messages: Dramatiq's WARNING stays.
    assert contended.stale_ran == 0
    assert len(re.findall(r"WARNING.*Message stale\(\) was skipped", contended.log)) == STALE
