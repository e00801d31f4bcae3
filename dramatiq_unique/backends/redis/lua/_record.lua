-- Library: an owner's enqueue record, field "!m:<owner>" of a lock hash:
-- "<taken ms>|<provisional until ms, 0 when confirmed>|<where>\n<where
-- before>" (the reaper looks for the message at both places, so a
-- message moving between queues is never missed).

-- record_text(taken, until_ms, where, before) returns the record's text.
local function record_text(taken, until_ms, where, before)
  return string.format("%.0f|%.0f|%s\n%s", taken, until_ms, where, before)
end

-- read_record(text) returns taken, until_ms (numbers), where, before:
-- the first three nil when text is nil, false or not a record; before
-- is what follows the first line, or "".
local function read_record(text)
  local taken, until_ms, where = string.match(text or "", "^(%d+)|(%d+)|([^\n]*)")
  return tonumber(taken), tonumber(until_ms), where, string.match(text or "", "\n(.*)$") or ""
end

-- confirmed_record(text) returns the record with no provisional
-- deadline ("<taken>|0|..."), the rest as it was; nil when text is nil,
-- false or not a record.
local function confirmed_record(text)
  local taken, rest = string.match(text or "", "^(%d+)|%d+|(.*)$")
  if taken then return taken .. "|0|" .. rest end
  return nil
end
