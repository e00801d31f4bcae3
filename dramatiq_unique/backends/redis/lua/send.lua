-- send: take a new message's enqueue lock and, only when it is taken,
-- enqueue the message with the Redis broker's own script, in one round
-- trip (see dramatiq_unique/send/fastpath.py).
--
-- "--@include dispatch" is the broker's dispatch.lua, given by the
-- caller, wrapped as a local function of (KEYS, ARGV) ahead of this
-- file's libraries, so that no name of theirs is in its scope: the lock
-- is taken as acquire.lua takes it, and the message is enqueued by
-- Dramatiq's own code, unchanged.  Only for a standalone Redis: the lock and the
-- queues are in different Cluster slots.
--
-- KEYS[1]  the enqueue lock hash (see _take.lua)
-- KEYS[2]  the broker's namespace (dispatch.lua's KEYS[1])
-- ARGV[1]  owner (message id)  ARGV[2] ttl ms  ARGV[3] limit
-- ARGV[4]  lock type           ARGV[5] lock args JSON, or ""
-- ARGV[6]  provisional ms: 0, the lock is confirmed at once since the
--          message is published in the same script
-- ARGV[7]  "1" to keep the owner's enqueue record, "0" not to
-- ARGV[8]  where the message is being published, for the record
-- ARGV[9...]  dispatch.lua's ARGV for its "enqueue" command: command,
--          timestamp, queue name, broker id, heartbeat timeout, dead
--          message ttl, do maintenance, max unpack size, redis message
--          id, encoded message
--
-- Returns the fence alone when the lock was taken and the message
-- enqueued (the common reply, the cheapest to read), else take()'s
-- {status, holder, fence, confirm}: nothing was enqueued when status is
-- 0.  Returns {4, error, 0, 0} when dispatch.lua failed: a lock this
-- call took is dropped again, so a message that is not enqueued leaves
-- no lock behind.
local function dispatch(KEYS, ARGV)
--@include dispatch
end
--@include _take
--@include _drop
local owner = ARGV[1]
local where = nil
if ARGV[7] == "1" then where = ARGV[8] end
local got = take(KEYS[1], owner, ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], where)
if got[1] == 0 then return got end
local args = {}
for i = 9, #ARGV do args[i - 8] = ARGV[i] end
-- A new message re-enters only its own lock when the client resent this
-- call after a lost reply: enqueue it once, and report the lock as taken
-- by this send.  (The same message sent twice re-enters its lock too.)
if got[1] == 2 and redis.call("HEXISTS", KEYS[2] .. ":" .. args[3] .. ".msgs", args[9]) == 1 then
  return got[3]
end
local ok, failure = pcall(dispatch, {KEYS[2]}, args)
if not ok then
  if got[1] == 1 then drop(KEYS[1], owner) end
  if type(failure) == "table" then failure = failure.err end
  return {4, tostring(failure), 0, 0}
end
if got[1] == 1 then return got[3] end
return got
