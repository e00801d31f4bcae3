"""Environment variables: both spellings, constructor wins, clear errors."""

from __future__ import annotations

import pytest

from dramatiq_unique import DEFAULT_LEASE, ConfigurationError, StubBackend, UniqueMiddleware
from dramatiq_unique.settings import from_environment


def test_defaults():
    settings = from_environment({})
    assert settings.lease == DEFAULT_LEASE and settings.enabled and settings.redis_url is None


@pytest.mark.parametrize("name", ["dramatiq_unique_lease", "DRAMATIQ_UNIQUE_LEASE"])
def test_both_spellings_are_read(name):
    assert from_environment({name: "3000"}).lease == 3000


def test_every_variable_is_read():
    settings = from_environment(
        {
            "dramatiq_unique_redis_url": "redis://example:1/2",
            "dramatiq_unique_prefix": "p",
            "dramatiq_unique_lock_ttl": "1000",
            "dramatiq_unique_lease": "2000",
            "dramatiq_unique_reschedule_delay": "0",
            "dramatiq_unique_enabled": "false",
            "dramatiq_unique_on_backend_error": "run_unlocked",
            "dramatiq_unique_record_lock_args": "yes",
            "dramatiq_unique_dashboard_password": " pass word ",
        }
    )
    expected = ("redis://example:1/2", "p", 1000, 2000)
    assert (settings.redis_url, settings.prefix, settings.lock_ttl, settings.lease) == expected
    assert (settings.reschedule_delay, settings.enabled, settings.on_backend_error) == (0, False, "run_unlocked")
    assert settings.record_lock_args is True
    assert settings.dashboard_password == "pass word"  # stripped, as every value


def test_a_dotted_path_middleware_records_lock_args_from_the_environment(monkeypatch):
    # django_dramatiq builds middleware from a dotted path, with no arguments.
    import importlib

    monkeypatch.setenv("DRAMATIQ_UNIQUE_RECORD_LOCK_ARGS", "1")
    module, _, name = "dramatiq_unique.UniqueMiddleware".rpartition(".")
    middleware = getattr(importlib.import_module(module), name)()
    assert middleware.record_lock_args is True
    assert UniqueMiddleware(record_lock_args=False).record_lock_args is False


def test_every_setting_is_in_the_readme_table():
    from dataclasses import fields
    from pathlib import Path

    from dramatiq_unique.settings import Settings

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    missing = [f.name for f in fields(Settings) if f"| `dramatiq_unique_{f.name}` |" not in readme]
    assert missing == []


@pytest.mark.parametrize(
    "name, value, says",
    [
        ("dramatiq_unique_lease", "60s",
         "dramatiq_unique_lease='60s' is invalid: expected a whole number of milliseconds"),
        ("DRAMATIQ_UNIQUE_LOCK_TTL", "-5", "DRAMATIQ_UNIQUE_LOCK_TTL=-5 is invalid"),
        ("dramatiq_unique_enabled", "maybe", "dramatiq_unique_enabled='maybe' is invalid: expected 1/0 or true/false"),
        ("dramatiq_unique_on_backend_error", "ignore", "expected one of fail, run_unlocked"),
        ("dramatiq_unique_reschedule_delay", "1.5", "dramatiq_unique_reschedule_delay='1.5'"),
        ("dramatiq_unique_record_lock_args", "sometimes", "dramatiq_unique_record_lock_args='sometimes' is invalid"),
    ],
)
def test_a_bad_value_names_the_variable(monkeypatch, name, value, says):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigurationError) as info:
        UniqueMiddleware()
    assert says in str(info.value)


def test_constructor_arguments_win(monkeypatch):
    monkeypatch.setenv("dramatiq_unique_lease", "3000")
    monkeypatch.setenv("dramatiq_unique_enabled", "0")
    middleware = UniqueMiddleware(lease=9000, enabled=True)
    assert middleware.settings.lease == 9000 and middleware.enabled


def test_the_environment_is_read_at_construction(monkeypatch):
    monkeypatch.setenv("dramatiq_unique_prefix", "from-env")
    assert UniqueMiddleware().settings.prefix == "from-env"


@pytest.mark.parametrize("kwargs", [{"lease": 0}, {"lock_ttl": "1"}, {"prefix": "a{b}"}, {"on_backend_error": "x"}])
def test_bad_constructor_arguments(kwargs):
    with pytest.raises(ConfigurationError):
        UniqueMiddleware(**kwargs)


@pytest.mark.parametrize("name", ["dramatiq_unique_leese", "DRAMATIQ_UNIQUE_REDIS"])
def test_a_misspelt_variable_is_refused_not_ignored(monkeypatch, name):
    monkeypatch.setenv(name, "1000")
    with pytest.raises(ConfigurationError, match=f"{name} is not a dramatiq-unique setting. Valid names: "):
        UniqueMiddleware()


def test_the_middlewares_switches_read_and_write_its_lock_context_and_show_on_the_class():
    # Given a middleware, whose enabled and record_lock_args live on the context its guards read
    unique = UniqueMiddleware(backend=StubBackend())
    # When they are switched on the middleware
    unique.enabled, unique.record_lock_args = False, True
    # Then the guards see it at once, and the class still lists both (help(), autodoc, inspect)
    assert (unique.service.enabled, unique.service.record_lock_args) == (False, True)
    assert (unique.enabled, unique.record_lock_args) == (False, True)
    assert all(hasattr(UniqueMiddleware, name) for name in ("enabled", "record_lock_args"))
