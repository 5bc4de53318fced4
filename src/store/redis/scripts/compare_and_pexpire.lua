-- Extend: reset the key's lease only while it still holds the caller's token.
--
-- Safe to run twice: a second run resets the lease again, from a moment later.
--
-- KEYS[1]  a lock
-- ARGV[1]  the caller's token
-- ARGV[2]  the new lease in milliseconds, from now
-- ARGV[3]  the deadline in microseconds of store time: received from then on, the call does
--          nothing
-- Returns  1 when extended, 0 when the key is gone or holds another token; -1 when received
--          after the deadline
-- Cost     O(1): TIME, GET, plus PEXPIRE on a match.
-- too late: the caller gave up on this call at its deadline
local t = redis.call('TIME')
if tonumber(t[1]) * 1000000 + tonumber(t[2]) >= tonumber(ARGV[3]) then return -1 end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
