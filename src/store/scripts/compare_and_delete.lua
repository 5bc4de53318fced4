-- Release: delete the key only while it still holds the caller's token.
--
-- KEYS[1]  a lock or claim
-- ARGV[1]  the caller's token
-- Returns  1 when deleted, 0 when the key is gone or holds another token
-- Cost     O(1): GET, plus DEL on a match.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
