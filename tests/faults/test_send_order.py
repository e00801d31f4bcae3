"""Hand-offs in send order: the waiters of one key run in the order
they were sent, sends of the same millisecond included.
"""

from __future__ import annotations

from collections import Counter

from tests.conftest import wait_for

SENDS = 20


def test_waiters_of_one_key_are_handed_it_in_send_order(make_harness, figure):
    # Given a job holding key k, and delayed copies that come back only long after (10 s)
    h = make_harness("redis", FAULTS_RESCHEDULE_DELAY="10000")
    h.workers(processes=1, threads=4)
    holder = h.app.hold.send("k", gate="holder")
    h.started(holder.message_id)
    # When 20 messages of k are sent in one loop, several of them within one millisecond
    sent = [h.app.hold.message("k") for _ in range(SENDS)]
    for message in sent:
        h.app.broker.enqueue(message)
    per_ms = Counter(int(message.message_timestamp) for message in sent)
    unique, spec = h.app.unique, h.app.unique.specs["hold"]
    key = unique.key(spec, spec.digest(("k",), {}), "run")
    wait_for(lambda: len(unique.backend.waiters(key)) == SENDS, timeout=30, what="every send to wait for k")
    h.open_gate("holder")
    # Then each waiter is handed the key in the order it was sent
    wait_for(lambda: len(h.runs()) == SENDS + 1, timeout=30, what="every message to run")
    ran = [run.message_id for run in sorted(h.runs(), key=lambda run: run.start)]
    order = [ran.index(message.message_id) for message in sent]
    figure("sends_sharing_a_millisecond", max(per_ms.values()))
    figure("hand_off_order", order)
    assert max(per_ms.values()) >= 2, per_ms
    assert ran[0] == holder.message_id
    assert order == list(range(1, SENDS + 1)), order
