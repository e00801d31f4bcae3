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
  local time = redis.call("TIME")
  local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
  local holders = 0
  local fields = redis.call("HGETALL", key)
  for i = 1, #fields, 2 do
    local name = fields[i]
    if string.sub(name, 1, 3) == "!r:" then
      if tonumber(fields[i + 1]) > now then holders = holders + 1 end
    elseif string.sub(name, 1, 1) ~= "!" then
      if tonumber(fields[i + 1]) > now then
        holders = holders + 1
      else
        redis.call("HDEL", key, name, "!m:" .. name)
      end
    end
  end
  if holders == 0 then redis.call("DEL", key) end
  if tonumber(deadline) <= now then return 0, true end
  return 1, true
end
