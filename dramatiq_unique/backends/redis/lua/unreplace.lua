-- unreplace: undo a replace whose message was never published, so the
-- message it superseded is current again and runs.
--
-- KEYS[1]  the lock hash (see replace.lua)
-- KEYS[2]  superseded: hash message id -> id of the message that replaced it
-- ARGV[1]  owner: the message whose publish failed
--
-- The message made current again gets back the enqueue record it had
-- when it was superseded ("!previous_m"), so the reaper still finds it.
--
-- Returns the id made current again, or false when the owner is not
-- current or superseded nobody.  The owner's own slot is left for
-- release.lua to remove.
local key, owner = KEYS[1], ARGV[1]
local deadline = redis.call("HGET", key, owner)
if not deadline or redis.call("HGET", key, "!current") ~= owner then return false end
local previous = redis.call("HGET", key, "!previous")
if not previous or redis.call("HGET", KEYS[2], previous) ~= owner then return false end
redis.call("HDEL", KEYS[2], previous)
local record = redis.call("HGET", key, "!previous_m")
redis.call("HDEL", key, "!previous", "!previous_m")
redis.call("HINCRBY", key, "!superseded", -1)
redis.call("HSET", key, "!current", previous)
if not redis.call("HGET", key, previous) then
  redis.call("HSET", key, previous, deadline)
  if record then redis.call("HSET", key, "!m:" .. previous, record) end
end
return previous
