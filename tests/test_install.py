"""What installing dramatiq-unique does to an environment.

The pytest plugin it registers is loaded by every pytest run there: it
must import nothing heavy, and a broken Dramatiq or a missing redis
must not break a run.  Without the ``redis`` extra, the command says
which extra to install.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, path: list[Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in [*path, ROOT])}
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    return subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_loading_the_plugin_imports_neither_dramatiq_nor_redis(tmp_path):
    code = ("import sys, dramatiq_unique.testing; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('dramatiq', 'redis', 'prometheus_client')))")
    done = run("-c", code, path=[], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def shadowed(tmp_path: Path, *names: str) -> Path:
    """A directory whose packages ``names`` fail to import, like missing ones."""
    shadow = tmp_path / "shadow"
    for name in names:
        (shadow / name).mkdir(parents=True)
        (shadow / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name='{name}')\n"
        )
    return shadow


#: What a Redis URL says without the redis extra.
NEEDS_REDIS = (
    "a lock backend at redis://, rediss://, unix:// or redis+cluster:// URLs needs redis-py: "
    "pip install 'dramatiq-unique[redis]'"
)

#: What a PostgreSQL URL says without the postgres extra.
NEEDS_PSYCOPG = (
    "a lock backend at postgresql:// or postgres:// URLs needs psycopg: pip install 'dramatiq-unique[postgres]'"
)


def test_without_the_redis_extra_the_command_names_it(tmp_path):
    done = run("-m", "dramatiq_unique", "locks", "--redis", "redis://127.0.0.1:1/0", path=[shadowed(tmp_path, "redis")],
               cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip() == f"dramatiq-unique: {NEEDS_REDIS}"


def test_without_the_redis_extra_a_redis_url_names_it(tmp_path):
    code = "from dramatiq_unique import UniqueMiddleware; UniqueMiddleware(redis_url='redis://127.0.0.1:1/0')"
    done = run("-c", code, path=[shadowed(tmp_path, "redis")], cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == f"dramatiq_unique.errors.ConfigurationError: {NEEDS_REDIS}"


@pytest.mark.parametrize("how", ["url=", "dramatiq_unique_url", "--url"])
def test_without_the_postgres_extra_a_postgres_url_names_it(tmp_path, how):
    # Given an environment where psycopg cannot be imported
    shadow = shadowed(tmp_path, "psycopg", "psycopg_pool")
    url = "postgresql://postgres@127.0.0.1:1/locks"
    # When a PostgreSQL URL is given as an argument, in the environment, or to the command
    if how == "--url":
        done = run("-m", "dramatiq_unique", "locks", "--url", url, path=[shadow], cwd=tmp_path)
        # Then it says which extra to install, in one line
        assert (done.returncode, done.stderr.strip()) == (1, f"dramatiq-unique: {NEEDS_PSYCOPG}")
        return
    given = f"url={url!r}" if how == "url=" else ""
    code = f"import os; os.environ['dramatiq_unique_url'] = {url!r} if {how == 'dramatiq_unique_url'} else ''\n" \
           f"from dramatiq_unique import UniqueMiddleware; UniqueMiddleware({given})"
    done = run("-c", code, path=[shadow], cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == f"dramatiq_unique.errors.ConfigurationError: {NEEDS_PSYCOPG}"


def test_a_broken_dramatiq_does_not_break_an_unrelated_pytest_run(tmp_path):
    every = importlib.metadata.entry_points()
    plugins = every.select(group="pytest11") if hasattr(every, "select") else every.get("pytest11", [])  # 3.9
    if not [e for e in plugins if e.value == "dramatiq_unique.testing"]:
        pytest.fail("The pytest plugin is not installed: run `pip install -e .` in the repository.")
    # Given an environment whose dramatiq and redis cannot be imported
    shadow = shadowed(tmp_path, "dramatiq", "redis")
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_unrelated.py").write_text("def test_it():\n    assert 1 + 1 == 2\n")
    # When pytest runs an unrelated test there, with the plugin loaded
    done = run("-m", "pytest", "-p", "no:cacheprovider", "-q", "test_unrelated.py", path=[shadow], cwd=project)
    # Then the run passes
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout
    listed = run("-m", "pytest", "-p", "no:cacheprovider", "--fixtures", "test_unrelated.py", path=[shadow],
                 cwd=project)
    assert "unique_stub_backend" in listed.stdout
