-- Idempotency: look up a key and, when it is new, claim it for this request — atomically.
--
-- KEYS[1]  the idempotency record, a hash: s = "run" | "done", f = fingerprint,
--          t = the owner's token (kept once done), r = encoded response (when done),
--          c = when it was claimed, in microseconds of store time (for idem_state.lua)
-- KEYS[2]  its pending marker (same hash tag): the token of a completion that replicas have
--          not acknowledged yet, which reads as still running
-- ARGV[1]  the request fingerprint
-- ARGV[2]  a random owner token
-- ARGV[3]  the lease in milliseconds
-- ARGV[4]  the deadline in microseconds of store time: received from then on, the call does
--          nothing
-- Returns  {0} claimed for this request; {1, lease_left_ms} another request with this key runs;
--          {2} the key was used with another fingerprint; {3, response} completed; {4} claimed
--          by this token already (its lease reset); -1 when received after the deadline
-- Cost     O(1): TIME, HMGET, plus HSET and PEXPIRE to claim or PTTL while running.
--
-- Safe to run twice: a record this token claimed and still runs is claimed again (lease reset).
-- too late: the caller gave up on this call at its deadline
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
if now >= tonumber(ARGV[4]) then return -1 end
local rec = redis.call('HMGET', KEYS[1], 's', 'f', 'r', 't')
if not rec[1] then
  redis.call('HSET', KEYS[1], 's', 'run', 'f', ARGV[1], 't', ARGV[2], 'c', string.format('%.0f', now))
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {0}
end
if rec[2] ~= ARGV[1] then return {2} end
if rec[1] == 'done' then
  if redis.call('GET', KEYS[2]) ~= rec[4] then return {3, rec[3]} end
  -- completed, but not acknowledged yet: it may be undone, so it is still running
  return {1, redis.call('PTTL', KEYS[2])}
end
if rec[4] == ARGV[2] then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {4}
end
return {1, redis.call('PTTL', KEYS[1])}
