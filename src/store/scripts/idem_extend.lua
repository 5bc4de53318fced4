-- Idempotency: extend the lease of a claim this owner still holds.
--
-- KEYS[1]  the idempotency record (see idem_begin.lua)
-- ARGV[1]  the owner token
-- ARGV[2]  the new lease in milliseconds, from now
-- Returns  1 when extended; 0 when the claim is no longer this owner's
-- Cost     O(1): HGET, plus PEXPIRE.
if redis.call('HGET', KEYS[1], 't') ~= ARGV[1] then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
