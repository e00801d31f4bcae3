"""A lock backend on Redis, standalone or Cluster.

Each lock is one hash whose key carries a Cluster hash tag around the
digest, and every script touches that one digest's keys only.
Deadlines come from the server's ``TIME``, so worker clocks do not
matter.  Scripts are called through :mod:`.calls` (one pre-encoded
``EVALSHA`` per call, reloaded after ``NOSCRIPT``) on a standalone
client, and through redis-py's ``Script`` on a Cluster.
"""

from __future__ import annotations

from importlib import resources
from typing import Any, Iterator, Optional, Sequence, Union
from urllib.parse import urlsplit, urlunsplit

import redis

from ..backend import Acquisition, LockBackend, LockInfo, Release
from .calls import ScriptCalls


def _lua(name: str) -> str:
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text()


def _as_function(name: str) -> str:
    """A script's source as a local Lua function of (KEYS, ARGV), for
    a script that composes it.
    """
    return f"local function {name}(KEYS, ARGV)\n{_lua(name)}\nend\n"


_SCRIPTS = {name: _lua(name) for name in ("acquire", "release", "extend", "wait", "claim")}
# The common outcomes as one integer, which costs the client less to
# read than an array: a fresh acquisition as its fence, a release that
# hands nothing over as its held flag.
_SCRIPTS["acquire"] = _as_function("acquire") + (
    "local got = acquire(KEYS, ARGV)\nif got[1] == 1 then return got[3] end\nreturn got\n"
)
_SCRIPTS["release"] = _as_function("release") + (
    "local done = release(KEYS, ARGV)\nif not done[2] then return done[1] end\nreturn done\n"
)
_SCRIPTS["take_run"] = _as_function("acquire") + _as_function("release") + _lua("take_run")


def send_script(dispatch: str) -> str:
    """send.lua behind acquire.lua and the broker's ``dispatch`` source."""
    return f"local function dispatch(KEYS, ARGV)\n{dispatch}\nend\n" + _as_function("acquire") + _lua("send")

#: The URL scheme that connects to a Cluster.
CLUSTER_SCHEME = "redis+cluster://"

#: Socket timeouts, in seconds as redis-py takes them, of the clients
#: this backend makes itself: a silent Redis must fail a lock call, not
#: hang a worker thread.
DEFAULT_SOCKET_TIMEOUT = 5.0


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _waiting(key: str) -> list[str]:
    """The waiters and tickets keys of a lock key: same hash tag, same
    Cluster slot.
    """
    return [f"{key}:wait", f"{key}:tickets"]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _acquisition(reply: Any, owner: str) -> Acquisition:
    """acquire.lua's reply: the fence alone, or {status, holder, fence}."""
    if isinstance(reply, int):
        return Acquisition(True, holder=owner, fence=reply)
    status, holder, fence = reply
    return Acquisition(status != 0, reentered=status == 2, holder=_text(holder), fence=int(fence))


def _release(reply: Any) -> Release:
    """release.lua's reply: the held flag alone, or {held, message}."""
    if isinstance(reply, int):
        return Release(bool(reply))
    held, promoted = reply
    return Release(bool(held), promoted or None)


class RedisBackend(LockBackend):
    """A lock backend that stores locks in Redis.

    Parameters:
      client(redis.Redis): A client to use, e.g. a
        ``redis.cluster.RedisCluster`` or one from a Sentinel.  When
        given, all other parameters are ignored.
      url(str): A Redis URL.  ``redis+cluster://host:port`` connects
        to a Cluster through any one of its nodes (for TLS, pass a
        ``RedisCluster(..., ssl=True)`` as ``client``).  When given, it
        wins over ``**parameters``.
      **parameters: Passed to ``redis.Redis``, or to
        ``redis.cluster.RedisCluster`` with a cluster URL.  Socket
        timeouts default to :data:`DEFAULT_SOCKET_TIMEOUT` seconds.

    Every script touches the keys of one lock only, and they share a
    hash tag, so each call goes to one Cluster node.  With Sentinel,
    pass the client of the primary; it follows failovers::

      from redis.sentinel import Sentinel

      sentinel = Sentinel([("sentinel-1", 26379), ("sentinel-2", 26379)], socket_timeout=0.5)
      backend = RedisBackend(client=sentinel.master_for("mymaster", socket_timeout=0.5))

    Warning:
      Redis replicates asynchronously: a lock written to a primary that
      fails before its replica saw it is gone after the failover, on
      Sentinel and Cluster alike, and a second holder may take it.
      Guard writes that must never overlap with
      :func:`dramatiq_unique.fence_token`.
    """

    def __init__(self, *, client: Optional[Any] = None, url: Optional[str] = None, **parameters: Any) -> None:
        parameters.setdefault("socket_timeout", DEFAULT_SOCKET_TIMEOUT)
        parameters.setdefault("socket_connect_timeout", DEFAULT_SOCKET_TIMEOUT)
        if client is None and url is not None and url.startswith(CLUSTER_SCHEME):
            client = redis.cluster.RedisCluster.from_url("redis://" + url[len(CLUSTER_SCHEME) :], **parameters)
        elif client is None and url is not None:
            client = redis.Redis.from_url(url, **parameters)
        self.client: Any = client if client is not None else redis.Redis(**parameters)
        self.url = url
        self.cluster = isinstance(self.client, redis.cluster.RedisCluster)
        self.scripts = {name: self.client.register_script(source) for name, source in _SCRIPTS.items()}
        self.calls = None if self.cluster else ScriptCalls(self.client, _SCRIPTS)
        self.batches_releases = self.calls is not None

    def _call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        if self.calls is not None:
            return self.calls.call(name, keys, args)
        return self.scripts[name](keys=keys, args=args, client=self.client)

    def describe(self) -> str:
        if self.url:
            return f"RedisBackend({_without_password(self.url)})"
        if self.cluster:
            node = self.client.get_default_node()
            return f"RedisBackend(cluster at {node.host}:{node.port})"
        pool = getattr(self.client, "connection_pool", None)
        service = getattr(pool, "service_name", None)
        if service:
            return f"RedisBackend(sentinel service {service})"
        kwargs = getattr(pool, "connection_kwargs", {})
        where = kwargs.get("path") or f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
        return f"RedisBackend(redis at {where})"

    def acquire(
        self, key: str, owner: str, *, ttl: int, limit: int = 1, lock: str = "", lock_args: Optional[str] = None
    ) -> Acquisition:
        return _acquisition(self._call("acquire", [key], [owner, ttl, limit, lock, lock_args or ""]), owner)

    def release(self, key: str, owner: str, *, hand_over: bool = True) -> Release:
        return _release(self._call("release", [key, *_waiting(key)], [owner, int(hand_over)]))

    def release_many(self, locks: Sequence[tuple[str, str]]) -> list[Union[Release, Exception]]:
        if self.calls is None or len(locks) < 2:
            return super().release_many(locks)
        replies = self.calls.batch([("release", [key, *_waiting(key)], [owner, 1]) for key, owner in locks])
        return [reply if isinstance(reply, Exception) else _release(reply) for reply in replies]

    def take_run(
        self, key: str, owner: str, queue_key: str, queue_owner: str, *, ttl: int, limit: int = 1, lock: str = ""
    ) -> tuple[Acquisition, Optional[bool]]:
        status, holder, fence, queue_held = self._call(
            "take_run", [key, queue_key], [owner, ttl, limit, lock, queue_owner]
        )
        got = Acquisition(status != 0, reentered=status == 2, holder=_text(holder), fence=int(fence))
        return got, None if queue_held == -1 else bool(queue_held)

    def acquire_and_dispatch(
        self,
        key: str,
        owner: str,
        *,
        ttl: int,
        limit: int,
        lock: str,
        lock_args: Optional[str],
        dispatch: str,
        namespace: str,
        arguments: Sequence[Any],
    ) -> Acquisition:
        """Acquire ``key`` as :meth:`acquire` does and, only when that
        succeeds, run the Redis broker's ``dispatch`` script source with
        ``arguments`` under ``namespace``, in one round trip.  Only on a
        standalone client, the broker's own Redis.
        """
        assert self.calls is not None, "a Cluster cannot run two slots' keys in one script"
        name = f"send:{hash(dispatch):x}"
        if name not in self.calls.sources:
            self.calls.add(name, send_script(dispatch))
        status, holder, fence = self.calls.call(
            name, [namespace, key], [owner, ttl, limit, lock, lock_args or "", *arguments]
        )
        return Acquisition(status != 0, reentered=status == 2, holder=_text(holder), fence=int(fence))

    def wait(self, key: str, ticket: str, message: bytes, *, order: int, ttl: int) -> None:
        self._call("wait", _waiting(key), [ticket, message, order, ttl])

    def claim(self, key: str, ticket: str) -> bool:
        return bool(self._call("claim", _waiting(key), [ticket]))

    def extend(self, locks: Sequence[tuple[str, str]], ttl: int) -> list[bool]:
        if not locks:
            return []
        if self.calls is not None:
            replies = self.calls.batch([("extend", [key], [owner, ttl]) for key, owner in locks])
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
            return [bool(reply) for reply in replies]
        if len(locks) == 1:
            key, owner = locks[0]
            return [bool(self.scripts["extend"](keys=[key], args=[owner, ttl], client=self.client))]
        pipe = self.client.pipeline(transaction=False)
        for key, owner in locks:
            # A Cluster pipeline refuses EVALSHA but sends EVAL, one batch per node.
            pipe.execute_command("EVAL", _SCRIPTS["extend"], 1, key, owner, ttl)
        return [bool(result) for result in pipe.execute()]

    def inspect(self, key: str) -> Optional[LockInfo]:
        fields = {_text(name): _text(value) for name, value in self.client.hgetall(key).items()}
        now = self._now_ms(key)
        holders = {name: int(value) for name, value in fields.items() if not name.startswith("!") and int(value) > now}
        if not holders:
            return None
        return LockInfo(key, fields.get("!lock") or None, holders, fields.get("!args"), int(fields.get("!fence", 0)))

    def scan(self, pattern: str) -> Iterator[str]:
        seen = set()
        for key in self.client.scan_iter(match=pattern, count=1000):
            name = _text(key)
            if name not in seen:
                seen.add(name)
                yield name

    def delete(self, key: str) -> bool:
        return bool(self.client.delete(key))

    def _now_ms(self, key: Optional[str] = None) -> int:
        # On a Cluster, ask the node that holds the key: its clock set the deadlines.
        where = {"target_nodes": self.client.get_node_from_key(key)} if self.cluster and key else {}
        seconds, micros = self.client.time(**where)
        return int(seconds) * 1000 + int(micros) // 1000
