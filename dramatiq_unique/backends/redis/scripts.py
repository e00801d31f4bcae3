"""The Lua scripts of :class:`~.client.RedisBackend`, one per verb, in
``lua/``: their sources, with the library each includes expanded.
"""

from __future__ import annotations

from importlib import resources
from typing import Mapping, Optional

_LUA = resources.files(__package__).joinpath("lua")


def source(name: str, *, given: Optional[Mapping[str, str]] = None) -> str:
    """A script's text, each ``--@include NAME`` line replaced by
    ``NAME.lua`` (expanded) or ``given[NAME]`` (not expanded); a library
    comes once, where first included.
    """
    included: set[str] = set()

    def expand(text: str) -> str:
        lines = []
        for line in text.splitlines(keepends=True):
            if not line.startswith("--@include "):
                lines.append(line)
                continue
            library = line.split()[1]
            if given is not None and library in given:
                lines.append(given[library].rstrip("\n") + "\n")
            elif library not in included:
                included.add(library)
                lines.append(expand(_LUA.joinpath(f"{library}.lua").read_text()))
        return "".join(lines)

    return expand(_LUA.joinpath(f"{name}.lua").read_text())


SCRIPTS = {
    name: source(name)
    for name in (
        *("acquire", "start", "release", "extend", "join_line", "claim"),
        *("replace", "current", "unreplace"),  # on_conflict="replace" and debounce
        *("confirm", "reap"),  # provisional enqueue locks and the reaper
    )
}


def send_script(dispatch: str) -> str:
    """send.lua around the broker's ``dispatch`` source, as a local function of (KEYS, ARGV)."""
    return source("send", given={"dispatch": dispatch})
