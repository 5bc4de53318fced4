-- Lock acquisition with a fencing token.
--
-- KEYS[1]  the lock (holds the owner's random token)
-- KEYS[2]  the fencing counter of this lock name (same hash tag)
-- ARGV[1]  the owner's random token
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  lifetime of the fencing counter in milliseconds (refreshed on every acquisition)
-- Returns  {1, fencing_token} when acquired; {0, lease_left_ms} when another owner holds it
-- Cost     O(1): SET NX PX, GET, SET on success (plus TIME for a new counter); PTTL on failure.
--
-- The fencing token strictly increases on every acquisition of one lock name: the counter plus
-- one, or — when the counter is new, expired or lost with the store — the store time in
-- microseconds. Every token is at most the store time of its acquisition (scripts run one at a
-- time, each for over a microsecond), so a restarted counter still starts above all earlier
-- tokens, as long as the store's clock does not go back.
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {0, redis.call('PTTL', KEYS[1])}
end
local last = redis.call('GET', KEYS[2])
local fence
if last then
  fence = tonumber(last) + 1
else
  local t = redis.call('TIME')
  fence = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
redis.call('SET', KEYS[2], string.format('%.0f', fence), 'PX', ARGV[3])
return {1, fence}
