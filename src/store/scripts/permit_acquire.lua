-- Permit acquisition: one of at most `limit` holders of a key, with a lease and a fencing token.
--
-- KEYS[1]  the permits: a sorted set of holders' tokens, each scored by the end of its lease in
--          microseconds of store time
-- KEYS[2]  the fencing counter of this key (same hash tag)
-- ARGV[1]  the holder's random token
-- ARGV[2]  the limit: at most this many unexpired permits
-- ARGV[3]  lease in milliseconds
-- ARGV[4]  lifetime of the fencing counter in milliseconds (refreshed on every acquisition;
--          longer than any lease)
-- ARGV[5]  the deadline in microseconds of store time: received from then on, the call does
--          nothing
-- Returns  {1, fencing_token} when taken by this call; {2, fencing_token} when this holder had a
--          permit already (its lease reset, a new fencing token drawn); {0, ms} when every permit
--          is held, the first lease ending in ms; -1 when received after the deadline
-- Cost     O(log n + expired): TIME, ZREMRANGEBYSCORE, ZSCORE, ZCARD; then ZADD, PTTL, GET, SET
--          to acquire, or ZRANGE when full.
--
-- Fencing tokens as in lock_acquire.lua: above both the counter's last value and the store time
-- in microseconds. Safe to run twice: a holder that has a permit keeps that one permit.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
-- too late: the caller gave up on this call at its deadline
if now >= tonumber(ARGV[5]) then return -1 end
-- leases that ended give their permits back
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local tag = 1
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  tag = 2
elseif redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  -- a limit of 0 has no lease to wait for
  if not first[2] then return {0, 0} end
  return {0, math.ceil((tonumber(first[2]) - now) / 1000)}
end
local lease = tonumber(ARGV[3])
-- 2^53: the ends stay exact in the scores' doubles
local ends = math.min(now + lease * 1000, 9007199254740992)
redis.call('ZADD', KEYS[1], string.format('%.0f', ends), ARGV[1])
-- the set outlives its longest lease
if redis.call('PTTL', KEYS[1]) < lease then redis.call('PEXPIRE', KEYS[1], lease) end
local fence = now
local last = tonumber(redis.call('GET', KEYS[2]) or '0')
if last >= fence then fence = last + 1 end
redis.call('SET', KEYS[2], string.format('%.0f', fence), 'PX', ARGV[4])
return {tag, fence}
