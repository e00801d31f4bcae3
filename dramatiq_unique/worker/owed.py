"""Releases that a stopping worker could not send, made by the next one.

A worker that stops while its lock backend is out of reach still owes
the releases it could not send: the failed releases that
:class:`~.failed.FailedReleases` was sending again, and the run
lock releases still waiting in the :class:`~.releaser.Releaser`.  Left
in its memory they would die with it, and an ``until_executed`` key
would stay held for its ``lock_ttl`` (24 h by default).  So the
stopping process writes them to the broker, as one message of a small
internal actor (:data:`OWED_ACTOR`) on a queue it consumed; whichever
worker processes that message makes the releases, each checking its
owner, and enqueues the message again, with backoff, for those the
backend still refuses, until each lands or its lock would have expired
by itself.

What tells a stopping process from a killed one: only a process that
runs its shutdown hooks writes what it owes.  A SIGKILLed process owes
nothing it can say, and an ``until_executed`` lock whose worker died
mid-run is kept until its redelivery runs, as before.

Every release is owner-checked, so making one twice is harmless: the
second finds its owner gone and changes nothing.  That is what makes an
enqueue whose outcome is unknown (it failed after its send, or did not
return within the bound) safe to send again.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import dramatiq
from dramatiq import Message
from dramatiq.logging import get_logger

from ..background import JITTER, now_ms

if TYPE_CHECKING:
    from dramatiq import Broker

    from ..send.context import LockContext

#: The internal actor that makes owed releases.
OWED_ACTOR = "dramatiq_unique_owed_releases"

#: Milliseconds before the first retry of a release the backend still
#: refused; each retry waits twice as long, up to ``DEFAULT_MOST_BETWEEN``.
DEFAULT_FIRST_RETRY = 500

#: The longest wait between two retries, in milliseconds.
DEFAULT_MOST_BETWEEN = 5_000

#: How often a stopping process tries its enqueue again within its
#: bound, in milliseconds.
ENQUEUE_RETRY = 100

#: The most releases one message carries.
BATCH = 1_000


@dataclass(frozen=True)
class OwedRelease:
    """One release a stopping process could not send.

    Attributes:
      key(str): The lock key.
      owner(str): The owner the release checks.
      until(int): Unix milliseconds when the lock expires by itself:
        no release is made after that.
      options(dict): Further keyword arguments of the release call,
        made again as given.
    """

    key: str
    owner: str
    until: int
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def within(cls, key: str, owner: str, left: float, options: Optional[dict[str, Any]] = None) -> "OwedRelease":
        """One whose lock expires ``left`` milliseconds from now."""
        return cls(key, owner, int(time.time() * 1000 + max(left, 0)), dict(options or {}))

    def encode(self) -> dict[str, Any]:
        return {"key": self.key, "owner": self.owner, "until": self.until, "options": self.options}

    @classmethod
    def decode(cls, data: dict[str, Any]) -> "OwedRelease":
        return cls(str(data["key"]), str(data["owner"]), int(data["until"]), dict(data.get("options") or {}))


class OwedReleases:
    """Writes what a stopping process owes, and makes what another owed.

    Parameters:
      service(LockContext): The middleware's lock context, whose
        backend makes the owed releases.
      first_retry(int): Milliseconds before the first retry.
      most_between(int): The longest wait between retries, in ms.
    """

    def __init__(
        self,
        service: "LockContext",
        *,
        first_retry: int = DEFAULT_FIRST_RETRY,
        most_between: int = DEFAULT_MOST_BETWEEN,
    ) -> None:
        self.logger = get_logger(__name__, type(self))
        self.service = service
        self.first_retry = first_retry
        self.most_between = most_between
        self.actor: Optional[dramatiq.Actor[Any, Any]] = None

    def declare(self, broker: "Broker", queue_name: str) -> None:
        """Declare the internal actor on ``queue_name``, a queue this
        worker consumes, unless the broker has it already.
        """
        if OWED_ACTOR in broker.actors:
            self.actor = broker.actors[OWED_ACTOR]
            return
        # Actor(), not @actor: its options are checked by no middleware.
        self.actor = dramatiq.Actor(self.make, broker=broker, actor_name=OWED_ACTOR, queue_name=queue_name,
                                    priority=0, options={})

    # The stopping process ---------------------------------------------------

    def write(self, owed: list[OwedRelease], *, timeout: float) -> bool:
        """Enqueue ``owed`` for the next worker, trying again for at most
        ``timeout`` milliseconds, on a thread of its own so that a broker
        that never answers cannot hold the shutdown.  What could not be
        written is logged, key by key, and left to expire with its lock.

        Returns:
          bool: True when every message was enqueued.
        """
        if not owed:
            return True
        if self.actor is None:
            self._unwritten(owed, "no queue of this worker runs a locked actor")
            return False
        deadline = now_ms() + timeout
        batches = [owed[i : i + BATCH] for i in range(0, len(owed), BATCH)]
        left: list[list[OwedRelease]] = []
        for batch in batches:
            if not self._enqueue_within(self._message(batch, attempt=0), deadline):
                left.append(batch)
        if left:
            self._unwritten([release for batch in left for release in batch], "the broker did not take them")
            return False
        self.logger.warning(
            "%d release(s) could not be sent before shutdown: they were written to queue %r, and the next "
            "worker makes them.", len(owed), self.actor.queue_name,
        )
        return True

    def _enqueue_within(self, message: Message[Any], deadline: float) -> bool:
        """Enqueue ``message``, again after a failure, until ``deadline``.
        A failure after the send may have enqueued it: a second copy
        makes the same owner-checked releases, which is harmless.
        """
        while now_ms() < deadline:
            sending = _Send(self, message)
            if not sending.done.wait(timeout=max(deadline - now_ms(), 0) / 1000):
                return False  # still sending: it may land, or not
            if sending.error is None:
                return True
            self.logger.debug("Could not write owed releases to the broker: %r", sending.error)
            time.sleep(min(ENQUEUE_RETRY, max(deadline - now_ms(), 0)) / 1000)
        return False

    def _unwritten(self, owed: list[OwedRelease], why: str) -> None:
        for release in owed:
            self.logger.error(
                "Lock %r of %s could not be released before shutdown, and %s: it expires by itself, or "
                "`dramatiq-unique release` frees it.", release.key, release.owner, why,
            )

    def _message(self, owed: list[OwedRelease], *, attempt: int) -> Message[Any]:
        assert self.actor is not None
        return self.actor.message_with_options(args=([release.encode() for release in owed],),
                                               kwargs={"attempt": attempt})

    # The next worker ----------------------------------------------------------

    def make(self, releases: list[dict[str, Any]], attempt: int = 0) -> None:
        """The actor: make each owed release, and enqueue again, later,
        those the backend refused.
        """
        backend = self.service.locks
        assert self.actor is not None
        now = time.time() * 1000
        left, made = [], 0
        for release in map(OwedRelease.decode, releases):
            if release.until <= now:
                self.logger.warning("Gave up releasing %r: it has expired by itself.", release.key)
                continue
            try:
                outcome = backend.release(release.key, release.owner, **release.options)
            except Exception as e:
                self.logger.debug("An owed release of %r failed again: %r", release.key, e)
                left.append(release)
                continue
            made += 1
            if outcome.promoted is not None:
                self._hand_over(release.key, outcome.promoted)
        if made:
            self.logger.info("Made %d release(s) owed by a worker that stopped.", made)
        if left:
            wait = min(self.first_retry * 2**attempt, self.most_between) * JITTER.uniform(0.5, 1.0)
            self.actor.broker.enqueue(self._message(left, attempt=attempt + 1), delay=int(wait))

    def _hand_over(self, key: str, encoded: bytes) -> None:
        assert self.actor is not None
        try:
            self.actor.broker.enqueue(Message.decode(encoded))
        except Exception as e:
            self.logger.warning("Could not hand %r to its next waiter (%r); it runs after its delay.", key, e)


class _Send:
    """One enqueue of owed releases, on a daemon thread of its own: a
    broker that never answers holds that thread, not the shutdown.
    """

    def __init__(self, owed: OwedReleases, message: Message[Any]) -> None:
        assert owed.actor is not None
        self.broker = owed.actor.broker
        self.message = message
        self.error: Optional[BaseException] = None
        self.done = threading.Event()
        threading.Thread(target=self._run, name="dramatiq-unique-owed", daemon=True).start()

    def _run(self) -> None:
        try:
            self.broker.enqueue(self.message)
        except BaseException as e:  # reported to the waiting thread
            self.error = e
        finally:
            self.done.set()
