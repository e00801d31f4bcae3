--@include _take
--@include _claim
-- current: whether a message is still current under on_conflict="replace",
-- when one of its copies is delivered or re-enqueued.
--
-- KEYS[1]  the lock hash (see _take.lua and replace.lua)
-- KEYS[2]  superseded: hash message id -> id of the message that replaced it
-- KEYS[3..5], optional (reenter): the message record, waiters and bodies
--          of the run lock whose waiter this copy may be (see join_line.lua)
-- ARGV[1]  owner (message id)
-- ARGV[2]  "start": a copy is delivered.  A superseded one gives up the
--          slot it may still have (a started holder's retry); the
--          current one is marked "!started".
--          "reenter": a copy is re-enqueued (retry, delay-queue move).
--          A current one re-enters its slot as acquire.lua does, or
--          takes the key again if it lapsed and nobody holds it; a copy
--          that may not run (see _claim.lua) takes nothing.
-- ARGV[3]  ttl ms (reenter)   ARGV[4] lock type (reenter)
-- ARGV[5..6], with KEYS[3..5]: attempt and via of this copy
-- ARGV[7]  reenter: where the copy is being published, for the owner's
--          enqueue record (see _take.lua), or "" to keep none
-- ARGV[8]  with KEYS[3..5]: the Retries count of this copy
--
-- Returns {status, other}: status -2 superseded by `other`; 3 this copy
-- may not run (`other` is the claim's verdict); 1 current (start), or
-- took the key afresh (reenter); 2 re-entered; 0 its slot lapsed and
-- `other` holds the key.
local key, owner = KEYS[1], ARGV[1]
local by = redis.call("HGET", KEYS[2], owner)
if by then
  if ARGV[2] == "start" and redis.call("HEXISTS", key, owner) == 1 then
    redis.call("HDEL", key, owner, "!m:" .. owner)
    local live = 0
    holders(key, now_ms(), function(_, _, kind)
      if kind == "live" then live = live + 1 end  -- holders only: an enqueue lock has no reservations
    end)
    if live == 0 then redis.call("DEL", key) end
  end
  return {-2, by}
end
if ARGV[2] == "start" then
  if redis.call("HGET", key, "!current") == owner then redis.call("HSET", key, "!started", owner) end
  return {1, false}
end
if KEYS[3] then
  local verdict = claim(KEYS[3], KEYS[4], KEYS[5], owner, tonumber(ARGV[5]), ARGV[6], false, tonumber(ARGV[8]))
  if verdict ~= "run" then return {3, verdict} end
end
local where = nil
if ARGV[7] and ARGV[7] ~= "" then where = ARGV[7] end
local got = take(key, owner, ARGV[3], 1, ARGV[4], "", 0, where)
if got[1] == 1 then
  -- a lapsed message takes its free key back as its current message
  redis.call("HDEL", key, "!started", "!superseded", "!previous", "!args")
  redis.call("HSET", key, "!current", owner, "!burst", string.format("%.0f", now_ms()))
end
return {got[1], got[2]}
