-- Library: take one of limit slots of a lock hash for an owner.
--
-- The lock hash: field <owner> = deadline (server ms), "!fence" = last
-- fencing token, "!lock" = lock type, "!args" = lock args JSON (only
-- when recorded).
--
-- take(key, owner, ttl, limit, lock, args) returns {status, holder,
-- fence}: status 1 acquired, 2 re-entered, 0 held by others (holder
-- names one of them).  Expired holders are dropped first; the key
-- expires with its last holder's deadline.
local function take(key, owner, ttl, limit, lock, args)
  local time = redis.call("TIME")
  local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
  local deadline = now + tonumber(ttl)
  local fields = redis.call("HGETALL", key)
  local live, other, mine, latest, fence = 0, false, false, deadline, 0
  for i = 1, #fields, 2 do
    local name, value = fields[i], tonumber(fields[i + 1])
    if name == "!fence" then
      fence = value
    elseif string.sub(name, 1, 1) ~= "!" then
      if value <= now then
        redis.call("HDEL", key, name)
      elseif name == owner then
        mine = value
      else
        live, other = live + 1, name
        if value > latest then latest = value end
      end
    end
  end
  if mine then
    if mine > deadline then deadline = mine end
    redis.call("HSET", key, owner, string.format("%.0f", deadline))
    redis.call("PEXPIREAT", key, string.format("%.0f", math.max(latest, deadline)))
    return {2, owner, fence}
  end
  if live >= tonumber(limit) then
    return {0, other, fence}
  end
  fence = math.max(fence + 1, tonumber(time[1]) * 1000000 + tonumber(time[2]))
  redis.call("HSET", key, owner, string.format("%.0f", deadline), "!fence", string.format("%.0f", fence), "!lock", lock)
  if args ~= "" then redis.call("HSET", key, "!args", args) end
  redis.call("PEXPIREAT", key, string.format("%.0f", latest))
  return {1, owner, fence}
end
