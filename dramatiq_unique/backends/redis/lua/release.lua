--@include _drop
--@include _claim
-- release: remove one owner from a lock, checking that it holds it,
-- and hand the freed slot to the longest waiter, reserved for it.
--
-- KEYS[1]  the lock hash (see _take.lua)
-- KEYS[2]  waiters: zset message id -> order (see join_line.lua)
-- KEYS[3]  bodies: hash message id -> encoded message
-- KEYS[4]  optional: the message record of the owner's message
-- ARGV[1]  owner      ARGV[2] "1" to hand the slot to a waiter, "0" not to
-- ARGV[3]  with KEYS[4]: the owner's message id
-- ARGV[4]  "1" when the owner's run succeeded (it finishes its message),
--          "0" or absent when it failed or is unknown
-- ARGV[5]  how long the slot stays reserved for the promoted waiter, ms
--          (default 10000)
--
-- Returns held alone when no waiter was promoted (the common reply, one
-- integer, which costs the client less to read than an array), else
-- {held, message}: held 1 when the owner held a live slot, 0 when it
-- was absent or had lapsed; message is the encoded message of the
-- promoted waiter.  Nothing is handed over by an owner
-- that held nothing.  The promoted waiter's slot is reserved for its
-- message (field "!r:<message id>", see _take.lua) until a copy of it
-- takes it or the reservation runs out: every other copy waits.
local held, present = drop(KEYS[1], ARGV[1])
-- The run of a rescheduled message ended: if it succeeded, later copies
-- of it are duplicates; if not, its next copy runs.
if KEYS[4] and redis.call("HGET", KEYS[4], "runner") == ARGV[1] then
  if ARGV[4] == "1" then
    local ran = redis.call("HGET", KEYS[4], "ran")
    local attempt, via, retries = string.match(ran, "^(%d+)|([^|]*)|(%d+)$")
    finish(KEYS[4], KEYS[2], KEYS[3], ARGV[3], attempt, via, retries, ARGV[1])
  else
    redis.call("HDEL", KEYS[4], "runner", "ran")
  end
end
if ARGV[2] ~= "1" or not present then return held end
while true do
  local first = redis.call("ZPOPMIN", KEYS[2])
  if #first == 0 then return held end
  local message = redis.call("HGET", KEYS[3], first[1])
  redis.call("HDEL", KEYS[3], first[1])
  if message then
    reserve(KEYS[1], first[1], tonumber(ARGV[5] or "10000"))
    return {held, message}
  end
end
