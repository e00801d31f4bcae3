--@include _claim
-- claim: settle which copy of a rescheduled message runs, without
-- taking a lock: for a copy that is retired (dead-lettered, expired,
-- dropped) before it could start, so that no other copy of it runs.
--
-- KEYS[1]  the message record   KEYS[2] waiters   KEYS[3] bodies
-- KEYS[4]  the run lock
-- ARGV[1]  message id   ARGV[2] attempt   ARGV[3] via   ARGV[4] retries
--
-- Returns 1 when this copy was, or now is, the one that may run: it
-- is retired in its message's stead, as the winner of its attempt, so
-- that the attempt's other copy is skipped.  The message is not
-- finished: a replay of the retired copy runs.  The same copy claiming
-- again (a call sent again after its reply was lost) is still the
-- winner.  No copy of the message runs now, so a slot the run lock
-- reserved for it (see _take.lua) is free for the next in line.
if claim(KEYS[1], KEYS[2], KEYS[3], ARGV[1], tonumber(ARGV[2]), ARGV[3], true, tonumber(ARGV[4])) ~= "run" then
  return 0
end
redis.call("HDEL", KEYS[1], "runner", "ran")
redis.call("HDEL", KEYS[4], "!r:" .. ARGV[1])
return 1
