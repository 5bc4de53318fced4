-- Permit acquisition: one of at most `limit` holders of a key, with a lease and a fencing token;
-- permits go to waiters first, in arrival order.
--
-- KEYS[1]  the permits: a sorted set of holders' tokens, each scored by the end of its lease in
--          microseconds of store time
-- KEYS[2]  the fencing counter of this key (same hash tag)
-- KEYS[3]  the queue: a sorted set of waiters' tokens, scored by arrival (µs of store time)
-- KEYS[4]  the waiters' places: the same tokens, scored by when each place lapses
-- ARGV[1]  the holder's random token
-- ARGV[2]  the limit: at most this many unexpired permits
-- ARGV[3]  lease in milliseconds
-- ARGV[4]  lifetime of the fencing counter in milliseconds (refreshed on every acquisition;
--          longer than any lease)
-- ARGV[5]  how long a holder that must wait keeps its place in the queue, in milliseconds (0:
--          it does not queue)
-- ARGV[6]  the deadline in microseconds of store time: received from then on, the call does
--          nothing
-- Returns  {1, fencing_token} when taken by this call; {2, fencing_token} when this holder had a
--          permit already (its lease reset, a new fencing token drawn); {0, ms, ahead} when no
--          permit is free for it: the first lease ends in ms (0: none held), `ahead` waiters
--          arrived before it; -1 when received after the deadline
-- Cost     O(log n + expired): TIME, ZREMRANGEBYSCORE, EXISTS, ZSCORE, ZCARD (with waiters:
--          ZRANGEBYSCORE, ZRANK); then ZADD, PTTL, GET, SET to acquire, or ZADD of the place to
--          wait.
--
-- A permit is free for a holder while fewer waiters arrived before it than permits are free; a
-- holder that does not queue counts every waiter as before it. Fencing tokens as in
-- lock_acquire.lua: above both the counter's last value and the store time in microseconds.
-- Safe to run twice: a holder that has a permit keeps that one permit, a waiter its place.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
-- too late: the caller gave up on this call at its deadline
if now >= tonumber(ARGV[6]) then return -1 end
local token, wait = ARGV[1], tonumber(ARGV[5])
-- leases that ended give their permits back; places that lapsed leave the queue (a key without
-- waiters pays one EXISTS for its queue)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local queued = redis.call('EXISTS', KEYS[4]) == 1
if queued then
  local lapsed = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)
  if #lapsed > 0 then
    redis.call('ZREM', KEYS[3], unpack(lapsed))
    redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  end
end
local tag = 1
if redis.call('ZSCORE', KEYS[1], token) then
  tag = 2
else
  local held = redis.call('ZCARD', KEYS[1])
  local place, ahead = false, 0
  if queued then
    place = redis.call('ZRANK', KEYS[3], token)
    ahead = place or redis.call('ZCARD', KEYS[3])
  end
  if ahead >= tonumber(ARGV[2]) - held then
    if wait > 0 then
      if not place then redis.call('ZADD', KEYS[3], string.format('%.0f', now), token) end
      redis.call('ZADD', KEYS[4], string.format('%.0f', now + wait * 1000), token)
      for q = 3, 4 do
        if redis.call('PTTL', KEYS[q]) < wait then redis.call('PEXPIRE', KEYS[q], wait) end
      end
    end
    local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
    local ms = 0
    if first[2] then ms = math.ceil((tonumber(first[2]) - now) / 1000) end
    return {0, ms, ahead}
  end
  if place then
    redis.call('ZREM', KEYS[3], token)
    redis.call('ZREM', KEYS[4], token)
  end
end
local lease = tonumber(ARGV[3])
-- 2^53: the ends stay exact in the scores' doubles
local ends = math.min(now + lease * 1000, 9007199254740992)
redis.call('ZADD', KEYS[1], string.format('%.0f', ends), token)
-- the set outlives its longest lease
if redis.call('PTTL', KEYS[1]) < lease then redis.call('PEXPIRE', KEYS[1], lease) end
local fence = now
local last = tonumber(redis.call('GET', KEYS[2]) or '0')
if last >= fence then fence = last + 1 end
redis.call('SET', KEYS[2], string.format('%.0f', fence), 'PX', ARGV[4])
return {tag, fence}
