"""The broker module of the benchmark's worker processes:
``dramatiq benchmarks.worker:broker``, configured by ``BENCH_*``
variables (see :func:`benchmarks.app.from_environment`).
"""

from __future__ import annotations

from .app import from_environment

broker, actor = from_environment()
