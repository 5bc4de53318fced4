#!/usr/bin/env bash
# Instructions a throwaway redis-server (port $PORT, default 6532) executes, counted by callgrind,
# for the commands of MEASURED (Redis' wire format) after those of WARM, per one of UNITS: the
# harness of `cost.sh` and `reference.sh`. Prints the number.
#
#   benches/lua/count.sh WARM MEASURED UNITS
#
# Needs valgrind, redis-server and redis-cli.
set -euo pipefail
warm=$1; measured=$2; units=$3
port=${PORT:-6532}
work=$(mktemp -d)
trap 'redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
valgrind --tool=callgrind --callgrind-out-file="$work/cg.%p" \
  redis-server --port "$port" --save '' --appendonly no >"$work/valgrind.log" 2>&1 &
server=$!
for _ in $(seq 100); do
  redis-cli -p "$port" ping 2>/dev/null | grep -q PONG && break
  sleep 0.2
done
redis-cli -p "$port" --pipe <"$warm" >/dev/null
callgrind_control -z "$server" >/dev/null 2>&1
redis-cli -p "$port" --pipe <"$measured" >"$work/pipe.log"
callgrind_control -d "$server" >/dev/null 2>&1
redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
wait "$server" || true
grep -q "errors: 0" "$work/pipe.log" || { cat "$work/pipe.log" >&2; exit 1; }
# the dump asked for above is part 1; the one at exit (part 2) holds the shutdown only
instructions=$(grep -h '^summary:' "$work"/cg.*.1 | awk '{print $2}')
echo $((instructions / units))
