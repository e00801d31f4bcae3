--@include _live
--@include _record
-- confirm: move a provisional enqueue slot to its full lifetime, now
-- that its message was published.
--
-- KEYS[1]  the lock hash (see _take.lua)
-- ARGV[1]  owner      ARGV[2] ttl ms
--
-- Returns 1 when the owner still held a live slot: it now lasts at
-- least until ttl from now and its record says confirmed.  Returns 0
-- when the slot was absent or had lapsed: a slot released meanwhile,
-- or lapsed and taken by another owner, is never revived.
local key, owner = KEYS[1], ARGV[1]
local deadline, now = live_slot(key, owner)
if not deadline then return 0 end
local renewed = math.max(deadline, now + tonumber(ARGV[2]))
redis.call("HSET", key, owner, string.format("%.0f", renewed))
local record = confirmed_record(redis.call("HGET", key, "!m:" .. owner))
if record then redis.call("HSET", key, "!m:" .. owner, record) end
if redis.call("PTTL", key) < renewed - now then
  redis.call("PEXPIREAT", key, string.format("%.0f", renewed))
end
return 1
