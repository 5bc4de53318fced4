-- Sliding-log script of the previous release (46da7fc), kept to measure against: benches/rate.rs.
-- Sliding-window log: exact. One sorted set per limit; a member per unit of admitted cost,
-- scored with the store's time in microseconds.
--
-- KEYS[i]     the log of limit i (all keys share one hash tag)
-- ARGV[1]     cost (integer >= 1)
-- ARGV[2]     the attempt id, unique per request (members are the id, or id..":"..n)
-- ARGV[1+2i]  quota of limit i
-- ARGV[2+2i]  window of limit i, microseconds
-- Returns     {admitted (0|1), retry_after_us, remaining_1, reset_us_1, remaining_2, reset_us_2, ...}
-- Cost        O(limits * log(entries)). Per limit it reads the oldest entry first, which both
--             tells whether anything left the window (only then it trims, and reads the new
--             oldest) and gives the reset; ZCARD only for a non-empty log; ZADD and PEXPIRE when
--             admitted. A new caller costs TIME, ZRANGE, ZADD, PEXPIRE. Denials write nothing.
-- Safe to run twice: when the first log already holds this attempt's first member (a re-sent
-- command), the attempt is admitted again without a second charge (one ZSCORE per decision).
-- Numbers passed to redis.call are formatted by hand: Redis would print 16-digit microsecond
-- scores with 14 significant digits.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cost = tonumber(ARGV[1])
local n = #KEYS
local counts, oldests = {}, {}
local admitted = 1
local retry = 0
local first_member = ARGV[2]
if cost > 1 then first_member = ARGV[2] .. ':1' end
local replay = redis.call('ZSCORE', KEYS[1], first_member) ~= false

for i = 1, n do
  local key = KEYS[i]
  local quota = tonumber(ARGV[1 + 2 * i])
  local window = tonumber(ARGV[2 + 2 * i])
  local count, oldest = 0, nil
  local first = redis.call('ZRANGE', key, '0', '0', 'WITHSCORES')
  if first[2] then
    oldest = tonumber(first[2])
    -- an entry scored s covers (s - window, s]; it is gone once now - window >= s
    if oldest <= now - window then
      redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%d', now - window))
      first = redis.call('ZRANGE', key, '0', '0', 'WITHSCORES')
      oldest = tonumber(first[2])
    end
    if oldest then count = redis.call('ZCARD', key) end
  end
  counts[i], oldests[i] = count, oldest
  if not replay and count + cost > quota then
    admitted = 0
    local wait = window
    if cost <= quota then
      -- room appears once the (count + cost - quota) oldest entries have left the window
      local idx = count + cost - quota - 1
      if idx == 0 then
        wait = oldest + window - now
      else
        local e = redis.call('ZRANGE', key, string.format('%d', idx), string.format('%d', idx), 'WITHSCORES')
        wait = tonumber(e[2]) + window - now
      end
    end
    if wait > retry then retry = wait end
  end
end

if replay then admitted, retry = 1, 0 end
local result = {admitted, retry}
local score = string.format('%d', now)
for i = 1, n do
  local key = KEYS[i]
  local quota = tonumber(ARGV[1 + 2 * i])
  local window = tonumber(ARGV[2 + 2 * i])
  local count, oldest = counts[i], oldests[i]
  local reset = 0
  if oldest then reset = oldest + window - now end
  -- a cost of 0 only looks: nothing is written
  if admitted == 1 and not replay and cost > 0 then
    if cost == 1 then
      redis.call('ZADD', key, score, ARGV[2])
    else
      local args = {}
      for c = 1, cost do
        args[#args + 1] = score
        args[#args + 1] = ARGV[2] .. ':' .. c
        if #args >= 1000 then
          redis.call('ZADD', key, unpack(args))
          args = {}
        end
      end
      if #args > 0 then redis.call('ZADD', key, unpack(args)) end
    end
    redis.call('PEXPIRE', key, string.format('%d', math.ceil(window / 1000)))
    count = count + cost
    -- the log was empty: its oldest entry is this request's
    if not oldest then reset = window end
  end
  local remaining = quota - count
  if remaining < 0 then remaining = 0 end
  result[#result + 1] = remaining
  result[#result + 1] = reset
end
return result
