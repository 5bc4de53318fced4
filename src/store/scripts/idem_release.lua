-- Idempotency: drop a claim this owner still holds, so that a retry runs again.
--
-- KEYS[1]  the idempotency record (see idem_begin.lua)
-- ARGV[1]  the owner token
-- Returns  1 when released; 0 when the claim is no longer this owner's
-- Cost     O(1): HGET, plus DEL.
if redis.call('HGET', KEYS[1], 't') ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
