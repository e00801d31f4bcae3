"""The performance harness of dramatiq-unique: ``python -m benchmarks``.

It is not a timed test: it measures every contender side by side on
one Redis, prints the tables and writes ``docs/performance.md``.
"""
