-- Permit release: give a permit back, only while the holder still has it, and note this release
-- call among the recent ones; a place the holder keeps in the queue is given up too.
--
-- Safe to run twice: a second run of the same call (a re-sent command) finds itself noted and
-- answers "released" again instead of "not held"; another release call answers 0. The notes are
-- a sorted set of call ids scored by store time, each dropped once older than its lifetime, so
-- that releases of many holders never overwrite each other's notes.
--
-- KEYS[1]  the permits (see permit_acquire.lua)
-- KEYS[2]  the recent release calls (same hash tag)
-- KEYS[3]  the queue, KEYS[4] the waiters' places (see permit_acquire.lua)
-- ARGV[1]  the holder's token
-- ARGV[2]  lifetime of a note in milliseconds
-- ARGV[3]  a random id of this release call
-- Returns  1 when given back (now, or by an earlier run of this call), 0 when the holder has no
--          unexpired permit
-- Cost     O(log n + expired notes): TIME, EXISTS (with waiters: ZREM twice), ZSCORE, plus ZREM, ZREMRANGEBYSCORE, ZADD, PEXPIRE
--          on a match, or ZSCORE of the note otherwise.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
if redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('ZREM', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[4], ARGV[1])
end
local ends = redis.call('ZSCORE', KEYS[1], ARGV[1])
if ends then
  redis.call('ZREM', KEYS[1], ARGV[1])
  if tonumber(ends) > now then
    local life = tonumber(ARGV[2])
    redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - life * 1000)
    redis.call('ZADD', KEYS[2], string.format('%.0f', now), ARGV[3])
    redis.call('PEXPIRE', KEYS[2], life)
    return 1
  end
end
if redis.call('ZSCORE', KEYS[2], ARGV[3]) then return 1 end
return 0
