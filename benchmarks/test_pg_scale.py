"""``python -m benchmarks.pg_scale`` end to end on tiny numbers, so that
it cannot rot: every section prints its figures and writes them, the
fill's rows are the backend's, the sweep deletes what expired, and the
cycles are all done and sampled.

Uses ``DU_TEST_POSTGRES_URL`` when it is set (the run makes and drops
two databases of its own there), else a private PostgreSQL.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import POSTGRES_URL_VARIABLE

from . import pg_scale


def test_the_scale_run_prints_and_writes_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "scale.json"
    url = os.environ.get(POSTGRES_URL_VARIABLE)
    pg_scale.main([*(["--url", url] if url else []), "--locks", "2000", "--cycles", "2000", "--threads", "4",
                   "--pairs", "400", "--output", str(output)])
    printed = capsys.readouterr().out
    for line in ("fill: 2,000 until_executed locks", "full / empty:", "one sweep() deleted",
                 "pairs while a sweep runs", "cycles: 2,000"):
        assert line in printed
    figures = json.loads(output.read_text())
    assert figures["fill"]["rows"] == 2000 and figures["fill"]["total"] > figures["fill"]["table"] > 0
    assert figures["per_job"]["ratio"] > 0 and figures["per_job"]["full"]["pairs"] == 400
    sweep = figures["sweep"]
    assert sweep["deleted"] == sweep["expired"] == 199 and sweep["left_after_triggered_sweeps"] == 0
    assert sweep["during"]["pairs"] > 0 and all(n == 200 for n in sweep["sweeps_during"])
    samples = figures["cycles"]["samples"]
    assert samples[0]["cycles"] == 0 and samples[-1]["cycles"] == 2000 and len(samples) >= 3
    assert samples[-1]["unexpired"] >= 2000
