-- Limits save: a rate-limit layer's table of limits replaced only if the store holds the
-- version the writer read (compare-and-set), and the change kept in the table's history.
--
-- Safe to run twice: a re-sent save names the version it read, which its first run raised, so
-- it saves nothing.
--
-- KEYS[1]  the table: a hash of `v` (its version) and `doc` (its text)
-- KEYS[2]  its history (same hash tag): a list of changes, the newest first
-- ARGV[1]  the version the writer read; 0 when there was no table
-- ARGV[2]  the new table's text
-- ARGV[3]  the change's note (one line)
-- ARGV[4]  how many changes the history keeps
-- ARGV[5]  the deadline in microseconds of store time: received from then on, the call does
--          nothing
-- Returns  {1, version} when saved as that version, {0, version} when the store held another;
--          -1 when received after the deadline
-- Cost     O(1) but for the history's trim: TIME, HGET, HSET, LPUSH, LTRIM.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
if now >= tonumber(ARGV[5]) then return -1 end
local held = tonumber(redis.call('HGET', KEYS[1], 'v') or '0')
if held ~= tonumber(ARGV[1]) then return {0, held} end
local version = held + 1
redis.call('HSET', KEYS[1], 'v', version, 'doc', ARGV[2])
-- the change: the table's text, then lines of its own that a table's reader skips
local at_ms = string.format('%d', math.floor(now / 1000))
redis.call('LPUSH', KEYS[2],
  ARGV[2] .. 'version ' .. version .. '\nat ' .. at_ms .. '\nnote ' .. ARGV[3] .. '\n')
redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[4]) - 1)
return {1, version}
