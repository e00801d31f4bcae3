--@include _take
-- replace: make a new send the current holder of an enqueue lock,
-- superseding the message that held it (on_conflict="replace", debounce).
--
-- KEYS[1]  the lock hash (see acquire.lua), with replace's fields:
--          "!current" = the current message, "!started" = the current
--          message once a worker has started it, "!burst" = server ms
--          of the first send of the debounce burst, "!superseded" =
--          how many messages the key's holders superseded,
--          "!previous" = the message the current one superseded (for
--          unreplace.lua, when the current one's publish fails), and
--          "!previous_m" = its enqueue record; "!m:<owner>" = each
--          holder's enqueue record, as _take.lua writes it.
-- KEYS[2]  superseded: hash superseded message id -> id of the message
--          that replaced it; lives ARGV[8] ms after the last replace.
-- ARGV[1]  owner (message id)   ARGV[2] ttl ms   ARGV[3] lock type
-- ARGV[4]  lock args JSON, or "" to record none
-- ARGV[5]  "1": a holder that has started is kept and the send refused
--          (until_expired); "0": a started holder is superseded too,
--          keeps its own slot until it releases it, and a new burst opens
-- ARGV[6]  debounce ms, or 0    ARGV[7] debounce_max ms, or 0
-- ARGV[8]  ttl ms of the superseded record
-- ARGV[9]  where the message is being published, for its record
--
-- Returns {status, other, fence, delay}: status 1 acquired a free key,
-- 2 re-entered, 3 replaced `other`, 0 refused (`other` has started);
-- delay is how long from now the message is due under debounce.  The
-- slot itself is taken by take() (see _take.lua), with no limit: the
-- superseded holders that have started keep theirs.
local key, owner = KEYS[1], ARGV[1]
local function take_slot()
  return take(key, owner, ARGV[2], math.huge, ARGV[3], ARGV[4], 0, ARGV[9])
end
local now = now_ms()
local live, any, meta = {}, false, {}
holders(key, now, function(name, value, kind)
  if kind == "live" then
    live[name], any = value, name
  elseif kind == "lapsed" then
    drop_lapsed(key, name)
  elseif kind == "meta" then
    meta[name] = value
  end
end)
-- A publish retry of the same send re-enters its slot: the record names its new place.
if live[owner] then return take_slot() end
-- Without a live current message, the slots left are those of started
-- holders that were superseded already: the key is free to replace
-- into.  (A key taken without replace has no "!current": its holder is
-- the current one.)
local current = meta["!current"]
if current == nil then current = any elseif not live[current] then current = false end
local status, burst = 1, now
if current then
  local started = meta["!started"] == current
  if started and ARGV[5] == "1" then return {0, current, tonumber(meta["!fence"] or "0"), 0} end
  if not started then
    redis.call("HDEL", key, current, "!m:" .. current)
    burst = tonumber(meta["!burst"] or now)
  end
  redis.call("HSET", KEYS[2], current, owner)
  if redis.call("PTTL", KEYS[2]) < tonumber(ARGV[8]) then redis.call("PEXPIRE", KEYS[2], ARGV[8]) end
  redis.call("HINCRBY", key, "!superseded", 1)
  redis.call("HSET", key, "!previous", current)
  if meta["!m:" .. current] then redis.call("HSET", key, "!previous_m", meta["!m:" .. current]) end
  status = 3
else
  redis.call("HDEL", key, "!superseded", "!args", "!previous", "!previous_m")
end
local delay, debounce, cap = 0, tonumber(ARGV[6]), tonumber(ARGV[7])
if debounce > 0 then
  local due = now + debounce
  if cap > 0 and due > burst + cap then due = math.max(now, burst + cap) end
  delay = due - now
end
redis.call("HDEL", key, "!started")
local got = take_slot()
redis.call("HSET", key, "!current", owner, "!burst", string.format("%.0f", burst))
return {status, current or false, got[3], delay}
