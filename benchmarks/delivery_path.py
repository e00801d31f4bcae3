"""Which of the package's files and classes one rescheduled delivery
touches: ``python -m benchmarks.delivery_path [--url URL]``.

A real in-process Dramatiq ``Worker`` on a ``StubBroker``, with
``UniqueMiddleware()`` (the stub backend, or the backend ``--url``
names), runs a ``while_executing`` actor with
``on_conflict="reschedule"``: one message is held while a second one is
delivered and rescheduled; then the first ends, the second is handed
the key and runs, and its delayed copy is skipped.  From the first send
to the last release, a profile hook on every thread records each frame
of the package: its file, its class, and (on Redis) the Lua scripts the
backend calls.  What the worker's boot and shutdown touch is left out.
"""

from __future__ import annotations

import argparse
import ast
import sys
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple, Optional

import dramatiq
from dramatiq import Worker
from dramatiq.brokers.stub import StubBroker

import dramatiq_unique
from dramatiq_unique import UniqueMiddleware
from dramatiq_unique.backends import from_url
from dramatiq_unique.testing import wait_for_releases

PACKAGE = Path(dramatiq_unique.__file__).resolve().parent
LUA = {path.stem for path in (PACKAGE / "backends" / "redis" / "lua").glob("*.lua")}

#: How long a rescheduled copy waits, in milliseconds: short, so the run ends soon.
RESCHEDULE_DELAY = 200

#: The longest the scenario waits for a step, in seconds.
PATIENCE = 10.0


class Touched(NamedTuple):
    """What one delivery touched."""

    files: list[str]  # in the order each first ran
    scripts: list[str]
    classes: list[str]


class Recorder:
    """A profile hook that keeps the package's frames."""

    def __init__(self) -> None:
        self.files: dict[str, None] = {}  # in the order they first ran
        self.classes: set[str] = set()
        self.scripts: set[str] = set()
        self.on = False

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or not self.on:
            return
        code = frame.f_code
        filename = code.co_filename
        if not filename.startswith(str(PACKAGE)):
            return
        relative = str(Path(filename).relative_to(PACKAGE))
        if relative == "testing.py":  # the scenario's own wait for the releases
            return
        self.files.setdefault(relative, None)
        owner = _class_of(code.co_qualname)
        if owner is not None:
            self.classes.add(f"{relative}:{owner}")
        if relative == "backends/redis/calls.py":
            self.scripts.update(f"{name}.lua" for name in _scripts(frame.f_locals))


def _scripts(arguments: dict[str, Any]) -> list[str]:
    """The scripts a call of the Redis backend's transport names: one
    by ``name``, or a batch of ``(name, keys, args)``.
    """
    name, batch = arguments.get("name"), arguments.get("calls")
    names = [name] if isinstance(name, str) else []
    if isinstance(batch, list):
        names += [call[0] for call in batch if isinstance(call, tuple) and call and isinstance(call[0], str)]
    return [name for name in names if name in LUA]


def _class_of(qualname: str) -> Optional[str]:
    """The class a function's qualified name puts it in, if any."""
    parts = [part for part in qualname.split(".")[:-1] if part != "<locals>"]
    return parts[-1] if parts and not parts[-1].islower() else None


def _wait(condition: Any, what: str) -> None:
    deadline = time.monotonic() + PATIENCE
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {PATIENCE} s for {what}")
        time.sleep(0.005)


def measure(url: Optional[str] = None) -> Touched:
    """Run the scenario once and return what it touched."""
    broker = StubBroker()
    broker.emit_after("process_boot")
    backend = from_url(url) if url else None
    middleware = UniqueMiddleware(backend=backend, reschedule_delay=RESCHEDULE_DELAY, prefix=f"path-{time.time_ns()}")
    broker.add_middleware(middleware)
    release = threading.Event()
    runs: list[int] = []

    @dramatiq.actor(broker=broker, lock="while_executing", on_conflict="reschedule", max_retries=0)
    def sync(account: int) -> None:
        runs.append(account)
        if len(runs) == 1:  # the first run holds the key until told
            release.wait(PATIENCE)

    recorder = Recorder()
    threading.setprofile(recorder)  # for the worker's threads, started next
    sys.setprofile(recorder)
    worker = Worker(broker, worker_timeout=50, worker_threads=2)
    worker.start()
    try:
        recorder.on = True
        sync.send(42)
        _wait(lambda: len(runs) == 1, "the first message to run")
        sync.send(42)
        _wait(lambda: middleware.events.count("rescheduled") >= 1, "the second message's reschedule")
        release.set()
        _wait(lambda: len(runs) == 2, "the second message to run")
        broker.join(sync.queue_name, fail_fast=False, timeout=int(PATIENCE * 1000))
        worker.join()
        wait_for_releases(middleware)
        recorder.on = False
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        worker.stop()
        broker.close()
    return Touched(list(recorder.files), sorted(recorder.scripts), sorted(recorder.classes))


def largest_classes(top: int = 8) -> tuple[int, list[tuple[int, str]]]:
    """How many classes the package defines, and its ``top`` largest by
    their methods (each ``def`` directly in the class body).
    """
    sizes = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                sizes.append((len(methods), f"{path.relative_to(PACKAGE)}:{node.name}"))
    return len(sizes), sorted(sizes, key=lambda size: (-size[0], size[1]))[:top]


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="the lock backend's URL (default: the stub backend)")
    args = parser.parse_args(argv)
    path = measure(args.url)
    print(f"files ({len(path.files)}), in the order each first ran:")
    for name in path.files:
        print(f"  {name}")
    print(f"Lua scripts ({len(path.scripts)}):" + ("" if path.scripts else " none"))
    for name in path.scripts:
        print(f"  {name}")
    print(f"classes ({len(path.classes)}):")
    for name in path.classes:
        print(f"  {name}")
    count, largest = largest_classes()
    print(f"the package's classes: {count}; the largest, by methods:")
    for methods, name in largest:
        print(f"  {methods:3d}  {name}")


if __name__ == "__main__":
    main()
