-- Library: the live-holders scan of a lock hash (see _take.lua).
--
-- holders(key, now, visit) reads the hash and calls visit(name, value,
-- kind) for each field, in the hash's order; it writes nothing and
-- returns nothing.  kind is:
-- * "live": a holder, name the owner, value its deadline (a number)
--   after now;
-- * "lapsed": a holder whose deadline is not after now;
-- * "reserved": a live reservation ("!r:<message id>"), name the
--   message id, value its deadline;
-- * "stale": a reservation that ran out, name the field;
-- * "meta": any other "!" field, value as stored ("!fence", "!lock",
--   "!m:<owner>", replace.lua's fields).
-- A visitor, not a table of holders: take() runs on every job.
local function holders(key, now, visit)
  local fields = redis.call("HGETALL", key)
  for i = 1, #fields, 2 do
    local name, value = fields[i], fields[i + 1]
    if string.sub(name, 1, 3) == "!r:" then
      local deadline = tonumber(value)
      if deadline > now then visit(string.sub(name, 4), deadline, "reserved") else visit(name, deadline, "stale") end
    elseif string.sub(name, 1, 1) == "!" then
      visit(name, value, "meta")
    else
      local deadline = tonumber(value)
      visit(name, deadline, deadline > now and "live" or "lapsed")
    end
  end
end

-- drop_lapsed(key, name): remove a lapsed owner and its enqueue record.
-- Returns nothing.
local function drop_lapsed(key, name)
  redis.call("HDEL", key, name, "!m:" .. name)
end
