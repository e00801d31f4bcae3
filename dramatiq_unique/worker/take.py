"""Taking the run lock before the actor runs, in the worker.

A run lock is owned by a token per execution and kept alive as a
lease.  A delivery that meets a held run lock follows the actor's
server strategy (:mod:`.conflict`); a copy that another copy of its
message stands for is skipped.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Optional

from dramatiq import Message
from dramatiq.middleware import AgeLimit, SkipMessage

from ..backends.base import CopyVerdict, Reschedules
from ..background import JITTER, now_ms, pid
from ..compat import age_limit_module
from ..model.spec import ActorSpec
from ..model.wire import UNIQUE_DIGEST, join_owner
from ..send.context import LockContext
from ..send.copies import copy_of, send_order
from .conflict import Conflict, on_conflict, reserve, skip_copy, wait_longer
from .coroutines import watch
from .delivery import Delivery, HandOff, attach, set_fence
from .superseded import skip_if_superseded
from .unlock import Unlocker

if TYPE_CHECKING:
    from dramatiq import Broker
    from dramatiq.broker import MessageProxy


class RunLockTaker:
    """Takes the run lock of each delivery of one middleware.

    Parameters:
      service(LockContext): The middleware's lock context.
      unlocker(Unlocker): Releases the enqueue lock a take frees, and
        owns the worker's threads (the releaser, whose pending releases
        ride in front of a take, and the lease keeper).
      async_actors(set[str]): The async actors with a run lock, whose
        coroutines are tracked.
    """

    def __init__(self, service: LockContext, unlocker: Unlocker, *, async_actors: set[str]) -> None:
        self.service = service
        self.unlocker = unlocker
        self.async_actors = async_actors
        # Owner tokens must differ between executions of one message,
        # even in two processes forked from one parent.
        self._tokens = itertools.count()
        self._token_prefix = f"{JITTER.getrandbits(32):08x}"
        # The stack last seen (held, so that no other list can take its
        # identity), its length, and per actor what _age_limit_of found.
        self._age_limits: tuple[Optional[list[Any]], int, dict[str, tuple[bool, Optional[int]]]] = (None, -1, {})

    def take(self, broker: "Broker", message: "MessageProxy", raw: Message, spec: ActorSpec) -> None:
        """Take what the lock type takes before the actor runs: for
        ``message`` and ``raw``, the message it proxies.
        """
        options = raw.options
        stamped = options.get(UNIQUE_DIGEST)
        digest = stamped or spec.digest(raw.args, raw.kwargs)
        options[UNIQUE_DIGEST] = digest  # so a retry re-enters, even if the sender had no middleware
        # An unstamped message took no enqueue lock (sent while disabled, or without the middleware).
        state = attach(message, Delivery(spec, digest, queue_released=not stamped))
        skip_if_superseded(self.service, broker, message, state)
        if not spec.lock.run_lock:
            if spec.lock.queue_release == "run_start":
                self.unlocker.release_queue_lock(message, state, strict=True)
        elif self._expired(broker, raw):
            # AgeLimit, after us, dead-letters it; only one copy of it may be.
            self._settle(message, state, strict=True)
        else:
            self._take_run_lock(broker, message, raw, state)

    def retire(self, message: "MessageProxy", state: Delivery) -> None:
        """A copy is dead-lettered: make sure no other copy of its
        message runs, and that it leaves no waiter behind.
        """
        if state.spec.lock.run_lock:
            try:
                self._settle(message, state)
            except SkipMessage:
                pass

    def _expired(self, broker: "Broker", message: Any) -> bool:
        """Whether AgeLimit, after us in the stack, will dead-letter
        ``message`` as too old: then it must take no lock, and never be
        rescheduled past its age.
        """
        limited, default = self._age_limit_of(broker, message.actor_name)
        if not limited:
            return False
        max_age = message.options.get("max_age") or default
        # Looked up at call time, like AgeLimit's own clock.
        return bool(max_age) and age_limit_module.current_millis() - message.message_timestamp >= max_age

    def _age_limit_of(self, broker: "Broker", actor_name: str) -> tuple[bool, Optional[int]]:
        """Whether the stack has an AgeLimit, and the actor's max_age
        under it: found once per actor and stack, not on every job.
        """
        stack = broker.middleware
        seen, size, found = self._age_limits
        if seen is not stack or size != len(stack):
            found = {}
            self._age_limits = (stack, len(stack), found)
        try:
            return found[actor_name]
        except KeyError:
            age_limit = _age_limit(stack)
            if age_limit is None:
                found[actor_name] = (False, None)
            else:
                found[actor_name] = (True, broker.get_actor(actor_name).options.get("max_age", age_limit.max_age))
            return found[actor_name]

    def _owner(self, message: Message) -> str:
        return join_owner(message.message_id, f"{self._token_prefix}.{pid():x}.{next(self._tokens):x}")

    def _take_run_lock(self, broker: "Broker", message: "MessageProxy", raw: Message, state: Delivery) -> None:
        service, spec, threads = self.service, state.spec, self.unlocker.threads
        key = service.key(spec, state.digest, "run")
        queue_key = None
        if spec.lock.queue_release == "run_start" and not state.queue_released:
            queue_key = service.key(spec, state.digest, "queue")
        owner = self._owner(raw)
        taken_at = now_ms()
        # Set before the call: one whose reply is lost may have taken it.
        state.run_key, state.run_owner = key, owner
        # Releases pending in this process ride in front of the call.
        releaser = threads.releaser
        take = releaser.take_run_lock if releaser is not None else service.locks.start
        try:
            started = take(
                key,
                owner,
                ttl=service.settings.lease,
                limit=spec.lock_limit,
                lock=spec.lock.name,
                copy=copy_of(raw, key),
                queue_key=queue_key,
                order=send_order(raw),
                reserve=reserve(service, spec),
            )
        except Exception as e:
            error = service.backend_error("take the run lock", key, spec, message, e)
            if service.settings.on_backend_error == "run_unlocked":
                service.logger.warning("Running %s without its lock %r.", message, key)
                self.unlocker.release_queue_lock(message, state)
                return
            raise error from e
        got, state.claimed = started.acquisition, True
        if started.promoted is not None:
            self.unlocker.hand_over(HandOff(broker, key, started.promoted))  # the free key went to an older waiter
        if not got.acquired:
            state.run_key = state.run_owner = None
            if got.refused:
                skip_copy(service, message, state, got.refused, started.duplicate_of)
            conflict = Conflict(service, broker, message, state, key, got.holder)
            if started.in_line and spec.server == "reschedule":
                wait_longer(conflict, started.free_in)
            on_conflict(conflict)
        if queue_key is not None:
            self.unlocker.queue_lock_released(message, state, queue_key, started.queue_released)
        state.run_confirmed, state.fence = True, got.fence
        if spec.actor_name in self.async_actors:
            state.coroutine = watch()
        state.lease = threads.leases.hold(key, owner, taken_at, actor=spec.actor_name)
        set_fence(got.fence)
        service.emit("locked", spec, key, raw)

    def _settle(self, message: "MessageProxy", state: Delivery, strict: bool = False) -> None:
        """Claim a copy that will not start, so that no other copy of
        its message starts either; skip it if another copy won.
        ``strict`` raises on a backend failure, so that the delivery is
        retried rather than dead-lettered beside a copy that won.
        """
        service = self.service
        copy = copy_of(message, service.key(state.spec, state.digest, "run"))
        if state.claimed or not copy.attempt:
            return
        try:
            may_run = Reschedules.require(service.locks, feature="a rescheduled message").claim(copy)
        except Exception as e:
            error = service.backend_error("settle the copies of", copy.key, state.spec, message, e)
            if strict and service.settings.on_backend_error == "fail":
                raise error from e
            return
        state.claimed = True
        if not may_run:
            skip_copy(service, message, state, CopyVerdict.LOST)


def _age_limit(stack: list[Any]) -> Optional[AgeLimit]:
    return next((middleware for middleware in stack if isinstance(middleware, AgeLimit)), None)
