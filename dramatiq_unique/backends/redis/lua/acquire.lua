--@include _take
--@include _claim
-- acquire: take one of ARGV[3] slots of a lock for an owner, unless the
-- message is a copy that may not run.
--
-- KEYS[1]  the lock hash (see _take.lua)
-- KEYS[2..4], optional: the message record, waiters and bodies of the
--          run lock whose waiter this message may be (see join_line.lua)
-- ARGV[1]  owner      ARGV[2] ttl ms      ARGV[3] limit
-- ARGV[4]  lock type  ARGV[5] lock args JSON, or "" to record none
-- ARGV[6]  provisional ms, or 0 (see _take.lua)
-- ARGV[7]  "1" to keep the owner's enqueue record, "0" not to
-- ARGV[8]  where the message is being published, for the record
-- ARGV[9..12], with KEYS[2..4]: message id, attempt, via, retries of
--          this copy
--
-- Returns the fence alone for a fresh, confirmed slot (the common
-- reply, one integer, which costs the client less to read than an
-- array); else {status, holder, fence, confirm} as take() does, or
-- {3, verdict, 0, 0} when this copy of its message may not run (see
-- _claim.lua): it then takes nothing.
if KEYS[2] then
  local verdict = claim(KEYS[2], KEYS[3], KEYS[4], ARGV[9], tonumber(ARGV[10]), ARGV[11], false, tonumber(ARGV[12]))
  if verdict ~= "run" then return {3, verdict, 0, 0} end
end
local where = nil
if ARGV[7] == "1" then where = ARGV[8] end
local got = take(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], where)
if got[1] == 1 and got[4] == 0 then return got[3] end
return got
