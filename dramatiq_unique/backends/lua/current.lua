-- current: whether a message is still current under on_conflict="replace",
-- when one of its copies is delivered or re-enqueued.
--
-- KEYS[1]  the lock hash (see acquire.lua and replace.lua)
-- KEYS[2]  superseded: hash message id -> id of the message that replaced it
-- ARGV[1]  owner (message id)
-- ARGV[2]  "start": a copy is delivered.  A superseded one gives up the
--          slot it may still have (a started holder's retry); the
--          current one is marked "!started".
--          "reenter": a copy is re-enqueued (retry, delay-queue move).
--          A current one re-enters its slot as acquire.lua does, or
--          takes the key again if it lapsed and nobody holds it.
-- ARGV[3]  ttl ms (reenter)   ARGV[4] lock type (reenter)
--
-- Returns {status, other}: status -2 superseded by `other`; 1 current
-- (start), or took the key afresh (reenter); 2 re-entered; 0 its slot
-- lapsed and `other` holds the key.
local key, owner = KEYS[1], ARGV[1]
local time = redis.call("TIME")
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local function live_holders()
  local fields, count, other = redis.call("HGETALL", key), 0, false
  for i = 1, #fields, 2 do
    local name = fields[i]
    if string.sub(name, 1, 1) ~= "!" then
      if tonumber(fields[i + 1]) > now then
        count, other = count + 1, name
      else
        redis.call("HDEL", key, name)
      end
    end
  end
  return count, other
end
local by = redis.call("HGET", KEYS[2], owner)
if by then
  if ARGV[2] == "start" and redis.call("HDEL", key, owner) == 1 and live_holders() == 0 then
    redis.call("DEL", key)
  end
  return {-2, by}
end
if ARGV[2] == "start" then
  if redis.call("HGET", key, "!current") == owner then redis.call("HSET", key, "!started", owner) end
  return {1, false}
end
local deadline = now + tonumber(ARGV[3])
local mine = tonumber(redis.call("HGET", key, owner) or "0")
if mine > now then
  if mine > deadline then deadline = mine end
  redis.call("HSET", key, owner, string.format("%.0f", deadline))
  if redis.call("PTTL", key) < deadline - now then redis.call("PEXPIREAT", key, string.format("%.0f", deadline)) end
  return {2, owner}
end
local count, other = live_holders()
if count > 0 then return {0, other} end
local fence = tonumber(redis.call("HGET", key, "!fence") or "0")
fence = math.max(fence + 1, tonumber(time[1]) * 1000000 + tonumber(time[2]))
redis.call("DEL", key)
redis.call("HSET", key, owner, string.format("%.0f", deadline), "!fence", string.format("%.0f", fence),
  "!lock", ARGV[4], "!current", owner, "!burst", string.format("%.0f", now))
redis.call("PEXPIREAT", key, string.format("%.0f", deadline))
return {1, owner}
