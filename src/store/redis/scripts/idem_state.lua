-- Idempotency inspection: a record's state and the time it has left. Reads only.
--
-- KEYS[1]  the idempotency record (see idem_begin.lua)
-- KEYS[2]  its pending marker (see idem_begin.lua)
-- Returns  {0} no record; {1, lease_left_ms, age_ms} a request with the key runs (or its
--          completion is not acknowledged yet, as idem_begin.lua answers it); {2,
--          retention_left_ms, response, age_ms} completed. age_ms: since the record was claimed,
--          -1 for a record claimed before its hash kept the time (no field c)
-- Cost     O(1): TIME, HMGET, GET, PTTL.
--
-- Writes nothing, so it may run any number of times.
local rec = redis.call('HMGET', KEYS[1], 's', 't', 'r', 'c')
if not rec[1] then return {0} end
local age = -1
if rec[4] then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  age = math.max(0, math.floor((now - tonumber(rec[4])) / 1000))
end
if rec[1] == 'done' then
  if redis.call('GET', KEYS[2]) ~= rec[2] then
    return {2, redis.call('PTTL', KEYS[1]), rec[3], age}
  end
  return {1, redis.call('PTTL', KEYS[2]), age}
end
return {1, redis.call('PTTL', KEYS[1]), age}
