-- Version 12: lines of waiters for room (RateStore::line_up, leave_line; as line.lua). A line
-- keeps its waiters as rows of permit_queue under the line's key (`<first limit key>:line`, a
-- name no concurrency limit's key takes): `arrived` when the waiter first lined up, `token` the
-- waiter (16 hex digits, which sort as its number), `expires_at` when its place lapses. The
-- purge deletes lapsed places with the rest of permit_queue. Functions only: copies of versions
-- 9 to 11 keep working on a schema of version 12.

-- line_up: keeps p_waiter's place in line p_key (or takes one at the end) until p_keep_ms from
-- now, once the lapsed places are gone; answers how many stand ahead of it; -1 received at or
-- after p_deadline_us, nothing done. Serialised with every other call on the line by the key's
-- advisory lock.
CREATE OR REPLACE FUNCTION __SCHEMA__.line_up(
  p_key text, p_waiter text, p_keep_ms bigint, p_deadline_us bigint
) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
  v_now bigint;
  v_arrived bigint;
  v_ahead bigint;
BEGIN
  PERFORM __SCHEMA__.lock_key(p_key);
  v_now := __SCHEMA__.now_us();
  IF v_now >= p_deadline_us THEN RETURN -1; END IF;
  DELETE FROM __SCHEMA__.permit_queue WHERE key = p_key AND expires_at <= v_now;
  INSERT INTO __SCHEMA__.permit_queue AS q (key, token, arrived, expires_at)
    VALUES (p_key, p_waiter, v_now, v_now + p_keep_ms * 1000)
    ON CONFLICT (key, token) DO UPDATE SET expires_at = EXCLUDED.expires_at
    RETURNING q.arrived INTO v_arrived;
  SELECT count(*) INTO v_ahead FROM __SCHEMA__.permit_queue
    WHERE key = p_key AND (arrived, token) < (v_arrived, p_waiter);
  RETURN v_ahead;
END $$;

-- leave_line: takes p_waiter out of line p_key (nothing when it is not in it).
CREATE OR REPLACE FUNCTION __SCHEMA__.leave_line(p_key text, p_waiter text) RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
  PERFORM __SCHEMA__.lock_key(p_key);
  DELETE FROM __SCHEMA__.permit_queue WHERE key = p_key AND token = p_waiter;
  RETURN 0;
END $$;
