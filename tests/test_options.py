"""Every invalid actor option fails at declaration, naming the choices,
and leaves no actor behind.
"""

from __future__ import annotations

import dramatiq
import pytest
from dramatiq.middleware import MiddlewareError

from dramatiq_unique import ConfigurationError, UniqueMiddleware


@pytest.fixture
def broker(stub_broker):
    stub_broker.add_middleware(UniqueMiddleware())
    return stub_broker


def declare(broker, **options):
    def sync(account_id, requested_at=None):
        pass

    return dramatiq.actor(sync, broker=broker, actor_name="sync", **options)


@pytest.mark.parametrize(
    "options, says",
    [
        ({"lock": "while_executin"}, "Valid choices: until_executing, until_executed"),
        ({"lock": 3}, "is not a lock type"),
        ({"lock": "while_executing", "on_conflict": "nope"}, "Valid server choices: reschedule, log, raise, reject"),
        ({"lock": "until_executing", "on_conflict": "reschedule"}, "Valid client choices: log, raise"),
        ({"lock": "until_executed", "on_conflict": {"server": "log"}}, "does not apply to lock='until_executed'"),
        ({"lock": "until_and_while_executing", "on_conflict": "reschedule"}, "{'client': ..., 'server': ...}"),
        ({"lock": "while_executing", "on_conflict": ["log"]}, "expected a strategy name"),
        ({"lock": "while_executing", "lock_args": ["acount_id"]}, "Valid choices: account_id, requested_at"),
        ({"lock": "while_executing", "lock_args": "account_id"}, "expected a list of parameter names"),
        ({"lock": "while_executing", "lock_args_method": 5}, "expected a callable"),
        ({"lock": "while_executing", "lock_args": ["account_id"], "lock_args_method": str}, "not both"),
        ({"lock": "until_executed", "lock_ttl": 0}, "positive whole number of milliseconds"),
        ({"lock": "until_executed", "lock_ttl": 1.5}, "positive whole number of milliseconds"),
        ({"lock": "until_executed", "lock_ttl": True}, "positive whole number of milliseconds"),
        ({"lock": "while_executing", "lock_limit": 0}, "a whole number, 1 or more"),
        ({"lock": "while_executing", "unique_across_queues": "yes"}, "True or False"),
        ({"lock": "while_executing", "unique_across_actors": 1}, "True or False"),
        ({"lock": "while_executing", "reschedule_delay": -1}, "0 or more"),
        ({"lock": "until_executed", "reschedule_delay": 10}, "only applies"),
        ({"on_conflict": "raise"}, "but no lock="),
    ],
)
def test_invalid_options_fail_at_declaration(broker, options, says):
    with pytest.raises(ConfigurationError) as info:
        declare(broker, **options)
    assert says in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, MiddlewareError)
    assert "sync" not in broker.actors


def test_a_typo_in_an_option_name_is_rejected_by_dramatiq(broker):
    with pytest.raises(ValueError, match="lok"):
        declare(broker, lok="while_executing")


def test_valid_options_declare(broker):
    actor = declare(broker, lock="until_and_while_executing", on_conflict={"client": "raise", "server": "reject"})
    assert broker.middleware[-1].specs["sync"].server == "reject"
    assert actor.actor_name in broker.actors
