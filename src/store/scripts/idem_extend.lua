-- Idempotency: extend the lease of a claim this owner still holds and still runs.
--
-- Safe to run twice: a second run resets the lease again, from a moment later.
--
-- KEYS[1]  the idempotency record (see idem_begin.lua)
-- ARGV[1]  the owner token
-- ARGV[2]  the new lease in milliseconds, from now
-- Returns  1 when extended; 0 when the claim is no longer this owner's, or is done
-- Cost     O(1): HMGET, plus PEXPIRE.
local rec = redis.call('HMGET', KEYS[1], 's', 't')
if rec[1] ~= 'run' or rec[2] ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
