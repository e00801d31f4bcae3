-- wait: register a message as waiting for a lock's next free slot.
--
-- KEYS[1]  waiters: zset ticket -> order
-- KEYS[2]  tickets: hash ticket -> "copies:claimed", "m:"..ticket -> message
-- ARGV[1]  ticket     ARGV[2] encoded message
-- ARGV[3]  order      ARGV[4] ttl ms of both keys
--
-- The message is also re-enqueued with a delay by the caller, so the
-- ticket starts with one copy; release.lua makes it two when it
-- promotes the waiter.
redis.call("ZADD", KEYS[1], ARGV[3], ARGV[1])
redis.call("HSET", KEYS[2], ARGV[1], "1:0", "m:" .. ARGV[1], ARGV[2])
redis.call("PEXPIRE", KEYS[1], ARGV[4])
redis.call("PEXPIRE", KEYS[2], ARGV[4])
return 1
