--@include _now
-- Library, included by the scripts that deliver, re-enqueue or retire
-- a copy of a rescheduled message: may this copy run?
--
-- A message record (hash) holds "attempt", the reschedule the message
-- waits in, and "winner", the copy of that attempt that arrived first
-- ("delay", "handoff" or "retry"; "" while none has).  It also keeps:
--
-- * "o:<attempt>:<via>": a copy that was made and has not arrived yet
--   (the delayed and the hand-off copy of each wait), and "out", how
--   many there are;
-- * "runner", "ran": the owner of the run lock the record's message
--   runs under, and "<attempt>|<via>|<retries>" of the copy it runs as;
-- * "finished": the Retries count of the copy whose run succeeded: a
--   copy with no more retries is a duplicate of it; "finished_as": that
--   copy, "<attempt>|<via>|<retries>", and "finished_by": the run lock
--   owner it ran under.  Only a run that leaves nothing to do finishes
--   its message: a failed run, a retired (dead-lettered) copy never do,
--   so their next copy (a retry, a redelivery, a replay) runs.
--
-- claim(record, wait, bodies, id, attempt, via, write, retries) returns
-- "run", "stale" (a copy of an earlier attempt), "lost" (another copy
-- of this attempt arrived first) or "done" (a copy of a run that has
-- ended: a broker published or delivered it twice).  A copy with no
-- record runs: it was never rescheduled, or its record expired.  With
-- write, the copy counts as arrived, and the first copy of an attempt
-- becomes its winner and withdraws the waiter, so no hand-off makes a
-- second copy of it.

-- How long a finished message's record outlives its last expected
-- copy, in ms: the window for copies a broker duplicated
-- (DUPLICATE_WINDOW in dramatiq_unique/backends/base.py).
local DUPLICATE_WINDOW = 600000

-- expect(record, attempt, via): count copy via of attempt as made and
-- still to come.  Returns nothing.
local function expect(record, attempt, via)
  if redis.call("HSETNX", record, "o:" .. attempt .. ":" .. via, 1) == 1 then
    redis.call("HINCRBY", record, "out", 1)
  end
end

-- arrived(record, attempt, via): count copy via of attempt as arrived.
-- Returns nothing.
local function arrived(record, attempt, via)
  if redis.call("HDEL", record, "o:" .. attempt .. ":" .. via) == 1 then
    redis.call("HINCRBY", record, "out", -1)
  end
end

-- A finished message's record lives only until no copy of it is to come.
local function settle(record)
  local state = redis.call("HMGET", record, "finished", "out")
  if not state[1] or tonumber(state[2] or "0") > 0 then return end
  local left = redis.call("PTTL", record)
  if left < 0 or left > DUPLICATE_WINDOW then redis.call("PEXPIRE", record, DUPLICATE_WINDOW) end
end

-- The run of a message succeeded: later copies with no more retries
-- than it are duplicates.  A waiter that a duplicate registered
-- meanwhile is withdrawn, and the record goes back to the finished
-- copy's attempt.
local function finish(record, wait, bodies, id, attempt, via, retries, by)
  if redis.call("ZREM", wait, id) == 1 then
    redis.call("HDEL", bodies, id)
    local current = redis.call("HGET", record, "attempt")
    if current then arrived(record, current, "handoff") end
  end
  redis.call("HSET", record, "attempt", attempt, "winner", via, "finished", retries,
    "finished_as", attempt .. "|" .. via .. "|" .. retries, "finished_by", by or "")
  redis.call("HDEL", record, "runner", "ran")
  settle(record)
end

-- Whether message id is still in line for the key (a registered waiter).
local function in_line(wait, id)
  return redis.call("ZSCORE", wait, id) ~= false
end

local function claim(record, wait, bodies, id, attempt, via, write, retries)
  retries = retries or 0
  local state = redis.call("HMGET", record, "attempt", "winner", "finished")
  if not state[1] then return "run" end
  if write then arrived(record, attempt, via) end
  local verdict = "run"
  local current = tonumber(state[1])
  local winner = state[2] or ""
  if state[3] and retries <= tonumber(state[3]) then
    verdict = "done"
  elseif attempt < current then
    verdict = "stale"
  elseif attempt == current and winner ~= "" then
    if winner ~= via then verdict = "lost" end
  elseif write then
    redis.call("HSET", record, "attempt", attempt, "winner", via)
    if redis.call("ZREM", wait, id) == 1 then arrived(record, attempt, "handoff") end
    redis.call("HDEL", bodies, id)
  end
  if write and verdict ~= "run" then settle(record) end
  return verdict
end

-- reserve(key, id, ms): reserve a free slot of the lock hash key for
-- message id, for ms (see _take.lua): the key lives at least as long.
-- Returns nothing.
local function reserve(key, id, ms)
  local deadline = now_ms() + ms
  redis.call("HSET", key, "!r:" .. id, string.format("%.0f", deadline))
  if redis.call("PTTL", key) < ms then redis.call("PEXPIREAT", key, string.format("%.0f", deadline)) end
end
