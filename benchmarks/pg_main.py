"""``python -m benchmarks --postgres [URL]``: locks in PostgreSQL (see
:mod:`.pg_rounds`), on a private redis-server (or ``--redis URL``) and a
private PostgreSQL (or the one at ``URL``).  Prints the tables and
writes its section of ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from . import pg_costs, pg_document, pg_rounds
from .document import _cpu_model
from .pg_server import PrivatePostgres, version
from .server import BenchmarkError, PrivateRedis, connect


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    plan = pg_rounds.QUICK if args.quick else pg_rounds.FULL
    started, load = time.time(), os.getloadavg()
    redis_server: Optional[PrivateRedis] = None
    postgres: Optional[PrivatePostgres] = None
    try:
        redis_server = None if args.redis else PrivateRedis().start()
        redis_url = args.redis or redis_server.url  # type: ignore[union-attr]
        postgres = None if args.postgres else PrivatePostgres().start()
        postgres_url = args.postgres or postgres.url  # type: ignore[union-attr]
        results = pg_rounds.measure(connect(redis_url), redis_url, postgres_url, plan, progress)
        costs: dict[str, list[pg_costs.Cost]] = {}
        plans: dict[str, str] = {}
        for setting in pg_rounds.SETTINGS:
            progress(f"profile of one take and release, synchronous_commit={setting}")
            costs[setting], plans = pg_costs.profile(postgres_url, setting, plan.calls)
        results.meta = meta(postgres_url, args, started, load)
    except BenchmarkError as e:
        progress(f"benchmark failed: {e}")
        return 2
    finally:
        if postgres is not None:
            postgres.stop()
        if redis_server is not None:
            redis_server.stop()
    print(pg_rounds.table(results))
    print("\n".join(pg_rounds.verdicts(results)))
    print(pg_document.cost_table(costs))
    print(pg_document.plans_line(plans))
    if args.output != "-":
        path = Path(args.output)
        page = path.read_text() if path.exists() else "# Performance\n"
        path.write_text(pg_document.splice(page, pg_document.render(results, costs, plans)))
        progress(f"wrote its section of {args.output}")
    for violation in results.violations:
        progress(f"GUARANTEE BROKEN: {violation}")
    return 1 if results.violations else 0


def meta(postgres_url: str, args: argparse.Namespace, started: float, load: tuple[float, ...]) -> dict[str, str]:
    end_load = os.getloadavg()
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "duration": f"{time.time() - started:.0f} s",
        "machine": f"{_cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "load": f"1-minute load average {load[0]:.2f} at the start, {end_load[0]:.2f} at the end",
        "postgres": (f"{version(postgres_url)}; "
                     + ("given with --postgres" if args.postgres else "a private cluster the harness started")),
    }
