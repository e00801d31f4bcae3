-- acquire: take one of ARGV[3] slots of a lock for an owner.
--
-- KEYS[1]  the lock hash: field <owner> = deadline (server ms),
--          "!fence" = last fencing token, "!lock" = lock type,
--          "!args" = lock args JSON (only when recorded),
--          "!m:<owner>" = the enqueue record of an owner (see below).
-- ARGV[1]  owner      ARGV[2] ttl ms      ARGV[3] limit
-- ARGV[4]  lock type  ARGV[5] lock args JSON, or "" to record none
-- ARGV[6]  optional, provisional ms: 0 (or absent) takes ttl at once;
--          otherwise a new slot (or one still provisional) lasts
--          min(provisional, ttl) until confirm.lua gives it its full ttl
-- ARGV[7]  optional: where the message is being published (opaque
--          text); when given, the owner's enqueue record is kept
--
-- The enqueue record is "<taken ms>|<provisional until ms, 0 when
-- confirmed>|<where>\n<where before>": the reaper looks for the message
-- at both places, so a message moving between queues is never missed.
--
-- Returns {status, holder, fence, provisional}: status 1 acquired, 2
-- re-entered, 0 held by others (holder names one of them);
-- provisional 1 when the caller must confirm the slot once published.
-- Expired holders are dropped first; the key expires with its last
-- holder's deadline.
local key, owner = KEYS[1], ARGV[1]
local time = redis.call("TIME")
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local ttl, provisional = tonumber(ARGV[2]), tonumber(ARGV[6] or "0")
local deadline, pending = now + ttl, 0
if provisional > 0 and provisional < ttl then
  pending = now + provisional
end
local fields = redis.call("HGETALL", key)
local live, other, mine, latest, fence = 0, false, false, 0, 0
for i = 1, #fields, 2 do
  local name, value = fields[i], tonumber(fields[i + 1])
  if name == "!fence" then
    fence = value
  elseif string.sub(name, 1, 1) ~= "!" then
    if value <= now then
      redis.call("HDEL", key, name, "!m:" .. name)
    elseif name == owner then
      mine = value
    else
      live, other = live + 1, name
      if value > latest then latest = value end
    end
  end
end
local where_now = ARGV[7]
local record = where_now ~= nil
local function write_record(taken, until_ms, before)
  local text = string.format("%.0f|%.0f|%s\n%s", taken, until_ms, where_now, before)
  redis.call("HSET", key, "!m:" .. owner, text)
end
if mine then
  local old = redis.call("HGET", key, "!m:" .. owner)
  local taken, was_pending, where = now, 0, ""
  if old then
    local t, p, w = string.match(old, "^(%d+)|(%d+)|([^\n]*)")
    taken, was_pending, where = tonumber(t) or now, tonumber(p) or 0, w or ""
  end
  -- A confirmed slot is re-entered by a retry, a delay-queue move or a
  -- reschedule, whose original stays in the broker until the copy is
  -- published: it takes its full ttl at once.  A slot still waiting
  -- for its first confirmation (a RabbitMQ publish retry) stays
  -- provisional.
  if was_pending == 0 then pending = 0 end
  if pending > 0 then deadline = pending end
  if mine > deadline then deadline = mine end
  if pending > 0 then pending = deadline end
  redis.call("HSET", key, owner, string.format("%.0f", deadline))
  if record then
    if where == where_now then
      where = string.match(old or "", "\n(.*)$") or ""
    end
    write_record(taken, pending, where)
  end
  redis.call("PEXPIREAT", key, string.format("%.0f", math.max(latest, deadline)))
  local confirm = 0
  if pending > 0 then confirm = 1 end
  return {2, owner, fence, confirm}
end
if live >= tonumber(ARGV[3]) then
  return {0, other, fence, 0}
end
if pending > 0 then deadline = pending end
fence = math.max(fence + 1, tonumber(time[1]) * 1000000 + tonumber(time[2]))
redis.call("HSET", key, owner, string.format("%.0f", deadline), "!fence", string.format("%.0f", fence), "!lock", ARGV[4])
if ARGV[5] ~= "" then redis.call("HSET", key, "!args", ARGV[5]) end
if record then write_record(now, pending, "") end
if deadline > latest then latest = deadline end
redis.call("PEXPIREAT", key, string.format("%.0f", latest))
local confirm = 0
if pending > 0 then confirm = 1 end
return {1, owner, fence, confirm}
