-- Limits load: a rate-limit layer's table of limits and its version, or its history.
--
-- KEYS[1]  the table: a hash of `v` (its version) and `doc` (its text)
-- KEYS[2]  its history (same hash tag): a list of changes, the newest first
-- ARGV[1]  `table` or `history`
-- Returns  {version, text} of the table ({false, false} when there is none), or every change
-- Cost     O(1) for the table; O(changes kept) for the history.
if ARGV[1] == 'history' then return redis.call('LRANGE', KEYS[2], 0, -1) end
return redis.call('HMGET', KEYS[1], 'v', 'doc')
