-- A caller's line of waiters for room (RateStore::line_up and leave_line): the order in which
-- copies' waiting requests ask for room.
--
-- KEYS[1]  the line: a sorted set of waiters, each scored by when it first lined up (µs of store
--          time); ties go by the waiter, whose 16 hex digits sort as its number
-- KEYS[2]  the places: the same waiters, each scored by when its place lapses (same hash tag)
-- ARGV[1]  the waiter (16 hex digits)
-- ARGV[2]  how long its place is kept, in milliseconds; 0: it leaves the line
-- ARGV[3]  the deadline in microseconds of store time: a line-up received from then on does
--          nothing (leaving takes none: it is never regretted)
-- Returns  the number of waiters ahead of it (0 once it left); -1 when received after the
--          deadline
-- Cost     O(log n + lapsed): TIME, ZRANGEBYSCORE (ZREM, ZREMRANGEBYSCORE of the lapsed), two
--          ZADD, two PTTL, ZRANK; leaving: two ZREM.
--
-- Safe to run twice: a waiter keeps the place it first took (ZADD NX), until it leaves or its
-- place lapses.
local waiter, keep = ARGV[1], tonumber(ARGV[2])
if keep == 0 then
  redis.call('ZREM', KEYS[1], waiter)
  redis.call('ZREM', KEYS[2], waiter)
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
-- too late: the caller gave up on this call at its deadline
if now >= tonumber(ARGV[3]) then return -1 end
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
if #lapsed > 0 then
  redis.call('ZREM', KEYS[1], unpack(lapsed))
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
end
redis.call('ZADD', KEYS[1], 'NX', string.format('%.0f', now), waiter)
-- 2^53: the ends stay exact in the scores' doubles
local ends = math.min(now + keep * 1000, 9007199254740992)
redis.call('ZADD', KEYS[2], string.format('%.0f', ends), waiter)
-- both sets outlive the longest place
for q = 1, 2 do
  if redis.call('PTTL', KEYS[q]) < keep then redis.call('PEXPIRE', KEYS[q], ARGV[2]) end
end
return redis.call('ZRANK', KEYS[1], waiter)
