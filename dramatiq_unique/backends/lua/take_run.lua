-- take_run: take a run lock and release the same message's enqueue
-- lock, in one round trip (until_and_while_executing).  Both keys carry
-- the digest's hash tag, so they live in one Cluster slot.
--
-- Loaded behind acquire.lua and release.lua, each wrapped as a local
-- function of (KEYS, ARGV), so the two locks follow exactly the rules
-- of those scripts.
--
-- KEYS[1]  the run lock hash      KEYS[2]  the enqueue lock hash
-- ARGV[1]  run owner   ARGV[2] ttl ms   ARGV[3] limit   ARGV[4] lock type
-- ARGV[5]  the enqueue lock's owner (the message id)
--
-- Returns {status, holder, fence, queue_held}: the first three as
-- acquire.lua; queue_held as release.lua's held when the run lock was
-- taken, and -1 on a conflict, where the enqueue lock is left alone.
local got = acquire({KEYS[1]}, {ARGV[1], ARGV[2], ARGV[3], ARGV[4], ""})
if got[1] == 0 then return {0, got[2], got[3], -1} end
local released = release({KEYS[2], KEYS[2] .. ":wait", KEYS[2] .. ":tickets"}, {ARGV[5], "0"})
return {got[1], got[2], got[3], released[1]}
