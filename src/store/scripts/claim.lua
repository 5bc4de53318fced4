-- Claim: one conditional write. The first caller stores its holder id; later callers learn who
-- holds the claim, atomically with their failed attempt.
--
-- Safe to run twice: a claim already held by this very holder (the same attempt re-sent, or a
-- retry with the same holder id) answers "won" again.
--
-- KEYS[1]  the claim
-- ARGV[1]  holder id of this caller
-- ARGV[2]  time to live in milliseconds; 0 keeps the claim until deleted
-- Returns  {1, holder} when this caller holds the claim, {0, holder} when another holds it
-- Cost     O(1): SET NX, plus GET when it was set already.
local ok
if tonumber(ARGV[2]) > 0 then
  ok = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
else
  ok = redis.call('SET', KEYS[1], ARGV[1], 'NX')
end
if ok then return {1, ARGV[1]} end
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then return {1, holder} end
return {0, holder}
