-- Claim: one conditional write. The first caller stores its holder id; later callers learn who
-- holds the claim, atomically with their failed attempt.
--
-- Safe to run twice: a claim already held by this very holder (the same attempt re-sent, or a
-- retry with the same holder id) answers "won" again, and says that it wrote nothing (so that a
-- durable write's undo leaves it alone).
--
-- KEYS[1]  the claim
-- ARGV[1]  holder id of this caller
-- ARGV[2]  time to live in milliseconds; 0 keeps the claim until deleted
-- ARGV[3]  the deadline in microseconds of store time: received from then on, the call does
--          nothing
-- Returns  {1, holder} when this call made the claim, {2, holder} when this holder held it
--          already, {0, holder} when another holds it; -1 when received after the deadline
-- Cost     O(1): TIME, SET NX, plus GET when it was set already.
-- too late: the caller gave up on this call at its deadline
local t = redis.call('TIME')
if tonumber(t[1]) * 1000000 + tonumber(t[2]) >= tonumber(ARGV[3]) then return -1 end
local ok
if tonumber(ARGV[2]) > 0 then
  ok = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
else
  ok = redis.call('SET', KEYS[1], ARGV[1], 'NX')
end
if ok then return {1, ARGV[1]} end
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then return {2, holder} end
return {0, holder}
