-- send: take an enqueue lock and, only when it is taken, enqueue the
-- message with the Redis broker's own script, in one round trip.
--
-- Loaded behind acquire.lua and the broker's dispatch.lua, each wrapped
-- as a local function of (KEYS, ARGV): the lock follows acquire.lua's
-- rules and the message is enqueued by Dramatiq's own code, unchanged.
-- Only for a standalone Redis: the two keys are in different slots.
--
-- KEYS[1]  the broker's namespace       KEYS[2]  the enqueue lock hash
-- ARGV[1]  owner (message id)  ARGV[2] ttl ms  ARGV[3] limit
-- ARGV[4]  lock type           ARGV[5] lock args JSON, or ""
-- ARGV[6...]  dispatch.lua's arguments, as the broker passes them for
--          its "enqueue" command
--
-- Returns acquire.lua's reply: nothing was enqueued when status is 0.
local got = acquire({KEYS[2]}, {ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]})
if got[1] == 0 then return got end
local args = {}
for i = 6, #ARGV do args[i - 5] = ARGV[i] end
dispatch({KEYS[1]}, args)
return got
