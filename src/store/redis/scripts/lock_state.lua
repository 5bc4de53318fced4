-- Lock inspection: who holds a lock, for how long still, and its last fencing token. Reads only.
--
-- KEYS[1]  the lock (holds the owner's random token; see lock_acquire.lua)
-- KEYS[2]  the fencing counter of this lock name (same hash tag)
-- Returns  {holder or nil, lease_left_ms (0 when free, -1 without expiry), fence or nil}
-- Cost     O(1): GET, PTTL, GET.
--
-- Writes nothing, so it may run any number of times.
local holder = redis.call('GET', KEYS[1])
local left = 0
if holder then left = redis.call('PTTL', KEYS[1]) end
return {holder, left, redis.call('GET', KEYS[2])}
