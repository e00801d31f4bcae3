--@include _now
--@include _holders
--@include _record
-- Library: take one of limit slots of a lock hash for an owner.
--
-- The lock hash: field <owner> = deadline (server ms), "!fence" = last
-- fencing token, "!lock" = lock type, "!args" = lock args JSON (only
-- when recorded), "!m:<owner>" = the enqueue record of an owner (see
-- _record.lua).
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

-- A re-entered slot: a confirmed one is re-entered by a retry, a
-- delay-queue move or a reschedule, whose original stays in the broker
-- until the copy is published: it takes its full ttl at once.  A slot
-- still waiting for its first confirmation (a RabbitMQ publish retry)
-- stays provisional.  Returns take()'s reply.
local function reenter(key, owner, now, deadline, pending, mine, latest, fence, old, where)
  local taken, was_pending, was_where, was_before = read_record(old)
  taken, was_where = taken or now, was_where or ""
  if (was_pending or 0) == 0 then pending = 0 end
  if pending > 0 then deadline = pending end
  if mine > deadline then deadline = mine end
  if pending > 0 then pending = deadline end
  redis.call("HSET", key, owner, string.format("%.0f", deadline))
  if where ~= nil then
    local before = was_where
    if was_where == where then before = was_before end
    redis.call("HSET", key, "!m:" .. owner, record_text(taken, pending, where, before))
  end
  redis.call("PEXPIREAT", key, string.format("%.0f", math.max(latest, deadline)))
  return {2, owner, fence, pending > 0 and 1 or 0}
end

local function take(key, owner, ttl, limit, lock, args, provisional, where, ahead)
  local now, micros = now_ms()
  ttl, provisional = tonumber(ttl), tonumber(provisional or "0")
  local deadline, pending = now + ttl, 0
  if provisional > 0 and provisional < ttl then pending = now + provisional end
  local message, record = string.match(owner, "^([^/]*)"), "!m:" .. owner
  local live, other, mine, latest, reserved, fence, old = 0, false, false, 0, false, 0, nil
  holders(key, now, function(name, value, kind)
    if kind == "meta" then
      if name == "!fence" then fence = tonumber(value) elseif name == record then old = value end
    elseif kind == "lapsed" then
      drop_lapsed(key, name)
    elseif kind == "stale" then
      redis.call("HDEL", key, name)
    elseif kind == "reserved" and name == message then
      reserved = true
    elseif kind == "live" and name == owner then
      mine = value
    else
      live, other = live + 1, name
      if value > latest then latest = value end
    end
  end)
  if mine then
    return reenter(key, owner, now, deadline, pending, mine, latest, fence, old, where)
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
  fence = math.max(fence + 1, micros)
  -- One HSET: the slot, the fence, the lock type and the owner's record
  -- (its taken time, and where its message goes when recorded).
  redis.call("HSET", key, owner, string.format("%.0f", deadline), "!fence", string.format("%.0f", fence), "!lock", lock,
    record, record_text(now, pending, where or "", ""))
  if args ~= "" then redis.call("HSET", key, "!args", args) end
  if deadline > latest then latest = deadline end
  redis.call("PEXPIREAT", key, string.format("%.0f", latest))
  return {1, owner, fence, pending > 0 and 1 or 0}
end
