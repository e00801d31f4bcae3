-- Library: the server's clock, which sets every deadline, so that the
-- clocks of the clients never matter.
--
-- now_ms() returns the server time (TIME) in ms, rounded down, and the
-- same instant in µs (the floor of a new fencing token).
local function now_ms()
  local time = redis.call("TIME")
  local seconds, micros = tonumber(time[1]), tonumber(time[2])
  return seconds * 1000 + math.floor(micros / 1000), seconds * 1000000 + micros
end
