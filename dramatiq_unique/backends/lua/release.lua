-- release: remove one owner from a lock, checking that it holds it,
-- and hand the freed slot to the longest waiter.
--
-- KEYS[1]  the lock hash (see acquire.lua)
-- KEYS[2]  waiters: zset ticket -> order (see wait.lua)
-- KEYS[3]  tickets: hash ticket -> "copies:claimed", "m:"..ticket -> message
-- ARGV[1]  owner      ARGV[2] "1" to hand the slot to a waiter, "0" not to
--
-- Returns {held, message}: held 1 when the owner held a live slot, 0
-- when it was absent or had lapsed; message is the encoded message of
-- the promoted waiter, or false.  The key is deleted with its last
-- live holder.
local key, owner = KEYS[1], ARGV[1]
local deadline = redis.call("HGET", key, owner)
if not deadline then return {0, false} end
redis.call("HDEL", key, owner, "!m:" .. owner)
local time = redis.call("TIME")
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
-- Lapsed holders count for nothing: drop them, or the key would
-- outlive its last live holder until its own expiry.
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
local held = 1
if tonumber(deadline) <= now then held = 0 end
if ARGV[2] ~= "1" then return {held, false} end
local first = redis.call("ZPOPMIN", KEYS[2])
if #first == 0 then return {held, false} end
local ticket = first[1]
local message = redis.call("HGET", KEYS[3], "m:" .. ticket)
redis.call("HDEL", KEYS[3], "m:" .. ticket)
if redis.call("HEXISTS", KEYS[3], ticket) == 1 then
  redis.call("HSET", KEYS[3], ticket, "2:0")
end
return {held, message}
