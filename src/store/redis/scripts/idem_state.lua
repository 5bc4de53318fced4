-- Idempotency inspection: a record's state and the time it has left. Reads only.
--
-- KEYS[1]  the idempotency record (see idem_begin.lua)
-- KEYS[2]  its pending marker (see idem_begin.lua)
-- Returns  {0} no record; {1, lease_left_ms} a request with the key runs (or its completion
--          is not acknowledged yet, as idem_begin.lua answers it); {2, retention_left_ms,
--          response} completed
-- Cost     O(1): HMGET, GET, PTTL.
--
-- Writes nothing, so it may run any number of times.
local rec = redis.call('HMGET', KEYS[1], 's', 't', 'r')
if not rec[1] then return {0} end
if rec[1] == 'done' then
  if redis.call('GET', KEYS[2]) ~= rec[2] then
    return {2, redis.call('PTTL', KEYS[1]), rec[3]}
  end
  return {1, redis.call('PTTL', KEYS[2])}
end
return {1, redis.call('PTTL', KEYS[1])}
