#!/usr/bin/env bash
# Instructions Redis executes per call of a reference beside `cost.sh`'s checks, counted the same
# way (`count.sh`: callgrind, a throwaway redis-server; 4,000 calls warm it up, the count covers
# 16,000 more):
#
#   fixed-window  tower-rate-limiter's script (INCR, PEXPIRE on the first, PTTL) by EVALSHA, one
#                 request of 10,000 random callers per call: what the peer a sliding counter is
#                 held against costs Redis per request
#   empty         FCALL of a function that returns at once, with the keys and arguments of a rate
#                 call of one check (2 keys, 11 arguments): the floor of a lone check's call
#   time          the same, calling TIME
#   get-psetex    the same, calling TIME, then GET of the caller's key and PSETEX of the record's
#
#   benches/lua/reference.sh fixed-window|empty|time|get-psetex
#
# Needs valgrind, redis-server, redis-cli and python3.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mode=${1:-fixed-window}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 "$here/calls.py" --reference "$mode" 4000 1 >"$work/warm.resp"
python3 "$here/calls.py" --reference "$mode" 16000 2 >"$work/measured.resp"
echo "$mode: $(bash "$here/count.sh" "$work/warm.resp" "$work/measured.resp" 16000) instructions per call"
