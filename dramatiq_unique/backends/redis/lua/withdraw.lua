-- withdraw: take back a wait whose delayed copy was never enqueued.
-- The message goes back to the attempt of the copy that registered
-- it, with that copy as the winner, so its retry runs and no hand-off
-- makes a copy of the attempt that never was.
--
-- KEYS[1]  the message record   KEYS[2] waiters   KEYS[3] bodies
-- ARGV[1]  message id   ARGV[2] attempt of the copy   ARGV[3] its via
redis.call("ZREM", KEYS[2], ARGV[1])
redis.call("HDEL", KEYS[3], ARGV[1])
if tonumber(ARGV[2]) == 0 then
  redis.call("DEL", KEYS[1])
elseif redis.call("EXISTS", KEYS[1]) == 1 then
  redis.call("HSET", KEYS[1], "attempt", ARGV[2], "winner", ARGV[3])
end
return 1
