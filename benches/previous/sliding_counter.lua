-- Sliding-counter script of the previous release (46da7fc), kept to measure against: benches/rate.rs.
-- Sliding-window counter: O(1) memory. Per limit one string
-- "<window index>:<current>:<previous>:<attempt>"; the estimate is current + previous * (share of
-- the previous window still inside the sliding one).
--
-- Safe to run twice: when the first limit was last charged by this very attempt (a re-sent
-- command), the attempt is admitted again without a second charge.
--
-- KEYS[i]     the counter of limit i (all keys share one hash tag)
-- ARGV[1]     cost (integer >= 1)
-- ARGV[2]     the attempt id (16 hex digits)
-- ARGV[1+2i]  quota of limit i
-- ARGV[2+2i]  window of limit i, microseconds (a whole number of milliseconds)
-- Returns     {admitted (0|1), retry_after_us, remaining_1, reset_us_1, ...}
-- Cost        O(limits); per limit GET, plus SET when admitted (KEEPTTL within a window).
local t = redis.call('TIME')
-- milliseconds keep quota * window exact in a double for windows of years
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cost = tonumber(ARGV[1])
local n = #KEYS
local attempt = ARGV[2]
local state = {}
local admitted = 1
local retry = 0
local replay = false

for i = 1, n do
  local quota = tonumber(ARGV[1 + 2 * i])
  local window = tonumber(ARGV[2 + 2 * i]) / 1000
  local index = math.floor(now / window)
  local elapsed = now - index * window
  local cur, prev, same = 0, 0, false
  local raw = redis.call('GET', KEYS[i])
  if raw then
    local idx, c, p, by = string.match(raw, '^(%d+):(%d+):(%d+):?(%x*)$')
    idx = tonumber(idx)
    if idx == index then cur, prev, same = tonumber(c), tonumber(p), true
    elseif idx == index - 1 then prev = tonumber(c) end
    if i == 1 and by == attempt then replay = true end
  end
  state[i] = {quota, window, index, elapsed, cur, prev, same}
  -- scaled by window: used * window = cur * window + prev * (window - elapsed)
  if replay then
    -- charged by the first run of this attempt: nothing to decide
  elseif (cur + cost) * window + prev * (window - elapsed) > quota * window then
    admitted = 0
    local wait
    local room = quota - cost - cur
    if cost > quota then
      wait = window
    elseif room >= 0 then
      -- prev * (window - elapsed - x) <= room * window
      wait = (window - elapsed) - room * window / prev
    else
      -- next window: cur becomes the previous one; cur * (window - x) <= (quota - cost) * window
      wait = (window - elapsed) + window - (quota - cost) * window / cur
    end
    if wait > retry then retry = wait end
  end
end

if replay then admitted, retry = 1, 0 end
local result = {admitted, math.ceil(retry * 1000)}
for i = 1, n do
  local quota, window, index, elapsed, cur, prev, same = unpack(state[i])
  -- a cost of 0 only looks: nothing is written
  if admitted == 1 and not replay and cost > 0 then
    cur = cur + cost
    local value = string.format('%d:%d:%d:%s', index, cur, prev, attempt)
    if same then
      -- the same window: its expiry (the end of the next window) stands
      redis.call('SET', KEYS[i], value, 'KEEPTTL')
    else
      redis.call('SET', KEYS[i], value, 'PX', string.format('%d', math.ceil(2 * window - elapsed)))
    end
  end
  local used = cur + prev * (window - elapsed) / window
  local whole = math.ceil(used - 1e-9)
  local remaining = quota - whole
  if remaining < 0 then remaining = 0 end
  -- the quota grows when the estimate next drops below a whole unit: within this window while
  -- the previous one's share can fall that far, else in the next, as this window's cost becomes
  -- the previous one's and fades (no later requests assumed): the same wait as a denial's
  local reset = 0
  if whole > 0 and prev > 0 and whole - 1 - cur >= 0 then
    reset = (window - elapsed) - (whole - 1 - cur) * window / prev
  elseif whole > 0 then
    reset = (window - elapsed) + window - (whole - 1) * window / cur
  end
  result[#result + 1] = remaining
  result[#result + 1] = math.ceil(reset * 1000)
end
return result
