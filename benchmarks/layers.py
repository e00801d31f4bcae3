"""What each piece of the throughput layer buys: ``while_executing`` as
shipped, beside the same lock with the releaser thread, the group
commit, or both switched off (:data:`~.app.LAYER_SWITCHES`), in the same
rounds, at the defaults and at prefetch 64.

A piece's gain is the rate with it over the rate without it, paired
within each round: the releaser's with the group commit on (shipped ÷
no releaser) and off (no group commit ÷ plain calls), and the group
commit's likewise.  A piece pays where the median gain is at least
:data:`KEEP_AT`.
"""

from __future__ import annotations

import re
from statistics import median
from typing import Optional

from .app import BARE, LAYER_SWITCHES, NO_GROUP, NO_RELEASER, PLAIN
from .report import CONFIDENCE, Results, _spread, _table, figure_name, median_interval, number
from .runs import DEFAULT, PREFETCH_64

#: The lock as shipped.
SHIPPED = "while_executing"
#: The contenders of the layer rounds.
CONTENDERS = (BARE, SHIPPED, *LAYER_SWITCHES)
#: The configurations they run in.
CONFIGS = (DEFAULT, PREFETCH_64)
#: The least median gain for which a piece is kept.
KEEP_AT = 1.03

#: The heading of the section, which ``--layers`` replaces in place.
HEADING = "## The throughput layer, piece by piece"

NAMES = {SHIPPED: "`while_executing` as shipped (releaser and group commit)",
         NO_RELEASER: "no releaser (each release on the worker thread, its own call)",
         NO_GROUP: "no group commit (each start its own call)",
         PLAIN: "plain calls (neither)"}

#: Piece -> the (with, without) pairs whose rates give its gain.
PIECES = {
    "releaser": ((SHIPPED, NO_RELEASER), (NO_GROUP, PLAIN)),
    "group commit": ((SHIPPED, NO_GROUP), (NO_RELEASER, PLAIN)),
}


def gains(results: Results, config: str, with_: str, without: str) -> list[float]:
    """Per-round rates of ``with_`` over ``without`` in ``config``."""
    return results.ratios(figure_name("process", config), with_, without)


def _paired(values: list[float]) -> str:
    interval = median_interval(values)
    if interval is None:
        return "n/a"
    return f"{median(values):.2f} ({interval[0]:.2f}–{interval[1]:.2f})"


def rate_table(results: Results) -> str:
    rows = []
    for config in (c.name for c in CONFIGS):
        process, cpu = figure_name("process", config), figure_name("worker_cpu", config)
        for contender in CONTENDERS[1:]:
            if not results.samples[process].get(contender):
                continue
            rows.append([config, NAMES[contender], number(results.median(process, contender)),
                         f"{number(results.ratio(process, contender, BARE), 2)} "
                         f"({_spread(results.ratios(process, contender, BARE))})",
                         _paired(gains(results, config, contender, SHIPPED)), number(results.median(cpu, contender))])
    return _table(["configuration", "`while_executing`", "processing msg/s", "× bare (min–max)",
                   "÷ as shipped, within each round", "worker CPU µs/job"], rows)


#: The verdicts on a piece in one configuration.
PAYS = f"pays (≥ {KEEP_AT:.2f}, interval above 1)"
PAYS_AT_MEDIAN = f"pays at the median (≥ {KEEP_AT:.2f}), but its interval holds 1"
DOES_NOT_PAY = f"does not pay (< {KEEP_AT:.2f})"


def pays(results: Results, piece: str, config: str) -> Optional[str]:
    """Whether taking ``piece`` out of the lock as shipped costs
    :data:`KEEP_AT` or more in ``config``, and whether the rounds tell
    that from no gain at all; None when not measured.
    """
    values = gains(results, config, *PIECES[piece][0])
    interval = median_interval(values)
    if interval is None:
        return None
    if median(values) < KEEP_AT:
        return DOES_NOT_PAY
    return PAYS if interval[0] > 1 else PAYS_AT_MEDIAN


def gain_table(results: Results) -> str:
    rows = []
    for piece, (shipped, other_off) in PIECES.items():
        for config in (c.name for c in CONFIGS):
            verdict = pays(results, piece, config)
            if verdict is None:
                continue
            rows.append([piece, config, _paired(gains(results, config, *shipped)),
                         _paired(gains(results, config, *other_off)), verdict])
    return _table(["piece", "configuration", "with it ÷ without it, the other piece on (as shipped)",
                   "the same, the other piece off", "verdict (as shipped)"], rows)


def decisions(results: Results) -> str:
    """What the rounds decide of each piece: kept where it pays at the
    median in some configuration (a piece that pays in none goes).
    """
    lines = []
    for piece, (shipped, _) in PIECES.items():
        verdicts = {config.name: pays(results, piece, config.name) for config in CONFIGS}
        where = [config for config, verdict in verdicts.items() if verdict in (PAYS, PAYS_AT_MEDIAN)]
        medians = ", ".join(f"{config} {median(gains(results, config, *shipped)):.2f}"
                            for config, verdict in verdicts.items() if verdict is not None)
        decided = f"kept: it pays in {', '.join(where)}" if where else "to go: it pays in no configuration"
        lines.append(f"- The {piece}: {decided} (with it ÷ without it, as shipped: {medians}).")
    return "\n".join(lines)


def section(results: Results, meta: str = "") -> str:
    """The section of ``docs/performance.md``; empty without its rounds."""
    if not results.samples[figure_name("process", DEFAULT.name)].get(PLAIN):
        return ""
    rounds = len(results.samples[figure_name("process", DEFAULT.name)][PLAIN])
    rounds_said = "in 1 round" if rounds == 1 else f"over {rounds} rounds"
    inner = median_interval(list(range(rounds)))
    spread = "here their whole range" if inner == (0, rounds - 1) else "the second lowest to the second highest here"
    if inner is not None and inner[0] > 1:
        spread = f"the {inner[0] + 1}th lowest to the {inner[0] + 1}th highest here"
    return f"""{HEADING}

The throughput layer is the releaser (`worker/release.py`: releases run off the worker thread,
riding in front of the next start through `release_and_start`, or sent in batches by a thread of
their own) and the group commit (`backends/redis/calls.py`: starts of worker threads share a round
trip).  Each can be switched off: `RedisBackend(release_in_background=False)` releases each run lock
on the worker thread in its own call, `RedisBackend(group_commit=False)` sends each start in its own
call.  Here `while_executing` runs as shipped and with either or both off, in the same rounds as bare
Dramatiq.  A piece's gain is the rate with it over the rate without it, within each round: the
median, and the interval of the ratios that covers the true median with {CONFIDENCE:.0%} confidence
({spread}), measured {rounds_said}.  A piece is kept where taking it out of
the lock as shipped costs {KEEP_AT - 1:.0%} or more.
{meta}
{rate_table(results)}

{gain_table(results)}

{decisions(results)}
"""


def splice(document: str, text: str) -> str:
    """``document`` with its throughput-layer section replaced by
    ``text`` (added before the notes when it has none).
    """
    pattern = re.compile(re.escape(HEADING) + r"\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(document):
        return pattern.sub(lambda _: text.rstrip("\n") + "\n\n", document, count=1)
    at = document.find("\n## Notes")
    if at < 0:
        return document.rstrip("\n") + "\n\n" + text
    return document[: at + 1] + text.rstrip("\n") + "\n\n" + document[at + 1 :]
