-- Permit inspection: the permits of a key in use, each with its lease left, and the waiters
-- that keep a place in its queue. Reads only.
--
-- KEYS[1]  the permits: a sorted set of holders' tokens scored by the end of each lease in
--          microseconds of store time (see permit_acquire.lua)
-- KEYS[2]  the waiters' places: tokens scored by when each place lapses (same hash tag)
-- Returns  {waiting, lease_left_ms, ...}: the number of waiters whose place has not lapsed, then
--          the time each unexpired permit has left, shortest first
-- Cost     O(log n + m): TIME, ZRANGEBYSCORE of the m permits held, ZCOUNT.
--
-- Leases that ended and places that lapsed are skipped, not removed: it writes nothing, so it
-- may run any number of times.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local after = '(' .. string.format('%.0f', now)
local held = redis.call('ZRANGEBYSCORE', KEYS[1], after, '+inf', 'WITHSCORES')
local out = {redis.call('ZCOUNT', KEYS[2], after, '+inf')}
for i = 2, #held, 2 do
  out[#out + 1] = math.floor((tonumber(held[i]) - now) / 1000)
end
return out
