"""Only a run that leaves nothing to do finishes its message: a failed
run never does, so the next copy of a message that once waited for its
key runs, whether it is Retries' re-enqueue, the broker's redelivery of
the copy that ran (its retry's enqueue and its ack lost), or an
operator's replay of the dead letter.  The same replay of a message
that never waited runs too.
"""

from __future__ import annotations

import time
from typing import Optional

import pika  # type: ignore[import-untyped]
import pytest
from dramatiq import Message

from tests.conftest import wait_for
from tests.faults.harness import Harness
from tests.faults.proxy import through

BROKERS = ["redis", "rabbitmq"]
EVENTS = "rescheduled,skipped,lock_lost,backend_error"


def copies(h: Harness, event: str, message_id: str) -> int:
    return sum(1 for e in h.events(event) if e["message_id"] == message_id)


def starts_of(h: Harness, message_id: str) -> int:
    return [r.message_id for r in h.starts()].count(message_id)


def dead_letter(h: Harness, message_id: str) -> Optional[bytes]:
    """Take the dead-lettered copy of a message off its dead-letter
    queue, as an operator's tool does; None while there is none.
    """
    if h.env["FAULTS_BROKER"] == "redis":
        name = f"{h.namespace}:{h.namespace}.XQ"
        for field, raw in h.records.hgetall(f"{name}.msgs").items():
            if Message.decode(raw).message_id == message_id:
                h.records.hdel(f"{name}.msgs", field)
                h.records.zrem(name, field)
                return bytes(raw)
        return None
    connection = pika.BlockingConnection(pika.URLParameters(h.env["FAULTS_RABBITMQ_URL"]))
    try:
        channel = connection.channel()
        found = None
        while found is None:
            method, _, body = channel.basic_get(f"{h.namespace}.XQ")
            if method is None:
                break
            if Message.decode(body).message_id == message_id:
                channel.basic_ack(method.delivery_tag)
                found = bytes(body)
        return found
    finally:
        connection.close()  # what it did not take goes back


def replay(h: Harness, message_id: str, *, reset: bool) -> None:
    """Send a dead letter back to its queue, as it is or with its retries reset."""
    taken: list[Optional[bytes]] = [None]

    def take() -> bool:
        taken[0] = dead_letter(h, message_id)
        return taken[0] is not None

    wait_for(take, timeout=30, what=f"message {message_id} to be dead-lettered")
    assert taken[0] is not None
    message = Message.decode(taken[0])
    if reset:
        message = message.copy(options={"retries": 0})
    h.app.broker.enqueue(message)


@pytest.mark.parametrize("broker", BROKERS)
@pytest.mark.parametrize("waited", [True, False], ids=["once waited", "never waited"])
def test_a_replayed_dead_letter_runs_again(make_harness, figure, broker, waited):
    # Given a message that always fails (max_retries=1), rescheduled behind a running one or not
    h = make_harness(broker, FAULTS_RESCHEDULE_DELAY="1000", FAULTS_EVENTS=EVENTS)
    h.workers(processes=1, threads=2)
    if waited:
        holder = h.app.flaky.send("k", fails=0, gate="a")
        h.started(holder.message_id)
    failing = h.app.flaky.send("k", fails=99)
    if waited:
        wait_for(lambda: copies(h, "rescheduled", failing.message_id) >= 1, what="the reschedule")
        h.open_gate("a")
    # When it ran, was retried and dead-lettered, and an operator replays the dead letter, as it is
    wait_for(lambda: starts_of(h, failing.message_id) == 2, what="its run and its retry")
    replay(h, failing.message_id, reset=False)
    # Then it runs again (and fails, so it is dead-lettered again: its one retry is spent)
    wait_for(lambda: starts_of(h, failing.message_id) == 3, timeout=20, what="the replay to run")
    # and a replay with its retries reset runs, and is retried
    replay(h, failing.message_id, reset=True)
    wait_for(lambda: starts_of(h, failing.message_id) == 5, timeout=20, what="the second replay to run twice")
    figure("starts", starts_of(h, failing.message_id))


def test_a_failed_run_whose_retry_and_ack_are_lost_runs_again_on_rabbitmq(
    make_harness, rabbitmq_proxy, rabbitmq_url, figure
):
    # Given workers that reach RabbitMQ through a proxy, and two messages that fail their first run
    # (max_retries=1): one rescheduled behind a running message of its key, one that never waited
    proxy = rabbitmq_proxy
    h = make_harness("rabbitmq", FAULTS_RESCHEDULE_DELAY="1000", FAULTS_EVENTS=EVENTS)
    h.workers(processes=1, threads=3, FAULTS_RABBITMQ_URL=through(proxy, rabbitmq_url))
    holder = h.app.flaky.send("k", fails=0, gate="a")
    h.started(holder.message_id)
    waited = h.app.flaky.send("k", fails=1, gate="b")
    wait_for(lambda: copies(h, "rescheduled", waited.message_id) >= 1, what="the reschedule")
    control = h.app.flaky.send("c", fails=1, gate="b")
    h.open_gate("a")
    wait_for(lambda: starts_of(h, waited.message_id) == 1 and starts_of(h, control.message_id) == 1,
             what="both to start")
    # When RabbitMQ is cut for 6 s as both runs fail: Retries' publish fails, the ack is lost,
    # and RabbitMQ delivers the copy that ran again once the worker reconnects
    proxy.cut()
    h.open_gate("b")
    time.sleep(6)
    proxy.heal()
    # Then both run again (the redelivered copy fails again, its retry is enqueued) and run their retry
    try:
        for message in (control, waited):
            wait_for(lambda m=message: starts_of(h, m.message_id) >= 3, timeout=45,
                     what=f"message {message.message_id} to run again, and its retry")
    finally:
        figure("starts_of_the_waited_message", starts_of(h, waited.message_id))
        figure("starts_of_the_control", starts_of(h, control.message_id))
