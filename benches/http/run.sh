#!/usr/bin/env bash
# HTTP throughput of tollgate's RateLimitLayer beside the hand-written baseline `limited` and the
# Rust peers, every server behind one Redis-backed limiter keyed by x-api-key (see README.md).
#
# usage: ./run.sh [LABEL=COMMAND ...]
#   Each optional LABEL=COMMAND adds a further server under test (appended to every round).
#   COMMAND is run through `env`-style word splitting (e.g. 'FOO=1 /path/to/bin --flag') with
#   PORT and REDIS_URL exported; it must serve GET /healthz and GET /api/hello on
#   127.0.0.1:$PORT. Examples:
#     ./run.sh 'gcra_alive=ALGO=gcra QUOTA=65535 WINDOW_S=65535 target/release/tollgate'
#     ./run.sh 'gcra1ms=GCRA_EMISSION_MS=1 target/release/trl_redis'
# servers (default: all but plain, tollgate_concurrency and tollgate_settle): limited trl_redis
#            trl tollgate_gcra tollgate_counter tollgate_log app plain tollgate_concurrency
#            tollgate_settle
# env knobs: ROUNDS=3 DUR=8s WARM=2s CONNS=50 THREADS=1 BUILD=1 (0 skips cargo builds)
#            QUIET_PCT=10 QUIET_MAX_WAIT=900 OTHER_MAX=0.4 (1.2 with DELAY_MS) TRIES=6
#            (foreign-load guard, below)
#            REDIS_PORT / APP_PORT (default: first free port from 6431 / 3131)
#            ONLY="limited plain" (restrict to these labels; extras always run)
#            CALLERS=random (10,000 random x-api-key callers) | hot (one caller, never denied:
#            every limit is raised to hold it)
#            DELAY_MS=1 (the servers reach Redis through delay/, a proxy adding that many ms to
#            every chunk each way; 0 is the proxy alone; unset: no proxy). At a distance wrk needs
#            more connections to keep the servers busy: CONNS=256 is a fair start.
# Output: raw/<UTC timestamp>/{runs.csv,summary.md,wrk_*.txt,cmdstats_*.txt,*.log};
#         summary.md is also printed. Nothing but 127.0.0.1 is contacted.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
cd "$HERE"
REPO="$(cd "$HERE/../.." && pwd)"               # the tollgate repository
export CARGO_TARGET_DIR="$HERE/target"          # this workspace's own target/, whatever the caller set
T="$CARGO_TARGET_DIR/release"
APP_BIN="$REPO/target/release/examples/app"     # the repository's example app, built in its target/
# the app accepts only the API keys of APP_API_KEYS: the callers of rand_key.lua ("1".."10000") and
# hot.lua ("hot"), each a tenant of its own (117 KB, under Linux's 128 KiB for one variable)
export APP_API_KEYS="$(seq 10000 | sed 's/.*/&:&:b/' | paste -sd, -),hot:hot:b"
# CALLERS=random (default): 10,000 random callers; CALLERS=hot: one caller for every request
CALLERS=${CALLERS:-random}
case "$CALLERS" in
  random) LUA="$HERE/rand_key.lua" ;;
  hot) LUA="$HERE/hot.lua" ;;
  *) echo "CALLERS=$CALLERS: expected random or hot"; exit 2 ;;
esac
ROUNDS=${ROUNDS:-3}; DUR=${DUR:-8s}; WARM=${WARM:-2s}; CONNS=${CONNS:-50}; THREADS=${THREADS:-1}
BUILD=${BUILD:-1}; ONLY=${ONLY:-}; DELAY_MS=${DELAY_MS:-}
for tool in wrk redis-server redis-cli curl bc ss python3; do
  command -v "$tool" >/dev/null || { echo "needs $tool on PATH (apt-get install -y wrk redis-server)"; exit 2; }
done

free_port() { local p=$1; while ss -Hltn "sport = :$p" | grep -q .; do p=$((p + 1)); done; echo "$p"; }
REDIS_PORT=${REDIS_PORT:-$(free_port 6431)}
APP_PORT=${APP_PORT:-$(free_port 3131)}
[ "$APP_PORT" = "$REDIS_PORT" ] && APP_PORT=$(free_port $((APP_PORT + 1)))
OUT="$HERE/raw/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$OUT"

# ---------------------------------------------------------------- build
TRL_NOTE=""
build() { # log-name command...: the last line of cargo's output, or its tail and exit on failure
  local log="$OUT/build_$1.log"; shift
  if "$@" >"$log" 2>&1; then tail -1 "$log"; else tail -20 "$log"; echo "!! build failed: $*"; exit 1; fi
}
if [ "$BUILD" = 1 ]; then
  echo "== building baseline (limited), peers, tollgate server (this workspace)"
  build baseline cargo build --release -p bench-baseline
  build peers cargo build --release -p peer-plain -p peer-trl-redis
  # tower-rate-limiter (and its dep http-extract) declare rust-version 1.96.0 in every
  # published version; cargo refuses on 1.95 unless the MSRV gate is skipped.
  if cargo build --release -p peer-trl 2>"$OUT/build_trl.log"; then
    TRL_NOTE="tower-rate-limiter built without --ignore-rust-version"
  elif cargo build --release -p peer-trl --ignore-rust-version 2>>"$OUT/build_trl.log"; then
    TRL_NOTE="tower-rate-limiter needed --ignore-rust-version (declares rust-version 1.96.0)"
  else
    TRL_NOTE="tower-rate-limiter did not build (see build_trl.log)"
  fi
  echo "== $TRL_NOTE"
  build tollgate cargo build --release -p bench-tollgate
  build delay cargo build --release -p bench-delay
  echo "== building the example app (cargo build --release --example app in $REPO)"
  (cd "$REPO" && build app env -u CARGO_TARGET_DIR cargo build --release --example app)
fi

# ---------------------------------------------------------------- servers under test
# Every limit is far above what wrk's 10,000 random callers send, so nothing is denied.
LABELS=(limited trl_redis trl tollgate_gcra tollgate_counter tollgate_log tollgate_lease app app_lease)
declare -A CMD=(
  [limited]="LIMITER=log $T/limited"
  [trl_redis]="$T/trl_redis"
  [trl]="$T/trl"
  [tollgate_gcra]="ALGO=gcra QUOTA=65535 WINDOW_S=65535 $T/tollgate"
  [tollgate_counter]="ALGO=counter $T/tollgate"
  [tollgate_log]="ALGO=log $T/tollgate"
  [tollgate_concurrency]="ALGO=concurrency $T/tollgate"
  [tollgate_settle]="ALGO=gcra QUOTA=65535 WINDOW_S=65535 SETTLE=1 $T/tollgate"
  # the sliding log caps a quota at 100,000 (the baseline's is 1e9 per 60 s)
  [app]="APP_ALGORITHM=sliding-log APP_LIMITS=minute:100000/60s $APP_BIN"
  # leased (Limit::leased): GCRA, 5e7 per 60 s, callers decided from slices once warm
  [tollgate_lease]="ALGO=gcra LEASE=1 $T/tollgate"
  [app_lease]="APP_ALGORITHM=gcra APP_LIMITS=minute:50000000/60s APP_LEASE=on $APP_BIN"
  [plain]="$T/plain"
)
if [ "$CALLERS" = hot ]; then
  # one caller at tens of thousands a second: every limit raised so that none denies it
  # tower-rate-limit-redis cannot hold one caller above 1,000/s (its emission interval is at
  # least 1 ms, its burst at most 65,535): it would deny, so it is left out of this run
  CMD[trl_redis]=""
  CMD[tollgate_gcra]="ALGO=gcra $T/tollgate"
  CMD[tollgate_log]="ALGO=log QUOTA=100000 WINDOW_S=1 $T/tollgate"
  CMD[app]="APP_ALGORITHM=gcra APP_LIMITS=minute:50000000/60s $APP_BIN"
fi
if [ -n "$ONLY" ]; then LABELS=($ONLY); fi
KEEP=()
for l in "${LABELS[@]}"; do  # drop servers whose binary is missing (e.g. failed build)
  [ -n "${CMD[$l]:-}" ] || { echo "!! $l: unknown or left out here (known: ${!CMD[*]})"; continue; }
  b=${CMD[$l]##* }
  if [ -x "$b" ]; then KEEP+=("$l"); else echo "!! $l: $b missing, skipped"; fi
done
LABELS=("${KEEP[@]}")
for x in "$@"; do
  l=${x%%=*}; c=${x#*=}
  [ -n "$l" ] && [ "$l" != "$x" ] || { echo "bad extra '$x' (want LABEL=COMMAND)"; exit 2; }
  CMD[$l]=$c; LABELS+=("$l")
done

# ---------------------------------------------------------------- redis
# only our own children, by pid; each pid is cleared as soon as it has been reaped
RPID=""; SPID=""; PPID_DELAY=""
stop() { if [ -n "$1" ]; then kill "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; fi; }
cleanup() { stop "$SPID"; SPID=""; stop "$PPID_DELAY"; PPID_DELAY=""; stop "$RPID"; RPID=""; }
trap cleanup EXIT INT TERM
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no --daemonize no \
  >"$OUT/redis.log" 2>&1 &
RPID=$!
R="redis-cli -h 127.0.0.1 -p $REDIS_PORT"
for i in $(seq 50); do $R ping >/dev/null 2>&1 && break; sleep 0.1; done
export REDIS_URL="redis://127.0.0.1:$REDIS_PORT/"
if [ -n "$DELAY_MS" ]; then
  # the servers reach Redis through the proxy; this script's own redis-cli calls do not
  PROXY_PORT=$(free_port $((REDIS_PORT + 100)))
  LISTEN="127.0.0.1:$PROXY_PORT" UPSTREAM="127.0.0.1:$REDIS_PORT" DELAY_MS="$DELAY_MS" \
    "$T/delay" >"$OUT/delay.log" 2>&1 &
  PPID_DELAY=$!
  for i in $(seq 50); do redis-cli -h 127.0.0.1 -p "$PROXY_PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
  export REDIS_URL="redis://127.0.0.1:$PROXY_PORT/"
fi

{
  echo "date_utc=$(date -u +%FT%TZ) host_cpus=$(nproc) callers=$CALLERS rounds=$ROUNDS dur=$DUR warm=$WARM conns=$CONNS threads=$THREADS delay_ms=${DELAY_MS:-none}"
  echo "redis_port=$REDIS_PORT app_port=$APP_PORT $(redis-server --version)"
  echo "$(rustc --version); $(wrk -v 2>&1 | head -1)"
  echo "$TRL_NOTE"
  echo "tollgate repo: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')$( [ -n "$(git -C "$REPO" status --porcelain -- src Cargo.toml Cargo.lock examples 2>/dev/null)" ] && echo ' (src/Cargo/examples modified)')"
  for l in "${LABELS[@]}"; do echo "cmd[$l]=${CMD[$l]}"; done
} | tee "$OUT/meta.txt"

ticks() { awk '{print $14+$15}' "/proc/$1/stat"; }          # utime+stime, clock ticks
busy() { awk '/^cpu /{print $2+$3+$4+$7+$8+$9}' /proc/stat; } # all CPUs, non-idle ticks
HZ=$(getconf CLK_TCK)
# Other work on this shared 2-core box (e.g. another session's tests) skews results. Before
# each measured run wait (up to QUIET_MAX_WAIT s) until the box is under QUIET_PCT % busy over
# 1 s; after it, if CPU used by anything but server+redis+wrk exceeded OTHER_MAX s, the run is
# logged to discarded.csv and repeated (up to TRIES times; the last try is kept regardless).
# Through the delay proxy the programs' own loopback traffic costs up to a second of a run in
# kernel time that no process is charged with (interrupts): the bound is higher there.
OTHER_DEFAULT=0.4; [ -z "$DELAY_MS" ] || OTHER_DEFAULT=1.2
QUIET_PCT=${QUIET_PCT:-10}; QUIET_MAX_WAIT=${QUIET_MAX_WAIT:-900}; OTHER_MAX=${OTHER_MAX:-$OTHER_DEFAULT}; TRIES=${TRIES:-6}
busy_pct_1s() {
  local a b; a=$(awk '/^cpu /{print $2+$3+$4+$7+$8+$9, $2+$3+$4+$5+$6+$7+$8+$9}' /proc/stat); sleep 1
  b=$(awk '/^cpu /{print $2+$3+$4+$7+$8+$9, $2+$3+$4+$5+$6+$7+$8+$9}' /proc/stat)
  echo "$a $b" | awk '{d=$4-$2; print (d>0)?int(100*($3-$1)/d):0}'
}
wait_quiet() { local t=0; while [ "$(busy_pct_1s)" -ge "$QUIET_PCT" ] && [ $t -lt "$QUIET_MAX_WAIT" ]; do t=$((t + 1)); done; echo $t; }

HDR="label,round,rps,p50,p99,non2xx,sock_err,requests,server_cpu_s,redis_cpu_s,wrk_cpu_s,other_cpu_s,redis_cmds,evalsha,load1,waited_s,try,proxy_cpu_s"
echo "$HDR" >"$OUT/runs.csv"; echo "$HDR" >"$OUT/discarded.csv"
run_one() { # label round
  local label=$1 round=$2 pid
  $R flushall >/dev/null
  env PORT="$APP_PORT" ${CMD[$label]} >"$OUT/server_${label}_r${round}.log" 2>&1 &
  pid=$!; SPID=$pid
  local ok=""
  for i in $(seq 100); do
    if curl -fs -o /dev/null "http://127.0.0.1:$APP_PORT/healthz"; then ok=1; break; fi
    kill -0 "$pid" 2>/dev/null || break; sleep 0.1
  done
  if [ -z "$ok" ]; then echo "!! $label did not come up"; stop "$pid"; SPID=""; return; fi
  wrk -t"$THREADS" -c"$CONNS" -d"$WARM" -s "$LUA" "http://127.0.0.1:$APP_PORT/api/hello" >/dev/null
  local try line waited
  for try in $(seq 1 "$TRIES"); do
    waited=$(wait_quiet)
    $R flushall >/dev/null
    $R config resetstat >/dev/null
    local load1; load1=$(cut -d' ' -f1 /proc/loadavg)
    local s0 r0 b0 s1 r1 b1 wt
    local W="$OUT/wrk_${label}_r${round}.txt" C="$OUT/cmdstats_${label}_r${round}.txt"
    local p0=0 p1=0
    [ -z "$PPID_DELAY" ] || p0=$(ticks "$PPID_DELAY")
    s0=$(ticks "$pid"); r0=$(ticks "$RPID"); b0=$(busy)
    local TIMEFORMAT='%U %S'
    wt=$( { time wrk -t"$THREADS" -c"$CONNS" -d"$DUR" --latency -s "$LUA" \
            "http://127.0.0.1:$APP_PORT/api/hello" >"$W"; } 2>&1 )
    s1=$(ticks "$pid"); r1=$(ticks "$RPID"); b1=$(busy)
    [ -z "$PPID_DELAY" ] || p1=$(ticks "$PPID_DELAY")
    $R info commandstats >"$C"
    local rps p50 p99 non2xx serr reqs cmds evsha
    rps=$(awk '/Requests\/sec/{print $2}' "$W")
    p50=$(awk '$1=="50%"{print $2}' "$W"); p99=$(awk '$1=="99%"{print $2}' "$W")
    non2xx=$(awk '/Non-2xx/{print $NF}' "$W"); non2xx=${non2xx:-0}
    serr=$(awk '/Socket errors/{gsub(",","");print $4+$6+$8+$10}' "$W"); serr=${serr:-0}
    reqs=$(awk '/requests in/{print $1}' "$W")
    # redis_cmds: all commandstats calls except INFO/CONFIG/FLUSHALL; Redis 7 also counts the
    # commands a script runs, so this includes the calls made inside Lua. evalsha: EVALSHA+EVAL.
    cmds=$(tr -d '\r' <"$C" | awk -F'[:=,]' '/^cmdstat_/ && $1!~/info|config|flushall/{s+=$3} END{print s+0}')
    evsha=$(tr -d '\r' <"$C" | awk -F'[:=,]' '/^cmdstat_eval/{s+=$3} END{print s+0}')
    local scpu rcpu wcpu ocpu
    scpu=$(echo "scale=2;($s1-$s0)/$HZ" | bc); rcpu=$(echo "scale=2;($r1-$r0)/$HZ" | bc)
    wcpu=$(echo "$wt" | awk '{printf "%.2f", $1+$2}')
    local pcpu; pcpu=$(echo "scale=2;($p1-$p0)/$HZ" | bc)
    ocpu=$(echo "scale=2;($b1-$b0)/$HZ-$scpu-$rcpu-$wcpu-$pcpu" | bc)
    line="$label,$round,$rps,$p50,$p99,$non2xx,$serr,$reqs,$scpu,$rcpu,$wcpu,$ocpu,$cmds,$evsha,$load1,$waited,$try,$pcpu"
    if [ "$try" -lt "$TRIES" ] && [ "$(echo "$ocpu > $OTHER_MAX" | bc)" = 1 ]; then
      echo "   (discarded, other_cpu_s=$ocpu) $line"; echo "$line" >>"$OUT/discarded.csv"
      cat "$W" >>"$OUT/discarded_wrk.txt"; continue
    fi
    break
  done
  stop "$pid"; SPID=""
  echo "$line" | tee -a "$OUT/runs.csv"
}

for round in $(seq 1 "$ROUNDS"); do
  for l in "${LABELS[@]}"; do run_one "$l" "$round"; done
done

python3 "$HERE/summarize.py" "$OUT/runs.csv" | tee "$OUT/summary.md"
echo "raw: $OUT"
