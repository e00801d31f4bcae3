"""The operators' reads of :class:`~.client.RedisBackend`: plain redis-py commands, none on a job's path."""

from __future__ import annotations

from typing import Any, Iterator, Optional

from ...model import wire
from ...settings import masked
from ..base import LockReads
from ..records import EnqueueRecord, LockInfo, Waiter
from .calls import as_text


class RedisReads(LockReads):
    """What operators read of :class:`~.client.RedisBackend`'s locks: each
    one hash, read with ``HGETALL`` at the server's ``TIME``.
    """

    #: The redis-py client (standalone or Cluster), and whether to close it with this backend.
    client: Any
    owns_client: bool
    #: The URL it was made from, if any, and whether it is a Cluster's.
    url: Optional[str]
    cluster: bool

    def describe(self) -> str:
        if self.url:
            return f"RedisBackend({masked(self.url)})"
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

    def inspect(self, key: str) -> Optional[LockInfo]:
        fields = {as_text(name): as_text(value) for name, value in self.client.hgetall(key).items()}
        now = self._now_ms(key)
        meta = wire.META_MARK
        holders = {name: int(value) for name, value in fields.items() if not name.startswith(meta) and int(value) > now}
        if not holders:
            return None
        records = {owner: EnqueueRecord.decode(fields.get(wire.record_field(owner), "")) for owner in holders}
        current = fields.get(wire.CURRENT_FIELD)
        return LockInfo(
            key,
            fields.get(wire.LOCK_FIELD) or None,
            holders,
            fields.get(wire.ARGS_FIELD),
            int(fields.get(wire.FENCE_FIELD, 0)),
            current=current if current in holders else None,
            superseded=int(fields.get(wire.SUPERSEDED_FIELD, 0)),
            records={owner: record for owner, record in records.items() if record is not None},
        )

    def scan(self, pattern: str) -> Iterator[str]:
        seen = set()
        for key in self.client.scan_iter(match=pattern, count=1000):
            name = as_text(key)
            if name not in seen:
                seen.add(name)
                yield name

    def close(self) -> None:
        if self.owns_client:
            self.client.close()

    def waiters(self, key: str) -> list[Waiter]:
        waiting = self.client.zrange(wire.waiters_key(key), 0, -1, withscores=True)
        return [Waiter(as_text(message_id), int(order)) for message_id, order in waiting]

    def _now_ms(self, key: Optional[str] = None) -> int:
        # On a Cluster, ask the node that holds the key: its clock set the deadlines.
        where = {"target_nodes": self.client.get_node_from_key(key)} if self.cluster and key else {}
        seconds, micros = self.client.time(**where)
        return int(seconds) * 1000 + int(micros) // 1000
