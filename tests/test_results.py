"""What a caller waiting on a result gets when a conflict ends the
message: the conflict, at once, never a timeout or a ``None``.
"""

from __future__ import annotations

import threading

import dramatiq
import pytest
from dramatiq.results import Results, ResultFailure
from dramatiq.results.backends import StubBackend as ResultsStub

from tests.conftest import make_worker, unique


@pytest.mark.parametrize("strategy", ["log", "reject"])
def test_a_dropped_or_rejected_message_gives_its_caller_the_conflict(stub_broker, strategy):
    # Given an actor that stores results, and a run of it holding its key
    results = ResultsStub()
    stub_broker.add_middleware(Results(backend=results))
    stub_broker.add_middleware(unique())
    release = threading.Event()

    @dramatiq.actor(broker=stub_broker, lock="while_executing", on_conflict=strategy, store_results=True)
    def sync(account_id: int) -> str:
        release.wait(10)
        return "synced"

    worker = make_worker(stub_broker, threads=2)
    try:
        first = sync.send(1)
        # When a second message of the key meets the held lock
        second = sync.send(1)
        # Then its caller learns why at once, not after a timeout
        with pytest.raises(ResultFailure) as failure:
            second.get_result(backend=results, block=True, timeout=5_000)
        assert failure.value.orig_exc_type == "LockConflict"
        assert first.message_id in failure.value.orig_exc_msg
        release.set()
        assert first.get_result(backend=results, block=True, timeout=5_000) == "synced"
        assert len(stub_broker.dead_letters) == (1 if strategy == "reject" else 0)
    finally:
        release.set()
        worker.stop()


def test_a_refused_duplicate_in_a_group_gives_its_caller_the_duplicate(stub_broker):
    # Given an enqueue lock held by a queued message, and a group with a duplicate of it
    results = ResultsStub()
    stub_broker.add_middleware(Results(backend=results))
    stub_broker.add_middleware(unique())

    @dramatiq.actor(broker=stub_broker, lock="until_executed", store_results=True)
    def report(day: str) -> str:
        return f"report {day}"

    holder = report.send("monday")
    members = dramatiq.group([report.message("tuesday"), report.message("monday")], broker=stub_broker).run()
    worker = make_worker(stub_broker)
    try:
        # Then the refused member's caller gets a ResultFailure naming the holder, and the rest run
        with pytest.raises(ResultFailure) as failure:
            members.children[1].get_result(backend=results, block=True, timeout=5_000)
        assert failure.value.orig_exc_type == "DuplicateMessage"
        assert holder.message_id in failure.value.orig_exc_msg
        assert members.children[0].get_result(backend=results, block=True, timeout=5_000) == "report tuesday"
        assert holder.get_result(backend=results, block=True, timeout=5_000) == "report monday"
    finally:
        worker.stop()
