#!/usr/bin/env bash
# Instructions Redis executes per rate check of `rate.lua`, counted by callgrind: repeatable for
# the same script and redis-server, whatever else the machine does. A throwaway redis-server on
# port $PORT (default 6532) runs under callgrind; 500 calls of $BATCH checks each (default 24;
# 10,000 random callers, one limit) warm it up, then the count covers 1,000 more calls. With
# BATCH=1 the figure is a whole call's: what a lone request costs Redis. Compare a change of the
# script with the one before it in one sitting: the figure includes Redis' own work (reading the
# call, GET and the write per check, the reply), as an HTTP request's check does.
#
#   [BATCH=n] benches/lua/cost.sh [gcra|counter|log] [SCRIPT]     (default: gcra, src/store/redis/scripts/rate.lua)
#
# Needs valgrind, redis-server, redis-cli and python3.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
algo=${1:-gcra}
script=${2:-$here/../../src/store/redis/scripts/rate.lua}
port=${PORT:-6532}
batch=${BATCH:-24}
work=$(mktemp -d)
trap 'redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
python3 "$here/calls.py" "$script" "$algo" 500 "$batch" >"$work/warm.resp"
python3 "$here/calls.py" "$script" "$algo" 1000 "$batch" >"$work/measured.resp"
valgrind --tool=callgrind --callgrind-out-file="$work/cg.%p" \
  redis-server --port "$port" --save '' --appendonly no >"$work/valgrind.log" 2>&1 &
server=$!
for _ in $(seq 100); do
  redis-cli -p "$port" ping 2>/dev/null | grep -q PONG && break
  sleep 0.2
done
redis-cli -p "$port" --pipe <"$work/warm.resp" >/dev/null
callgrind_control -z "$server" >/dev/null 2>&1
redis-cli -p "$port" --pipe <"$work/measured.resp" >"$work/pipe.log"
callgrind_control -d "$server" >/dev/null 2>&1
redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
wait "$server" || true
grep -q "errors: 0" "$work/pipe.log" || { cat "$work/pipe.log"; exit 1; }
# the dump asked for above is part 1; the one at exit (part 2) holds the shutdown only
instructions=$(grep -h '^summary:' "$work"/cg.*.1 | awk '{print $2}')
echo "$algo $(basename "$script"): $((instructions / (1000 * batch))) instructions per check"
