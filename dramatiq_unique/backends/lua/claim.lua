-- claim: record that one copy of a waiting ticket arrived.
--
-- KEYS[1]  waiters: zset ticket -> order
-- KEYS[2]  tickets: hash ticket -> "copies:claimed", "m:"..ticket -> message
-- ARGV[1]  ticket
--
-- Returns 1 when this copy may run (the first to arrive, or a ticket
-- with no record), 0 when another copy arrived first.  The record is
-- dropped once every copy has arrived.
local ticket = ARGV[1]
local state = redis.call("HGET", KEYS[2], ticket)
if not state then return 1 end
local copies, claimed = string.match(state, "(%d+):(%d+)")
copies = tonumber(copies) - 1
redis.call("ZREM", KEYS[1], ticket)
redis.call("HDEL", KEYS[2], "m:" .. ticket)
if copies <= 0 then
  redis.call("HDEL", KEYS[2], ticket)
else
  redis.call("HSET", KEYS[2], ticket, copies .. ":1")
end
if claimed == "1" then return 0 end
return 1
