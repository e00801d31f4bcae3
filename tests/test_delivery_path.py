"""One delivery's path through the package, measured as
``python -m benchmarks.delivery_path`` measures it: a ``while_executing``
actor with ``on_conflict="reschedule"`` on the Redis backend, two sends
for one key, every thread traced from the first send to the last release.

The path is held to what docs/architecture.md promises a reader: the
walk on that page names exactly the modules the code runs, and no more
modules or scripts run than the figures below.
"""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.delivery_path import measure

WALK = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"

#: The most modules and scripts one delivery may run: 12 now (26
#: before the merges of issue 35), so that a module added to the path
#: is seen the day it is.
MOST_MODULES = 12
MOST_SCRIPTS = 3


def walked_modules() -> list[str]:
    """The modules docs/architecture.md's walk lists, in its order."""
    text = WALK.read_text()
    section = text.split("## One rescheduled message through the code", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. `([\w/]+\.py)`", section, flags=re.MULTILINE)


def test_one_delivery_runs_few_modules_and_the_walk_names_them(redis_url: str) -> None:
    path = measure(redis_url)
    assert len(path.files) <= MOST_MODULES, path.files
    assert len(path.scripts) <= MOST_SCRIPTS, path.scripts
    assert sorted(walked_modules()) == sorted(path.files), (walked_modules(), path.files)
