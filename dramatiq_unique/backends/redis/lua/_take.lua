-- Library: take one of limit slots of a lock hash for an owner.
--
-- The lock hash: field <owner> = deadline (server ms), "!fence" = last
-- fencing token, "!lock" = lock type, "!args" = lock args JSON (only
-- when recorded), "!m:<owner>" = the enqueue record of an owner:
-- "<taken ms>|<provisional until ms, 0 when confirmed>|<where>\n<where
-- before>" (the reaper looks for the message at both places, so a
-- message moving between queues is never missed).
--
-- take(key, owner, ttl, limit, lock, args, provisional, where) returns
-- {status, holder, fence, confirm}: status 1 acquired, 2 re-entered, 0
-- held by others (holder names one of them); confirm 1 when the slot is
-- provisional and the caller must confirm it once its message is
-- published (see confirm.lua).  provisional (ms, 0 or nil for none):
-- a new slot, or one still provisional, lasts min(provisional, ttl)
-- until confirmed; a confirmed slot that is re-entered takes ttl at
-- once.  where (nil for none): keep the owner's enqueue record, naming
-- where its message is being published.  A new slot taken without
-- where (a run lock) still records when it was taken, with no place:
-- "<taken ms>|0|\n".  Expired holders are dropped first; the key
-- expires with its last holder's deadline.
--
-- A run lock's release that hands the key to a waiter reserves the
-- freed slot for the waiter's message: field "!r:<message id>" =
-- deadline (server ms).  A live reservation counts as a holder for
-- every owner but that message's own ("<message id>/<token>"), whose
-- take consumes it.  ahead (optional): a function called when a slot
-- is free for the owner and none is reserved for it; when it returns
-- true (an older waiter is in line), nothing is taken and status is 5.
local function take(key, owner, ttl, limit, lock, args, provisional, where, ahead)
  local time = redis.call("TIME")
  local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
  ttl, provisional = tonumber(ttl), tonumber(provisional or "0")
  local deadline, pending = now + ttl, 0
  if provisional > 0 and provisional < ttl then pending = now + provisional end
  local record = where ~= nil
  local fields = redis.call("HGETALL", key)
  local live, other, mine, latest, fence = 0, false, false, 0, 0
  local message = string.match(owner, "^([^/]*)")
  local reserved = false
  for i = 1, #fields, 2 do
    local name, value = fields[i], tonumber(fields[i + 1])
    if name == "!fence" then
      fence = value
    elseif string.sub(name, 1, 3) == "!r:" then
      if value <= now then
        redis.call("HDEL", key, name)
      elseif string.sub(name, 4) == message then
        reserved = true
      else
        live, other = live + 1, string.sub(name, 4)
        if value > latest then latest = value end
      end
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
  local function write_record(taken, until_ms, before)
    local text = string.format("%.0f|%.0f|%s\n%s", taken, until_ms, where, before)
    redis.call("HSET", key, "!m:" .. owner, text)
  end
  if mine then
    local old = redis.call("HGET", key, "!m:" .. owner)
    local taken, was_pending, was_where = now, 0, ""
    if old then
      local t, p, w = string.match(old, "^(%d+)|(%d+)|([^\n]*)")
      taken, was_pending, was_where = tonumber(t) or now, tonumber(p) or 0, w or ""
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
      local before = was_where
      if was_where == where then before = string.match(old or "", "\n(.*)$") or "" end
      write_record(taken, pending, before)
    end
    redis.call("PEXPIREAT", key, string.format("%.0f", math.max(latest, deadline)))
    return {2, owner, fence, pending > 0 and 1 or 0}
  end
  if live >= tonumber(limit) then
    return {0, other, fence, 0}
  end
  if reserved then
    redis.call("HDEL", key, "!r:" .. message)
  elseif ahead and ahead() then
    return {5, false, fence, 0}
  end
  if pending > 0 then deadline = pending end
  fence = math.max(fence + 1, tonumber(time[1]) * 1000000 + tonumber(time[2]))
  -- One HSET: the slot, the fence, the lock type and the owner's record
  -- (its taken time, and where its message goes when recorded).
  local stamp = string.format("%.0f|%.0f|%s\n", now, pending, where or "")
  redis.call("HSET", key, owner, string.format("%.0f", deadline), "!fence", string.format("%.0f", fence), "!lock", lock,
    "!m:" .. owner, stamp)
  if args ~= "" then redis.call("HSET", key, "!args", args) end
  if deadline > latest then latest = deadline end
  redis.call("PEXPIREAT", key, string.format("%.0f", latest))
  return {1, owner, fence, pending > 0 and 1 or 0}
end
