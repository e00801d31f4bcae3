--@include _live
-- extend: renew one owner's lease on a lock.
--
-- KEYS[1]  the lock hash (see _take.lua)
-- ARGV[1]  owner      ARGV[2] ttl ms
--
-- Returns 1 when the owner still held a live slot and it now lasts
-- until ttl from now; 0 when the slot was absent or had lapsed (a
-- lapsed slot is dropped, never revived).
local key, owner = KEYS[1], ARGV[1]
local deadline, now = live_slot(key, owner)
if not deadline then return 0 end
local renewed = now + tonumber(ARGV[2])
redis.call("HSET", key, owner, string.format("%.0f", renewed))
if redis.call("PTTL", key) < tonumber(ARGV[2]) then
  redis.call("PEXPIREAT", key, string.format("%.0f", renewed))
end
return 1
