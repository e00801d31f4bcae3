--@include _claim
-- claim: settle which copy of a rescheduled message runs, without
-- taking a lock: for a copy that is retired (dead-lettered, expired,
-- dropped) before it could start, so that no other copy of it runs.
--
-- KEYS[1]  the message record   KEYS[2] waiters   KEYS[3] bodies
-- ARGV[1]  message id   ARGV[2] attempt   ARGV[3] via
--
-- Returns 1 when this copy was, or now is, the one that may run.
if claim(KEYS[1], KEYS[2], KEYS[3], ARGV[1], tonumber(ARGV[2]), ARGV[3], true) == "run" then return 1 end
return 0
