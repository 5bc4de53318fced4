-- Reset: forgets what a caller has spent of a policy's limits, unless received too late. A reset
-- that timed out has then either run by its deadline or never will: held by a partition and
-- delivered later, it would erase what the caller was charged since its caller was told it
-- failed.
--
-- KEYS     the caller's keys under the policy: its limits', then the blocks of those with a
--          penalty (one hash tag)
-- ARGV[1]  the deadline in microseconds of store time: received from then on, the call does
--          nothing
-- Returns  the number of keys deleted; -1 when received after the deadline
-- Cost     O(n) in the number of keys: TIME and one DEL.
local t = redis.call('TIME')
if tonumber(t[1]) * 1000000 + tonumber(t[2]) >= tonumber(ARGV[1]) then return -1 end
return redis.call('DEL', unpack(KEYS))
