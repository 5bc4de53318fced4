-- Release: delete the key only while it still holds the caller's token, and leave a short-lived
-- marker naming this release call.
--
-- Safe to run twice: a second run of the same call (a re-sent command) finds its marker and
-- answers "released" again instead of "not held"; another release call answers 0.
--
-- KEYS[1]  a lock or claim
-- KEYS[2]  its release marker (same hash tag)
-- ARGV[1]  the caller's token
-- ARGV[2]  lifetime of the marker in milliseconds
-- ARGV[3]  a random id of this release call
-- Returns  1 when deleted (now, or by an earlier run of this call), 0 when the key is gone or
--          holds another token
-- Cost     O(1): GET, plus DEL and SET PX on a match, or GET of the marker otherwise.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
  return 1
end
if redis.call('GET', KEYS[2]) == ARGV[3] then return 1 end
return 0
