-- Library, included by the scripts that deliver, re-enqueue or retire
-- a copy of a rescheduled message: may this copy run?
--
-- A message record (hash) holds "attempt", the reschedule the message
-- waits in, and "winner", the copy of that attempt that arrived first
-- ("delay" or "handoff"; "" while none has).
--
-- claim(record, wait, bodies, id, attempt, via, write) returns "run",
-- "stale" (a copy of an earlier attempt) or "lost" (the other copy of
-- this attempt arrived first).  A copy with no record runs: it was
-- never rescheduled, or its record expired.  With write, the first
-- copy of an attempt becomes its winner and withdraws the waiter, so
-- no hand-off makes a second copy of it.
local function claim(record, wait, bodies, id, attempt, via, write)
  local state = redis.call("HMGET", record, "attempt", "winner")
  if not state[1] then return "run" end
  local current = tonumber(state[1])
  if attempt < current then return "stale" end
  local winner = state[2] or ""
  if attempt == current and winner ~= "" then
    if winner == via then return "run" end
    return "lost"
  end
  if write then
    redis.call("HSET", record, "attempt", attempt, "winner", via)
    redis.call("ZREM", wait, id)
    redis.call("HDEL", bodies, id)
  end
  return "run"
end
