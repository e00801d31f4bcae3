"""Failed releases, sent again off the worker thread until they land."""

from __future__ import annotations

import os
import time

from dramatiq_unique import StubBackend
from dramatiq_unique.worker.resend import FailedRelease, FailedReleases
from tests.conftest import wait_for


class FlakyBackend(StubBackend):
    """A stub backend whose releases fail while ``down`` is set."""

    down = True

    def release(self, key, owner, **options):  # type: ignore[no-untyped-def]
        if self.down:
            raise ConnectionError("the lock backend is unreachable")
        return super().release(key, owner, **options)


class Landed(list):  # type: ignore[type-arg]
    """Where the retries report: the key of each release that landed."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: list[object] = []

    def landed(self, failed: FailedRelease, outcome: object) -> None:
        self.append(failed.key)
        self.outcomes.append(outcome)

    def hand_over(self, handoff: object) -> None:
        raise AssertionError(f"no key is handed over here: {handoff}")


def now_ms() -> float:
    return time.monotonic() * 1000


def test_a_failed_release_lands_once_the_backend_is_back() -> None:
    backend = FlakyBackend()
    assert backend.acquire("k", "m", ttl=60_000).acquired
    landed = Landed()
    retries = FailedReleases(backend, reports=landed, first_retry=10, most_between=50)
    retries.submit(FailedRelease("k", "m", now_ms() + 60_000))
    # While the backend is down the release keeps failing, and keeps waiting
    wait_for(lambda: retries.pending() == 1 and backend.inspect("k") is not None, timeout=5, what="a retry")
    time.sleep(0.1)
    assert not landed and backend.inspect("k") is not None
    # Once it is back, the release lands within a retry interval, and its outcome is reported once
    backend.down = False
    wait_for(lambda: landed, timeout=5, what="the release to land")
    assert backend.inspect("k") is None
    assert [outcome.held for outcome in landed.outcomes] == [True]  # type: ignore[attr-defined]
    assert retries.pending() == 0
    retries.stop(timeout=100)


def test_a_release_whose_lock_expired_meanwhile_is_dropped_and_the_thread_ends() -> None:
    backend = FlakyBackend()
    retries = FailedReleases(backend, reports=Landed(), first_retry=10, most_between=20)
    retries.submit(FailedRelease("k", "m", now_ms() + 50))
    wait_for(lambda: retries.pending() == 0, timeout=5, what="the expired release to be dropped")
    wait_for(lambda: retries._thread.running_in is None, timeout=5, what="the retry thread to end")


def test_shutdown_waits_for_failed_releases_at_most_its_bound() -> None:
    backend = FlakyBackend()
    retries = FailedReleases(backend, reports=Landed(), first_retry=10, most_between=20)
    retries.submit(FailedRelease("k", "m", now_ms() + 60_000))
    began = time.monotonic()
    retries.stop(timeout=300)
    assert 0.25 <= time.monotonic() - began < 2.0
    assert retries.pending() == 0  # what was left is logged and left to expire


def test_a_forked_child_leaves_the_parents_failed_releases_to_the_parent() -> None:
    # Given a failed release waiting for its retry in the parent
    backend = FlakyBackend()
    assert backend.acquire("parent", "m", ttl=60_000).acquired
    assert backend.acquire("child", "m", ttl=60_000).acquired
    landed = Landed()
    retries = FailedReleases(backend, reports=landed, first_retry=10, most_between=20)
    retries.submit(FailedRelease("parent", "m", now_ms() + 60_000))
    read, write = os.pipe()
    # When the process forks, and the child's backend comes back and it submits a failed release of its own
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        left_at_fork = retries.pending()
        backend.down = False
        retries.submit(FailedRelease("child", "m", now_ms() + 60_000))
        deadline = time.monotonic() + 5
        while not landed and time.monotonic() < deadline:
            time.sleep(0.01)
        state = f"{left_at_fork}:{landed}:{backend.inspect('child') is None}:{backend.inspect('parent') is None}"
        os.write(write, state.encode())
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    # Then the child had none of the parent's, and its own retry thread landed its release, and only it
    assert os.read(read, 200).decode() == "0:['child']:True:False"
    # And the parent still retries its own
    assert retries.pending() == 1 and not landed
    backend.down = False
    wait_for(lambda: landed == ["parent"], timeout=5, what="the parent's release to land")
    retries.stop(timeout=100)


def test_a_run_locks_release_is_sent_on_past_its_lease_to_end_the_run_in_its_record() -> None:
    # Given a failed release of a run lock and one of an enqueue lock, both of locks that expire in 50 ms
    backend = FlakyBackend()
    assert backend.acquire("t:{a}:run", "a/1", ttl=60_000).acquired
    landed = Landed()
    retries = FailedReleases(backend, reports=landed, first_retry=10, most_between=20, record_ttl=60_000)
    retries.submit(FailedRelease("t:{a}:run", "a/1", now_ms() + 50))
    retries.submit(FailedRelease("t:{a}:queue", "a", now_ms() + 50))
    # When both locks' own expiry has passed while the backend is down
    wait_for(lambda: retries.pending() == 1, timeout=5, what="the enqueue lock's release to be dropped")
    time.sleep(0.1)
    # Then the run lock's release is still sent, and lands once the backend is back
    assert retries.pending() == 1 and not landed
    backend.down = False
    wait_for(lambda: landed, timeout=5, what="the run lock's release to land")
    assert backend.inspect("t:{a}:run") is None
    retries.stop(timeout=100)
