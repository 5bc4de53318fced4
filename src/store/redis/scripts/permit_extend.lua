-- Permit extension: reset a permit's lease, only while the holder still has it.
--
-- Safe to run twice: a second run resets the lease again, from a moment later.
--
-- KEYS[1]  the permits (see permit_acquire.lua)
-- ARGV[1]  the holder's token
-- ARGV[2]  the new lease in milliseconds, from now
-- ARGV[3]  the deadline in microseconds of store time: received from then on, the call does
--          nothing
-- Returns  1 when extended, 0 when the holder has no unexpired permit; -1 when received after
--          the deadline
-- Cost     O(log n): TIME, ZSCORE, plus ZADD XX and PTTL on a match.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
-- too late: the caller gave up on this call at its deadline
if now >= tonumber(ARGV[3]) then return -1 end
local ends = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not ends or tonumber(ends) <= now then return 0 end
local lease = tonumber(ARGV[2])
ends = math.min(now + lease * 1000, 9007199254740992)
redis.call('ZADD', KEYS[1], 'XX', string.format('%.0f', ends), ARGV[1])
if redis.call('PTTL', KEYS[1]) < lease then redis.call('PEXPIRE', KEYS[1], lease) end
return 1
