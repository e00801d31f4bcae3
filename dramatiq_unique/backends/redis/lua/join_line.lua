--@include _claim
-- wait: register a message as waiting for a run lock's next free slot,
-- as a new attempt of it.
--
-- KEYS[1]  the message record: hash "attempt", "winner", the copies
--          still to come (see _claim.lua)
-- KEYS[2]  waiters: zset message id -> order
-- KEYS[3]  bodies: hash message id -> the encoded copy to hand the lock to
-- ARGV[1]  message id   ARGV[2] encoded message   ARGV[3] order
-- ARGV[4]  attempt      ARGV[5] ttl ms of all three keys
--
-- The caller also enqueues a delayed copy of the same attempt; the
-- first of the two copies to arrive becomes the attempt's winner.
--
-- Returns how many waiters are ahead of this one (0 when it changed
-- nothing).
--
-- Only the copy that won attempt - 1 waits for attempt, once: a wait
-- that finds its attempt recorded was sent again after its reply was
-- lost (a client retrying a dropped connection), and changes nothing.
-- Otherwise it would undo the claim of a copy that won meanwhile, and
-- the attempt's other copy would run beside it.
local recorded = redis.call("HGET", KEYS[1], "attempt")
if recorded and tonumber(recorded) >= tonumber(ARGV[4]) then return 0 end
redis.call("HSET", KEYS[1], "attempt", ARGV[4], "winner", "")
expect(KEYS[1], ARGV[4], "delay")
expect(KEYS[1], ARGV[4], "handoff")
redis.call("ZADD", KEYS[2], ARGV[3], ARGV[1])
redis.call("HSET", KEYS[3], ARGV[1], ARGV[2])
for i = 1, 3 do redis.call("PEXPIRE", KEYS[i], ARGV[5]) end
return redis.call("ZRANK", KEYS[2], ARGV[1])
