"""What a caller waiting on a result learns when a conflict ends a
message without running it.

Dramatiq's ``Results`` stores ``None`` for any skipped message that is
not failed, and an exception only when it is dead-lettered.  A message
that this package drops, dead-letters or supersedes must instead give
its caller a ``ResultFailure`` naming why, and a copy that is skipped
while another copy runs must store nothing at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dramatiq.logging import get_logger

from ..compat import result_options

if TYPE_CHECKING:
    from dramatiq import Broker

logger = get_logger(__name__)


def store_nothing(message: Any) -> None:
    """Keep ``Results`` from storing ``None`` for a skipped copy, which
    would overwrite or pre-empt the result of the copy that runs.
    """
    message.options["store_results"] = False


def store_failure(broker: "Broker", message: Any, error: Exception) -> None:
    """Store ``error`` as the result of ``message`` in every ``Results``
    middleware of ``broker`` whose actor stores results, then keep
    Dramatiq from storing anything else for this delivery.
    """
    from dramatiq.results import Results

    for middleware in broker.middleware:
        if not isinstance(middleware, Results):
            continue
        stores, ttl = result_options(middleware, broker, message)
        if stores:
            try:
                middleware.backend.store_exception(message, error, ttl)
            except Exception as e:  # the result store is not ours to fail the delivery over
                logger.warning("Could not store why %s did not run: %r", message, e)
    store_nothing(message)
