--@include _drop
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
local held = drop(key, owner)
return held
