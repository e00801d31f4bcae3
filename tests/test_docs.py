"""The documentation builds with warnings as errors, its examples run,
and its reference tables say what the code does.

Every fenced ``python`` block of a page runs, in page order, in one
fresh Python process per page (later blocks use what earlier ones
defined, as a reader would).  A block whose first line is
``# no-run: <reason>`` is shown but not run; keep those rare.

Fenced ``console`` blocks run too, in the same order: each
``$ dramatiq-unique ...`` line runs the command against ``REDIS_URL``
and must exit 0, and the first line of output shown under it must be
the first line the command prints (``export`` lines are skipped).

A python block whose first line is ``# file: NAME.py`` is written to
that file instead of run; when a page wrote ``test_*.py`` files, pytest
runs them at the end, and every test in them must pass.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterator

import pytest

from dramatiq_unique import EVENTS, LOCK_TYPES, STRATEGIES, UniqueMiddleware
from dramatiq_unique.settings import Settings
from dramatiq_unique.model.spec import ACTOR_OPTIONS
from tests.cluster import Servers, start_cluster, start_sentinel

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
NO_RUN = "# no-run:"

#: A fenced python or console block, possibly indented (inside a
#: definition list).
_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<kind>python|console)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S
)

#: Runs the blocks it reads as JSON from stdin, in order.  Python blocks
#: share one namespace; each is compiled under its page's name and
#: padded to its line, so a traceback points at the page and line of
#: the failing example.  pytest runs as a subprocess.
_RUNNER = """
import contextlib, importlib.metadata, io, json, os, subprocess, sys

FILE = "# file: "

def run_command(block, argv, expected):
    # In this process, through the console script's own entry point: a
    # process per command would cost a second each.
    from dramatiq_unique.ops.cli import main

    out = io.StringIO()
    os.environ["dramatiq_unique_url"] = os.environ["REDIS_URL"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            status = main(argv)
    finally:
        del os.environ["dramatiq_unique_url"]
    where = f"{block['page']}:{block['line']}: dramatiq-unique {' '.join(argv)}"
    if status != 0:
        sys.exit(f"{where} exited with {status}:\\n{out.getvalue()}")
    printed = (out.getvalue().splitlines() or [""])[0].split()
    if expected is not None and printed != expected.split():
        sys.exit(f"{where} printed {' '.join(printed)!r} first, the page shows {expected!r}")

def run_tests(page, files):
    installed = any(e.value == "dramatiq_unique.testing" for e in importlib.metadata.entry_points(group="pytest11"))
    plugin = [] if installed else ["-p", "dramatiq_unique.testing"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, *files],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    if done.returncode != 0:
        sys.exit(f"the tests of {page} failed:\\n{done.stdout[-3000:]}{done.stderr[-1000:]}")

namespace = {"__name__": "__main__"}
tests = []
for block in json.load(sys.stdin):
    if block["kind"] == "python" and block["code"].startswith(FILE):
        name = block["code"].split("\\n", 1)[0][len(FILE):].strip()
        with open(name, "w") as out:
            out.write(block["code"])
        tests += [name] if os.path.basename(name).startswith("test_") else []
    elif block["kind"] == "python":
        exec(compile("\\n" * (block["line"] - 1) + block["code"], block["page"], "exec"), namespace)
    else:
        for argv, expected in block["commands"]:
            run_command(block, argv, expected)
if tests:
    run_tests(block["page"], tests)
"""


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    code: str
    kind: str = "python"

    @property
    def runs(self) -> bool:
        return not self.code.lstrip().startswith(NO_RUN)

    def commands(self) -> list[list[Any]]:
        """A console block's ``dramatiq-unique`` commands, as
        ``[argv, first output line shown or None]``.
        """
        found: list[list[Any]] = []
        for line in self.code.splitlines():
            if line.startswith("$ "):
                found.append([shlex.split(line[2:]), None])
            elif found and found[-1][1] is None and line.strip():
                found[-1][1] = line
        commands = [[argv[1:], shown] for argv, shown in found if argv[0] != "export"]
        assert all(argv[0] == "dramatiq-unique" for argv, _ in found if argv[0] != "export"), (
            f"{self.page}:{self.line}: a console block runs only dramatiq-unique commands"
        )
        return commands

    def payload(self) -> dict[str, object]:
        if self.kind == "console":
            return {"kind": "console", "page": self.page, "line": self.line, "commands": self.commands()}
        return {"kind": "python", "page": self.page, "line": self.line, "code": self.code}


def pages() -> list[Path]:
    return sorted(path for path in DOCS.rglob("*.md") if "_build" not in path.parts)


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in _FENCE.finditer(text):
        indent = len(match["indent"])
        lines = [line[indent:] for line in match["body"].splitlines()]
        line = text.count("\n", 0, match.start("body")) + 1
        found.append(Block(str(page.relative_to(ROOT)), line, "\n".join(lines) + "\n", match["kind"]))
    return found


def table(text: str, heading: str) -> list[str]:
    """The rows of the first Markdown table whose header row starts with
    ``| heading |``, as stripped lines.
    """
    lines = [line.strip() for line in text.splitlines()]
    start = next((i for i, line in enumerate(lines) if line.startswith(f"| {heading} |")), None)
    assert start is not None, f"no table with a {heading!r} column"
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def documented_names(rows: list[str]) -> set[str]:
    """The `code` names in the first column of table rows."""
    return {match for row in rows[2:] for match in re.findall(r"^\|\s*`([^`]+)`", row)}


# The build -------------------------------------------------------------------


def test_the_docs_build_with_warnings_as_errors(tmp_path: Path) -> None:
    if importlib.util.find_spec("sphinx") is None or importlib.util.find_spec("myst_parser") is None:
        pytest.fail("Sphinx and myst-parser are needed to build the docs: run `pip install -e '.[test]'`.")
    html = tmp_path / "html"
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
               "-d", str(tmp_path / "doctrees"), str(DOCS), str(html)]
    build = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, f"sphinx-build failed:\n{build.stdout}\n{build.stderr}"
    built = {path.relative_to(html).with_suffix("").as_posix() for path in html.rglob("*.html")}
    assert {page.relative_to(DOCS).with_suffix("").as_posix() for page in pages()} <= built
    # Nothing the pages load comes from the network.
    for page in html.rglob("*.html"):
        loads = re.findall(r'<(?:script|link)[^>]+(?:src|href)="(https?:[^"]+)"', page.read_text())
        assert loads == [], f"{page.name} loads {loads}"


# The examples ----------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster_and_sentinel() -> Iterator[dict[str, str]]:
    """A throw-away Redis Cluster and Sentinel, named the way the
    Cluster page's examples read them.
    """
    servers = Servers()
    try:
        ports = start_cluster(servers)
        sentinel = start_sentinel(servers, "locks")
        yield {
            "REDIS_CLUSTER_URL": f"redis+cluster://127.0.0.1:{ports[0]}",
            "REDIS_SENTINEL": f"127.0.0.1:{sentinel}",
            "REDIS_SENTINEL_SERVICE": "locks",
        }
    finally:
        servers.stop()


def services(page: str, request: pytest.FixtureRequest) -> dict[str, str]:
    """Environment variables naming the servers a page's examples use
    besides ``REDIS_URL``.
    """
    return request.getfixturevalue("cluster_and_sentinel") if page == "redis-cluster.md" else {}


def pages_with_examples() -> list[str]:
    return [page.relative_to(DOCS).as_posix() for page in pages() if any(block.runs for block in blocks(page))]


@pytest.mark.parametrize("page", pages_with_examples())
def test_the_examples_run(
    page: str, redis_url: str, redis_client: object, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    runnable = [block for block in blocks(DOCS / page) if block.runs]
    env = {name: value for name, value in os.environ.items() if not name.lower().startswith("dramatiq_unique_")}
    env.update(PYTHONPATH=str(ROOT), REDIS_URL=redis_url, PYTHONUNBUFFERED="1", **services(page, request))
    payload = json.dumps([block.payload() for block in runnable])
    run = subprocess.run([sys.executable, "-c", _RUNNER], input=payload, capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=90)
    assert run.returncode == 0, f"an example of {page} failed:\n{run.stderr[-4000:]}"


def test_few_examples_are_left_unrun() -> None:
    every = [block for page in pages() for block in blocks(page)]
    idle = [f"{block.page}:{block.line}" for block in every if not block.runs]
    assert len(every) >= 30
    assert len(idle) <= len(every) // 10, f"too many examples are not run: {idle}"
    for block in every:
        if not block.runs:
            reason = block.code.lstrip()[len(NO_RUN):].splitlines()[0].strip()
            assert reason, f"{block.page}:{block.line} says no-run without a reason"


# The reference tables --------------------------------------------------------


def test_the_lock_table_names_every_lock_type() -> None:
    rows = table((DOCS / "lock-types.md").read_text(), "lock")
    assert [re.findall(r"`([^`]+)`", row)[0] for row in rows[2:]] == list(LOCK_TYPES)


def test_every_strategy_is_documented_on_its_side() -> None:
    text = (DOCS / "conflict-strategies.md").read_text()
    client, _, server = text.partition("## Server side")
    for side, section in (("client", client), ("server", server)):
        headings = re.findall(r"^### `([a-z]+)`$", section.partition("## One strategy per side")[0], re.M)
        assert headings == list(STRATEGIES[side]), f"the {side} side documents {headings}"


def test_the_environment_table_is_the_readme_table() -> None:
    readme = table((ROOT / "README.md").read_text(), "variable")
    docs = table((DOCS / "configuration.md").read_text(), "variable")
    assert docs == readme


def test_every_setting_option_and_argument_is_documented() -> None:
    text = (DOCS / "configuration.md").read_text()
    assert set(inspect.signature(UniqueMiddleware).parameters) <= documented_names(table(text, "argument"))
    assert set(ACTOR_OPTIONS) <= documented_names(table(text, "option"))
    variables = documented_names(table(text, "variable"))
    assert {f"dramatiq_unique_{field.name}" for field in fields(Settings)} <= variables


def test_the_migration_table_covers_every_actor_option() -> None:
    rows = table((DOCS / "migration.md").read_text(), "sidekiq-unique-jobs")
    ours = {name for row in rows[2:] for name in re.findall(r"`([A-Za-z_]+)", row.split("|")[2])}
    assert set(ACTOR_OPTIONS) <= ours


def test_every_event_metric_log_line_and_command_is_documented() -> None:
    from dramatiq_unique.ops.cli import parser
    from dramatiq_unique.events import LOG_LINES
    from dramatiq_unique.ops.prometheus import METRICS

    text = (DOCS / "operations.md").read_text()
    assert [name for name in EVENTS if f"| `{name}` |" not in text] == []
    cells = [row.split("|") for row in table(text, "level")[2:]]
    documented = {(cell[1].strip(), cell[2].strip().strip("`")) for cell in cells}
    assert {(line.level, line.template) for line in LOG_LINES} == documented
    for name, kind, _, _ in METRICS:
        assert f"`{name}_total`" in text if kind == "counter" else f"`{name}`" in text
    commands = [name for action in parser()._actions if action.dest == "command" for name in action.choices or ()]
    assert "locks" in commands
    assert [name for name in commands if f"dramatiq-unique {name}" not in text and name != "demo"] == []


def test_the_api_reference_names_every_public_name() -> None:
    import dramatiq_unique

    text = (DOCS / "api.md").read_text()
    public = [f"dramatiq_unique.{name}" for name in dramatiq_unique.__all__ if name not in ("LOCK_TYPES", "STRATEGIES")]
    public += [f"dramatiq_unique.testing.{name}" for name in ("disabled", "assert_duplicate", "wait_for_releases")]
    assert [name for name in public if name not in text] == []
    assert "`dramatiq_unique.LOCK_TYPES`" in text and "`dramatiq_unique.STRATEGIES`" in text


def test_the_cluster_page_names_the_keys_of_a_digest_that_exist(redis_client: Any) -> None:
    """Every key of one digest, made by the verbs that make them, is one
    the Redis Cluster page names, and it names no other.
    """
    from dramatiq_unique.backends.records import Copy
    from dramatiq_unique.backends.redis import RedisBackend

    backend, minute = RedisBackend(client=redis_client), 60_000
    stem = "dramatiq-unique:sync_account_balance:{" + "3f0c" * 8 + "}"
    queue, run = f"{stem}:queue", f"{stem}:run"
    assert backend.acquire(queue, "m1", ttl=minute, lock="until_and_while_executing").acquired
    backend.replace(queue, "m2", ttl=minute, superseded_ttl=minute)  # newest wins: m1 is superseded
    assert backend.start(run, "m2/t", ttl=minute, limit=1, lock="until_and_while_executing",
                         copy=Copy(run, "m2")).acquisition.acquired
    backend.join_line(Copy(run, "m3"), b"the encoded message", order=1, ttl=minute)  # m3 is rescheduled
    made = {key.decode()[len(stem):].replace(":m3", ":<message id>") for key in redis_client.keys("*")}
    text = " ".join((DOCS / "redis-cluster.md").read_text().split())
    bullet = text[text.index("all keys of one digest"):text.index("live in the same slot")]
    assert set(re.findall(r"`…(:[^`]+)`", bullet)) == made


def test_the_options_every_command_takes_are_theirs() -> None:
    """"Every subcommand takes X, and every one but C takes Y": each
    option is an option of exactly the commands the page says.
    """
    from dramatiq_unique.ops.cli import parser

    commands = next(action.choices for action in parser()._actions if action.dest == "command")
    options = {name: {o for a in command._actions for o in a.option_strings} for name, command in commands.items()}
    text = " ".join((DOCS / "operations.md").read_text().split())
    sentence = re.search(r"Every subcommand takes (.*?);", text)
    assert sentence is not None
    every, _, rest = sentence[1].partition("every one but ")
    but = set(re.findall(r"`([a-z]+)`", rest.partition(",")[0]))
    for option in re.findall(r"`(--[a-z-]+)", every):
        assert [name for name, taken in options.items() if option not in taken] == [], option
    for option in re.findall(r"`(--[a-z-]+)", rest):
        assert {name for name, taken in options.items() if option not in taken} == but, option


# What a first-day user reads -----------------------------------------------------


#: What a page may import without an extra: the reader's own test
#: runner, on the testing page.
ASSUMED = {"pytest"}

#: The install that a page without one of its own relies on: the
#: first one the index shows.
DEFAULT_EXTRAS = {"redis"}


def extras_told(text: str) -> set[str]:
    """The extras of dramatiq-unique that a page tells its reader to
    install: in its ``pip install`` commands (the index's, when it has
    none) and its "the `X` extra".
    """
    installs = re.findall(r"pip install [^\n]*?\[([\w,\s]+)\]", text)
    told = {extra.strip() for found in installs for extra in found.split(",")} or DEFAULT_EXTRAS
    return told | set(re.findall(r"`(\w+)`\s+extra\b", text))


def installed_by(extras: set[str]) -> set[str]:
    """The distributions ``pip install 'dramatiq-unique[EXTRAS]'``
    installs, requirements of requirements included.
    """
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: set[str] = set()
    todo = [("dramatiq-unique", set(extras))]
    while todo:
        name, wanted = todo.pop()
        found.add(canonicalize_name(name))
        try:
            lines = requires(name) or []
        except PackageNotFoundError:
            continue
        for line in lines:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in wanted | {""}):
                if canonicalize_name(req.name) not in found:
                    todo.append((req.name, set(req.extras)))
    return found


def _module_imports(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """The modules a module always imports when it is imported: at its
    top level, outside ``if`` (``TYPE_CHECKING``, or only under gevent)
    and ``try`` (an optional import).  ``from X import name`` counts
    ``X.name`` too, which may be a module.
    """
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = module if is_package else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            source = ".".join(filter(None, [base if node.level else "", node.module or ""]))
            found |= {source} | {f"{source}.{alias.name}" for alias in node.names}
    return found


def third_party_imports(code: str) -> set[str]:
    """The top-level names of the third-party modules that running
    ``code`` imports, following the imports of dramatiq and
    dramatiq-unique modules (which need no extra themselves).
    """
    ours = ("dramatiq", "dramatiq_unique")
    found: set[str] = set()
    seen: set[str] = set()
    todo = sorted(_module_imports(ast.parse(code), "__main__", False))
    while todo:
        module = todo.pop()
        top = module.partition(".")[0]
        if module in seen or top in sys.stdlib_module_names or top == "__future__":
            continue
        seen.add(module)
        if top not in ours:
            found.add(top)
            continue
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:  # a name in a module that is no package
            spec = None
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            tree = ast.parse(Path(spec.origin).read_text())
            todo += _module_imports(tree, module, spec.submodule_search_locations is not None)
        elif spec is None and "." in module:  # a name in a module: where it is defined
            parent, _, name = module.rpartition(".")
            defined = getattr(importlib.import_module(parent), name, None)
            todo += [getattr(defined, "__module__", None) or parent]
    return found


def test_every_example_imports_only_what_its_page_says_to_install() -> None:
    # A reader installs what the page says (the postgres page's
    # example once needed pika, which the postgres extra does not bring).
    from importlib.metadata import packages_distributions

    from packaging.utils import canonicalize_name

    distributions = packages_distributions()
    missing = []
    for page in pages():
        text = page.read_text()
        written = set(re.findall(r"^# file: (\w+)\.py", text, re.M))
        installed = installed_by(extras_told(text))
        for block in blocks(page):
            if block.kind != "python":
                continue
            for module in sorted(third_party_imports(block.code) - written - ASSUMED):
                if not {canonicalize_name(d) for d in distributions.get(module, [])} & installed:
                    missing.append(f"{block.page}:{block.line} imports {module}, not in {sorted(extras_told(text))}")
    assert not missing, "\n".join(missing)



def test_installs_are_from_the_checkout_until_the_package_is_published() -> None:
    # dramatiq-unique is not on PyPI: a line that installs it by name is
    # marked as for later, beside the install from the checkout.
    for path in [ROOT / "README.md", DOCS / "index.md"]:
        lines = path.read_text().splitlines()
        by_name = [line for line in lines if re.search(r"pip install .*'dramatiq-unique\[", line)]
        assert by_name and all("once published" in line for line in by_name), f"{path.name}: {by_name}"
        assert any(line.startswith("pip install -e '.[redis]'") for line in lines), path.name


def test_the_readme_names_the_variables_the_suite_reads() -> None:
    readme = (ROOT / "README.md").read_text()
    testing = readme[readme.index("Run the tests"):readme.index("`bash .ci/run`")]
    assert "`REDIS_URL`" in testing and "`RABBITMQ_URL`" in testing
