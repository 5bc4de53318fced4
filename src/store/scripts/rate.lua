-- Rate checks, decided in turn: one call carries a batch of checks — of one caller or of many,
-- each with one or more limits under any of the three algorithms — so that Redis pays the
-- per-call cost (parsing, the script call, one TIME) once per batch. Each check is decided
-- exactly as it would be alone at this instant of store time, after the checks before it.
--
-- KEYS        every check's limit keys, check after check (one check's keys share a hash tag;
--             on Cluster a batch holds keys of one slot)
-- ARGV        the call's deadline in microseconds of store time (the earliest of its checks':
--             a call received from then on decides nothing, its callers gave up on it), the
--             number of policies, then per policy its algorithm (1 sliding log, 2 sliding
--             counter, 3 GCRA), its number of limits n and per limit the quota and the window in
--             microseconds; then per check its policy (1-based), its cost (integer >= 0; 0 only
--             looks) and its attempt id (16 hex digits)
-- Returns     per check: admitted (0|1), retry_after_us, then per limit remaining and reset_us;
--             or -1 and the error of a check that failed (the checks around it stand); or -2, 0
--             for every check of a call received after its deadline, which charged nothing
--
-- Safe to run twice: a check whose attempt already charged its limits (the call was re-sent, or
-- its reply lost and the check retried) is admitted again without a second charge, whatever other
-- checks charged the caller in between. The log finds the attempt among its entries; the counter
-- and GCRA keep, in the first limit's value, the recent attempts that charged it, each with its
-- deadline: an entry is dropped once its deadline has passed (a re-send is refused from then on
-- anyway), and at most RECENT (8) of them are kept, so a re-send is recognised as long as fewer
-- than 8 other attempts charged the caller before its deadline.
--
-- Numbers go to redis.call formatted as integers by hand: Lua would print those of more than 14
-- digits in exponent form, and Redis formats every number it is given as a float, which costs
-- more. A policy's limits are sent and read once per call, whatever the number of its checks.
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
-- milliseconds keep quota * window exact in a double for windows of years
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out, len = {}, 0
local format, match, sub = string.format, string.match, string.sub
local floor, ceil, tonumber = math.floor, math.ceil, tonumber
-- per-limit scratch of the check being decided, reused by every check of the call
local s1, s2, s3, s4, s5 = {}, {}, {}, {}, {}

-- A decimal integer below 2^53, read as two short halves: strtod takes a slow path for the
-- 16 digits of a microsecond time.
local function int(s)
  local n = #s
  if n <= 9 then return tonumber(s) end
  return tonumber(sub(s, 1, n - 8)) * 100000000 + tonumber(sub(s, n - 7))
end

-- The recent attempts of a counter or GCRA value: entries of 24 hex digits, the attempt id (16)
-- then its deadline in whole seconds of store time, rounded up (8), oldest first. A value written
-- by an earlier version holds one bare attempt id (16 digits, no deadline).
local ENTRY, RECENT = 24, 8
local find = string.find
-- the call's deadline and now, in whole seconds as entries hold them (set below)
local until_hex, now_hex

-- whether `attempt` is among the recent attempts `tail`
local function seen(tail, attempt)
  local p = find(tail, attempt, 1, true)
  while p do
    if (p - 1) % ENTRY == 0 then return true end
    p = find(tail, attempt, p + 1, true)
  end
  return false
end

-- `tail` without the entries whose deadline passed (fixed-width hex compares as numbers do), at
-- most RECENT - 1 of them, and then `attempt` with the call's deadline
local function remember(tail, attempt)
  local n = #tail
  if n % ENTRY ~= 0 then tail, n = '', 0 end
  local from = 1
  while from <= n and sub(tail, from + 16, from + 23) <= now_hex do
    from = from + ENTRY
  end
  local most = (RECENT - 1) * ENTRY
  if n - from + 1 > most then from = n - most + 1 end
  return sub(tail, from) .. attempt .. until_hex
end

local function push(a, b)
  out[len + 1], out[len + 2] = a, b
  len = len + 2
end

-- ceil(a / b) for integers 0 <= a, 0 < b below 2^53, exact whatever the rounding of a / b
local function ceil_div(a, b)
  local q = floor(a / b)
  if q * b > a then q = q - 1 end
  if q * b < a then q = q + 1 end
  return q
end

-- Sliding log: exact. One sorted set per limit, a member per unit of admitted cost (the attempt
-- id, or id:1 .. id:cost), scored with the store time. Reads the oldest entry first: only when it
-- left the window is the log trimmed. A new caller costs ZRANGE, ZADD, PEXPIRE; a known one adds
-- ZCARD. A re-sent attempt finds its own entries: they are never added twice (ZADD NX), and only
-- a log that would deny is searched for them (ZSCORE).
local function sliding_log(k, n, q, w, cost, attempt)
  local counts, oldests = s1, s2
  local admitted, retry, replay = 1, 0, false
  local first_member = attempt
  if cost > 1 then first_member = attempt .. ':1' end
  for i = 1, n do
    local key = KEYS[k + i]
    local quota, window = q[i], w[i]
    local count, oldest = 0, nil
    local first = redis.call('ZRANGE', key, '0', '0', 'WITHSCORES')
    if first[2] then
      oldest = int(first[2])
      -- an entry scored s covers (s - window, s]; it is gone once now - window >= s
      if oldest <= now_us - window then
        redis.call('ZREMRANGEBYSCORE', key, '-inf', format('%d', now_us - window))
        first = redis.call('ZRANGE', key, '0', '0', 'WITHSCORES')
        if first[2] then oldest = int(first[2]) else oldest = nil end
      end
      if oldest then count = redis.call('ZCARD', key) end
    end
    counts[i], oldests[i] = count, oldest
    if not replay and count + cost > quota then
      if cost > 0 and count > 0 and redis.call('ZSCORE', key, first_member) then
        -- charged by the first run of this attempt
        replay = true
      else
        admitted = 0
        local wait = window
        if cost <= quota then
          -- room appears once the (count + cost - quota) oldest entries have left the window
          local idx = count + cost - quota - 1
          if idx == 0 then
            wait = oldest + window - now_us
          else
            local e = redis.call('ZRANGE', key, format('%d', idx), format('%d', idx), 'WITHSCORES')
            wait = int(e[2]) + window - now_us
          end
        end
        if wait > retry then retry = wait end
      end
    end
  end
  if replay then admitted, retry = 1, 0 end
  push(admitted, retry)
  local score = format('%d', now_us)
  for i = 1, n do
    local key = KEYS[k + i]
    local quota, window = q[i], w[i]
    local count, oldest = counts[i], oldests[i]
    local reset = 0
    if oldest then reset = oldest + window - now_us end
    if admitted == 1 and cost > 0 then
      local added
      if cost == 1 then
        added = redis.call('ZADD', key, 'NX', score, attempt)
      else
        added = 0
        local args = {'NX'}
        for c = 1, cost do
          args[#args + 1] = score
          args[#args + 1] = attempt .. ':' .. c
          if #args >= 1001 then
            added = added + redis.call('ZADD', key, unpack(args))
            args = {'NX'}
          end
        end
        if #args > 1 then added = added + redis.call('ZADD', key, unpack(args)) end
      end
      if added > 0 then
        redis.call('PEXPIRE', key, format('%d', ceil(window / 1000)))
        count = count + added
        -- the log was empty: its oldest entry is this request's
        if not oldest then reset = window end
      end
    end
    local remaining = quota - count
    if remaining < 0 then remaining = 0 end
    push(remaining, reset)
  end
end

-- Sliding-window counter: O(1) memory. Per limit one string
-- "<window index>:<current>:<previous>:<recent attempts>" (the attempts on the first limit only);
-- the estimate is current + previous * (share of the previous window still inside the sliding
-- one). GET, plus SET when admitted (KEEPTTL within a window). A re-sent attempt finds its id
-- among the first limit's recent attempts.
local function sliding_counter(k, n, q, w, cost, attempt)
  local now = now_ms
  local indexes, elapsed_ms, curs, prevs, sames = s1, s2, s3, s4, s5
  local admitted, retry, replay, recent = 1, 0, false, ''
  for i = 1, n do
    local quota = q[i]
    local window = w[i] / 1000
    local index = floor(now / window)
    local elapsed = now - index * window
    local cur, prev, same = 0, 0, false
    local raw = redis.call('GET', KEYS[k + i])
    if raw then
      -- the recent attempts are cut off, not matched: a pattern walks them a digit at a time
      local idx, c, p, at = match(raw, '^(%d+):(%d+):(%d+):?()')
      local by = sub(raw, at)
      idx = tonumber(idx)
      if idx == index then cur, prev, same = tonumber(c), tonumber(p), true
      elseif idx == index - 1 then prev = tonumber(c) end
      if i == 1 then recent, replay = by, seen(by, attempt) end
    end
    indexes[i], elapsed_ms[i], curs[i], prevs[i], sames[i] = index, elapsed, cur, prev, same
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
  push(admitted, ceil(retry * 1000))
  for i = 1, n do
    local quota, window = q[i], w[i] / 1000
    local index, elapsed, cur, prev = indexes[i], elapsed_ms[i], curs[i], prevs[i]
    if admitted == 1 and not replay and cost > 0 then
      cur = cur + cost
      local tail = ''
      if i == 1 then tail = remember(recent, attempt) end
      local value = format('%d:%d:%d:%s', index, cur, prev, tail)
      if sames[i] then
        -- the same window: its expiry (the end of the next window) stands
        redis.call('SET', KEYS[k + i], value, 'KEEPTTL')
      else
        redis.call('PSETEX', KEYS[k + i], format('%d', ceil(2 * window - elapsed)), value)
      end
    end
    local used = cur + prev * (window - elapsed) / window
    local whole = ceil(used - 1e-9)
    local remaining = quota - whole
    if remaining < 0 then remaining = 0 end
    -- the quota grows when the estimate next drops below a whole unit: within this window while
    -- the previous one's share can fall that far, else in the next, as this window's cost
    -- becomes the previous one's and fades (no later requests assumed): a denial's wait
    local reset = 0
    if whole > 0 and prev > 0 and whole - 1 - cur >= 0 then
      reset = (window - elapsed) - (whole - 1 - cur) * window / prev
    elseif whole > 0 then
      reset = (window - elapsed) + window - (whole - 1) * window / cur
    end
    push(remaining, ceil(reset * 1000))
  end
end

-- GCRA (generic cell rate algorithm): O(1) memory, smooth. Emission interval T = window / quota;
-- a request of cost c is admitted when max(TAT, now) + c*T - now <= window (a fresh caller may
-- spend the whole quota at once). Kept exact in integers: per limit one string
-- "<tat>:<rem>:<recent attempts>", the theoretical arrival time in whole microseconds of store
-- time plus rem/quota of a microsecond, and (on the first limit only) the attempts that charged it
-- lately. Offsets from now are counted in 1/quota microseconds, where T is exactly `window`
-- units (quota * window < 2^52). GET, plus SET PX when admitted. A re-sent attempt finds its id
-- among the first limit's recent attempts.
local function gcra(k, n, q, w, cost, attempt)
  local now = now_us
  local tats, rems = s1, s2
  local admitted, retry, replay, recent = 1, 0, false, ''
  for i = 1, n do
    local quota, window = q[i], w[i]
    local tat, rem = now, 0
    local raw = redis.call('GET', KEYS[k + i])
    if raw then
      local stored, r, at = match(raw, '^(%d+):(%d+):?()')
      local by = sub(raw, at)
      stored = int(stored)
      if stored >= now then tat, rem = stored, tonumber(r) end
      if i == 1 then recent, replay = by, seen(by, attempt) end
    end
    tats[i], rems[i] = tat, rem
    if replay then
      -- charged by the first run of this attempt: nothing to decide
    elseif cost > quota then
      admitted = 0
      if window > retry then retry = window end
    else
      local ahead = (tat - now) * quota + rem + cost * window
      if ahead > window * quota then
        admitted = 0
        local wait = ceil_div(ahead - window * quota, quota)
        if wait > retry then retry = wait end
      end
    end
  end
  if replay then admitted, retry = 1, 0 end
  push(admitted, retry)
  for i = 1, n do
    local quota, window = q[i], w[i]
    local tat, rem = tats[i], rems[i]
    if admitted == 1 and not replay and cost > 0 then
      local units = rem + cost * window
      local whole = floor(units / quota)
      if whole * quota > units then whole = whole - 1 end
      tat = tat + whole
      rem = units - whole * quota
      local tail = ''
      if i == 1 then tail = remember(recent, attempt) end
      redis.call('PSETEX', KEYS[k + i], format('%d', ceil((tat - now) / 1000) + 1),
        format('%d:%d:%s', tat, rem, tail))
    end
    local ahead = (tat - now) * quota + rem
    local used = ceil_div(ahead, window)
    local remaining = quota - used
    if remaining < 0 then remaining = 0 end
    local reset = 0
    -- the next unit frees when the offset drops to (used - 1) emission intervals
    if used > 0 then reset = ceil_div(ahead - (used - 1) * window, quota) end
    push(remaining, reset)
  end
end

local algorithms = {sliding_log, sliding_counter, gcra}
local deadline = int(ARGV[1])
local late = now_us >= deadline
-- eight digits last until 2106; a later deadline is kept as that
local until_s = ceil(deadline / 1000000)
if until_s > 4294967295 then until_s = 4294967295 end
until_hex, now_hex = format('%08x', until_s), format('%08x', floor(now_us / 1000000))
local policies, a = {}, 2
for p = 1, tonumber(ARGV[2]) do
  local n, q, w = tonumber(ARGV[a + 2]), {}, {}
  for i = 1, n do
    q[i], w[i] = tonumber(ARGV[a + 1 + 2 * i]), tonumber(ARGV[a + 2 + 2 * i])
  end
  policies[p] = {algorithms[tonumber(ARGV[a + 1])], n, q, w}
  a = a + 2 + 2 * n
end
local k, args = 0, #ARGV
while a < args do
  local policy = policies[tonumber(ARGV[a + 1])]
  local n = policy[2]
  local start = len
  local ok, err = true, nil
  if late then
    push(-2, 0)
  else
    ok, err = pcall(policy[1], k, n, policy[3], policy[4], tonumber(ARGV[a + 2]), ARGV[a + 3])
  end
  if not ok then
    -- this check's partial answer gives way to its error
    for j = len, start + 1, -1 do out[j] = nil end
    len = start
    if type(err) == 'table' then err = err.err end
    push(-1, tostring(err))
  end
  k, a = k + n, a + 3
end
return out
