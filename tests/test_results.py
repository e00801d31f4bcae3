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
