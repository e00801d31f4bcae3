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
-- ARGV[9]  the message's send order (its place among the waiters)
-- ARGV[10] how long a slot handed to a waiter stays reserved, ms
-- ARGV[11] optional: the lock args JSON to record (record_lock_args)
--
-- Returns fence * 2 + queue for a fresh slot (status 1: the common
-- reply, one integer, which costs the client less to read than an
-- array); else {status, holder, fence, queue, extra}:
-- * status as take() returns it (1 acquired, 2 re-entered, 0 held by
--   others; queue 1 when the enqueue lock was held and is now
--   released);
-- * 3 with holder = the claim's verdict when this copy may not run
--   (extra: for "done", the run lock owner of the run it duplicates);
-- * 4: held by others (or reserved), and this copy's message is still
--   in line: nothing was written, the copy only waits longer; a sixth
--   element says in how many ms the key's last holder or reservation
--   runs out, unless renewed (its PTTL).
-- With status 0 or 4, extra may be the encoded message of an older
-- waiter that the free slot was just handed to (and reserved for): the
-- caller enqueues it.  A free slot goes to the oldest waiter in line
-- (lowest order) unless it is reserved for this message or this copy
-- is older: waiters are handed the key in send order, even when no
-- release hands it over (its holder died, its reservation ran out).
-- A rescheduled message's record names the owner it runs under, so
-- that its release can tell that its run ended (see _claim.lua).
local record, wait, bodies = KEYS[2], KEYS[3], KEYS[4]
local id, attempt, via, retries = ARGV[5], tonumber(ARGV[6]), ARGV[7], tonumber(ARGV[8])
-- A message that was never rescheduled has no record: one EXISTS, not a claim.
local recorded = redis.call("EXISTS", record) == 1
local verdict = "run"
if recorded then verdict = claim(record, wait, bodies, id, attempt, via, false, retries) end
if verdict ~= "run" then
  claim(record, wait, bodies, id, attempt, via, true, retries)  -- it arrived: settle the record
  local by = false
  if verdict == "done" then by = redis.call("HGET", record, "finished_by") or false end
  return {3, verdict, 0, 0, by}
end
local order = tonumber(ARGV[9] or "")
local handed, handed_to = false, false
local function ahead()
  while true do
    local head = redis.call("ZRANGE", wait, 0, 0, "WITHSCORES")
    if #head == 0 or head[1] == id or (order and tonumber(head[2]) >= order) then return false end
    redis.call("ZREM", wait, head[1])
    local body = redis.call("HGET", bodies, head[1])
    if body then
      redis.call("HDEL", bodies, head[1])
      reserve(KEYS[1], head[1], tonumber(ARGV[10] or "10000"))
      handed, handed_to = body, head[1]
      return true
    end
  end
end
local got = take(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[11] or "", nil, nil, ahead)
if got[1] == 5 then got = {0, handed_to, got[3], 0} end
if got[1] == 0 then
  if recorded and in_line(wait, id) then return {4, got[2], got[3], 0, handed, redis.call("PTTL", KEYS[1])} end
  if recorded then claim(record, wait, bodies, id, attempt, via, true, retries) end
  return {0, got[2], got[3], 0, handed}
end
if recorded then claim(record, wait, bodies, id, attempt, via, true, retries) end
if got[1] == 1 and recorded then
  redis.call("HSET", record, "runner", ARGV[1], "ran", ARGV[6] .. "|" .. ARGV[7] .. "|" .. ARGV[8])
end
local queue = 0
if KEYS[5] then queue = drop(KEYS[5], ARGV[5]) end
if got[1] == 1 then return got[3] * 2 + queue end
return {got[1], got[2], got[3], queue}
