--@include _now
-- Library: the slot of one owner, for the verbs that renew it.
--
-- live_slot(key, owner) returns the owner's deadline and now (ms) when
-- it holds a live slot of the lock hash key; nil when the slot is
-- absent, or lapsed: a lapsed slot is dropped with its record, never
-- revived.
local function live_slot(key, owner)
  local deadline = redis.call("HGET", key, owner)
  if not deadline then return nil end
  local now = now_ms()
  if tonumber(deadline) <= now then
    redis.call("HDEL", key, owner, "!m:" .. owner)
    return nil
  end
  return tonumber(deadline), now
end
