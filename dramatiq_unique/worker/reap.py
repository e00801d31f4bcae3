"""Releasing enqueue locks whose message vanished from the broker (:class:`Reaper`, run by
``dramatiq-unique reap`` through :class:`~dramatiq_unique.ops.admin.LockAdmin`), a worker's
:class:`PeriodicReaper`, and its backend check at boot (:func:`check_backend`).  See
docs/reliability.md, "The periodic reaper, and the check at boot", and "Orphaned enqueue locks".
"""

from __future__ import annotations

import logging
import os
import time as mod_time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Protocol, Sequence, TypeVar

from dramatiq.logging import get_logger

from ..backends.base import LockBackend, PrefixLocks
from ..background import DEFAULT_STOP_TIMEOUT, JITTER, BackgroundThread
from ..model.wire import QUEUE, EnqueueRecord, Place, join_owner, reaper_key
from ..send.context import LockContext

if TYPE_CHECKING:
    from dramatiq import Broker

T = TypeVar("T")

#: How many enqueue locks one transaction on the broker checks.
DEFAULT_BATCH = 100

#: Locks younger than this (ms) go unchecked: without a provisional window, a lock is written just before its publish.
DEFAULT_MIN_AGE = 10_000

#: How many lock keys one pass of the periodic reaper looks at at most.
DEFAULT_PASS_KEYS = 10_000

#: Lock types whose enqueue lock outlives its message on purpose.
KEPT_AFTER_RUN = ("until_expired",)


class ListedLock(Protocol):
    """One listed lock, as the reaper reads it (an ``ops.admin.Lock``, a ``records.ListedLock``)."""

    @property
    def key(self) -> str: ...

    @property
    def actor(self) -> str: ...

    @property
    def lock(self) -> Optional[str]: ...

    @property
    def lock_args(self) -> Optional[str]: ...

    @property
    def holders(self) -> Sequence[Any]:
        """Each with an ``owner`` and a ``record`` (an ``ops.admin.Holder``, a ``records.HeldSlot``)."""


class LockListing(Protocol):
    """What the reaper reads locks through: the operators' ``LockAdmin``, a worker's ``PrefixLocks``."""

    @property
    def backend(self) -> LockBackend: ...

    @property
    def prefix(self) -> str: ...

    def locks(self, *, actor: Optional[str] = None, phase: Optional[str] = None) -> Iterator[ListedLock]: ...

    def call(self, doing: str, call: Callable[..., T], *args: Any) -> T: ...


def _text(value: Any) -> str:
    """A reply of the broker's client as text: redis-py answers bytes unless told to decode."""
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisQueues:
    """Looks messages up in a Redis broker's keys (Dramatiq's ``dispatch.lua``): per queue a
    hash of messages until acked and a dead-letter hash, per worker and queue a set of unacked ids.
    """

    def __init__(self, client: Any) -> None:
        self.client = client

    def find(self, records: list[EnqueueRecord]) -> list[bool]:
        """Per record, whether its message is at either of its places, in one transaction."""
        places = [[p for p in map(Place.parse, (r.where, r.before)) if p is not None] for r in records]
        namespaces = {place.namespace for found in places for place in found}
        workers = {ns: [_text(w) for w in self.client.zrange(f"{ns}:__heartbeats__", 0, -1)] for ns in namespaces}
        pipe = self.client.pipeline(transaction=True)
        counts = []
        for found in places:
            before = len(pipe)
            for place in found:
                self._look_up(pipe, place, workers[place.namespace])
            counts.append(len(pipe) - before)
        answers = iter(pipe.execute() if len(pipe) else [])
        return [any([bool(next(answers)) for _ in range(count)]) for count in counts]

    @staticmethod
    def _look_up(pipe: Any, place: Place, workers: list[str]) -> None:
        ns, queue, rid = place.namespace, place.queue, place.redis_id
        pipe.hexists(f"{ns}:{queue}.msgs", rid)
        pipe.hexists(f"{ns}:{place.canonical_queue}.XQ.msgs", rid)
        # A queue purged while its message runs: only the worker's ack set has it.
        for worker in workers:
            pipe.sismember(f"{ns}:__acks__.{worker}.{queue}", rid)


@dataclass(frozen=True)
class Suspect:
    """An enqueue lock holder (``message_id``) whose message was found nowhere: its ``lock_args`` JSON
    when recorded, the ``queue`` it was last published to, the ``age`` of its lock in ms, and whether
    this pass ``released`` it.
    """

    key: str
    actor: str
    message_id: str
    lock_args: Optional[str]
    queue: str
    age: int
    record: EnqueueRecord
    released: bool = False


@dataclass
class ReapReport:
    """What one reap found: how many enqueue-lock holders were ``checked`` on the broker, ``skipped``
    (provisional, too young, or kept after their run) or ``unknown`` (no Redis place: RabbitMQ, the
    stub broker, older locks); the ``suspects``; and whether it was ``complete`` (not stopped at its
    key budget).
    """

    checked: int = 0
    skipped: int = 0
    unknown: int = 0
    suspects: list[Suspect] = field(default_factory=list)
    complete: bool = True


class Reaper:
    """Finds, and optionally releases, enqueue locks whose message is gone: it leaves locks younger
    than ``min_age`` ms alone, and looks ``batch`` holders up per broker transaction.
    """

    def __init__(
        self, admin: LockListing, queues: RedisQueues, *, min_age: int = DEFAULT_MIN_AGE, batch: int = DEFAULT_BATCH
    ) -> None:
        self.admin = admin
        self.queues = queues
        self.min_age = min_age
        self.batch = batch

    def run(
        self,
        *,
        release: bool = False,
        actor: Optional[str] = None,
        max_keys: Optional[int] = None,
        budget: Optional[float] = None,
    ) -> ReapReport:
        """Look every confirmed enqueue lock's message up; release the missing ones' when ``release``.
        Stop after ``max_keys`` lock keys or ``budget`` seconds.
        """
        report = ReapReport()
        pending: list[tuple[ListedLock, str, EnqueueRecord]] = []
        stop_at = None if budget is None else mod_time.monotonic() + budget
        for n, lock in enumerate(self.admin.locks(actor=actor, phase=QUEUE)):
            if (max_keys is not None and n >= max_keys) or (stop_at is not None and mod_time.monotonic() > stop_at):
                report.complete = False
                break
            pending.extend(self._candidates(lock, report))
            if len(pending) >= self.batch:
                self._check(pending, report, release)
                pending = []
        if pending:
            self._check(pending, report, release)
        return report

    def _candidates(self, lock: ListedLock, report: ReapReport) -> Iterator[tuple[ListedLock, str, EnqueueRecord]]:
        now = int(mod_time.time() * 1000)
        for holder in lock.holders:
            record = holder.record
            if record is None or not any(Place.parse(w) for w in (record.where, record.before)):
                report.unknown += 1
            elif lock.lock in KEPT_AFTER_RUN or record.provisional_until or now - record.taken_at < self.min_age:
                report.skipped += 1
            else:
                report.checked += 1
                yield lock, holder.owner, record

    def _check(self, pending: list[tuple[ListedLock, str, EnqueueRecord]], report: ReapReport, release: bool) -> None:
        found = self.admin.call("look messages up on the broker", self.queues.find, [r for _, _, r in pending])
        now = int(mod_time.time() * 1000)
        for (lock, owner, record), present in zip(pending, found):
            if present:
                continue
            released = release and self.admin.call(
                f"reap {lock.key!r}", self.admin.backend.reap, lock.key, owner, record
            )
            age = now - record.taken_at
            report.suspects.append(
                Suspect(lock.key, lock.actor, owner, lock.lock_args, record.queue, age, record, released)
            )


class PeriodicReaper:
    """Reaps every ``interval`` ms in one worker at a time: each pass holds the lock
    ``<prefix>:!reaper`` for ``lease`` ms, and stops after ``max_keys`` keys or half its lease.
    """

    def __init__(
        self,
        admin: LockListing,
        queues: RedisQueues,
        *,
        interval: int,
        lease: int = 60_000,
        max_keys: int = DEFAULT_PASS_KEYS,
        min_age: int = DEFAULT_MIN_AGE,
    ) -> None:
        self.logger = get_logger(__name__, type(self))
        self.reaper = Reaper(admin, queues, min_age=min_age)
        self.backend: LockBackend = admin.backend
        self.key = reaper_key(admin.prefix)
        self.owner = join_owner("reaper", f"{os.getpid():x}.{JITTER.getrandbits(32):08x}")
        self.interval = interval
        self.lease = lease
        self.max_keys = max_keys
        # A greenlet under gevent: the broker's client's patched sockets belong to the hub.
        self._thread = BackgroundThread(name="dramatiq-unique-reaper", loop=self._run)

    def start(self) -> None:
        self._thread.ensure_started()

    def stop(self, *, timeout: float = DEFAULT_STOP_TIMEOUT) -> None:
        """Stop the reaper's thread, waiting at most ``timeout`` ms."""
        self._thread.stop(timeout=timeout)

    def _run(self, thread: BackgroundThread) -> None:
        while not thread.wait(self.interval * JITTER.uniform(0.8, 1.2)) and not thread.stopping:
            try:
                self.run_once()
            except Exception as e:
                self.logger.warning("Reaper pass failed: %r.", e)

    def run_once(self) -> Optional[ReapReport]:
        """Run one pass, unless another worker runs one (then None)."""
        got = self.backend.acquire(self.key, self.owner, ttl=self.lease, lock="reaper")
        if not got.acquired:
            return None
        try:
            report = self.reaper.run(release=True, max_keys=self.max_keys, budget=self.lease / 2000)
        finally:
            self.backend.release(self.key, self.owner, hand_over=False)
        for suspect in report.suspects:
            if suspect.released:
                self.logger.warning(
                    "Reaped enqueue lock %r of message %s: its message is in no queue.", suspect.key, suspect.message_id
                )
        return report


def start_reaper(service: LockContext, broker: "Broker") -> Optional[PeriodicReaper]:
    """Start the periodic reaper here, when ``reap_interval`` is set and the broker is a Redis one."""
    interval = service.settings.reap_interval
    if not interval or service.backend is None:
        return None
    client, namespace = getattr(broker, "client", None), getattr(broker, "namespace", None)
    if client is None or not isinstance(namespace, str):
        service.logger.warning(
            "reap_interval is set, but a %s cannot look messages up by id: no periodic reaper.",
            type(broker).__name__,
        )
        return None
    listing = PrefixLocks(service.backend, prefix=service.settings.prefix)
    reaper = PeriodicReaper(listing, RedisQueues(client), interval=interval)
    reaper.start()
    return reaper


def reason(error: BaseException) -> str:
    """``error`` on one line, led by its type: what failed, and why."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def check_backend(backend: LockBackend, *, prefix: str, on_backend_error: str, logger: logging.Logger) -> bool:
    """Make one read of ``backend`` (a key under ``prefix``); when that fails, log one ERROR
    naming it, why, and the ``on_backend_error`` setting.  Never raises; True when it answered.
    """
    try:
        backend.check(f"{prefix}:!check")
    except Exception as error:
        logger.error(
            "Lock backend %s does not answer at worker boot (%s); the worker goes on, and until it answers, "
            "on_backend_error=%r decides what locked messages do.",
            backend.describe(),
            reason(error),
            on_backend_error,
        )
        return False
    return True
