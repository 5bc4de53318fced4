-- Claim: one conditional write. The first caller stores its holder id; later callers learn who
-- holds the claim, atomically with their failed attempt.
--
-- Safe to run twice: a claim already held by this very holder (the same attempt re-sent, or a
-- retry with the same holder id) answers "won" again, and says that it did not make the claim
-- (so that a durable write's undo leaves it alone). A durable re-run marks it pending again:
-- that write is what its WAIT waits for, and it follows the claim's first write.
--
-- A durable claim (one that replicas must acknowledge) is marked pending until they have: others
-- then learn that it is in progress, not that it is taken, since it may yet be undone.
--
-- KEYS[1]  the claim
-- KEYS[2]  its pending marker (same hash tag): the holder of a claim not yet acknowledged
-- ARGV[1]  holder id of this caller
-- ARGV[2]  time to live in milliseconds; 0 keeps the claim until deleted
-- ARGV[3]  lifetime of the pending marker in milliseconds; 0 for a claim no replica must
--          acknowledge
-- ARGV[4]  the deadline in microseconds of store time: received from then on, the call does
--          nothing
-- Returns  {1, holder} when this call made the claim, {2, holder} when this holder held it
--          already, {0, holder} when another holds it, {3, holder} when another's claim is
--          pending; -1 when received after the deadline
-- Cost     O(1): TIME, SET NX (plus SET PX of the marker), or GET and EXISTS when it was set.
-- too late: the caller gave up on this call at its deadline
local t = redis.call('TIME')
if tonumber(t[1]) * 1000000 + tonumber(t[2]) >= tonumber(ARGV[4]) then return -1 end
local ok
if tonumber(ARGV[2]) > 0 then
  ok = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
else
  ok = redis.call('SET', KEYS[1], ARGV[1], 'NX')
end
if ok then
  if tonumber(ARGV[3]) > 0 then redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[3]) end
  return {1, ARGV[1]}
end
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  -- marked pending again: the write that a durable re-run's WAIT waits for
  if tonumber(ARGV[3]) > 0 then redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[3]) end
  return {2, holder}
end
if redis.call('GET', KEYS[2]) == holder then return {3, holder} end
return {0, holder}
