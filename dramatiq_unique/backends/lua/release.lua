--@include _drop
-- release: remove one owner from a lock, checking that it holds it,
-- and hand the freed slot to the longest waiter.
--
-- KEYS[1]  the lock hash (see _take.lua)
-- KEYS[2]  waiters: zset message id -> order (see wait.lua)
-- KEYS[3]  bodies: hash message id -> encoded message
-- ARGV[1]  owner      ARGV[2] "1" to hand the slot to a waiter, "0" not to
--
-- Returns {held, message}: held 1 when the owner held a live slot, 0
-- when it was absent or had lapsed; message is the encoded message of
-- the promoted waiter, or false.  Nothing is handed over by an owner
-- that held nothing.
local held, present = drop(KEYS[1], ARGV[1])
if ARGV[2] ~= "1" or not present then return {held, false} end
while true do
  local first = redis.call("ZPOPMIN", KEYS[2])
  if #first == 0 then return {held, false} end
  local message = redis.call("HGET", KEYS[3], first[1])
  redis.call("HDEL", KEYS[3], first[1])
  if message then return {held, message} end
end
