-- Idempotency: drop a claim this owner still holds and still runs, so that a retry runs again;
-- a completed record is never dropped.
--
-- Safe to run twice: a marker naming this release call answers a second run of the same call.
--
-- KEYS[1]  the idempotency record (see idem_begin.lua)
-- KEYS[2]  its release marker (same hash tag)
-- ARGV[1]  the owner token
-- ARGV[2]  lifetime of the marker in milliseconds
-- ARGV[3]  a random id of this release call
-- Returns  1 when released (now, or by an earlier run of this call); 0 when the claim is no
--          longer this owner's, or is done
-- Cost     O(1): HMGET, plus DEL and SET PX, or GET of the marker.
local rec = redis.call('HMGET', KEYS[1], 's', 't')
if rec[1] == 'run' and rec[2] == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
  return 1
end
if redis.call('GET', KEYS[2]) == ARGV[3] then return 1 end
return 0
