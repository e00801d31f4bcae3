"""Real ``dramatiq`` worker processes for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Optional

ROOT = Path(__file__).resolve().parent.parent


class WorkerGroup:
    """``python -m dramatiq MODULE -p P -t T`` in its own process group.

    Parameters:
      module(str): The broker, e.g. ``tests.apps.seed:broker``.
      env(dict): Extra environment variables for the workers.
    """

    def __init__(self, module: str, *, processes: int = 2, threads: int = 4, env: Optional[Mapping[str, str]] = None,
                 extra: tuple[str, ...] = ()) -> None:
        self.args = [sys.executable, "-m", "dramatiq", module, "-p", str(processes), "-t", str(threads), *extra]
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.process: Optional[subprocess.Popen[bytes]] = None
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"dramatiq-unique-workers-{os.getpid()}-{id(self)}.log"

    def start(self) -> "WorkerGroup":
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(self.args, env=self.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        return self

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_booted(self, processes: int, timeout: float = 30) -> None:
        """Wait until every worker process logged that it booted."""
        deadline = time.monotonic() + timeout
        while self.output().count("is ready for action") < processes:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"workers exited with {self.process.returncode}:\n{self.output()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers did not boot in {timeout} s:\n{self.output()[-3000:]}")
            time.sleep(0.05)

    def stop(self, timeout: float = 30) -> int:
        """Graceful: SIGTERM to the main process, then wait."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9

    def kill(self) -> None:
        """SIGKILL the whole group: no hook runs anywhere."""
        assert self.process is not None
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def __enter__(self) -> "WorkerGroup":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.kill()
