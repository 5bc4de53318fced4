-- Lock acquisition with a fencing token.
--
-- KEYS[1]  the lock (holds the owner's random token)
-- KEYS[2]  the fencing counter of this lock name (same hash tag)
-- ARGV[1]  the owner's random token
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  lifetime of the fencing counter in milliseconds (refreshed on every acquisition;
--          longer than any lease)
-- ARGV[4]  the deadline in microseconds of store time: received from then on, the call does
--          nothing
-- Returns  {1, fencing_token} when acquired by this call; {2, fencing_token} when this owner
--          held it already (its lease reset); {0, lease_left_ms} when another owner holds it;
--          -1 when received after the deadline
-- Cost     O(1): TIME, GET; then SET PX, GET, SET to acquire, or PTTL when held.
--
-- Fencing tokens never repeat: each is above both the counter's last value and the store time in
-- microseconds, so a counter that expired, or came back stale from a restored or promoted store,
-- still hands out tokens above every earlier one — as long as the store's clock does not go back.
--
-- Safe to run twice: a lock that already holds this owner's token (the same attempt re-sent) is
-- acquired again with the same fencing token and a fresh lease.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
-- too late: the caller gave up on this call at its deadline
if now >= tonumber(ARGV[4]) then return -1 end
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  local drawn = redis.call('GET', KEYS[2])
  if drawn then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {2, tonumber(drawn)}
  end
elseif holder then
  return {0, redis.call('PTTL', KEYS[1])}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local fence = now
local last = tonumber(redis.call('GET', KEYS[2]) or '0')
if last >= fence then fence = last + 1 end
redis.call('SET', KEYS[2], string.format('%.0f', fence), 'PX', ARGV[3])
return {1, fence}
