-- reap: release an enqueue slot whose message was found nowhere in the
-- broker, if nothing about it changed since it was looked at.
--
-- KEYS[1]  the lock hash (see acquire.lua)
-- ARGV[1]  owner      ARGV[2] the enqueue record the reaper checked
--
-- Returns 1 when the slot was released; 0 when the owner no longer
-- holds it, or its record changed (the message was re-enqueued,
-- confirmed or re-entered meanwhile), so it is left alone.  The key is
-- deleted with its last live holder.
local key, owner = KEYS[1], ARGV[1]
if redis.call("HGET", key, "!m:" .. owner) ~= ARGV[2] then return 0 end
local deadline = redis.call("HGET", key, owner)
if not deadline then return 0 end
redis.call("HDEL", key, owner, "!m:" .. owner)
local time = redis.call("TIME")
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local holders = 0
local fields = redis.call("HGETALL", key)
for i = 1, #fields, 2 do
  local name = fields[i]
  if string.sub(name, 1, 1) ~= "!" then
    if tonumber(fields[i + 1]) > now then
      holders = holders + 1
    else
      redis.call("HDEL", key, name, "!m:" .. name)
    end
  end
end
if holders == 0 then redis.call("DEL", key) end
if tonumber(deadline) <= now then return 0 end
return 1
