-- Idempotency: store the response of a request whose claim this owner still holds.
--
-- KEYS[1]  the idempotency record (see idem_begin.lua)
-- ARGV[1]  the owner token
-- ARGV[2]  the encoded response
-- ARGV[3]  retention of the completed record in milliseconds
-- Returns  1 when stored; 0 when the claim is no longer this owner's (its lease ran out, and it
--          expired or another request took it over): nothing is written then
-- Cost     O(1): HGET, then HSET, HDEL, PEXPIRE.
if redis.call('HGET', KEYS[1], 't') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 's', 'done', 'r', ARGV[2])
redis.call('HDEL', KEYS[1], 't')
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
