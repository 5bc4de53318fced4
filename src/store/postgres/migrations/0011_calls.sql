-- Version 11: limits that count calls (Limit::counting_calls). Such a limit is sent with its
-- quota negated (p_quotas[i] = -quota): a check of any cost above 0 charges it 1 (a look,
-- nothing), and a settlement never changes it; every other limit is charged the cost, as
-- before. Only the functions that read a policy's limits one by one change (check_rate,
-- rate_look, rate_sliding_log, rate_sliding_counter, rate_gcra, settle_rate): each limit's step
-- gets abs(quota) and limit_cost(quota, cost), the steps themselves stay as the base has them.
-- Same signatures, same answers for positive quotas: copies of versions 9 and 10 keep working.
-- This file replaces functions of the base, so it runs after the base at every migration.

-- What a check of p_cost charges a limit sent with quota p_quota: the cost, or, for a limit
-- that counts calls (p_quota < 0), 1 (0 for a look).
CREATE OR REPLACE FUNCTION __SCHEMA__.limit_cost(p_quota bigint, p_cost bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
  SELECT CASE WHEN p_quota < 0 THEN least(p_cost, 1) ELSE p_cost END
$$;

CREATE OR REPLACE FUNCTION __SCHEMA__.check_rate(
  p_algorithm smallint, p_keys text[], p_quotas bigint[], p_windows bigint[],
  p_cost bigint, p_attempt bigint, p_reservation boolean, p_hold bigint,
  p_retention_us bigint, p_deadline_us bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  v_hold bigint := 0;
  v_key text := p_keys[1];
  v_n int := cardinality(p_keys);
  r_a bigint;
  r_b bigint;
  r_c bigint;
  r_born bigint;
  r_recent bigint[];
  r_until bigint[];
  r_expires bigint;
  v_now bigint;
  v_cost bigint := p_cost;
  v_replay boolean := false;
  v_reply bigint[];
  v_log record;
  v_place bigint[];
  v_place_until bigint := 0;
  v_index bigint;
BEGIN
  -- late already: not even a placeholder row is made
  IF __SCHEMA__.now_us() >= p_deadline_us THEN RETURN ARRAY[-2, 0]; END IF;
  IF v_n <> 1 THEN PERFORM __SCHEMA__.lock_rate_rows(p_keys); END IF;
  -- The first limit's row, read once. One limit (the common policy): its row is locked by
  -- reading it (made first if missing; holding no other row, this cannot deadlock).
  LOOP
    SELECT l.a, l.b, l.c, l.born, l.recent, l.recent_until, l.expires_at
      INTO r_a, r_b, r_c, r_born, r_recent, r_until, r_expires
      FROM __SCHEMA__.rate_limits AS l WHERE l.key = v_key FOR UPDATE;
    EXIT WHEN FOUND;
    -- missing, or deleted (purged, reset) before it could be locked: made, then locked
    INSERT INTO __SCHEMA__.rate_limits (key) VALUES (v_key) ON CONFLICT DO NOTHING;
  END LOOP;
  v_now := __SCHEMA__.now_us();
  IF v_now >= p_deadline_us THEN RETURN ARRAY[-2, 0]; END IF;
  IF p_cost > 0 THEN
    -- an expired row remembers nothing, as an expired Redis key holds nothing
    IF r_expires <= v_now THEN r_recent := '{}'; r_until := '{}'; END IF;
    v_replay := __SCHEMA__.remembered(v_key, p_attempt, v_now, r_recent, r_until);
    -- a replay looks: the limits as they stand
    IF v_replay THEN v_cost := 0; END IF;
  END IF;
  IF v_cost > 0 THEN v_hold := greatest(coalesce(p_hold, 0), 0); END IF;
  IF v_n <> 1 THEN
    IF p_algorithm = 1 THEN
      v_reply := __SCHEMA__.rate_sliding_log(p_keys, p_quotas, p_windows, v_cost, p_attempt,
        v_now, v_hold);
    ELSIF p_algorithm = 2 THEN
      -- a sliding counter ignores the hold
      v_reply := __SCHEMA__.rate_sliding_counter(p_keys, p_quotas, p_windows, v_cost,
        p_attempt, v_now, p_deadline_us);
    ELSE
      v_reply := __SCHEMA__.rate_gcra(p_keys, p_quotas, p_windows, v_cost, p_attempt, v_now,
        p_deadline_us, v_hold);
    END IF;
  ELSIF p_algorithm = 1 THEN
    v_log := __SCHEMA__.rate_log_step(v_key, r_a, r_expires, abs(p_quotas[1]), p_windows[1],
      __SCHEMA__.limit_cost(p_quotas[1], v_cost), p_attempt, v_now, false, true, v_hold);
    v_reply := ARRAY[CASE WHEN v_log.o_admitted THEN 1 ELSE 0 END, v_log.o_retry,
      v_log.o_remaining, v_log.o_reset];
  ELSIF p_algorithm = 2 THEN
    v_reply := __SCHEMA__.rate_counter_step(v_key, r_a, r_b, r_c, r_expires > v_now,
      abs(p_quotas[1]), p_windows[1], __SCHEMA__.limit_cost(p_quotas[1], v_cost), v_now, true,
      r_born, p_attempt);
  ELSE
    v_reply := __SCHEMA__.rate_gcra_step(v_key, r_a, r_b, r_expires > v_now, abs(p_quotas[1]),
      p_windows[1], __SCHEMA__.limit_cost(p_quotas[1], v_cost), v_now, true, r_born, p_attempt,
      v_hold);
  END IF;
  IF v_replay THEN
    RETURN ARRAY[1, 0, v_now] || v_reply[3:2 + 2 * v_n];
  END IF;
  -- charged: remembered, with a reservation's place
  IF v_reply[1] = 1 AND p_cost > 0 THEN
    IF p_reservation AND p_algorithm = 2 THEN
      v_place := '{}';
      FOR i IN 1..v_n LOOP
        v_index := __SCHEMA__.counter_window(v_now, p_windows[i]);
        IF v_n = 1 THEN
          v_place := ARRAY[v_index, v_reply[5]];
        ELSE
          SELECT v_place || ARRAY[v_index, l.born] INTO v_place
            FROM __SCHEMA__.rate_limits AS l WHERE l.key = p_keys[i];
        END IF;
        v_place_until := greatest(v_place_until, (v_index + 2) * p_windows[i]);
      END LOOP;
    ELSIF p_reservation AND p_algorithm = 3 THEN
      IF v_n = 1 THEN
        v_place := v_reply[5:7];
      ELSE
        v_place := '{}';
        FOR i IN 1..v_n LOOP
          SELECT v_place || ARRAY[l.a, l.b, l.born] INTO v_place
            FROM __SCHEMA__.rate_limits AS l WHERE l.key = p_keys[i];
        END LOOP;
      END IF;
      FOR i IN 1..v_n LOOP
        v_place_until := greatest(v_place_until, v_place[3 * i - 2]);
      END LOOP;
    END IF;
    PERFORM __SCHEMA__.remember_attempt(v_key, p_attempt, p_deadline_us + p_retention_us,
      v_place, v_place_until);
  END IF;
  RETURN v_reply[1:2] || v_now || v_reply[3:2 + 2 * v_n];
END $$;

CREATE OR REPLACE FUNCTION __SCHEMA__.rate_look(
  p_algorithm smallint, p_keys text[], p_quotas bigint[], p_windows bigint[], p_cost bigint,
  p_attempt bigint, p_now bigint, p_hold bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  v_replay boolean := false;
  v_retry bigint := 0;
  v_limits bigint[] := '{}';
  v_row __SCHEMA__.rate_limits;
  v_log record;
  v_step bigint[];
BEGIN
  FOR i IN 1..cardinality(p_keys) LOOP
    SELECT * INTO v_row FROM __SCHEMA__.rate_limits WHERE key = p_keys[i];
    IF p_algorithm = 1 THEN
      v_log := __SCHEMA__.rate_log_step(p_keys[i], v_row.a, v_row.expires_at,
        abs(p_quotas[i]), p_windows[i], __SCHEMA__.limit_cost(p_quotas[i], p_cost), p_attempt,
        p_now, v_replay, false, p_hold);
      v_replay := v_log.o_replay;
      v_step := ARRAY[CASE WHEN v_log.o_admitted THEN 1 ELSE 0 END, v_log.o_retry,
        v_log.o_remaining, v_log.o_reset];
    ELSIF p_algorithm = 2 THEN
      v_step := __SCHEMA__.rate_counter_step(p_keys[i], v_row.a, v_row.b, v_row.c,
        v_row.expires_at > p_now, abs(p_quotas[i]), p_windows[i],
        __SCHEMA__.limit_cost(p_quotas[i], p_cost), p_now, false, NULL, 0);
    ELSE
      v_step := __SCHEMA__.rate_gcra_step(p_keys[i], v_row.a, v_row.b,
        v_row.expires_at > p_now, abs(p_quotas[i]), p_windows[i],
        __SCHEMA__.limit_cost(p_quotas[i], p_cost), p_now, false, NULL, 0, p_hold);
    END IF;
    v_retry := greatest(v_retry, v_step[2]);
    v_limits := v_limits || ARRAY[1 - v_step[1], v_step[3], v_step[4]];
  END LOOP;
  RETURN ARRAY[CASE WHEN v_replay THEN 1 ELSE 0 END, v_retry] || v_limits;
END $$;

CREATE OR REPLACE FUNCTION __SCHEMA__.rate_sliding_log(
  p_keys text[], p_quotas bigint[], p_windows bigint[], p_cost bigint, p_attempt bigint,
  p_now bigint, p_hold bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  v_counts bigint[] := '{}';
  v_oldests bigint[] := '{}';
  v_limits bigint[] := '{}';
  v_admitted boolean := true;
  v_replay boolean := false;
  v_retry bigint := 0;
  v_row __SCHEMA__.rate_limits;
  v_step record;
BEGIN
  FOR i IN 1..cardinality(p_keys) LOOP
    SELECT * INTO v_row FROM __SCHEMA__.rate_limits WHERE key = p_keys[i];
    v_step := __SCHEMA__.rate_log_step(p_keys[i], v_row.a, v_row.expires_at,
      abs(p_quotas[i]), p_windows[i], __SCHEMA__.limit_cost(p_quotas[i], p_cost), p_attempt,
      p_now, v_replay, false, p_hold);
    v_counts[i] := v_step.o_count;
    v_oldests[i] := v_step.o_oldest;
    v_limits := v_limits || ARRAY[v_step.o_remaining, v_step.o_reset];
    v_replay := v_step.o_replay;
    v_admitted := v_admitted AND v_step.o_admitted;
    v_retry := greatest(v_retry, v_step.o_retry);
  END LOOP;
  IF v_replay THEN
    v_admitted := true;
    v_retry := 0;
  END IF;
  IF v_admitted AND p_cost > 0 THEN
    FOR i IN 1..cardinality(p_keys) LOOP
      v_step := __SCHEMA__.rate_log_charge(p_keys[i], v_counts[i], v_oldests[i],
        abs(p_quotas[i]), p_windows[i], __SCHEMA__.limit_cost(p_quotas[i], p_cost), p_attempt,
        p_now, p_hold);
      v_limits[2 * i - 1] := v_step.o_remaining;
      v_limits[2 * i] := v_step.o_reset;
    END LOOP;
  END IF;
  RETURN ARRAY[CASE WHEN v_admitted THEN 1 ELSE 0 END, v_retry] || v_limits;
END $$;

CREATE OR REPLACE FUNCTION __SCHEMA__.rate_sliding_counter(
  p_keys text[], p_quotas bigint[], p_windows bigint[], p_cost bigint, p_attempt bigint,
  p_now bigint, p_deadline bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  v_rows __SCHEMA__.rate_limits[] := '{}';
  v_limits bigint[] := '{}';
  v_admitted boolean := true;
  v_retry bigint := 0;
  v_row __SCHEMA__.rate_limits;
  v_step bigint[];
BEGIN
  FOR i IN 1..cardinality(p_keys) LOOP
    SELECT * INTO v_row FROM __SCHEMA__.rate_limits WHERE key = p_keys[i];
    v_step := __SCHEMA__.rate_counter_step(p_keys[i], v_row.a, v_row.b, v_row.c,
      v_row.expires_at > p_now, abs(p_quotas[i]), p_windows[i],
      __SCHEMA__.limit_cost(p_quotas[i], p_cost), p_now, false, NULL, 0);
    v_rows[i] := v_row;
    v_limits := v_limits || v_step[3:4];
    v_admitted := v_admitted AND v_step[1] = 1;
    v_retry := greatest(v_retry, v_step[2]);
  END LOOP;
  IF v_admitted AND p_cost > 0 THEN
    FOR i IN 1..cardinality(p_keys) LOOP
      v_row := v_rows[i];
      v_step := __SCHEMA__.rate_counter_step(p_keys[i], v_row.a, v_row.b, v_row.c,
        v_row.expires_at > p_now, abs(p_quotas[i]), p_windows[i],
        __SCHEMA__.limit_cost(p_quotas[i], p_cost), p_now, true, v_row.born, p_attempt);
      v_limits[2 * i - 1:2 * i] := v_step[3:4];
    END LOOP;
  END IF;
  RETURN ARRAY[CASE WHEN v_admitted THEN 1 ELSE 0 END, v_retry] || v_limits;
END $$;

CREATE OR REPLACE FUNCTION __SCHEMA__.rate_gcra(
  p_keys text[], p_quotas bigint[], p_windows bigint[], p_cost bigint, p_attempt bigint,
  p_now bigint, p_deadline bigint, p_hold bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  v_rows __SCHEMA__.rate_limits[] := '{}';
  v_limits bigint[] := '{}';
  v_admitted boolean := true;
  v_retry bigint := 0;
  v_row __SCHEMA__.rate_limits;
  v_step bigint[];
BEGIN
  FOR i IN 1..cardinality(p_keys) LOOP
    SELECT * INTO v_row FROM __SCHEMA__.rate_limits WHERE key = p_keys[i];
    v_step := __SCHEMA__.rate_gcra_step(p_keys[i], v_row.a, v_row.b, v_row.expires_at > p_now,
      abs(p_quotas[i]), p_windows[i], __SCHEMA__.limit_cost(p_quotas[i], p_cost), p_now, false,
      NULL, 0, p_hold);
    v_rows[i] := v_row;
    v_limits := v_limits || v_step[3:4];
    v_admitted := v_admitted AND v_step[1] = 1;
    v_retry := greatest(v_retry, v_step[2]);
  END LOOP;
  IF v_admitted AND p_cost > 0 THEN
    FOR i IN 1..cardinality(p_keys) LOOP
      v_row := v_rows[i];
      v_step := __SCHEMA__.rate_gcra_step(p_keys[i], v_row.a, v_row.b,
        v_row.expires_at > p_now, abs(p_quotas[i]), p_windows[i],
        __SCHEMA__.limit_cost(p_quotas[i], p_cost), p_now, true, v_row.born, p_attempt, p_hold);
      v_limits[2 * i - 1:2 * i] := v_step[3:4];
    END LOOP;
  END IF;
  RETURN ARRAY[CASE WHEN v_admitted THEN 1 ELSE 0 END, v_retry] || v_limits;
END $$;

CREATE OR REPLACE FUNCTION __SCHEMA__.settle_rate(
  p_algorithm smallint, p_keys text[], p_quotas bigint[], p_windows bigint[],
  p_reserved bigint, p_actual bigint, p_of bigint, p_refundable boolean, p_attempt bigint,
  p_retention_us bigint, p_deadline_us bigint
) RETURNS bigint[] LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint;
  v_row __SCHEMA__.rate_limits;
  v_replay boolean;
  v_delta bigint := p_actual - p_reserved;
  -- the numbers of a place per limit
  v_width int := CASE p_algorithm WHEN 2 THEN 2 WHEN 3 THEN 3 ELSE 0 END;
  v_place bigint[];
  v_limits bigint[] := '{}';
BEGIN
  IF __SCHEMA__.now_us() >= p_deadline_us THEN RETURN ARRAY[-2, 0]; END IF;
  PERFORM __SCHEMA__.lock_rate_rows(p_keys);
  v_now := __SCHEMA__.now_us();
  IF v_now >= p_deadline_us THEN RETURN ARRAY[-2, 0]; END IF;
  SELECT * INTO v_row FROM __SCHEMA__.rate_limits WHERE key = p_keys[1];
  -- an expired row remembers nothing
  IF v_row.expires_at <= v_now THEN v_row.recent := '{}'; v_row.recent_until := '{}'; END IF;
  v_replay := __SCHEMA__.remembered(p_keys[1], p_attempt, v_now, v_row.recent,
    v_row.recent_until);
  IF v_replay OR (v_delta < 0 AND NOT p_refundable) THEN
    v_delta := 0;
  ELSIF v_delta < 0 AND v_width > 0 THEN
    SELECT place INTO v_place FROM __SCHEMA__.rate_attempts
      WHERE key = p_keys[1] AND attempt = p_of AND expires_at > v_now AND place_until > v_now;
    -- a place kept for other limits than these places nothing, nor one of an earlier version
    -- (without the lives it charged)
    IF cardinality(v_place) <> v_width * cardinality(p_keys) THEN v_place := NULL; END IF;
  END IF;
  FOR i IN 1..cardinality(p_keys) LOOP
    SELECT * INTO v_row FROM __SCHEMA__.rate_limits WHERE key = p_keys[i];
    -- a limit that counts calls counted the call: the settlement leaves it
    v_limits := v_limits || __SCHEMA__.settle_limit(p_algorithm, v_row, abs(p_quotas[i]),
      p_windows[i], CASE WHEN p_quotas[i] < 0 THEN 0 ELSE v_delta END,
      v_place[v_width * (i - 1) + 1:v_width * i], p_of, p_attempt, v_now);
  END LOOP;
  IF NOT v_replay THEN
    UPDATE __SCHEMA__.rate_attempts SET place = NULL, place_until = 0
      WHERE key = p_keys[1] AND attempt = p_of AND place IS NOT NULL;
    PERFORM __SCHEMA__.remember_attempt(p_keys[1], p_attempt, p_deadline_us + p_retention_us,
      NULL, 0);
  END IF;
  RETURN ARRAY[1, 0, v_now] || v_limits;
END $$;
