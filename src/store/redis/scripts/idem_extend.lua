-- Idempotency: extend the lease of a claim this owner still holds and still runs.
--
-- Safe to run twice: a second run resets the lease again, from a moment later.
--
-- KEYS[1]  the idempotency record (see idem_begin.lua)
-- ARGV[1]  the owner token
-- ARGV[2]  the new lease in milliseconds, from now
-- ARGV[3]  the deadline in microseconds of store time: received from then on, the call does
--          nothing
-- Returns  1 when extended; 0 when the claim is no longer this owner's, or is done; -1 when
--          received after the deadline
-- Cost     O(1): TIME, HMGET, plus PEXPIRE.
-- too late: the caller gave up on this call at its deadline
local t = redis.call('TIME')
if tonumber(t[1]) * 1000000 + tonumber(t[2]) >= tonumber(ARGV[3]) then return -1 end
local rec = redis.call('HMGET', KEYS[1], 's', 't')
if rec[1] ~= 'run' or rec[2] ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
