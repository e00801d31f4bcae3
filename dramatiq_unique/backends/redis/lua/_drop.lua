--@include _now
--@include _holders
-- Library: remove one owner from a lock hash, checking that it holds it.
--
-- drop(key, owner) returns held, present: held 1 when the owner held a
-- live slot, 0 when it was absent or had lapsed; present false when it
-- was absent.  Lapsed holders count for nothing and are
-- dropped too, and the key is deleted with its last live holder (or
-- reservation, see _take.lua), so it never outlives them.
local function drop(key, owner)
  local deadline = redis.call("HGET", key, owner)
  if not deadline then return 0, false end
  redis.call("HDEL", key, owner, "!m:" .. owner)
  local now = now_ms()
  local live = 0
  holders(key, now, function(name, _, kind)
    if kind == "live" or kind == "reserved" then
      live = live + 1
    elseif kind == "lapsed" then
      drop_lapsed(key, name)
    end
  end)
  if live == 0 then redis.call("DEL", key) end
  if tonumber(deadline) <= now then return 0, true end
  return 1, true
end
