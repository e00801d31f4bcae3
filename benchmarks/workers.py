"""One real ``dramatiq`` worker process (``-p 1 -t 8``) per run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Optional

from .server import BenchmarkError

ROOT = Path(__file__).resolve().parent.parent

#: Worker threads of the one worker process, as the issue prescribes.
THREADS = 8


def clean_environment() -> dict[str, str]:
    """This environment without any ``dramatiq_*`` setting, so every
    contender runs with Dramatiq's and dramatiq-unique's defaults.
    """
    return {name: value for name, value in os.environ.items() if not name.lower().startswith("dramatiq_")}


class WorkerProcess:
    """``python -m dramatiq benchmarks.worker:broker -p 1 -t 8`` in its
    own process group, configured by ``BENCH_*`` variables.
    """

    def __init__(self, settings: Mapping[str, str]) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="dramatiq-unique-bench-worker-"))
        self.report = self.workdir / "report.json"
        self.progress = self.workdir / "report.json.progress"
        self.acked = self.workdir / "report.json.acked"
        self.log = self.workdir / "worker.log"
        self.env = {**clean_environment(), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
                    "BENCH_REPORT": str(self.report), **settings}
        self.process: Optional[subprocess.Popen[bytes]] = None

    def start(self) -> "WorkerProcess":
        args = [sys.executable, "-m", "dramatiq", "benchmarks.worker:broker", "-p", "1", "-t", str(THREADS)]
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(args, env=self.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        return self

    def wait_for(self, path: Path, timeout: float, what: str) -> None:
        """Poll for ``path``; fail with the worker's log tail."""
        deadline = time.monotonic() + timeout
        while not path.exists():
            if self.process is not None and self.process.poll() is not None:
                raise BenchmarkError(f"the worker exited with {self.process.returncode} before {what}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise BenchmarkError(f"timed out after {timeout:.0f} s waiting for {what}:\n{self.tail()}")
            time.sleep(0.01)

    def wait_progress(self, timeout: float) -> None:
        self.wait_for(self.progress, timeout, "every job to run")

    def finish(self, timeout: float) -> dict[str, Any]:
        """Wait until every job was acked, then kill the worker: its
        graceful shutdown would only add seconds of idle polling.
        """
        self.wait_for(self.acked, timeout, "every job to be acked")
        report = dict(json.loads(self.acked.read_text()))
        self.kill()
        return report

    def stop(self, timeout: float = 60) -> dict[str, Any]:
        """Stop gracefully and return the worker's report."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise BenchmarkError(f"the worker did not stop within {timeout:.0f} s:\n{self.tail()}") from None
        if code != 0 or not self.report.exists():
            raise BenchmarkError(f"the worker exited with {code} and no report:\n{self.tail()}")
        return dict(json.loads(self.report.read_text()))

    def kill(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def __enter__(self) -> "WorkerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)
