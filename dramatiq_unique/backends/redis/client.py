"""A lock backend on Redis, standalone or Cluster.

Each lock is one hash, its key's hash tag the digest; every script touches
that digest's keys only.  Deadlines follow the server's ``TIME``, not worker
clocks.  Scripts run through :mod:`.calls`, on a Cluster redis-py's ``Script``.
"""

from __future__ import annotations

import functools
import hashlib
import re
from typing import Any, Callable, Optional, Sequence, Union

try:
    import redis
except ModuleNotFoundError as e:  # tested in a subprocess: tests/test_install.py
    raise ModuleNotFoundError(
        f"{e}: RedisBackend needs redis-py, which comes with the redis extra: "
        "run `pip install 'dramatiq-unique[redis]'`.",
        name=e.name,
    ) from None

from ...model import wire
from ...settings import DEFAULT_MIN_REPLICAS, DEFAULT_MIN_REPLICAS_TIMEOUT
from ..capabilities import (
    BatchedReleases,
    DispatchFailed,
    NativeExtender,
    NewestWins,
    RenewsNatively,
    Reschedules,
    SendsWithPublish,
    release_then_start,
)
from .. import records
from ..records import (
    DEFAULT_RESERVE,
    Acquisition,
    Copy,
    CurrentCheck,
    CurrentStatus,
    Release,
    Releasing,
    ReplaceArgs,
    ReplaceStatus,
    Replacement,
    Start,
    StartArgs,
    TakeArgs,
)
from .calls import Call, ScriptCalls, as_text, default_retry
from .native import native_extend
from .reads import RedisReads
from .replicas import TooFewReplicas, replication, require
from .scripts import SCRIPTS, send_script


class RedisDispatchFailed(DispatchFailed, redis.ResponseError):
    """The broker's ``dispatch.lua`` failed inside send.lua (see :class:`DispatchFailed`)."""


CLUSTER_SCHEME = "redis+cluster://"

#: Socket timeouts (s) of the clients this backend makes: a silent Redis must fail a lock call, not hang a thread.
DEFAULT_SOCKET_TIMEOUT = 5.0


def _waiting(key: str) -> list[str]:
    """The waiters and bodies keys of a run lock key (same hash tag, same slot)."""
    return [wire.waiters_key(key), wire.bodies_key(key)]


def _records(copy: Copy) -> list[str]:
    """The keys a :class:`Copy` is settled on: its message record, then :func:`_waiting`."""
    return [wire.message_key(copy.key, copy.message_id), *_waiting(copy.key)]


def _message_of(owner: str) -> str:
    """The message id of a run lock owner (``<message id>/<token>``)."""
    return wire.message_id_of(owner) or ""


def _release_keys(key: str, owner: str) -> list[str]:
    """release.lua's keys: lock, waiters, bodies, the owner's message record (spelled out: every job's)."""
    message = f"{key}{wire.MESSAGE_SUFFIX}{_message_of(owner)}"
    return [key, f"{key}{wire.WAIT_SUFFIX}", f"{key}{wire.BODIES_SUFFIX}", message]


def _take_args(owner: str, take: TakeArgs) -> list[Any]:
    """The ARGV of _take.lua's take() for ``owner``."""
    ttl, limit, lock, lock_args, provisional, where = take
    return [owner, ttl, limit, lock, lock_args or "", provisional, int(where is not None), where or ""]


def _copy_args(copy: Copy) -> list[Any]:
    return [copy.message_id, copy.attempt, copy.via, copy.retries]


def _start_call(key: str, owner: str, start: StartArgs) -> tuple[list[str], list[Any]]:
    """start.lua's keys and arguments: every job's, so spelled out."""
    ttl, limit, lock, copy, queue_key, order, reserve = start
    message = f"{key}{wire.MESSAGE_SUFFIX}{copy.message_id}"
    keys = [key, message, f"{key}{wire.WAIT_SUFFIX}", f"{key}{wire.BODIES_SUFFIX}"]  # _records(copy), inline
    if queue_key:
        keys.append(queue_key)
    place = "" if order is None else order
    args = [owner, ttl, limit, lock, copy.message_id, copy.attempt, copy.via, copy.retries, place, reserve]
    if copy.lock_args is not None:  # only under record_lock_args: the default call is unchanged
        args.append(copy.lock_args)
    return keys, args


#: replace.lua's status codes.
_REPLACED = {
    0: ReplaceStatus.REFUSED,
    1: ReplaceStatus.ACQUIRED,
    2: ReplaceStatus.REENTERED,
    3: ReplaceStatus.REPLACED,
}


#: The characters a key glob reads as wildcards (see ``glob_pattern``).
_GLOB_SPECIALS = re.compile(r"[*?\[\]\\]")


#: Builds a named tuple in C; its own ``__new__``, in Python, costs more than the rest of reading a job's reply.
_new = tuple.__new__

#: release.lua's two short replies.
_RELEASES = (Release(False), Release(True))


def _acquisition(reply: Any, owner: str) -> Acquisition:
    """acquire.lua's reply: the fence alone (a fresh, confirmed slot), or
    {status, holder, fence, provisional}; status 3: a copy that may not run.
    """
    if isinstance(reply, int):
        return Acquisition(True, holder=owner, fence=reply)
    status, holder, fence, provisional = reply
    if status == 3:
        return Acquisition(False, refused=records.CopyVerdict(as_text(holder)))
    return Acquisition(
        status in (1, 2), reentered=status == 2, holder=as_text(holder), fence=int(fence), provisional=provisional == 1
    )


def _start(reply: Any, owner: str) -> Start:
    """start.lua's reply: fence * 2 + the queue flag (a fresh slot), or
    {status, holder, fence, queue[, extra]}: status 4 is a conflict of a
    copy still in line; extra the promoted waiter's message (status 0
    or 4) or the owner of the run a "done" copy duplicates (status 3).
    """
    if isinstance(reply, int):  # Acquisition(True, holder=owner, fence=reply >> 1), and the queue flag
        acquired = _new(Acquisition, (True, False, owner, reply >> 1, False, None))
        return _new(Start, (acquired, bool(reply & 1), False, None, None, None))
    status, holder, fence, queue = reply[:4]
    extra = reply[4] if len(reply) > 4 else None
    if status == 3:
        return Start(_acquisition([status, holder, fence, 0], owner), duplicate_of=as_text(extra) if extra else None)
    in_line = status == 4
    acquisition = _acquisition([0 if in_line else status, holder, fence, 0], owner)
    free_in = int(reply[5]) if in_line and len(reply) > 5 else None
    return Start(acquisition, queue_released=bool(queue), in_line=in_line, promoted=extra or None, free_in=free_in)


def _release(reply: Any) -> Release:
    """release.lua's reply: the held flag alone, or {held, message}."""
    if isinstance(reply, int):
        return _RELEASES[bool(reply)]
    held, promoted = reply
    return Release(bool(held), promoted or None)


def _release_args(owner: str, hand_over: bool, succeeded: bool, reserve: int) -> list[Any]:
    return [owner, int(hand_over), _message_of(owner), int(succeeded), reserve]


def _release_calls(locks: Sequence[tuple[Any, ...]]) -> list[Call]:
    """release.lua calls that hand each slot over."""
    return [
        ("release", _release_keys(one.key, one.owner), _release_args(one.owner, True, one.succeeded, one.reserve))
        for one in (Releasing(*lock) for lock in locks)
    ]


def _releases(replies: Sequence[Any]) -> list[Union[Release, Exception]]:
    return [reply if isinstance(reply, Exception) else _release(reply) for reply in replies]


class RedisBackend(RedisReads, Reschedules, NewestWins, SendsWithPublish, BatchedReleases, RenewsNatively):
    """A lock backend that stores locks in Redis, with every capability; on a
    Cluster, sending with the publish, batched releases and native renewal
    are off (:attr:`dispatch_client` and :meth:`native_extender` give None,
    :attr:`batches_releases` is False).

    Parameters:
      client(redis.Redis): A client to use (a ``RedisCluster``, or one from a
        Sentinel): all other parameters are then ignored.
      url(str): A Redis URL, winning over ``**parameters``.
        ``redis+cluster://host:port`` connects to a Cluster through any
        node (for TLS, pass ``RedisCluster(..., ssl=True)`` as ``client``).
      **parameters: Passed to ``redis.Redis`` (``RedisCluster`` with a
        cluster URL); socket timeouts default to :data:`DEFAULT_SOCKET_TIMEOUT`,
        and ``retry`` (not on a Cluster) to :func:`~.calls.default_retry`.
      min_replicas(int): When above 0, every call that takes a lock is
        followed, in the same round trip, by ``WAIT``; a lock fewer replicas
        acknowledged is given back and the call raises :class:`TooFewReplicas`
        (``docs/reliability.md``, "Failover").  Not on a Cluster.
      min_replicas_timeout(int): How long ``WAIT`` waits, in ms; keep it
        well under the socket timeout.
      group_commit(bool): Let concurrent run lock calls of worker threads
        share one round trip (see :mod:`.calls`).
      release_in_background(bool): Let the worker release run locks off
        the worker thread (:class:`dramatiq_unique.worker.release.Releaser`).
        Both switches exist to measure what each buys
        (``docs/performance.md``, "The throughput layer").

    With Sentinel, pass the primary's client; it follows failovers::

      from redis.sentinel import Sentinel

      sentinel = Sentinel([("sentinel-1", 26379), ("sentinel-2", 26379)], socket_timeout=0.5)
      backend = RedisBackend(client=sentinel.master_for("mymaster", socket_timeout=0.5))

    Warning:
      Redis replicates asynchronously: a lock on a primary that fails
      before its replica saw it is gone after the failover (Sentinel and
      Cluster alike), and a second holder may take it.  Guard writes that
      must never overlap with :func:`dramatiq_unique.fence_token`;
      ``min_replicas`` narrows that window, it does not close it.
    """

    def __init__(
        self,
        *,
        client: Optional[Any] = None,
        url: Optional[str] = None,
        min_replicas: int = DEFAULT_MIN_REPLICAS,
        min_replicas_timeout: int = DEFAULT_MIN_REPLICAS_TIMEOUT,
        group_commit: bool = True,
        release_in_background: bool = True,
        **parameters: Any,
    ) -> None:
        parameters.setdefault("socket_timeout", DEFAULT_SOCKET_TIMEOUT)
        parameters.setdefault("socket_connect_timeout", DEFAULT_SOCKET_TIMEOUT)
        #: Whether the client is this backend's own, to close with it.
        self.owns_client = client is None
        if client is None and url is not None and url.startswith(CLUSTER_SCHEME):
            client = redis.cluster.RedisCluster.from_url("redis://" + url[len(CLUSTER_SCHEME) :], **parameters)
        elif client is None:
            parameters.setdefault("retry", default_retry())
            client = redis.Redis(**parameters) if url is None else redis.Redis.from_url(url, **parameters)
        self.client: Any = client
        self.url = url
        self.cluster = isinstance(self.client, redis.cluster.RedisCluster)
        self.scripts = {name: self.client.register_script(source) for name, source in SCRIPTS.items()}
        self.calls = None if self.cluster else ScriptCalls(self.client, SCRIPTS, group_commit=group_commit)
        self.batches_releases = self.calls is not None and release_in_background
        self.min_replicas, self.min_replicas_timeout = replication(min_replicas, min_replicas_timeout, self.cluster)
        self.wait_command = (b"WAIT", self.min_replicas, self.min_replicas_timeout) if self.min_replicas else None
        #: (acked, key, give_back): see :func:`.replicas.require`.
        self._require = functools.partial(
            require, wanted=self.min_replicas, within=self.min_replicas_timeout, backend=self.describe
        )

    def _call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        if self.calls is not None:
            return self.calls.call(name, keys, args)
        return self.scripts[name](keys=keys, args=args, client=self.client)

    def _take(self, name: str, keys: list[str], args: list[Any]) -> tuple[Any, Union[int, Exception, None]]:
        """A script that may take a lock, then ``WAIT`` under ``min_replicas``:
        its reply, and ``WAIT``'s (a count or an error; None without it).
        """
        if self.wait_command is None:
            return self._call(name, keys, args), None
        assert self.calls is not None  # refused on a Cluster at construction
        reply, acked = self.calls.batch([(name, keys, args)], trailer=self.wait_command)
        if isinstance(reply, Exception):
            raise reply
        return reply, acked

    def _give_back(self, key: str, owner: str) -> Callable[[], Any]:
        # No hand-over (a promoted message could not be enqueued here): the waiters' delayed copies come anyway.
        return lambda: self.release(key, owner, hand_over=False)

    def acquire(self, key: str, owner: str, *, copy: Optional[Copy] = None, **take: Any) -> Acquisition:
        keys = [key]
        args = _take_args(owner, TakeArgs(**take))
        if copy is not None:
            keys, args = keys + _records(copy), args + _copy_args(copy)
        reply, acked = self._take("acquire", keys, args)
        got = _acquisition(reply, owner)
        if acked is not None and got.acquired:
            # A re-entered slot was held before this call: its message is out already.
            self._require(acked, key, None if got.reentered else self._give_back(key, owner))
        return got

    @property
    def dispatch_client(self) -> Optional[Any]:
        """The client, unless a Cluster's: one script may then touch the lock's and the broker's keys."""
        return None if self.calls is None else self.client

    def acquire_and_dispatch(
        self, key: str, owner: str, *, dispatch: str, namespace: str, arguments: Sequence[Any], **take: Any
    ) -> Acquisition:
        """:meth:`SendsWithPublish.acquire_and_dispatch` in one call of send.lua,
        its ``DispatchFailed`` a :class:`RedisDispatchFailed`; any other
        ``redis.RedisError``, after a lost reply, may have locked and enqueued.
        """
        assert self.calls is not None, "a Cluster cannot run two slots' keys in one script"
        name = f"send:{hashlib.sha1(dispatch.encode()).hexdigest()}"
        if name not in self.calls.sources:
            self.calls.add(name, send_script(dispatch))
        args = [*_take_args(owner, TakeArgs(**take)), *arguments]
        reply, acked = self._take(name, [key, namespace], args)
        if isinstance(reply, int):
            # The script enqueued the message: keep its lock to match the queue (a lost reply's rule).
            self._require(acked, key, None)
            return Acquisition(True, holder=owner, fence=reply)
        status, holder, fence, _ = reply
        if status == 4:
            raise RedisDispatchFailed(as_text(holder))
        if status in (1, 2):
            self._require(acked, key, None)
        return Acquisition(status in (1, 2), reentered=status == 2, holder=as_text(holder), fence=int(fence))

    def start(self, key: str, owner: str, **options: Any) -> Start:
        """:meth:`LockBackend.start` in one call of start.lua."""
        keys, args = _start_call(key, owner, StartArgs(**options))
        if self.calls is None:
            return _start(self._call("start", keys, args), owner)
        # Every job makes this call: shared with other worker threads' of the moment.
        replies = self.calls.batch([("start", keys, args)], grouped=True, trailer=self.wait_command)
        if isinstance(replies[0], Exception):
            raise replies[0]
        started = _start(replies[0], owner)
        if self.wait_command is not None:
            self._started_acked(started, replies[1], key, owner)
        return started

    def _started_acked(self, started: Start, acked: Any, key: str, owner: str) -> None:
        """Raise :class:`TooFewReplicas` for a run lock too few replicas saw,
        given back first (a released enqueue lock stays so: it was delivered).
        """
        if started.acquisition.acquired:
            self._require(acked, key, self._give_back(key, owner))

    def release_and_start(
        self, releases: Sequence[tuple[Any, ...]], key: str, owner: str, **start: Any
    ) -> tuple[list[Union[Release, Exception]], Union[Start, Exception]]:
        if self.calls is None:
            return release_then_start(self, releases, key, owner, **start)
        calls = _release_calls(releases)
        calls.append(("start", *_start_call(key, owner, StartArgs(**start))))
        replies = self.calls.batch(calls, grouped=True, trailer=self.wait_command)
        acked = replies.pop() if self.wait_command is not None else None
        reply = replies.pop()
        if isinstance(reply, Exception):
            return _releases(replies), reply
        started = _start(reply, owner)
        try:
            if acked is not None:
                self._started_acked(started, acked, key, owner)
        except TooFewReplicas as e:
            return _releases(replies), e
        return _releases(replies), started

    def release(
        self, key: str, owner: str, *, hand_over: bool = True, succeeded: bool = False, reserve: int = DEFAULT_RESERVE
    ) -> Release:
        args = _release_args(owner, hand_over, succeeded, reserve)
        return _release(self._call("release", _release_keys(key, owner), args))

    def release_many(self, locks: Sequence[tuple[Any, ...]]) -> list[Union[Release, Exception]]:
        if self.calls is None:
            return super().release_many(locks)
        return _releases(self.calls.batch(_release_calls(locks))) if locks else []

    def join_line(self, copy: Copy, message: bytes, *, order: int, ttl: int) -> int:
        return int(self._call("join_line", _records(copy), [copy.message_id, message, order, copy.attempt, ttl]) or 0)

    def claim(self, copy: Copy) -> bool:
        return bool(self._call("claim", [*_records(copy), copy.key], _copy_args(copy)))

    def extend(self, locks: Sequence[tuple[str, str]], ttl: int) -> list[bool]:
        return self._each("extend", [(key, owner, ttl) for key, owner in locks])

    def native_extender(self) -> Optional[NativeExtender]:
        """:class:`~.native.NativeExtend` for a standalone client on TCP or a Unix socket, else None."""
        return None if self.cluster else native_extend(self.client, script=SCRIPTS["extend"])

    def confirm(self, locks: Sequence[tuple[str, str, int]]) -> list[bool]:
        return self._each("confirm", locks)

    def _each(self, script: str, calls: Sequence[tuple[str, str, int]]) -> list[bool]:
        """Run a one-key ``script`` once per ``(key, owner, ttl)``, in one round trip."""
        if not calls:
            return []
        if self.calls is not None:
            replies = self.calls.batch([(script, [key], [owner, ttl]) for key, owner, ttl in calls])
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
            return [bool(reply) for reply in replies]
        pipe = self.client.pipeline(transaction=False)
        for key, owner, ttl in calls:
            # A Cluster pipeline refuses EVALSHA but sends EVAL, one batch per node.
            pipe.execute_command("EVAL", SCRIPTS[script], 1, key, owner, ttl)
        return [bool(result) for result in pipe.execute()]

    def reap(self, key: str, owner: str, record: records.EnqueueRecord) -> bool:
        return bool(self._call("reap", [key], [owner, record.encode()]))

    def _replace(self, call: ReplaceArgs) -> Replacement:
        key, owner, ttl, lock, lock_args, keep_started, debounce, debounce_max, superseded_ttl, where = call
        (status, other, fence, delay), acked = self._take(
            "replace",
            [key, wire.superseded_key(key)],
            [owner, ttl, lock, lock_args or "", int(keep_started), debounce, debounce_max, superseded_ttl, where],
        )
        got = Replacement(_REPLACED[int(status)], as_text(other) if other else None, int(delay), int(fence))
        if acked is not None and got.status is not ReplaceStatus.REFUSED:
            self._require(acked, key, self._replaced_back(key, owner, got.status))
        return got

    def _replaced_back(self, key: str, owner: str, status: ReplaceStatus) -> Optional[Callable[[], Any]]:
        """How to give back what a replace took (the superseded one current again, then the slot)."""
        if status is ReplaceStatus.REENTERED:
            return None
        release = self._give_back(key, owner)
        if status is ReplaceStatus.ACQUIRED:
            return release
        return lambda: (self.unreplace(key, owner), release())

    def _current(self, call: records.CurrentArgs) -> CurrentCheck:
        key, owner, reenter, ttl, lock, copy, where = call
        keys: list[str] = [key, wire.superseded_key(key)]
        args: list[Any] = [owner, "reenter" if reenter else "start", ttl, lock]
        if reenter and copy is not None:
            keys, args = keys + _records(copy), args + [copy.attempt, copy.via, where or "", copy.retries]
        elif reenter and where is not None:
            args += [0, "", where]
        # Only a re-enqueue takes a slot; a delivery marks its message started.
        reply, acked = self._take("current", keys, args) if reenter else (self._call("current", keys, args), None)
        status, other = reply
        got = CurrentCheck(CurrentStatus(int(status)), as_text(other) if other else None)
        if acked is not None and got.status in (CurrentStatus.CURRENT, CurrentStatus.REENTERED):
            # Took the free key again (given back on too few replicas), or re-entered (kept).
            self._require(acked, key, self._give_back(key, owner) if got.status is CurrentStatus.CURRENT else None)
        return got

    def unreplace(self, key: str, owner: str) -> Optional[str]:
        previous = self._call("unreplace", [key, wire.superseded_key(key)], [owner])
        return as_text(previous) if previous else None

    def delete(self, key: str) -> bool:
        return bool(self.client.delete(key))

    def delete_prefix(self, prefix: str) -> int:
        # One key per DEL: on a Cluster the keys of a prefix are on every node.
        keys = list(self.scan(_GLOB_SPECIALS.sub(r"\\\g<0>", prefix) + "*"))
        return sum(int(self.client.delete(key)) for key in keys)
