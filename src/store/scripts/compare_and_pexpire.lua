-- Extend: reset the key's lease only while it still holds the caller's token.
--
-- Safe to run twice: a second run resets the lease again, from a moment later.
--
-- KEYS[1]  a lock
-- ARGV[1]  the caller's token
-- ARGV[2]  the new lease in milliseconds, from now
-- Returns  1 when extended, 0 when the key is gone or holds another token
-- Cost     O(1): GET, plus PEXPIRE on a match.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
