-- Idempotency: look up a key and, when it is new, claim it for this request — atomically.
--
-- KEYS[1]  the idempotency record, a hash: s = "run" | "done", f = fingerprint,
--          t = the owner's token (kept once done), r = encoded response (when done)
-- ARGV[1]  the request fingerprint
-- ARGV[2]  a random owner token
-- ARGV[3]  the lease in milliseconds
-- Returns  {0} claimed for this request; {1, lease_left_ms} another request with this key runs;
--          {2} the key was used with another fingerprint; {3, response} completed
-- Cost     O(1): HMGET, plus HSET and PEXPIRE to claim or PTTL while running.
--
-- Safe to run twice: a record this token claimed and still runs is claimed again (lease reset).
local rec = redis.call('HMGET', KEYS[1], 's', 'f', 'r', 't')
if not rec[1] then
  redis.call('HSET', KEYS[1], 's', 'run', 'f', ARGV[1], 't', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {0}
end
if rec[2] ~= ARGV[1] then return {2} end
if rec[1] == 'done' then return {3, rec[3]} end
if rec[4] == ARGV[2] then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {0}
end
return {1, redis.call('PTTL', KEYS[1])}
