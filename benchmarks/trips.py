"""Counts the Redis round trips this process makes, by what they carry.

A round trip is one ``send_packed_command`` of redis-py, or one
exchange of the lock backend's own (``wire.exchange``, which sends
without redis-py): one command, or one whole pipeline.  Scripts are named by their SHA1, so a lock
script and the broker's ``dispatch.lua`` are told apart even though
both are ``EVALSHA``.  Counting is off unless :func:`install` is called.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

import dramatiq.brokers.redis
import redis.connection
from dramatiq.worker import WorkerThread

from dramatiq_unique.backends.redis.scripts import SCRIPTS

try:
    from dramatiq_unique.backends import wire
except ImportError:  # a version that sends through redis-py only, measured for comparison
    wire = None  # type: ignore[assignment]

try:
    from dramatiq_unique.backends.redis.scripts import send_script
except ImportError:  # a version without the send fast path, measured for comparison
    send_script = None  # type: ignore[assignment]

#: Commands of the ``ConcurrentRateLimiter`` recipe's Redis backend.
_MUTEX_COMMANDS = {"SET", "GET", "WATCH", "UNWATCH", "MULTI+SET+EXEC"}

_counts: Counter[str] = Counter()
#: The round trips made on Dramatiq's worker threads, which run the actors.
_worker_counts: Counter[str] = Counter()
#: The round trips made on each thread, by thread ident.
_thread_counts: dict[int, Counter[str]] = {}
_mutex = threading.Lock()
_original: Optional[Callable[..., Any]] = None
#: The lock backend's own exchange, where this version has one.
_original_raw: Optional[Callable[..., Any]] = None if wire is None else wire.exchange


def _sha(source: bytes) -> str:
    return hashlib.sha1(source).hexdigest()


def _script_names() -> dict[str, str]:
    dispatch = Path(dramatiq.brokers.redis.__file__).parent / "redis" / "dispatch.lua"
    names = {_sha(dispatch.read_bytes()): "broker:dispatch"}
    names.update({_sha(source.encode()): f"lock:{name}" for name, source in SCRIPTS.items()})
    # The send fast path: a lock and the broker's enqueue in one script.
    if send_script is not None:
        names[_sha(send_script(dispatch.read_text()).encode())] = "lock:send+broker:dispatch"
    return names


_SCRIPT_NAMES = _script_names()


def _commands(packed: bytes) -> list[list[bytes]]:
    """The first two arguments of every command in a RESP buffer."""
    commands, at = [], 0
    while at < len(packed):
        end = packed.index(b"\r\n", at)
        count, at = int(packed[at + 1 : end]), end + 2
        head: list[bytes] = []
        for _ in range(count):
            end = packed.index(b"\r\n", at)
            size, at = int(packed[at + 1 : end]), end + 2
            if len(head) < 2:
                head.append(packed[at : at + size])
            at += size + 2
        commands.append(head)
    return commands


def label(packed: Any) -> str:
    """What one round trip carries, e.g. ``lock:acquire``,
    ``broker:dispatch`` or ``MULTI+SET+EXEC``.
    """
    chunks = [packed] if isinstance(packed, (bytes, str)) else packed
    buffer = b"".join(chunk.encode() if isinstance(chunk, str) else bytes(chunk) for chunk in chunks)
    names = []
    for head in _commands(buffer):
        name = head[0].decode().upper()
        if name == "EVALSHA" and len(head) > 1:
            name = _SCRIPT_NAMES.get(head[1].decode(), "EVALSHA ?")
        names.append(name)
    if "lock:start" in names and set(names) <= {"lock:start", "lock:release"}:
        return _start_label(names)
    if len(set(names)) == 1 and len(names) > 1:
        return f"{names[0]} x{len(names)}"
    return "+".join(names)


def _start_label(names: list[str]) -> str:
    """A run lock round trip: ``start``, shared by several worker
    threads' starts (``grouped``), and carrying pending releases.
    """
    grouped = " (grouped)" if names.count("lock:start") > 1 else ""
    releases = " +releases" if "lock:release" in names else ""
    return f"lock:start{grouped}{releases}"


def owner(name: str) -> str:
    """Who a round trip serves: ``lock``, ``mutex``, ``broker`` or ``other``."""
    if name.startswith("lock:send"):
        return "lock+broker"
    if name.startswith("lock:"):
        return "lock"
    if name in _MUTEX_COMMANDS:
        return "mutex"
    if name.startswith("broker:"):
        return "broker"
    return "other"


def _count(packed: Any) -> None:
    name = label(packed)
    on_worker = isinstance(threading.current_thread(), WorkerThread)
    with _mutex:
        _counts[name] += 1
        if on_worker:
            _worker_counts[name] += 1
        _thread_counts.setdefault(threading.get_ident(), Counter())[name] += 1


def install() -> None:
    """Start counting every round trip of every connection."""
    global _original
    if _original is not None:
        return
    original = redis.connection.AbstractConnection.send_packed_command

    def send_packed_command(self: Any, command: Any, check_health: bool = True) -> None:
        _count(command)
        original(self, command, check_health)

    _original = original
    redis.connection.AbstractConnection.send_packed_command = send_packed_command  # type: ignore[method-assign]
    raw = _original_raw
    if raw is not None:

        def exchange_raw(conn: Any, packed: bytes, count: int) -> list[Any]:
            _count(packed)
            replies: list[Any] = raw(conn, packed, count)
            return replies

        wire.exchange = exchange_raw


def uninstall() -> None:
    """Stop counting."""
    global _original
    if _original is not None:
        redis.connection.AbstractConnection.send_packed_command = _original  # type: ignore[method-assign]
        _original = None
        if _original_raw is not None:
            wire.exchange = _original_raw


def counts() -> dict[str, int]:
    """Round trips so far, by label."""
    with _mutex:
        return dict(_counts)


def worker_counts() -> dict[str, int]:
    """Round trips so far on worker threads, by label."""
    with _mutex:
        return dict(_worker_counts)


def thread_counts() -> dict[str, int]:
    """Round trips so far on the calling thread, by label: a send's own,
    without those of background threads a process may still run.
    """
    with _mutex:
        return dict(_thread_counts.get(threading.get_ident(), ()))


def reset() -> None:
    with _mutex:
        _counts.clear()
        _worker_counts.clear()
        _thread_counts.clear()
