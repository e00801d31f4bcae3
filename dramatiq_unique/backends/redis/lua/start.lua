--@include _take
--@include _claim
--@include _drop
-- start: what a delivery takes before its actor runs, in one call.
-- Claim the delivered copy, take a run-lock slot, and release the
-- message's enqueue lock when the lock type releases it at run start.
--
-- KEYS[1]  the run lock hash (see _take.lua)
-- KEYS[2]  the message record   KEYS[3] waiters   KEYS[4] bodies
-- KEYS[5]  optional: the enqueue lock hash to release
-- ARGV[1]  owner      ARGV[2] lease ms     ARGV[3] limit
-- ARGV[4]  lock type  ARGV[5] message id   ARGV[6] attempt
-- ARGV[7]  via (which copy this is)   ARGV[8] its Retries count
-- ARGV[9]  optional: the lock args JSON to record (record_lock_args)
--
-- Returns {status, holder, fence, queue}: status as take() returns it,
-- or 3 with holder = the claim's verdict when this copy may not run;
-- queue 1 when the enqueue lock was held and is now released.  A
-- rescheduled message's record names the owner it runs under, so that
-- its release can tell that its run ended (see _claim.lua).
local verdict = claim(KEYS[2], KEYS[3], KEYS[4], ARGV[5], tonumber(ARGV[6]), ARGV[7], true, tonumber(ARGV[8]))
if verdict ~= "run" then return {3, verdict, 0, 0} end
local got = take(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[9] or "")
if got[1] == 1 and redis.call("EXISTS", KEYS[2]) == 1 then
  redis.call("HSET", KEYS[2], "runner", ARGV[1], "ran", ARGV[6] .. "|" .. ARGV[7] .. "|" .. ARGV[8])
end
if got[1] == 0 or not KEYS[5] then return {got[1], got[2], got[3], 0} end
local held = drop(KEYS[5], ARGV[5])
return {got[1], got[2], got[3], held}
