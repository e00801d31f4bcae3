"""The background tasks of a worker process: lease renewals, batched
releases, retries of failed releases, hand-off polls, the periodic
reaper.

Each thread works on the backend that was current when it was made: it
is made on first use, and a new backend (``UniqueMiddleware.backend =
...``) stops the lock threads, so that the next use makes them afresh.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from ..backends.base import BatchedReleases
from ..background import now_ms
from ..send.context import LockContext
from .failed import RUN_SUFFIX, FailedReleases, LandedReports
from .handoff import HandoffPolls
from .leases import LeaseKeeper
from .owed import OwedRelease
from .reap import PeriodicReaper, start_reaper
from .releaser import Releaser, ReleaseReports
from .reports import LockTroubles

if TYPE_CHECKING:
    from dramatiq import Broker

#: Guards the lazy creation of the threads: worker threads ask at once.
_MAKING = threading.Lock()


class Reports(ReleaseReports, LandedReports, Protocol):
    """Where the releaser and the retries of failed releases report."""


class WorkerThreads:
    """The background tasks of one middleware in a worker process.

    Parameters:
      service(LockContext): The middleware's lock context.
      reports(Reports): Where releases report their outcomes.
      troubles(LockTroubles): Where lost leases and stalled releases
        are told.
    """

    def __init__(self, service: LockContext, *, reports: Reports, troubles: LockTroubles) -> None:
        self.service = service
        self.reports = reports
        self.troubles = troubles
        self.handoffs = HandoffPolls()
        self._leases: Optional[LeaseKeeper] = None
        self._releaser: Optional[Releaser] = None
        self._failed: Optional[FailedReleases] = None
        self._reaper: Optional[PeriodicReaper] = None

    @property
    def leases(self) -> LeaseKeeper:
        """Renews the run leases of this process."""
        if self._leases is None:
            # Worker threads ask at once on their first jobs: one keeper, or
            # a lease held by a second one would be renewed after its release.
            with _MAKING:
                if self._leases is None:
                    self._leases = LeaseKeeper(
                        self.service.locks,
                        lease=self.service.settings.lease,
                        on_lost=self.troubles.lease_lost,
                        on_error=self.troubles.renewal_failed,
                    )
        return self._leases

    @property
    def releaser(self) -> Optional[Releaser]:
        """Releases run locks off the worker thread, when the backend
        batches releases; None when it does not.
        """
        backend = self.service.backend
        if self._releaser is None and isinstance(backend, BatchedReleases) and backend.batches_releases:
            with _MAKING:  # worker threads ask at once: make one
                if self._releaser is None:
                    self._releaser = Releaser(backend, reports=self.reports, on_stalled=self.troubles.releases_stalled)
        return self._releaser

    @property
    def failed(self) -> FailedReleases:
        """Sends the releases that failed again, off the worker thread."""
        if self._failed is None:
            with _MAKING:
                if self._failed is None:
                    ttl = self.service.settings.lock_ttl
                    self._failed = FailedReleases(self.service.locks, reports=self.reports, record_ttl=ttl)
        return self._failed

    def start_reaper(self, broker: "Broker") -> None:
        """Start the periodic reaper, once, if ``reap_interval`` asks for one."""
        if self._reaper is None:
            self._reaper = start_reaper(self.service, broker)

    def restart(self) -> None:
        """Stop the lock threads: the next use makes each on the backend current then."""
        leases, releaser, failed = self._leases, self._releaser, self._failed
        self._leases = self._releaser = self._failed = None
        if leases is not None:
            leases.stop()
        if releaser is not None:
            releaser.stop()
        if failed is not None:
            failed.stop()

    def stop(self, left: Callable[[], float]) -> list[OwedRelease]:
        """Stop every thread, each within what ``left`` says is left of
        the shutdown's bound, in milliseconds.

        Returns:
          list[OwedRelease]: The releases that could not be sent, for
          the next worker (:mod:`.owed`).
        """
        self.handoffs.stop()
        owed: list[OwedRelease] = []
        if self._releaser is not None:
            owed += [self._owed(p.key, p.owner, now_ms(), p.options) for p in self._releaser.stop(left())]
        if self._failed is not None:
            # After the releaser, whose failures it takes.
            owed += [self._owed(f.key, f.owner, f.until, f.options) for f in self._failed.stop(left())]
        if self._leases is not None:
            self._leases.stop(timeout=left())
        if self._reaper is not None:
            self._reaper.stop(timeout=left())
            self._reaper = None
        return owed

    def _owed(self, key: str, owner: str, until: float, options: dict[str, Any]) -> OwedRelease:
        """A release to hand on, from its lock's monotonic expiry.  A run
        lock's release is made even after its lease ran out: it also
        ends the run of a rescheduled message in its record, which lives
        ``lock_ttl``, so that a duplicate of that run is skipped.
        """
        if key.endswith(RUN_SUFFIX):
            until = max(until, now_ms() + self.service.settings.lock_ttl)
        return OwedRelease.within(key, owner, until - now_ms(), options)
