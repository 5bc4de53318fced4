-- Confirm: a durable write that replicas acknowledged is no longer pending — drop its marker, only
-- while the marker still names this write's holder or token.
--
-- Safe to run twice, and late: a marker that names another holder is left alone.
--
-- KEYS[1]  a pending marker (see claim.lua, idem_complete.lua)
-- ARGV[1]  the holder or token of the acknowledged write
-- Returns  1 when the marker was dropped, 0 when it names another or is gone
-- Cost     O(1): GET, plus DEL on a match.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
