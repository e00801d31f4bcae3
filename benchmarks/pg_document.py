"""The "Locks in PostgreSQL" section of ``docs/performance.md``: written
by ``python -m benchmarks --postgres`` between two markers, and kept as
it is by the other runs, which rewrite the rest of the page.
"""

from __future__ import annotations

from statistics import median
from typing import Optional

from .pg_costs import Cost
from .pg_rounds import SETTINGS, TARGET, PgResults, table, verdicts
from .workers import THREADS

BEGIN = "<!-- postgres: written by `python -m benchmarks --postgres`; do not edit by hand -->"
END = "<!-- postgres: end -->"


def splice(page: str, section: str) -> str:
    """``page`` with its PostgreSQL section replaced by ``section``, or
    ``section`` appended when it has none.
    """
    kept = extract(page)
    if kept is None:
        return page.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
    return page.replace(kept, section.rstrip("\n"))


def extract(page: str) -> Optional[str]:
    """The PostgreSQL section of ``page``, markers included, or None."""
    start = page.find(BEGIN)
    end = page.find(END, start)
    if start < 0 or end < 0:
        return None
    return page[start : end + len(END)]


def keep(new_page: str, old_page: str) -> str:
    """``new_page`` with ``old_page``'s PostgreSQL section, if it had one."""
    kept = extract(old_page)
    return new_page if kept is None else splice(new_page, kept)


def cost_table(costs: dict[str, list[Cost]]) -> str:
    names = [cost.name for cost in next(iter(costs.values()), [])]
    header = ["call (one thread)"] + [f"{part}, synchronous_commit={s}" for s in costs
                                      for part in ("wall µs", "client CPU µs", "server µs")]
    rows = []
    for name in names:
        row = [name]
        for setting_costs in costs.values():
            [cost] = [c for c in setting_costs if c.name == name]
            row += [f"{cost.wall:,.0f}", f"{cost.cpu:,.0f}", "n/a" if cost.server is None else f"{cost.server:,.0f}"]
        rows.append(row)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def plans_line(plans: dict[str, str]) -> str:
    """How the server reads the lock table to write and to delete."""
    found = ", ".join(f"the {name}: {scan or 'no scan of the table'}" for name, scan in plans.items())
    return f"The server's plans of the backend's statements, after the profile's calls: {found}."


def _short(results: PgResults) -> str:
    """The section's opening: the lock against the floor and bare Dramatiq."""
    def ratio(setting: str, contender: str, base: str) -> str:
        values = results.ratios(setting, contender, base)
        return f"{median(values):.2f}" if values else "n/a"

    on, off = SETTINGS
    return (f"`while_executing` with its locks in PostgreSQL processes {ratio(on, 'pg_while_executing', 'pg_floor')} "
            f"× the PostgreSQL floor's rate with `synchronous_commit` on, and "
            f"{ratio(off, 'pg_while_executing', 'pg_floor')} × with it off (the target is {TARGET:.2f} ×); "
            f"{ratio(on, 'pg_while_executing', 'bare')} and {ratio(off, 'pg_while_executing', 'bare')} × bare "
            f"Dramatiq's, where the Redis backend's lock processes {ratio(on, 'while_executing', 'bare')} and "
            f"{ratio(off, 'while_executing', 'bare')} × in the same rounds.")


def render(results: PgResults, costs: dict[str, list[Cost]], plans: dict[str, str]) -> str:
    m, plan = results.meta, results.plan
    return f"""{BEGIN}
## Locks in PostgreSQL

**In short:** {_short(results)}

- **When:** {m.get('date', '')}, {m.get('duration', '')}
- **Machine:** {m.get('machine', '')}; {m.get('load', '')}
- **PostgreSQL:** {m.get('postgres', '')}
- **Plan:** {plan.rounds} rounds of {plan.sent} jobs per contender and setting, sent in turns of
  {plan.chunk}; {plan.calls} single calls of each kind for the profile

### How it measures

Four contenders, each one `RedisBroker` app with the no-op actor `job(key, seq)` of the rest of
this page, run by one real `dramatiq` worker process with {THREADS} threads, every job on a key
of its own:

- **bare Dramatiq**;
- **`while_executing`, locks in Redis**: `UniqueMiddleware` with its default `RedisBackend` on
  the broker's Redis;
- **PostgreSQL floor**: bare Dramatiq plus one committed single-row write per job
  (`INSERT ... ON CONFLICT DO UPDATE`, autocommit) in `before_process_message`, on the worker
  thread, on a psycopg connection of the thread's own with the backend's settings (nothing
  prepared): what no lock that commits its take in PostgreSQL on the worker thread can go below;
- **`while_executing`, locks in PostgreSQL**: `UniqueMiddleware(backend=PostgresBackend(url=...))`.

Each round runs every contender once with `synchronous_commit=on` and once with `off`, the two
settings in turn, set per session through the URL (`options=-c synchronous_commit=off`), for the
floor and the backend alike.  Within a setting the driver sends every contender's jobs in turns,
then runs one worker per contender on its queue; the order of contenders rotates from round to
round, and ratios are taken within a round: the median, then the lowest and highest round.  Each
run checks that every job ran exactly once, that the floor left one row per job and the lock one
row per key in PostgreSQL, and that each lock was taken once, and released once (a release that
rides with a later call may land after the last ack: one per thread).

### Processing, within each round (median, lowest–highest round)

{table(results)}

{chr(10).join(verdicts(results))}

### One take and release, from one thread

Each call {plan.calls} times in chunks taken in turn, from one thread of the driver: wall time,
the thread's CPU time (psycopg, JSON and the stub's rules), and the server's execution time of the
statements (`pg_stat_statements`, which the private cluster loads; the commit's flush is not in
it).  "Rules in memory" runs the stub's method of the call on the rows a call reads, held in
memory: the Python between the read and the write.

{cost_table(costs)}

{findings(results, costs, plans)}
{END}
"""


def _cost(costs: list[Cost], start: str) -> Cost:
    [cost] = [c for c in costs if c.name.startswith(start)]
    return cost


def _per_job(costs: list[Cost]) -> str:
    take, release = _cost(costs, "take"), _cost(costs, "release")
    floor, trip = _cost(costs, "floor"), _cost(costs, "round trip")
    rules = _cost(costs, "rules of a take").wall + _cost(costs, "rules of a release").wall
    wall, cpu = take.wall + release.wall, take.cpu + release.cpu
    server = None if take.server is None or release.server is None else take.server + release.server
    waiting = wall - cpu - (server or 0)
    return (f"a take and its release cost {wall:,.0f} µs against {floor.wall:,.0f} µs for the floor's write "
            f"({wall / floor.wall:.1f} ×): {cpu:,.0f} µs of client CPU (the floor's: {floor.cpu:,.0f} µs), of "
            f"which {rules:,.0f} µs run the stub's rules; "
            + ("" if server is None else f"{server:,.0f} µs of statements on the server (the floor's: "
               f"{floor.server or 0:,.0f} µs); ")
            + f"and {waiting:,.0f} µs waiting: four round trips (a bare one costs {trip.wall:,.0f} µs here) "
            "and the take's commit, where the floor makes one of each")


def _worker_cpu(results: PgResults) -> str:
    """What the lock's worker spends per job beyond the floor's, in the rounds."""
    def cpu(setting: str, contender: str) -> Optional[float]:
        values = [run.worker_cpu for run in results.runs.get((setting, contender), []) if run.worker_cpu is not None]
        return median(values) if values else None

    parts = []
    for setting in SETTINGS:
        bare, floor, lock = (cpu(setting, c) for c in ("bare", "pg_floor", "pg_while_executing"))
        if bare is not None and floor is not None and lock is not None:
            parts.append(f"{lock - bare:,.0f} µs of worker CPU per job beyond bare Dramatiq's with "
                         f"synchronous_commit={setting}, against {floor - bare:,.0f} µs for the floor")
    return ("In the rounds, the lock costs " + "; ".join(parts) + ": with eight threads on a few cores, the "
            "worker's CPU, under one GIL, bounds its rate before the server does.") if parts else ""


def findings(results: PgResults, costs: dict[str, list[Cost]], plans: dict[str, str]) -> str:
    """Where the time goes, read off the profile, and what the lock does
    per job that the floor does not.
    """
    missed = [s for s in SETTINGS if (r := results.ratios(s, "pg_while_executing", "pg_floor")) and median(r) < TARGET]
    lines = ["### Where the time goes", "",
             "Each call of the backend is one transaction of two round trips, each one message of statements "
             "with their values bound by psycopg: `BEGIN`, the `statement_timeout` and the row locks "
             "(`INSERT ... ON CONFLICT DO UPDATE ... RETURNING`), then, once the stub's rules decided in "
             "Python, the writes and `COMMIT`; a transaction that only released and promoted no waiter "
             "commits without waiting for the flush.  In a worker the release of a job rides in the next "
             "job's start (`release_and_start`): one transaction and one flushed commit per job, where the "
             "floor makes one round trip and one commit.  The profile times a take and a release as separate "
             "calls, from one thread:", ""]
    lines += [f"- synchronous_commit={setting}: {_per_job(setting_costs)}." for setting, setting_costs in costs.items()]
    lines += ["", _worker_cpu(results), "", plans_line(plans)]
    seq_scan = any("Seq Scan" in scan for scan in plans.values())
    if seq_scan:
        lines += ["", "A sequential scan reads every row of the table, held or fenced, in every call that writes: "
                  "the planner takes `jsonb_to_recordset` and `jsonb_array_elements_text` for 100 rows each, and "
                  "below some thousands of rows a hash join over the whole table looks cheaper than 100 index "
                  "probes.  The cost of each call grows with the table until the plan flips.  With "
                  "`enable_seqscan = off` in the call's transaction (or statements whose row count the planner "
                  "sees), the same statements are index lookups."]
    if missed:
        first = "the index lookups above; " if seq_scan else ""
        lines += ["", f"What would close the gap to the floor: {first}one round trip per call instead of two, "
                  "which needs the decision on the server: the rules of the hot path (`start`, "
                  "`release_and_start`, `release`) written again in SQL, as a function of the key's row that "
                  "returns the result, beside the stub's rules in Python, with the contract suite and the model "
                  "run against both; and less worker CPU per job (psycopg's per query, and the state's JSON "
                  "and the stub's rules, some 100 µs a call)."]
    return "\n".join(lines)
