"""``min_replicas``: the ``WAIT`` after every take of a :class:`~.client.RedisBackend`, checked."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

from ...errors import ConfigurationError, LockBackendError


class TooFewReplicas(LockBackendError):
    """A lock call took a lock fewer than ``min_replicas`` replicas acknowledged
    within ``min_replicas_timeout``, which a failover could lose: it failed.  A
    fresh lock is given back, unless ``given_back`` is False (that failed too,
    or it guards a message already enqueued): it then lapses by TTL or lease.

    Attributes:
      acked(int): How many replicas acknowledged it (0 when ``WAIT`` failed).
      wanted(int): ``min_replicas``.
    """

    def __init__(self, message: str, *, backend: str, key: str, acked: int, wanted: int, given_back: bool) -> None:
        super().__init__(message, backend=backend)
        self.key = key
        self.acked = acked
        self.wanted = wanted
        self.given_back = given_back


def replication(replicas: Any, timeout: Any, cluster: bool) -> tuple[int, int]:
    """Checked ``min_replicas`` and ``min_replicas_timeout``.

    Raises:
      ConfigurationError: a count below 0, a timeout below 1 ms (``WAIT
        n 0`` would block for ever), or replicas asked of a Cluster,
        whose pipelines do not keep ``WAIT`` on the script's connection.
    """
    for name, value, least in (("min_replicas", replicas, 0), ("min_replicas_timeout", timeout, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ConfigurationError(f"{name}={value!r} is invalid: expected a whole number, {least} or more.")
    if replicas and cluster:
        raise ConfigurationError(f"min_replicas={replicas!r} is not supported on a Redis Cluster.")
    return replicas, timeout


def require(
    acked: Union[int, Exception, None],
    key: str,
    give_back: Optional[Callable[[], Any]],
    *,
    wanted: int,
    within: int,
    backend: Callable[[], str],
) -> None:
    """Raise :class:`TooFewReplicas` when fewer than ``wanted`` replicas
    acknowledged the take of ``key`` ``within`` ms (``acked``: ``WAIT``'s
    reply or error, None without ``WAIT``), after ``give_back`` (if any);
    ``backend()`` describes the backend for the error.
    """
    if acked is None or (isinstance(acked, int) and acked >= wanted):
        return
    failure, given_back = "", False
    if give_back is not None:
        try:
            give_back()
            given_back = True
        except Exception as e:  # the lock then lapses by its TTL or lease
            failure = f"; giving it back failed too ({e!r}), so it lapses by its TTL or lease"
    count = acked if isinstance(acked, int) else 0
    seen = f"{acked} of {wanted}" if isinstance(acked, int) else f"none (WAIT failed: {acked!r})"
    kept = " and was given back" if given_back else " and is kept" if give_back is None else ""
    raise TooFewReplicas(
        f"the lock {key!r} was acknowledged by {seen} replicas within {within} ms{kept}{failure}",
        backend=backend(),
        key=key,
        acked=count,
        wanted=wanted,
        given_back=given_back,
    )
