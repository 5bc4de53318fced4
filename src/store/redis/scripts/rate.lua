-- Rate checks, decided in turn: one call carries a batch of checks — of one caller or of many,
-- each with one or more limits under any of the three algorithms — so that Redis pays the
-- per-call cost (parsing, the script call, one TIME) once per batch. Each check is decided
-- exactly as it would be alone at this instant of store time, after the checks before it.
--
-- KEYS        m record keys, then every check's limit keys, check after check, each check's
--             followed by the keys of the blocks of its limits with a penalty, in order, then
--             by the key of its place when it has one (see below; one check's keys
--             share a hash tag; on Cluster a call holds keys of one slot, its records too): the
--             first record is this call's own, the others those of calls that carried one of
--             its checks before
-- ARGV        the call's deadline in microseconds of store time (the earliest of its checks':
--             a call received from then on decides nothing, its callers gave up on it), m (0:
--             no records), how long a record outlives the deadline in milliseconds, the number
--             of policies, then per policy its algorithm (1 sliding log, 2 sliding counter, 3
--             GCRA), its number of limits n and per limit the quota (of a limit that counts
--             calls: '<quota>c') and the window in microseconds (of a limit with a penalty:
--             '<window>:<block_for>', both in microseconds); then per check its policy
--             (1-based), its cost (integer >= 0; 0 only looks; a reservation: 'r<cost>'; either
--             held for h µs: 'c<cost>+<h>' or 'r<cost>+<h>'; a settlement:
--             's<reserved>:<actual>:<settled attempt id>', or 'S...' when it settles a
--             reservation, whose unused part it may refund) and its attempt id (16 hex digits),
--             followed, for a check sent before, by every place it went out at whose record may
--             live: '@j:p' each, the p-th check of the call of record j (1: this call), e.g.
--             '<attempt>@3:1@2:4'
-- Returns     per check: admitted (0|1), retry_after_us, then per limit two numbers: -1 and
--             the time its block has left (µs) for a limit that blocks the caller; else the
--             state its answer is read from (by the client, with the formulas every store
--             answers by: computed here, they would cost Redis more than reading the state): of a
--             sliding log the units left and when the next one frees (µs), of a sliding counter
--             its current and previous windows' counts, of GCRA its TAT's offset from the call's
--             store time (µs) and remainder; or -1 and the error of a check that failed (the
--             checks around it stand); or -2, 0 for every check of a call received after its
--             deadline, which charged nothing; then, last, the store time of the call in
--             microseconds: when its checks were decided
--
-- Safe to run twice: a check whose attempt already charged its limits is admitted again without
-- a second charge, whatever other checks charged the caller in between. A call keeps its record:
-- a string with a digit per check, 1 for each that charged, kept until the call's deadline plus
-- the retention; the same call re-sent (a dropped connection, a Cluster retry) reads its own,
-- and a check sent again in another call (its caller retrying) reads the records of every call
-- it went out in before: it charged if any of them says so (a call received after its deadline
-- left none, and hides no earlier one). A check admitted as charged before marks this call's
-- record too. One GET of its own record, one per earlier record named (once, whatever its
-- checks) and at most one SET per call: a re-send costs the decisions nothing. The log also
-- finds its attempt among its entries.
--
-- A reservation is charged as any check, and keeps where its charge went for as long as the
-- limit counts it, so that its settlement refunds only that: a sliding log's entries are named by
-- the attempt; under a sliding counter or GCRA the reservation's place key (in KEYS after its
-- limit keys, named by its attempt) holds 'p:' and per limit the index of the window the charge
-- was added to ('<index>:<born>:...', kept until the end of that window's successor), or the
-- theoretical arrival time right after the charge ('<tat>:<rem>:<born>:...', kept until then).
-- Written by the run that charges, never by a re-send. `born` names the life of the state it
-- charged: a counter or GCRA state keeps the attempt id that began it (a charge or an overrun
-- finding no state living: absent, reset, of a window before the previous one, or its arrival
-- time passed), and a refund comes only out of the life its reservation charged — never out of
-- what others charged after a reset. (A state written before lives were named has no born: the
-- next charge names it. A place without the 'p:' mark refunds nothing.)
--
-- A held check (a copy's leased slice, whose units it admits up to h µs after the charge) is
-- counted for as long as they may be admitted: a sliding log dates its entries now + h (a log's
-- expiry is never shortened: PEXPIRE GT), GCRA charges from now + h at the earliest (the decision
-- too: the slice also fits when admitted at once); a sliding counter charges as any check (the
-- copy spends the slice within the window).
--
-- A settlement corrects what an admitted check charged to its actual cost, always admitted; it
-- answers the limits as they stand after it. An overrun is added whatever the balance (past the
-- quota by at most one more quota). A refund, of a reservation only, returns what of its charge
-- the limit still counts: its log entries still in the window; from its counter window while
-- that is the current or the previous one, up to that window's count; of its GCRA span the part
-- still ahead of now, up to the current offset. The settlement of a reservation names the place
-- key of the reservation after its limit keys and drops it: a refund is made once. Its own
-- attempt id and record make a settlement count once, however often it is sent.
--
-- A limit that counts calls is charged 1 by a check of any cost above 0 (a look, nothing), and
-- a settlement never changes it: its cost per check is at most 1, its settlement's delta 0.
-- `calls` (per limit, true for one that counts calls) is nil for a policy without any: the
-- common path tests that once per limit.
--
-- A penalty (a limit's block_for) blocks the caller: a check (cost > 0, not a settlement) that a
-- limit with a penalty denies, of a caller not blocked yet, writes in the same run that limit's
-- block key, holding the store time the block ends (kept a millisecond past it). While any
-- block of the check's limits has not ended, the check is denied and charges nothing (a re-sent
-- check that charged before is admitted, as always): it waits at least until the latest block
-- ends, and each blocking limit answers -1 and the time its block has left. A denial
-- while blocked writes nothing: the block is not extended. Settlements ignore blocks.
--
-- One file, run two ways (see its end): as a function of a library the server keeps (FCALL),
-- whose functions and scratch tables are made once per load, then `run` per call; or as a
-- script (EVAL), the whole file per call. What a call sets lives at the file's level, and `run`
-- sets it anew as it starts: nothing of one call reaches the next but the scratch tables, which
-- each check writes before it reads, and the functions of the algorithms, made by the first
-- call that uses each (making a function costs Redis more than most checks cost it).
--
-- Numbers go to redis.call formatted as integers by hand: Lua would print those of more than 14
-- digits in exponent form, and Redis formats every number it is given as a float, which costs
-- more. Numbers are read as strtod reads them, exact for integers below 2^53 (it rounds
-- correctly) and cheaper than any cutting of the string: by arithmetic on a text that is only
-- digits (`s + 0`: the conversion of tonumber without the call of a function), by tonumber
-- where the text may be something else (a quota '<quota>c', a cost 'r<cost>'). A policy's
-- limits are sent once per call, whatever the number of its checks, and read once per library
-- (kept by their text, see `run`); a cost, once per call whatever the number of checks that
-- carry it. Where every check pays for it, floor(x) is written x - x % 1 and ceil(x)
-- -(-x - -x % 1): arithmetic, where math.floor and math.ceil cost a function call each (exact:
-- x % 1 is x - floor(x), exact in a double).
-- The functions of Lua's libraries used, reached as locals: set by the first call (a library's
-- code may not reach them while it loads).
local format, match, sub, gmatch, find, floor, ceil, min, max, tonumber
-- The call being run, set by `run` as it starts: its store commands, keys and arguments, its
-- store time in microseconds and in milliseconds, and its answer so far (`len` entries).
local call, KEYS, ARGV, now_us, now_ms, out, len
-- per-limit scratch of the check being decided, reused by every check (each writes a limit's
-- entries before it reads them)
local s1, s2 = {}, {}
-- per limit of the check being decided, whether it denied the cost (a penalty's cause)
local denied = {}
-- how long after the charge the check being decided may admit its units (µs; 0: at once)
local hold = 0
-- the function deciding a check per algorithm (1 sliding log, 2 sliding counter, 3 GCRA), made
-- by the first call that uses it
local algorithms = {}
-- per algorithm, the function deciding its common check, where it has one: a policy of one limit
-- without a penalty or calls counted, a check that is neither a reservation nor a settlement.
-- It takes the same steps as the algorithm's function without its scratch tables: most checks
-- are such, and what a check costs Redis is mostly the Lua it runs.
local ones = {}
-- the texts of the call's store time and of the expiries it uses, each formatted once per call
-- (`run` renews them)
local now_text, ms_texts
-- the windows of a sliding counter's limits placed in the call's time: a function made with
-- the algorithm's
local windows
-- The policies read, by their text (their arguments as sent), and how many: a call reads its
-- policies from the text, not again from each argument (numbers from text are dear to Lua), and
-- more than 64 distinct policies start the table afresh.
local parsed, parsed_count = {}, 0

-- The call's number of records; its own record, when it ran before; those of earlier calls,
-- read once each; per check, '1' when its attempt charged, in this run or an earlier one.
local records, before, earlier, charged

-- What the place of a settled reservation holds, per limit, as strings (nil when nothing is
-- kept), and the place dropped: the settlement is the last to read it.
local function take_place(place)
  local raw = call('GET', place)
  if not raw then return nil end
  call('DEL', place)
  if sub(raw, 1, 2) ~= 'p:' then return nil end
  local at = {}
  for v in gmatch(sub(raw, 3), '[^:]+') do at[#at + 1] = v end
  return at
end

-- The period of G ms of store time (G = a quarter of `window` µs, at most 30 s, at least 1 ms)
-- that the millisecond past `us` (ceil(us / 1000) + 1) falls in, and G: a GCRA key and a sliding
-- log expire at the end of the period after the one their state's end falls in, so that the
-- writes of a period find their expiry set.
local function period_of(us, window)
  local g = window / 4000
  g = min(g - g % 1, 30000)
  if g < 1 then g = 1 end
  local ms = -us / 1000
  ms = (1 - (ms - ms % 1)) / g
  return ms - ms % 1, g
end

-- Sliding log: exact. One sorted set per limit, a member per unit of admitted cost (the attempt
-- id, or id:1 .. id:cost), scored with the store time. Reads the oldest entry first: only when it
-- left the window is the log trimmed. A new caller costs ZRANGE, ZADD, PEXPIREAT; a known one adds
-- ZCARD. A re-sent attempt finds its own entries: they are never added twice (ZADD NX), and only
-- a log that would deny is searched for them (ZSCORE). The log outlives its newest entry's stay
-- in the window by up to two periods of G = a quarter of the window, at most 30 s (so by half a
-- window at most): it expires at the end of the period after the one that stay ends in, so that
-- the checks of a period find its expiry set (an expiry that GT leaves as it is costs Redis half
-- of one it moves).
local function make_sliding_log()
  -- every check of a sliding log not held scores its entries with the call's store time as
  -- text, and sets the same expiry
  local function ms_text(ms)
    local text = ms_texts[ms]
    if not text then
      text = format('%d', ms)
      ms_texts[ms] = text
    end
    return text
  end
  -- The members of the log of the `u`-th unit of a check of `cost` by `attempt`.
  local function unit(attempt, cost, u)
    if cost == 1 and u == 1 then return attempt end
    return attempt .. ':' .. u
  end

  -- Settles the units the attempt of a settlement `s` keeps in log `key`: from its reserved
  -- count to its actual one (at most `cap` units in the log), added with `score` or, of a
  -- reservation, removed, by name, so that a settlement run twice changes nothing more. The change
  -- in the log's size.
  local function settle_log(key, s, count, cap, score)
    local reserved, actual, of = s[1], s[2], s[3]
    local change, args, verb = 0, {}, 'ZREM'
    local from, to = actual + 1, reserved
    if actual < reserved and not s[4] then
      -- a plain check's charge is not refunded
      return 0
    elseif actual > reserved then
      verb, args = 'ZADD', {'NX'}
      from, to = reserved + 1, math.min(actual, reserved + cap - count)
    end
    for u = from, to do
      if verb == 'ZADD' then args[#args + 1] = score end
      args[#args + 1] = unit(of, reserved, u)
      if #args >= 1000 then
        change = change + call(verb, key, unpack(args))
        args = verb == 'ZADD' and {'NX'} or {}
      end
    end
    if #args > (verb == 'ZADD' and 1 or 0) then change = change + call(verb, key, unpack(args)) end
    if verb == 'ZREM' then return -change end
    return change
  end

  -- Keeps log `key` of `window` while entries dated `hold` from now stay in it: until the end of
  -- the period after the one their stay ends in, never shorter than it was (GT): entries a held
  -- charge dated later may outlive those added since. A log that held nothing live was made by
  -- this ZADD, without an expiry, which GT would leave so.
  local function keep(key, window, hold, fresh)
    local period, g = period_of(now_us + hold + window, window)
    local at = ms_text((period + 2) * g)
    if fresh then
      call('PEXPIREAT', key, at)
    else
      call('PEXPIREAT', key, at, 'GT')
    end
  end

  algorithms[1] = function(k, policy, all, attempt, replay, settle, _, blocked)
    local n, q, w, calls = policy[2], policy[3], policy[4], policy[8]
    local counts, oldests = s1, s2
    local admitted, retry = 1, 0
    for i = 1, n do
      local key = KEYS[k + i]
      local quota, window, cost = q[i], w[i], all
      if calls and calls[i] then cost = min(all, 1) end
      local first_member = attempt
      if cost > 1 then first_member = attempt .. ':1' end
      local count, oldest = 0, nil
      local first = call('ZRANGE', key, '0', '0', 'WITHSCORES')
      if first[2] then
        oldest = tonumber(first[2])
        -- an entry scored s covers (s - window, s]; it is gone once now - window >= s
        if oldest <= now_us - window then
          call('ZREMRANGEBYSCORE', key, '-inf', format('%d', now_us - window))
          first = call('ZRANGE', key, '0', '0', 'WITHSCORES')
          if first[2] then oldest = tonumber(first[2]) else oldest = nil end
        end
        if oldest then count = call('ZCARD', key) end
      end
      counts[i], oldests[i] = count, oldest
      if not replay and not settle and count + cost > quota then
        if cost > 0 and count > 0 and call('ZSCORE', key, first_member) then
          -- charged by the first run of this attempt
          replay = true
        else
          admitted, denied[i] = 0, true
          local wait = window
          if cost <= quota then
            -- room appears once the (count + cost - quota) oldest entries have left the window
            local idx = count + cost - quota - 1
            if idx == 0 then
              wait = oldest + window - now_us
            else
              local at = format('%d', idx)
              local e = call('ZRANGE', key, at, at, 'WITHSCORES')
              wait = tonumber(e[2]) + window - now_us
            end
          end
          if wait > retry then retry = wait end
        end
      end
    end
    if replay then admitted, retry = 1, 0 elseif blocked then admitted = 0 end
    out[len + 1], out[len + 2], len = admitted, retry, len + 2
    -- a held charge's units are dated when the copy may last admit them
    local score = hold == 0 and now_text or format('%d', now_us + hold)
    for i = 1, n do
      local key = KEYS[k + i]
      local quota, window, cost = q[i], w[i], all
      if calls and calls[i] then cost = min(all, 1) end
      local count, oldest = counts[i], oldests[i]
      local reset = 0
      if oldest then reset = oldest + window - now_us end
      if settle then
        if not replay and not (calls and calls[i]) then
          local change = settle_log(key, settle, count, 2 * quota, score)
          count = count + change
          if change > 0 then
            keep(key, window, 0, not oldest)
            if not oldest or now_us < oldest then reset = window end
          elseif change < 0 then
            -- the oldest entry may have been one of those refunded
            local first = call('ZRANGE', key, '0', '0', 'WITHSCORES')
            reset = 0
            if first[2] then reset = tonumber(first[2]) + window - now_us end
          end
        end
      elseif admitted == 1 and cost > 0 and not replay then
        local added
        if cost == 1 then
          added = call('ZADD', key, 'NX', score, attempt)
        else
          added = 0
          local args = {'NX'}
          for c = 1, cost do
            args[#args + 1] = score
            args[#args + 1] = attempt .. ':' .. c
            if #args >= 1001 then
              added = added + call('ZADD', key, unpack(args))
              args = {'NX'}
            end
          end
          if #args > 1 then added = added + call('ZADD', key, unpack(args)) end
        end
        if added > 0 then
          keep(key, window, hold, not oldest)
          count = count + added
          -- the log was empty, or held only later entries: its oldest entry is this request's
          if not oldest or now_us + hold < oldest then reset = window + hold end
        end
      end
      local remaining = quota - count
      if remaining < 0 then remaining = 0 end
      out[len + 1], out[len + 2], len = remaining, reset, len + 2
    end
  end
end

-- Sliding-window counter: O(1) memory. Per limit one string
-- "<window index>:<current>:<previous>:<born>"; the estimate is current +
-- previous * (share of the previous window still inside the sliding one). GET, plus SET when
-- admitted (KEEPTTL within a window). `place`: of a reservation, where it keeps the windows it
-- charges; of a settlement, where its reservation kept them.
--
-- A policy's windows are placed in time once per call (`windows`): per limit the window in ms,
-- the index of the current one, the ms elapsed in it and the index as text. Its common check is
-- decided by `one` (see `ones`).
local function make_sliding_counter()
  local s3, s4, s5, s6 = {}, {}, {}, {}
  -- How long until `cost` fits a sliding counter at `cur` this window and `prev` the last,
  -- `elapsed` into a window of `window` ms with `quota`.
  local function counter_wait(quota, window, elapsed, cur, prev, cost)
    local room = quota - cost - cur
    if cost > quota then
      return window
    elseif room >= 0 then
      -- prev * (window - elapsed - x) <= room * window
      return (window - elapsed) - room * window / prev
    end
    -- next window: cur becomes the previous one; cur * (window - x) <= (quota - cost) * window
    return (window - elapsed) + window - (quota - cost) * window / cur
  end

  -- The state of counter `key` in window `index` (`text` as text): its current window's count and
  -- its previous one's, whether it is of this window, the attempt that began its life (false:
  -- none), and, of a state of this window, the texts of its index and previous count as read (a
  -- write that changes only the current count joins them instead of formatting them again).
  local function read(key, index, text)
    local raw = call('GET', key)
    if not raw then return 0, 0, false, false end
    -- one match: cheaper, on a state this short, than finding each colon and cutting each field
    local t, c, p, b = match(raw, '^(%d+):(%d+):(%d+):?(.*)$')
    if b == '' then b = false end
    -- a state of this window names it as this call would (strings compare at once)
    local idx = index
    if t ~= text then idx = t + 0 end
    if idx == index then return c + 0, p + 0, true, b, t, p end
    if idx == index - 1 then return 0, c + 0, false, b end
    return 0, 0, false, false
  end

  -- Writes counter `key`: in the window it was read in (`same`) with its expiry kept, else anew,
  -- expiring at the end of the next window. `text` and `ptext`, of a state of this window whose
  -- previous count stands, are the texts of its index and previous count as read.
  local function write(key, same, text, ptext, index, cur, prev, born, window, elapsed)
    if not same then
      call('PSETEX', key, format('%d', ceil(2 * window - elapsed)),
        format('%d:%d:%d:%s', index, cur, prev, born))
    elseif ptext then
      call('SET', key, text .. ':' .. format('%d', cur) .. ':' .. ptext .. ':' .. born, 'KEEPTTL')
    else
      call('SET', key, format('%d:%d:%d:%s', index, cur, prev, born), 'KEEPTTL')
    end
  end

  -- The common check: one limit, no penalty, no calls counted; not a reservation or settlement.
  local function one(k, policy, cost, attempt, replay)
    local key, quota = KEYS[k + 1], policy[3][1]
    local placed = policy[10]
    local window, index, elapsed = placed[1], placed[2], placed[3]
    local left = window - elapsed
    local cur, prev, same, born, text, ptext = read(key, index, placed[4])
    local admitted, retry = 1, 0
    if replay then
      -- charged by an earlier run of this attempt
    elseif (cur + cost) * window + prev * left > quota * window then
      admitted = 0
      local wait = counter_wait(quota, window, elapsed, cur, prev, cost)
      if wait > 0 then retry = ceil(wait * 1000) end
    end
    out[len + 1], out[len + 2], len = admitted, retry, len + 2
    if admitted == 1 and not replay and cost > 0 then
      cur = cur + cost
      write(key, same, text, ptext, index, cur, prev, born or attempt, window, elapsed)
    end
    out[len + 1], out[len + 2], len = cur, prev, len + 2
  end

  ones[2] = one

  -- Places the windows of `n` limits of windows `w` (µs) in the call's time, in `placed`: per
  -- limit, in turn, the window in ms, the index of the current one, the ms elapsed in it and the
  -- index as text (formatted again only when the index is not the one placed last).
  windows = function(placed, n, w)
    for i = 1, n do
      local window = w[i] / 1000
      local index = now_ms / window
      index = index - index % 1
      local slot = 4 * i
      if placed[slot - 2] ~= index then placed[slot] = format('%d', index) end
      placed[slot - 3], placed[slot - 2], placed[slot - 1] = window, index, now_ms - index * window
    end
  end

  algorithms[2] = function(k, policy, all, attempt, replay, settle, place, blocked)
    local n, q, calls = policy[2], policy[3], policy[8]
    local placed = policy[10]
    local curs, prevs, sames, borns, index_texts, prev_texts = s1, s2, s3, s4, s5, s6
    local admitted, retry = 1, 0
    for i = 1, n do
      local quota, cost, slot = q[i], all, 4 * i
      if calls and calls[i] then cost = min(all, 1) end
      local window, elapsed = placed[slot - 3], placed[slot - 1]
      local cur, prev, same, born, text, ptext = read(KEYS[k + i], placed[slot - 2], placed[slot])
      curs[i], prevs[i], sames[i], borns[i] = cur, prev, same, born
      index_texts[i], prev_texts[i] = text, ptext
      -- scaled by window: used * window = cur * window + prev * (window - elapsed)
      if replay or settle then
        -- charged by an earlier run of this attempt, or a settlement: nothing to decide
      elseif (cur + cost) * window + prev * (window - elapsed) > quota * window then
        admitted, denied[i] = 0, true
        local wait = counter_wait(quota, window, elapsed, cur, prev, cost)
        if wait > retry then retry = wait end
      end
    end
    if replay then admitted, retry = 1, 0 elseif blocked then admitted = 0 end
    if retry > 0 then retry = ceil(retry * 1000) end
    out[len + 1], out[len + 2], len = admitted, retry, len + 2
    local charge = admitted == 1 and not replay and all > 0
    -- a settlement: what it adds (> 0) or may refund (< 0), and where its reservation went
    local delta, at = 0, nil
    if settle and not replay then
      delta = settle[2] - settle[1]
      if place then
        if delta < 0 then at = take_place(place) else call('DEL', place) end
      end
    end
    -- a reservation charged: the windows it went to, and until when they count
    local marks, keep = nil, 0
    if charge and place then marks = {} end
    for i = 1, n do
      local quota, slot = q[i], 4 * i
      local window, index, elapsed = placed[slot - 3], placed[slot - 2], placed[slot - 1]
      local cur, prev = curs[i], prevs[i]
      local born = borns[i] or attempt
      local write_it = charge
      local cost, delta = all, delta
      if calls and calls[i] then cost, delta = min(all, 1), 0 end
      if write_it then cur = cur + cost end
      if delta > 0 then
        -- an overrun goes to this window
        cur = min(cur + delta, max(cur, 2 * quota))
        write_it = true
      elseif delta < 0 and at and at[2 * i] == borns[i] then
        -- a refund comes out of the window the reservation went to, while it still counts, of
        -- the life it charged
        local p = tonumber(at[2 * i - 1])
        if p == index and cur > 0 then
          cur = cur - min(-delta, cur)
          write_it = true
        elseif p == index - 1 and prev > 0 then
          prev = prev - min(-delta, prev)
          write_it = true
        end
      end
      if marks then
        marks[2 * i - 1], marks[2 * i] = placed[slot], born
        -- until the end of the next window
        local until_ms = ceil((index + 2) * window - now_ms)
        if until_ms > keep then keep = until_ms end
      end
      if write_it then
        write(KEYS[k + i], sames[i], index_texts[i], prev == prevs[i] and prev_texts[i] or nil,
          index, cur, prev, born, window, elapsed)
      end
      out[len + 1], out[len + 2], len = cur, prev, len + 2
    end
    if marks then
      call('PSETEX', place, format('%d', keep), 'p:' .. table.concat(marks, ':'))
    end
  end
end

-- GCRA (generic cell rate algorithm): O(1) memory, smooth. Emission interval T = window / quota;
-- a request of cost c is admitted when max(TAT, now) + c*T - now <= window (a fresh caller may
-- spend the whole quota at once). Kept exact in integers: per limit one string
-- "<tat>:<rem>:<born>:", the theoretical arrival time in whole microseconds of store time plus
-- rem/quota of a microsecond, and the attempt that began the state's life. Offsets from now are
-- counted in 1/quota microseconds, where T is exactly `window` units (quota * window < 2^52).
-- GET, plus a SET when admitted. The key outlives its TAT by up to two periods of G = a quarter
-- of the window, at most 30 s (so by half a window at most): the millisecond it must outlive
-- (ceil(TAT / 1000) + 1) falls in a period of G ms of store time, and the key expires at the end
-- of the next one. A write whose TAT falls in the period of the state it replaces keeps the key's
-- expiry (SET KEEPTTL, which costs Redis less than setting one), as the trailing ':' says it may:
-- a state without it (written by a copy of a version before) has an expiry of its own, and its
-- next write sets one.
-- `place`: of a reservation, where it keeps the ends of its spans; of a settlement, where its
-- reservation kept them.
local function make_gcra()
  local s3, s4 = {}, {}
  -- ceil(a / b) for integers 0 <= a, 0 < b below 2^53, exact whatever the rounding of a / b
  local function ceil_div(a, b)
    local q = floor(a / b)
    if q * b > a then q = q - 1 end
    if q * b < a then q = q + 1 end
    return q
  end
  -- The state of GCRA `key` at store time `now`: its TAT and rem (now and 0 when it has passed),
  -- the attempt that began its life (false: none, or its TAT passed), and the TAT its key's
  -- expiry was set for (false: an expiry of its own).
  local function read(key, now)
    local raw = call('GET', key)
    if not raw then return now, 0, false, false end
    local tat, rem, born, kept = now, 0, false, false
    -- its fields, between colons found by plain search: cheaper than a pattern's captures
    local c1 = find(raw, ':', 1, true)
    local c2 = find(raw, ':', c1 + 1, true)
    local stored = sub(raw, 1, c1 - 1) + 0
    if stored >= now then
      tat, rem = stored, sub(raw, c1 + 1, (c2 or 0) - 1) + 0
      if c2 then
        local c3 = find(raw, ':', c2 + 1, true)
        local b = sub(raw, c2 + 1, (c3 or 0) - 1)
        if b ~= '' then born = b end
      end
    end
    -- the key's expiry holds whatever the state's life: the TAT it was written for
    if sub(raw, -1) == ':' then kept = stored end
    return tat, rem, born, kept
  end

  -- How long until `cost` fits a limit of `quota` per `window` µs at `tat` + `rem` (0: it fits
  -- now); a held charge starts from now + hold at the earliest.
  local function wait_for(quota, window, tat, rem, cost)
    local now = now_us
    if cost > quota then return window end
    if tat < now + hold then tat, rem = now + hold, 0 end
    local ahead = (tat - now) * quota + rem + cost * window
    if ahead <= window * quota then return 0 end
    return ceil_div(ahead - window * quota, quota)
  end

  -- The state after charging `cost` to one at `tat` + `rem`: a held charge starts from
  -- now + hold at the earliest.
  local function charged_to(quota, window, tat, rem, cost)
    if tat < now_us + hold then tat, rem = now_us + hold, 0 end
    local units = rem + cost * window
    local whole = units / quota
    whole = whole - whole % 1
    if whole * quota > units then whole = whole - 1 end
    return tat + whole, units - whole * quota
  end

  -- Writes GCRA `key`, of a life begun by `born`, whose expiry was set for `kept`.
  local function write(key, window, tat, rem, born, kept)
    -- each number formatted alone and joined: one format of several costs more
    local value = format('%d', tat) .. ':' .. (rem == 0 and '0' or format('%d', rem)) .. ':'
      .. born .. ':'
    -- the periods the key's TAT and the stored one fall in
    local period, g = period_of(tat, window)
    if kept and period == period_of(kept, window) then
      call('SET', key, value, 'KEEPTTL')
    else
      call('PSETEX', key, format('%d', (period + 2) * g - now_ms), value)
    end
  end

  -- The common check: one limit, no penalty, no calls counted; not a reservation or settlement.
  local function one(k, policy, cost, attempt, replay)
    local key, quota, window = KEYS[k + 1], policy[3][1], policy[4][1]
    local tat, rem, born, kept = read(key, now_us)
    local retry = 0
    if not replay then retry = wait_for(quota, window, tat, rem, cost) end
    if retry > 0 then
      out[len + 1], out[len + 2], len = 0, retry, len + 2
    else
      out[len + 1], out[len + 2], len = 1, 0, len + 2
      if not replay and cost > 0 then
        tat, rem = charged_to(quota, window, tat, rem, cost)
        write(key, window, tat, rem, born or attempt, kept)
      end
    end
    out[len + 1], out[len + 2], len = tat - now_us, rem, len + 2
  end
  ones[3] = one

  algorithms[3] = function(k, policy, all, attempt, replay, settle, place, blocked)
    local n, q, w, calls = policy[2], policy[3], policy[4], policy[8]
    local now = now_us
    local tats, rems, borns, expires = s1, s2, s3, s4
    local admitted, retry = 1, 0
    for i = 1, n do
      local quota, window, cost = q[i], w[i], all
      if calls and calls[i] then cost = min(all, 1) end
      local tat, rem, born, kept = read(KEYS[k + i], now)
      tats[i], rems[i], borns[i], expires[i] = tat, rem, born, kept
      if not (replay or settle) then
        -- a check to decide: not a charged attempt run again, nor a settlement
        local wait = wait_for(quota, window, tat, rem, cost)
        if wait > 0 then
          admitted, denied[i] = 0, true
          if wait > retry then retry = wait end
        end
      end
    end
    if replay then admitted, retry = 1, 0 elseif blocked then admitted = 0 end
    out[len + 1], out[len + 2], len = admitted, retry, len + 2
    local charge = admitted == 1 and not replay and all > 0
    -- a settlement: what it adds (> 0) or may refund (< 0), and where its reservation went
    local delta, at = 0, nil
    if settle and not replay then
      delta = settle[2] - settle[1]
      if place then
        if delta < 0 then at = take_place(place) else call('DEL', place) end
      end
    end
    -- a reservation charged: the ends of its spans, and until when they count
    local marks, keep = nil, 0
    if charge and place then marks = {} end
    for i = 1, n do
      local quota, window = q[i], w[i]
      local tat, rem = tats[i], rems[i]
      local born = borns[i] or attempt
      local write_it = charge
      local cost, delta = all, delta
      if calls and calls[i] then cost, delta = min(all, 1), 0 end
      if write_it then tat, rem = charged_to(quota, window, tat, rem, cost) end
      if delta ~= 0 then
        -- the offset from now (2 * window * quota < 2^53 stays exact)
        local offset = (tat - now) * quota + rem
        local ahead = offset
        if delta > 0 then
          -- an overrun moves it on, past the quota by at most one more
          ahead = min(offset + delta * window, max(offset, 2 * window * quota))
        elseif at and at[3 * i] and at[3 * i] == borns[i] then
          -- a refund takes back what of the reservation's span is still ahead of now, of the
          -- life it charged
          local left = (tonumber(at[3 * i - 2]) - now) * quota + tonumber(at[3 * i - 1])
          if left > 0 then ahead = offset - min(-delta * window, left, offset) end
        end
        if ahead ~= offset then
          local whole = floor(ahead / quota)
          if whole * quota > ahead then whole = whole - 1 end
          tat, rem = now + whole, ahead - whole * quota
          write_it = true
        end
      end
      if marks then
        marks[3 * i - 2], marks[3 * i - 1], marks[3 * i] = format('%d', tat), format('%d', rem),
          born
        local until_ms = ceil((tat - now) / 1000) + 1
        if until_ms > keep then keep = until_ms end
      end
      if write_it then write(KEYS[k + i], window, tat, rem, born, expires[i]) end
      out[len + 1], out[len + 2], len = tat - now, rem, len + 2
    end
    if marks then
      call('PSETEX', place, format('%d', keep), 'p:' .. table.concat(marks, ':'))
    end
  end
end

-- The makers of the algorithms' functions, by algorithm.
local makers = {make_sliding_log, make_sliding_counter, make_gcra}

-- Penalties: made by the first call of a limit with one.
local blocks, penalize
local function make_penalties()
  -- The ends of the blocks of a check's limits (policy `policy`, its block keys from KEYS[bk + 1])
  -- in `tills` (0: none or ended), and whether one has not ended; no limit has denied yet.
  blocks = function(bk, policy, tills)
    local b, j, blocked = policy[6], 0, false
    for i = 1, policy[2] do
      tills[i], denied[i] = 0, false
      if b[i] > 0 then
        j = j + 1
        local raw = call('GET', KEYS[bk + j])
        if raw and tonumber(raw) > now_us then tills[i], blocked = tonumber(raw), true end
      end
    end
    return blocked
  end

  -- The penalties of a denied check whose answer starts at out[start + 1]: a caller not blocked
  -- yet (`blocked` false) is blocked, from now, on each limit with a penalty that denied a cost;
  -- each limit that blocks it answers -1 and the time its block has left, and the check
  -- waits at least until the latest block ends.
  penalize = function(bk, policy, tills, blocked, cost, start)
    local b, j = policy[6], 0
    for i = 1, policy[2] do
      if b[i] > 0 then
        j = j + 1
        if not blocked and cost > 0 and denied[i] then
          tills[i] = now_us + b[i]
          call('SET', KEYS[bk + j], format('%d', tills[i]), 'PX',
            format('%d', ceil(b[i] / 1000) + 1))
        end
        if tills[i] > now_us then
          local left = tills[i] - now_us
          out[start + 1 + 2 * i], out[start + 2 + 2 * i] = -1, left
          if left > out[start + 2] then out[start + 2] = left end
        end
      end
    end
  end
end


-- whether the `c`-th check charged in an earlier run: this call's, or, sent before as the
-- `p`-th check of the call of record `j` for each 'j:p' of `where`, any of those calls'
local function replayed(c, where)
  if before and sub(before, c, c) == '1' then return true end
  if not where then return false end
  for j, p in gmatch(where, '(%d+):(%d+)') do
    j, p = tonumber(j), tonumber(p)
    if j > records then
      -- not a record of this call: names nothing
    elseif j == 1 then
      -- record 1 is this call's: an attempt sent twice in one call
      if charged[p] == '1' then return true end
    else
      local record = earlier[j]
      if record == nil then
        record = call('GET', KEYS[j])
        earlier[j] = record
      end
      if record and sub(record, p, p) == '1' then return true end
    end
  end
  return false
end

-- The policy whose arguments follow ARGV[a]: its algorithm, number of limits, quotas, windows
-- (µs), whether a reservation keeps a place (the sliding log names a reservation's entries by its
-- attempt: it keeps none), blocks (µs; 0: none), number of limits with a penalty, limits that
-- count calls (nil: none), the function of its common check where it has one (`ones`; else
-- false), and where a sliding counter's windows are placed in each call's time (else false). The
-- first policy of an algorithm makes the algorithm's functions, kept for every later call of the
-- library.
local function parse(a)
  local n, q, w, b, nb, calls = ARGV[a + 2] + 0, {}, {}, {}, 0, nil
  for i = 1, n do
    q[i], w[i], b[i] = tonumber(ARGV[a + 1 + 2 * i]), tonumber(ARGV[a + 2 + 2 * i]), 0
    if not q[i] then
      -- '<quota>c': a limit that counts calls
      q[i] = tonumber(match(ARGV[a + 1 + 2 * i], '^(%d+)c$'))
      calls = calls or {}
      calls[i] = true
    end
    if not w[i] then
      local window, block = match(ARGV[a + 2 + 2 * i], '^(%d+):(%d+)$')
      w[i], b[i], nb = tonumber(window), tonumber(block), nb + 1
    end
  end
  local algorithm = ARGV[a + 1] + 0
  if not algorithms[algorithm] and makers[algorithm] then makers[algorithm]() end
  local policy = {algorithm, n, q, w, algorithm ~= 1, b, nb, calls, false, false}
  if n == 1 and nb == 0 and not calls then policy[9] = ones[algorithm] or false end
  if algorithm == 2 then policy[10] = {} end
  return policy
end

-- Runs one call: `keys` and `argv` as KEYS and ARGV above.
local function run(keys, argv)
  call, KEYS, ARGV = redis.call, keys, argv
  if not format then
    format, match, sub, gmatch = string.format, string.match, string.sub, string.gmatch
    find, floor, ceil, min, max = string.find, math.floor, math.ceil, math.min, math.max
    tonumber = _G.tonumber
  end
  local t = call('TIME')
  now_us = t[1] * 1000000 + t[2]
  -- milliseconds keep quota * window exact in a double for windows of years (exact: now_us is an
  -- integer below 2^53, so its quotient by 1000 is never rounded up to the next integer)
  now_ms = floor(now_us / 1000)
  out, len, hold = {}, 0, 0
  -- The call's policies, read first (see `parse`), each by its text: a policy of one limit is
  -- '<algorithm> <quota> <window>', of n others '<algorithm> <n> <quota> <window> ...'. `logs`:
  -- whether a policy of the call is a sliding log; `penalties`: whether a limit of the call has
  -- one. A counter's windows are placed in the call's time.
  local policies, logs, penalties, a = {}, false, false, 4
  for p = 1, ARGV[4] + 0 do
    local text
    if ARGV[a + 2] == '1' then
      text = ARGV[a + 1] .. ' ' .. ARGV[a + 3] .. ' ' .. ARGV[a + 4]
    else
      text = ARGV[a + 1] .. ' ' .. ARGV[a + 2]
      for j = a + 3, a + 2 + 2 * ARGV[a + 2] do text = text .. ' ' .. ARGV[j] end
    end
    local policy = parsed[text]
    if not policy then
      if parsed_count >= 64 then parsed, parsed_count = {}, 0 end
      policy = parse(a)
      parsed[text], parsed_count = policy, parsed_count + 1
    end
    local algorithm, n = policy[1], policy[2]
    if algorithm == 1 then logs = true end
    if policy[7] > 0 then penalties = true end
    if algorithm == 2 then windows(policy[10], n, policy[4]) end
    policies[p == 1 and '1' or tostring(p)] = policy
    a = a + 2 + 2 * n
  end
  if logs then now_text, ms_texts = format('%d', now_us), {} end
  if penalties and not blocks then make_penalties() end

  local deadline = ARGV[1] + 0
  local late = now_us >= deadline
  local retain_ms = ARGV[3] + 0
  records, before, earlier, charged = ARGV[2] + 0, false, {}, {}
  if records > 0 and not late then before = call('GET', KEYS[1]) end
  local any = false

  local k, c, args = records, 0, #ARGV
  -- the costs read, by their text: a call's checks mostly cost the same
  local costs = {}
  -- per limit of the check being decided, the end of its block
  local tills = {}
  while a < args do
    local policy = policies[ARGV[a + 1]]
    local n, nb = policy[2], policy[7]
    local cost, attempt, where = costs[ARGV[a + 2]], ARGV[a + 3], nil
    if not cost then
      cost = tonumber(ARGV[a + 2])
      if cost then costs[ARGV[a + 2]] = cost end
    end
    -- a reservation keeps where its charge goes; a settlement of one reads it: the key follows the
    -- check's limit keys
    local settle, place = nil, nil
    hold = 0
    if not cost then
      local kind = sub(ARGV[a + 2], 1, 1)
      if kind == 'r' or kind == 'c' then
        local units, held = match(ARGV[a + 2], '^[rc](%d+)%+?(%d*)$')
        cost = tonumber(units)
        if held ~= '' and cost > 0 then hold = tonumber(held) end
        if kind == 'r' and policy[5] then place = KEYS[k + n + nb + 1] end
      else
        -- a settlement: what it settles, whether it may refund, and nothing to decide
        local reserved, actual, of = match(ARGV[a + 2], '^[sS](%d+):(%d+):(%x+)$')
        settle, cost = {tonumber(reserved), tonumber(actual), of, kind == 'S'}, 0
        if settle[4] and policy[5] then place = KEYS[k + n + nb + 1] end
      end
    end
    -- an attempt sent before carries where: '<attempt>@j:p', one '@j:p' per call
    if #attempt > 16 then attempt, where = sub(attempt, 1, 16), sub(attempt, 18) end
    local start = len
    local ok, err = true, nil
    c = c + 1
    charged[c] = '0'
    if late then
      out[len + 1], out[len + 2], len = -2, 0, len + 2
    else
      local counts = cost > 0 or settle ~= nil
      local replay = counts and (before or where) and replayed(c, where)
      local penalties = nb > 0 and not settle
      local blocked = false
      if penalties then
        ok, err = pcall(blocks, k + n, policy, tills)
        blocked = ok and err
      end
      if ok then
        if policy[9] and not settle and not place then
          ok, err = pcall(policy[9], k, policy, cost, attempt, replay)
        else
          ok, err = pcall(algorithms[policy[1]], k, policy, cost, attempt, replay, settle, place,
            blocked)
        end
      end
      if ok and penalties and out[start + 1] == 0 then
        ok, err = pcall(penalize, k + n, policy, tills, blocked, cost, start)
      end
      if ok and counts and out[start + 1] == 1 then
        charged[c], any = '1', true
      end
    end
    if not ok then
      -- this check's partial answer gives way to its error
      for j = len, start + 1, -1 do out[j] = nil end
      len = start
      if type(err) == 'table' then err = err.err end
      out[len + 1], out[len + 2], len = -1, tostring(err), len + 2
    end
    k, a = k + n + nb, a + 3
    if place then k = k + 1 end
  end
  if any and records > 0 then
    local record = table.concat(charged)
    if record ~= before then
      call('PSETEX', KEYS[1], format('%d', ceil((deadline - now_us) / 1000) + retain_ms), record)
    end
  end
  out[len + 1] = now_us
  return out
end

-- Redis 7 and later and Valkey keep this file as a library of functions (FUNCTION LOAD), made
-- once and kept by the server: the store puts the library's name line before it and
-- `local library_name = '<its name>'` at the start of its first line, and `run` is registered
-- under that name (FCALL runs it). Elsewhere it runs as a script (EVAL), once per call.
if redis.register_function then
  redis.register_function(library_name, run)
else
  return run(_G.KEYS, _G.ARGV)
end
