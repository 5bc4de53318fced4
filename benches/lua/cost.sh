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
# Needs valgrind, redis-server, redis-cli and python3 (the harness: count.sh).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
algo=${1:-gcra}
script=${2:-$here/../../src/store/redis/scripts/rate.lua}
batch=${BATCH:-24}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 "$here/calls.py" "$script" "$algo" 500 "$batch" >"$work/warm.resp"
python3 "$here/calls.py" "$script" "$algo" 1000 "$batch" >"$work/measured.resp"
per_check=$(bash "$here/count.sh" "$work/warm.resp" "$work/measured.resp" $((1000 * batch)))
echo "$algo $(basename "$script"): $per_check instructions per check"
