"""The seed scenario, serialize per resource, run end to end.

Several syncs for account 42 and one each for 43 and 44 go at once to a ``while_executing`` actor
with ``on_conflict="reschedule"``: 42's run one after another, 43 and 44 alongside.  In memory by
default; ``--redis URL`` uses a ``RedisBroker`` and its Redis, ``--url URL`` keeps the locks there.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import dramatiq
from dramatiq import Worker

from ..backends import from_url
from ..middleware import UniqueMiddleware

#: How long one simulated sync takes, in seconds.
SYNC_SECONDS = 0.4
ACCOUNTS = [42, 42, 42, 42, 43, 44]
#: How long a sync that met the held lock waits before it is tried again, in ms.
RESCHEDULE_DELAY = 1000


@dataclass
class Run:
    account: int
    nth: int
    start: float
    end: float


def _broker(redis_url: Optional[str], url: Optional[str] = None) -> tuple[dramatiq.Broker, UniqueMiddleware]:
    if redis_url is None:
        from dramatiq.brokers.stub import StubBroker

        broker: dramatiq.Broker = StubBroker()
    else:
        from dramatiq.brokers.redis import RedisBroker

        broker = RedisBroker(url=redis_url, namespace="dramatiq-unique-demo")
    locks = url or redis_url
    backend = from_url(locks) if locks is not None else None
    if backend is not None:
        backend.delete_prefix("dramatiq-unique-demo:")  # what an interrupted run left
    unique = UniqueMiddleware(backend=backend, prefix="dramatiq-unique-demo", reschedule_delay=RESCHEDULE_DELAY)
    broker.add_middleware(unique)
    return broker, unique


def run(redis_url: Optional[str] = None, out: Any = None, *, url: Optional[str] = None) -> list[Run]:
    """Run the scenario and print its timeline; return the runs.

    Parameters:
      redis_url(str): A Redis for a ``RedisBroker`` (and the locks).
      url(str): Where the locks are, when not in the broker.
    """
    broker, unique = _broker(redis_url, url)
    runs: list[Run] = []
    mutex = threading.Lock()
    started = time.monotonic()

    @dramatiq.actor(broker=broker, lock="while_executing", on_conflict="reschedule", lock_args=["account_id"])
    def sync_account_balance(account_id: int, requested_at: float) -> None:
        begin = time.monotonic() - started
        time.sleep(SYNC_SECONDS)
        with mutex:
            nth = 1 + sum(r.account == account_id for r in runs)
            runs.append(Run(account_id, nth, begin, time.monotonic() - started))

    waiters: set[str] = set()
    unique.events.subscribe(lambda e: waiters.add(e.message_id) if e.name == "rescheduled" and e.message_id else None)
    if redis_url is not None:
        broker.flush_all()
    worker = Worker(broker, worker_threads=8, worker_timeout=100)
    worker.start()
    try:
        for account in ACCOUNTS:
            sync_account_balance.send(account, time.time())
        deadline = time.monotonic() + 60
        while len(runs) < len(ACCOUNTS):
            if time.monotonic() > deadline:
                raise TimeoutError("the demo's syncs did not all finish in time")
            time.sleep(0.02)
    finally:
        worker.stop()
        broker.close()
    _print_timeline(runs, unique, waiters, out)
    return runs


def _print_timeline(runs: list[Run], unique: UniqueMiddleware, waiters: set[str], out: Any) -> None:
    width, total = 48, max(r.end for r in runs)
    scale = width / total
    lines = [f"sync_account_balance: lock=while_executing, on_conflict=reschedule, {SYNC_SECONDS:.1f} s per sync"]
    lines.append(f"{'':16}0 s{'':{width - 6}}{total:4.1f} s")
    for r in sorted(runs, key=lambda r: (r.account, r.start)):
        bar = " " * int(r.start * scale) + "#" * max(1, int((r.end - r.start) * scale))
        label = f"account {r.account}" + (f" #{r.nth}" if r.account == 42 else "")
        lines.append(f"{label:16}|{bar:{width}}| {r.start:5.2f}-{r.end:5.2f} s")
    waited = f"{len(waiters)} syncs of account 42 waited for its lock"
    lines.append(
        f"{len(runs)} syncs ran once each; {waited}, rescheduled {unique.events.count('rescheduled')} times in all"
    )
    lines.append("(each waiting sync is handed the lock when the one before it ends, and its delayed copy,")
    lines.append(f" {RESCHEDULE_DELAY / 1000:.0f} s later, is rescheduled again if it comes while the lock is held).")
    lines.append(f"Account 42 ran one sync at a time: {'yes' if not overlaps(runs, 42) else 'NO'}.")
    lines.append(f"Accounts 43 and 44 ran alongside 42: {'yes' if _alongside(runs) else 'no'}.")
    print("\n".join(lines), file=out)


def overlaps(runs: list[Run], account: int) -> list[tuple[Run, Run]]:
    """Pairs of runs for ``account`` that overlapped in time."""
    mine = sorted((r for r in runs if r.account == account), key=lambda r: r.start)
    return [(a, b) for a, b in zip(mine, mine[1:]) if b.start < a.end]


def _alongside(runs: list[Run]) -> bool:
    first = min((r for r in runs if r.account == 42), key=lambda r: r.start)
    return all(r.start < first.end for r in runs if r.account in (43, 44))


def _quiet_skips(record: logging.LogRecord) -> bool:
    # Dramatiq logs every rescheduled delivery as "skipped"; the timeline says it better.
    return not record.getMessage().endswith("was skipped.")


def main(redis_url: Optional[str] = None, *, url: Optional[str] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_quiet_skips)
    runs = run(redis_url, url=url)
    ok = not overlaps(runs, 42) and len(runs) == len(ACCOUNTS)
    return 0 if ok else 1
