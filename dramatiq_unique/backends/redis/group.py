"""Group commit: the lock calls that worker threads make at the same
moment share one round trip.

The first caller to find no round trip in flight leads: it sends its
own commands, and those of every caller that queued meanwhile, in one
pipeline.  Callers that arrive while a round trip is in flight queue
and wait on a lock of their own.  When the replies are in, the leader
hands each caller its own, wakes the first caller queued since to lead
the next round trip, and returns to its own job.  Under load one round
trip serves several jobs, and a worker thread that waits for it blocks
once, on its lock, instead of on a socket; alone, a caller leads at
once and pays nothing more than a direct call.

What stays true:

* Each caller's commands are sent once, in order, and answered with its
  own replies; a failure of the round trip is raised to every caller in
  it, as a direct call would raise it.
* A caller waits at most ``timeout`` seconds, then raises
  :class:`TimeoutError` as a lost reply would: if its commands were in
  flight they may have been applied, which every lock call is built to
  survive (the owner token re-enters, the release checks the owner); if
  they were still queued they are withdrawn.  A caller that stops
  waiting for any reason passes on the lead it was handed.
* An interrupt meant for one thread (a time limit, a shutdown notice)
  that breaks a round trip it leads is raised in that thread only; the
  other callers of that round trip get a :class:`TimeoutError`, as for
  a lost reply.
* A forked child starts with no round trip in flight.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from ...forks import pid

#: How long, in seconds, a caller waits for a round trip led by another
#: thread when the connection has no socket timeout of its own.
DEFAULT_TIMEOUT = 30.0

RoundTrip = Callable[[list[tuple[Any, ...]]], list[Any]]


class _Caller:
    """One caller's commands, and where its replies land."""

    __slots__ = ("commands", "trailer", "replies", "error", "ready", "leads")

    def __init__(self, commands: list[tuple[Any, ...]], trailer: Optional[tuple[Any, ...]] = None) -> None:
        self.commands = commands
        self.trailer = trailer
        self.replies: Optional[list[Any]] = None
        self.error: Optional[BaseException] = None
        self.ready = threading.Lock()
        self.ready.acquire()  # released once: replies in, or the lead handed over
        self.leads = False

    def result(self) -> list[Any]:
        if self.error is not None:
            raise self.error
        assert self.replies is not None
        return self.replies


def _interrupted(interrupt: BaseException) -> TimeoutError:
    """What the other callers of a round trip get when an interrupt (a
    time limit, a shutdown notice) meant for the leading thread broke it:
    a lost reply, theirs to retry, not that thread's interrupt.
    """
    return TimeoutError(
        f"the round trip carrying this call was interrupted in another thread ({interrupt!r}); "
        "the call may have applied"
    )


class GroupCommit:
    """Shares round trips between concurrent callers.

    Parameters:
      round_trip(callable): Sends commands in one round trip and returns
        their replies.
      timeout(float): The longest a caller waits for a round trip led by
        another thread, in seconds.
    """

    def __init__(self, round_trip: RoundTrip, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.round_trip = round_trip
        self.timeout = timeout
        self._mutex = threading.Lock()
        self._queue: list[_Caller] = []
        self._leading = False
        self._pid = pid()

    def call(self, commands: list[tuple[Any, ...]], *, trailer: Optional[tuple[Any, ...]] = None) -> list[Any]:
        """Send ``commands`` in the next round trip and return their
        replies.

        Parameters:
          trailer(tuple): A command sent once after every caller's
            commands of the round trip (``WAIT``: it covers every write
            before it on the connection), however many callers name it;
            its reply comes last, after this caller's own.
        """
        with self._mutex:
            if self._pid != pid():
                self._queue, self._leading, self._pid = [], False, pid()  # the parent's round trip is not ours
            leads = not self._leading
            self._leading = True
            if not leads:
                caller = _Caller(commands, trailer)
                self._queue.append(caller)
        if leads:
            # Nobody is queued (a caller only queues behind a lead): send
            # this caller's commands alone.
            try:
                return self.round_trip(commands if trailer is None else [*commands, trailer])
            finally:
                self._hand_over([])
        try:
            if not caller.ready.acquire(timeout=self.timeout):
                raise TimeoutError(
                    f"the lock backend did not answer within {self.timeout:.0f} s; the call may have applied"
                )
        except BaseException:  # a time limit's exception too: never leave the lead with nobody
            self._abandon(caller)
            raise
        if caller.leads:  # handed the lead: send what queued meanwhile, this caller's own included
            self._lead(caller)
        return caller.result()

    def _abandon(self, caller: _Caller) -> None:
        """Take back a caller that stops waiting: out of the queue if it
        is still there, and the lead passed on if it was handed it.
        """
        with self._mutex:
            if caller in self._queue:
                self._queue.remove(caller)
            if not caller.leads:
                return
            following = self._queue[0] if self._queue else None
            if following is None:
                self._leading = False
            else:
                following.leads = True
        if following is not None:
            following.ready.release()

    def _lead(self, leader: _Caller) -> None:
        """Send everything queued in one round trip, hand out the
        replies, and pass the lead to the first caller queued since.
        """
        with self._mutex:
            batch, self._queue = self._queue, []
        # Each distinct trailer once, after every caller's commands.
        trailers = list(dict.fromkeys(caller.trailer for caller in batch if caller.trailer is not None))
        try:
            replies = self.round_trip([command for caller in batch for command in caller.commands] + trailers)
        except BaseException as e:  # a time limit's exception too: every caller must hear of it
            for caller in batch:
                caller.error = e if caller is leader or isinstance(e, Exception) else _interrupted(e)
        else:
            at, ends = 0, dict(zip(trailers, replies[len(replies) - len(trailers) :]))
            for caller in batch:
                caller.replies, at = replies[at : at + len(caller.commands)], at + len(caller.commands)
                if caller.trailer is not None:
                    caller.replies.append(ends[caller.trailer])
        finally:
            self._hand_over(batch)

    def _hand_over(self, batch: list[_Caller]) -> None:
        with self._mutex:
            following = self._queue[0] if self._queue else None
            if following is None:
                self._leading = False
            else:
                following.leads = True
        for caller in batch:
            if not caller.leads:
                caller.ready.release()
        if following is not None:
            following.ready.release()
